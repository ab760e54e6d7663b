// ckpt::Env is the only door to files and directories (STYLE.md §3). Every entry point of the
// library takes an Env through its Options, so tests can substitute MemEnv or a
// FaultInjectionEnv and lose, tear or fail any call.
//
// Durability contract, which every Env implements and FaultInjectionEnv enforces:
//   * bytes appended to a WritableFile are durable only after its Sync() returns OK;
//   * a created, renamed or removed directory entry is durable only after SyncDir() of the
//     directory that holds it returns OK.
#ifndef CKPT_ENV_H_
#define CKPT_ENV_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>
#include "absl/strings/string_view.h"

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace ckpt {

// Hints for opening a file. An Env that cannot honour a hint ignores it.
struct FileOptions {
  // Bypass the page cache (O_DIRECT) for large sequential transfers. Appends and reads of any
  // size and alignment stay correct; aligned ones (4 KiB offsets, lengths and addresses) are
  // the fast path.
  bool direct_io = false;
  // Reads only: follow a symbolic link at the last component of the path. The store's own
  // files (LATEST, MANIFEST, data files) are opened with false: ckpt never makes a link there,
  // so a link is someone else's and is refused (kFailedPrecondition) rather than followed. HF
  // model files may be links (the HuggingFace cache links snapshots to blobs).
  bool follow_symlinks = true;
};

// What WriteAt requires of its offset, length and buffer address.
inline constexpr size_t kWriteAtAlignment = 4096;

// A file being written from the start, by Append (one writer) or by WriteAt (several).
class WritableFile {
 public:
  virtual ~WritableFile() = default;

  // Appends `data`. An Env may complete the write asynchronously; an error of an earlier
  // Append is then reported by a later Append, Sync or Close. Returns kResourceExhausted on
  // ENOSPC/EDQUOT, another code for other IO errors; after a failure the file's contents are
  // unspecified and the caller must abandon it.
  virtual absl::Status Append(std::span<const std::byte> data) = 0;
  // Writes `data` at `offset`, for a writer that lays out whole blocks itself and keeps several
  // writes in flight from several threads. The offset, the length and the address of `data`
  // must be multiples of kWriteAtAlignment, so that an O_DIRECT file takes the bytes as they
  // are (kInvalidArgument otherwise). A file is written by Append or by WriteAt, never both
  // (kFailedPrecondition). Safe to call from several threads at once; Sync and Close must not
  // overlap a WriteAt. The write is done (or failed, with Append's error codes) when it returns;
  // unwritten gaps read as zeros. size() is then the largest end written.
  virtual absl::Status WriteAt(uint64_t offset, std::span<const std::byte> data) = 0;
  // Makes every byte appended or written so far durable.
  virtual absl::Status Sync() = 0;
  // Completes outstanding writes and releases the file. Does not imply Sync. Calling any
  // method after Close is an error (kFailedPrecondition).
  virtual absl::Status Close() = 0;
  // Bytes appended so far (or the largest end WriteAt wrote).
  virtual uint64_t size() const = 0;
};

// A file opened for reading at arbitrary offsets. Safe for concurrent use.
class RandomAccessFile {
 public:
  virtual ~RandomAccessFile() = default;
  // Reads exactly out.size() bytes at `offset`. Returns kDataLoss naming the file and offset
  // when the file ends before offset + out.size(); `out` is then unspecified.
  virtual absl::Status Read(uint64_t offset, std::span<std::byte> out) const = 0;
  // The size of the file when it was opened.
  virtual uint64_t size() const = 0;
};

// What Env::Stat reports of one directory entry, which it never follows.
struct FileInfo {
  enum class Type { kRegular, kDirectory, kSymlink, kOther };
  Type type = Type::kOther;
  uint64_t size_bytes = 0;  // Of a regular file; 0 for anything else.
  // Where the entry lives. Two entries with different values are on different file systems or
  // different mounts of one (a bind mount shows as another mount_id on the same device); an
  // Env that cannot tell mounts apart reports 0 for both fields everywhere.
  uint64_t device = 0;
  uint64_t mount_id = 0;
  bool SameMountAs(const FileInfo& other) const {
    return device == other.device && mount_id == other.mount_id;
  }
};

// An advisory lock held until destruction.
class FileLock {
 public:
  virtual ~FileLock() = default;
};

// The file system as ckpt sees it. Thread safety: every Env of ours (PosixEnv, UringEnv,
// MemEnv, FaultInjectionEnv) is safe for concurrent use, calls included; the objects it returns
// are not shared unless their class says so (a WritableFile has one writer, a RandomAccessFile
// is safe for concurrent reads). An Env outlives every file and lock it handed out.
// A thread an Env started (Env::StartThread). Join() waits until its function has returned;
// the destructor joins a thread not joined yet.
class EnvThread {
 public:
  virtual ~EnvThread() = default;
  virtual void Join() = 0;
};

class Env {
 public:
  virtual ~Env() = default;

  // The process-wide default: a UringEnv when an io_uring ring can be created here, otherwise
  // a PosixEnv (the reason is kept in DefaultEnvFallbackReason()). Never null; never deleted.
  static Env* Default();

  // Creates a new, empty file at `path`. kAlreadyExists when anything (a file, a directory, a
  // symbolic link, dangling or not) has that name: an existing name is never truncated and a
  // planted link is never written through (O_CREAT | O_EXCL). kNotFound if the directory does
  // not exist. Callers that replace a file remove the old name first.
  virtual absl::StatusOr<std::unique_ptr<WritableFile>> NewWritableFile(
      const std::string& path, const FileOptions& options) = 0;
  // Opens an existing regular file. kNotFound if it does not exist; kFailedPrecondition naming
  // the type when it is not a regular file (a FIFO, device or socket is never opened in a way
  // that can block, and a directory is refused), and when it is a symbolic link and
  // options.follow_symlinks is false.
  virtual absl::StatusOr<std::unique_ptr<RandomAccessFile>> NewRandomAccessFile(
      const std::string& path, const FileOptions& options) = 0;
  // Atomically renames `src` to `dst`, replacing a file `dst`. Durable after SyncDir.
  virtual absl::Status RenameFile(const std::string& src, const std::string& dst) = 0;
  // Removes a file. kNotFound if absent.
  virtual absl::Status RemoveFile(const std::string& path) = 0;
  // Creates a directory. kAlreadyExists if present; kNotFound if the parent is missing.
  virtual absl::Status CreateDir(const std::string& path) = 0;
  // Removes an empty directory. kNotFound if absent; kFailedPrecondition if not empty.
  virtual absl::Status RemoveDir(const std::string& path) = 0;
  // Makes the entries of directory `path` (creates, renames, removes) durable.
  virtual absl::Status SyncDir(const std::string& path) = 0;
  // Names (not paths) of the entries of `dir`, without "." and "..", in no particular order.
  virtual absl::StatusOr<std::vector<std::string>> GetChildren(const std::string& dir) = 0;
  // kNotFound if absent.
  virtual absl::StatusOr<uint64_t> GetFileSize(const std::string& path) = 0;
  // OK and true for a directory, false for anything else; kNotFound if absent.
  virtual absl::StatusOr<bool> IsDirectory(const std::string& path) = 0;
  // The entry at `path` itself (a symbolic link is reported, never followed): its type, size
  // and mount. kNotFound if absent.
  virtual absl::StatusOr<FileInfo> Stat(const std::string& path) = 0;
  // Takes an exclusive advisory lock on `path` (created if absent), held on an open
  // descriptor: removing, replacing or recreating the file while it is held does not let a
  // second holder in (PosixEnv also locks the directory holding `path`; where the file system
  // refuses a directory lock, the file's lock alone holds). kFailedPrecondition if another
  // holder has it, in this process or another, or if `path` is a symbolic link (never
  // followed: a dangling link would otherwise create its target) or not a regular file.
  virtual absl::StatusOr<std::unique_ptr<FileLock>> LockFile(const std::string& path) = 0;
  // The absolute path of `path` with every symbolic link resolved, so that a root given as a
  // link to a directory is resolved once and worked below. kNotFound if it does not exist.
  virtual absl::StatusOr<std::string> RealPath(const std::string& path) = 0;
  // Runs `fn` on a new thread: the one way libckpt starts a thread (a save's writer threads,
  // a read's I/O and worker threads, the remover of retired steps), so that an Env can count,
  // bound or name them (LevelDB's Env::StartThread). The default is a std::thread.
  virtual std::unique_ptr<EnvThread> StartThread(std::function<void()> fn);
  // Bytes of memory this process could allocate and touch now without swapping or meeting the
  // OOM killer (Linux: MemAvailable of /proc/meminfo), or nullopt when unknown. Linux
  // overcommits, so an allocation that succeeds says nothing of this: a copy kept in memory
  // rather than written out (a load's undo) asks first. The default is nullopt.
  virtual std::optional<uint64_t> AvailableMemoryBytes();
};

// Forwards every call to a target Env; test Envs override only what they change.
class EnvWrapper : public Env {
 public:
  // REQUIRES: target outlives the wrapper.
  explicit EnvWrapper(Env* target) : target_(target) {}
  Env* target() const { return target_; }

  absl::StatusOr<std::unique_ptr<WritableFile>> NewWritableFile(
      const std::string& path, const FileOptions& options) override {
    return target_->NewWritableFile(path, options);
  }
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> NewRandomAccessFile(
      const std::string& path, const FileOptions& options) override {
    return target_->NewRandomAccessFile(path, options);
  }
  absl::Status RenameFile(const std::string& src, const std::string& dst) override {
    return target_->RenameFile(src, dst);
  }
  absl::Status RemoveFile(const std::string& path) override { return target_->RemoveFile(path); }
  absl::Status CreateDir(const std::string& path) override { return target_->CreateDir(path); }
  absl::Status RemoveDir(const std::string& path) override { return target_->RemoveDir(path); }
  absl::Status SyncDir(const std::string& path) override { return target_->SyncDir(path); }
  absl::StatusOr<std::vector<std::string>> GetChildren(const std::string& dir) override {
    return target_->GetChildren(dir);
  }
  absl::StatusOr<uint64_t> GetFileSize(const std::string& path) override {
    return target_->GetFileSize(path);
  }
  absl::StatusOr<bool> IsDirectory(const std::string& path) override {
    return target_->IsDirectory(path);
  }
  absl::StatusOr<FileInfo> Stat(const std::string& path) override { return target_->Stat(path); }
  absl::StatusOr<std::unique_ptr<FileLock>> LockFile(const std::string& path) override {
    return target_->LockFile(path);
  }
  absl::StatusOr<std::string> RealPath(const std::string& path) override {
    return target_->RealPath(path);
  }
  std::unique_ptr<EnvThread> StartThread(std::function<void()> fn) override {
    return target_->StartThread(std::move(fn));
  }
  std::optional<uint64_t> AvailableMemoryBytes() override {
    return target_->AvailableMemoryBytes();
  }

 private:
  Env* target_;
};

// A PosixEnv (pread/pwrite/fsync). The caller owns it.
std::unique_ptr<Env> NewPosixEnv();
// A UringEnv: io_uring with O_DIRECT, registered aligned buffers and a bounded queue.
// kUnimplemented when no ring can be created here (seccomp, sysctl, old kernel), naming why.
absl::StatusOr<std::unique_ptr<Env>> NewUringEnv();
// A purely in-memory Env; everything is durable at once. Safe for concurrent use.
std::unique_ptr<Env> NewMemEnv();
// Why Env::Default() is not a UringEnv, or empty when it is.
std::string DefaultEnvFallbackReason();

// Helpers built on Env.
// Reads a whole regular file into a string. The size is checked before anything is allocated:
// kDataLoss naming the file and both sizes when it holds more than `max_bytes`.
absl::StatusOr<std::string> ReadFileToString(Env* env, const std::string& path, uint64_t max_bytes,
                                             const FileOptions& options = FileOptions{});
// Writes `parts` to `path` through `tmp` (same directory): a regular file at `tmp` (ours from a
// crash) is removed, anything else there (a link, FIFO or directory someone planted) is
// kFailedPrecondition and never followed; then `tmp` is created exclusively, appended,
// synced, closed and renamed over `path`. The rename is durable only after the
// directory is synced, which is left to the caller (several files may share one SyncDir). On
// failure `tmp` is removed (best effort) and `path` is untouched.
absl::Status WriteFileViaTmp(Env* env, const std::string& tmp, const std::string& path,
                             std::span<const std::span<const std::byte>> parts,
                             const FileOptions& options = FileOptions{});
// WriteFileViaTmp with the file's bytes appended by `write` (a file too large to hold in
// memory streams through it); the same rules for `tmp`, `path` and failures.
absl::Status WriteFileViaTmpWith(Env* env, const std::string& tmp, const std::string& path,
                                 const std::function<absl::Status(WritableFile&)>& write,
                                 const FileOptions& options = FileOptions{});
// WriteFileViaTmp through `path`.tmp, then SyncDir of the parent: durable on return.
absl::Status WriteFileAtomically(Env* env, const std::string& path, absl::string_view data);
// Removes `path` and, if it is a directory, everything below it. A symbolic link is removed,
// never followed; an entry on another mount than `path` (a mount point below it) is never
// entered: kFailedPrecondition naming it, with what was removed before it gone. Not durable
// until the parent directory is synced. kNotFound if absent.
absl::Status RemoveRecursively(Env* env, const std::string& path);
// Joins path components with '/'.
std::string JoinPath(absl::string_view dir, absl::string_view name);
// The directory part of `path` ("." when none).
std::string Dirname(absl::string_view path);

}  // namespace ckpt

#endif  // CKPT_ENV_H_
