// Optimizer state as transactions on a CheckpointStore (DESIGN.md §6).
//
// Save (collective):
// 1. Every rank checks that its optimizer is clean (not poisoned) and, on the CUDA engine, that
//    the last step's copies reached the slabs; the ranks vote, so one refusal ends all.
// 2. BeginSave; every rank writes its pieces of every tensor straight from the slabs (no copy
//    of the state; the weights are the masters rounded, a block at a time: state_io.h), its
//    optimizer record and the trainer's blobs; Commit votes and publishes
//    (libckpt/store/commit.cc). The state is never changed.
// 3. On success the step becomes the free undo source while the state stays unchanged, and
//    its manifest's identity is remembered: a reload of it then reads nothing (Load's step
//    2(a'), optimizer/checkpointer_load.cc).
//
// SaveAsync (collective) and Finalize (collective):
// A1. As Save's step 1 (and no other async save in flight on this Checkpointer); BeginSave.
// A2. Take what is not in the slabs now: the layout record (groups, hyper-parameters, step
//     counters) and the trainer's blobs. Start the writer (optimizer/async_save.h) and install
//     it as the optimizer's fence; return.
// A3. Meanwhile the writer writes unit by unit, from the slabs, or from a copy a step made
//     before changing a unit not yet written; then the blobs; then it prepares this rank's side
//     of the commit (data durable, part written). A writer error frees every unit (steps go on)
//     and becomes this rank's no vote.
// A4. Finalize: wait for the writer; remove the fence.
// A5. Commit: vote and publish as Save's step 2. The saved step is clean (a free undo source)
//     only while the optimizer's state_version() is still what it was at A1.
//
// Load and LoadModel: optimizer/checkpointer_load.cc and optimizer/load_model.cc; the undo
// source and rollback they share: optimizer/checkpointer_rollback.cc.
#include "ckpt/optimizer/checkpointer.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "ckpt/base/status_macros.h"
#include "ckpt/formats/optimizer_record.h"
#include "optimizer/async_save.h"
#include "optimizer/state_io.h"
#include "optimizer/state_layout.h"

namespace ckpt::optimizer {

using formats::kOptimizerRecordBlob;
using internal::kTrainerPrefix;
using internal::StateLayout;

struct Checkpointer::InFlight {
  uint64_t step = 0;
  uint64_t version_at_call = 0;  // The optimizer's state_version() when the save began.
  std::unique_ptr<internal::AsyncSave> save;
  std::optional<StagedAdamW::FenceScope> fence;  // Over `save` until its writer is done.
};

Checkpointer::Checkpointer(StagedAdamW* optimizer, CheckpointStore* store,
                           Coordinator* coordinator, CheckpointerOptions options)
    : optimizer_(optimizer),
      store_(store),
      coordinator_(coordinator),
      options_(options) {}

Checkpointer::~Checkpointer() {
  if (in_flight_ == nullptr) return;
  in_flight_->save->Wait().IgnoreError();  // Destructors never report.
  in_flight_->fence.reset();
  in_flight_.reset();  // Destroys the unfinished transaction: a collective abort.
}

absl::Status Checkpointer::NoSaveInFlight(absl::string_view what) const {
  if (in_flight_ == nullptr) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(what, ": the async save of step ",
                                                    in_flight_->step,
                                                    " is in flight; Finalize() it first"));
}

bool PendingSave::writer_done() const {
  return finalized_ || owner_->in_flight_ == nullptr || owner_->in_flight_->save->writer_done();
}

absl::Status PendingSave::Finalize() { return owner_->FinalizeAsync(*this); }

AsyncSaveReport PendingSave::report() const {
  if (finalized_ || owner_->in_flight_ == nullptr || owner_->in_flight_->step != step_) {
    return report_;
  }
  const internal::AsyncSaveStats s = owner_->in_flight_->save->stats();
  return {s.units, s.units_copied, s.bytes_copied, s.step_waits};
}

absl::StatusOr<std::unique_ptr<Checkpointer>> Checkpointer::Create(StagedAdamW* optimizer,
                                                                   CheckpointStore* store,
                                                                   Coordinator* coordinator,
                                                                   CheckpointerOptions options) {
  if (optimizer == nullptr || store == nullptr || coordinator == nullptr) {
    return absl::InvalidArgumentError("Checkpointer needs an optimizer, a store and a coordinator");
  }
  return std::unique_ptr<Checkpointer>(new Checkpointer(optimizer, store, coordinator, options));
}

absl::Status Checkpointer::Vote(const absl::Status& mine) {
  CKPT_ASSIGN_OR_RETURN(std::vector<std::string> votes,
                        coordinator_->AllGather(EncodeStatus(mine)));
  for (size_t r = 0; r < votes.size(); ++r) {
    absl::Status s = DecodeStatus(votes[r]);
    if (!s.ok()) return Annotate(s, absl::StrCat("rank ", r));
  }
  return absl::OkStatus();
}

