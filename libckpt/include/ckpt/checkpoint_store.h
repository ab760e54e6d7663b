// CheckpointStore: a directory of transactional checkpoints (DESIGN.md §3). An interface, as
// LevelDB's DB: the implementation (store, transaction, commit, retention, recovery) is in
// libckpt/store/, behind Open.
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
// True when directory `root` holds what only a store holds: LATEST, LOCK, quarantine/, an entry
// named like a step directory, or a save's or load's leftovers (staging, deleting, undo). The one
// test of "is this a ckpt root?" (ckpt-tool's path detection and model-only loads use it too).
// IO errors of listing it as they come.
absl::StatusOr<bool> LooksLikeStore(Env* env, const std::string& root);
// The step directories of `root` that retention may ever retire, ascending: directories on the
// root's own mount (a link or a mount point under a step's name is not the store's to delete).
absl::StatusOr<std::vector<uint64_t>> RetainableSteps(Env* env, const std::string& root);
// The committed steps `policy` retires when LATEST names `latest`, of `steps` (ascending):
// steps above LATEST are not committed and neither count nor go; LATEST always stays.
std::vector<uint64_t> RetiredSteps(const std::vector<uint64_t>& steps,
                                   std::optional<uint64_t> latest, const RetentionPolicy& policy);
// What retention does to each of the steps `doomed` of `root` (from RetiredSteps), by the rule
// of libckpt/store/retention.cc: delete (only ckpt's files), quarantine (something else), or
// leave (a mount point, or cannot tell). Changes nothing; the real run acts on this very list.
// IO errors of the root's Stat as they come (an error judging one step leaves that step).
absl::StatusOr<RetentionReport> PlanRetention(Env* env, const std::string& root,
                                              const std::vector<uint64_t>& doomed);
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
  // by the rules written at the top of libckpt/store/recovery.cc: only ckpt's own garbage is
  // removed, what is damaged or foreign is set aside in quarantine/, intact unpublished steps
  // and mount points stay in place and are reported, and what cannot be read (permission, IO
  // error, a newer format version, a link or FIFO where the store keeps a file) is left in
  // place while Open returns kFailedPrecondition naming it and why. A non-primary or read-only
  // handle only reads LATEST and changes nothing. Returns kNotFound when a non-primary or
  // read-only root is missing, kFailedPrecondition when the LOCK is held or when the root is
  // or lies inside a committed step or a staging directory of another store (naming both:
  // that store's retention or recovery would take it along), kDataLoss when no
  // step is intact (primary) or a read-only handle finds LATEST damaged, IO errors as they
  // come.
  static absl::StatusOr<std::unique_ptr<CheckpointStore>> Open(const std::string& root,
                                                               const StoreOptions& options);
  // Waits for the removals retention started (WaitForRemovals), then releases the LOCK.
  virtual ~CheckpointStore() = default;

  virtual const std::string& root() const = 0;
  virtual Env* env() const = 0;
  virtual const StoreOptions& options() const = 0;
  virtual const RecoveryReport& recovery() const = 0;
  // The step LATEST named at Open or after the last commit through this handle.
  virtual std::optional<uint64_t> latest_step() const = 0;
  // Steps with a directory in the root, ascending (manifests not verified).
  virtual absl::StatusOr<std::vector<uint64_t>> ListSteps() const = 0;
  // Names of the entries of quarantine/ (empty when there is none).
  virtual absl::StatusOr<std::vector<std::string>> ListQuarantine() const = 0;

  // Begins saving `step` on this rank. Collective over `coordinator` (null: a single process).
  // Rank 0 must call it on the primary handle. An entry already named like `step` (an
  // unpublished step recovery kept) is first moved whole into quarantine/. kFailedPrecondition on every rank when `step`
  // is not newer than LATEST, another save is in flight or the handle is read-only; IO errors
  // of creating the staging directory on every rank. Local errors after that are reported by
  // Commit().
  virtual absl::StatusOr<std::unique_ptr<SaveTransaction>> BeginSave(
      uint64_t step, Coordinator* coordinator = nullptr) = 0;

  // Opens a committed step for reading. kNotFound if there is none; kDataLoss if its MANIFEST
  // or a data file header is damaged, or its MANIFEST names another step.
  virtual absl::StatusOr<std::unique_ptr<CheckpointReader>> OpenStep(uint64_t step) const = 0;
  // kNotFound when nothing has been committed.
  virtual absl::StatusOr<std::unique_ptr<CheckpointReader>> OpenLatest() const = 0;

  // Retires the committed steps `policy` does not keep (never the one LATEST names), by
  // recovery's rule (PlanRetention): a step holding only ckpt's files is deleted, one holding
  // anything else moves whole into quarantine/, one that is or holds a mount point stays.
  // Each deletion is an atomic rename followed by removal, so a crash leaves every remaining
  // step whole. With dry_run nothing changes. Returns what was done (or would be), per step.
  // kFailedPrecondition on a non-primary or read-only handle (a dry run works on any).
  virtual absl::StatusOr<RetentionReport> ApplyRetention(const RetentionPolicy& policy,
                                                         bool dry_run = false) = 0;
  // Waits until the steps that retention retired after a commit are removed. A commit renames
  // the steps it retires away (one SyncDir) and leaves removing their files to a background
  // thread, so that a commit (and an async save's Finalize) does not wait for the file system
  // to free gigabytes. The destructor waits too.
  virtual void WaitForRemovals() = 0;
  // Deletes everything in quarantine/ (rename-then-remove, as retention does). Returns the
  // names deleted (or that would be, with dry_run). Primary, writable handle only.
  virtual absl::StatusOr<std::vector<std::string>> PurgeQuarantine(bool dry_run = false) = 0;

  // Makes LATEST name `step` (ckpt-tool adopt): an intact step recovery kept above LATEST, or
  // an older one to go back to. Every chunk is verified first. kNotFound when there is no such
  // step, kDataLoss naming the chunk when it does not verify, kFailedPrecondition naming the
  // step when it is a symbolic link or on another mount than the root (a bind mount of another
  // store's step is never the store's own), on a non-primary or read-only handle or while a
  // save is in flight. On failure LATEST is unchanged.
  virtual absl::Status Adopt(uint64_t step) = 0;
  // Moves `step` whole into quarantine/ (ckpt-tool quarantine). When LATEST named it, LATEST
  // then names the newest older step that opens intact; with none, LATEST stays and the next
  // Open refuses (no intact step). Returns the entry's name in quarantine/. kNotFound when
  // there is no such step; kFailedPrecondition as Adopt.
  virtual absl::StatusOr<std::string> QuarantineStep(uint64_t step) = 0;
  // Moves every step and LATEST into quarantine/: the root then opens as a new, empty store
  // (how an operator starts afresh in a root whose steps are all damaged). Returns the names
  // moved, in quarantine/.
  virtual absl::StatusOr<std::vector<std::string>> QuarantineAll() = 0;

 protected:
  CheckpointStore() = default;
  CheckpointStore(const CheckpointStore&) = delete;  // Owns a root's LOCK.
  CheckpointStore& operator=(const CheckpointStore&) = delete;
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
