#include "optimizer/rules/update_rule.h"

#include <algorithm>
#include <cassert>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "ckpt/base/status_macros.h"
#include "optimizer/rules/adafactor/adafactor_rule.h"
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
    case HyperParam::Range::kBool:
      return v == 0 || v == 1;
    case HyperParam::Range::kNonPositive:
      return v <= 0 && std::isfinite(v);
    case HyperParam::Range::kAtLeastOne:
      return v >= 1 && std::isfinite(v);
  }
  return false;  // Unreachable: the switch names every range.
}

}  // namespace

double GroupLr(const ParamGroup& g) { return g.lr; }
double GroupEps(const ParamGroup& g) { return g.eps; }
double GroupWeightDecay(const ParamGroup& g) { return g.weight_decay; }

std::optional<double> HyperValue(const HyperParam& h, const ParamGroup& group) {
  if (h.get != nullptr) return h.get(group);
  auto it = group.hyper.find(h.name);
  if (it != group.hyper.end()) return it->second;
  if (h.optional) return std::nullopt;
  return h.fallback;
}

bool StateApplies(const StateDecl& d, std::span<const uint64_t> shape) {
  return d.applies == nullptr || d.applies(shape);
}

std::vector<uint64_t> StateShape(const StateDecl& d, std::span<const uint64_t> shape) {
  if (d.shape == nullptr) return std::vector<uint64_t>(shape.begin(), shape.end());
  return d.shape(shape);
}

uint64_t StateElements(const StateDecl& d, std::span<const uint64_t> shape) {
  uint64_t n = 1;
  for (uint64_t e : StateShape(d, shape)) n *= e;
  return n;
}

uint64_t AuxElements(const UpdateRule& rule, std::span<const uint64_t> shape) {
  uint64_t n = 0;
  for (const StateDecl& d : rule.states()) {
    assert(!(d.slab == Slab::kAux && d.only_with_max_slab) && "see StateDecl");
    if (d.slab == Slab::kAux && StateApplies(d, shape)) n += StateElements(d, shape);
  }
  return n;
}

absl::Status UpdateRule::CheckParam(const ParamSpec& param) const {
  (void)param;
  return absl::OkStatus();
}

uint64_t UpdateRule::UnitRows(const ParamSpec& param) const {
  return param.shape.empty() ? 1 : param.shape[0];
}

void UpdateRule::StepWholeCpu(const WholeParamStep& step, const StepConstants& c,
                              CpuScratch* scratch, const ParallelFor& parallel) const {
  // Only rules that keep parameters whole have units of whole parameters.
  (void)step, (void)c, (void)scratch, (void)parallel;
  assert(false && "StepWholeCpu of a rule that does not keep parameters whole");
}

absl::Status UpdateRule::CheckGroup(const ParamGroup& group, size_t index) const {
  (void)group;
  (void)index;
  return absl::OkStatus();
}

absl::Status UpdateRule::Validate(const ParamGroup& group, size_t index) const {
  for (const HyperParam& h : schema()) {
    const std::optional<double> value = HyperValue(h, group);
    if (value.has_value() && !InRange(*value, h.range)) {
      return absl::InvalidArgumentError(
          absl::StrCat("param group ", index, ": ", h.name, " = ", *value, " is out of range"));
    }
  }
  for (const auto& entry : group.hyper) {
    const bool known = std::any_of(schema().begin(), schema().end(), [&](const HyperParam& h) {
      return h.get == nullptr && h.name == entry.first;
    });
    if (!known) {
      return absl::InvalidArgumentError(absl::StrCat(
          "param group ", index, ": ", name(), " has no hyper-parameter \"", entry.first, "\""));
    }
  }
  return CheckGroup(group, index);
}

absl::StatusOr<const UpdateRule*> FindRule(Algorithm algorithm) {
  // One line per rule: the only place that maps an Algorithm to its rule (-Wswitch names a
  // value left out; the others go 0 to kLastAlgorithm).
  switch (algorithm) {
    case Algorithm::kAdamW:
      return &AdamWRule();
    case Algorithm::kMuon:
      return &MuonRule();
    case Algorithm::kAdafactor:
      return &AdafactorRule();
  }
  return absl::InvalidArgumentError(
      absl::StrCat("algorithm ", static_cast<int>(algorithm), " names no update rule"));
}

absl::StatusOr<const UpdateRule*> FindRuleByKey(absl::string_view key) {
  for (int a = 0; a <= static_cast<int>(kLastAlgorithm); ++a) {
    const UpdateRule& rule = RuleFor(static_cast<Algorithm>(a));
    if (rule.key() == key) return &rule;
  }
  return absl::NotFoundError(absl::StrCat("no update rule is called \"", key, "\""));
}

const UpdateRule& RuleFor(Algorithm algorithm) {
  absl::StatusOr<const UpdateRule*> rule = FindRule(algorithm);
  assert(rule.ok() && "RuleFor of an unvalidated algorithm");
  return rule.ok() ? **rule : AdamWRule();
}

}  // namespace ckpt::optimizer::internal
