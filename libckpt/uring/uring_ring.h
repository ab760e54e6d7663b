// UringRing owns one io_uring instance (STYLE.md §5, §6).
#ifndef CKPT_LIBCKPT_URING_URING_RING_H_
#define CKPT_LIBCKPT_URING_URING_RING_H_

#include <liburing.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace ckpt::internal {

// Move-only owner of an io_uring submission/completion queue pair. The owner must reap every
// submitted request before destruction (a request in flight belongs to its batch until its
// completion arrives). Not thread-safe: one thread drives a ring at a time.
class UringRing {
 public:
  UringRing() = default;
  // kUnimplemented when the kernel refuses a ring (ENOSYS, EPERM under seccomp or sysctl),
  // naming the reason; kResourceExhausted on ENOMEM.
  static absl::StatusOr<UringRing> Create(unsigned depth);
  ~UringRing();
  // Copying would tear the ring down twice.
  UringRing(const UringRing&) = delete;
  UringRing& operator=(const UringRing&) = delete;
  UringRing(UringRing&& o) noexcept : ring_(std::move(o.ring_)), depth_(o.depth_) {}
  UringRing& operator=(UringRing&& o) noexcept;

  bool valid() const { return ring_ != nullptr; }
  io_uring* get() const { return ring_.get(); }
  unsigned depth() const { return depth_; }

 private:
  std::unique_ptr<io_uring> ring_;
  unsigned depth_ = 0;
};

// Waits for one completion of `ring`, retrying when the wait itself is interrupted; errors name
// `path`.
absl::StatusOr<io_uring_cqe*> WaitCqe(io_uring* ring, const std::string& path);
// Submits every queued request of `ring`, retrying on EINTR and EAGAIN; errors name `path`.
absl::Status SubmitAll(io_uring* ring, const std::string& path);

}  // namespace ckpt::internal

#endif  // CKPT_LIBCKPT_URING_URING_RING_H_
