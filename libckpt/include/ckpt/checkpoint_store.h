// CheckpointStore: a directory of transactional checkpoints (DESIGN.md §3).
#ifndef CKPT_CHECKPOINT_STORE_H_
#define CKPT_CHECKPOINT_STORE_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "absl/status/statusor.h"
#include "ckpt/checkpoint_reader.h"
#include "ckpt/checkpoint_writer.h"
#include "ckpt/coordinator.h"
#include "ckpt/env.h"
#include "ckpt/options.h"
#include "ckpt/recovery.h"

namespace ckpt {

// The name of the folder below a root into which recovery moves steps it must set aside.
inline constexpr char kQuarantineDirName[] = "quarantine";

// Reads <root>/LATEST without following a link. nullopt when there is none; kDataLoss when it
// is damaged (wrong size, magic or checksum); kFailedPrecondition when it is not a regular
// file; IO and permission errors as they come.
absl::StatusOr<std::optional<uint64_t>> ReadLatest(Env* env, const std::string& root);
// The steps that have an entry named like a step directory in `root`, ascending. Whether each
// is a directory, or verifies, is not checked.
absl::StatusOr<std::vector<uint64_t>> ListStepDirs(Env* env, const std::string& root);
// Opens committed step `step` of `root` for reading, as CheckpointStore::OpenStep does (with
// `options`' env, direct IO and read threads): kNotFound if there is none, kFailedPrecondition
// for a link or file under the step's name, the reader's errors otherwise.
absl::StatusOr<std::unique_ptr<CheckpointReader>> OpenStepOf(const std::string& root,
                                                             uint64_t step,
                                                             const StoreOptions& options);
// The name of `step`'s directory below a root ("step-00001200").
std::string StepDirectoryName(uint64_t step);
// True when directory `root` holds what only a store holds: LATEST, LOCK or an entry named like
// a step directory. IO errors of listing it as they come.
absl::StatusOr<bool> LooksLikeStore(Env* env, const std::string& root);
// The step directories of `root` that retention may ever retire, ascending: directories on the
// root's own mount (a link or a mount point under a step's name is not the store's to delete).
absl::StatusOr<std::vector<uint64_t>> RetainableSteps(Env* env, const std::string& root);
// The committed steps `policy` retires when LATEST names `latest`, of `steps` (ascending):
// steps above LATEST are not committed and neither count nor go; LATEST always stays.
std::vector<uint64_t> RetiredSteps(const std::vector<uint64_t>& steps,
                                   std::optional<uint64_t> latest, const RetentionPolicy& policy);
// The entries of `root` left by saves that never committed or deletions in progress (staging
// and deleting directories, LATEST.tmp), sorted: what the next recovery removes.
absl::StatusOr<std::vector<std::string>> ListUncommitted(Env* env, const std::string& root);

// A root directory holding committed steps, LATEST and in-progress saves. The primary handle
// owns the root (LOCK) and is the only one that commits, recovers and deletes; see
// StoreOptions::primary and StoreOptions::read_only. One save at a time per store.
// Thread safety: latest_step(), OpenStep(), OpenLatest() and ListSteps() are safe to call
// concurrently with each other and with a save's commit; BeginSave and ApplyRetention must not
// run concurrently with each other.
class CheckpointStore {
 public:
  // Opens `root`, creating it if absent (a writable primary only). A root given as a symbolic
  // link to a directory is resolved once; root() is the resolved path. The primary recovers,
  // by the rules written at the top of libckpt/recovery.cc: only ckpt's own garbage is
  // removed, what is damaged or foreign is set aside in quarantine/, intact unpublished steps
  // and mount points stay in place and are reported, and what cannot be read (permission, IO
  // error, a newer format version, a link or FIFO where the store keeps a file) is left in
  // place while Open returns kFailedPrecondition naming it and why. A non-primary or read-only
  // handle only reads LATEST and changes nothing. Returns kNotFound when a non-primary or
  // read-only root is missing, kFailedPrecondition when the LOCK is held, kDataLoss when no
  // step is intact (primary) or a read-only handle finds LATEST damaged, IO errors as they
  // come.
  static absl::StatusOr<std::unique_ptr<CheckpointStore>> Open(const std::string& root,
                                                               const StoreOptions& options);
  ~CheckpointStore();

  const std::string& root() const { return root_; }
  Env* env() const { return env_; }
  const StoreOptions& options() const { return options_; }
  const RecoveryReport& recovery() const { return recovery_; }
  // The step LATEST named at Open or after the last commit through this handle.
  std::optional<uint64_t> latest_step() const;
  // Steps with a directory in the root, ascending (manifests not verified).
  absl::StatusOr<std::vector<uint64_t>> ListSteps() const;
  // Names of the entries of quarantine/ (empty when there is none).
  absl::StatusOr<std::vector<std::string>> ListQuarantine() const;

  // Begins saving `step` on this rank. Collective over `coordinator` (null: a single process).
  // Rank 0 must call it on the primary handle. An entry already named like `step` (an
  // unpublished step recovery kept) is first moved whole into quarantine/. kFailedPrecondition on every rank when `step`
  // is not newer than LATEST, another save is in flight or the handle is read-only; IO errors
  // of creating the staging directory on every rank. Local errors after that are reported by
  // Commit().
  absl::StatusOr<std::unique_ptr<SaveTransaction>> BeginSave(uint64_t step,
                                                             Coordinator* coordinator = nullptr);

