// The demo trainer's model and ranks (demo/demo_trainer.cc): a HuggingFace model's floating
// tensors as BF16 parameters of StagedAdamW, cut over data-parallel ranks as Megatron's
// distributed optimizer does, a synthetic loss, and the checkpoint layout of one rank's state.
//
// Checkpoint layout (one step): the BF16 weights under each parameter's HF name, and
// "optimizer.master.<name>" (FP32), "optimizer.exp_avg.<name>", "optimizer.exp_avg_sq.<name>"
// (FP32, or BF16 with BF16 moments), all of the parameter's global shape; every rank writes only
// its pieces, straight from its slabs. Rank 0 stores the step in the blob kStepBlob.
//
// State dump (ckpt-demo-trainer --dump-state FILE, DumpState): every rank's whole state at the
// end of a run, so that two runs can be compared byte for byte. Integers and floats are
// little-endian; slab contents are the slabs' bytes as they are in memory (little-endian hosts):
//   "ckpt-demo-state 1\n"                     the magic, kStateDumpMagic
//   u32 ranks
//   per rank, in rank order:
//     u64 n                                    elements this rank owns
//     u32 b                                    bytes per moment: 4 (FP32), 2 (BF16), 0 when the
//                                              rank owns nothing (n is 0 then)
//     n*4 bytes master, n*b exp_avg, n*b exp_avg_sq   the optimizer's slabs
//     n*2 bytes                                the BF16 model weights
//     u32 groups; per group: u64 step, f64 lr, beta1, beta2, eps, weight_decay (0 groups when
//                                              the rank owns nothing)
#ifndef CKPT_DEMO_DEMO_MODEL_H_
#define CKPT_DEMO_DEMO_MODEL_H_

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "ckpt/base/status_macros.h"
#include "ckpt/checkpoint_reader.h"
#include "ckpt/checkpoint_writer.h"
#include "ckpt/hf_checkpoint.h"
#include "ckpt/optimizer/layout.h"
#include "ckpt/optimizer/staged_adamw.h"
#include "demo/device_step.h"

namespace ckpt::demo {

inline constexpr const char* kStepBlob = "trainer.step";
inline constexpr std::string_view kStateDumpMagic = "ckpt-demo-state 1\n";

class DemoRank;

// What every rank agrees on: the parameters, their groups and who owns which piece. Immutable.
class DemoModel {
 public:
  // The BF16, F16 and F32 tensors of `hf` become BF16 parameters (others are left out); matrices
  // get weight decay, vectors not; every rank steps on `engine` and keeps its moments as
  // `moments`. kInvalidArgument when there is no floating tensor.
  static absl::StatusOr<DemoModel> FromHf(const HfCheckpointReader& hf, int ranks,
                                          optimizer::EngineKind engine,
                                          optimizer::MomentDType moments);

  const std::vector<optimizer::ParamSpec>& params() const { return params_; }
  const std::vector<optimizer::ParamGroup>& groups() const { return groups_; }
  const std::vector<optimizer::Piece>& pieces(int rank) const { return pieces_[rank]; }
  uint64_t elements() const { return elements_; }
  int ranks() const { return static_cast<int>(pieces_.size()); }
  optimizer::EngineKind engine() const { return engine_; }
  optimizer::MomentDType moments() const { return moments_; }

  // Rank `rank`'s weights in slab order, rounded to BF16.
  absl::StatusOr<std::vector<uint16_t>> ReadHfWeights(const HfCheckpointReader& hf, int rank) const;
  // Gathers every rank's weights into whole tensors and writes them as model.safetensors in
  // `dir`. kInternal if the ranks' pieces do not cover every parameter exactly once.
  absl::Status ExportHf(const std::vector<std::unique_ptr<DemoRank>>& ranks,
                        const std::string& dir) const;

  // The loss's target for element `index` of parameter `param`.
  float Target(uint32_t param, uint64_t index) const;

 private:
  std::vector<optimizer::ParamSpec> params_;
  std::vector<optimizer::ParamGroup> groups_;
  std::vector<std::vector<optimizer::Piece>> pieces_;
  uint64_t elements_ = 0;
  optimizer::EngineKind engine_ = optimizer::EngineKind::kCpu;
  optimizer::MomentDType moments_ = optimizer::MomentDType::kF32;
};

// One rank: its StagedAdamW, its BF16 weights and gradient buffer. Not thread-safe; each rank
// is driven by one thread.
class DemoRank {
 public:
  // Masters from `weights` (this rank's elements in slab order); every group has taken `step`
  // steps.
  static absl::StatusOr<std::unique_ptr<DemoRank>> Create(const DemoModel& model, int rank,
                                                          std::vector<uint16_t> weights,
                                                          uint64_t step);
  // Weights, masters and moments of this rank's pieces from a committed step.
  // kFailedPrecondition when the step holds moments of another dtype than model.moments().
  static absl::StatusOr<std::unique_ptr<DemoRank>> Load(const DemoModel& model, int rank,
                                                        const CheckpointReader& ckpt,
                                                        uint64_t step);

  // Computes the gradient of the loss at the current BF16 weights (plus noise fixed by `step`)
  // and takes one optimizer step. Returns this rank's part of the loss before the step.
  absl::StatusOr<double> Step(const DemoModel& model, int step);
  // Declares every tensor and writes this rank's pieces (with `half`, only the first half of
  // them, for the crash).
  absl::Status Save(const DemoModel& model, SaveTransaction* txn, bool half) const;

  // Appends this rank's part of the state dump (see the top of this file).
  void AppendState(std::string* out) const;
  // Weights, masters, both moments (their slab bytes, FP32 or BF16) and every group's step and
  // hyper-parameters equal bit for bit.
  bool SameState(const DemoRank& other) const;
  const std::vector<optimizer::Piece>& pieces() const { return pieces_; }
  const std::vector<uint16_t>& weights() const { return weights_; }

 private:
  DemoRank() = default;
  std::vector<optimizer::Piece> pieces_;
  std::vector<uint16_t> weights_;
  std::vector<float> grads_;
  std::unique_ptr<optimizer::StagedAdamW> opt_;  // Null when the rank owns no piece.
  std::unique_ptr<DeviceStep> device_;           // CUDA engine only.
};

// The state dump of a whole job (see the top of this file).
std::string DumpState(const std::vector<std::unique_ptr<DemoRank>>& ranks);

// Writes a small Llama-shaped BF16 model (2 layers, hidden 64) as model.safetensors in `dir`.
absl::Status WriteSmallModel(const std::string& dir);

}  // namespace ckpt::demo

#endif  // CKPT_DEMO_DEMO_MODEL_H_
