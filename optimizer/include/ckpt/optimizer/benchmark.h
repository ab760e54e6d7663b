// Benchmark of the CUDA engine against the PCIe bound measured in the same run; used by
// `ckpt-tool bench adamw --engine cuda`.
#ifndef CKPT_OPTIMIZER_BENCHMARK_H_
#define CKPT_OPTIMIZER_BENCHMARK_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "ckpt/optimizer/staged_adamw.h"

namespace ckpt::optimizer {

struct CudaStepBenchmark {
  std::string engine;
  double gparams_per_s = 0;
  double h2d_gbps = 0;  // Host-to-device rate while device-to-host runs at the same time.
  double d2h_gbps = 0;
  double bytes_per_param = 0;  // Each way: 12 (FP32 moments) or 8 (BF16 moments).
  double bound_gparams_per_s = 0;
  uint64_t device_bytes = 0;  // Held by the engine.
};

// Runs `steps` timed steps over `params` BF16 parameters with FP32 gradients on the first
// device. kUnimplemented without CUDA; kFailedPrecondition without a device.
absl::StatusOr<CudaStepBenchmark> RunCudaStepBenchmark(uint64_t params, int steps,
                                                       MomentDType moments, uint64_t unit_bytes,
                                                       int slots);

}  // namespace ckpt::optimizer

#endif  // CKPT_OPTIMIZER_BENCHMARK_H_
