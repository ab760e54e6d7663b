// Optimizer state as transactions on a CheckpointStore (DESIGN.md §6).
//
// Save (collective):
// 1. Every rank checks that its optimizer is clean (not poisoned) and, on the CUDA engine, that
//    the last step's copies reached the slabs; the ranks vote, so one refusal ends all.
// 2. BeginSave; every rank writes its pieces of every tensor straight from the slabs and the
//    weight buffer (no copy of the state), its layout record and the trainer's blobs; Commit
//    votes and publishes (libckpt/checkpoint_writer.cc). The state is never changed.
// 3. On success the step becomes the free undo source while the state stays unchanged.
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
// Load (collective); a failure at any step ends it on every rank with the same error:
// 1. Preflight, nothing touched: rank 0 resolves LATEST and broadcasts it (one step for all);
//    the CUDA engine's last copies are awaited; open the step, check names (missing and extra ones
//    listed), dtypes, shapes, that its pieces cover every element this rank owns, and the layout
//    record (groups, valid hyper-parameters, every parameter in the same group as here). Vote.
// 2. Fix the undo source, the cheapest that holds: (a) the step the state last equalled, if the
//    optimizer's state_version() has not moved since and it is not the step being loaded (it
//    costs nothing); (b) the state re-derived (StateIsDerivable: every step 0, both moments
//    zero, masters the weight buffer widened, as a freshly built or model-loaded optimizer's
//    are), so a resume in a new process writes nothing before it reads and works on a full disk
//    or a read-only store; otherwise (c) spill the state into a private store
//    <root>/.undo-rank-R-<nonce>/ (checksummed chunks, written straight from the slabs: memory
//    bounded by two chunks; a read-only handle refuses). Vote; a failure removes the spills,
//    the state untouched.
// 3. Apply: lifecycle kLoading; read every piece straight into the slabs (moments converted in
//    bounded batches when the dtypes differ), then the groups. The weight buffer is not touched
//    here: (b) re-derives the masters from it.
// 4. Vote. All OK: the weights := the masters rounded to the model dtype (what every save
//    writes as the weights), lifecycle kClean, the loaded step is the new undo source. Any
//    failure: every rank restores from its undo source ((a), (c): as step 3; (b): masters from
//    the weights, moments zero, the groups as they were); a restore that fails poisons the
//    optimizer (Step, SetGroup and Save refuse until a complete Load).
// 5. Remove the spill (best effort: recovery removes .undo-* directories at the next Open).
#include "ckpt/optimizer/checkpointer.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <set>
#include <thread>
#include <vector>


#include "absl/cleanup/cleanup.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "ckpt/base/status_macros.h"
#include "ckpt/formats/convert.h"
#include "ckpt/formats/optimizer_record.h"
#include "optimizer/async_save.h"
#include "optimizer/new_directory.h"
#include "optimizer/state_io.h"
#include "optimizer/state_layout.h"
#include "optimizer/thread_pool.h"
#include "optimizer/engine.h"

namespace ckpt::optimizer {
namespace {

using formats::DType;
using formats::kOptimizerRecordBlob;
using internal::kTrainerPrefix;
using internal::ListNames;
using internal::StateKind;
using internal::StateLayout;

// The step's optimizer record (formats/optimizer_record.h), of an AdamW optimizer.
absl::StatusOr<formats::OptimizerRecord> ReadRecord(const CheckpointReader& reader,
                                                    absl::string_view where) {
  CKPT_ASSIGN_OR_RETURN(std::string text, reader.ReadBlob(kOptimizerRecordBlob, 0));
  CKPT_ASSIGN_OR_RETURN(formats::OptimizerRecord record,
                        formats::ParseOptimizerRecord(text, where));
  if (record.kind != formats::kOptimizerKindAdamW) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, " holds the state of a \"", record.kind, "\" optimizer, not AdamW's"));
  }
  return record;
}

// The record's groups, validated, as this optimizer's `expected` groups.
absl::StatusOr<std::vector<ParamGroup>> RecordGroups(const formats::OptimizerRecord& record,
                                                     size_t expected, absl::string_view where) {
  if (record.groups.size() != expected) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": ", record.groups.size(),
                                                   " param groups, the optimizer has ", expected));
  }
  std::vector<ParamGroup> out;
  for (const formats::OptimizerRecordGroup& g : record.groups) {
    ParamGroup p{g.lr, g.beta1, g.beta2, g.eps, g.weight_decay, g.step};
    CKPT_RETURN_IF_ERROR(ValidateHyperParameters(p, out.size()));
    out.push_back(p);
  }
  return out;
}

