// What `ckpt-tool bench reshard` measures: an offline reshard (optimizer::Reshard) of a
// Checkpointer-shaped step against the disk's bound measured in the same run (DESIGN.md §8:
// reading plus writing the state), and the peak memory it took. Also the synthetic step it
// reshards, written in bounded memory, which the large-state memory tests reuse. Not
// installed: for ckpt-tool and tests only. Functions never print.
#ifndef CKPT_OPTIMIZER_BENCH_RESHARD_BENCH_H_
#define CKPT_OPTIMIZER_BENCH_RESHARD_BENCH_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "ckpt/env.h"

namespace ckpt::bench {

// Writes step `step` into the store at `root` (created) as `ranks` ranks' Checkpointer::Save
// would: `params` parameters cut into tensors "layers.<i>.weight" of at most 2^24 elements
// (BF16 weights, FP32 masters and both moments, one param group), Megatron buckets of 40M
// elements, the optimizer record. Values are a fixed function of (tensor, element). Memory is
// bounded (a few MiB per rank) whatever `params`. kInvalidArgument for no parameters or ranks.
absl::Status WriteSyntheticOptimizerStep(Env* env, const std::string& root, uint64_t params,
                                         int ranks, uint64_t step);

// A plain value.
struct ReshardBenchOptions {
  std::string dir;      // An existing directory; the stores are dir/ckpt-bench-reshard-*.
  uint64_t params = 0;  // 14 bytes of state each.
  int ranks = 2;        // Ranks that wrote the source.
  int dp = 3;           // Ranks of the output.
};

struct ReshardFigures {
  uint64_t state_bytes = 0;
  double seconds = 0;           // Reshard's call until it returned (committed).
  double gbps = 0;              // state_bytes / seconds / 1e9.
  double read_bound_gbps = 0;   // Raw O_DIRECT read of the source's data files.
  double write_bound_gbps = 0;  // Best sequential O_DIRECT write of the same bytes.
  // Reading then writing the state at those rates: 1 / (1/read + 1/write), in GB/s of state.
  double bound_gbps = 0;
  uint64_t peak_rss_bytes = 0;  // The process's peak resident set after the reshard.
};

// Writes the source (WriteSyntheticOptimizerStep), reshards it from `ranks` to `dp` ranks,
// then measures the bounds; both stores are removed afterwards (and a previous run's first).
absl::StatusOr<ReshardFigures> RunReshardBench(const ReshardBenchOptions& options);

}  // namespace ckpt::bench

#endif  // CKPT_OPTIMIZER_BENCH_RESHARD_BENCH_H_
