// StateLayout: the one owner of how an optimizer's state lies in a step (the table at the top
// of ckpt/optimizer/checkpointer.h). Per parameter a fixed list of state tensors (AdamW: the
// weights under the parameter's own name, then optimizer.master.<name>, optimizer.exp_avg.<name>
// and optimizer.exp_avg_sq.<name>, and optimizer.max_exp_avg_sq.<name> when the optimizer keeps
// AMSGrad's maximum; a Muon parameter's are its weights, master and optimizer.momentum.<name>,
// docs/design/muon.md), their dtypes and declarations, and a rank's pieces as runs of slab
// elements. Save, the async writer, the undo spill, restore, the model-only load, reshard and
// export all ask it instead of computing names or offsets themselves. Immutable once built;
// safe for concurrent use.
#ifndef CKPT_OPTIMIZER_STATE_LAYOUT_H_
#define CKPT_OPTIMIZER_STATE_LAYOUT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "ckpt/checkpoint_writer.h"
#include "ckpt/formats/dtype.h"
#include "ckpt/optimizer/staged_adamw.h"

namespace ckpt::optimizer::internal {

// The trainer's blobs are stored under this prefix (Checkpointer's Blobs keys follow it).
inline constexpr char kTrainerPrefix[] = "trainer.";
// Every tensor name that starts so is optimizer state; the other tensors are the model's.
inline constexpr char kOptimizerPrefix[] = "optimizer.";

// A state tensor of a parameter. The weights are the masters rounded to the model dtype.
// kMomentum is a Muon parameter's momentum buffer, kept where exp_avg is (the same EMA).
enum class StateKind : uint8_t { kWeights, kMaster, kExpAvg, kExpAvgSq, kMaxExpAvgSq, kMomentum };
inline constexpr size_t kStateKinds = 6;

// The kinds AdamW keeps per parameter, in the order they are declared and written; with
// AMSGrad's maximum (StagedAdamW::has_max_exp_avg_sq()) the second list.
inline constexpr StateKind kAdamWKinds[] = {StateKind::kWeights, StateKind::kMaster,
                                            StateKind::kExpAvg, StateKind::kExpAvgSq};
inline constexpr StateKind kAmsgradKinds[] = {StateKind::kWeights, StateKind::kMaster,
                                              StateKind::kExpAvg, StateKind::kExpAvgSq,
                                              StateKind::kMaxExpAvgSq};
// The kinds a Muon parameter keeps.
inline constexpr StateKind kMuonKinds[] = {StateKind::kWeights, StateKind::kMaster,
                                           StateKind::kMomentum};
// True for the kinds stored in the moments' dtype.
inline bool IsMoment(StateKind kind) {
  return kind == StateKind::kExpAvg || kind == StateKind::kExpAvgSq ||
         kind == StateKind::kMaxExpAvgSq || kind == StateKind::kMomentum;
}

// The name of `param`'s tensor of `kind` in a step: the parameter's own name for the weights,
// "optimizer.master." + param and so on for the rest.
std::string StateTensorName(StateKind kind, absl::string_view param);

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
  // this rank holds `pieces` back to back in its slabs; `max_exp_avg_sq`: with AMSGrad's
  // maximum; `muon`: per parameter, whether it is a Muon group's (empty: none is).
  // REQUIRES: every piece names a parameter of `params`; `muon` empty or one per parameter.
  StateLayout(std::vector<ParamSpec> params, std::vector<Piece> pieces, formats::DType moment,
              bool max_exp_avg_sq = false, std::vector<bool> muon = {});
  static StateLayout Of(const StagedAdamW& opt);

  const std::vector<ParamSpec>& params() const { return params_; }
  const std::vector<Piece>& pieces() const { return pieces_; }
  uint64_t size() const { return size_; }  // Slab elements: the pieces' counts added up.
  // The kinds of an AdamW parameter.
  std::span<const StateKind> kinds() const {
    if (max_exp_avg_sq_) return kAmsgradKinds;
    return kAdamWKinds;
  }
  // The kinds of parameter `param`: Muon's or AdamW's.
  std::span<const StateKind> kinds(uint32_t param) const {
    if (!muon_.empty() && muon_[param]) return kMuonKinds;
    return kinds();
  }
  bool is_muon(uint32_t param) const { return !muon_.empty() && muon_[param]; }
  bool has_max_exp_avg_sq() const { return max_exp_avg_sq_; }
  // The dtype of `param`'s tensor of `kind`: its own for the weights, F32 for the masters, the
  // moments' for the moments.
  formats::DType dtype(StateKind kind, uint32_t param) const;
  // The same for the kinds every parameter has alike. REQUIRES: kind != kWeights.
  formats::DType dtype(StateKind kind) const;
  const std::string& name(uint32_t param, StateKind kind) const {
    return names_[param][static_cast<size_t>(kind)];
  }
  // Every state tensor of every parameter: per parameter, its kinds(param) in order.
  std::vector<TensorSpec> Declarations() const;
  // The runs of slab elements [begin, begin + count), in slab order: a piece cut at `begin`
  // and `begin + count`. REQUIRES: begin + count <= size().
  std::vector<StateRun> Runs(uint64_t begin, uint64_t count) const;
  std::vector<StateRun> Runs() const { return Runs(0, size_); }

 private:
  std::vector<ParamSpec> params_;
  std::vector<Piece> pieces_;
  std::vector<uint64_t> piece_offset_;  // Slab offset of each piece; then size_.
  uint64_t size_ = 0;
  formats::DType moment_;
  bool max_exp_avg_sq_;
  std::vector<bool> muon_;
  std::vector<std::vector<std::string>> names_;  // By parameter, then kind (every kind).
};

// The optimizer record (formats/optimizer_record.h) of the state saved by `world_size` ranks:
// the parameters (name, shape, model dtype, group, and each one's step count when some differs
// from its group's), the groups (hyper-parameters in double, step counters, and Muon's when the
// group is Muon's: kind "muon", version 4) and the moments' dtype.
std::string LayoutRecord(const std::vector<ParamSpec>& params,
                         const std::vector<ParamGroup>& groups,
                         const std::vector<uint64_t>& param_steps, MomentDType moments,
                         int world_size);

// The first 10 names, then how many more: "a, b, c and 12 more".
std::string ListNames(const std::vector<std::string>& names);

}  // namespace ckpt::optimizer::internal

#endif  // CKPT_OPTIMIZER_STATE_LAYOUT_H_
