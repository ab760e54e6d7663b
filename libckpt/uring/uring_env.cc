// UringEnv: file data moves through io_uring; metadata calls are the POSIX ones.
//
// Writes: libckpt/uring/uring_writable_file.cc (each WritableFile owns a ring and a few
// aligned write buffers).
//
// Reads: a read is cut into slices submitted together (bounded by the ring's depth) on a
// ring borrowed from the Env's pool. Aligned reads use the O_DIRECT descriptor, others the
// buffered one.
//
// Completions arrive in any order. -EAGAIN and -EINTR resubmit; short transfers advance and
// resubmit the rest; the first error is kept and every request in flight is reaped before the
// call returns.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <vector>

#include "absl/strings/str_cat.h"
#include "ckpt/base/status_macros.h"
#include "ckpt/env.h"
#include "libckpt/aligned_buffer.h"
#include "libckpt/io_error.h"
#include "libckpt/posix/posix_file_ops.h"
#include "libckpt/posix/scoped_fd.h"
#include "libckpt/uring/uring_ring.h"
#include "libckpt/uring/uring_writable_file.h"

namespace ckpt {
namespace {

using internal::AlignedBuffer;
using internal::IoError;
using internal::kDirectIoAlignment;
using internal::ScopedFd;
using internal::SubmitAll;
using internal::UringRing;
using internal::WaitCqe;

constexpr size_t kDirectWriteBufferBytes = 4 << 20;
constexpr size_t kBufferedWriteBufferBytes = 256 << 10;
constexpr unsigned kReadDepth = 8;
constexpr size_t kReadSliceBytes = 4 << 20;

bool IsAligned(uint64_t v) { return v % kDirectIoAlignment == 0; }

// Rings for reads, shared by every RandomAccessFile of one UringEnv. Safe for concurrent use.
class RingPool {
 public:
  absl::StatusOr<UringRing> Acquire() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!free_.empty()) {
        UringRing ring = std::move(free_.back());
        free_.pop_back();
        return ring;
      }
    }
    return UringRing::Create(kReadDepth);
  }
  void Release(UringRing ring) {
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(std::move(ring));
  }

 private:
  std::mutex mu_;
  std::vector<UringRing> free_;
};

class UringRandomAccessFile : public RandomAccessFile {
 public:
  UringRandomAccessFile(std::string path, ScopedFd direct_fd, ScopedFd buffered_fd, uint64_t size,
                        std::shared_ptr<RingPool> pool)
      : path_(std::move(path)),
        direct_fd_(std::move(direct_fd)),
        buffered_fd_(std::move(buffered_fd)),
        size_(size),
        pool_(std::move(pool)) {}

  absl::Status Read(uint64_t offset, std::span<std::byte> out) const override {
    if (out.empty()) return absl::OkStatus();
    if (offset > size_ || out.size() > size_ - offset) {
      return absl::DataLossError(absl::StrCat("read ", path_, ": file of ", size_,
                                              " bytes ends before offset ", offset + out.size()));
    }
    bool aligned = direct_fd_.valid() && IsAligned(offset) && IsAligned(out.size()) &&
                   IsAligned(reinterpret_cast<uintptr_t>(out.data()));
    int fd = aligned ? direct_fd_.get() : buffered_fd_.get();
    CKPT_ASSIGN_OR_RETURN(UringRing ring, pool_->Acquire());
    absl::Status status = ReadSlices(ring.get(), fd, offset, out);
    pool_->Release(std::move(ring));
    return status;
  }
  uint64_t size() const override { return size_; }

 private:
  struct Slice {
    uint64_t offset;
    std::byte* data;
    size_t len;
    size_t done;
  };

