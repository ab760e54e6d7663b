// Recovery of a checkpoint root at Open (primary, writable handle). The save protocol it undoes
// is in checkpoint_writer.cc; docs/design/commit-protocol.md has the same rules with examples.
//
// The rule: delete only what is provably garbage. Anything we cannot read is left where it is
// and the open refuses, naming it; anything proven damaged is moved aside, never deleted.
//
// Judging a step (Judge below) gives one of three verdicts:
//   good      its MANIFEST parses and verifies, names this step, and every data file's size
//             and header agree with it;
//   damaged   bytes we read are wrong (kDataLoss: checksum, magic, size, truncation), or the
//             step directory or a file the protocol always writes is missing (kNotFound);
//   unknown   anything else: permission denied, an IO error, a format version newer than we
//             read (kUnimplemented), a symbolic link, FIFO, device or plain file where the
//             store keeps a directory or a regular file. We cannot tell whether it is good.
// LATEST is judged the same way: missing (while steps exist) or failing its checksum is
// damaged; unreadable, or not a regular file, is unknown.
//
// Steps, each idempotent, so that a crash during recovery is repaired by the next Open:
// 1. Take <root>/LOCK (never through a link): one primary recovers, saves or deletes at a time.
// 2. Remove .staging-* and .deleting-* directories and LATEST.tmp: by the commit protocol a
//    staging directory never reached its commit point and a deleting one was already decided.
//    Only what is itself a directory (or, for LATEST.tmp, a file) is removed, never followed;
//    anything else under such a name is not ours and stays.
//    SyncDir(root).
// 3. Judge LATEST and the step it names.
//    a. Both good: go to 5.
//    b. Either is unknown: refuse (kFailedPrecondition naming the file and the cause). Nothing
//       is changed: it may be the newest committed state, and only an operator can tell.
//    c. Either is damaged (or LATEST is missing while steps exist): go to 4.
// 4. Fall back. Walk the steps from the newest down. The first good one, T, becomes LATEST. A
//    damaged step is passed over; an unknown one newer than T refuses as in 3b, since it may
//    be the step LATEST should name. Every step newer than T is moved whole (one rename per
//    step) into <root>/quarantine/ under a fresh name; then SyncDir(quarantine), SyncDir(root);
//    then LATEST := T (tmp + Sync + rename + SyncDir). With no good step, every step is
//    quarantined and LATEST removed. A crash in between leaves LATEST damaged, so the next
//    Open repeats 4 and reaches the same T. `ckpt-tool inspect` lists quarantine/ and
//    `ckpt-tool gc --purge-quarantine` deletes it when an operator decides to.
// 5. Steps newer than a good LATEST were never published (LATEST is the commit point; a crash
//    fell between the rename of the step and the replacement of LATEST): directories are
//    removed; an entry with a step's name that is not a directory is not ours and is
//    quarantined instead. SyncDir(root).
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "ckpt/base/coding.h"
#include "ckpt/base/status_macros.h"
#include "ckpt/checkpoint_store.h"
#include "libckpt/filename.h"

