// AlignedBuffer owns a block of memory aligned for O_DIRECT (STYLE.md §5).
#ifndef CKPT_LIBCKPT_ALIGNED_BUFFER_H_
#define CKPT_LIBCKPT_ALIGNED_BUFFER_H_

#include <cstddef>
#include <cstdlib>
#include <span>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace ckpt::internal {

inline constexpr size_t kDirectIoAlignment = 4096;

// Move-only owner of `size` bytes aligned to kDirectIoAlignment, zero-filled at creation unless
// the caller will overwrite it anyway (a read bounce buffer). Not thread-safe.
class AlignedBuffer {
 public:
  enum class Fill { kZero, kUninitialized };
  AlignedBuffer() = default;
  // kResourceExhausted when the allocation fails.
  static absl::StatusOr<AlignedBuffer> Create(size_t size, Fill fill = Fill::kZero) {
    size_t rounded = (size + kDirectIoAlignment - 1) / kDirectIoAlignment * kDirectIoAlignment;
    if (rounded == 0) rounded = kDirectIoAlignment;
    void* p = std::aligned_alloc(kDirectIoAlignment, rounded);
    if (p == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat("allocate ", rounded, " aligned bytes"));
    }
    if (fill == Fill::kZero) __builtin_memset(p, 0, rounded);
    return AlignedBuffer(static_cast<std::byte*>(p), size);
  }
  ~AlignedBuffer() { std::free(data_); }
  // Copying would free the block twice.
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  AlignedBuffer(AlignedBuffer&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  AlignedBuffer& operator=(AlignedBuffer&& o) noexcept {
    if (this != &o) {
      std::free(data_);
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }

  bool valid() const { return data_ != nullptr; }
  std::byte* data() const { return data_; }
  size_t size() const { return size_; }
  std::span<std::byte> span() const { return {data_, size_}; }

 private:
  AlignedBuffer(std::byte* data, size_t size) : data_(data), size_(size) {}
  std::byte* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace ckpt::internal

#endif  // CKPT_LIBCKPT_ALIGNED_BUFFER_H_
