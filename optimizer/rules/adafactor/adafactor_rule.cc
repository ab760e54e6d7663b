// Adafactor on the CPU, as torch's _single_tensor_adafactor computes it on an FP32 parameter:
//   t += 1; w = t^beta2_decay; rho = min(lr, 1 / sqrt(t));
//   alpha = max(eps2, ||p|| / sqrt(numel)) * rho;  p *= 1 - lr * weight_decay (when wd != 0)
//   matrices: row_var.lerp_(mean(g^2, -1), w); col_var.lerp_(mean(g^2, -2), w);
//             v = row_var @ col_var / max(mean(row_var, -2), eps1)
//   vectors:  variance.lerp_(g^2, w); v = variance
//   u = rsqrt(max(v, eps1^2)) * g;  p += u * -(alpha / max(1, ||u|| / (sqrt(numel) * d)))
// (g = -grad with maximize; eps1 None: the machine epsilon of the parameter's dtype). Scalars in
// double as torch keeps Python floats, rounded to float where torch's kernels take them. Sums
// (the norms, the factors' means) are accumulated in double over chunks of a fixed size, so the
// result does not depend on the threads; torch accumulates in float, hence the tolerance of
// docs/design/adafactor.md.
#include "optimizer/rules/adafactor/adafactor_rule.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "ckpt/formats/convert.h"
#include "optimizer/engine.h"
#include "optimizer/rules/torch_math.h"

namespace ckpt::optimizer::internal {
namespace {

using formats::DType;

bool Factored(std::span<const uint64_t> shape) { return shape.size() >= 2; }
bool Unfactored(std::span<const uint64_t> shape) { return shape.size() < 2; }
std::vector<uint64_t> RowShape(std::span<const uint64_t> shape) {
  std::vector<uint64_t> out(shape.begin(), shape.end());
  out.back() = 1;
  return out;
}
std::vector<uint64_t> ColShape(std::span<const uint64_t> shape) {
  std::vector<uint64_t> out(shape.begin(), shape.end());
  out[out.size() - 2] = 1;
  return out;
}

constexpr StateDecl kStates[] = {
    {"row_var", Slab::kAux, false, RowShape, Factored},
    {"col_var", Slab::kAux, false, ColShape, Factored},
    {"variance", Slab::kAux, false, nullptr, Unfactored},
};

// Indices into kSchema of the hyper-parameters ParamGroup has no field for.
enum Schema { kBeta2Decay = 2, kEps1Param, kEps2Param, kDParam, kMaximizeParam };
constexpr HyperParam kSchema[] = {
    {"lr", GroupLr, HyperParam::Range::kNonNegative},
    {"weight_decay", GroupWeightDecay, HyperParam::Range::kNonNegative},
    {"beta2_decay", nullptr, HyperParam::Range::kNonPositive, -0.8},
    {"eps1", nullptr, HyperParam::Range::kNonNegative, 0, /*optional=*/true},
    {"eps2", nullptr, HyperParam::Range::kNonNegative, 1e-3},
    {"d", nullptr, HyperParam::Range::kAtLeastOne, 1.0},
    {"maximize", nullptr, HyperParam::Range::kBool, 0},
};

// StepConstants::values, as SetConstants fills them.
enum Value { kW, kRho, kDecay, kHasDecay, kEps1, kEps2, kD, kMaximize };

// eps1 as torch takes it: the group's, or (None, NaN here) the machine epsilon of the
// parameter's dtype, torch.finfo(param.dtype).eps (torch takes its group's first parameter's
// for the whole group; ckpt each parameter's own, the same unless a group mixes dtypes).
double Eps1(double value, DType param_dtype) {
  if (!std::isnan(value)) return value;
  switch (param_dtype) {
    case DType::kBF16:
      return 0x1p-7;
    case DType::kF16:
      return 0x1p-10;
    default:
      return static_cast<double>(FLT_EPSILON);  // 2^-23.
  }
}

// Elements per chunk of a pass (a fixed cut: sums do not depend on the threads).
constexpr uint64_t kChunk = uint64_t{1} << 15;

// fn(c) for every chunk c of `chunks`, on the engine's threads.
void ForChunks(const ParallelFor& parallel, size_t chunks, const std::function<void(size_t)>& fn) {
  if (parallel == nullptr || chunks <= 1) {
    for (size_t c = 0; c < chunks; ++c) fn(c);
    return;
  }
  parallel(chunks, fn);
}

// The sum of squares of `x[0, n)` in double, over chunks of kChunk added in order.
double SumOfSquares(const ParallelFor& parallel, const float* x, uint64_t n) {
  const size_t chunks = static_cast<size_t>((n + kChunk - 1) / kChunk);
  std::vector<double> partial(chunks, 0.0);
  ForChunks(parallel, chunks, [&](size_t c) {
    double acc = 0;
    for (uint64_t i = c * kChunk; i < std::min(n, (c + 1) * kChunk); ++i) {
      acc += static_cast<double>(x[i]) * x[i];
    }
    partial[c] = acc;
  });
  double total = 0;
  for (double p : partial) total += p;
  return total;
}

struct Scratch : CpuScratch {
  std::vector<float> g;         // The gradients in FP32, then the update.
  std::vector<float> row_mean;  // Per batch: max(mean(row_var, -2), eps1).
};

class Adafactor final : public UpdateRule {
 public:
  Algorithm algorithm() const override { return Algorithm::kAdafactor; }
  absl::string_view name() const override { return "Adafactor"; }
  absl::string_view key() const override { return "adafactor"; }
  std::span<const StateDecl> states() const override { return kStates; }
  bool keeps_params_whole() const override { return true; }
  std::span<const HyperParam> schema() const override { return kSchema; }
  bool has_cuda_kernels() const override { return false; }

