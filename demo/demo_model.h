// The demo trainer's model and ranks (demo/demo_trainer.cc): a HuggingFace model's floating
// tensors as BF16 parameters of StagedAdamW, cut over data-parallel ranks as Megatron's
// distributed optimizer does, a synthetic loss, a learning-rate schedule, and each rank's
// Checkpointer (optimizer/checkpointer.h: the checkpoint's layout is its).
//
// Trainer blobs saved with every step (Checkpointer blobs, "trainer.<key>" in the store):
//   lr_schedule   LrSchedule::Encode(): "warmup W total T peak P min M" (doubles as %.17g)
//   position      "next_step N": the step the run continues with (gradient noise is drawn by
//                 step number, so this is the data position)
//
// State dump (ckpt-demo-trainer --dump-state FILE, DumpState): every rank's whole state at the
// end of a run, so that two runs can be compared byte for byte. Integers and floats are
// little-endian; slab contents are the slabs' bytes as they are in memory (little-endian hosts):
//   "ckpt-demo-state 1\n"                     the magic, kStateDumpMagic
//   u32 ranks
//   per rank, in rank order:
//     u64 n                                    elements this rank owns (0 for a rank that owns
//                                              only padding)
//     u32 b                                    bytes per moment: 4 (FP32), 2 (BF16)
//     n*4 bytes master, n*b exp_avg, n*b exp_avg_sq   the optimizer's slabs
//     n*2 bytes                                the BF16 model weights
//     u32 groups; per group: u64 step, f64 lr, beta1, beta2, eps, weight_decay
#ifndef CKPT_DEMO_DEMO_MODEL_H_
#define CKPT_DEMO_DEMO_MODEL_H_

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "ckpt/base/status_macros.h"
#include "ckpt/checkpoint_store.h"
#include "ckpt/coordinator.h"
#include "ckpt/hf_checkpoint.h"
#include "ckpt/optimizer/checkpointer.h"
#include "ckpt/optimizer/layout.h"
#include "ckpt/optimizer/staged_adamw.h"
#include "demo/device_step.h"

namespace ckpt::demo {

inline constexpr std::string_view kStateDumpMagic = "ckpt-demo-state 1\n";
inline constexpr const char* kScheduleBlob = "lr_schedule";
inline constexpr const char* kPositionBlob = "position";

// Linear warmup to `peak` over steps 1..warmup, then a cosine from `peak` down to `min` at step
// `total`, flat at `min` after it (steps count from 1).
struct LrSchedule {
  int warmup = 2;
  int total = 12;
  double peak = 3e-3;
  double min = 3e-4;

  double At(int step) const;
  std::string Describe() const;  // For people: "warmup 2 steps to 3.0e-03, cosine to ...".
  std::string Encode() const;
  // kDataLoss naming the text when it is not what Encode() writes.
  static absl::StatusOr<LrSchedule> Decode(absl::string_view text);
};

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
  uint64_t elements_of(int rank) const;  // What rank `rank`'s pieces hold.
  int ranks() const { return static_cast<int>(pieces_.size()); }
  optimizer::EngineKind engine() const { return engine_; }
  optimizer::MomentDType moments() const { return moments_; }

  // Rank `rank`'s weights in slab order, rounded to BF16.
  absl::StatusOr<std::vector<uint16_t>> ReadHfWeights(const HfCheckpointReader& hf, int rank) const;
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

// One rank: its StagedAdamW, BF16 weights, gradient buffer and Checkpointer. Not thread-safe;
// each rank is driven by one thread.
class DemoRank {
 public:
  // Masters from `weights` (this rank's elements in slab order, empty for a rank that owns
  // nothing); its Checkpointer saves to and loads from `store` in the job `coordinator` joins
  // (no Checkpointer when `store` is null). Both must outlive the rank.
  static absl::StatusOr<std::unique_ptr<DemoRank>> Create(const DemoModel& model, int rank,
                                                          std::vector<uint16_t> weights,
                                                          CheckpointStore* store,
                                                          Coordinator* coordinator);

  // Sets every group's learning rate to `lr`, computes the gradient of the loss at the current
  // BF16 weights (plus noise fixed by `step`) and takes one optimizer step. Returns this rank's
  // part of the loss before the step.
  absl::StatusOr<double> Step(const DemoModel& model, int step, double lr);
  // Collective: the state as checkpoint `step`, with the trainer's blobs (optimizer/checkpointer.h).
  // kFailedPrecondition for a rank created without a store.
  absl::Status Save(uint64_t step, const optimizer::Blobs& blobs);
  // Collective: begins an async save of the state as it is now (Checkpointer::SaveAsync).
  // kFailedPrecondition for a rank created without a store.
  absl::StatusOr<std::unique_ptr<optimizer::PendingSave>> SaveAsync(
      uint64_t step, const optimizer::Blobs& blobs);
  // Collective: LATEST into this rank's state, whatever the layout that saved it.
  // kFailedPrecondition for a rank created without a store.
  absl::StatusOr<optimizer::LoadReport> Load(optimizer::Blobs* blobs);

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
  std::vector<uint16_t> weights_;  // Never resized: the Checkpointer keeps a view of it.
  std::vector<float> grads_;
  std::unique_ptr<optimizer::StagedAdamW> opt_;
  std::unique_ptr<optimizer::Checkpointer> ckpt_;
  std::unique_ptr<DeviceStep> device_;  // CUDA engine only.
};

// The state dump of a whole job (see the top of this file).
std::string DumpState(const std::vector<std::unique_ptr<DemoRank>>& ranks);

// Writes a small Llama-shaped BF16 model (2 layers, hidden 64) as model.safetensors in `dir`.
absl::Status WriteSmallModel(const std::string& dir);

}  // namespace ckpt::demo

#endif  // CKPT_DEMO_DEMO_MODEL_H_
