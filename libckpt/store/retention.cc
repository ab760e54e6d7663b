// Retention of a checkpoint root (StoreImpl::ApplyRetention, and after each commit).
//
// Retention: every doomed step is renamed to .deleting-step-N-<nonce>, then the root is synced
// once, then the renamed trees are removed. A step is never half there: it is renamed whole, and
// a crash before the sync brings it back whole while one after it leaves garbage that step 2 of
// recovery removes. (On a real file system the kernel may persist some of the renames before
// the sync; each step is still whole, but a crash may then delete a subset of the doomed steps.)
// After a commit the removal runs on the store's remover thread (the commit waits for the
// renames and the sync only); WaitForRemovals and the destructor wait for it.
#include <algorithm>
#include <set>

#include "absl/strings/str_cat.h"
#include "ckpt/base/status_macros.h"
#include "libckpt/filename.h"
#include "libckpt/store/store_impl.h"

namespace ckpt {

using internal::StepDirName;

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

absl::StatusOr<std::vector<uint64_t>> internal::StoreImpl::ApplyRetention(const RetentionPolicy& policy,
                                                                      bool dry_run) {
  return Retire(policy, dry_run, /*background=*/false);
}

absl::StatusOr<std::vector<uint64_t>> internal::StoreImpl::Retire(const RetentionPolicy& policy,
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
  CKPT_ASSIGN_OR_RETURN(std::vector<uint64_t> own, RetainableSteps(env_, root_));
  std::vector<uint64_t> doomed = RetiredSteps(own, latest, policy);
  if (dry_run) return doomed;
  if (doomed.empty()) return doomed;
  // All renames first and one SyncDir: the deletion is decided at once, then carried out.
  std::vector<std::string> trash;
  for (uint64_t step : doomed) {
    trash.push_back(JoinPath(root_, internal::DeletingDirName(step, internal::NewNonce())));
    CKPT_RETURN_IF_ERROR(env_->RenameFile(JoinPath(root_, StepDirName(step)), trash.back()));
  }
  CKPT_RETURN_IF_ERROR(env_->SyncDir(root_));
  if (background) {
    std::lock_guard<std::mutex> lock(remove_mu_);
    for (std::string& dir : trash) to_remove_.push_back(std::move(dir));
    if (remover_ == nullptr) remover_ = env_->StartThread([this] { RemoverMain(); });
    remove_cv_.notify_all();
    return doomed;
  }
  for (const std::string& dir : trash) CKPT_RETURN_IF_ERROR(RemoveRecursively(env_, dir));
  CKPT_RETURN_IF_ERROR(env_->SyncDir(root_));
  return doomed;
}

}  // namespace ckpt
