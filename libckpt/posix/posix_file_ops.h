// Directory and metadata operations on a POSIX file system, shared by PosixEnv and UringEnv
// (they differ only in how file data moves).
#ifndef CKPT_LIBCKPT_POSIX_POSIX_FILE_OPS_H_
#define CKPT_LIBCKPT_POSIX_POSIX_FILE_OPS_H_

#include <sys/types.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "ckpt/env.h"
#include "libckpt/posix/scoped_fd.h"

namespace ckpt::internal {

absl::Status PosixRenameFile(const std::string& src, const std::string& dst);
absl::Status PosixRemoveFile(const std::string& path);
absl::Status PosixCreateDir(const std::string& path);
absl::Status PosixRemoveDir(const std::string& path);
absl::Status PosixSyncDir(const std::string& path);
absl::StatusOr<std::vector<std::string>> PosixGetChildren(const std::string& dir);
absl::StatusOr<uint64_t> PosixGetFileSize(const std::string& path);
absl::StatusOr<bool> PosixIsDirectory(const std::string& path);
absl::StatusOr<FileInfo> PosixStat(const std::string& path);
absl::StatusOr<std::unique_ptr<FileLock>> PosixLockFile(const std::string& path);
absl::StatusOr<std::string> PosixRealPath(const std::string& path);
// MemAvailable of /proc/meminfo in bytes; nullopt where it cannot be read.
std::optional<uint64_t> PosixAvailableMemoryBytes();

// A regular file opened for reading, with its identity and size at open.
struct OpenedFile {
  ScopedFd fd;
  uint64_t size = 0;
  dev_t dev = 0;
  ino_t ino = 0;
};
// Opens `path` read-only (plus `extra_flags`, e.g. O_DIRECT) under Env::NewRandomAccessFile's
// contract: the type is checked before the open and again on the descriptor, the open never
// blocks (O_NONBLOCK: a FIFO would wait for a writer), and with follow_symlinks false a link
// is refused (O_NOFOLLOW).
absl::StatusOr<OpenedFile> OpenRegularFileForRead(const std::string& path, bool follow_symlinks,
                                                  int extra_flags);
// Creates `path` for writing under Env::NewWritableFile's contract (O_CREAT | O_EXCL).
absl::StatusOr<ScopedFd> CreateNewFile(const std::string& path, int extra_flags);

// Full pwrite/pread loops that retry EINTR and short transfers.
absl::Status PosixWriteAt(int fd, const std::byte* data, size_t n, uint64_t offset,
                          const std::string& path);
absl::Status PosixReadAt(int fd, std::byte* out, size_t n, uint64_t offset,
                         const std::string& path);

// EnvWrapper-style base whose metadata calls use the functions above.
class PosixMetadataEnv : public Env {
 public:
  absl::Status RenameFile(const std::string& src, const std::string& dst) override {
    return PosixRenameFile(src, dst);
  }
  absl::Status RemoveFile(const std::string& path) override { return PosixRemoveFile(path); }
  absl::Status CreateDir(const std::string& path) override { return PosixCreateDir(path); }
  absl::Status RemoveDir(const std::string& path) override { return PosixRemoveDir(path); }
  absl::Status SyncDir(const std::string& path) override { return PosixSyncDir(path); }
  absl::StatusOr<std::vector<std::string>> GetChildren(const std::string& dir) override {
    return PosixGetChildren(dir);
  }
  absl::StatusOr<uint64_t> GetFileSize(const std::string& path) override {
    return PosixGetFileSize(path);
  }
  absl::StatusOr<bool> IsDirectory(const std::string& path) override {
    return PosixIsDirectory(path);
  }
  absl::StatusOr<FileInfo> Stat(const std::string& path) override { return PosixStat(path); }
  absl::StatusOr<std::unique_ptr<FileLock>> LockFile(const std::string& path) override {
    return PosixLockFile(path);
  }
  absl::StatusOr<std::string> RealPath(const std::string& path) override {
    return PosixRealPath(path);
  }
  std::optional<uint64_t> AvailableMemoryBytes() override { return PosixAvailableMemoryBytes(); }
};

}  // namespace ckpt::internal

#endif  // CKPT_LIBCKPT_POSIX_POSIX_FILE_OPS_H_
