// Retention of a checkpoint root (StoreImpl::ApplyRetention, and after each commit), under
// recovery's rule (DESIGN.md §3): it deletes only what ckpt wrote and can show it wrote, never
// follows a link, never enters or moves another mount, and moves whole into quarantine/ what
// it may not delete. The recogniser is recovery's own (own_files.h, CommittedStepProblem).
//
// 1. Choose: RetiredSteps picks the committed steps the policy does not keep, among the step
//    directories on the root's own mount (RetainableSteps): a link or a mount point under a
//    step's name neither counts nor goes; steps above LATEST are recovery's.
// 2. Judge every chosen step before anything changes (PlanRetention), so that a dry run
//    prints exactly what the real run then does:
//    a. it is, or holds at any depth, a mount point: leave it in place and report it. Moving
//       it would move someone's mount (their path to it would change), and removing it would
//       cross into the mount; nothing ckpt must reclaim is worth either;
//    b. it holds exactly its MANIFEST and the data files that MANIFEST lists, as regular files
//       with ckpt's headers (nothing else: the commit removes the parts before its rename):
//       delete it (3, 5);
//    c. it holds anything else (a user's file, a FIFO, a directory or a nested store, a link,
//       an unlisted data file, no MANIFEST that parses): move it whole into quarantine/ (4);
//    d. judging fails (permission, EIO): leave it and report why; we cannot tell.
// 3. Rename every step of 2b to .deleting-step-N-<nonce>, then SyncDir(root) once: the
//    deletion is decided at once. A step is never half there: it is renamed whole, and a crash
//    before the sync brings it back whole while one after it leaves garbage that step 2 of
//    recovery removes (it holds only ckpt's files, so recovery recognises it). (On a real
//    file system the kernel may persist some renames before the sync; each step is still
//    whole, but a crash may then delete a subset of the doomed steps.)
// 4. Move every step of 2c into quarantine/<name>-<nonce> (one rename each), SyncDir
//    (quarantine), SyncDir(root): nothing in it is lost; `gc --purge-quarantine` is the
//    operator's decision.
// 5. Remove the renamed trees, then SyncDir(root). After a commit this runs on the store's
//    remover thread (the commit waits for 1-4 only); WaitForRemovals and the destructor wait
//    for it.
#include <algorithm>
#include <set>

#include "absl/strings/str_cat.h"
#include "ckpt/base/status_macros.h"
#include "libckpt/filename.h"
#include "libckpt/store/own_files.h"
#include "libckpt/store/store_impl.h"

