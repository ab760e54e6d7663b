#include "optimizer/state_io.h"

#include <algorithm>
#include <memory>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "ckpt/base/checksum.h"
#include "ckpt/base/coding.h"
#include "ckpt/base/status_macros.h"
#include "ckpt/formats/convert.h"
#include "ckpt/formats/manifest.h"

namespace ckpt::optimizer::internal {
namespace {

using formats::DType;

// Weights rounded per block of a synchronous write (two blocks in memory: one rounded while the
// other is written), then whole chunks of the store: the spill must stay within a chunk + 16 MiB.
constexpr uint64_t kWeightBlockBytes = uint64_t{4} << 20;
// Elements converted per batch when a step's moment dtype differs from the slabs'.
constexpr uint64_t kConvertElems = uint64_t{1} << 20;

const std::byte* SlabOf(const StateBytes& from, Slab slab) {
  switch (slab) {
    case Slab::kMaster:
      return from.master;
    case Slab::kExpAvg:
      return from.exp_avg;
    case Slab::kExpAvgSq:
      return from.exp_avg_sq;
    case Slab::kMaxExpAvgSq:
      return from.max_exp_avg_sq;
    case Slab::kAux:
      return from.aux;
  }
  return nullptr;  // Unreachable: the switch names every slab.
}

std::byte* SlabOf(const MutableStateBytes& to, Slab slab) {
  switch (slab) {
    case Slab::kMaster:
      return to.master;
    case Slab::kExpAvg:
      return to.exp_avg;
    case Slab::kExpAvgSq:
      return to.exp_avg_sq;
    case Slab::kMaxExpAvgSq:
      return to.max_exp_avg_sq;
    case Slab::kAux:
      return to.aux;
  }
  return nullptr;  // Unreachable: the switch names every slab.
}

// Where state `s` of `run` lies: elements [tensor_begin, tensor_begin + count) of its tensor,
// from element `at` of its slab as the state bytes at hand begin (at `base`, a slab element;
// the aux slab at AuxStart(base)). An aux state goes whole with its parameter's one piece.
struct Place {
  uint64_t tensor_begin, count, at;
};
absl::StatusOr<Place> PlaceOf(const StateLayout& layout, const StateRun& run, const ParamState& s,
                              uint64_t base) {
  if (s.slab != Slab::kAux) return Place{run.tensor_begin, run.count, run.slab_offset - base};
  if (run.tensor_begin != 0 || run.count != layout.params()[run.param].numel()) {
    return absl::InternalError(absl::StrCat("state \"", s.name, "\" of a parameter kept whole is cut at [",
                                            run.tensor_begin, ", +", run.count, ")"));
  }
  uint64_t n = 1;
  for (uint64_t e : s.shape) n *= e;
  return Place{0, n, layout.AuxStart(run.slab_offset) - layout.AuxStart(base) + s.aux_offset};
}

}  // namespace

StateBytes SlabBytes(const StagedAdamW& opt, uint64_t begin) {
  const size_t m = opt.moment_bytes();
  return {reinterpret_cast<const std::byte*>(opt.master().data()) + 4 * begin,
          opt.exp_avg_bytes().data() + m * begin, opt.exp_avg_sq_bytes().data() + m * begin,
          opt.has_max_exp_avg_sq() ? opt.max_exp_avg_sq_bytes().data() + m * begin : nullptr,
          opt.aux().empty() ? nullptr
                            : reinterpret_cast<const std::byte*>(opt.aux().data()) +
                                  4 * opt.AuxStart(begin)};
}

absl::Status WriteState(SaveTransaction& txn, const StateLayout& layout, const StateBytes& slabs,
                        uint64_t chunk_bytes) {
  // Everything is queued (the slabs do not change during the call): the writer threads copy one
  // buffer of rounded weights while this thread rounds the next blocks into the other. A buffer
  // holds the blocks of as many runs as fit (many small tensors' weights then go to the store
  // together, not with a wait between every two); it is never resized while queued.
  // Every block below fits an empty buffer: at most max(kWeightBlockBytes, one chunk) bytes.
  const uint64_t capacity = std::max<uint64_t>({kWeightBlockBytes, chunk_bytes, 8});
  std::unique_ptr<std::byte[]> weights[2];
  uint64_t used[2] = {0, 0};
  uint64_t queued_as[2] = {0, 0};  // The ticket each buffer's last block was queued as.
  bool in_use[2] = {false, false};
  size_t next = 0;
  uint64_t ticket = 0;
  bool queued = false;
  // Whatever way this returns, no writer thread reads `weights` or the slabs afterwards.
  // Dropped: the error that ends the call early is already being returned.
  absl::Cleanup drain = [&] {
    if (queued) txn.stream().WaitCopied(ticket).IgnoreError();
  };
  for (const StateRun& run : layout.Runs()) {
    const DType model = layout.params()[run.param].dtype;
    const size_t wsize = formats::DTypeSize(model);
    const uint64_t chunk_elems = std::max<uint64_t>(1, chunk_bytes / wsize);
    const uint64_t block =
        chunk_elems * std::max<uint64_t>(1, kWeightBlockBytes / (chunk_elems * wsize));
    for (const ParamState& state : layout.states(run.param)) {
      const std::string& name = state.name;
      // F32 weights are the masters themselves; others are rounded a block at a time below.
      if (!state.weights || model == DType::kF32) {
        const size_t size = formats::DTypeSize(state.weights ? DType::kF32 : state.dtype);
        CKPT_ASSIGN_OR_RETURN(const Place at, PlaceOf(layout, run, state, 0));
        CKPT_ASSIGN_OR_RETURN(
            ticket, txn.stream().Queue(name, at.tensor_begin, at.count,
                                       {SlabOf(slabs, state.slab) + at.at * size, at.count * size}));
        queued = true;
        continue;
      }
      for (uint64_t done = 0; done < run.count; done += block) {
        const uint64_t n = std::min(block, run.count - done);
        if (used[next] + n * wsize > capacity) {
          next ^= 1;
          used[next] = 0;
          // Reusable once the writer threads copied it out (not yet written: the disk overlaps).
          if (in_use[next]) CKPT_RETURN_IF_ERROR(txn.stream().WaitCopied(queued_as[next]));
        }
        if (weights[next] == nullptr) {
          weights[next] = std::make_unique_for_overwrite<std::byte[]>(capacity);
        }
        const std::span<std::byte> out(weights[next].get() + used[next], n * wsize);
        formats::Convert(DType::kF32, {slabs.master + 4 * (run.slab_offset + done), 4 * n}, model,
                         out);
        CKPT_ASSIGN_OR_RETURN(ticket, txn.stream().Queue(name, run.tensor_begin + done, n, out));
        used[next] += n * wsize;
        queued_as[next] = ticket;
        in_use[next] = queued = true;
      }
    }
  }
  std::move(drain).Cancel();
  return queued ? txn.stream().WaitCopied(ticket) : absl::OkStatus();
}

absl::StatusOr<uint64_t> QueueState(SaveTransaction& txn, const StateLayout& layout,
                                    uint64_t begin, uint64_t count, const StateBytes& from,
                                    std::span<std::byte> weights) {
  uint64_t ticket = 0;
  size_t used = 0;  // Bytes of `weights` taken by the runs so far.
  for (const StateRun& run : layout.Runs(begin, count)) {
    const uint64_t at = run.slab_offset - begin;  // Into `from`.
    const DType model = layout.params()[run.param].dtype;
    // F32 weights are the masters themselves; others are rounded into `weights`.
    std::span<const std::byte> rounded(from.master + 4 * at, 4 * run.count);
    if (model != DType::kF32) {
      const std::span<std::byte> out =
          weights.subspan(used, run.count * formats::DTypeSize(model));
      formats::Convert(DType::kF32, rounded, model, out);
      rounded = out;
      used += out.size();
    }
    for (const ParamState& state : layout.states(run.param)) {
      if (state.weights) {
        CKPT_ASSIGN_OR_RETURN(ticket,
                              txn.stream().Queue(state.name, run.tensor_begin, run.count, rounded));
        continue;
      }
      const size_t size = formats::DTypeSize(state.dtype);
      CKPT_ASSIGN_OR_RETURN(const Place place, PlaceOf(layout, run, state, begin));
      CKPT_ASSIGN_OR_RETURN(
          ticket, txn.stream().Queue(state.name, place.tensor_begin, place.count,
                                     std::span<const std::byte>(
                                         SlabOf(from, state.slab) + place.at * size,
                                         place.count * size)));
    }
  }
  return ticket;
}

absl::Status ReadState(const CheckpointReader& reader, const StateLayout& layout,
                       const MutableStateBytes& to) {
  // Every range stored in the slabs' dtype is read in one ReadRanges: one pipeline of reads for
  // the whole state (a checkpoint of many small tensors is then read in large requests, not
  // one pipeline per tensor); the others are converted in bounded batches.
  std::vector<CheckpointReader::RangeRead> direct;
  std::vector<std::byte> batch;
  for (const StateRun& run : layout.Runs()) {
    for (const ParamState& state : layout.states(run.param)) {
      if (state.weights) continue;  // The masters rounded, written by the caller.
      const std::string& name = state.name;
      CKPT_ASSIGN_OR_RETURN(const formats::TensorInfo* info, reader.FindTensor(name));
      const DType want = state.dtype;
      const size_t size = formats::DTypeSize(want);
      CKPT_ASSIGN_OR_RETURN(const Place place, PlaceOf(layout, run, state, 0));
      std::span<std::byte> out(SlabOf(to, state.slab) + place.at * size, place.count * size);
      if (info->dtype == want) {
        direct.push_back({name, place.tensor_begin, place.count, out});
        continue;
      }
      const size_t in_size = formats::DTypeSize(info->dtype);
      for (uint64_t done = 0; done < place.count; done += kConvertElems) {
        const uint64_t n = std::min(kConvertElems, place.count - done);
        batch.resize(n * in_size);
        CKPT_RETURN_IF_ERROR(reader.ReadRange(name, place.tensor_begin + done, n, batch));
        formats::Convert(info->dtype, batch, want, out.subspan(done * size, n * size));
      }
    }
  }
  return reader.ReadRanges(direct);
}

uint64_t ManifestIdentity(const formats::Manifest& manifest) {
  return Checksum(AsBytes(formats::EncodeManifest(manifest)));
}

}  // namespace ckpt::optimizer::internal
