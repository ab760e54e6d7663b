#include "optimizer/host_buffer.h"

#include <sys/mman.h>

#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace ckpt::optimizer::internal {

constexpr size_t kPage = 4096;
constexpr size_t kHugePage = size_t{2} << 20;

absl::StatusOr<HostBuffer> HostBuffer::Create(size_t bytes, size_t stagger, bool pinned) {
  const size_t total = (bytes + stagger + kPage - 1) / kPage * kPage + kPage;
  HostBuffer b;
  if (pinned) {
    absl::StatusOr<void*> p = AllocatePinned(total);
    if (!p.ok()) return p.status();
    b.base_ = *p;
  } else {
    // 2 MiB alignment and MADV_HUGEPAGE: an update streams nine arrays at once, and with 4 KiB
    // pages the TLB misses on every page of every stream. Advice only; failure is harmless.
    const size_t huge_total = (total + kHugePage - 1) / kHugePage * kHugePage;
    b.base_ = std::aligned_alloc(kHugePage, huge_total);
    if (b.base_ == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrCat("allocate ", huge_total, " bytes of host memory for a slab"));
    }
    ::madvise(b.base_, huge_total, MADV_HUGEPAGE);
  }
  b.pinned_ = pinned;
  std::memset(b.base_, 0, total);
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
  if (pinned_) {
    FreePinned(base_);
  } else {
    std::free(base_);
  }
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
