// Muon's step of one whole matrix on the CPU (docs/design/muon.md): the momentum and the update
// of the masters elementwise in FP32 with torch's formulas, the Newton-Schulz orthogonalisation
// with BF16 operands, FP32 accumulation and one BF16 rounding per product, as torch rounds it;
// the products are OpenBLAS SGEMMs over operands that hold BF16 values.
#ifndef CKPT_OPTIMIZER_RULES_MUON_MUON_H_
#define CKPT_OPTIMIZER_RULES_MUON_MUON_H_

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "ckpt/formats/dtype.h"
#include "ckpt/optimizer/layout.h"
#include "ckpt/optimizer/staged_adamw.h"
#include "optimizer/rules/update_rule.h"

namespace ckpt::optimizer::internal {

// One group's Muon constants, from its double hyper-parameters rounded to float once, as torch
// passes Python floats into its kernels.
struct MuonConstants {
  float lerp_weight;      // 1 - momentum: buf.lerp_(g, 1 - momentum).
  float nesterov_weight;  // momentum: u = g.lerp(buf, momentum).
  bool nesterov;
  float decay;  // 1 - lr * weight_decay.
  double lr;    // Each matrix's adjusted lr comes from it and the matrix's shape.
  MuonLrAdjust adjust;
  float a, b, c;  // Newton-Schulz coefficients.
  float eps;
  uint32_t ns_steps;
};
MuonConstants ComputeMuonConstants(const ParamGroup& group);

// The adjusted lr of a rows x cols matrix, in double as torch's _adjust_lr, then rounded to
// float as add_'s alpha. Inline: the CUDA engine's library calls it too.
inline float MuonAdjustedLr(const MuonConstants& k, uint64_t rows, uint64_t cols) {
  const auto a = static_cast<double>(rows), b = static_cast<double>(cols);
  const double ratio = k.adjust == MuonLrAdjust::kOriginal ? std::sqrt(std::max(1.0, a / b))
                                                           : 0.2 * std::sqrt(std::max(a, b));
  return static_cast<float>(k.lr * ratio);
}


// Buffers one orthogonalisation reuses (grown to the largest matrix seen).
struct MuonScratch {
  std::vector<float> update, x, y, gram, poly;
};

// The Newton-Schulz orthogonalisation of `u` (rows x cols, row-major), written to `out` (the
// same shape; BF16 values held in FP32): torch's _zeropower_via_newtonschulz. `u` and `out` may
// be the same buffer.
void NewtonSchulz(const float* u, uint64_t rows, uint64_t cols, const MuonConstants& k,
                  MuonScratch& scratch, float* out, const ParallelFor& parallel = nullptr);

// One Muon step of a whole matrix: momentum (F32 or BF16 elements) and master read from the
// `_in` pointers (in place when they equal the outputs), gradients (of grad_dtype, times
// grad_scale) read, master and momentum written, and the weights written as the masters rounded
// to param_dtype (nearest even).
struct MuonMatrixArgs {
  const float* master_in;
  float* master;
  const std::byte* momentum_in;
  std::byte* momentum;
  MomentDType moment_dtype;
  const std::byte* grads;
  formats::DType grad_dtype;
  float grad_scale;
  std::byte* params;
  formats::DType param_dtype;
  uint64_t rows, cols;
};
void MuonStepMatrix(const MuonMatrixArgs& a, const MuonConstants& k, MuonScratch& scratch,
                    const ParallelFor& parallel = nullptr);

// Sets the threads OpenBLAS's products use (process-wide: OpenBLAS has no per-call setting) and
// returns the previous number, for the caller to put back.
int SetBlasThreads(int threads);

}  // namespace ckpt::optimizer::internal

#endif  // CKPT_OPTIMIZER_RULES_MUON_MUON_H_
