// The CUDA benchmarks of a build without CUDA (CMake compiles this file instead of
// optimizer/cuda/bench/cuda_bench.cc): each says why it cannot run.
#include "ckpt/bench/adamw_bench.h"

namespace ckpt::optimizer {

absl::StatusOr<CudaStepBenchmark> RunCudaStepBenchmark(uint64_t, int, MomentDType, uint64_t, int) {
  return absl::UnimplementedError(
      "CUDA engine unavailable: ckpt was built without CUDA (CKPT_CUDA=OFF or no toolkit)");
}

absl::StatusOr<std::unique_ptr<DeviceStepBuffers>> NewDeviceStepBuffers(uint64_t, float) {
  return absl::UnimplementedError(
      "CUDA engine unavailable: ckpt was built without CUDA (CKPT_CUDA=OFF or no toolkit)");
}

absl::StatusOr<DuplexRates> MeasurePcieDuplex(uint64_t) {
  return absl::UnimplementedError(
      "CUDA engine unavailable: ckpt was built without CUDA (CKPT_CUDA=OFF or no toolkit)");
}

absl::StatusOr<GpuProducts> TimeGpuMuonProducts(uint64_t, uint64_t, uint32_t, int) {
  return absl::UnimplementedError(
      "CUDA engine unavailable: ckpt was built without CUDA (CKPT_CUDA=OFF or no toolkit)");
}

}  // namespace ckpt::optimizer
