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

struct KernelArgs {
  float* master;
  float* exp_avg;
  float* exp_avg_sq;
  const void* grads;  // Already offset to the run's first element.
  void* params;       // Likewise.
  size_t n;
  float grad_scale;
  StepConstants c;
};

using KernelFn = void (*)(const KernelArgs&);

// True if this CPU can run `isa` (kAuto and kScalar always).
bool CpuSupports(CpuIsa isa);
// The widest supported ISA for kAuto.
CpuIsa ResolveIsa(CpuIsa isa);
const char* IsaName(CpuIsa isa);
// Null for unsupported dtype pairs.
KernelFn SelectKernel(CpuIsa isa, formats::DType grad, formats::DType param);

// Scalar conversions shared by every path (and the tests).
using formats::Bf16ToFloat;
using formats::FloatToBf16;
using formats::FloatToHalf;
using formats::HalfToFloat;

}  // namespace ckpt::optimizer::internal

#endif  // CKPT_OPTIMIZER_CPU_KERNELS_H_
