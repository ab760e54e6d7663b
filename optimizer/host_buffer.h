// HostBuffer owns the host memory of one slab (STYLE.md §5).
#ifndef CKPT_OPTIMIZER_HOST_BUFFER_H_
#define CKPT_OPTIMIZER_HOST_BUFFER_H_

#include <cstddef>
#include <utility>

#include "absl/status/statusor.h"

namespace ckpt::optimizer::internal {

// Move-only. Memory is page-aligned plus `stagger` bytes, so that slabs of equal size do not
// start at the same offset within a page (equal alignment makes the three streams of one
// update alias in the L1 cache and costs up to 2.4x on an EPYC). Zero-filled, by every core at
// once (ZeroInParallel). With `pinned`, the pages are then registered with CUDA (CUDA builds)
// so the GPU can DMA them.
// The stagger between the slabs (master 0, exp_avg 1x, exp_avg_sq 2x).
inline constexpr size_t kSlabStagger = 1024 + 64;

class HostBuffer {
 public:
  HostBuffer() = default;
  // kResourceExhausted when memory runs out; kUnimplemented for pinned memory without CUDA.
  static absl::StatusOr<HostBuffer> Create(size_t bytes, size_t stagger, bool pinned);
  // Page-aligned, without huge-page advice: what a plain allocator gives (benchmarks compare).
  static absl::StatusOr<HostBuffer> CreateSmallPages(size_t bytes);
  ~HostBuffer();
  HostBuffer(const HostBuffer&) = delete;  // Would free twice.
  HostBuffer& operator=(const HostBuffer&) = delete;
  HostBuffer(HostBuffer&& o) noexcept { *this = std::move(o); }
  HostBuffer& operator=(HostBuffer&& o) noexcept;

  bool valid() const { return base_ != nullptr; }
  std::byte* data() const { return data_; }
  size_t size() const { return size_; }
  bool pinned() const { return pinned_; }

 private:
  void Reset();
  void* base_ = nullptr;
  std::byte* data_ = nullptr;
  size_t size_ = 0;
  bool pinned_ = false;
};

// Zero-fills [base, base + bytes) on up to every core, in chunks: the first touch of each page
// (the kernel allocating it) then runs in parallel.
void ZeroInParallel(void* base, size_t bytes);

// Pins host memory already allocated (and touched) for DMA, and unpins it (CUDA builds only:
// optimizer/cuda/cuda_engine_factory.cc; otherwise RegisterPinned returns kUnimplemented).
// kResourceExhausted when the driver cannot pin that much.
absl::Status RegisterPinned(void* base, size_t bytes);
void UnregisterPinned(void* base);

}  // namespace ckpt::optimizer::internal

#endif  // CKPT_OPTIMIZER_HOST_BUFFER_H_