  absl::Status CheckParam(const ParamSpec& p) const override {
    if (p.numel() > 0) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(
        "param \"", p.name, "\" in Adafactor group ", p.group,
        " has no elements: Adafactor's norms of it are undefined (step it with AdamW)"));
  }

  // Rows of the unit: every dimension but the last (a vector or scalar is one row).
  uint64_t UnitRows(const ParamSpec& p) const override {
    if (p.shape.size() < 2) return 1;
    return p.numel() / p.shape.back();
  }

  void SetConstants(const ParamGroup& g, uint64_t t, StepConstants& c) const override {
    c.rule = this;
    const auto step = static_cast<double>(t);
    const std::optional<double> eps1 = HyperValue(kSchema[kEps1Param], g);
    c.values[kW] = std::pow(step, *HyperValue(kSchema[kBeta2Decay], g));
    c.values[kRho] = std::min(g.lr, 1.0 / std::sqrt(step));
    c.values[kDecay] = 1.0 - g.lr * g.weight_decay;
    c.values[kHasDecay] = g.weight_decay != 0 ? 1 : 0;
    // None: the parameter's dtype decides, at its step (Eps1).
    c.values[kEps1] = eps1.has_value() ? *eps1 : std::numeric_limits<double>::quiet_NaN();
    c.values[kEps2] = *HyperValue(kSchema[kEps2Param], g);
    c.values[kD] = *HyperValue(kSchema[kDParam], g);
    c.values[kMaximize] = *HyperValue(kSchema[kMaximizeParam], g);
  }

  std::unique_ptr<CpuScratch> NewCpuScratch() const override {
    return std::make_unique<Scratch>();
  }

  void StepWholeCpu(const WholeParamStep& w, const StepConstants& c, CpuScratch* scratch,
                    const ParallelFor& parallel) const override;

