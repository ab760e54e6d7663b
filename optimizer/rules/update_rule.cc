#include "optimizer/rules/update_rule.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "ckpt/base/status_macros.h"
#include "optimizer/rules/adamw/adamw_rule.h"
#include "optimizer/rules/muon/muon_rule.h"

namespace ckpt::optimizer::internal {
namespace {

bool InRange(double v, HyperParam::Range range) {
  switch (range) {
    case HyperParam::Range::kNonNegative:
      return v >= 0 && std::isfinite(v);
    case HyperParam::Range::kUnitOpen:
      return v >= 0 && v < 1;
    case HyperParam::Range::kFinite:
      return std::isfinite(v);
    case HyperParam::Range::kBelow100:
      return v >= 0 && v < 100;
    case HyperParam::Range::kEnum2:
      return v == 0 || v == 1;
  }
  return false;  // Unreachable: the switch names every range.
}

}  // namespace

double GroupLr(const ParamGroup& g) { return g.lr; }
double GroupEps(const ParamGroup& g) { return g.eps; }
double GroupWeightDecay(const ParamGroup& g) { return g.weight_decay; }

absl::Status UpdateRule::CheckParam(const ParamSpec& param) const {
  (void)param;
  return absl::OkStatus();
}

absl::Status UpdateRule::CheckGroup(const ParamGroup& group, size_t index) const {
  (void)group;
  (void)index;
  return absl::OkStatus();
}

absl::Status UpdateRule::Validate(const ParamGroup& group, size_t index) const {
  for (const HyperParam& h : schema()) {
    const double value = h.get(group);
    if (!InRange(value, h.range)) {
      return absl::InvalidArgumentError(
          absl::StrCat("param group ", index, ": ", h.name, " = ", value, " is out of range"));
    }
  }
  return CheckGroup(group, index);
}

absl::StatusOr<const UpdateRule*> FindRule(Algorithm algorithm) {
  // One line per rule: the only place that lists them.
  switch (algorithm) {
    case Algorithm::kAdamW:
      return &AdamWRule();
    case Algorithm::kMuon:
      return &MuonRule();
  }
  return absl::InvalidArgumentError(
      absl::StrCat("algorithm ", static_cast<int>(algorithm), " names no update rule"));
}

const UpdateRule& RuleFor(Algorithm algorithm) {
  absl::StatusOr<const UpdateRule*> rule = FindRule(algorithm);
  return rule.ok() ? **rule : AdamWRule();  // REQUIRES excludes the fallback.
}

}  // namespace ckpt::optimizer::internal