namespace ckpt {

using internal::StepDirName;
using Kind = RecoveryAction::Kind;

namespace {

// Step 2, for one step.
RecoveryAction JudgeRetired(Env* env, const std::string& root, const FileInfo& root_info,
                            uint64_t step) {
  const std::string name = StepDirName(step);
  absl::StatusOr<internal::StepProblem> problem =
      internal::CommittedStepProblem(env, JoinPath(root, name), root_info);
  if (!problem.ok()) {  // Step 2d.
    return {Kind::kKeep, name,
            absl::StrCat("cannot tell whether it holds only ckpt's files: ",
                         problem.status().message()),
            step};
  }
  switch (problem->kind) {
    case internal::StepProblem::Kind::kNone:  // Step 2b.
      return {Kind::kRemove, name, "holds only ckpt's files", step};
    case internal::StepProblem::Kind::kForeign:  // Step 2c.
      return {Kind::kQuarantine, name, problem->why, step};
    case internal::StepProblem::Kind::kMountPoint:  // Step 2a.
      return {Kind::kKeep, name,
              absl::StrCat("mount point: ",
                           problem->entry == "." ? std::string("the step itself")
                                                 : problem->entry,
                           "; ckpt never enters nor moves another mount"),
              step};
  }
  return {Kind::kKeep, name, "unknown verdict", step};
}

}  // namespace

std::vector<uint64_t> StepsOf(const RetentionReport& report, RecoveryAction::Kind kind) {
  std::vector<uint64_t> steps;
  for (const RecoveryAction& a : report.actions) {
    if (a.kind == kind && a.step.has_value()) steps.push_back(*a.step);
  }
  return steps;
}

std::string DescribeRetention(const RecoveryAction& action, bool dry_run) {
  absl::string_view verb;
  switch (action.kind) {
    case Kind::kRemove:
      verb = dry_run ? "would delete" : "deleted";
      break;
    case Kind::kQuarantine:
      verb = dry_run ? "would quarantine" : "quarantined";
      break;
    case Kind::kKeep:
    case Kind::kSetLatest:
      verb = dry_run ? "would leave" : "left";
      break;
  }
  return absl::StrCat(verb, " ", action.name, " (", action.reason, ")");
}

absl::StatusOr<RetentionReport> PlanRetention(Env* env, const std::string& root,
                                              const std::vector<uint64_t>& doomed) {
  RetentionReport report;
  if (doomed.empty()) return report;
  CKPT_ASSIGN_OR_RETURN(FileInfo root_info, env->Stat(root));
  for (uint64_t step : doomed) report.actions.push_back(JudgeRetired(env, root, root_info, step));
  return report;
}

absl::StatusOr<std::vector<uint64_t>> RetainableSteps(Env* env, const std::string& root) {
  CKPT_ASSIGN_OR_RETURN(std::vector<uint64_t> steps, ListStepDirs(env, root));
  CKPT_ASSIGN_OR_RETURN(FileInfo root_info, env->Stat(root));
  std::vector<uint64_t> own;
  for (uint64_t step : steps) {
    CKPT_ASSIGN_OR_RETURN(FileInfo info, env->Stat(JoinPath(root, StepDirName(step))));
    if (info.type == FileInfo::Type::kDirectory && info.SameMountAs(root_info)) own.push_back(step);
  }
  return own;
}

std::vector<uint64_t> RetiredSteps(const std::vector<uint64_t>& all, std::optional<uint64_t> latest,
                                   const RetentionPolicy& policy) {
  if (!latest.has_value()) return {};
  // Entries above LATEST are not committed steps (recovery owns them): they neither count
  // toward keep_last nor are deleted here.
  std::vector<uint64_t> steps(all.begin(), std::upper_bound(all.begin(), all.end(), *latest));
  if (policy.keep_only.has_value()) {
    const std::set<uint64_t> keep(policy.keep_only->begin(), policy.keep_only->end());
    std::vector<uint64_t> doomed;
    for (uint64_t step : steps) {
      if (step != *latest && !keep.count(step)) doomed.push_back(step);
    }
    return doomed;
  }
  if (policy.keep_last == 0) return {};
  std::set<uint64_t> keep;
  for (size_t i = 0; i < steps.size() && i < policy.keep_last; ++i)
    keep.insert(steps[steps.size() - 1 - i]);
  keep.insert(*latest);
  std::vector<uint64_t> doomed;
  for (uint64_t step : steps) {
    bool every = policy.keep_every > 0 && step % policy.keep_every == 0;
    if (!keep.count(step) && !every) doomed.push_back(step);
  }
  return doomed;
}

void internal::StoreImpl::WaitForRemovals() {
  std::unique_lock<std::mutex> lock(remove_mu_);
  remove_cv_.wait(lock, [&] { return to_remove_.empty() && !removing_; });
}

void internal::StoreImpl::RemoverMain() {
  std::unique_lock<std::mutex> lock(remove_mu_);
  for (;;) {
    remove_cv_.wait(lock, [&] { return remover_stop_ || !to_remove_.empty(); });
    if (to_remove_.empty()) return;  // Stopping.
    const std::string dir = std::move(to_remove_.front());
    to_remove_.pop_front();
    removing_ = true;
    lock.unlock();
    absl::Status s = RemoveRecursively(env_, dir);
    if (s.ok()) s = env_->SyncDir(root_);
    // A failure leaves a .deleting-* directory, which no reader opens; recovery removes it.
    if (!s.ok()) Log(absl::StrCat("retention: removing ", dir, ": ", s.message()));
    lock.lock();
    removing_ = false;
    remove_cv_.notify_all();
  }
}

absl::StatusOr<RetentionReport> internal::StoreImpl::ApplyRetention(const RetentionPolicy& policy,
                                                                    bool dry_run) {
  return Retire(policy, dry_run, /*background=*/false);
}

absl::StatusOr<RetentionReport> internal::StoreImpl::Retire(const RetentionPolicy& policy,
                                                            bool dry_run, bool background) {
  if (!dry_run && (!options_.primary || options_.read_only || options_.skip_recovery)) {
    return absl::FailedPreconditionError(
        "retention needs the primary, writable store handle (that recovered)");
  }
  std::optional<uint64_t> latest;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (save_in_flight_) {
      return absl::FailedPreconditionError(absl::StrCat(root_, ": a save is in flight"));
    }
    latest = latest_;
  }
  // Steps 1 and 2.
  CKPT_ASSIGN_OR_RETURN(std::vector<uint64_t> own, RetainableSteps(env_, root_));
  CKPT_ASSIGN_OR_RETURN(RetentionReport report,
                        PlanRetention(env_, root_, RetiredSteps(own, latest, policy)));
  if (dry_run) return report;
  for (const RecoveryAction& a : report.actions) {
    Log(absl::StrCat("retention: ", DescribeRetention(a, /*dry_run=*/false)));
  }
  // Step 3. All renames first and one SyncDir: the deletion is decided at once.
  std::vector<std::string> trash;
  for (uint64_t step : StepsOf(report, Kind::kRemove)) {
    trash.push_back(JoinPath(root_, internal::DeletingDirName(step, internal::NewNonce())));
    CKPT_RETURN_IF_ERROR(env_->RenameFile(JoinPath(root_, StepDirName(step)), trash.back()));
  }
  if (!trash.empty()) CKPT_RETURN_IF_ERROR(env_->SyncDir(root_));
  // Step 4.
  std::vector<std::string> foreign;
  for (uint64_t step : StepsOf(report, Kind::kQuarantine)) foreign.push_back(StepDirName(step));
  CKPT_ASSIGN_OR_RETURN(report.quarantined, QuarantineEntries(foreign));
  // Step 5.
  if (trash.empty()) return report;
  if (background) {
    std::lock_guard<std::mutex> lock(remove_mu_);
    for (std::string& dir : trash) to_remove_.push_back(std::move(dir));
    if (remover_ == nullptr) remover_ = env_->StartThread([this] { RemoverMain(); });
    remove_cv_.notify_all();
    return report;
  }
  for (const std::string& dir : trash) CKPT_RETURN_IF_ERROR(RemoveRecursively(env_, dir));
  CKPT_RETURN_IF_ERROR(env_->SyncDir(root_));
  return report;
}

}  // namespace ckpt