// Refuses a record that puts any of `params` in another group than the optimizer does: each
// group's hyper-parameters would land on other parameters. The record's parameter order may
// differ (a checkpoint loads at any parameter order, DESIGN.md §2); names it lacks are the
// tensor check's to report.
absl::Status CheckParamGroups(const formats::OptimizerRecord& record,
                              const std::vector<ParamSpec>& params, absl::string_view where) {
  std::map<std::string, uint64_t> saved;
  for (const formats::OptimizerRecordParam& p : record.params) saved[p.name] = p.group;
  std::vector<std::string> moved;
  for (const ParamSpec& p : params) {
    auto it = saved.find(p.name);
    if (it != saved.end() && it->second != p.group) {
      moved.push_back(absl::StrCat(p.name, " (group ", it->second, " in the checkpoint, ", p.group,
                                   " here)"));
    }
  }
  if (moved.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      where, " puts ", moved.size(), " parameter(s) in other param groups than this optimizer: ",
      internal::ListNames(moved), "; their hyper-parameters would change, so nothing was loaded"));
}

}  // namespace


// Where a failed load rolls back from: a committed step (the store's, or a private spill). It
// is opened once when fixed (so a load never starts without a readable undo source), closed
// during the apply, and opened again to restore.
struct Checkpointer::Undo {
  std::unique_ptr<CheckpointStore> spill_store;  // Null for a committed step of the store.
  std::string spill_dir;
  uint64_t step = 0;  // In the store, or 1 in the spill.
  // Set when the state is re-derived instead (StateIsDerivable): the groups to put back.
  std::optional<std::vector<ParamGroup>> derived_groups;
};

struct Checkpointer::InFlight {
  uint64_t step = 0;
  uint64_t version_at_call = 0;  // The optimizer's state_version() when the save began.
  std::unique_ptr<internal::AsyncSave> save;
  std::optional<StagedAdamW::FenceScope> fence;  // Over `save` until its writer is done.
};

Checkpointer::Checkpointer(StagedAdamW* optimizer, std::span<std::byte> weights,
                           CheckpointStore* store, Coordinator* coordinator,
                           CheckpointerOptions options)
    : optimizer_(optimizer),
      weights_(weights),
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
                                                                   std::span<std::byte> weights,
                                                                   CheckpointStore* store,
                                                                   Coordinator* coordinator,
                                                                   CheckpointerOptions options) {
  if (optimizer == nullptr || store == nullptr || coordinator == nullptr) {
    return absl::InvalidArgumentError("Checkpointer needs an optimizer, a store and a coordinator");
  }
  const uint64_t want = optimizer->size() * formats::DTypeSize(optimizer->model_dtype());
  if (weights.size() != want) {
    return absl::InvalidArgumentError(absl::StrCat("weight buffer has ", weights.size(),
                                                   " bytes, the optimizer's elements need ", want));
  }
  return std::unique_ptr<Checkpointer>(
      new Checkpointer(optimizer, weights, store, coordinator, options));
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
                             optimizer_->options().moment_dtype, coordinator_->size());
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
  clean_step_ = step;
  clean_version_ = optimizer_->state_version();
  return absl::OkStatus();
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
                             optimizer_->options().moment_dtype, coordinator_->size()));
  for (const auto& [key, value] : blobs) plan_blobs.emplace_back(kTrainerPrefix + key, value);
  if (staging_ == nullptr) {
    uint64_t slot_bytes = 0;
    for (const Unit& u : optimizer_->units()) {
      slot_bytes = std::max(slot_bytes, internal::AsyncSave::UnitStateBytes(*optimizer_, u));
    }
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
                                                       std::move(plan_blobs), staging_.get());
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
  if (committed.ok()) {
    clean_step_ = in_flight_->step;
    clean_version_ = in_flight_->version_at_call;
  }
  in_flight_.reset();
  return committed;
}