absl::Status Checkpointer::SaveInto(SaveTransaction& txn, const Blobs& blobs,
                                    uint64_t chunk_bytes) {
  const StateLayout layout = StateLayout::Of(*optimizer_);
  for (const TensorSpec& t : layout.Declarations()) CKPT_RETURN_IF_ERROR(txn.DeclareTensor(t));
  CKPT_RETURN_IF_ERROR(
      internal::WriteState(txn, layout, internal::SlabBytes(*optimizer_), chunk_bytes));
  const std::string record =
      internal::LayoutRecord(optimizer_->options().params, optimizer_->groups(),
                             optimizer_->param_steps(), optimizer_->options().moment_dtype,
                             coordinator_->size());
  CKPT_RETURN_IF_ERROR(txn.WriteBlob(kOptimizerRecordBlob, std::as_bytes(std::span(record))));
  for (const auto& [key, value] : blobs) {
    CKPT_RETURN_IF_ERROR(
        txn.WriteBlob(absl::StrCat(kTrainerPrefix, key), std::as_bytes(std::span(value))));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<SaveTransaction>> Checkpointer::BeginSave(uint64_t step,
                                                                         absl::string_view what) {
  // Every rank is in the same place with its async saves (they are collective), so this
  // refusal needs no vote.
  CKPT_RETURN_IF_ERROR(NoSaveInFlight(what));
  absl::Status ready = optimizer_->CheckClean("save");
  if (ready.ok()) ready = optimizer_->Synchronize();
  CKPT_RETURN_IF_ERROR(Vote(ready));
  return store_->BeginSave(step, coordinator_);
}

absl::Status Checkpointer::Save(uint64_t step, const Blobs& blobs) {
  // Steps 1 and 2.
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<SaveTransaction> txn, BeginSave(step, "save"));
  absl::Status written = SaveInto(*txn, blobs, store_->options().chunk_bytes);
  if (!written.ok()) {
    // The vote must go round so the others abort too; this rank already fails with `written`.
    txn->Abort().IgnoreError();
    return written;
  }
  CKPT_RETURN_IF_ERROR(txn->Commit());
  // Step 3.
  MarkClean(step, optimizer_->state_version(), nullptr);
  return absl::OkStatus();
}

void Checkpointer::MarkClean(uint64_t step, uint64_t version, const CheckpointReader* reader) {
  clean_step_ = step;
  clean_version_ = version;
  clean_identity_.reset();
  if (reader != nullptr) {
    clean_identity_ = internal::ManifestIdentity(reader->manifest());
    return;
  }
  // Just committed through this handle: what it wrote. Not opening it only costs the next
  // reload of it its shortcut.
  absl::StatusOr<std::unique_ptr<CheckpointReader>> opened = store_->OpenStep(step);
  if (opened.ok()) clean_identity_ = internal::ManifestIdentity((*opened)->manifest());
}

absl::StatusOr<std::unique_ptr<PendingSave>> Checkpointer::SaveAsync(uint64_t step,
                                                                     const Blobs& blobs) {
  // Step A1.
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<SaveTransaction> txn, BeginSave(step, "async save"));
  // Step A2: everything that is not in the slabs is taken now.
  std::vector<std::pair<std::string, std::string>> plan_blobs;
  plan_blobs.emplace_back(
      kOptimizerRecordBlob,
      internal::LayoutRecord(optimizer_->options().params, optimizer_->groups(),
                             optimizer_->param_steps(), optimizer_->options().moment_dtype,
                             coordinator_->size()));
  for (const auto& [key, value] : blobs) plan_blobs.emplace_back(kTrainerPrefix + key, value);
  // A slot holds the largest unit's state. The units change when parameters are added (a Muon
  // unit is a whole matrix, of any size): a pool made for smaller units is made again (no save
  // is in flight, so nothing uses it).
  uint64_t slot_bytes = 0;
  for (const Unit& u : optimizer_->units()) {
    slot_bytes = std::max(slot_bytes, internal::AsyncSave::UnitStateBytes(*optimizer_, u));
  }
  if (staging_ != nullptr && staging_->slot_bytes() < slot_bytes) staging_.reset();
  if (staging_ == nullptr) {
    const uint64_t slots =
        slot_bytes == 0 ? 0
                        : std::min<uint64_t>(options_.async_staging_bytes / slot_bytes,
                                             optimizer_->units().size());
    // None when the option allows no slot or the memory cannot be had: steps then wait.
    staging_ = internal::StagingPool::Create(slot_bytes, slots);
  }
  auto flight = std::make_unique<InFlight>();
  flight->step = step;
  flight->version_at_call = optimizer_->state_version();
  flight->save = std::make_unique<internal::AsyncSave>(*optimizer_, std::move(txn),
                                                       std::move(plan_blobs), staging_.get(), &Pool(),
                                                       store_->env());
  flight->fence.emplace(optimizer_->InstallFence(flight->save.get()));
  in_flight_ = std::move(flight);
  return std::unique_ptr<PendingSave>(new PendingSave(this, step));
}

absl::Status Checkpointer::FinalizeAsync(PendingSave& handle) {
  if (handle.finalized_ || in_flight_ == nullptr || in_flight_->step != handle.step_) {
    return absl::FailedPreconditionError(
        absl::StrCat("the async save of step ", handle.step_, " is already finalized"));
  }
  handle.finalized_ = true;
  // Step A4. The writer's error, if any, is already this rank's vote.
  in_flight_->save->Wait().IgnoreError();
  in_flight_->fence.reset();
  const internal::AsyncSaveStats stats = in_flight_->save->stats();
  handle.report_ = {stats.units, stats.units_copied, stats.bytes_copied, stats.step_waits};
  // Step A5.
  absl::Status committed = in_flight_->save->txn().Commit();
  if (committed.ok()) MarkClean(in_flight_->step, in_flight_->version_at_call, nullptr);
  in_flight_.reset();
  return committed;
}

}  // namespace ckpt::optimizer