  absl::Status ReadSlices(io_uring* ring, int fd, uint64_t offset, std::span<std::byte> out) const {
    std::vector<Slice> slices;
    for (size_t pos = 0; pos < out.size(); pos += kReadSliceBytes) {
      slices.push_back(
          {offset + pos, out.data() + pos, std::min(kReadSliceBytes, out.size() - pos), 0});
    }
    absl::Status status;
    size_t next = 0;
    unsigned in_flight = 0;
    auto prep = [&](size_t i) {
      io_uring_sqe* sqe = io_uring_get_sqe(ring);
      // At most kReadDepth requests are outstanding on a ring of that depth.
      if (sqe == nullptr) {
        status.Update(absl::InternalError("io_uring queue full reading " + path_));
        return;
      }
      Slice& s = slices[i];
      io_uring_prep_read(sqe, fd, s.data + s.done, static_cast<unsigned>(s.len - s.done),
                         s.offset + s.done);
      io_uring_sqe_set_data64(sqe, i);
      ++in_flight;
    };
    while (status.ok() && (next < slices.size() || in_flight > 0)) {
      while (status.ok() && next < slices.size() && in_flight < kReadDepth) prep(next++);
      if (absl::Status s = SubmitAll(ring, path_); !s.ok()) {
        status.Update(s);
        break;
      }
      absl::StatusOr<io_uring_cqe*> cqe = WaitCqe(ring, path_);
      if (!cqe.ok()) {
        status.Update(cqe.status());
        break;
      }
      int res = (*cqe)->res;
      size_t i = static_cast<size_t>(io_uring_cqe_get_data64(*cqe));
      io_uring_cqe_seen(ring, *cqe);
      --in_flight;
      Slice& s = slices[i];
      if (res == -EAGAIN || res == -EINTR) {
        prep(i);
      } else if (res < 0) {
        status.Update(
            IoError(-res, absl::StrCat("read ", path_, " at offset ", s.offset + s.done)));
      } else if (res == 0) {
        status.Update(absl::DataLossError(
            absl::StrCat("read ", path_, ": file ends before offset ", s.offset + s.len)));
      } else {
        s.done += static_cast<size_t>(res);
        if (s.done < s.len) prep(i);
      }
    }
    // Requests in flight own their slices of `out` until reaped.
    while (in_flight > 0) {
      absl::StatusOr<io_uring_cqe*> cqe = WaitCqe(ring, path_);
      if (!cqe.ok()) break;
      io_uring_cqe_seen(ring, *cqe);
      --in_flight;
    }
    return status;
  }

  const std::string path_;
  ScopedFd direct_fd_;
  ScopedFd buffered_fd_;
  const uint64_t size_;
  std::shared_ptr<RingPool> pool_;
};

// Creates `path` (exclusively), then turns on O_DIRECT when asked and the file system allows
// it. Setting it with F_SETFL after the create, rather than at open, keeps a refusal (tmpfs and
// some network file systems answer EINVAL) from leaving a created file that the exclusive
// create of a retry would then find; buffered IO is still correct.
absl::StatusOr<ScopedFd> CreateMaybeDirect(const std::string& path, bool direct, bool* got_direct) {
  *got_direct = false;
  CKPT_ASSIGN_OR_RETURN(ScopedFd fd, internal::CreateNewFile(path, 0));
  if (direct) {
    const int flags = ::fcntl(fd.get(), F_GETFL);
    *got_direct = flags >= 0 && ::fcntl(fd.get(), F_SETFL, flags | O_DIRECT) == 0;
  }
  return fd;
}

class UringEnv : public internal::PosixMetadataEnv {
 public:
  absl::StatusOr<std::unique_ptr<WritableFile>> NewWritableFile(
      const std::string& path, const FileOptions& options) override {
    bool direct = false;
    CKPT_ASSIGN_OR_RETURN(ScopedFd fd, CreateMaybeDirect(path, options.direct_io, &direct));
    const size_t buffer_bytes = direct ? kDirectWriteBufferBytes : kBufferedWriteBufferBytes;
    return internal::NewUringWritableFile(path, std::move(fd), direct, buffer_bytes);
  }

  absl::StatusOr<std::unique_ptr<RandomAccessFile>> NewRandomAccessFile(
      const std::string& path, const FileOptions& options) override {
    CKPT_ASSIGN_OR_RETURN(internal::OpenedFile buffered,
                          internal::OpenRegularFileForRead(path, options.follow_symlinks, 0));
    ScopedFd direct;
    if (options.direct_io) {
      // The direct descriptor must be the very file the buffered one checked; when the name
      // moved in between, or O_DIRECT is refused, reads stay buffered.
      absl::StatusOr<internal::OpenedFile> d =
          internal::OpenRegularFileForRead(path, options.follow_symlinks, O_DIRECT);
      if (d.ok() && d->dev == buffered.dev && d->ino == buffered.ino) direct = std::move(d->fd);
    }
    return std::unique_ptr<RandomAccessFile>(new UringRandomAccessFile(
        path, std::move(direct), std::move(buffered.fd), buffered.size, pool_));
  }

 private:
  std::shared_ptr<RingPool> pool_ = std::make_shared<RingPool>();
};

}  // namespace

absl::StatusOr<std::unique_ptr<Env>> NewUringEnv() {
  // Probe: a kernel that refuses a ring refuses it for every file, so say so once here.
  CKPT_ASSIGN_OR_RETURN(UringRing probe, UringRing::Create(kReadDepth));
  (void)probe;
  return std::unique_ptr<Env>(new UringEnv());
}

}  // namespace ckpt
