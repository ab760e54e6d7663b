#include "ckpt/optimizer/layout.h"

#include <algorithm>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "ckpt/base/status_macros.h"

namespace ckpt::optimizer {

uint64_t ParamSpec::numel() const {
  uint64_t n = 1;
  for (uint64_t d : shape) n *= d;
  return n;
}

absl::StatusOr<std::vector<Bucket>> BuildBuckets(const std::vector<ParamSpec>& params,
                                                 const BucketOptions& options, int dp_size) {
  if (dp_size < 1 || options.bucket_elems == 0 || options.pad_to == 0) {
    return absl::InvalidArgumentError(absl::StrCat("bad bucket layout: dp_size ", dp_size,
                                                   ", bucket_elems ", options.bucket_elems));
  }
  const uint64_t multiple = std::lcm(static_cast<uint64_t>(dp_size), options.pad_to);
  std::vector<Bucket> buckets;
  Bucket current;
  auto close = [&] {
    if (current.entries.empty()) return;
    current.padded_elems = (current.elems + multiple - 1) / multiple * multiple;
    buckets.push_back(std::move(current));
    current = Bucket();
  };
  for (size_t k = 0; k < params.size(); ++k) {
    const uint32_t i = static_cast<uint32_t>(options.reverse_order ? params.size() - 1 - k : k);
    current.entries.push_back({i, current.elems});
    current.elems += params[i].numel();
    if (current.elems >= options.bucket_elems) close();
  }
  close();
  return buckets;
}

std::vector<std::vector<Piece>> RankPieces(const std::vector<Bucket>& buckets, int dp_size) {
  std::vector<std::vector<Piece>> out(static_cast<size_t>(dp_size));
  for (const Bucket& b : buckets) {
    const uint64_t shard = b.padded_elems / static_cast<uint64_t>(dp_size);
    for (int r = 0; r < dp_size; ++r) {
      const uint64_t lo = shard * static_cast<uint64_t>(r), hi = lo + shard;
      for (size_t e = 0; e < b.entries.size(); ++e) {
        const uint64_t start = b.entries[e].offset;
        const uint64_t end = e + 1 < b.entries.size() ? b.entries[e + 1].offset : b.elems;
        const uint64_t a = std::max(lo, start), z = std::min(hi, end);
        if (a < z) out[static_cast<size_t>(r)].push_back({b.entries[e].param, a - start, z - a});
      }
    }
  }
  return out;
}

absl::StatusOr<std::vector<std::vector<Piece>>> RankPiecesKeepingWhole(
    const std::vector<ParamSpec>& params, const std::vector<bool>& whole,
    const BucketOptions& options, int dp_size) {
  if (whole.size() != params.size()) {
    return absl::InvalidArgumentError(absl::StrCat(whole.size(), " whole flags for ",
                                                   params.size(), " parameters"));
  }
  std::vector<ParamSpec> cut;
  std::vector<uint32_t> index_of_cut;  // Into `params`.
  for (uint32_t i = 0; i < params.size(); ++i) {
    if (!whole[i]) {
      cut.push_back(params[i]);
      index_of_cut.push_back(i);
    }
  }
  CKPT_ASSIGN_OR_RETURN(std::vector<Bucket> buckets, BuildBuckets(cut, options, dp_size));
  std::vector<std::vector<Piece>> out = RankPieces(buckets, dp_size);
  std::vector<uint64_t> load(out.size(), 0);
  for (size_t r = 0; r < out.size(); ++r) {
    for (Piece& p : out[r]) {
      p.param = index_of_cut[p.param];
      load[r] += p.count;
    }
  }
  std::vector<uint32_t> order;
  for (uint32_t i = 0; i < params.size(); ++i) {
    if (whole[i] && params[i].numel() > 0) order.push_back(i);  // Nothing to own of an empty one.
  }
  std::stable_sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) {
    return params[a].numel() > params[b].numel();
  });
  for (uint32_t i : order) {
    const size_t r = static_cast<size_t>(std::min_element(load.begin(), load.end()) - load.begin());
    out[r].push_back({i, 0, params[i].numel()});
    load[r] += params[i].numel();
  }
  return out;
}

}  // namespace ckpt::optimizer