absl::Status Checkpointer::Preflight(const CheckpointReader& reader) const {
  const formats::Manifest& m = reader.manifest();
  const StagedAdamWOptions& o = optimizer_->options();
  const std::string where = absl::StrCat("step ", m.step);
  std::map<std::string, uint32_t> index;
  for (uint32_t i = 0; i < m.tensors.size(); ++i) index[m.tensors[i].name] = i;
  std::set<std::string> expected;
  std::vector<std::string> missing, extra;
  const StateLayout layout = StateLayout::Of(*optimizer_);
  for (uint32_t p = 0; p < o.params.size(); ++p) {
    for (StateKind kind : layout.kinds()) expected.insert(layout.name(p, kind));
  }
  for (const std::string& name : expected) {
    if (!index.count(name)) missing.push_back(name);
  }
  for (const auto& [name, i] : index) {
    if (!expected.count(name)) extra.push_back(name);
  }
  if (!missing.empty() || !extra.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, " does not hold this optimizer's state",
        missing.empty() ? "" : absl::StrCat("; missing ", missing.size(), ": ", ListNames(missing)),
        extra.empty() ? ""
                      : absl::StrCat("; not in the optimizer ", extra.size(), ": ",
                                     ListNames(extra))));
  }
  // The moments may be stored as F32 or BF16 (a load converts them), both alike.
  const DType moments = m.tensors[index[layout.name(0, StateKind::kExpAvg)]].dtype;
  for (uint32_t p = 0; p < o.params.size(); ++p) {
    for (StateKind kind : layout.kinds()) {
      const bool moment = kind == StateKind::kExpAvg || kind == StateKind::kExpAvgSq;
      const DType want = moment ? moments : layout.dtype(kind);
      const std::string& name = layout.name(p, kind);
      const formats::TensorInfo& t = m.tensors[index[name]];
      if (t.shape != o.params[p].shape || t.dtype != want ||
          (moment && t.dtype != DType::kF32 && t.dtype != DType::kBF16)) {
        return absl::InvalidArgumentError(absl::StrCat(
            where, ": tensor \"", name, "\" is ", formats::DTypeName(t.dtype), " [",
            absl::StrJoin(t.shape, ", "), "], the optimizer needs ", formats::DTypeName(want),
            " [", absl::StrJoin(o.params[p].shape, ", "), "]"));
      }
    }
  }
  for (const Piece& piece : o.pieces) {
    for (StateKind kind : layout.kinds()) {
      const std::string& name = layout.name(piece.param, kind);
      if (!internal::Covers(m, index[name], piece.begin, piece.count)) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, " does not cover elements [", piece.begin, ", ",
                         piece.begin + piece.count, ") of \"", name, "\", which this rank owns"));
      }
    }
  }
  CKPT_ASSIGN_OR_RETURN(formats::OptimizerRecord record, ReadRecord(reader, where));
  CKPT_RETURN_IF_ERROR(RecordGroups(record, o.groups.size(), where).status());
  return CheckParamGroups(record, o.params, where);
}

