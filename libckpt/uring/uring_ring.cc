#include "libckpt/uring/uring_ring.h"

#include <cerrno>

#include "absl/strings/str_cat.h"
#include "libckpt/io_error.h"

namespace ckpt::internal {

absl::StatusOr<UringRing> UringRing::Create(unsigned depth) {
  auto ring = std::make_unique<io_uring>();
  int ret = io_uring_queue_init(depth, ring.get(), 0);
  if (ret < 0) {
    int err = -ret;
    if (err == ENOSYS || err == EPERM || err == EINVAL || err == EACCES) {
      return absl::UnimplementedError(
          absl::StrCat("io_uring unavailable: io_uring_queue_init(", depth, "): ", strerror(err)));
    }
    return IoError(err, absl::StrCat("io_uring_queue_init(", depth, ")"));
  }
  UringRing out;
  out.ring_ = std::move(ring);
  out.depth_ = depth;
  return out;
}

UringRing::~UringRing() {
  if (ring_) io_uring_queue_exit(ring_.get());
}

UringRing& UringRing::operator=(UringRing&& o) noexcept {
  if (this != &o) {
    if (ring_) io_uring_queue_exit(ring_.get());
    ring_ = std::move(o.ring_);
    depth_ = o.depth_;
  }
  return *this;
}


absl::StatusOr<io_uring_cqe*> WaitCqe(io_uring* ring, const std::string& path) {
  io_uring_cqe* cqe = nullptr;
  for (;;) {
    int ret = io_uring_wait_cqe(ring, &cqe);
    if (ret == 0) return cqe;
    if (ret != -EINTR && ret != -EAGAIN) return IoError(-ret, absl::StrCat("wait on ", path));
  }
}

absl::Status SubmitAll(io_uring* ring, const std::string& path) {
  for (;;) {
    int ret = io_uring_submit(ring);
    if (ret >= 0) return absl::OkStatus();
    if (ret != -EINTR && ret != -EAGAIN) return IoError(-ret, absl::StrCat("submit for ", path));
  }
}

}  // namespace ckpt::internal
