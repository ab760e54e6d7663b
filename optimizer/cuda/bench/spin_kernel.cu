// LaunchSpin (spin_kernel.h).
#include "optimizer/cuda/bench/spin_kernel.h"

namespace ckpt::optimizer::internal {
namespace {

__device__ uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void Spin(uint64_t ns) {
  const uint64_t start = GlobalTimerNs();
  while (GlobalTimerNs() - start < ns) __nanosleep(2000);
}

}  // namespace

cudaError_t LaunchSpin(cudaStream_t stream, uint64_t ns) {
  Spin<<<1, 1, 0, stream>>>(ns);
  return cudaGetLastError();
}

}  // namespace ckpt::optimizer::internal