  // Opens a committed step for reading. kNotFound if there is none; kDataLoss if its MANIFEST
  // or a data file header is damaged, or its MANIFEST names another step.
  absl::StatusOr<std::unique_ptr<CheckpointReader>> OpenStep(uint64_t step) const;
  // kNotFound when nothing has been committed.
  absl::StatusOr<std::unique_ptr<CheckpointReader>> OpenLatest() const;

  // Deletes the committed steps `policy` does not keep (never the one LATEST names); each
  // deletion is an atomic rename followed by removal, so a crash leaves every remaining step
  // whole. With dry_run nothing changes. Returns the steps deleted (or that would be).
  // kFailedPrecondition on a non-primary or read-only handle (a dry run works on any).
  absl::StatusOr<std::vector<uint64_t>> ApplyRetention(const RetentionPolicy& policy,
                                                       bool dry_run = false);
  // Waits until the steps that retention retired after a commit are removed. A commit renames
  // the steps it retires away (one SyncDir) and leaves removing their files to a background
  // thread, so that a commit (and an async save's Finalize) does not wait for the file system
  // to free gigabytes. The destructor waits too.
  void WaitForRemovals();
  // Deletes everything in quarantine/ (rename-then-remove, as retention does). Returns the
  // names deleted (or that would be, with dry_run). Primary, writable handle only.
  absl::StatusOr<std::vector<std::string>> PurgeQuarantine(bool dry_run = false);

  // Makes LATEST name `step` (ckpt-tool adopt): an intact step recovery kept above LATEST, or
  // an older one to go back to. Every chunk is verified first. kNotFound when there is no such
  // step, kDataLoss naming the chunk when it does not verify, kFailedPrecondition on a
  // non-primary or read-only handle or while a save is in flight. On failure LATEST is
  // unchanged.
  absl::Status Adopt(uint64_t step);
  // Moves `step` whole into quarantine/ (ckpt-tool quarantine). When LATEST named it, LATEST
  // then names the newest older step that opens intact; with none, LATEST stays and the next
  // Open refuses (no intact step). Returns the entry's name in quarantine/. kNotFound when
  // there is no such step; kFailedPrecondition as Adopt.
  absl::StatusOr<std::string> QuarantineStep(uint64_t step);
  // Moves every step and LATEST into quarantine/: the root then opens as a new, empty store
  // (how an operator starts afresh in a root whose steps are all damaged). Returns the names
  // moved, in quarantine/.
  absl::StatusOr<std::vector<std::string>> QuarantineAll();

 private:
  friend class SaveTransaction;
  CheckpointStore(std::string root, const StoreOptions& options, Env* env);
  // Recovery (libckpt/recovery.cc).
  absl::Status Recover();
  // Renames each entry of the root named in `names` into quarantine/<name>-<nonce>, then
  // syncs quarantine/ and the root. Returns the new names ("quarantine/<name>-<nonce>").
  absl::StatusOr<std::vector<std::string>> QuarantineEntries(const std::vector<std::string>& names);
  absl::Status CheckWritableIdle(absl::string_view what);
  // BeginSave, rank 0: moves an entry named like `step` (above LATEST) into quarantine/.
  absl::Status SetAsideUnpublished(uint64_t step);
  void Log(absl::string_view message) const;
  // ApplyRetention; with `background`, the renamed steps are removed by the remover thread.
  absl::StatusOr<std::vector<uint64_t>> Retire(const RetentionPolicy& policy, bool dry_run,
                                               bool background);
  void RemoverMain();
  // Called by rank 0's transaction once LATEST durably names `step`.
  void OnCommitted(uint64_t step);
  void OnSaveEnded();
  // A commit wrote LATEST naming `step` but could neither make it durable nor put the previous
  // one back: what LATEST names is unknown until recovery, so further saves are refused.
  void OnLatestUncertain(uint64_t step);

  const std::string root_;
  const StoreOptions options_;
  Env* const env_;
  std::unique_ptr<FileLock> lock_;
  RecoveryReport recovery_;
  // latest_ is written by the committing thread and read by any: guarded.
  mutable std::mutex mu_;
  std::optional<uint64_t> latest_;
  bool save_in_flight_ = false;
  std::optional<uint64_t> latest_uncertain_;  // See OnLatestUncertain.
  // Retired step directories (renamed to .deleting-*) the remover thread has yet to remove;
  // recovery removes any a crash leaves.
  std::mutex remove_mu_;
  std::condition_variable remove_cv_;
  std::deque<std::string> to_remove_;  // Guarded by remove_mu_, as the two flags.
  bool removing_ = false;
  bool remover_stop_ = false;
  std::thread remover_;  // Started by the first background removal; joined by the destructor.
};

// Collective: this rank's handle on `root` for a job of `coordinator->size()` ranks, opened in
// the one safe order. Rank 0 opens the primary handle (options.primary is set for it and
// cleared for the others), which creates and recovers the root; only once it has (its
// outcome broadcast) do the others open theirs, so none reads a root that recovery is still
// changing. Then the ranks vote: every rank returns a handle, or every rank fails with the
// first failure (naming the rank it happened on) and holds none. Errors as
// CheckpointStore::Open, and the coordinator's. REQUIRES: every rank calls it, with the same
// root and options.
absl::StatusOr<std::unique_ptr<CheckpointStore>> OpenStoreOnRanks(const std::string& root,
                                                                  StoreOptions options,
                                                                  Coordinator* coordinator);

}  // namespace ckpt

#endif  // CKPT_CHECKPOINT_STORE_H_
