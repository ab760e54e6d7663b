#include "tests/support/synthetic_state.h"

#include <cstdio>
#include <cstring>
#include <fstream>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "ckpt/base/checksum.h"
#include "ckpt/base/coding.h"
#include "ckpt/base/status_macros.h"
#include "ckpt/verify.h"

namespace ckpt::testing {
namespace {

std::vector<uint16_t> BiasAt(uint64_t step) {
  std::vector<uint16_t> out(kBiasElems);
  for (uint64_t i = 0; i < kBiasElems; ++i) out[i] = static_cast<uint16_t>(step * 131 + i * 7);
  return out;
}

// Rank r of R holds elements [r * n / R, (r + 1) * n / R) of "w": ranges cut mid-tensor.
std::pair<uint64_t, uint64_t> RangeOf(int rank, int ranks) {
  uint64_t lo = kWeightElems * static_cast<uint64_t>(rank) / static_cast<uint64_t>(ranks);
  uint64_t hi = kWeightElems * static_cast<uint64_t>(rank + 1) / static_cast<uint64_t>(ranks);
  return {lo, hi};
}

absl::Status SaveRank(CheckpointStore* store, Coordinator* coordinator, uint64_t step) {
  const int rank = coordinator->rank();
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<SaveTransaction> txn, store->BeginSave(step, coordinator));
  std::vector<float> w = WeightsAt(step);
  auto [lo, hi] = RangeOf(rank, coordinator->size());
  absl::Status s = txn->DeclareTensor({"w", formats::DType::kF32, {kWeightElems}});
  if (s.ok() && hi > lo) {
    s = txn->WritePiece("w", lo, hi - lo, std::as_bytes(std::span(w).subspan(lo, hi - lo)));
  }
  if (s.ok() && rank == 0) {
    std::vector<uint16_t> b = BiasAt(step);
    s = txn->DeclareTensor({"b", formats::DType::kBF16, {kBiasElems}});
    if (s.ok()) s = txn->WritePiece("b", 0, kBiasElems, std::as_bytes(std::span(b)));
  }
  std::string blob = SchedulerBlobAt(step, rank);
  if (s.ok()) s = txn->WriteBlob("sched", std::as_bytes(std::span(blob)));
  // Commit even after a local failure: the vote must go round so the others abort too.
  absl::Status commit = txn->Commit();
  return s.ok() ? commit : s;
}

}  // namespace

std::vector<float> WeightsAt(uint64_t step) {
  std::vector<float> w(kWeightElems);
  for (uint64_t i = 0; i < kWeightElems; ++i)
    w[i] = static_cast<float>(step) * 1000.0f + static_cast<float>(i) * 0.25f;
  return w;
}

std::string SchedulerBlobAt(uint64_t step, int rank) {
  return absl::StrCat("scheduler state of rank ", rank, " at step ", step);
}

absl::Status SaveSyntheticStep(const std::string& root, const StoreOptions& options, int ranks,
                               uint64_t step) {
  std::vector<std::unique_ptr<CheckpointStore>> stores;
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointStore> primary,
                        CheckpointStore::Open(root, options));
  stores.push_back(std::move(primary));
  StoreOptions secondary = options;
  secondary.primary = false;
  for (int r = 1; r < ranks; ++r) {
    absl::StatusOr<std::unique_ptr<CheckpointStore>> s = CheckpointStore::Open(root, secondary);
    if (!s.ok()) return s.status();
    stores.push_back(std::move(s).value());
  }
  ThreadGroup group(ranks);
  std::vector<absl::Status> results(static_cast<size_t>(ranks));
  std::vector<std::thread> threads;
  for (int r = 1; r < ranks; ++r) {
    threads.emplace_back([&, r] { results[r] = SaveRank(stores[r].get(), group.member(r), step); });
  }
  results[0] = SaveRank(stores[0].get(), group.member(0), step);
  for (std::thread& t : threads) t.join();
  for (int r = 1; r < ranks; ++r) {
    if (results[r].ok() != results[0].ok()) {
      return absl::InternalError(absl::StrCat("rank ", r, " saw ", results[r].ToString(),
                                              " but rank 0 saw ", results[0].ToString()));
    }
  }
  return results[0];
}

absl::StatusOr<std::optional<uint64_t>> CheckStoreConsistent(const std::string& root,
                                                             const StoreOptions& options) {
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointStore> store,
                        CheckpointStore::Open(root, options));
  Env* env = store->env();
  CKPT_ASSIGN_OR_RETURN(std::vector<std::string> names, env->GetChildren(root));
  for (const std::string& name : names) {
    if (absl::StartsWith(name, "."))
      return absl::InternalError(absl::StrCat("garbage survived Open: ", name));
  }
  CKPT_ASSIGN_OR_RETURN(StoreVerifyReport report,
                        VerifyStore(env, root, std::nullopt, /*all=*/true));
  if (!report.ok()) {
    std::string why;
    for (const auto& p : report.problems) absl::StrAppend(&why, p.file, ": ", p.message, "; ");
    for (const auto& s : report.steps) {
      for (const auto& p : s.problems) absl::StrAppend(&why, p.file, ": ", p.message, "; ");
    }
    return absl::InternalError(absl::StrCat("verify failed: ", why));
  }
  std::optional<uint64_t> latest = store->latest_step();
  if (!latest.has_value()) return latest;
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> reader, store->OpenLatest());
  std::vector<float> w(kWeightElems);
  CKPT_RETURN_IF_ERROR(
      reader->ReadRange("w", 0, kWeightElems, std::as_writable_bytes(std::span(w))));
  if (w != WeightsAt(*latest))
    return absl::InternalError(absl::StrCat("w differs from step ", *latest));
  std::vector<uint16_t> b(kBiasElems);
  CKPT_RETURN_IF_ERROR(reader->ReadRange("b", 0, kBiasElems, std::as_writable_bytes(std::span(b))));
  if (b != BiasAt(*latest))
    return absl::InternalError(absl::StrCat("b differs from step ", *latest));
  for (uint32_t r = 0; r < reader->manifest().world_size; ++r) {
    CKPT_ASSIGN_OR_RETURN(std::string blob, reader->ReadBlob("sched", r));
    if (blob != SchedulerBlobAt(*latest, static_cast<int>(r)))
      return absl::InternalError("blob differs");
  }
  return latest;
}

absl::Status RewriteManifestVersion(const std::string& path, uint32_t version) {
  std::string m;
  {
    std::ifstream in(path, std::ios::binary);
    if (!in) return absl::NotFoundError(path);
    m.assign(std::istreambuf_iterator<char>(in), {});
  }
  if (m.size() < 32) return absl::DataLossError(absl::StrCat(path, ": too short"));
  std::string v;
  PutFixed32(&v, version);
  m.replace(8, 4, v);
  StreamingChecksum sum;
  sum.Update(AsBytes(absl::string_view(m).substr(0, 24)));
  sum.Update(AsBytes(absl::string_view(m).substr(32)));
  std::string digest;
  PutFixed64(&digest, sum.Digest());
  m.replace(24, 8, digest);
  std::remove(path.c_str());
  std::ofstream out(path, std::ios::binary);
  out << m;
  return out.good() ? absl::OkStatus() : absl::InternalError(absl::StrCat("write ", path));
}

}  // namespace ckpt::testing
