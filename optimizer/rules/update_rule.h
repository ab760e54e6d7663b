// UpdateRule: what one optimizer algorithm declares (DESIGN.md §12), so that the rest of the
// optimizer is derived from the declarations instead of naming the algorithm: the state tensors
// each parameter keeps beside its weights and master (their names in a step, which slab holds
// them, whether they are moments), whether a parameter must lie whole on one rank, which
// parameters it can step at all, its hyper-parameters as a named schema (ranges checked in one
// place) and its step constants. StateLayout (names and dtypes on disk), reshard (which tensors
// travel with a parameter), unit building (a whole parameter is one unit), hyper-parameter
// validation and ComputeStepConstants ask the rule of a parameter's group.
//
// A rule is a stateless singleton (RuleFor): safe for concurrent use.
#ifndef CKPT_OPTIMIZER_RULES_UPDATE_RULE_H_
#define CKPT_OPTIMIZER_RULES_UPDATE_RULE_H_

#include <cstddef>
#include <cstdint>
#include <span>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "ckpt/optimizer/layout.h"

namespace ckpt::optimizer {
struct StepConstants;  // optimizer/engine.h.
}  // namespace ckpt::optimizer

namespace ckpt::optimizer::internal {

// The slab that holds a state tensor's elements on a rank (optimizer/slabs.h): each is indexed
// like the masters, one element per parameter element this rank owns.
enum class Slab : uint8_t { kMaster, kExpAvg, kExpAvgSq, kMaxExpAvgSq };

// A state tensor a rule keeps per parameter, besides the weights and the master every rule has:
// stored in a step as "optimizer.<key>.<parameter>", shaped like its parameter, in the
// moments' dtype (MomentDType), its elements in `slab`.
struct StateDecl {
  absl::string_view key;
  Slab slab;
  // Kept only while the optimizer holds AMSGrad's slab (StagedAdamW::has_max_exp_avg_sq()):
  // then for every parameter of the rule, whether or not its group asks for amsgrad.
  bool only_with_max_slab = false;
};

// One hyper-parameter of a rule's schema: its name (as torch's param_groups spell it), how it
// is read from a ParamGroup, and the values it may take.
struct HyperParam {
  enum class Range : uint8_t {
    kNonNegative,  // Finite and >= 0 (lr, eps, weight_decay, momentum).
    kUnitOpen,     // In [0, 1) (AdamW's betas).
    kFinite,       // Any finite value (Newton-Schulz coefficients).
    kBelow100,     // An integer count below 100 (Newton-Schulz steps, as torch).
    kEnum2,        // An enumeration of two values, 0 or 1 (Muon's adjust_lr).
  };
  absl::string_view name;
  double (*get)(const ParamGroup& group);
  Range range;
};

class UpdateRule {
 public:
  virtual ~UpdateRule() = default;
  virtual Algorithm algorithm() const = 0;
  // The rule's name in messages ("AdamW", "Muon").
  virtual absl::string_view name() const = 0;
  // The state tensors of each parameter, in the order they are declared and written (after the
  // weights and the master). Those with only_with_max_slab are kept only when `max_slab`.
  virtual std::span<const StateDecl> states() const = 0;
  // Each parameter lies whole on one rank and is one unit of the step (Unit::rows set): its
  // update needs all of it at once (Muon's orthogonalisation).
  virtual bool keeps_params_whole() const = 0;
  // OK when the rule can step `param`; kInvalidArgument naming the parameter and why otherwise
  // (Muon steps 2-D matrices only).
  virtual absl::Status CheckParam(const ParamSpec& param) const;
  // The hyper-parameters the rule reads (a ParamGroup's other fields are ignored by it).
  virtual std::span<const HyperParam> schema() const = 0;
  // OK when every hyper-parameter of `schema()` is in range and the group asks for nothing the
  // rule lacks; kInvalidArgument naming group `index`, the field and its value otherwise.
  absl::Status Validate(const ParamGroup& group, size_t index) const;
  // Fills the rule's part of one step's constants for a group at step count `t` (>= 1).
  virtual void SetConstants(const ParamGroup& group, uint64_t t, StepConstants& c) const = 0;

 protected:
  // Checks beyond the schema's ranges (an AdamW-only flag on a Muon group); OK by default.
  virtual absl::Status CheckGroup(const ParamGroup& group, size_t index) const;
};

// The rule of `algorithm`; kInvalidArgument for a value that names none.
absl::StatusOr<const UpdateRule*> FindRule(Algorithm algorithm);
// The same. REQUIRES: `algorithm` names a rule (groups are validated before they are stepped).
const UpdateRule& RuleFor(Algorithm algorithm);

// The hyper-parameters every rule reads alike: lr, eps and weight_decay.
double GroupLr(const ParamGroup& g);
double GroupEps(const ParamGroup& g);
double GroupWeightDecay(const ParamGroup& g);

}  // namespace ckpt::optimizer::internal

#endif  // CKPT_OPTIMIZER_RULES_UPDATE_RULE_H_
