// CheckpointStore: a directory of transactional checkpoints (DESIGN.md §3).
#ifndef CKPT_CHECKPOINT_STORE_H_
#define CKPT_CHECKPOINT_STORE_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "ckpt/checkpoint_reader.h"
#include "ckpt/checkpoint_writer.h"
#include "ckpt/coordinator.h"
#include "ckpt/env.h"
#include "ckpt/options.h"

namespace ckpt {

// What Open() found and did to make the root consistent.
struct RecoveryReport {
  std::vector<std::string> removed;  // Garbage and unpublished steps removed.
  bool latest_repaired = false;      // LATEST was missing or damaged and was rewritten.
  std::string latest_problem;        // Why, when latest_repaired.
};

// A root directory holding committed steps, LATEST and in-progress saves. The primary handle
// owns the root (LOCK) and is the only one that commits, recovers and deletes; see
// StoreOptions::primary. One save at a time per store. Safe for concurrent readers; BeginSave
// and ApplyRetention must not run concurrently with each other.
class CheckpointStore {
 public:
  // Opens `root`, creating it if absent (primary only). The primary recovers:
  //   1. takes <root>/LOCK (kFailedPrecondition if another handle holds it);
  //   2. removes staging and deleting directories left by a crash;
  //   3. reads LATEST; if it is missing or damaged, or names a step whose MANIFEST does not
  //      verify, picks the newest step whose MANIFEST verifies and rewrites LATEST durably;
  //   4. removes step directories newer than LATEST: LATEST is the commit point, so they were
  //      never published.
  // A non-primary handle only reads LATEST. Returns kNotFound when a non-primary root is
  // missing, IO errors as they come.
  static absl::StatusOr<std::unique_ptr<CheckpointStore>> Open(const std::string& root,
                                                               const StoreOptions& options);
  ~CheckpointStore();

  const std::string& root() const { return root_; }
  Env* env() const { return env_; }
  const StoreOptions& options() const { return options_; }
  const RecoveryReport& recovery() const { return recovery_; }
  // The step LATEST named at Open or after the last commit through this handle.
  std::optional<uint64_t> latest_step() const { return latest_; }
  // Steps with a directory in the root, ascending (manifests not verified).
  absl::StatusOr<std::vector<uint64_t>> ListSteps() const;

  // Begins saving `step` on this rank. Collective over `coordinator` (null: a single process).
  // Rank 0 must call it on the primary handle. kFailedPrecondition on every rank when `step`
  // is not newer than LATEST or another save is in flight; IO errors of creating the staging
  // directory on every rank. Local errors after that are reported by Commit().
  absl::StatusOr<std::unique_ptr<SaveTransaction>> BeginSave(uint64_t step,
                                                             Coordinator* coordinator = nullptr);

  // Opens a committed step for reading. kNotFound if there is none; kDataLoss if its MANIFEST
  // or a data file header is damaged.
  absl::StatusOr<std::unique_ptr<CheckpointReader>> OpenStep(uint64_t step) const;
  // kNotFound when nothing has been committed.
  absl::StatusOr<std::unique_ptr<CheckpointReader>> OpenLatest() const;

  // Deletes the committed steps `policy` does not keep (never the one LATEST names); each
  // deletion is an atomic rename followed by removal, so a crash leaves every remaining step
  // whole. With dry_run nothing changes. Returns the steps deleted (or that would be).
  // Primary only (kFailedPrecondition otherwise).
  absl::StatusOr<std::vector<uint64_t>> ApplyRetention(const RetentionPolicy& policy,
                                                       bool dry_run = false);

 private:
  friend class SaveTransaction;
  CheckpointStore(std::string root, const StoreOptions& options, Env* env);
  absl::Status Recover();
  absl::Status RemoveGarbage();
  absl::Status RepairLatest();
  void Log(absl::string_view message) const;
  // Called by rank 0's transaction once LATEST durably names `step`.
  void OnCommitted(uint64_t step);
  void OnSaveEnded() { save_in_flight_ = false; }

  const std::string root_;
  const StoreOptions options_;
  Env* const env_;
  std::unique_ptr<FileLock> lock_;
  RecoveryReport recovery_;
  std::optional<uint64_t> latest_;
  bool save_in_flight_ = false;
};

}  // namespace ckpt

#endif  // CKPT_CHECKPOINT_STORE_H_