namespace ckpt {
namespace {

enum class Verdict { kGood, kDamaged, kUnknown };

Verdict VerdictOf(const absl::Status& status) {
  if (status.ok()) return Verdict::kGood;
  if (absl::IsDataLoss(status) || absl::IsNotFound(status)) return Verdict::kDamaged;
  return Verdict::kUnknown;
}

absl::Status Refuse(absl::string_view what, const absl::Status& cause) {
  return absl::FailedPreconditionError(absl::StrCat(
      "recovery cannot tell whether ", what, " is intact: ", cause.message(),
      "; nothing was changed. Fix the cause (or move that entry out of the root to fall back "
      "to an older step) and open again"));
}

}  // namespace

absl::Status CheckpointStore::Recover() {
  // Step 2.
  CKPT_RETURN_IF_ERROR(RemoveGarbage());
  // Step 3.
  absl::StatusOr<std::optional<uint64_t>> named = ReadLatest(env_, root_);
  const std::string latest_path = JoinPath(root_, internal::kLatestName);
  switch (VerdictOf(named.status())) {
    case Verdict::kUnknown:
      return Refuse(latest_path, named.status());
    case Verdict::kDamaged:
      recovery_.latest_problem = std::string(named.status().message());
      return FallBack();
    case Verdict::kGood:
      break;
  }
  if (!named->has_value()) {
    CKPT_ASSIGN_OR_RETURN(std::vector<uint64_t> steps, ListStepDirs(env_, root_));
    if (steps.empty()) return absl::OkStatus();  // A new, empty store.
    recovery_.latest_problem = "LATEST is missing";
    return FallBack();
  }
  const uint64_t step = **named;
  absl::Status opened = OpenStep(step).status();
  switch (VerdictOf(opened)) {
    case Verdict::kUnknown:
      return Refuse(
          absl::StrCat(JoinPath(root_, internal::StepDirName(step)), " (the step LATEST names)"),
          opened);
    case Verdict::kDamaged:
      recovery_.latest_problem = absl::StrCat("LATEST names step ", step, ": ", opened.message());
      return FallBack();
    case Verdict::kGood:
      break;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    latest_ = step;
  }
  // Step 5.
  return RemoveUnpublished();
}

absl::Status CheckpointStore::RemoveGarbage() {
  CKPT_ASSIGN_OR_RETURN(std::vector<std::string> names, env_->GetChildren(root_));
  bool removed = false;
  for (const std::string& name : names) {
    if (!internal::IsGarbageName(name)) continue;
    const std::string path = JoinPath(root_, name);
    // Only the kind of entry ckpt makes under that name goes: a directory for staging, deleting
    // and undo names, a file for LATEST.tmp. Anything else there is not ours and stays.
    CKPT_ASSIGN_OR_RETURN(bool is_dir, env_->IsDirectory(path));
    const bool tmp_file = name == absl::StrCat(internal::kLatestName, ".tmp");
    if (is_dir == tmp_file) {
      Log(absl::StrCat("recovery left ", path, ": not the kind of entry ckpt makes there"));
      continue;
    }
    CKPT_RETURN_IF_ERROR(RemoveRecursively(env_, path));
    recovery_.removed.push_back(name);
    Log(absl::StrCat("recovery removed ", path));
    removed = true;
  }
  if (removed) CKPT_RETURN_IF_ERROR(env_->SyncDir(root_));
  return absl::OkStatus();
}

absl::Status CheckpointStore::FallBack() {
  CKPT_ASSIGN_OR_RETURN(std::vector<uint64_t> steps, ListStepDirs(env_, root_));
  std::optional<uint64_t> good;
  std::vector<uint64_t> newer;
  for (auto it = steps.rbegin(); it != steps.rend(); ++it) {
    absl::Status opened = OpenStep(*it).status();
    Verdict verdict = VerdictOf(opened);
    if (verdict == Verdict::kUnknown) {
      return Refuse(absl::StrCat(JoinPath(root_, internal::StepDirName(*it)),
                                 " (newer than any "
                                 "step that verifies, while ",
                                 recovery_.latest_problem, ")"),
                    opened);
    }
    if (verdict == Verdict::kGood) {
      good = *it;
      break;
    }
    newer.push_back(*it);
  }
  // Step 4: set the newer steps aside before LATEST moves, so a crash repeats this step.
  CKPT_RETURN_IF_ERROR(Quarantine(newer));
  const std::string latest_path = JoinPath(root_, internal::kLatestName);
  recovery_.latest_repaired = true;
  if (good.has_value()) {
    CKPT_RETURN_IF_ERROR(WriteFileAtomically(env_, latest_path, formats::EncodeLatest(*good)));
    {
      std::lock_guard<std::mutex> lock(mu_);
      latest_ = *good;
    }
    Log(absl::StrCat("recovery: ", recovery_.latest_problem, "; LATEST now names step ", *good,
                     newer.empty() ? "" : "; newer steps moved into quarantine/"));
    return absl::OkStatus();
  }
  absl::Status removed = env_->RemoveFile(latest_path);
  if (!removed.ok() && !absl::IsNotFound(removed)) return removed;
  Log(absl::StrCat("recovery: ", recovery_.latest_problem, "; no step verifies",
                   newer.empty() ? "" : "; every step moved into quarantine/"));
  return env_->SyncDir(root_);
}

absl::Status CheckpointStore::Quarantine(const std::vector<uint64_t>& steps) {
  if (steps.empty()) return absl::OkStatus();
  const std::string dir = JoinPath(root_, kQuarantineDirName);
  absl::Status made = env_->CreateDir(dir);
  if (made.ok()) {
    CKPT_RETURN_IF_ERROR(env_->SyncDir(root_));
  } else if (!absl::IsAlreadyExists(made)) {
    return made;
  } else {
    CKPT_ASSIGN_OR_RETURN(bool is_dir, env_->IsDirectory(dir));
    if (!is_dir) {
      return absl::FailedPreconditionError(
          absl::StrCat(dir, ": exists and is not a directory; recovery cannot set steps aside"));
    }
  }
  for (uint64_t step : steps) {
    const std::string name = absl::StrCat(internal::StepDirName(step), "-", internal::NewNonce());
    CKPT_RETURN_IF_ERROR(
        env_->RenameFile(JoinPath(root_, internal::StepDirName(step)), JoinPath(dir, name)));
    recovery_.quarantined.push_back(absl::StrCat(kQuarantineDirName, "/", name));
    Log(absl::StrCat("recovery moved ", internal::StepDirName(step), " to ", JoinPath(dir, name)));
  }
  CKPT_RETURN_IF_ERROR(env_->SyncDir(dir));
  return env_->SyncDir(root_);
}

absl::Status CheckpointStore::RemoveUnpublished() {
  CKPT_ASSIGN_OR_RETURN(std::vector<uint64_t> steps, ListStepDirs(env_, root_));
  const uint64_t latest = *latest_step();
  std::vector<uint64_t> foreign;
  bool removed = false;
  for (uint64_t step : steps) {
    if (step <= latest) continue;
    const std::string path = JoinPath(root_, internal::StepDirName(step));
    CKPT_ASSIGN_OR_RETURN(bool is_dir, env_->IsDirectory(path));
    if (!is_dir) {
      foreign.push_back(step);
      continue;
    }
    CKPT_RETURN_IF_ERROR(RemoveRecursively(env_, path));
    recovery_.removed.push_back(internal::StepDirName(step));
    Log(absl::StrCat("recovery removed unpublished ", path));
    removed = true;
  }
  if (removed) CKPT_RETURN_IF_ERROR(env_->SyncDir(root_));
  return Quarantine(foreign);
}

absl::StatusOr<std::vector<std::string>> CheckpointStore::ListQuarantine() const {
  const std::string dir = JoinPath(root_, kQuarantineDirName);
  absl::StatusOr<std::vector<std::string>> names = env_->GetChildren(dir);
  if (absl::IsNotFound(names.status())) return std::vector<std::string>{};
  CKPT_RETURN_IF_ERROR(names.status());
  std::sort(names->begin(), names->end());
  return names;
}

absl::StatusOr<std::vector<std::string>> CheckpointStore::PurgeQuarantine(bool dry_run) {
  if (!dry_run && (!options_.primary || options_.read_only)) {
    return absl::FailedPreconditionError(
        absl::StrCat(root_, ": purging quarantine/ needs the primary, writable store handle"));
  }
  CKPT_ASSIGN_OR_RETURN(std::vector<std::string> names, ListQuarantine());
  if (dry_run || names.empty()) return names;
  // Renamed out first, as retention does: a crash leaves each entry whole or decided garbage.
  const std::string dir = JoinPath(root_, kQuarantineDirName);
  std::vector<std::string> trash;
  for (const std::string& name : names) {
    trash.push_back(JoinPath(
        root_, absl::StrCat(internal::kDeletingPrefix, "quarantine-", internal::NewNonce())));
    CKPT_RETURN_IF_ERROR(env_->RenameFile(JoinPath(dir, name), trash.back()));
  }
  CKPT_RETURN_IF_ERROR(env_->SyncDir(dir));
  CKPT_RETURN_IF_ERROR(env_->SyncDir(root_));
  for (const std::string& path : trash) CKPT_RETURN_IF_ERROR(RemoveRecursively(env_, path));
  CKPT_RETURN_IF_ERROR(env_->SyncDir(root_));
  return names;
}

}  // namespace ckpt
