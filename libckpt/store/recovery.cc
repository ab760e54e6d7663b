// Recovery of a checkpoint root at Open (primary, writable handle). The save protocol it undoes
// is in transaction.cc and commit.cc; docs/design/recovery.md has the table of
// every case.
//
// The rule: recovery deletes only what ckpt created and can show it created. It removes its own
// staging, deleting and undo directories and LATEST.tmp, recognised by name AND by holding only
// entries of ckpt's own names and headers, all on the root's mount. It never follows a symbolic
// link, never enters another mount (device and mount id, so a bind mount counts), and never
// removes a file it does not recognise. What it cannot use moves whole into quarantine/ (one
// rename, never a copy); what it cannot move or judge stays in place and is reported.
//
// Judging a step (JudgeStep below) gives one of three verdicts:
//   good      its MANIFEST parses and verifies, names this step, and every data file's size
//             and header agree with it (chunks are checked when read, or by ckpt-tool verify);
//   damaged   bytes we read are wrong (kDataLoss: checksum, magic, size, truncation), or the
//             step directory or a file the protocol always writes is missing (kNotFound);
//   unknown   anything else: permission denied, an IO error, a format version newer than we
//             read (kUnimplemented), a symbolic link, FIFO, device or plain file where the
//             store keeps a directory or a regular file. We cannot tell whether it is good.
// LATEST is judged the same way: missing (while steps exist) or failing its checksum is
// damaged; unreadable, or not a regular file, is unknown.
//
// Steps. PlanRecovery (1-4) only reads and returns the actions; Recover carries them out (5).
// A dry run (ckpt-tool gc --dry-run) prints the plan, which is the list the real run acts on.
// Every action is idempotent, so a crash during recovery is repaired by the next Open.
// 1. (Open) Take the LOCK, an OS lock on an open descriptor of LOCK and of the root itself.
// 2. Garbage names (.staging-*, .deleting-*, .undo-* directories, LATEST.tmp); an entry
//    recovery cannot judge (an unreadable file in it, an IO error) is kept and reported:
//    a. not the kind of entry ckpt makes there (a file or link under a directory's name, a
//       directory or link under LATEST.tmp): kept, reported; it is not ours;
//    b. a mount point: kept, reported; recovery never enters another mount;
//    c. holding only ckpt's own entries (OwnTreeProblem): removed. By the commit protocol a
//       staging directory never reached its commit point, a deleting one was already decided,
//       an undo spill outlived its load;
//    d. holding anything else (a user's file, a link, a mount, a file without ckpt's header):
//       moved whole into quarantine/.
// 3. Judge LATEST and the step it names.
//    a. Either is unknown: refuse (kFailedPrecondition naming the file and the cause). Nothing
//       is changed: it may be the newest committed state, and only an operator can tell.
//    b. Both good: every step entry newer than LATEST was never published (a crash between
//       the rename of the step and the replacement of LATEST, or LATEST replaced by an older
//       copy). Each is judged: good: kept in place and reported (`ckpt-tool adopt ROOT STEP`
//       makes it LATEST; the next save of that step number moves it into quarantine/ first);
//       damaged, or not a directory: quarantined; unknown or a mount point: kept, reported.
//    c. Either is damaged (or LATEST is missing while steps exist): go to 4.
// 4. Fall back. When a readable LATEST named a damaged step S, the steps above S were never
//    published and are judged as in 3b (LATEST never moves forward to a step it did not name);
//    the walk starts at S. Otherwise (LATEST missing or damaged) it starts at the newest step.
//    Walk the steps down, skipping mount points (kept: never a candidate). The first good one, T, becomes LATEST. A damaged step is passed over; an
//    unknown one newer than T refuses as in 3a, since it may be the step LATEST should name.
//    With no good step at all: refuse (kDataLoss naming every step and why), changing nothing:
//    a store that lost every step never presents itself as empty; `ckpt-tool quarantine ROOT
//    --all` is how an operator starts afresh. Otherwise every damaged step newer than T is
//    quarantined, then LATEST := T.
// 5. Carry out: removals, SyncDir(root); quarantines (one rename each into quarantine/ under
//    <name>-<nonce>), SyncDir(quarantine), SyncDir(root); then LATEST (tmp + Sync + rename +
//    SyncDir). The quarantines come before LATEST moves, so a crash in between leaves LATEST
//    damaged and the next Open repeats 4 and reaches the same T.
#include <algorithm>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "ckpt/base/coding.h"
#include "ckpt/base/status_macros.h"
#include "libckpt/store/own_files.h"
#include "libckpt/store/store_impl.h"
#include "ckpt/formats/manifest.h"
#include "libckpt/filename.h"

