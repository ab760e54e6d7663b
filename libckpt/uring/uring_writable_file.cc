// UringWritableFile: a WritableFile whose data moves through io_uring (UringEnv's files).
//
// Each file owns a ring and a few aligned buffers registered with it. Append copies into the
// current buffer; a full buffer is submitted and the next one is filled while it is in flight,
// so up to kWriteSlots writes overlap the caller's work. Sync and Close flush the partial
// buffer (padded to 4 KiB under O_DIRECT, then ftruncate to the logical size), wait for every
// write to complete, and only then submit the fsync, since a sync covers only completed
// writes. The partial buffer stays in place and is rewritten whole by the next flush, so the
// O_DIRECT offset of every submission stays aligned. WriteAt (whole aligned blocks, from
// several threads: the store's writer threads) is a pwrite on the same descriptor from the
// caller's thread; a file takes one kind of write or the other. Completions arrive in any
// order; -EAGAIN and -EINTR resubmit; short transfers advance and resubmit the rest; the first
// error is kept and every request in flight is reaped before the call returns.
#include "libckpt/uring/uring_writable_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "ckpt/base/status_macros.h"
#include "libckpt/aligned_buffer.h"
#include "libckpt/io_error.h"
#include "libckpt/posix/posix_file_ops.h"

namespace ckpt::internal {
namespace {

constexpr unsigned kWriteSlots = 4;
constexpr uint64_t kFsyncTag = ~uint64_t{0};

class UringWritableFile : public WritableFile {
 public:
  struct Slot {
    AlignedBuffer buf;
    uint64_t file_offset = 0;
    size_t len = 0;
    size_t done = 0;
    bool in_flight = false;
  };

  // The write buffers are made by the first Append and freed by Close, so that a file opened
  // long before it is written (a rank waiting its turn) or kept open after it is closed holds
  // no memory.
  UringWritableFile(std::string path, ScopedFd fd, bool direct, size_t buffer_bytes,
                    UringRing ring)
      : path_(std::move(path)),
        fd_(std::move(fd)),
        direct_(direct),
        buffer_bytes_(buffer_bytes),
        ring_(std::move(ring)) {}

  ~UringWritableFile() override {
    // Buffers in flight belong to the kernel until reaped: drain before any member goes.
    DrainAll().IgnoreError();  // Destructors never report; Close() is the reporting path.
  }

  absl::Status Append(std::span<const std::byte> data) override {
    CKPT_RETURN_IF_ERROR(CheckUsable());
    if (positional_.load()) {
      return absl::FailedPreconditionError(path_ + ": Append on a file written by WriteAt");
    }
    if (data.empty()) return absl::OkStatus();
    appended_ = true;
    CKPT_RETURN_IF_ERROR(MakeBuffers());
    while (!data.empty()) {
      Slot& slot = slots_[current_];
      size_t n = std::min(data.size(), buffer_bytes_ - fill_);
      std::memcpy(slot.buf.data() + fill_, data.data(), n);
      fill_ += n;
      size_ += n;
      data = data.subspan(n);
      if (fill_ == buffer_bytes_) {
        CKPT_RETURN_IF_ERROR(Submit(current_, buffer_bytes_));
        current_ = (current_ + 1) % slots_.size();
        buffer_offset_ += buffer_bytes_;
        fill_ = 0;
        CKPT_RETURN_IF_ERROR(WaitSlotFree(current_));
      }
    }
    return first_error_;
  }

  // A plain pwrite on the file's descriptor (O_DIRECT when it has it: the blocks are aligned),
  // from the caller's thread: the callers are the threads that keep writes in flight.
  absl::Status WriteAt(uint64_t offset, std::span<const std::byte> data) override {
    if (closed_) return absl::FailedPreconditionError(path_ + ": file already closed");
    CKPT_RETURN_IF_ERROR(
        internal::CheckWriteAt(path_, offset, data.data(), data.size(), appended_));
    positional_.store(true);
    CKPT_RETURN_IF_ERROR(
        internal::PosixWriteAt(fd_.get(), data.data(), data.size(), offset, path_));
    uint64_t end = offset + data.size();
    uint64_t seen = positional_size_.load();
    while (seen < end && !positional_size_.compare_exchange_weak(seen, end)) {
    }
    return absl::OkStatus();
  }

