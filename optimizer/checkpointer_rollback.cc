// A load's undo source and rollback (Load's steps 2, 4 and 5 in optimizer/checkpointer_load.cc,
// shared by the model-only load, optimizer/load_model.cc): Transact fixes the cheapest undo
// source that holds, votes, applies under a LoadScope, votes again, and then commits, or
// restores from the undo source, or poisons the optimizer when the restore fails too.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <new>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "ckpt/base/status_macros.h"
#include "ckpt/formats/convert.h"
#include "ckpt/optimizer/checkpointer.h"
#include "optimizer/new_directory.h"
#include "optimizer/thread_pool.h"

namespace ckpt::optimizer {

using formats::DType;

// Where a failed load rolls back from: a committed step (the store's, or a private spill). It
// is opened once when fixed (so a load never starts without a readable undo source), closed
// during the apply, and opened again to restore.
struct Checkpointer::Undo {
  std::unique_ptr<CheckpointStore> spill_store;  // Null for a committed step of the store.
  std::string spill_dir;
  uint64_t step = 0;  // In the store, or 1 in the spill.
  // Set when the state is re-derived instead (CopyIfDerivable): the groups to put back, and
  // the masters in `derived_dtype` (exact: the model dtype when each master is a value of it,
  // FP32 otherwise).
  std::optional<std::vector<ParamGroup>> derived_groups;
  std::unique_ptr<std::byte[]> derived_masters;
  DType derived_dtype = DType::kF32;
  // Load's step 2(a'): the state equals the step being loaded and the apply writes nothing to
  // it, so the state itself is the undo source and a rollback has nothing to restore.
  bool unchanged = false;
};

absl::StatusOr<std::unique_ptr<Checkpointer::Undo>> Checkpointer::FixUndoSource(
    std::optional<uint64_t> exclude, bool unchanged) {
  auto undo = std::make_unique<Undo>();
  if (unchanged) {
    undo->unchanged = true;
    return undo;
  }
  // The step being loaded is no undo source for itself: a chunk that fails the apply would fail
  // the restore too.
  if (clean_step_.has_value() && clean_step_ != exclude &&
      clean_version_ == optimizer_->state_version()) {
    if (store_->OpenStep(*clean_step_).ok()) {
      undo->step = *clean_step_;
      return undo;
    }
  }
  // A fresh (or model-loaded) state is re-derived on a rollback from a copy of the masters
  // kept in memory: nothing to write.
  std::string why_not_derived;
  if (std::unique_ptr<std::byte[]> copy = CopyIfDerivable(&undo->derived_dtype, &why_not_derived);
      copy != nullptr) {
    undo->derived_groups = optimizer_->groups();
    undo->derived_masters = std::move(copy);
    return undo;
  }
  // A private single-rank store below the root: its chunks are checksummed and written from the
  // slabs as they are, so the spill holds no second copy of the state in memory.
  if (store_->options().read_only) {
    return absl::FailedPreconditionError(absl::StrCat(
        store_->root(),
        ": a load whose undo source must be spilled needs a writable store handle (the spill "
        "goes below the root)",
        why_not_derived.empty() ? "" : absl::StrCat("; ", why_not_derived)));
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
  // Its errors say what was being written: the spill's own "save step 1" would read as if the
  // checkpoint were being rewritten.
  const std::string what = absl::StrCat(
      "writing the load's undo copy of the optimizer state to ", undo->spill_dir,
      " (the checkpoints of the store are untouched)");
  absl::StatusOr<std::unique_ptr<CheckpointStore>> spill =
      CheckpointStore::Open(undo->spill_dir, options);
  if (!spill.ok()) return Annotate(spill.status(), what);
  undo->spill_store = *std::move(spill);
  absl::StatusOr<std::unique_ptr<SaveTransaction>> txn = undo->spill_store->BeginSave(1);
  if (!txn.ok()) return Annotate(txn.status(), what);
  absl::Status written = SaveInto(**txn, {}, options.chunk_bytes);
  if (!written.ok()) {
    // Already failing with `written`; the abort only ends this private transaction.
    (*txn)->Abort().IgnoreError();
    return Annotate(written, what);
  }
  if (absl::Status committed = (*txn)->Commit(); !committed.ok()) {
    return Annotate(committed, what);
  }
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

// CopyIfDerivable's copy of the masters: `bytes` (and a byte more), or null with `why_not` set
// when it and the `faulted_moments` bytes the load would touch exceed the `available` memory
// or the allocation fails.
std::unique_ptr<std::byte[]> AllocateCopy(uint64_t bytes, uint64_t faulted_moments,
                                          std::optional<uint64_t> available,
                                          std::string* why_not) {
  if (available.has_value() && bytes + faulted_moments > *available) {
    *why_not = absl::StrFormat(
        "a copy of the masters in memory instead would need %d bytes (and the load %d for "
        "the moments), more than the %d available",
        bytes, faulted_moments, *available);
    return nullptr;
  }
  std::unique_ptr<std::byte[]> copy(new (std::nothrow) std::byte[bytes + 1]);
  if (copy == nullptr) {
    *why_not = absl::StrFormat("a copy of the masters in memory instead (%d bytes) could "
                               "not be allocated", bytes);
  }
  return copy;
}

// The masters [at, end) rounded into `copy` (elements of `model`), then widened back a stack
// block at a time: equal when each master is exactly a model-dtype value. Sets `inexact` when
// one is not, and stops once it is set (by any thread).
void RoundMasters(std::span<const float> master, size_t at, size_t end, DType model,
                  std::byte* copy, std::atomic<bool>& inexact) {
  const size_t wsize = formats::DTypeSize(model);
  constexpr size_t kWiden = 2048;
  float widened[kWiden];
  for (size_t i = at; i < end && !inexact.load(std::memory_order_relaxed); i += kWiden) {
    const size_t n = std::min(kWiden, end - i);
    const std::span<std::byte> rounded(copy + i * wsize, n * wsize);
    formats::Convert(DType::kF32, std::as_bytes(master.subspan(i, n)), model, rounded);
    if (model == DType::kF32) continue;
    formats::Convert(model, rounded, DType::kF32, std::as_writable_bytes(std::span(widened, n)));
    if (std::memcmp(widened, master.data() + i, n * 4) != 0) {
      inexact.store(true, std::memory_order_relaxed);
    }
  }
}

}  // namespace

internal::ThreadPool& Checkpointer::Pool() {
  if (pool_ == nullptr) {
    const int threads =
        optimizer_->options().threads > 0
            ? optimizer_->options().threads
            : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    pool_ = std::make_unique<internal::ThreadPool>(threads);
  }
  return *pool_;
}

std::unique_ptr<std::byte[]> Checkpointer::CopyIfDerivable(DType* dtype,
                                                          std::string* why_not) {
  for (const ParamGroup& g : optimizer_->groups()) {
    if (g.step != 0) return nullptr;
  }
  // The copy is in the model dtype when every master is a value of it (2 bytes per element for
  // BF16); otherwise (parameters of several dtypes, or masters loaded from an FP32 source into
  // BF16 parameters) in FP32: twice the memory, still nothing written, so a new process
  // resumes on a full disk or a read-only store whatever its parameters and masters.
  DType model = optimizer_->mixed_dtypes() ? DType::kF32 : optimizer_->model_dtype();
  const std::span<const float> master = optimizer_->master();
  // Not being able to hold the copy is not an error: the caller spills instead. Linux
  // overcommits, so an allocation that succeeds may still meet the OOM killer as the copy
  // touches its pages, or as the load then touches moments never written: the copy is taken
  // only when it and those moments fit in the memory the Env says is available.
  const std::optional<uint64_t> available = store_->env()->AvailableMemoryBytes();
  const uint64_t faulted_moments =
      optimizer_->moments_untouched()
          ? optimizer_->exp_avg_bytes().size() + optimizer_->exp_avg_sq_bytes().size() +
                optimizer_->max_exp_avg_sq_bytes().size()
          : 0;
  auto allocate = [&](DType d) {
    return AllocateCopy(master.size() * formats::DTypeSize(d), faulted_moments, available,
                        why_not);
  };
  std::unique_ptr<std::byte[]> copy = allocate(model);
  if (copy == nullptr) return nullptr;
  // Blocks of 4 MiB of masters, scanned on the optimizer's threads (a fresh process's load
  // runs this scan before it reads: one core alone would cost a fifth of the load).
  constexpr size_t kBlock = size_t{1} << 20;
  const std::span<const std::byte> exp_avg = optimizer_->exp_avg_bytes();
  const std::span<const std::byte> exp_avg_sq = optimizer_->exp_avg_sq_bytes();
  const std::span<const std::byte> max_exp_avg_sq = optimizer_->max_exp_avg_sq_bytes();
  // Moments never written are zero without a read (which would fault in every page of them).
  const bool check_moments = !optimizer_->moments_untouched();
  const size_t moment_block = kBlock * optimizer_->moment_bytes();
  const size_t blocks = (master.size() + kBlock - 1) / kBlock;
  std::atomic<bool> moments_differ{false};
  std::atomic<bool> inexact{false};  // A master that is no value of `model`.
  Pool().ParallelFor(blocks, [&](size_t b) {
    if (moments_differ.load(std::memory_order_relaxed)) return;
    const size_t at = b * kBlock;
    const size_t end = std::min(master.size(), at + kBlock);
    if (check_moments) {
      for (std::span<const std::byte> m : {exp_avg, exp_avg_sq, max_exp_avg_sq}) {
        if (m.empty()) continue;
        const size_t lo = std::min(m.size(), b * moment_block);
        if (!AllZero(m.subspan(lo, std::min(m.size() - lo, moment_block)))) {
          moments_differ.store(true, std::memory_order_relaxed);
          return;
        }
      }
    }
    // Once a master is no model-dtype value, the FP32 copy below replaces this one: only the
    // moments are still checked.
    RoundMasters(master, at, end, model, copy.get(), inexact);
  });
  // Aux state (Adafactor's factors) is small beside the masters: read whole.
  if (moments_differ.load() || !AllZero(std::as_bytes(optimizer_->aux()))) return nullptr;
  if (inexact.load()) {
    copy.reset();  // Before the larger one: the load's peak holds one copy, not both.
    model = DType::kF32;
    copy = allocate(model);
    if (copy == nullptr) return nullptr;
    Pool().ParallelFor(blocks, [&](size_t b) {
      const size_t at = b * kBlock;
      const size_t n = std::min(master.size(), at + kBlock) - at;
      std::memcpy(copy.get() + at * 4, master.data() + at, n * 4);
    });
  }
  *dtype = model;
  return copy;
}

absl::Status Checkpointer::RestoreFrom(Undo& undo, StagedAdamW::LoadScope& scope) {
  if (undo.unchanged) return absl::OkStatus();  // The apply wrote nothing to the state.
  if (undo.derived_groups.has_value()) {
    // The state again: the masters from their exact model-dtype copy, the moments zero.
    const std::span<float> master = optimizer_->mutable_master();
    formats::Convert(undo.derived_dtype,
                     std::span<const std::byte>(undo.derived_masters.get(),
                                                master.size() *
                                                    formats::DTypeSize(undo.derived_dtype)),
                     DType::kF32, std::as_writable_bytes(master));
    for (std::span<std::byte> moment :
         {optimizer_->mutable_exp_avg_bytes(), optimizer_->mutable_exp_avg_sq_bytes(),
          optimizer_->mutable_max_exp_avg_sq_bytes(),
          std::as_writable_bytes(optimizer_->mutable_aux())}) {
      if (!moment.empty()) std::memset(moment.data(), 0, moment.size());
    }
    // Derivable only while no parameter has stepped: every count is 0.
    scope.RestoreGroups(*undo.derived_groups,
                        std::vector<uint64_t>(optimizer_->options().params.size(), 0));
    return absl::OkStatus();
  }
  CheckpointStore* from = undo.spill_store != nullptr ? undo.spill_store.get() : store_;
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> reader, from->OpenStep(undo.step));
  return Apply(*reader, nullptr, scope);
}

absl::Status Checkpointer::Transact(std::optional<uint64_t> exclude,
                                    const std::function<absl::Status(StagedAdamW::LoadScope&)>& apply,
                                    absl::string_view what, bool* undo_spilled,
                                    bool* undo_derived, bool unchanged) {
  // Step 2.
  // A load under an open overlapped step would change the state its speculation started from.
  absl::Status fixed = optimizer_->CheckNoOverlap(what);
  absl::StatusOr<std::unique_ptr<Undo>> undo =
      fixed.ok() ? FixUndoSource(exclude, unchanged) : absl::StatusOr<std::unique_ptr<Undo>>(fixed);
  if (fixed.ok() && !undo.ok()) fixed = undo.status();
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

}  // namespace ckpt::optimizer