absl::Status Checkpointer::Apply(const CheckpointReader& reader, Blobs* blobs,
                                 StagedAdamW::LoadScope& scope) {
  const formats::Manifest& m = reader.manifest();
  const StagedAdamWOptions& o = optimizer_->options();
  const std::string where = absl::StrCat("step ", m.step);
  CKPT_ASSIGN_OR_RETURN(formats::OptimizerRecord record, ReadRecord(reader, where));
  CKPT_ASSIGN_OR_RETURN(std::vector<ParamGroup> groups,
                        RecordGroups(record, o.groups.size(), where));
  // The weights are not read: they are the masters rounded, written once the load has been
  // voted (Transact), so that until then the weight buffer still holds what a rollback may
  // re-derive the masters from.
  CKPT_RETURN_IF_ERROR(internal::ReadState(
      reader, StateLayout::Of(*optimizer_),
      {reinterpret_cast<std::byte*>(optimizer_->mutable_master().data()),
       optimizer_->mutable_exp_avg_bytes().data(), optimizer_->mutable_exp_avg_sq_bytes().data()}));
  scope.RestoreGroups(groups);
  if (blobs == nullptr) return absl::OkStatus();
  // This rank's trainer blobs, or rank 0's when the checkpoint was saved by fewer ranks.
  const uint32_t rank = static_cast<uint32_t>(coordinator_->rank()) < m.world_size
                            ? static_cast<uint32_t>(coordinator_->rank())
                            : 0;
  Blobs out;
  for (const formats::BlobInfo& b : m.blobs) {
    if (b.rank != rank || b.name.rfind(kTrainerPrefix, 0) != 0) continue;
    CKPT_ASSIGN_OR_RETURN(out[b.name.substr(sizeof(kTrainerPrefix) - 1)],
                          reader.ReadBlob(b.name, rank));
  }
  *blobs = std::move(out);
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Checkpointer::Undo>> Checkpointer::FixUndoSource(
    std::optional<uint64_t> exclude) {
  auto undo = std::make_unique<Undo>();
  // The step being loaded is no undo source for itself: a chunk that fails the apply would fail
  // the restore too.
  if (clean_step_.has_value() && clean_step_ != exclude &&
      clean_version_ == optimizer_->state_version()) {
    if (store_->OpenStep(*clean_step_).ok()) {
      undo->step = *clean_step_;
      return undo;
    }
  }
  // A fresh (or model-loaded) state is re-derived on a rollback: nothing to write.
  if (StateIsDerivable()) {
    undo->derived_groups = optimizer_->groups();
    return undo;
  }
  // A private single-rank store below the root: its chunks are checksummed and written from the
  // slabs as they are, so the spill holds no second copy of the state in memory.
  if (store_->options().read_only) {
    return absl::FailedPreconditionError(
        absl::StrCat(store_->root(),
                     ": a load whose undo source must be spilled needs a writable store "
                     "handle (the spill goes below the root)"));
  }
  undo->spill_dir =
      JoinPath(store_->root(), absl::StrFormat(".undo-rank-%05d-%016x", coordinator_->rank(),
                                               internal::RandomNonce()));
  StoreOptions options = store_->options();
  options.primary = true;
  options.read_only = false;
  options.retention = RetentionPolicy{};
  options.logger = nullptr;
  // Two writer threads still overlap copying with writing, and hold two chunk buffers: the
  // spill's memory stays within a chunk or two however many threads a save uses.
  options.write_threads = std::min(options.write_threads, 2);
  // A spill that fails (ENOSPC, say) must not stay behind, possibly nearly a full copy.
  absl::Cleanup remove = [&] { RemoveSpill(*undo); };
  CKPT_ASSIGN_OR_RETURN(undo->spill_store, CheckpointStore::Open(undo->spill_dir, options));
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<SaveTransaction> txn, undo->spill_store->BeginSave(1));
  absl::Status written = SaveInto(*txn, {}, options.chunk_bytes);
  if (!written.ok()) {
    // Already failing with `written`; the abort only ends this private transaction.
    txn->Abort().IgnoreError();
    return written;
  }
  CKPT_RETURN_IF_ERROR(txn->Commit());
  undo->step = 1;
  CKPT_RETURN_IF_ERROR(undo->spill_store->OpenStep(undo->step).status());
  std::move(remove).Cancel();
  return undo;
}

void Checkpointer::RemoveSpill(Undo& undo) {
  if (undo.spill_dir.empty()) return;
  undo.spill_store.reset();  // Releases its LOCK before the tree goes.
  // Best effort: recovery removes .undo-* at the next Open of the root.
  RemoveRecursively(store_->env(), undo.spill_dir).IgnoreError();
  store_->env()->SyncDir(store_->root()).IgnoreError();
  undo.spill_dir.clear();
}

namespace {

// True when every byte of `bytes` is zero; word by word, which the compiler vectorises.
bool AllZero(std::span<const std::byte> bytes) {
  const size_t words = bytes.size() / 8;
  constexpr size_t kBlock = 1 << 12;  // Words per block: an early exit without a branch per word.
  for (size_t at = 0; at < words; at += kBlock) {
    uint64_t any = 0;
    const size_t end = std::min(words, at + kBlock);
    for (size_t i = at; i < end; ++i) {
      uint64_t w;
      std::memcpy(&w, bytes.data() + 8 * i, 8);
      any |= w;
    }
    if (any != 0) return false;
  }
  for (size_t i = words * 8; i < bytes.size(); ++i) {
    if (bytes[i] != std::byte{0}) return false;
  }
  return true;
}

}  // namespace

