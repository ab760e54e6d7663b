// BouncePool keeps O_DIRECT bounce buffers of one size for reuse across calls and objects.
// Buffers are huge-page backed (AlignedBuffer::Pages::kHuge), which is what makes O_DIRECT
// reads fast, and allocating and faulting them in per call would cost time; a process-wide pool
// makes every reader use the same few warm blocks, and lets a benchmark's raw bound use the very
// blocks the reader uses (read speed depends on the memory read into, not only on the disk).
#ifndef CKPT_LIBCKPT_BOUNCE_POOL_H_
#define CKPT_LIBCKPT_BOUNCE_POOL_H_

#include <vector>

#include <mutex>
#include "libckpt/aligned_buffer.h"

namespace ckpt::internal {

class BouncePool {
 public:
  // `buffer_bytes`: the size of every buffer; `max_retained`: buffers kept when given back.
  BouncePool(size_t buffer_bytes, size_t max_retained)
      : buffer_bytes_(buffer_bytes), max_retained_(max_retained) {}

  // The pool of 8 MiB (+8 KiB for widening to 4 KiB boundaries) read buffers; keeps up to 16
  // (128 MiB).
  static BouncePool& ReadBuffers() {
    static BouncePool* pool = new BouncePool((size_t{8} << 20) + 2 * kDirectIoAlignment, 16);
    return *pool;
  }

  size_t buffer_bytes() const { return buffer_bytes_; }

  // A retained buffer, or a new uninitialised one: the caller reads into it before using it.
  absl::StatusOr<AlignedBuffer> Take() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!free_.empty()) {
        AlignedBuffer b = std::move(free_.back());
        free_.pop_back();
        return b;
      }
    }
    return AlignedBuffer::Create(buffer_bytes_, AlignedBuffer::Fill::kUninitialized,
                                 AlignedBuffer::Pages::kHuge);
  }

  void Give(AlignedBuffer b) {
    std::lock_guard<std::mutex> lock(mu_);
    if (b.size() == buffer_bytes_ && free_.size() < max_retained_) free_.push_back(std::move(b));
  }

 private:
  const size_t buffer_bytes_;
  const size_t max_retained_;
  std::mutex mu_;
  std::vector<AlignedBuffer> free_;
};

}  // namespace ckpt::internal

#endif  // CKPT_LIBCKPT_BOUNCE_POOL_H_
