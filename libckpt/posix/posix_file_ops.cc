#include "libckpt/posix/posix_file_ops.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "ckpt/base/status_macros.h"
#include "libckpt/io_error.h"
#include "libckpt/posix/scoped_fd.h"

namespace ckpt::internal {
namespace {

const char* TypeName(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISLNK(mode)) return "a symbolic link";
  return "not a regular file";
}

absl::Status NotRegular(const std::string& path, mode_t mode) {
  return absl::FailedPreconditionError(
      absl::StrCat("open ", path, ": is ", TypeName(mode), ", not a regular file"));
}

absl::Status SymlinkRefused(const std::string& path, absl::string_view what) {
  return absl::FailedPreconditionError(
      absl::StrCat("open ", what, " ", path,
                   ": is a symbolic link, which ckpt never creates there; not "
                   "following it"));
}

// Holds the flock of the lock file and, where the file system allows one, of its directory.
class PosixFileLock : public FileLock {
 public:
  PosixFileLock(ScopedFd fd, ScopedFd dir) : fd_(std::move(fd)), dir_(std::move(dir)) {}
  // Closing the descriptors releases the flocks.
 private:
  ScopedFd fd_;
  ScopedFd dir_;
};

// Locks the directory holding a lock file, so that a second opener is refused even after the
// file was removed or replaced (its new inode would take a lock of its own). An empty ScopedFd
// where the file system cannot lock a directory (NFS emulates flock with POSIX locks, which a
// descriptor opened read-only cannot take exclusively): the file's lock alone then holds.
absl::StatusOr<ScopedFd> LockDirectoryOf(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  const std::string dir = slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
  ScopedFd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!fd.valid()) return ScopedFd();
  if (::flock(fd.get(), LOCK_EX | LOCK_NB) != 0) {
    if (errno == EWOULDBLOCK) {
      return absl::FailedPreconditionError(absl::StrCat(
          "lock ", path, ": ", dir,
          " is held by another store handle or process (its lock file may have been removed "
          "or replaced meanwhile)"));
    }
    return ScopedFd();
  }
  return fd;
}

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

absl::StatusOr<FileInfo> PosixStat(const std::string& path) {
  struct statx stx;
  // STATX_MNT_ID tells a bind mount from its source, which st_dev does not; a kernel without
  // it (before 5.8) leaves the bit clear and mount_id 0, so only devices are compared.
  if (::statx(AT_FDCWD, path.c_str(), AT_SYMLINK_NOFOLLOW | AT_NO_AUTOMOUNT,
              STATX_TYPE | STATX_SIZE | STATX_MNT_ID, &stx) != 0) {
    if (errno != ENOSYS && errno != EPERM) return IoError(errno, absl::StrCat("stat ", path));
    // A seccomp profile that predates statx: lstat, devices only.
    struct stat st;
    if (::lstat(path.c_str(), &st) != 0) return IoError(errno, absl::StrCat("stat ", path));
    FileInfo info;
    if (S_ISREG(st.st_mode)) {
      info.type = FileInfo::Type::kRegular;
      info.size_bytes = static_cast<uint64_t>(st.st_size);
    } else if (S_ISDIR(st.st_mode)) {
      info.type = FileInfo::Type::kDirectory;
    } else if (S_ISLNK(st.st_mode)) {
      info.type = FileInfo::Type::kSymlink;
    }
    info.device = static_cast<uint64_t>(st.st_dev);
    return info;
  }
  FileInfo info;
  const mode_t mode = stx.stx_mode;
  if (S_ISREG(mode)) {
    info.type = FileInfo::Type::kRegular;
    info.size_bytes = stx.stx_size;
  } else if (S_ISDIR(mode)) {
    info.type = FileInfo::Type::kDirectory;
  } else if (S_ISLNK(mode)) {
    info.type = FileInfo::Type::kSymlink;
  }
  info.device = (uint64_t{stx.stx_dev_major} << 32) | stx.stx_dev_minor;
  if (stx.stx_mask & STATX_MNT_ID) info.mount_id = stx.stx_mnt_id;
  return info;
}