bool Checkpointer::StateIsDerivable() const {
  for (const ParamGroup& g : optimizer_->groups()) {
    if (g.step != 0) return false;
  }
  // Blocks of 4 MiB of masters, scanned on the optimizer's threads (a fresh process's load
  // runs this scan before it reads: one core alone would cost a fifth of the load).
  constexpr size_t kBlock = size_t{1} << 20;
  const std::span<const float> master = optimizer_->master();
  const std::span<const std::byte> exp_avg = optimizer_->exp_avg_bytes();
  const std::span<const std::byte> exp_avg_sq = optimizer_->exp_avg_sq_bytes();
  // Moments never written are zero without a read (which would fault in every page of them).
  const bool check_moments = !optimizer_->moments_untouched();
  const size_t moment_block = kBlock * optimizer_->moment_bytes();
  const DType model = optimizer_->model_dtype();
  const size_t blocks = (master.size() + kBlock - 1) / kBlock;
  std::atomic<bool> differs{false};
  const int threads = optimizer_->options().threads > 0
                          ? optimizer_->options().threads
                          : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  internal::ThreadPool pool(std::min<int>(threads, static_cast<int>(std::max<size_t>(1, blocks))));
  pool.ParallelFor(blocks, [&](size_t b) {
    if (differs.load(std::memory_order_relaxed)) return;
    const size_t at = b * kBlock;
    const size_t end = std::min(master.size(), at + kBlock);
    bool same = true;
    if (check_moments) {
      for (std::span<const std::byte> m : {exp_avg, exp_avg_sq}) {
        const size_t lo = std::min(m.size(), b * moment_block);
        same = same && AllZero(m.subspan(lo, std::min(m.size() - lo, moment_block)));
      }
    }
    // The weights widened, a stack block at a time, against the masters.
    constexpr size_t kWiden = 2048;
    const size_t wsize = formats::DTypeSize(model);
    float widened[kWiden];
    for (size_t i = at; same && i < end; i += kWiden) {
      const size_t n = std::min(kWiden, end - i);
      formats::Convert(model, weights_.subspan(i * wsize, n * wsize), DType::kF32,
                       std::as_writable_bytes(std::span(widened, n)));
      same = std::memcmp(widened, master.data() + i, n * 4) == 0;
    }
    if (!same) differs.store(true, std::memory_order_relaxed);
  });
  return !differs.load();
}

void Checkpointer::WriteWeightsFromMasters() {
  formats::Convert(DType::kF32, std::as_bytes(optimizer_->master()), optimizer_->model_dtype(),
                   weights_);
}

absl::Status Checkpointer::RestoreFrom(Undo& undo, StagedAdamW::LoadScope& scope) {
  if (undo.derived_groups.has_value()) {
    // The construction state again, from the weight buffer no load step has touched.
    formats::Convert(optimizer_->model_dtype(), weights_, DType::kF32,
                     std::as_writable_bytes(optimizer_->mutable_master()));
    for (std::span<std::byte> moment :
         {optimizer_->mutable_exp_avg_bytes(), optimizer_->mutable_exp_avg_sq_bytes()}) {
      std::memset(moment.data(), 0, moment.size());
    }
    scope.RestoreGroups(*undo.derived_groups);
    return absl::OkStatus();
  }
  CheckpointStore* from = undo.spill_store != nullptr ? undo.spill_store.get() : store_;
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> reader, from->OpenStep(undo.step));
  return Apply(*reader, nullptr, scope);
}

absl::StatusOr<uint64_t> Checkpointer::AgreeOnLatest(Env* env, const std::string& root) {
  std::string named;
  if (coordinator_->rank() == 0) {
    absl::StatusOr<std::optional<uint64_t>> latest = ReadLatest(env, root);
    if (latest.ok() && !latest->has_value()) {
      latest = absl::NotFoundError(absl::StrCat(root, ": no committed step to load"));
    }
    named = latest.ok() ? absl::StrCat("ok ", **latest) : EncodeStatus(latest.status());
  }
  CKPT_ASSIGN_OR_RETURN(named, coordinator_->Broadcast(named, 0));
  uint64_t latest = 0;
  absl::string_view view = named;
  if (!absl::ConsumePrefix(&view, "ok ") || !absl::SimpleAtoi(view, &latest)) {
    absl::Status why = DecodeStatus(named);
    return why.ok() ? absl::InternalError("malformed LATEST from rank 0") : why;
  }
  return latest;
}

