// What `ckpt-tool bench startup` measures: building a StagedAdamW (allocating its slabs, their
// first touch, pinning them for the CUDA engine, the first copy of the weights into the
// masters) against the host's own rate of doing the same to the same bytes, measured in the
// same run: every core first-touching them, then (CUDA engine) the driver pinning them. Not
// installed: for ckpt-tool only. Functions never print.
#ifndef CKPT_OPTIMIZER_BENCH_STARTUP_BENCH_H_
#define CKPT_OPTIMIZER_BENCH_STARTUP_BENCH_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "ckpt/optimizer/staged_adamw.h"

namespace ckpt::bench {

// A plain value.
struct StartupBenchOptions {
  uint64_t params = 0;  // BF16 weights in host memory, cut into tensors of at most 2^26.
  optimizer::EngineKind engine = optimizer::EngineKind::kCpu;
};

struct StartupFigures {
  uint64_t slab_bytes = 0;      // Masters and both moments (FP32).
  double create_seconds = 0;    // StagedAdamW::Create until it returned.
  double touch_gbps = 0;        // Every core first-touching slab_bytes of fresh memory.
  double pin_gbps = 0;          // The driver pinning them (CUDA engine; 0 otherwise).
  double bound_seconds = 0;     // slab_bytes at those rates.
  double ratio = 0;             // bound_seconds / create_seconds.
};

// Measures the bound (its memory is freed before), then builds the optimizer once.
// kInvalidArgument for no parameters; the optimizer's errors (kUnimplemented for the CUDA
// engine without CUDA).
absl::StatusOr<StartupFigures> RunStartupBench(const StartupBenchOptions& options);

}  // namespace ckpt::bench

#endif  // CKPT_OPTIMIZER_BENCH_STARTUP_BENCH_H_
