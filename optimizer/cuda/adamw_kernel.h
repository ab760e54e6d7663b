// Launchers of the fused AdamW kernel (adamw_kernel.cu). Self-contained (no C++20, no absl) so
// nvcc compiles the kernel in C++17.
#ifndef CKPT_OPTIMIZER_CUDA_ADAMW_KERNEL_H_
#define CKPT_OPTIMIZER_CUDA_ADAMW_KERNEL_H_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace ckpt::optimizer::internal {

// Element types the kernel handles.
enum class KernelType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

// The per-group constants of one step; the same fields as StepConstants (engine.h).
struct KernelConstants {
  float beta1, beta2, eps, decay, omb1, omb2, step_size, bc2_sqrt;
  int amsgrad;  // With x_in set: x = max(x, v) and the denominator takes sqrt(x).
};

// One run of a unit whose gradients and weights are contiguous and whose constants are the
// same: where it starts among the unit's elements (the slot buffers), its length, its buffers.
struct DeviceSegment {
  const void* grads;  // Device; this run's first gradient.
  void* params;       // Device; this run's first weight.
  uint64_t at;        // Elements from the unit's first.
  uint64_t n;
  KernelConstants c;
};

// The runs one launch updates (a unit spans a few parameters: one launch, not one per run).
constexpr int kMaxSegments = 8;

struct DeviceUnitArgs {
  // The unit's state in the slot buffers, from its first element.
  const float* master_in;
  const void* m_in;  // FP32 or BF16 per the moment type.
  const void* v_in;
  float* master_out;
  void* m_out;
  void* v_out;
  // AMSGrad's max_exp_avg_sq (moment type), or null when the slabs hold none. Set: x_out is
  // written, updated when c.amsgrad and copied through from x_in otherwise.
  const void* x_in;
  void* x_out;
  float grad_scale;
  int segments;  // 1 to kMaxSegments, all of one gradient and one weight type.
  DeviceSegment segment[kMaxSegments];
};

// Enqueues the update of `args.segments` runs of one unit on `stream`, in one launch. `moments`
// is kF32 or kBF16.
cudaError_t LaunchAdamwUnit(const DeviceUnitArgs& args, KernelType grad, KernelType param,
                            KernelType moments, cudaStream_t stream);
// Adds the number of non-finite scaled gradients among `n` into *count (device).
cudaError_t LaunchCountNonFinite(const void* grads, KernelType grad, uint64_t n, float scale,
                                 unsigned long long* count, cudaStream_t stream);

// Writes `n` FP32 values of `master` (device) rounded to `param` (nearest even) into `params`.
cudaError_t LaunchRoundMasters(const float* master, void* params, KernelType param, uint64_t n,
                               cudaStream_t stream);

}  // namespace ckpt::optimizer::internal

#endif  // CKPT_OPTIMIZER_CUDA_ADAMW_KERNEL_H_