  absl::Status Sync() override {
    CKPT_RETURN_IF_ERROR(CheckUsable());
    CKPT_RETURN_IF_ERROR(Flush());
    io_uring_sqe* sqe = io_uring_get_sqe(ring_.get());
    if (sqe == nullptr) return absl::InternalError(absl::StrCat("no sqe for fsync of ", path_));
    io_uring_prep_fsync(sqe, fd_.get(), IORING_FSYNC_DATASYNC);
    io_uring_sqe_set_data64(sqe, kFsyncTag);
    CKPT_RETURN_IF_ERROR(SubmitAll(ring_.get(), path_));
    for (;;) {
      CKPT_ASSIGN_OR_RETURN(io_uring_cqe * cqe, WaitCqe(ring_.get(), path_));
      int res = cqe->res;
      io_uring_cqe_seen(ring_.get(), cqe);
      if (res == -EINTR || res == -EAGAIN) {
        if (::fdatasync(fd_.get()) != 0) return Fail(IoError(errno, "sync " + path_));
        return absl::OkStatus();
      }
      if (res < 0) return Fail(IoError(-res, absl::StrCat("sync ", path_)));
      return absl::OkStatus();
    }
  }

  absl::Status Close() override {
    if (closed_) return absl::FailedPreconditionError(path_ + ": file already closed");
    absl::Status status = first_error_.ok() ? Flush() : first_error_;
    status.Update(DrainAll());
    closed_ = true;
    if (!AnyInFlight()) {  // The kernel is done with the buffers: free them, ring first.
      UringRing dropped = std::move(ring_);
      slots_.clear();
    }
    if (int err = fd_.Close(); err != 0) status.Update(IoError(err, "close " + path_));
    return status;
  }

  uint64_t size() const override { return positional_.load() ? positional_size_.load() : size_; }

 private:
  absl::Status CheckUsable() const {
    if (closed_) return absl::FailedPreconditionError(path_ + ": file already closed");
    return first_error_;
  }
  absl::Status Fail(absl::Status s) {
    first_error_.Update(s);
    return first_error_;
  }

  bool AnyInFlight() const {
    for (const Slot& slot : slots_) {
      if (slot.in_flight) return true;
    }
    return false;
  }

  absl::Status MakeBuffers() {
    if (!slots_.empty()) return absl::OkStatus();
    std::vector<Slot> slots(kWriteSlots);
    std::vector<iovec> iovecs;
    for (Slot& slot : slots) {
      CKPT_ASSIGN_OR_RETURN(
          slot.buf, AlignedBuffer::Create(
                        buffer_bytes_, AlignedBuffer::Fill::kZero,
                        direct_ ? AlignedBuffer::Pages::kHuge : AlignedBuffer::Pages::kSmall));
      iovecs.push_back({slot.buf.data(), buffer_bytes_});
    }
    slots_ = std::move(slots);
    // Registration pins the buffers once instead of on every write; when the memlock limit
    // refuses it, unregistered writes are just as correct.
    registered_ = io_uring_register_buffers(ring_.get(), iovecs.data(),
                                            static_cast<unsigned>(iovecs.size())) == 0;
    return absl::OkStatus();
  }

  absl::Status Submit(size_t index, size_t len) {
    Slot& slot = slots_[index];
    slot.file_offset = buffer_offset_;
    slot.len = len;
    slot.done = 0;
    slot.in_flight = true;
    return Prep(index);
  }

  absl::Status Prep(size_t index) {
    Slot& slot = slots_[index];
    io_uring_sqe* sqe = io_uring_get_sqe(ring_.get());
    if (sqe == nullptr) return Fail(absl::InternalError("io_uring queue full for " + path_));
    const std::byte* p = slot.buf.data() + slot.done;
    unsigned n = static_cast<unsigned>(slot.len - slot.done);
    uint64_t off = slot.file_offset + slot.done;
    if (registered_) {
      io_uring_prep_write_fixed(sqe, fd_.get(), p, n, off, static_cast<int>(index));
    } else {
      io_uring_prep_write(sqe, fd_.get(), p, n, off);
    }
    io_uring_sqe_set_data64(sqe, index);
    return SubmitAll(ring_.get(), path_);
  }

