#include "optimizer/host_buffer.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "optimizer/thread_pool.h"

namespace ckpt::optimizer::internal {

constexpr size_t kPage = 4096;
constexpr size_t kHugePage = size_t{2} << 20;

void ZeroInParallel(void* base, size_t bytes) {
  constexpr size_t kChunk = size_t{64} << 20;
  const size_t chunks = (bytes + kChunk - 1) / kChunk;
  std::byte* const p = static_cast<std::byte*>(base);
  if (chunks <= 1) {
    std::memset(p, 0, bytes);
    return;
  }
  ThreadPool pool(static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  pool.ParallelFor(chunks, [&](size_t c) {
    std::memset(p + c * kChunk, 0, std::min(kChunk, bytes - c * kChunk));
  });
}

absl::StatusOr<HostBuffer> HostBuffer::Create(size_t bytes, size_t stagger, bool pinned) {
  const size_t total = (bytes + stagger + kPage - 1) / kPage * kPage + kPage;
  // 2 MiB alignment and MADV_HUGEPAGE: an update streams nine arrays at once, and with 4 KiB
  // pages the TLB misses on every page of every stream. Advice only; failure is harmless.
  const size_t huge_total = (total + kHugePage - 1) / kHugePage * kHugePage;
  HostBuffer b;
  b.base_ = std::aligned_alloc(kHugePage, huge_total);
  if (b.base_ == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("allocate ", huge_total, " bytes of host memory for a slab"));
  }
  ::madvise(b.base_, huge_total, MADV_HUGEPAGE);
  // Every page is first touched here, by every core at once: one thread zero-filling a slab
  // of tens of GB (or the driver pinning one it must fault in itself) ran at about 1 GB/s.
  ZeroInParallel(b.base_, huge_total);
  if (pinned) {
    // The pages exist: registering them only pins them, so the GPU can DMA them.
    const absl::Status registered = RegisterPinned(b.base_, huge_total);
    if (!registered.ok()) {
      std::free(b.base_);
      b.base_ = nullptr;
      return registered;
    }
  }
  b.pinned_ = pinned;
  b.data_ = static_cast<std::byte*>(b.base_) + stagger;
  b.size_ = bytes;
  return b;
}

absl::StatusOr<HostBuffer> HostBuffer::CreateSmallPages(size_t bytes) {
  const size_t total = (bytes + kPage - 1) / kPage * kPage + kPage;
  HostBuffer b;
  b.base_ = std::aligned_alloc(kPage, total);
  if (b.base_ == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat("allocate ", total, " bytes of host memory"));
  }
  std::memset(b.base_, 0, total);
  b.data_ = static_cast<std::byte*>(b.base_);
  b.size_ = bytes;
  return b;
}

void HostBuffer::Reset() {
  if (base_ == nullptr) return;
  if (pinned_) UnregisterPinned(base_);
  std::free(base_);
  base_ = nullptr;
  data_ = nullptr;
  size_ = 0;
}

HostBuffer::~HostBuffer() { Reset(); }

HostBuffer& HostBuffer::operator=(HostBuffer&& o) noexcept {
  if (this != &o) {
    Reset();
    base_ = std::exchange(o.base_, nullptr);
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
    pinned_ = o.pinned_;
  }
  return *this;
}

}  // namespace ckpt::optimizer::internal