 private:
  // Update the factors (or the variance) from the gradients in s.g, then replace s.g with the
  // update u = rsqrt(max(v, eps1^2)) * g.
  static void FactoredUpdate(const WholeParamStep& w, const StepConstants& c, double eps1,
                             Scratch& s, const ParallelFor& parallel);
  static void UnfactoredUpdate(const WholeParamStep& w, const StepConstants& c, double eps1,
                               Scratch& s, const ParallelFor& parallel);
};

void Adafactor::StepWholeCpu(const WholeParamStep& w, const StepConstants& c,
                             CpuScratch* scratch, const ParallelFor& parallel) const {
  Scratch& s = *static_cast<Scratch*>(scratch);
  const uint64_t n = w.count;
  s.g.resize(n);
  const float sign = c.values[kMaximize] != 0 ? -1.0f : 1.0f;
  const size_t gsize = formats::DTypeSize(w.grad_dtype);
  const size_t chunks = static_cast<size_t>((n + kChunk - 1) / kChunk);
  ForChunks(parallel, chunks, [&](size_t ch) {
    const uint64_t lo = ch * kChunk, hi = std::min(n, lo + kChunk);
    formats::Convert(w.grad_dtype, {w.grads + lo * gsize, (hi - lo) * gsize}, DType::kF32,
                     std::as_writable_bytes(std::span(s.g.data() + lo, hi - lo)));
    for (uint64_t i = lo; i < hi; ++i) s.g[i] = s.g[i] * w.grad_scale * sign;
  });
  // alpha from the parameter before its weight decay, as torch's order has it; torch's norm
  // is a float.
  const double p_norm = static_cast<float>(std::sqrt(SumOfSquares(parallel, w.master, n)));
  const double alpha =
      std::max(c.values[kEps2], p_norm / std::sqrt(static_cast<double>(n))) * c.values[kRho];
  const double eps1 = Eps1(c.values[kEps1], w.param_dtype);
  if (w.shape.size() >= 2) {
    FactoredUpdate(w, c, eps1, s, parallel);
  } else {
    UnfactoredUpdate(w, c, eps1, s, parallel);
  }
  const double u_norm = static_cast<float>(std::sqrt(SumOfSquares(parallel, s.g.data(), n)));
  const double denom =
      std::max(1.0, u_norm / (std::sqrt(static_cast<double>(n)) * c.values[kD]));
  const auto step = static_cast<float>(-alpha / denom);
  const auto decay = static_cast<float>(c.values[kDecay]);
  const bool has_decay = c.values[kHasDecay] != 0;
  const size_t psize = formats::DTypeSize(w.param_dtype);
  ForChunks(parallel, chunks, [&](size_t ch) {
    const uint64_t lo = ch * kChunk, hi = std::min(n, lo + kChunk);
    for (uint64_t i = lo; i < hi; ++i) {
      const float p = has_decay ? w.master[i] * decay : w.master[i];
      w.master[i] = std::fma(s.g[i], step, p);  // torch's add_(u, alpha=step): one FMA.
    }
    formats::Convert(DType::kF32, std::as_bytes(std::span(w.master + lo, hi - lo)),
                     w.param_dtype, {w.params + lo * psize, (hi - lo) * psize});
  });
}

void Adafactor::FactoredUpdate(const WholeParamStep& w, const StepConstants& c, double eps1_d,
                               Scratch& s, const ParallelFor& parallel) {
  // (batches, R, C): the last two dimensions factored, the others batched.
  const uint64_t cols = w.shape.back();
  const uint64_t rows_per = w.shape[w.shape.size() - 2];
  const uint64_t rows = w.count / cols;  // batches * rows_per
  const uint64_t batches = rows / rows_per;
  float* row_var = w.aux;         // batches * rows_per
  float* col_var = w.aux + rows;  // batches * cols
  const auto weight = static_cast<float>(c.values[kW]);
  const auto eps1 = static_cast<float>(eps1_d);
  const auto eps1_sq = static_cast<float>(eps1_d * eps1_d);
  float* g = s.g.data();
  const uint64_t row_chunk = std::max<uint64_t>(1, kChunk / cols);
  const auto row_chunks = static_cast<size_t>((rows + row_chunk - 1) / row_chunk);
  // Row factors: torch.norm(g, dim=-1) (a float), squared, over C.
  ForChunks(parallel, row_chunks, [&](size_t ch) {
    for (uint64_t r = ch * row_chunk; r < std::min(rows, (ch + 1) * row_chunk); ++r) {
      double acc = 0;
      for (uint64_t j = 0; j < cols; ++j) acc += static_cast<double>(g[r * cols + j]) * g[r * cols + j];
      const auto nrm = static_cast<float>(std::sqrt(acc));
      row_var[r] = TorchLerp(row_var[r], nrm * nrm / static_cast<float>(cols), weight);
    }
  });
  // Column factors: over the R rows of each batch, a block of columns per task.
  constexpr uint64_t kColBlock = 256;
  const uint64_t col_blocks = (cols + kColBlock - 1) / kColBlock;
  ForChunks(parallel, static_cast<size_t>(batches * col_blocks), [&](size_t task) {
    const uint64_t b = task / col_blocks, c0 = (task % col_blocks) * kColBlock;
    const uint64_t c1 = std::min(cols, c0 + kColBlock);
    double acc[kColBlock] = {};
    for (uint64_t r = 0; r < rows_per; ++r) {
      const float* at = g + (b * rows_per + r) * cols;
      for (uint64_t j = c0; j < c1; ++j) acc[j - c0] += static_cast<double>(at[j]) * at[j];
    }
    for (uint64_t j = c0; j < c1; ++j) {
      const auto nrm = static_cast<float>(std::sqrt(acc[j - c0]));
      float& cv = col_var[b * cols + j];
      cv = TorchLerp(cv, nrm * nrm / static_cast<float>(rows_per), weight);
    }
  });
  // v = row_var @ col_var / max(mean(row_var, -2), eps1); u in place of g.
  s.row_mean.resize(batches);
  for (uint64_t b = 0; b < batches; ++b) {
    double acc = 0;
    for (uint64_t r = 0; r < rows_per; ++r) acc += row_var[b * rows_per + r];
    s.row_mean[b] = std::max(static_cast<float>(acc / static_cast<double>(rows_per)), eps1);
  }
  ForChunks(parallel, row_chunks, [&](size_t ch) {
    for (uint64_t r = ch * row_chunk; r < std::min(rows, (ch + 1) * row_chunk); ++r) {
      const uint64_t b = r / rows_per;
      const float* cv = col_var + b * cols;
      float* u = g + r * cols;
      for (uint64_t j = 0; j < cols; ++j) {
        const float v = row_var[r] * cv[j] / s.row_mean[b];
        u[j] = 1.0f / std::sqrt(std::max(v, eps1_sq)) * u[j];
      }
    }
  });
}

void Adafactor::UnfactoredUpdate(const WholeParamStep& w, const StepConstants& c, double eps1,
                                 Scratch& s, const ParallelFor& parallel) {
  const auto weight = static_cast<float>(c.values[kW]);
  const auto eps1_sq = static_cast<float>(eps1 * eps1);
  float* variance = w.aux;
  const uint64_t n = w.count;
  ForChunks(parallel, static_cast<size_t>((n + kChunk - 1) / kChunk), [&](size_t ch) {
    for (uint64_t i = ch * kChunk; i < std::min(n, (ch + 1) * kChunk); ++i) {
      const float g = s.g[i];
      variance[i] = TorchLerp(variance[i], g * g, weight);
      s.g[i] = 1.0f / std::sqrt(std::max(variance[i], eps1_sq)) * g;
    }
  });
}

}  // namespace

const UpdateRule& AdafactorRule() {
  static const Adafactor rule;
  return rule;
}

}  // namespace ckpt::optimizer::internal