  // Reaps one write completion and resubmits what it left undone.
  absl::Status ReapOne() {
    CKPT_ASSIGN_OR_RETURN(io_uring_cqe * cqe, WaitCqe(ring_.get(), path_));
    int res = cqe->res;
    uint64_t index = io_uring_cqe_get_data64(cqe);
    io_uring_cqe_seen(ring_.get(), cqe);
    if (index >= slots_.size()) return absl::OkStatus();  // A stale fsync completion.
    Slot& slot = slots_[index];
    if (res == -EAGAIN || res == -EINTR) return Prep(index);
    if (res <= 0) {
      slot.in_flight = false;
      int err = res == 0 ? EIO : -res;
      return Fail(
          IoError(err, absl::StrCat("write ", path_, " at offset ", slot.file_offset + slot.done)));
    }
    slot.done += static_cast<size_t>(res);
    if (slot.done < slot.len) return Prep(index);
    slot.in_flight = false;
    return absl::OkStatus();
  }

  absl::Status WaitSlotFree(size_t index) {
    while (slots_[index].in_flight) CKPT_RETURN_IF_ERROR(ReapOne());
    return absl::OkStatus();
  }

  absl::Status DrainAll() {
    absl::Status status;
    for (size_t i = 0; i < slots_.size(); ++i) {
      while (slots_[i].in_flight) {
        absl::Status s = ReapOne();
        if (!s.ok()) {
          status.Update(s);
          // The ring itself failed; nothing more will complete through it.
          if (slots_[i].in_flight && s.code() != absl::StatusCode::kResourceExhausted) break;
        }
      }
    }
    return status;
  }

  // Writes the partial buffer (padded under O_DIRECT) and waits for every write.
  absl::Status Flush() {
    if (fill_ > 0) {
      size_t len = fill_;
      if (direct_) {
        len = static_cast<size_t>(RoundUp(fill_));
        std::memset(slots_[current_].buf.data() + fill_, 0, len - fill_);
      }
      CKPT_RETURN_IF_ERROR(Submit(current_, len));
    }
    CKPT_RETURN_IF_ERROR(DrainAll());
    CKPT_RETURN_IF_ERROR(first_error_);
    if (direct_ && fill_ % kDirectIoAlignment != 0) {
      if (::ftruncate(fd_.get(), static_cast<off_t>(size_)) != 0) {
        return Fail(IoError(errno, absl::StrCat("truncate ", path_, " to ", size_)));
      }
    }
    return absl::OkStatus();
  }

  static uint64_t RoundUp(uint64_t n) {
    return (n + kDirectIoAlignment - 1) / kDirectIoAlignment * kDirectIoAlignment;
  }

  const std::string path_;
  ScopedFd fd_;
  const bool direct_;
  const size_t buffer_bytes_;
  // Teardown order: the ring (which registers the buffers) goes before the buffers it names.
  std::vector<Slot> slots_;
  UringRing ring_;
  bool registered_ = false;
  size_t current_ = 0;
  size_t fill_ = 0;
  uint64_t buffer_offset_ = 0;
  uint64_t size_ = 0;
  bool closed_ = false;
  absl::Status first_error_;
  // Append and WriteAt exclude each other. Append's state above has one writer; WriteAt's
  // callers are several threads, which only read appended_ and closed_ (set before them).
  bool appended_ = false;
  std::atomic<bool> positional_{false};
  std::atomic<uint64_t> positional_size_{0};  // The largest end WriteAt wrote.
};

}  // namespace

absl::StatusOr<std::unique_ptr<WritableFile>> NewUringWritableFile(std::string path, ScopedFd fd,
                                                                   bool direct,
                                                                   size_t buffer_bytes) {
  CKPT_ASSIGN_OR_RETURN(UringRing ring, UringRing::Create(2 * kWriteSlots));
  return std::unique_ptr<WritableFile>(new UringWritableFile(std::move(path), std::move(fd),
                                                             direct, buffer_bytes,
                                                             std::move(ring)));
}

}  // namespace ckpt::internal
