// The fused AdamW pass over one run of elements, for each instruction set and dtype pair.
// Every variant performs the same float operations in the same order (no FMA contraction), so
// all produce bit-identical results.
#ifndef CKPT_OPTIMIZER_CPU_KERNELS_H_
#define CKPT_OPTIMIZER_CPU_KERNELS_H_

#include <cstddef>
#include <cstdint>

#include "ckpt/formats/dtype.h"
#include "ckpt/formats/float_convert.h"
#include "ckpt/optimizer/staged_adamw.h"
#include "optimizer/engine.h"

namespace ckpt::optimizer::internal {

// How far ahead every kernel prefetches each read stream, into L1 and into L2 (the measurements
// behind the distances are in cpu_kernels.cc); the benchmark's triad uses the same.
inline constexpr size_t kPrefetchL1Bytes = 2048;
inline constexpr size_t kPrefetchL2Bytes = 8192;

struct KernelArgs {
  float* master;
  void* exp_avg;  // FP32 or BF16 elements, per the kernel's moment dtype.
  void* exp_avg_sq;
  void* max_exp_avg_sq;  // AMSGrad kernels only (SelectKernel's `amsgrad`).
  const void* grads;  // Already offset to the run's first element.
  void* params;       // Likewise.
  size_t n;
  float grad_scale;
  StepConstants c;
  // Where the state is read: null reads it where it is written (in place). Set by an
  // out-of-place pass (an overlapped step writes the spare side, docs/design/overlap.md);
  // `master` and the moments above are then only written. The math kernels honour these; the
  // benchmark's memory-only kernels run in place.
  const float* master_in = nullptr;
  const void* exp_avg_in = nullptr;
  const void* exp_avg_sq_in = nullptr;
  const void* max_exp_avg_sq_in = nullptr;
};
// `a` with every null source pointer set to its destination.
KernelArgs WithSources(const KernelArgs& a);

using KernelFn = void (*)(const KernelArgs&);

// True if this CPU can run `isa` (kAuto and kScalar always).
bool CpuSupports(CpuIsa isa);
// The widest supported ISA for kAuto.
CpuIsa ResolveIsa(CpuIsa isa);
const char* IsaName(CpuIsa isa);
// Null for unsupported dtype pairs. `amsgrad`: the kernel keeps KernelArgs::max_exp_avg_sq.
KernelFn SelectKernel(CpuIsa isa, formats::DType grad, formats::DType param,
                      MomentDType moments = MomentDType::kF32, bool amsgrad = false);

// Gradients that are NaN or infinite once multiplied by the step's scale (a finite gradient that
// the scale overflows counts too): how many, and the index of the first (UINT64_MAX if none).
struct NonFinite {
  uint64_t count = 0;
  uint64_t first = ~uint64_t{0};
};
using NonFiniteFn = NonFinite (*)(const void* grads, size_t n, float scale);
// The check_finite pass, vectorized like the step. Null for an unsupported gradient dtype.
NonFiniteFn SelectNonFiniteKernel(CpuIsa isa, formats::DType grad);

// How many elements one task of the CPU engine covers when `total` elements are spread over
// `threads` threads: 256 Ki at most (each task restarts the prefetch streams, so longer tasks
// waste less), 4 Ki at least, about 8 tasks per thread on small models so threads stay busy.
// Always a multiple of 64, so every task's 16-bit copy starts as aligned as the first's.
uint64_t TaskElems(uint64_t total, int threads);

// Memory-only kernels for the benchmark's bounds (ckpt-tool bench adamw).
// The step's streams with one add per stream in place of the AdamW arithmetic: the same loads,
// stores, prefetches and vector width as SelectKernel's kernel. Writes garbage into the slabs.
KernelFn SelectShapedKernel(CpuIsa isa, formats::DType grad, formats::DType param,
                            MomentDType moments = MomentDType::kF32);

// Scalar conversions shared by every path (and the tests).
using formats::Bf16ToFloat;
using formats::FloatToBf16;
using formats::FloatToHalf;
using formats::HalfToFloat;

}  // namespace ckpt::optimizer::internal

#endif  // CKPT_OPTIMIZER_CPU_KERNELS_H_
