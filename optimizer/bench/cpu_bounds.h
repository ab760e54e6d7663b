// Memory-only measurements that bound the CPU engine's step (ckpt-tool bench adamw, DESIGN.md
// §8). Both run on the engine's footing: buffers laid out as the slabs are (2 MiB-aligned,
// MADV_HUGEPAGE, staggered), a pool of the same size, the same task size, the widest vectors
// the CPU has and the step's prefetches; each is the best of `passes` timed passes.
#ifndef CKPT_OPTIMIZER_BENCH_CPU_BOUNDS_H_
#define CKPT_OPTIMIZER_BENCH_CPU_BOUNDS_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "ckpt/formats/dtype.h"
#include "ckpt/optimizer/staged_adamw.h"

namespace ckpt::optimizer::internal {

// a[i] = b[i] + s * c[i], the STREAM triad, with the widest vectors of `isa` and the step's
// prefetches. With `streaming`, non-temporal stores to `a` (12 bytes move per element); without,
// plain stores, which also read every line of `a` before writing it (16 bytes move).
void TriadKernel(CpuIsa isa, bool streaming, float* a, const float* b, const float* c, float s,
                 size_t n);

// Host memory bandwidth in GB/s from the STREAM triad a = b + s * c over `n` floats per array,
// counting the bytes that actually move: the better of streaming stores (12 bytes per element)
// and plain ones (16: each line of `a` is read before it is written). STREAM itself counts 12
// for plain stores too, which understates what memory did.
absl::StatusOr<double> MeasureTriadGBps(uint64_t n, int threads, CpuIsa isa, int passes);

// Parameters per second (in billions) of the step's own streams without its arithmetic (see
// SelectShapedKernel): what memory allows for exactly this access pattern. `grads` (n elements
// of `grad_dtype`) and `params` (n BF16 elements) are the caller's; the three slab-like buffers
// (moments of `moments` dtype) are allocated here.
absl::StatusOr<double> MeasureShapedGparams(const void* grads, formats::DType grad_dtype,
                                            void* params, uint64_t n, int threads, CpuIsa isa,
                                            int passes, MomentDType moments = MomentDType::kF32);

}  // namespace ckpt::optimizer::internal

#endif  // CKPT_OPTIMIZER_BENCH_CPU_BOUNDS_H_