absl::StatusOr<std::unique_ptr<FileLock>> PosixLockFile(const std::string& path) {
  // O_NOFOLLOW: a dangling link planted at LOCK would otherwise make us create its target.
  ScopedFd fd(::open(path.c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0644));
  if (!fd.valid()) {
    if (errno == ELOOP) return SymlinkRefused(path, "lock file");
    return IoError(errno, absl::StrCat("open lock file ", path));
  }
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) return IoError(errno, absl::StrCat("stat ", path));
  if (!S_ISREG(st.st_mode)) return NotRegular(path, st.st_mode);
  if (::flock(fd.get(), LOCK_EX | LOCK_NB) != 0) {
    int err = errno;
    if (err == EWOULDBLOCK) {
      return absl::FailedPreconditionError(
          absl::StrCat("lock ", path, ": held by another store handle or process"));
    }
    return IoError(err, absl::StrCat("lock ", path));
  }
  CKPT_ASSIGN_OR_RETURN(ScopedFd dir, LockDirectoryOf(path));
  return std::unique_ptr<FileLock>(new PosixFileLock(std::move(fd), std::move(dir)));
}

absl::StatusOr<std::string> PosixRealPath(const std::string& path) {
  char* resolved = ::realpath(path.c_str(), nullptr);
  if (resolved == nullptr) return IoError(errno, absl::StrCat("resolve ", path));
  std::string out(resolved);
  ::free(resolved);
  return out;
}

absl::StatusOr<OpenedFile> OpenRegularFileForRead(const std::string& path, bool follow_symlinks,
                                                  int extra_flags) {
  // Checked before the open so that a FIFO or device is not opened at all...
  struct stat st;
  int rc = follow_symlinks ? ::stat(path.c_str(), &st) : ::lstat(path.c_str(), &st);
  if (rc != 0) return IoError(errno, absl::StrCat("open ", path));
  if (S_ISLNK(st.st_mode)) return SymlinkRefused(path, "file");
  if (!S_ISREG(st.st_mode)) return NotRegular(path, st.st_mode);
  // ...and again on the descriptor, since the name may have changed in between; O_NONBLOCK
  // keeps that open from waiting on a FIFO swapped in, and is ignored by regular files.
  int flags = O_RDONLY | O_CLOEXEC | O_NONBLOCK | extra_flags;
  if (!follow_symlinks) flags |= O_NOFOLLOW;
  OpenedFile out;
  out.fd = ScopedFd(::open(path.c_str(), flags));
  if (!out.fd.valid()) {
    if (errno == ELOOP && !follow_symlinks) return SymlinkRefused(path, "file");
    return IoError(errno, absl::StrCat("open ", path));
  }
  if (::fstat(out.fd.get(), &st) != 0) return IoError(errno, absl::StrCat("stat ", path));
  if (!S_ISREG(st.st_mode)) return NotRegular(path, st.st_mode);
  out.size = static_cast<uint64_t>(st.st_size);
  out.dev = st.st_dev;
  out.ino = st.st_ino;
  return out;
}

absl::StatusOr<ScopedFd> CreateNewFile(const std::string& path, int extra_flags) {
  // O_EXCL also refuses a symbolic link at `path`, dangling or not, without following it.
  ScopedFd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | extra_flags, 0644));
  if (!fd.valid()) {
    const int err = errno;
    if (err == EEXIST) {
      return absl::AlreadyExistsError(
          absl::StrCat("create ", path,
                       ": the name is taken (a stale file or a planted link); not "
                       "overwriting it"));
    }
    return IoError(err, absl::StrCat("create ", path));
  }
  return fd;
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

std::optional<uint64_t> PosixAvailableMemoryBytes() {
  ScopedFd fd(::open("/proc/meminfo", O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return std::nullopt;
  char text[8192];
  size_t size = 0;
  while (size < sizeof(text) - 1) {
    const ssize_t n = ::read(fd.get(), text + size, sizeof(text) - 1 - size);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    size += static_cast<size_t>(n);
  }
  text[size] = '\0';
  const char* line = std::strstr(text, "MemAvailable:");
  if (line == nullptr) return std::nullopt;  // Kernels before 3.14.
  char* end = nullptr;
  const unsigned long long kib = std::strtoull(line + std::strlen("MemAvailable:"), &end, 10);
  if (end == line + std::strlen("MemAvailable:")) return std::nullopt;
  return static_cast<uint64_t>(kib) * 1024;
}

}  // namespace ckpt::internal
