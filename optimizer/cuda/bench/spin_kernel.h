// A kernel that keeps a stream busy for a given time: the synthetic backward of
// `ckpt-tool bench overlap` (ckpt/bench/adamw_bench.h, DeviceStepBuffers::Busy).
#ifndef CKPT_OPTIMIZER_CUDA_BENCH_SPIN_KERNEL_H_
#define CKPT_OPTIMIZER_CUDA_BENCH_SPIN_KERNEL_H_

#include <cuda_runtime.h>

#include <cstdint>

namespace ckpt::optimizer::internal {

// Queues one thread on `stream` that returns once the GPU's global timer has advanced `ns`
// nanoseconds from its start; the other SMs stay free. Returns the launch's error.
cudaError_t LaunchSpin(cudaStream_t stream, uint64_t ns);

}  // namespace ckpt::optimizer::internal

#endif  // CKPT_OPTIMIZER_CUDA_BENCH_SPIN_KERNEL_H_