absl::Status Checkpointer::Transact(std::optional<uint64_t> exclude,
                                    const std::function<absl::Status(StagedAdamW::LoadScope&)>& apply,
                                    absl::string_view what, bool* undo_spilled,
                                    bool* undo_derived) {
  // Step 2.
  absl::StatusOr<std::unique_ptr<Undo>> undo = FixUndoSource(exclude);
  absl::Status fixed = undo.ok() ? absl::OkStatus() : undo.status();
  auto remove_spill = [&] {
    if (undo.ok()) RemoveSpill(**undo);
  };
  absl::Status voted = Vote(fixed);
  if (!voted.ok()) {
    remove_spill();
    return voted;
  }
  *undo_spilled = !(*undo)->spill_dir.empty();
  *undo_derived = (*undo)->derived_groups.has_value();
  // Step 3.
  StagedAdamW::LoadScope scope = optimizer_->BeginLoad();
  absl::Status applied = apply(scope);
  // Step 4.
  voted = Vote(applied);
  if (voted.ok()) {
    WriteWeightsFromMasters();
    scope.Commit();
    remove_spill();
    return absl::OkStatus();
  }
  absl::Status restored = RestoreFrom(**undo, scope);
  std::string poison_reason;
  if (restored.ok()) {
    scope.RolledBack();
    // The state equals the undo source again.
    if ((*undo)->spill_dir.empty() && !(*undo)->derived_groups.has_value()) {
      clean_version_ = optimizer_->state_version();
    }
  } else {
    poison_reason = absl::StrCat(what, " failed (", voted.message(),
                                 ") and its rollback failed too (", restored.message(), ")");
    scope.Poison(poison_reason);
    clean_step_.reset();
  }
  // Step 5.
  remove_spill();
  if (!restored.ok()) {
    // Not the apply's code: the state is not as before, and no caller may go on as if it were.
    return absl::FailedPreconditionError(
        absl::StrCat("the optimizer is poisoned: ", poison_reason));
  }
  return voted;
}

absl::StatusOr<LoadReport> Checkpointer::Load(std::optional<uint64_t> step, Blobs* blobs) {
  absl::StatusOr<LoadReport> loaded = LoadStep(step, blobs);
  if (!absl::IsDataLoss(loaded.status())) return loaded;
  return Annotate(loaded.status(),
                  "the state is as before the load. To go on, load the newest older step that "
                  "loads intact (Checkpointer::LoadNewestIntact; Python: load(fallback=True)), "
                  "or set the damaged step aside: ckpt-tool quarantine ROOT STEP");
}

absl::StatusOr<LoadReport> Checkpointer::LoadNewestIntact(Blobs* blobs) {
  CKPT_RETURN_IF_ERROR(NoSaveInFlight("load"));
  // LATEST as rank 0 reads it; a damaged LATEST (a read-only handle runs no recovery) leaves
  // every step a candidate.
  absl::StatusOr<uint64_t> latest = AgreeOnLatest(store_->env(), store_->root());
  if (!latest.ok() && !absl::IsDataLoss(latest.status())) return latest.status();
  // The candidates as rank 0 lists them, so that every rank walks the same steps.
  std::string listed;
  if (coordinator_->rank() == 0) {
    absl::StatusOr<std::vector<uint64_t>> steps = RetainableSteps(store_->env(), store_->root());
    listed = steps.ok() ? absl::StrCat("ok ", absl::StrJoin(*steps, " "))
                        : EncodeStatus(steps.status());
  }
  CKPT_ASSIGN_OR_RETURN(listed, coordinator_->Broadcast(listed, 0));
  absl::string_view view = listed;
  if (!absl::ConsumePrefix(&view, "ok")) {
    absl::Status why = DecodeStatus(listed);
    return why.ok() ? absl::InternalError("malformed step list from rank 0") : why;
  }
  std::vector<uint64_t> candidates;
  if (latest.ok()) candidates.push_back(*latest);
  std::vector<uint64_t> older;
  for (absl::string_view token : absl::StrSplit(view, ' ', absl::SkipEmpty())) {
    uint64_t s = 0;
    if (!absl::SimpleAtoi(token, &s)) return absl::InternalError("malformed step list from rank 0");
    if (!latest.ok() || s < *latest) older.push_back(s);
  }
  candidates.insert(candidates.end(), older.rbegin(), older.rend());
  std::vector<std::string> skipped;
  std::vector<uint64_t> skipped_steps;
  for (uint64_t step : candidates) {
    absl::StatusOr<LoadReport> r = LoadStep(step, blobs);
    if (r.ok()) {
      SetAsideSkipped(skipped_steps, skipped);
      r->skipped = std::move(skipped);
      return r;
    }
    // Only damage passes over a step (a poisoned optimizer, a refusal or an IO error ends it).
    if (!absl::IsDataLoss(r.status())) return r.status();
    skipped.push_back(absl::StrCat("step ", step, ": ", r.status().message()));
    skipped_steps.push_back(step);
  }
  return absl::DataLossError(absl::StrCat(store_->root(), ": no step loads intact (",
                                          absl::StrJoin(skipped, "; "),
                                          "); the state is as before the call"));
}

