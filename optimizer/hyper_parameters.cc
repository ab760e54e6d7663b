// StagedAdamW's hyper-parameters by name (ckpt/optimizer/staged_adamw.h): what the C ABI and
// the Python package read and set of a rule they do not otherwise know (UpdateRule::schema).
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "ckpt/base/status_macros.h"
#include "ckpt/optimizer/staged_adamw.h"
#include "optimizer/rules/update_rule.h"

namespace ckpt::optimizer {
namespace {

// The schema entry of `name` in group `index`'s rule.
absl::StatusOr<const internal::HyperParam*> Find(const std::vector<ParamGroup>& groups,
                                                 size_t index, absl::string_view name) {
  if (index >= groups.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("param group ", index, " does not exist (", groups.size(), ")"));
  }
  CKPT_ASSIGN_OR_RETURN(const internal::UpdateRule* rule,
                        internal::FindRule(groups[index].algorithm),
                        absl::StrCat("param group ", index));
  const std::span<const internal::HyperParam> schema = rule->schema();
  auto it = std::find_if(schema.begin(), schema.end(),
                         [&](const internal::HyperParam& h) { return h.name == name; });
  if (it == schema.end()) {
    return absl::InvalidArgumentError(absl::StrCat("param group ", index, ": ", rule->name(),
                                                   " has no hyper-parameter \"", name, "\""));
  }
  return &*it;
}

}  // namespace

absl::StatusOr<std::optional<double>> StagedAdamW::HyperParameter(size_t index,
                                                                   absl::string_view name) const {
  CKPT_ASSIGN_OR_RETURN(const internal::HyperParam* h, Find(options_.groups, index, name));
  return internal::HyperValue(*h, options_.groups[index]);
}

absl::Status StagedAdamW::SetHyperParameter(size_t index, absl::string_view name,
                                            std::optional<double> value) {
  CKPT_ASSIGN_OR_RETURN(const internal::HyperParam* h, Find(options_.groups, index, name));
  if (h->get != nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "param group ", index, ": \"", name, "\" is a field of the group: set it with SetGroup"));
  }
  if (!value.has_value() && !h->optional) {
    return absl::InvalidArgumentError(
        absl::StrCat("param group ", index, ": \"", name, "\" cannot be unset"));
  }
  ParamGroup group = options_.groups[index];
  if (value.has_value()) {
    group.hyper[std::string(name)] = *value;
  } else {
    group.hyper.erase(std::string(name));
  }
  return SetGroup(index, group);
}

}  // namespace ckpt::optimizer
