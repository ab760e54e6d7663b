// Recovery and retention of a checkpoint root. The save protocol is in checkpoint_writer.cc.
//
// Recovery at Open (primary handle), each step idempotent so a crash during recovery is
// repaired by the next Open:
// 1. Take <root>/LOCK: only one primary may recover, save or delete.
// 2. Remove .staging-* and .deleting-* directories and LATEST.tmp: saves that never reached
//    their commit point and deletions already decided. SyncDir(root).
// 3. Read LATEST. If it is missing, damaged, or names a step whose MANIFEST does not parse and
//    verify, choose the newest step whose MANIFEST does and rewrite LATEST durably (tmp, Sync,
//    rename, SyncDir). With no such step, remove LATEST: the store is empty.
// 4. Remove step directories newer than LATEST; LATEST is the commit point, so they were never
//    published (a crash between rename and LATEST). SyncDir(root).
//
// Retention: every doomed step is renamed to .deleting-step-N-<nonce>, then the root is synced
// once, then the renamed trees are removed. A step is never half there: it is renamed whole, and
// a crash before the sync brings it back whole while one after it leaves garbage that step 2 of
// recovery removes. (On a real file system the kernel may persist some of the renames before
// the sync; each step is still whole, but a crash may then delete a subset of the doomed steps.)
#include "ckpt/checkpoint_store.h"

#include <algorithm>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "libckpt/coding.h"
#include "libckpt/filename.h"
#include "libckpt/status_macros.h"