void Checkpointer::SetAsideSkipped(const std::vector<uint64_t>& steps,
                                   std::vector<std::string>& skipped) {
  // Rank 0's primary, writable handle moves the damaged steps it passed over into quarantine/
  // (newest first, so that LATEST falls back onto the step loaded): the next save then need
  // not be newer than a damaged step, and nothing is deleted. Elsewhere they stay, said so.
  const bool writable = store_->options().primary && !store_->options().read_only;
  for (size_t i = 0; i < steps.size(); ++i) {
    if (coordinator_->rank() != 0) continue;
    if (!writable) {
      absl::StrAppend(&skipped[i], " (left in place: a read-only handle; ckpt-tool quarantine "
                                   "ROOT STEP sets it aside)");
      continue;
    }
    absl::StatusOr<std::string> moved = store_->QuarantineStep(steps[i]);
    absl::StrAppend(&skipped[i], moved.ok() ? absl::StrCat(" (moved into ", *moved, ")")
                                            : absl::StrCat(" (could not be set aside: ",
                                                           moved.status().message(), ")"));
  }
}

absl::StatusOr<LoadReport> Checkpointer::LoadStep(std::optional<uint64_t> step, Blobs* blobs) {
  CKPT_RETURN_IF_ERROR(NoSaveInFlight("load"));
  // Step 1. LATEST is read afresh (another handle may have committed since this one opened) by
  // rank 0 alone and broadcast, so no rank can load another step from a stale cache.
  if (!step.has_value()) {
    CKPT_ASSIGN_OR_RETURN(step, AgreeOnLatest(store_->env(), store_->root()));
  }
  // The CUDA engine's last copies must have reached the slabs before they are spilled or
  // overwritten.
  absl::Status checked = optimizer_->Synchronize();
  absl::StatusOr<std::unique_ptr<CheckpointReader>> reader = store_->OpenStep(*step);
  if (checked.ok()) checked = reader.ok() ? Preflight(**reader) : reader.status();
  CKPT_RETURN_IF_ERROR(Vote(checked));
  // Steps 2 to 5.
  LoadReport report;
  report.step = (*reader)->manifest().step;
  report.saved_world_size = (*reader)->manifest().world_size;
  absl::StatusOr<const formats::TensorInfo*> moments =
      (*reader)->FindTensor(
          internal::StateTensorName(StateKind::kExpAvg, optimizer_->options().params[0].name));
  if (moments.ok()) report.saved_moment_dtype = (*moments)->dtype;
  Blobs loaded;
  CKPT_RETURN_IF_ERROR(Transact(
      *step,
      [&](StagedAdamW::LoadScope& scope) {
        return Apply(**reader, blobs != nullptr ? &loaded : nullptr, scope);
      },
      absl::StrCat("load of step ", report.step), &report.undo_spilled, &report.undo_derived));
  clean_step_ = report.step;
  clean_version_ = optimizer_->state_version();
  if (blobs != nullptr) *blobs = std::move(loaded);
  return report;
}

}  // namespace ckpt::optimizer
