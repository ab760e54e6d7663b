// Opening and saving through a checkpoint root: StoreImpl, the CheckpointStore of
// libckpt/store/store_impl.h. The save protocol is in transaction.cc and commit.cc, recovery in
// recovery.cc, retention in retention.cc.
#include "libckpt/store/store_impl.h"

#include <algorithm>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "ckpt/base/coding.h"
#include "ckpt/base/status_macros.h"
#include "ckpt/verify.h"
#include "libckpt/filename.h"

namespace ckpt {

using internal::StepDirName;

absl::StatusOr<std::optional<uint64_t>> ReadLatest(Env* env, const std::string& root) {
  const std::string path = JoinPath(root, internal::kLatestName);
  absl::StatusOr<std::string> bytes =
      ReadFileToString(env, path, formats::kLatestBytes, FileOptions{.follow_symlinks = false});
  if (absl::IsNotFound(bytes.status())) return std::optional<uint64_t>();
  CKPT_RETURN_IF_ERROR(bytes.status());
  CKPT_ASSIGN_OR_RETURN(uint64_t step, formats::DecodeLatest(AsBytes(*bytes), path));
  return std::optional<uint64_t>(step);
}

absl::StatusOr<std::vector<uint64_t>> ListStepDirs(Env* env, const std::string& root) {
  CKPT_ASSIGN_OR_RETURN(std::vector<std::string> names, env->GetChildren(root));
  std::vector<uint64_t> steps;
  for (const std::string& name : names) {
    if (std::optional<uint64_t> step = internal::ParseStepDirName(name)) steps.push_back(*step);
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

std::string StepDirectoryName(uint64_t step) { return StepDirName(step); }

absl::StatusOr<std::vector<std::string>> ListUncommitted(Env* env, const std::string& root) {
  CKPT_ASSIGN_OR_RETURN(std::vector<std::string> names, env->GetChildren(root));
  std::vector<std::string> out;
  for (std::string& name : names) {
    if (internal::IsGarbageName(name)) out.push_back(std::move(name));
  }
  std::sort(out.begin(), out.end());
  return out;
}

absl::StatusOr<bool> LooksLikeStore(Env* env, const std::string& root) {
  CKPT_ASSIGN_OR_RETURN(std::vector<std::string> names, env->GetChildren(root));
  for (const std::string& name : names) {
    if (name == internal::kLatestName || name == internal::kLockName ||
        name == kQuarantineDirName || internal::ParseStepDirName(name).has_value() ||
        internal::IsGarbageName(name)) {
      return true;
    }
  }
  return false;
}

namespace {

// A directory of another store that `path` is or lies inside, which that store's recovery,
// retention or purge would set aside or delete with everything in it: a committed step (named
// like one, holding a MANIFEST), a staging or deleting directory, or (`creating` a root there)
// an undo directory or its quarantine/; whose parent LooksLikeStore. nullopt when none. A store
// already inside quarantine/ (set aside whole, to be rescued) still opens. The parents are
// walked by name, so only those named like such a directory are read.
std::optional<std::pair<std::string, std::string>> EnclosingStoreEntry(Env* env,
                                                                       const std::string& path,
                                                                       bool creating) {
  for (std::string dir = path; dir != "/" && dir != "." && !dir.empty(); dir = Dirname(dir)) {
    absl::string_view name = dir;
    while (name.size() > 1 && name.back() == '/') name.remove_suffix(1);
    name = name.substr(name.rfind('/') + 1);
    const bool step = internal::ParseStepDirName(name).has_value();
    // An undo directory is itself a store (a load's spill, opened by the Checkpointer): only a
    // root below one is refused.
    const bool undo = absl::StartsWith(name, internal::kUndoPrefix) && dir != path;
    const bool doomed_if_new = creating && (undo || name == kQuarantineDirName);
    if (!step && !absl::StartsWith(name, internal::kStagingPrefix) &&
        !absl::StartsWith(name, internal::kDeletingPrefix) && !doomed_if_new) {
      continue;
    }
    // A parent we cannot read is not taken for a store: the check refuses only what it sees.
    if (step && !env->Stat(JoinPath(dir, internal::kManifestName)).ok()) continue;
    const std::string parent = Dirname(dir);
    absl::StatusOr<bool> store = LooksLikeStore(env, parent);
    if (store.ok() && *store) return std::make_pair(parent, dir);
  }
  return std::nullopt;
}

absl::Status RefuseInsideAnotherStore(Env* env, const std::string& root, const std::string& path,
                                      bool creating) {
  std::optional<std::pair<std::string, std::string>> outer =
      EnclosingStoreEntry(env, path, creating);
  if (!outer.has_value()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      root, ": lies inside ", outer->second, ", a step, staging, undo or quarantine directory of "
      "the ckpt store ",
      outer->first, "; that store's retention or recovery would delete or quarantine it with "
      "everything in it. Give a root outside it"));
}

}  // namespace

internal::StoreImpl::StoreImpl(std::string root, const StoreOptions& options, Env* env)
    : root_(std::move(root)), options_(options), env_(env) {}

internal::StoreImpl::~StoreImpl() {
  WaitForRemovals();  // While the LOCK is still held.
  {
    std::lock_guard<std::mutex> lock(remove_mu_);
    remover_stop_ = true;
  }
  remove_cv_.notify_all();
  if (remover_ != nullptr) remover_->Join();
}

void internal::StoreImpl::Log(absl::string_view message) const {
  if (options_.logger) options_.logger(message);
}

std::optional<uint64_t> internal::StoreImpl::latest_step() const {
  std::lock_guard<std::mutex> lock(mu_);
  return latest_;
}

absl::StatusOr<std::unique_ptr<CheckpointStore>> CheckpointStore::Open(
    const std::string& root, const StoreOptions& options) {
  Env* env = options.env != nullptr ? options.env : Env::Default();
  const bool writable = options.primary && !options.read_only;
  absl::StatusOr<std::string> real = env->RealPath(root);
  if (absl::IsNotFound(real.status()) && writable) {
    // Checked before the root is made, so that a refused root leaves nothing behind.
    absl::StatusOr<std::string> parent = env->RealPath(Dirname(root));
    if (parent.ok()) {
      absl::string_view base = root;
      while (base.size() > 1 && base.back() == '/') base.remove_suffix(1);
      base = base.substr(base.rfind('/') + 1);
      CKPT_RETURN_IF_ERROR(
          RefuseInsideAnotherStore(env, root, JoinPath(*parent, base), /*creating=*/true));
    }
    CKPT_RETURN_IF_ERROR(env->CreateDir(root));
    CKPT_RETURN_IF_ERROR(env->SyncDir(Dirname(root)));
    real = env->RealPath(root);
  }
  CKPT_RETURN_IF_ERROR(real.status());
  CKPT_RETURN_IF_ERROR(RefuseInsideAnotherStore(env, root, *real, /*creating=*/false));
  CKPT_ASSIGN_OR_RETURN(bool is_dir, env->IsDirectory(*real));
  if (!is_dir) return absl::FailedPreconditionError(absl::StrCat(root, ": not a directory"));
  std::unique_ptr<internal::StoreImpl> store(new internal::StoreImpl(*real, options, env));
  if (writable) {
    CKPT_ASSIGN_OR_RETURN(store->lock_, env->LockFile(JoinPath(*real, internal::kLockName)));
    if (!options.skip_recovery) {
      CKPT_RETURN_IF_ERROR(store->Recover());
      return store;
    }
    absl::StatusOr<std::optional<uint64_t>> named = ReadLatest(env, *real);
    std::lock_guard<std::mutex> lock(store->mu_);
    if (named.ok()) store->latest_ = *named;
    return store;
  }
  CKPT_ASSIGN_OR_RETURN(std::optional<uint64_t> latest, ReadLatest(env, *real));
  std::lock_guard<std::mutex> lock(store->mu_);
  store->latest_ = latest;
  return store;
}

absl::StatusOr<std::vector<uint64_t>> internal::StoreImpl::ListSteps() const {
  return ListStepDirs(env_, root_);
}

absl::StatusOr<std::unique_ptr<SaveTransaction>> internal::StoreImpl::BeginSave(
    uint64_t step, Coordinator* coordinator) {
  std::unique_ptr<Coordinator> own;
  if (coordinator == nullptr) {
    own = std::make_unique<SingleProcessCoordinator>();
    coordinator = own.get();
  }
  std::string message;
  std::string staging;
  if (coordinator->rank() == 0) {
    absl::Status s;
    std::lock_guard<std::mutex> lock(mu_);
    if (!options_.primary || options_.read_only || options_.skip_recovery) {
      s = absl::FailedPreconditionError(
          "rank 0 must save through the primary, writable store handle (that recovered)");
    } else if (save_in_flight_) {
      s = absl::FailedPreconditionError(absl::StrCat(root_, ": another save is in flight"));
    } else if (latest_uncertain_.has_value()) {
      s = absl::FailedPreconditionError(absl::StrCat(
          root_, ": the commit of step ", *latest_uncertain_,
          " could not make LATEST durable nor put the previous one back; reopen the store so "
          "that recovery decides which step LATEST names"));
    } else if (latest_.has_value() && step <= *latest_) {
      s = absl::FailedPreconditionError(absl::StrCat(
          "step ", step, " is not newer than LATEST (step ", *latest_, ") in ", root_));
    } else {
      s = SetAsideUnpublished(step);
      staging = JoinPath(root_, internal::StagingDirName(step, internal::NewNonce()));
      if (s.ok()) s = env_->CreateDir(staging);
      // Claimed in the same critical section as the check: two BeginSave calls cannot both pass.
      save_in_flight_ = s.ok();
    }
    message = EncodeResult(s.ok() ? absl::StatusOr<std::string>(staging) : s);
  }
  absl::StatusOr<std::string> broadcast = coordinator->Broadcast(message, 0);
  if (!broadcast.ok()) {
    if (coordinator->rank() == 0 && !staging.empty()) {
      // Best effort: recovery removes the staging directory at the next Open.
      RemoveRecursively(env_, staging).IgnoreError();
      OnSaveEnded();
    }
    return broadcast.status();
  }
  CKPT_ASSIGN_OR_RETURN(std::string staging_dir, DecodeResult(*broadcast));
  auto txn = std::make_unique<Transaction>(this, coordinator, step, std::move(staging_dir),
                                           absl::OkStatus());
  txn->Own(std::move(own));
  return txn;
}

absl::Status internal::StoreImpl::SetAsideUnpublished(uint64_t step) {
  const std::string name = StepDirName(step);
  absl::StatusOr<FileInfo> info = env_->Stat(JoinPath(root_, name));
  if (absl::IsNotFound(info.status())) return absl::OkStatus();
  CKPT_RETURN_IF_ERROR(info.status());
  // Only a step above LATEST reaches here: recovery kept it (or it appeared since), and the
  // commit's rename must not meet it. A rename, so nothing of it is lost.
  absl::StatusOr<std::vector<std::string>> moved = QuarantineEntries({name});
  if (!moved.ok()) {
    return Annotate(moved.status(),
                    absl::StrCat("setting aside the unpublished ", name, " before saving step ",
                                 step, " (move or adopt it by hand)"));
  }
  Log(absl::StrCat("save of step ", step, ": the unpublished ", name, " moved to ", (*moved)[0]));
  return absl::OkStatus();
}

absl::Status internal::StoreImpl::CheckWritableIdle(absl::string_view what) {
  if (!options_.primary || options_.read_only) {
    return absl::FailedPreconditionError(
        absl::StrCat(root_, ": ", what, " needs the primary, writable store handle"));
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (save_in_flight_) {
    return absl::FailedPreconditionError(absl::StrCat(root_, ": a save is in flight"));
  }
  return absl::OkStatus();
}

absl::Status internal::StoreImpl::Adopt(uint64_t step) {
  CKPT_RETURN_IF_ERROR(CheckWritableIdle(absl::StrCat("adopting step ", step)));
  // LATEST names only a directory of this root's own mount (docs/design/recovery.md): a link
  // or a mount point under a step's name is someone else's, and recovery never makes it LATEST
  // either (steps 3b and 4 of recovery.cc).
  const std::string dir = JoinPath(root_, StepDirName(step));
  absl::StatusOr<FileInfo> info = env_->Stat(dir);
  if (absl::IsNotFound(info.status())) {
    return absl::NotFoundError(absl::StrCat(root_, ": no step ", step));
  }
  CKPT_RETURN_IF_ERROR(info.status());
  CKPT_ASSIGN_OR_RETURN(FileInfo root_info, env_->Stat(root_));
  if (info->type == FileInfo::Type::kSymlink) {
    return absl::FailedPreconditionError(absl::StrCat(
        dir, ": is a symbolic link; LATEST never names a step outside ", root_, ", unchanged"));
  }
  if (!info->SameMountAs(root_info)) {
    return absl::FailedPreconditionError(absl::StrCat(
        dir, ": is a mount point (another mount than ", root_,
        "); LATEST never names a step that is not the store's own, unchanged"));
  }
  CKPT_RETURN_IF_ERROR(OpenStep(step).status());
  CKPT_ASSIGN_OR_RETURN(StepVerifyReport report,
                        VerifyStepDir(env_, JoinPath(root_, StepDirName(step))));
  if (!report.problems.empty()) {
    const VerifyProblem& p = report.problems.front();
    return absl::DataLossError(absl::StrCat(
        "step ", step, " does not verify, LATEST unchanged: ", p.file,
        p.chunk.has_value() ? absl::StrCat(" chunk ", *p.chunk) : std::string(), " at offset ",
        p.offset, ": ", p.message));
  }
  CKPT_RETURN_IF_ERROR(WriteFileAtomically(env_, JoinPath(root_, internal::kLatestName),
                                           formats::EncodeLatest(step)));
  std::lock_guard<std::mutex> lock(mu_);
  latest_ = step;
  latest_uncertain_.reset();
  return absl::OkStatus();
}

absl::StatusOr<std::string> internal::StoreImpl::QuarantineStep(uint64_t step) {
  CKPT_RETURN_IF_ERROR(CheckWritableIdle(absl::StrCat("quarantining step ", step)));
  const std::string name = StepDirName(step);
  CKPT_RETURN_IF_ERROR(env_->Stat(JoinPath(root_, name)).status());
  // The step LATEST falls back to is chosen first, so that a failure leaves both in place.
  std::optional<uint64_t> fallback;
  if (latest_step() == step) {
    CKPT_ASSIGN_OR_RETURN(std::vector<uint64_t> own, RetainableSteps(env_, root_));
    for (auto it = own.rbegin(); it != own.rend(); ++it) {
      if (*it < step && OpenStep(*it).ok()) {
        fallback = *it;
        break;
      }
    }
  }
  CKPT_ASSIGN_OR_RETURN(std::vector<std::string> moved, QuarantineEntries({name}));
  if (fallback.has_value()) {
    // Until this is durable LATEST names a missing step, which the next Open repairs the same.
    CKPT_RETURN_IF_ERROR(WriteFileAtomically(env_, JoinPath(root_, internal::kLatestName),
                                             formats::EncodeLatest(*fallback)));
    std::lock_guard<std::mutex> lock(mu_);
    latest_ = fallback;
  } else if (latest_step() == step) {
    std::lock_guard<std::mutex> lock(mu_);
    latest_uncertain_ = step;  // LATEST names nothing now: no save until an Open decides.
  }
  return moved[0];
}

absl::StatusOr<std::vector<std::string>> internal::StoreImpl::QuarantineAll() {
  CKPT_RETURN_IF_ERROR(CheckWritableIdle("quarantining every step"));
  CKPT_ASSIGN_OR_RETURN(std::vector<std::uint64_t> steps, ListSteps());
  std::vector<std::string> names;
  // LATEST goes first: from then on no step is named, and a crash leaves steps that the
  // next Open judges as a store without LATEST (the newest intact one becomes LATEST).
  absl::StatusOr<FileInfo> latest = env_->Stat(JoinPath(root_, internal::kLatestName));
  if (latest.ok()) names.push_back(std::string(internal::kLatestName));
  else if (!absl::IsNotFound(latest.status())) return latest.status();
  for (uint64_t step : steps) names.push_back(StepDirName(step));
  CKPT_ASSIGN_OR_RETURN(std::vector<std::string> moved, QuarantineEntries(names));
  std::lock_guard<std::mutex> lock(mu_);
  latest_.reset();
  latest_uncertain_.reset();
  return moved;
}

void internal::StoreImpl::OnCommitted(uint64_t step) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!latest_.has_value() || *latest_ < step) latest_ = step;
}

void internal::StoreImpl::OnLatestUncertain(uint64_t step) {
  std::lock_guard<std::mutex> lock(mu_);
  latest_uncertain_ = step;
}

void internal::StoreImpl::OnSaveEnded() {
  std::lock_guard<std::mutex> lock(mu_);
  save_in_flight_ = false;
}

absl::StatusOr<std::unique_ptr<CheckpointReader>> OpenStepOf(const std::string& root,
                                                             uint64_t step,
                                                             const StoreOptions& options) {
  Env* env = options.env != nullptr ? options.env : Env::Default();
  const std::string dir = JoinPath(root, StepDirName(step));
  absl::StatusOr<bool> is_dir = env->IsDirectory(dir);
  if (absl::IsNotFound(is_dir.status())) {
    return absl::NotFoundError(absl::StrCat(root, ": no step ", step));
  }
  CKPT_RETURN_IF_ERROR(is_dir.status());
  if (!*is_dir) {
    // ckpt only ever renames a directory to a step's name: a link or file there is not ours.
    return absl::FailedPreconditionError(
        absl::StrCat(dir,
                     ": is not a directory (a symbolic link or a file), which ckpt never "
                     "puts under a step's name"));
  }
  return CheckpointReader::Open(dir, options);
}

absl::StatusOr<std::unique_ptr<CheckpointReader>> internal::StoreImpl::OpenStep(uint64_t step) const {
  StoreOptions options = options_;
  options.env = env_;
  return OpenStepOf(root_, step, options);
}

absl::StatusOr<std::unique_ptr<CheckpointReader>> internal::StoreImpl::OpenLatest() const {
  std::optional<uint64_t> latest = latest_step();
  if (!latest.has_value()) return absl::NotFoundError(absl::StrCat(root_, ": no committed step"));
  return OpenStep(*latest);
}

absl::StatusOr<std::unique_ptr<CheckpointStore>> OpenStoreOnRanks(const std::string& root,
                                                                  StoreOptions options,
                                                                  Coordinator* coordinator) {
  const int rank = coordinator->rank();
  options.primary = rank == 0;
  absl::StatusOr<std::unique_ptr<CheckpointStore>> store =
      absl::FailedPreconditionError("not opened");
  if (rank == 0) store = CheckpointStore::Open(root, options);
  // The primary's outcome first: the others open only a root it has recovered.
  CKPT_RETURN_IF_ERROR(BroadcastResult(*coordinator,
                                       store.ok() ? absl::StatusOr<std::string>("")
                                                  : Annotate(store.status(), "rank 0"),
                                       0)
                           .status());
  if (rank != 0) store = CheckpointStore::Open(root, options);
  absl::Status mine = store.ok() ? absl::OkStatus()
                                 : Annotate(store.status(), absl::StrCat("rank ", rank));
  CKPT_ASSIGN_OR_RETURN(std::vector<std::string> votes,
                        coordinator->AllGather(EncodeStatus(mine)));
  for (const std::string& vote : votes) CKPT_RETURN_IF_ERROR(DecodeStatus(vote));
  return store;
}

}  // namespace ckpt