namespace ckpt {

using internal::StepDirName;

CheckpointStore::CheckpointStore(std::string root, const StoreOptions& options, Env* env)
    : root_(std::move(root)), options_(options), env_(env) {}

CheckpointStore::~CheckpointStore() = default;

void CheckpointStore::Log(absl::string_view message) const {
  if (options_.logger) options_.logger(message);
}

absl::StatusOr<std::unique_ptr<CheckpointStore>> CheckpointStore::Open(
    const std::string& root, const StoreOptions& options) {
  Env* env = options.env != nullptr ? options.env : Env::Default();
  std::unique_ptr<CheckpointStore> store(new CheckpointStore(root, options, env));
  absl::StatusOr<bool> is_dir = env->IsDirectory(root);
  if (!is_dir.ok() && absl::IsNotFound(is_dir.status()) && options.primary) {
    CKPT_RETURN_IF_ERROR(env->CreateDir(root));
    CKPT_RETURN_IF_ERROR(env->SyncDir(Dirname(root)));
    is_dir = true;
  }
  CKPT_RETURN_IF_ERROR(is_dir.status());
  if (!*is_dir) return absl::FailedPreconditionError(absl::StrCat(root, ": not a directory"));
  if (options.primary) {
    CKPT_ASSIGN_OR_RETURN(store->lock_, env->LockFile(JoinPath(root, internal::kLockName)));
    CKPT_RETURN_IF_ERROR(store->Recover());
  } else {
    absl::StatusOr<std::string> latest =
        ReadFileToString(env, JoinPath(root, internal::kLatestName));
    if (latest.ok()) {
      CKPT_ASSIGN_OR_RETURN(
          uint64_t step,
          formats::DecodeLatest(AsBytes(*latest), JoinPath(root, internal::kLatestName)));
      store->latest_ = step;
    } else if (!absl::IsNotFound(latest.status())) {
      return latest.status();
    }
  }
  return store;
}

absl::Status CheckpointStore::RemoveGarbage() {
  CKPT_ASSIGN_OR_RETURN(std::vector<std::string> names, env_->GetChildren(root_));
  bool removed = false;
  for (const std::string& name : names) {
    if (!internal::IsGarbageName(name)) continue;
    CKPT_RETURN_IF_ERROR(RemoveRecursively(env_, JoinPath(root_, name)));
    recovery_.removed.push_back(name);
    Log(absl::StrCat("recovery removed ", JoinPath(root_, name)));
    removed = true;
  }
  if (removed) CKPT_RETURN_IF_ERROR(env_->SyncDir(root_));
  return absl::OkStatus();
}

absl::Status CheckpointStore::RepairLatest() {
  const std::string latest_path = JoinPath(root_, internal::kLatestName);
  CKPT_ASSIGN_OR_RETURN(std::vector<uint64_t> steps, ListSteps());
  std::optional<uint64_t> named;
  absl::StatusOr<std::string> bytes = ReadFileToString(env_, latest_path);
  if (bytes.ok()) {
    absl::StatusOr<uint64_t> step = formats::DecodeLatest(AsBytes(*bytes), latest_path);
    if (step.ok()) {
      absl::StatusOr<std::unique_ptr<CheckpointReader>> reader = OpenStep(*step);
      if (reader.ok()) {
        latest_ = *step;
        return absl::OkStatus();
      }
      recovery_.latest_problem =
          absl::StrCat("LATEST names step ", *step, ": ", reader.status().message());
    } else {
      recovery_.latest_problem = std::string(step.status().message());
    }
  } else if (absl::IsNotFound(bytes.status())) {
    if (steps.empty()) return absl::OkStatus();  // A new, empty store.
    recovery_.latest_problem = "LATEST is missing";
  } else {
    return bytes.status();
  }
  // Fall back to the newest step whose manifest and data file headers verify.
  for (auto it = steps.rbegin(); it != steps.rend(); ++it) {
    if (OpenStep(*it).ok()) {
      CKPT_RETURN_IF_ERROR(WriteFileAtomically(env_, latest_path, formats::EncodeLatest(*it)));
      latest_ = *it;
      recovery_.latest_repaired = true;
      Log(absl::StrCat("recovery: ", recovery_.latest_problem, "; LATEST now names step ", *it));
      return absl::OkStatus();
    }
  }
  // Nothing verifies: the store holds no committed state.
  absl::Status removed = env_->RemoveFile(latest_path);
  if (!removed.ok() && !absl::IsNotFound(removed)) return removed;
  recovery_.latest_repaired = true;
  Log(absl::StrCat("recovery: ", recovery_.latest_problem, "; no step verifies"));
  return env_->SyncDir(root_);
}

absl::Status CheckpointStore::Recover() {
  CKPT_RETURN_IF_ERROR(RemoveGarbage());
  CKPT_RETURN_IF_ERROR(RepairLatest());
  CKPT_ASSIGN_OR_RETURN(std::vector<uint64_t> steps, ListSteps());
  bool removed = false;
  for (uint64_t step : steps) {
    if (latest_.has_value() && step <= *latest_) continue;
    CKPT_RETURN_IF_ERROR(RemoveRecursively(env_, JoinPath(root_, StepDirName(step))));
    recovery_.removed.push_back(StepDirName(step));
    Log(absl::StrCat("recovery removed unpublished ", StepDirName(step)));
    removed = true;
  }
  if (removed) CKPT_RETURN_IF_ERROR(env_->SyncDir(root_));
  return absl::OkStatus();
}

absl::StatusOr<std::vector<uint64_t>> CheckpointStore::ListSteps() const {
  CKPT_ASSIGN_OR_RETURN(std::vector<std::string> names, env_->GetChildren(root_));
  std::vector<uint64_t> steps;
  for (const std::string& name : names) {
    if (std::optional<uint64_t> step = internal::ParseStepDirName(name)) steps.push_back(*step);
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

absl::StatusOr<std::unique_ptr<SaveTransaction>> CheckpointStore::BeginSave(
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
    if (!options_.primary) {
      s = absl::FailedPreconditionError("rank 0 must save through the primary store handle");
    } else if (save_in_flight_) {
      s = absl::FailedPreconditionError(absl::StrCat(root_, ": another save is in flight"));
    } else if (latest_.has_value() && step <= *latest_) {
      s = absl::FailedPreconditionError(absl::StrCat(
          "step ", step, " is not newer than LATEST (step ", *latest_, ") in ", root_));
    } else {
      staging = JoinPath(root_, internal::StagingDirName(step, internal::NewNonce()));
      s = env_->CreateDir(staging);
    }
    message = s.ok() ? absl::StrCat("ok ", staging)
                     : absl::StrCat("err ", static_cast<int>(s.code()), " ", s.message());
  }
  CKPT_ASSIGN_OR_RETURN(std::string outcome, coordinator->Broadcast(message, 0));
  absl::string_view view = outcome;
  if (!absl::ConsumePrefix(&view, "ok ")) {
    absl::ConsumePrefix(&view, "err ");
    size_t space = view.find(' ');
    int code = 0;
    if (space == absl::string_view::npos || !absl::SimpleAtoi(view.substr(0, space), &code) ||
        code <= 0 || code > 16) {
      return absl::InternalError(absl::StrCat("malformed begin message from rank 0: ", outcome));
    }
    return absl::Status(static_cast<absl::StatusCode>(code), view.substr(space + 1));
  }
  save_in_flight_ = true;
  std::unique_ptr<SaveTransaction> txn(
      new SaveTransaction(this, coordinator, step, std::string(view), absl::OkStatus()));
  txn->own_coordinator_ = std::move(own);
  return txn;
}

void CheckpointStore::OnCommitted(uint64_t step) {
  if (!latest_.has_value() || *latest_ < step) latest_ = step;
}

absl::StatusOr<std::unique_ptr<CheckpointReader>> CheckpointStore::OpenStep(uint64_t step) const {
  StoreOptions options = options_;
  options.env = env_;
  const std::string dir = JoinPath(root_, StepDirName(step));
  absl::StatusOr<bool> is_dir = env_->IsDirectory(dir);
  if (!is_dir.ok() || !*is_dir) {
    return absl::NotFoundError(absl::StrCat(root_, ": no step ", step));
  }
  return CheckpointReader::Open(dir, options);
}

absl::StatusOr<std::unique_ptr<CheckpointReader>> CheckpointStore::OpenLatest() const {
  if (!latest_.has_value()) return absl::NotFoundError(absl::StrCat(root_, ": no committed step"));
  return OpenStep(*latest_);
}

absl::StatusOr<std::vector<uint64_t>> CheckpointStore::ApplyRetention(const RetentionPolicy& policy,
                                                                      bool dry_run) {
  if (!options_.primary) {
    return absl::FailedPreconditionError("retention needs the primary store handle");
  }
  if (save_in_flight_) {
    return absl::FailedPreconditionError(absl::StrCat(root_, ": a save is in flight"));
  }
  CKPT_ASSIGN_OR_RETURN(std::vector<uint64_t> steps, ListSteps());
  if (policy.keep_last == 0) return std::vector<uint64_t>{};
  std::set<uint64_t> keep;
  for (size_t i = 0; i < steps.size() && i < policy.keep_last; ++i)
    keep.insert(steps[steps.size() - 1 - i]);
  if (latest_.has_value()) keep.insert(*latest_);
  std::vector<uint64_t> doomed;
  for (uint64_t step : steps) {
    bool every = policy.keep_every > 0 && step % policy.keep_every == 0;
    if (!keep.count(step) && !every) doomed.push_back(step);
  }
  if (dry_run) return doomed;
  if (doomed.empty()) return doomed;
  // All renames first and one SyncDir: the deletion is decided at once, then carried out.
  std::vector<std::string> trash;
  for (uint64_t step : doomed) {
    trash.push_back(JoinPath(root_, internal::DeletingDirName(step, internal::NewNonce())));
    CKPT_RETURN_IF_ERROR(env_->RenameFile(JoinPath(root_, StepDirName(step)), trash.back()));
  }
  CKPT_RETURN_IF_ERROR(env_->SyncDir(root_));
  for (const std::string& dir : trash) CKPT_RETURN_IF_ERROR(RemoveRecursively(env_, dir));
  CKPT_RETURN_IF_ERROR(env_->SyncDir(root_));
  return doomed;
}

}  // namespace ckpt
