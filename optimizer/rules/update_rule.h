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
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "ckpt/formats/dtype.h"
#include "ckpt/optimizer/layout.h"
#include "ckpt/optimizer/staged_adamw.h"

namespace ckpt::optimizer {
struct StepConstants;  // optimizer/engine.h.
}  // namespace ckpt::optimizer

namespace ckpt::optimizer::internal {

// The slab that holds a state tensor's elements on a rank (optimizer/slabs.h). The first four
// are indexed like the masters, one element per parameter element this rank owns, in the
// moments' dtype (but the masters). kAux holds FP32 state shaped unlike its parameter (Adafactor's
// row and column factors): each piece of a parameter a rule keeps whole has its own run of it,
// its states' elements back to back (StateLayout::AuxStart).
enum class Slab : uint8_t { kMaster, kExpAvg, kExpAvgSq, kMaxExpAvgSq, kAux };

// A state tensor a rule keeps per parameter, besides the weights and the master every rule has:
// stored in a step as "optimizer.<key>.<parameter>", its elements in `slab`.
struct StateDecl {
  absl::string_view key;
  Slab slab;
  // Kept only while the optimizer holds AMSGrad's slab (StagedAdamW::has_max_exp_avg_sq()):
  // then for every parameter of the rule, whether or not its group asks for amsgrad. Never
  // for a kAux state (its offsets do not depend on the optimizer's slabs).
  bool only_with_max_slab = false;
  // The state's shape for a parameter of `shape`; null: the parameter's own. Only kAux states
  // may be shaped unlike their parameter.
  std::vector<uint64_t> (*shape)(std::span<const uint64_t> shape) = nullptr;
  // Whether a parameter of `shape` keeps the state; null: every parameter.
  bool (*applies)(std::span<const uint64_t> shape) = nullptr;
};

// Runs fn(i) for every i in [0, count) on the caller's threads (the CPU engine's pool) and
// returns when all are done; null runs them in order on the calling thread. A kernel cuts its
// passes into chunks of a fixed size, so its result does not depend on the threads.
using ParallelFor = std::function<void(size_t count, const std::function<void(size_t)>& fn)>;

// One parameter a rule keeps whole, stepped on the CPU (UpdateRule::StepWholeCpu): its state
// read and written in place, its gradients (of grad_dtype, times grad_scale) read, its weights
// written as the masters rounded to param_dtype (nearest even).
struct WholeParamStep {
  float* master;
  std::byte* exp_avg;  // Its elements in the exp_avg slab (moment_dtype), for rules that use it.
  float* aux;          // Its run of the aux slab, for rules that use it.
  MomentDType moment_dtype;
  const std::byte* grads;
  formats::DType grad_dtype;
  float grad_scale;
  std::byte* params;
  formats::DType param_dtype;
  std::span<const uint64_t> shape;
  uint64_t rows;  // UpdateRule::UnitRows of the parameter; count / rows columns.
  uint64_t count;
};

// What a rule's CPU kernel keeps between the parameters it steps (buffers grown to the largest
// parameter). Owned by one engine; used by one step at a time.
class CpuScratch {
 public:
  virtual ~CpuScratch() = default;
};

// One hyper-parameter of a rule's schema: its name (as torch's param_groups spell it), how it
// is read from a ParamGroup, and the values it may take.
// A rule's own hyper-parameters (those ParamGroup has no field for) live in ParamGroup::hyper
// by name: `get` is null for them, and `fallback` is the value of one the group does not set
// (torch's default), unless `optional` (absent means "none", as torch's eps1=None).
struct HyperParam {
  enum class Range : uint8_t {
    kNonNegative,  // Finite and >= 0 (lr, eps, weight_decay, momentum).
    kUnitOpen,     // In [0, 1) (AdamW's betas).
    kFinite,       // Any finite value (Newton-Schulz coefficients).
    kBelow100,     // An integer count below 100 (Newton-Schulz steps, as torch).
    kBool,         // 0 or 1 (Muon's adjust_lr, Adafactor's maximize).
    kNonPositive,  // Finite and <= 0 (Adafactor's beta2_decay).
    kAtLeastOne,   // Finite and >= 1 (Adafactor's clipping threshold d).
  };
  absl::string_view name;
  double (*get)(const ParamGroup& group);
  Range range;
  double fallback = 0;
  bool optional = false;
};
// The value of `h` in `group`: its field, its entry in ParamGroup::hyper, or its fallback.
// Absent and optional: nullopt.
std::optional<double> HyperValue(const HyperParam& h, const ParamGroup& group);

class UpdateRule {
 public:
  virtual ~UpdateRule() = default;
  virtual Algorithm algorithm() const = 0;
  // The rule's name in messages ("AdamW", "Muon").
  virtual absl::string_view name() const = 0;
  // Its name in the optimizer record's groups ("adamw", "muon"): never changes once written.
  virtual absl::string_view key() const = 0;
  // The state tensors of each parameter, in the order they are declared and written (after the
  // weights and the master). Those with only_with_max_slab are kept only when `max_slab`.
  virtual std::span<const StateDecl> states() const = 0;
  // Each parameter lies whole on one rank and is one unit of the step (Unit::rows set): its
  // update needs all of it at once (Muon's orthogonalisation).
  virtual bool keeps_params_whole() const = 0;
  // OK when the rule can step `param`; kInvalidArgument naming the parameter and why otherwise
  // (Muon steps 2-D matrices only).
  virtual absl::Status CheckParam(const ParamSpec& param) const;
  // A parameter kept whole is one unit of Unit::rows rows (its count / rows columns): Muon's
  // matrix rows, by default the first dimension. REQUIRES: keeps_params_whole().
  virtual uint64_t UnitRows(const ParamSpec& param) const;
  // Steps one whole parameter on the CPU with the constants SetConstants made for it.
  // REQUIRES: keeps_params_whole(); `scratch` made by NewCpuScratch().
  virtual void StepWholeCpu(const WholeParamStep& step, const StepConstants& c,
                            CpuScratch* scratch, const ParallelFor& parallel) const;
  virtual std::unique_ptr<CpuScratch> NewCpuScratch() const { return nullptr; }
  // Whether the CUDA engine has this rule's kernels (an optimizer with a group whose rule has
  // none is refused on the CUDA engine, kUnimplemented).
  virtual bool has_cuda_kernels() const { return true; }
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

// Whether a parameter of `shape` keeps state `d`, and that state's shape and element count.
bool StateApplies(const StateDecl& d, std::span<const uint64_t> shape);
std::vector<uint64_t> StateShape(const StateDecl& d, std::span<const uint64_t> shape);
uint64_t StateElements(const StateDecl& d, std::span<const uint64_t> shape);
// The aux slab elements (Slab::kAux) a parameter of `shape` stepped by `rule` keeps: its aux
// states' elements added up, in the order the rule declares them.
uint64_t AuxElements(const UpdateRule& rule, std::span<const uint64_t> shape);

// The rule of `algorithm`; kInvalidArgument for a value that names none.
// The rule whose key() is `key`, as the optimizer record names it; kNotFound for none.
absl::StatusOr<const UpdateRule*> FindRuleByKey(absl::string_view key);
absl::StatusOr<const UpdateRule*> FindRule(Algorithm algorithm);
// The same. REQUIRES: `algorithm` names a rule (groups are validated before they are stepped).
const UpdateRule& RuleFor(Algorithm algorithm);

// The hyper-parameters every rule reads alike: lr, eps and weight_decay.
double GroupLr(const ParamGroup& g);
double GroupEps(const ParamGroup& g);
double GroupWeightDecay(const ParamGroup& g);

}  // namespace ckpt::optimizer::internal

#endif  // CKPT_OPTIMIZER_RULES_UPDATE_RULE_H_
