// Explicit little-endian encoding of fixed-width integers (STYLE.md §4): never memcpy a struct.
#ifndef CKPT_BASE_CODING_H_
#define CKPT_BASE_CODING_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include "absl/strings/string_view.h"

namespace ckpt {

inline void EncodeFixed32(std::byte* dst, uint32_t v) {
  for (int i = 0; i < 4; ++i) dst[i] = static_cast<std::byte>((v >> (8 * i)) & 0xff);
}
inline void EncodeFixed64(std::byte* dst, uint64_t v) {
  for (int i = 0; i < 8; ++i) dst[i] = static_cast<std::byte>((v >> (8 * i)) & 0xff);
}
inline uint32_t DecodeFixed32(const std::byte* src) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(src[i]) << (8 * i);
  return v;
}
inline uint64_t DecodeFixed64(const std::byte* src) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(src[i]) << (8 * i);
  return v;
}
inline void PutFixed32(std::string* dst, uint32_t v) {
  std::byte buf[4];
  EncodeFixed32(buf, v);
  dst->append(reinterpret_cast<const char*>(buf), 4);
}
inline void PutFixed64(std::string* dst, uint64_t v) {
  std::byte buf[8];
  EncodeFixed64(buf, v);
  dst->append(reinterpret_cast<const char*>(buf), 8);
}

inline std::span<const std::byte> AsBytes(absl::string_view s) {
  return {reinterpret_cast<const std::byte*>(s.data()), s.size()};
}
inline absl::string_view AsStringView(std::span<const std::byte> b) {
  return {reinterpret_cast<const char*>(b.data()), b.size()};
}

// Rounds `n` up to a multiple of `align` (a power of two). REQUIRES: no overflow.
constexpr uint64_t RoundUp(uint64_t n, uint64_t align) { return (n + align - 1) & ~(align - 1); }

}  // namespace ckpt

#endif  // CKPT_BASE_CODING_H_
