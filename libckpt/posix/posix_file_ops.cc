#include "libckpt/posix/posix_file_ops.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include "absl/strings/str_cat.h"
#include "libckpt/io_error.h"
#include "libckpt/posix/scoped_fd.h"

namespace ckpt::internal {
namespace {

class PosixFileLock : public FileLock {
 public:
  explicit PosixFileLock(ScopedFd fd) : fd_(std::move(fd)) {}
  // Closing the descriptor releases the flock.
 private:
  ScopedFd fd_;
};

}  // namespace

absl::Status PosixRenameFile(const std::string& src, const std::string& dst) {
  if (::rename(src.c_str(), dst.c_str()) != 0) {
    return IoError(errno, absl::StrCat("rename ", src, " to ", dst));
  }
  return absl::OkStatus();
}

absl::Status PosixRemoveFile(const std::string& path) {
  if (::unlink(path.c_str()) != 0) return IoError(errno, absl::StrCat("remove ", path));
  return absl::OkStatus();
}

absl::Status PosixCreateDir(const std::string& path) {
  if (::mkdir(path.c_str(), 0755) != 0) return IoError(errno, absl::StrCat("mkdir ", path));
  return absl::OkStatus();
}

absl::Status PosixRemoveDir(const std::string& path) {
  if (::rmdir(path.c_str()) != 0) {
    int err = errno;
    if (err == ENOTEMPTY || err == EEXIST) {
      return absl::FailedPreconditionError(absl::StrCat("rmdir ", path, ": directory not empty"));
    }
    return IoError(err, absl::StrCat("rmdir ", path));
  }
  return absl::OkStatus();
}

absl::Status PosixSyncDir(const std::string& path) {
  ScopedFd fd(::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!fd.valid()) return IoError(errno, absl::StrCat("open directory ", path));
  if (::fsync(fd.get()) != 0) return IoError(errno, absl::StrCat("sync directory ", path));
  if (int err = fd.Close(); err != 0) return IoError(err, absl::StrCat("close directory ", path));
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> PosixGetChildren(const std::string& dir) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return IoError(errno, absl::StrCat("list ", dir));
  std::vector<std::string> names;
  errno = 0;
  while (struct dirent* entry = ::readdir(d)) {
    std::string name = entry->d_name;
    if (name != "." && name != "..") names.push_back(std::move(name));
  }
  int err = errno;
  ::closedir(d);
  if (err != 0) return IoError(err, absl::StrCat("list ", dir));
  return names;
}

absl::StatusOr<uint64_t> PosixGetFileSize(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return IoError(errno, absl::StrCat("stat ", path));
  return static_cast<uint64_t>(st.st_size);
}

absl::StatusOr<bool> PosixIsDirectory(const std::string& path) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) return IoError(errno, absl::StrCat("stat ", path));
  return S_ISDIR(st.st_mode);
}

absl::StatusOr<std::unique_ptr<FileLock>> PosixLockFile(const std::string& path) {
  ScopedFd fd(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644));
  if (!fd.valid()) return IoError(errno, absl::StrCat("open lock file ", path));
  if (::flock(fd.get(), LOCK_EX | LOCK_NB) != 0) {
    int err = errno;
    if (err == EWOULDBLOCK) {
      return absl::FailedPreconditionError(
          absl::StrCat("lock ", path, ": held by another store handle or process"));
    }
    return IoError(err, absl::StrCat("lock ", path));
  }
  return std::unique_ptr<FileLock>(new PosixFileLock(std::move(fd)));
}

absl::Status PosixWriteAt(int fd, const std::byte* data, size_t n, uint64_t offset,
                          const std::string& path) {
  while (n > 0) {
    ssize_t w = ::pwrite(fd, data, n, static_cast<off_t>(offset));
    if (w < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      return IoError(errno, absl::StrCat("write ", path, " at offset ", offset));
    }
    data += w;
    n -= static_cast<size_t>(w);
    offset += static_cast<uint64_t>(w);
  }
  return absl::OkStatus();
}

absl::Status PosixReadAt(int fd, std::byte* out, size_t n, uint64_t offset,
                         const std::string& path) {
  while (n > 0) {
    ssize_t r = ::pread(fd, out, n, static_cast<off_t>(offset));
    if (r < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      return IoError(errno, absl::StrCat("read ", path, " at offset ", offset));
    }
    if (r == 0) {
      return absl::DataLossError(
          absl::StrCat("read ", path, ": file ends before offset ", offset + n));
    }
    out += r;
    n -= static_cast<size_t>(r);
    offset += static_cast<uint64_t>(r);
  }
  return absl::OkStatus();
}

}  // namespace ckpt::internal
