// ScopedFd owns one file descriptor (STYLE.md §5).
#ifndef CKPT_LIBCKPT_POSIX_SCOPED_FD_H_
#define CKPT_LIBCKPT_POSIX_SCOPED_FD_H_

#include <unistd.h>

#include <utility>

namespace ckpt::internal {

// Move-only owner of a file descriptor; closes it on destruction, ignoring errors (a caller
// that cares calls Close()). Not thread-safe.
class ScopedFd {
 public:
  ScopedFd() = default;
  explicit ScopedFd(int fd) : fd_(fd) {}
  ~ScopedFd() { Reset(); }
  // Copying would close the descriptor twice.
  ScopedFd(const ScopedFd&) = delete;
  ScopedFd& operator=(const ScopedFd&) = delete;
  ScopedFd(ScopedFd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  ScopedFd& operator=(ScopedFd&& other) noexcept {
    if (this != &other) {
      Reset();
      fd_ = std::exchange(other.fd_, -1);
    }
    return *this;
  }

  bool valid() const { return fd_ >= 0; }
  int get() const { return fd_; }
  // Closes the descriptor and returns close()'s errno, or 0.
  int Close() {
    if (fd_ < 0) return 0;
    int rc = ::close(std::exchange(fd_, -1));
    return rc == 0 ? 0 : errno;
  }

 private:
  void Reset() {
    if (fd_ >= 0) ::close(std::exchange(fd_, -1));
  }
  int fd_ = -1;
};

}  // namespace ckpt::internal

#endif  // CKPT_LIBCKPT_POSIX_SCOPED_FD_H_
