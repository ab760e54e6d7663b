// PosixEnv: buffered pread/pwrite/fdatasync. Always available; the fallback when io_uring is
// not. It ignores FileOptions::direct_io.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "ckpt/base/status_macros.h"
#include "ckpt/env.h"
#include "libckpt/io_error.h"
#include "libckpt/posix/posix_file_ops.h"
#include "libckpt/posix/scoped_fd.h"

namespace ckpt {
namespace {

using internal::IoError;
using internal::ScopedFd;

class PosixWritableFile : public WritableFile {
 public:
  PosixWritableFile(std::string path, ScopedFd fd) : path_(std::move(path)), fd_(std::move(fd)) {}

  absl::Status Append(std::span<const std::byte> data) override {
    if (!fd_.valid()) return Closed();
    std::lock_guard<std::mutex> lock(mu_);  // Uncontended: Append has one writer.
    if (positional_) {
      return absl::FailedPreconditionError(path_ + ": Append on a file written by WriteAt");
    }
    appended_ = true;
    absl::Status s = internal::PosixWriteAt(fd_.get(), data.data(), data.size(), size_, path_);
    if (s.ok()) size_ += data.size();
    return s;
  }
  absl::Status WriteAt(uint64_t offset, std::span<const std::byte> data) override {
    if (!fd_.valid()) return Closed();
    {
      std::lock_guard<std::mutex> lock(mu_);
      CKPT_RETURN_IF_ERROR(
          internal::CheckWriteAt(path_, offset, data.data(), data.size(), appended_));
      positional_ = true;
    }
    CKPT_RETURN_IF_ERROR(
        internal::PosixWriteAt(fd_.get(), data.data(), data.size(), offset, path_));
    std::lock_guard<std::mutex> lock(mu_);
    size_ = std::max(size_, offset + data.size());
    return absl::OkStatus();
  }
  absl::Status Sync() override {
    if (!fd_.valid()) return Closed();
    if (::fdatasync(fd_.get()) != 0) return IoError(errno, absl::StrCat("sync ", path_));
    return absl::OkStatus();
  }
  absl::Status Close() override {
    if (!fd_.valid()) return Closed();
    if (int err = fd_.Close(); err != 0) return IoError(err, absl::StrCat("close ", path_));
    return absl::OkStatus();
  }
  uint64_t size() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return size_;
  }

 private:
  absl::Status Closed() const {
    return absl::FailedPreconditionError(absl::StrCat(path_, ": file already closed"));
  }
  std::string path_;
  ScopedFd fd_;
  mutable std::mutex mu_;    // Guards size_ and the two flags under concurrent WriteAt calls.
  uint64_t size_ = 0;
  bool appended_ = false;    // Written by Append: WriteAt refuses.
  bool positional_ = false;  // Written by WriteAt: Append refuses.
};

class PosixRandomAccessFile : public RandomAccessFile {
 public:
  PosixRandomAccessFile(std::string path, ScopedFd fd, uint64_t size)
      : path_(std::move(path)), fd_(std::move(fd)), size_(size) {}
  absl::Status Read(uint64_t offset, std::span<std::byte> out) const override {
    return internal::PosixReadAt(fd_.get(), out.data(), out.size(), offset, path_);
  }
  uint64_t size() const override { return size_; }

 private:
  std::string path_;
  ScopedFd fd_;
  uint64_t size_;
};

class PosixEnv : public internal::PosixMetadataEnv {
 public:
  absl::StatusOr<std::unique_ptr<WritableFile>> NewWritableFile(
      const std::string& path, const FileOptions& /*options*/) override {
    CKPT_ASSIGN_OR_RETURN(ScopedFd fd, internal::CreateNewFile(path, 0));
    return std::unique_ptr<WritableFile>(new PosixWritableFile(path, std::move(fd)));
  }
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> NewRandomAccessFile(
      const std::string& path, const FileOptions& options) override {
    CKPT_ASSIGN_OR_RETURN(internal::OpenedFile f,
                          internal::OpenRegularFileForRead(path, options.follow_symlinks, 0));
    return std::unique_ptr<RandomAccessFile>(
        new PosixRandomAccessFile(path, std::move(f.fd), f.size));
  }
};

}  // namespace

std::unique_ptr<Env> NewPosixEnv() { return std::make_unique<PosixEnv>(); }

}  // namespace ckpt
