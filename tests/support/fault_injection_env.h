// FaultInjectionEnv: an EnvWrapper that fails, tears and crashes on command (STYLE.md §3).
#ifndef CKPT_TESTS_SUPPORT_FAULT_INJECTION_ENV_H_
#define CKPT_TESTS_SUPPORT_FAULT_INJECTION_ENV_H_

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "ckpt/env.h"

namespace ckpt::testing {

// Wraps a target Env and records what has been made durable:
//   * per written file, the size at its last Sync;
//   * per directory, the creates, removes and renames since its last SyncDir.
// It can fail the n-th mutating call with an errno, tear an Append (keep a prefix, then fail),
// and crash after the k-th mutating call: from then on every call fails with EIO, as if the
// process had died. DropUnsyncedData() then makes the target look like the disk after a power
// cut: files cut back to their last Sync (or at a seeded random point of the unsynced tail),
// unsynced creates deleted, unsynced removes and renames undone. Afterwards everything present
// counts as durable and the Env works again.
//
// Mutating calls, counted from 1: NewWritableFile, Append, Sync, RenameFile, RemoveFile,
// CreateDir, RemoveDir, SyncDir. Safe for concurrent use.
class FaultInjectionEnv : public EnvWrapper {
 public:
  // kAppend counts WritableFile::Append and WriteAt alike: a write of file data.
  enum class Op { kAny, kOpen, kAppend, kSync, kRename, kRemove, kCreateDir, kRemoveDir, kSyncDir };

  explicit FaultInjectionEnv(Env* target);
  ~FaultInjectionEnv() override;

  // The n-th mutating call (of kind `op`, counted from now) fails with `errnum`.
  void FailNth(uint64_t n, int errnum, Op op = Op::kAny);
  // The n-th Append or WriteAt (counted from now) writes only its first `keep_bytes` (a WriteAt
  // whole blocks of them: it writes aligned blocks only), then fails with EIO or, with crash,
  // crashes the Env.
  void TearNthAppend(uint64_t n, size_t keep_bytes, bool crash);
  // After the k-th mutating call (counted from now) completes, the Env crashes; k = 0 crashes
  // at once.
  void CrashAfter(uint64_t k);
  // Every later NewRandomAccessFile of a path ending in `path_suffix`, after the first `skip`
  // such opens, fails with `errnum` (EACCES as for a file another user owns, EIO), until
  // Disarm() or DropUnsyncedData().
  void FailReadOpens(const std::string& path_suffix, int errnum, int skip = 0);
  // Clears every armed failure.
  void Disarm();
  // AvailableMemoryBytes reports `bytes` from now on (nullopt: unknown), not the target's.
  void SetAvailableMemory(std::optional<uint64_t> bytes);

  uint64_t mutating_calls() const;
  bool crashed() const;

  // Drops what was never made durable (see the class comment) and resets the Env to working,
  // with nothing pending. With a seed, each unsynced tail is cut at a random point instead of
  // at the last Sync.
  absl::Status DropUnsyncedData(std::optional<uint64_t> seed = std::nullopt);

  absl::StatusOr<std::unique_ptr<WritableFile>> NewWritableFile(
      const std::string& path, const FileOptions& options) override;
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> NewRandomAccessFile(
      const std::string& path, const FileOptions& options) override;
  absl::Status RenameFile(const std::string& src, const std::string& dst) override;
  absl::Status RemoveFile(const std::string& path) override;
  absl::Status CreateDir(const std::string& path) override;
  absl::Status RemoveDir(const std::string& path) override;
  absl::Status SyncDir(const std::string& path) override;
  absl::StatusOr<std::vector<std::string>> GetChildren(const std::string& dir) override;
  absl::StatusOr<uint64_t> GetFileSize(const std::string& path) override;
  absl::StatusOr<bool> IsDirectory(const std::string& path) override;
  absl::StatusOr<FileInfo> Stat(const std::string& path) override;
  absl::StatusOr<std::unique_ptr<FileLock>> LockFile(const std::string& path) override;
  std::optional<uint64_t> AvailableMemoryBytes() override;

 private:
  class File;
  friend class File;
  struct FileState {
    uint64_t size = 0;
    uint64_t synced = 0;
  };
  struct DirOp {
    enum Kind { kCreate, kRemove, kRename } kind;
    std::string path;  // Created or removed entry; rename destination.
    std::string src;   // Rename source.
    bool is_dir = false;
    std::optional<std::string> saved;  // Durable contents of a removed or replaced file.
  };

  // Counts a mutating call; returns the injected failure for it, if any.
  absl::Status BeforeMutation(Op op, const std::string& what);
  void AfterMutation();
  absl::Status CheckAlive(const std::string& what) const;
  std::optional<std::string> DurableContents(const std::string& path);
  void MovePaths(const std::string& from, const std::string& to);
  absl::Status Truncate(const std::string& path, uint64_t size);
  absl::Status Restore(const std::string& path, const std::string& contents);

  mutable std::recursive_mutex mu_;
  uint64_t calls_ = 0;
  std::map<Op, uint64_t> per_op_calls_;
  struct Failure {
    uint64_t n;
    int errnum;
    Op op;
  };
  std::vector<Failure> failures_;
  std::optional<uint64_t> tear_append_;
  size_t tear_keep_ = 0;
  bool tear_crash_ = false;
  uint64_t appends_ = 0;
  std::optional<uint64_t> crash_after_;
  struct ReadFailure {
    std::string suffix;
    int errnum;
    int skip;  // Matching opens still to let through.
  };
  std::vector<ReadFailure> read_failures_;
  bool crashed_ = false;
  std::optional<std::optional<uint64_t>> available_memory_;  // Set: what AvailableMemoryBytes says.
  std::map<std::string, std::shared_ptr<FileState>> files_;
  std::vector<DirOp> pending_;
};

}  // namespace ckpt::testing

#endif  // CKPT_TESTS_SUPPORT_FAULT_INJECTION_ENV_H_
