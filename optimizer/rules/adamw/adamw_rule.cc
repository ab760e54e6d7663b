#include "optimizer/rules/adamw/adamw_rule.h"

#include <cmath>

#include "optimizer/engine.h"

namespace ckpt::optimizer::internal {
namespace {

constexpr StateDecl kStates[] = {
    {"exp_avg", Slab::kExpAvg},
    {"exp_avg_sq", Slab::kExpAvgSq},
    {"max_exp_avg_sq", Slab::kMaxExpAvgSq, /*only_with_max_slab=*/true},
};

double Beta1(const ParamGroup& g) { return g.beta1; }
double Beta2(const ParamGroup& g) { return g.beta2; }

// eps = 0 as torch allows it: an element whose moments are both zero then becomes 0/0 = NaN in
// torch and here alike.
constexpr HyperParam kSchema[] = {
    {"lr", GroupLr, HyperParam::Range::kNonNegative},
    {"beta1", Beta1, HyperParam::Range::kUnitOpen},
    {"beta2", Beta2, HyperParam::Range::kUnitOpen},
    {"eps", GroupEps, HyperParam::Range::kNonNegative},
    {"weight_decay", GroupWeightDecay, HyperParam::Range::kNonNegative},
};

class AdamW final : public UpdateRule {
 public:
  Algorithm algorithm() const override { return Algorithm::kAdamW; }
  absl::string_view name() const override { return "AdamW"; }
  absl::string_view key() const override { return "adamw"; }
  std::span<const StateDecl> states() const override { return kStates; }
  bool keeps_params_whole() const override { return false; }
  std::span<const HyperParam> schema() const override { return kSchema; }

  // Derived in double, rounded to float once (DESIGN.md §5).
  void SetConstants(const ParamGroup& g, uint64_t t, StepConstants& c) const override {
    c.rule = this;
    const double b1 = g.beta1, b2 = g.beta2;
    const double bc1 = 1.0 - std::pow(b1, static_cast<double>(t));
    const double bc2 = 1.0 - std::pow(b2, static_cast<double>(t));
    c.beta1 = static_cast<float>(g.beta1);
    c.beta2 = static_cast<float>(g.beta2);
    c.eps = static_cast<float>(g.eps);
    c.decay = static_cast<float>(1.0 - g.lr * g.weight_decay);
    c.omb1 = static_cast<float>(1.0 - b1);
    c.omb2 = static_cast<float>(1.0 - b2);
    c.step_size = static_cast<float>(g.lr / bc1);
    c.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
    c.amsgrad = g.amsgrad;
  }
};

}  // namespace

const UpdateRule& AdamWRule() {
  static const AdamW rule;
  return rule;
}

}  // namespace ckpt::optimizer::internal
