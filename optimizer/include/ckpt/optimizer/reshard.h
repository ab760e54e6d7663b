// Offline resharding (what `ckpt-tool reshard` runs): a committed step rewritten as the files
// that `dp` ranks of the next job would have saved, each rank's pieces laid out as
// StagedAdamW lays them out for that data-parallel size (Megatron buckets), so that each rank
// of the next job reads one file front to back. Streams chunk by chunk in bounded memory.
#ifndef CKPT_OPTIMIZER_RESHARD_H_
#define CKPT_OPTIMIZER_RESHARD_H_

#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/statusor.h"
#include "ckpt/checkpoint_reader.h"
#include "ckpt/options.h"
#include "ckpt/optimizer/layout.h"

namespace ckpt::optimizer {

// The output's ranks are threads of this process, at most this many.
inline constexpr int kMaxReshardRanks = 1024;

struct ReshardOptions {
  int dp = 1;  // Ranks of the output, from 1 to kMaxReshardRanks.
  // The buckets the next job's optimizer uses (BuildBuckets): who owns which piece.
  BucketOptions buckets;
  // The output store: env, chunk size, codec (zstd) and level, direct IO. `primary` and
  // `read_only` are ignored (reshard opens its own handles); retention is applied as usual.
  StoreOptions store;
  // Bytes read and written at a time, rounded down to whole chunks of the output (at least
  // one): with the reader's and the writer's buffers, the memory reshard holds.
  uint64_t buffer_bytes = uint64_t{32} << 20;
  // Called as data is written: bytes of tensor data written so far, and the total.
  std::function<void(uint64_t done, uint64_t total)> progress = nullptr;
};

struct ReshardReport {
  uint64_t step = 0;
  uint32_t source_world_size = 0;
  int dp = 0;
  uint64_t tensors = 0;
  uint64_t bytes = 0;  // Tensor data written (and read).
  bool optimizer_layout = false;  // The step was a Checkpointer's (parameters from its record).
};

// Writes the step `source` holds into the store at `dst_root` as the same step, committed as
// one transaction. An existing root gets the step through the store's commit protocol: a crash
// or an error leaves its steps and LATEST as they were. A new root (absent, or an empty
// directory) is built under a hidden sibling name and renamed into place once committed, so a
// failure leaves nothing there. `dst_root` must not be or lie inside the source's root.
// The parameters and their order come from the step's optimizer record (Checkpointer steps: a
// parameter's weights, masters and moments share its pieces, and every rank's record says
// world size `dp`); a step without one treats each tensor as a parameter, in manifest order.
// Blobs: rank r gets the source's rank r blobs, or rank 0's when the source had fewer ranks
// (what Load hands a rank). kInvalidArgument for dp outside [1, kMaxReshardRanks], a zero
// bucket size or a `dst_root` inside the source's root; kFailedPrecondition when `dst_root`
// already holds this step or a newer one, or is a file; kDataLoss naming file and chunk for a
// damaged source; IO errors of the output as they come (kResourceExhausted for ENOSPC).
absl::StatusOr<ReshardReport> Reshard(const CheckpointReader& source, const std::string& dst_root,
                                      const ReshardOptions& options);

}  // namespace ckpt::optimizer

#endif  // CKPT_OPTIMIZER_RESHARD_H_
