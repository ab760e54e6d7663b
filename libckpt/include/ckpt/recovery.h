// What recovery decides about a checkpoint root, and what it did (libckpt/store/recovery.cc has the
// rules as numbered steps; docs/design/recovery.md has the table of every case).
#ifndef CKPT_RECOVERY_H_
#define CKPT_RECOVERY_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "ckpt/env.h"

namespace ckpt {

// One thing recovery does to one entry of the root.
struct RecoveryAction {
  enum class Kind {
    kRemove,      // ckpt's own garbage (staging, deleting, undo, LATEST.tmp), shown to be ours.
    kQuarantine,  // Moved whole into quarantine/ (damaged, incomplete or foreign); never deleted.
    kKeep,        // Left where it is and reported (an intact unpublished step, a mount point,
                  // something recovery cannot judge or that is not the store's).
    kSetLatest,   // LATEST is rewritten to name `step` (a fallback).
  };
  Kind kind = Kind::kKeep;
  std::string name;  // The entry below the root ("step-00000005"); "LATEST" for kSetLatest.
  std::string reason;
  std::optional<uint64_t> step;  // The step the entry holds or LATEST is set to, if any.
};

// The line `ckpt-tool gc` prints for an action, the same for a dry run and the real run:
// "remove .staging-step-00000004-...: <reason>".
std::string DescribeAction(const RecoveryAction& action);

// What recovery of a root does, in order: removals, then quarantines, then LATEST.
struct RecoveryPlan {
  std::vector<RecoveryAction> actions;
  std::optional<uint64_t> latest;  // The step LATEST names once the plan is carried out.
  std::string latest_problem;      // Why LATEST is rewritten, when it is.
};

// Judges `root` by the rules of libckpt/store/recovery.cc and returns what recovery would do,
// changing nothing (this is `ckpt-tool gc --dry-run`). kFailedPrecondition when recovery cannot
// tell whether LATEST, the step it names or a step that could replace it is intact (a
// permission or IO error, a newer format, a link where a step belongs): recovery then refuses
// and changes nothing. kDataLoss when steps exist but none is intact: recovery refuses rather
// than present the store as empty. IO errors of listing the root as they come.
absl::StatusOr<RecoveryPlan> PlanRecovery(Env* env, const std::string& root);

// What Open() found and did to make the root consistent.
struct RecoveryReport {
  std::vector<RecoveryAction> actions;   // As carried out, in order.
  std::vector<std::string> removed;      // Names removed (ckpt's own garbage).
  std::vector<std::string> quarantined;  // Where entries went: "quarantine/<name>-<nonce>".
  std::vector<std::string> kept;         // Names left in place and reported.
  bool latest_repaired = false;          // LATEST was missing or damaged and was rewritten.
  std::string latest_problem;            // Why, when latest_repaired.
};

// What retention did (or, for a dry run, would do) to the committed steps a policy retires,
// under recovery's rule (libckpt/store/retention.cc has the steps): one action per retired
// step, ascending. kRemove: it held exactly its MANIFEST and the data files that lists, and
// was deleted. kQuarantine: it held something ckpt did not write (a user's file, a FIFO, a
// directory, a nested store, a link), and was moved whole into quarantine/. kKeep: it is or
// holds a mount point, or it could not be judged; it was left in place. `reason` says which.
struct RetentionReport {
  std::vector<RecoveryAction> actions;
  std::vector<std::string> quarantined;  // Where: "quarantine/<name>-<nonce>" (real runs only).
};

// The steps of `report` whose action is `kind`, ascending.
std::vector<uint64_t> StepsOf(const RetentionReport& report, RecoveryAction::Kind kind);

// The line `ckpt-tool gc` prints for a retention action, the same words for a dry run (with
// "would") and the real run: "would quarantine step-00000002 (holds notes.txt, which ckpt did
// not write (...))", "deleted step-00000001 (...)", "left step-00000003 (...)".
std::string DescribeRetention(const RecoveryAction& action, bool dry_run);

}  // namespace ckpt

#endif  // CKPT_RECOVERY_H_