namespace ckpt {
namespace {

using Kind = RecoveryAction::Kind;
using Type = FileInfo::Type;

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

absl::StatusOr<RecoveryAction> JudgeGarbage(Env* env, const std::string& root,
                                            const FileInfo& root_info, const std::string& name) {
  const std::string path = JoinPath(root, name);
  CKPT_ASSIGN_OR_RETURN(FileInfo info, env->Stat(path));
  const bool tmp_file = name == absl::StrCat(internal::kLatestName, ".tmp");
  // Step 2a.
  if (info.type != (tmp_file ? Type::kRegular : Type::kDirectory)) {
    return RecoveryAction{Kind::kKeep, name, "not the kind of entry ckpt makes there; not ours", std::nullopt};
  }
  // Step 2b.
  if (!info.SameMountAs(root_info)) {
    return RecoveryAction{Kind::kKeep, name, "a mount point, which recovery never enters", std::nullopt};
  }
  std::string problem;
  if (tmp_file) {
    CKPT_ASSIGN_OR_RETURN(problem,
                          internal::HeaderProblem(env, path, info, formats::kLatestMagic, false));
  } else {
    CKPT_ASSIGN_OR_RETURN(problem, internal::OwnTreeProblem(env, path, root_info, 1));
  }
  // Step 2c.
  if (problem.empty()) {
    return RecoveryAction{Kind::kRemove, name,
                          tmp_file ? "a LATEST.tmp a crash left"
                                   : "ckpt's own, left by a save, retention or load that ended",
                          std::nullopt};
  }
  // Step 2d. A LATEST.tmp that is not ours is a file someone put there: left alone.
  if (tmp_file) return RecoveryAction{Kind::kKeep, name, absl::StrCat("not ours: ", problem),
                                         std::nullopt};
  return RecoveryAction{Kind::kQuarantine, name,
                        absl::StrCat("has ckpt's name but not only ckpt's contents: ", problem),
                        std::nullopt};
}

absl::Status JudgeStep(Env* env, const std::string& root, uint64_t step) {
  StoreOptions options;
  options.env = env;
  return OpenStepOf(root, step, options).status();
}

// Step 3b: one entry named like a step, newer than a good LATEST.
absl::StatusOr<RecoveryAction> JudgeUnpublished(Env* env, const std::string& root,
                                                const FileInfo& root_info, uint64_t step,
                                                uint64_t latest) {
  const std::string name = internal::StepDirName(step);
  CKPT_ASSIGN_OR_RETURN(FileInfo info, env->Stat(JoinPath(root, name)));
  RecoveryAction action{Kind::kKeep, name, "", step};
  if (info.type != Type::kDirectory) {
    action.kind = Kind::kQuarantine;
    action.reason = "not a directory (a link or a file), which ckpt never puts under a step's name";
    return action;
  }
  if (!info.SameMountAs(root_info)) {
    action.reason = "a mount point, which recovery never enters";
    return action;
  }
  absl::Status judged = JudgeStep(env, root, step);
  switch (VerdictOf(judged)) {
    case Verdict::kGood:
      action.reason = absl::StrCat(
          "complete and intact but newer than LATEST (step ", latest,
          "): a commit that crashed before LATEST, or a stale LATEST; `ckpt-tool adopt ROOT ",
          step, "` makes it LATEST");
      return action;
    case Verdict::kDamaged:
      action.kind = Kind::kQuarantine;
      action.reason = absl::StrCat("unpublished and damaged: ", judged.message());
      return action;
    case Verdict::kUnknown:
      action.reason = absl::StrCat("cannot tell whether it is intact: ", judged.message());
      return action;
  }
  return action;
}

// Step 4.
// `named`: the step a readable LATEST names (damaged): only steps up to it are candidates, and
// the ones above it were never published and are judged as in step 3b (LATEST never moves
// forward to a step it did not name). Without it (LATEST missing or damaged) every step is.
absl::Status FallBack(Env* env, const std::string& root, const FileInfo& root_info,
                      RecoveryPlan& plan, std::optional<uint64_t> named = std::nullopt) {
  CKPT_ASSIGN_OR_RETURN(std::vector<uint64_t> steps, ListStepDirs(env, root));
  std::vector<std::string> damage;
  std::vector<RecoveryAction> above;
  if (named.has_value()) {
    while (!steps.empty() && steps.back() > *named) {
      CKPT_ASSIGN_OR_RETURN(RecoveryAction action,
                            JudgeUnpublished(env, root, root_info, steps.back(), *named));
      above.insert(above.begin(), std::move(action));
      steps.pop_back();
    }
  }
  plan.actions.insert(plan.actions.end(), above.begin(), above.end());
  for (auto it = steps.rbegin(); it != steps.rend(); ++it) {
    const std::string name = internal::StepDirName(*it);
    absl::StatusOr<FileInfo> info = env->Stat(JoinPath(root, name));
    if (info.ok() && info->type == Type::kDirectory && !info->SameMountAs(root_info)) {
      plan.actions.push_back({Kind::kKeep, name, "a mount point, which recovery never enters", *it});
      continue;
    }
    absl::Status judged = info.ok() ? JudgeStep(env, root, *it) : info.status();
    switch (VerdictOf(judged)) {
      case Verdict::kUnknown:
        return Refuse(absl::StrCat(JoinPath(root, name), " (newer than any step that verifies, "
                                                         "while ",
                                   plan.latest_problem, ")"),
                      judged);
      case Verdict::kDamaged:
        damage.push_back(absl::StrCat(name, ": ", judged.message()));
        plan.actions.push_back({Kind::kQuarantine, name,
                                absl::StrCat("damaged, newer than the step LATEST falls back "
                                             "to: ",
                                             judged.message()),
                                *it});
        continue;
      case Verdict::kGood:
        plan.latest = *it;
        plan.actions.push_back({Kind::kSetLatest, std::string(internal::kLatestName),
                                absl::StrCat(plan.latest_problem, "; the newest intact step is ",
                                             *it),
                                *it});
        return absl::OkStatus();
    }
  }
  return absl::DataLossError(absl::StrCat(
      root, ": no step is intact (", plan.latest_problem, "; ",
      damage.empty() ? std::string("no step directory") : absl::StrJoin(damage, "; "),
      "); nothing was changed. This root never opens as empty: to start a new run in it, "
      "`ckpt-tool quarantine ", root, " --all` moves every step and LATEST into quarantine/"));
}

}  // namespace

std::string DescribeAction(const RecoveryAction& action) {
  switch (action.kind) {
    case Kind::kRemove:
      return absl::StrCat("remove ", action.name, ": ", action.reason);
    case Kind::kQuarantine:
      return absl::StrCat("quarantine ", action.name, ": ", action.reason);
    case Kind::kKeep:
      return absl::StrCat("keep ", action.name, ": ", action.reason);
    case Kind::kSetLatest:
      return absl::StrCat("LATEST := step ", action.step.value_or(0), ": ", action.reason);
  }
  return action.name;
}

absl::StatusOr<RecoveryPlan> PlanRecovery(Env* env, const std::string& root) {
  RecoveryPlan plan;
  CKPT_ASSIGN_OR_RETURN(FileInfo root_info, env->Stat(root));
  CKPT_ASSIGN_OR_RETURN(std::vector<std::string> names, env->GetChildren(root));
  std::sort(names.begin(), names.end());
  // Step 2.
  for (const std::string& name : names) {
    if (!internal::IsGarbageName(name)) continue;
    absl::StatusOr<RecoveryAction> action = JudgeGarbage(env, root, root_info, name);
    if (!action.ok()) {
      // What recovery cannot judge stays where it is (a user's unreadable file, an IO error).
      action = RecoveryAction{Kind::kKeep, name,
                              absl::StrCat("cannot tell whether it is ckpt's own: ",
                                           action.status().message()),
                              std::nullopt};
    }
    plan.actions.push_back(*std::move(action));
  }
  // Step 3.
  absl::StatusOr<std::optional<uint64_t>> named = ReadLatest(env, root);
  const std::string latest_path = JoinPath(root, internal::kLatestName);
  switch (VerdictOf(named.status())) {
    case Verdict::kUnknown:
      return Refuse(latest_path, named.status());
    case Verdict::kDamaged:
      plan.latest_problem = std::string(named.status().message());
      CKPT_RETURN_IF_ERROR(FallBack(env, root, root_info, plan));
      return plan;
    case Verdict::kGood:
      break;
  }
  CKPT_ASSIGN_OR_RETURN(std::vector<uint64_t> steps, ListStepDirs(env, root));
  if (!named->has_value()) {
    if (steps.empty()) return plan;  // A new, empty store.
    plan.latest_problem = "LATEST is missing";
    CKPT_RETURN_IF_ERROR(FallBack(env, root, root_info, plan));
    return plan;
  }
  const uint64_t step = **named;
  absl::Status opened = JudgeStep(env, root, step);
  switch (VerdictOf(opened)) {
    case Verdict::kUnknown:
      return Refuse(
          absl::StrCat(JoinPath(root, internal::StepDirName(step)), " (the step LATEST names)"),
          opened);
    case Verdict::kDamaged:
      plan.latest_problem = absl::StrCat("LATEST names step ", step, ": ", opened.message());
      CKPT_RETURN_IF_ERROR(FallBack(env, root, root_info, plan, step));
      return plan;
    case Verdict::kGood:
      break;
  }
  plan.latest = step;
  for (uint64_t newer : steps) {
    if (newer <= step) continue;
    CKPT_ASSIGN_OR_RETURN(RecoveryAction action,
                          JudgeUnpublished(env, root, root_info, newer, step));
    plan.actions.push_back(std::move(action));
  }
  return plan;
}

absl::Status internal::StoreImpl::Recover() {
  CKPT_ASSIGN_OR_RETURN(RecoveryPlan plan, PlanRecovery(env_, root_));
  // Step 5, in the plan's order of kinds: removals, quarantines, LATEST.
  bool removed = false;
  for (const RecoveryAction& action : plan.actions) {
    if (action.kind != Kind::kRemove) continue;
    CKPT_RETURN_IF_ERROR(RemoveRecursively(env_, JoinPath(root_, action.name)));
    recovery_.removed.push_back(action.name);
    removed = true;
  }
  if (removed) CKPT_RETURN_IF_ERROR(env_->SyncDir(root_));
  std::vector<std::string> doomed;
  for (const RecoveryAction& action : plan.actions) {
    if (action.kind == Kind::kQuarantine) doomed.push_back(action.name);
    if (action.kind == Kind::kKeep) recovery_.kept.push_back(action.name);
  }
  CKPT_ASSIGN_OR_RETURN(recovery_.quarantined, QuarantineEntries(doomed));
  for (const RecoveryAction& action : plan.actions) {
    Log(absl::StrCat("recovery: ", DescribeAction(action)));
    if (action.kind != Kind::kSetLatest) continue;
    CKPT_RETURN_IF_ERROR(WriteFileAtomically(env_, JoinPath(root_, internal::kLatestName),
                                             formats::EncodeLatest(*action.step)));
    recovery_.latest_repaired = true;
  }
  recovery_.latest_problem = plan.latest_problem;
  recovery_.actions = std::move(plan.actions);
  std::lock_guard<std::mutex> lock(mu_);
  latest_ = plan.latest;
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> internal::StoreImpl::QuarantineEntries(
    const std::vector<std::string>& names) {
  std::vector<std::string> moved_to;
  if (names.empty()) return moved_to;
  const std::string dir = JoinPath(root_, kQuarantineDirName);
  absl::Status made = env_->CreateDir(dir);
  if (made.ok()) {
    CKPT_RETURN_IF_ERROR(env_->SyncDir(root_));
  } else if (!absl::IsAlreadyExists(made)) {
    return made;
  } else {
    CKPT_ASSIGN_OR_RETURN(FileInfo info, env_->Stat(dir));
    if (info.type != FileInfo::Type::kDirectory) {
      return absl::FailedPreconditionError(absl::StrCat(
          dir, ": exists and is not a directory; recovery cannot set entries aside"));
    }
  }
  for (const std::string& name : names) {
    const std::string moved = absl::StrCat(name, "-", internal::NewNonce());
    CKPT_RETURN_IF_ERROR(env_->RenameFile(JoinPath(root_, name), JoinPath(dir, moved)));
    moved_to.push_back(absl::StrCat(kQuarantineDirName, "/", moved));
    Log(absl::StrCat("moved ", name, " to ", JoinPath(dir, moved)));
  }
  CKPT_RETURN_IF_ERROR(env_->SyncDir(dir));
  CKPT_RETURN_IF_ERROR(env_->SyncDir(root_));
  return moved_to;
}

absl::StatusOr<std::vector<std::string>> internal::StoreImpl::ListQuarantine() const {
  const std::string dir = JoinPath(root_, kQuarantineDirName);
  absl::StatusOr<std::vector<std::string>> names = env_->GetChildren(dir);
  if (absl::IsNotFound(names.status())) return std::vector<std::string>{};
  CKPT_RETURN_IF_ERROR(names.status());
  std::sort(names->begin(), names->end());
  return names;
}

absl::StatusOr<std::vector<std::string>> internal::StoreImpl::PurgeQuarantine(bool dry_run) {
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
