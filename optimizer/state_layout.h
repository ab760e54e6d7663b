// StateLayout: the one owner of how an optimizer's state lies in a step (the table at the top
// of ckpt/optimizer/checkpointer.h). Per parameter its state tensors, derived from its group's
// UpdateRule (optimizer/rules/update_rule.h): the weights under the parameter's own name, then
// optimizer.master.<name>, then optimizer.<key>.<name> for each state the rule declares (AdamW:
// exp_avg, exp_avg_sq, and max_exp_avg_sq when the optimizer keeps AMSGrad's maximum; Muon:
// momentum, docs/design/muon.md); their dtypes and declarations, and a rank's pieces as runs of
// slab elements. Save, the async writer, the undo spill, restore, the model-only load, reshard and
// export all ask it instead of computing names or offsets themselves. Immutable once built;
// safe for concurrent use.
#ifndef CKPT_OPTIMIZER_STATE_LAYOUT_H_
#define CKPT_OPTIMIZER_STATE_LAYOUT_H_

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "ckpt/checkpoint_writer.h"
#include "ckpt/formats/dtype.h"
#include "ckpt/formats/optimizer_record.h"
#include "ckpt/optimizer/staged_adamw.h"
#include "optimizer/rules/update_rule.h"

namespace ckpt::optimizer::internal {

// The trainer's blobs are stored under this prefix (Checkpointer's Blobs keys follow it).
inline constexpr char kTrainerPrefix[] = "trainer.";
// Every tensor name that starts so is optimizer state; the other tensors are the model's.
inline constexpr char kOptimizerPrefix[] = "optimizer.";

// The key of the masters' tensors ("optimizer.master.<param>"), which every rule keeps.
inline constexpr char kMasterKey[] = "master";

// The name of `param`'s state tensor of `key` in a step: "optimizer." + key + "." + param.
std::string StateTensorName(absl::string_view key, absl::string_view param);

// A state tensor of one parameter as a step holds it: the weights (the masters rounded to the
// parameter's dtype, under the parameter's own name), the master, then its rule's state
// tensors (UpdateRule::states()).
struct ParamState {
  std::string name;
  formats::DType dtype;
  Slab slab;             // Where its elements are: kMaster for the weights and the master.
  bool weights = false;  // The masters rounded: written, never read back.
  bool moment = false;   // Kept in the moments' dtype (a load converts F32 and BF16).
  std::vector<uint64_t> shape;  // The tensor's shape: the parameter's, but for aux states.
  // Slab::kAux: its first element in its parameter's run of the aux slab (the aux states
  // before it, added up); it is always written and read whole.
  uint64_t aux_offset = 0;
};

inline formats::DType MomentDTypeOf(MomentDType m) {
  return m == MomentDType::kF32 ? formats::DType::kF32 : formats::DType::kBF16;
}

// Elements [tensor_begin, tensor_begin + count) of parameter `param`, which lie at
// [slab_offset, slab_offset + count) of the slabs.
struct StateRun {
  uint32_t param = 0;
  uint64_t tensor_begin = 0;
  uint64_t slab_offset = 0;
  uint64_t count = 0;
  friend bool operator==(const StateRun&, const StateRun&) = default;
};

class StateLayout {
 public:
  // The state of the parameters `params` (whose weights are each of its own dtype), of which
  // this rank holds `pieces` back to back in its slabs; `max_exp_avg_sq`: the optimizer keeps
  // AMSGrad's slab; `algorithms`: per parameter, its group's (empty: AdamW for every one).
  // REQUIRES: every piece names a parameter of `params`; `algorithms` empty or one per
  // parameter, each naming a rule.
  StateLayout(std::vector<ParamSpec> params, std::vector<Piece> pieces, formats::DType moment,
              bool max_exp_avg_sq = false, std::vector<Algorithm> algorithms = {});
  static StateLayout Of(const StagedAdamW& opt);

  const std::vector<ParamSpec>& params() const { return params_; }
  const std::vector<Piece>& pieces() const { return pieces_; }
  uint64_t size() const { return size_; }  // Slab elements: the pieces' counts added up.
  // Parameter `param`'s state tensors, in the order they are declared and written.
  std::span<const ParamState> states(uint32_t param) const { return states_[param]; }
  // The rule that steps parameter `param`.
  const UpdateRule& rule(uint32_t param) const { return *rules_[param]; }
  bool has_max_exp_avg_sq() const { return max_exp_avg_sq_; }
  formats::DType moment_dtype() const { return moment_; }
  // The aux slab's size in elements, and where the aux state of the piece that starts at slab
  // element `slab_offset` begins in it (of the first piece starting at or after it: the aux
  // state of slab elements [a, b) is [AuxStart(a), AuxStart(b)) when neither cuts a parameter
  // kept whole).
  uint64_t aux_size() const { return piece_aux_.back(); }
  uint64_t AuxStart(uint64_t slab_offset) const;
  // Every state tensor of every parameter: per parameter, its states(param) in order.
  std::vector<TensorSpec> Declarations() const;
  // The runs of slab elements [begin, begin + count), in slab order: a piece cut at `begin`
  // and `begin + count`. REQUIRES: begin + count <= size().
  std::vector<StateRun> Runs(uint64_t begin, uint64_t count) const;
  std::vector<StateRun> Runs() const { return Runs(0, size_); }

 private:
  std::vector<ParamSpec> params_;
  std::vector<Piece> pieces_;
  std::vector<uint64_t> piece_offset_;  // Slab offset of each piece; then size_.
  std::vector<uint64_t> piece_aux_;     // Aux slab offset of each piece; then aux_size().
  uint64_t size_ = 0;
  formats::DType moment_;
  bool max_exp_avg_sq_;
  std::vector<const UpdateRule*> rules_;         // By parameter.
  std::vector<std::vector<ParamState>> states_;  // By parameter.
};

// The state tensor names a parameter `name` of `shape` stepped by `rule` keeps in a step, in
// order (weights, master, the rule's); with `max_slab`, those only an optimizer with AMSGrad's
// slab keeps too.
std::vector<std::string> StateTensorNames(const UpdateRule& rule, absl::string_view name,
                                          std::span<const uint64_t> shape, bool max_slab);

// The optimizer record (formats/optimizer_record.h) of the state saved by `world_size` ranks:
// the parameters (name, shape, model dtype, group, and each one's step count when some differs
// from its group's), the groups (hyper-parameters in double, step counters, and Muon's when the
// group is Muon's: kind "muon", version 4) and the moments' dtype.
std::string LayoutRecord(const std::vector<ParamSpec>& params,
                         const std::vector<ParamGroup>& groups,
                         const std::vector<uint64_t>& param_steps, MomentDType moments,
                         int world_size);

// The algorithm an optimizer record's group was saved with: Muon's, AdamW's or (version 5) the
// rule its "algorithm" names; kInvalidArgument naming `where` and the group for a rule this
// build does not know.
absl::StatusOr<Algorithm> RecordAlgorithm(const formats::OptimizerRecordGroup& group,
                                          size_t index, absl::string_view where);

// The first 10 names, then how many more: "a, b, c and 12 more".
std::string ListNames(const std::vector<std::string>& names);

}  // namespace ckpt::optimizer::internal

#endif  // CKPT_OPTIMIZER_STATE_LAYOUT_H_
