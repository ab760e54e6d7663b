// Bulk element conversion (convert.h). The scalar loops are written as plain loads, shifts and
// selects so that -O3 vectorises them; F16 goes through F16C where the CPU has it (vcvtph2ps
// and vcvtps2ph with round-to-nearest-even give float_convert.h's bits, NaNs included).
// Little-endian host: a BF16 is the high half of its float.
#include "ckpt/formats/convert.h"

#include <immintrin.h>

#include <algorithm>
#include <bit>
#include <cassert>
#include <cstdint>
#include <cstring>

#include "ckpt/base/cpu_features.h"
#include "ckpt/formats/float_convert.h"

namespace ckpt::formats {
namespace {

static_assert(std::endian::native == std::endian::little, "tensor data is little-endian");

uint16_t Load16(const std::byte* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return h;
}
uint32_t Load32(const std::byte* p) {
  uint32_t u;
  std::memcpy(&u, p, 4);
  return u;
}

void Bf16ToF32(const std::byte* in, std::byte* out, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const uint32_t u = static_cast<uint32_t>(Load16(in + 2 * i)) << 16;
    std::memcpy(out + 4 * i, &u, 4);
  }
}

void F16ToF32(const std::byte* in, std::byte* out, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const float f = HalfToFloat(Load16(in + 2 * i));
    std::memcpy(out + 4 * i, &f, 4);
  }
}

void F32ToBf16(const std::byte* in, std::byte* out, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const uint32_t bits = Load32(in + 4 * i);
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    const uint32_t quiet_nan = (bits >> 16) | 0x40u;
    // A select, not a branch: FloatToBf16's NaN rule, vectorisable.
    const uint16_t h =
        static_cast<uint16_t>((bits & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
    std::memcpy(out + 2 * i, &h, 2);
  }
}

void F32ToF16(const std::byte* in, std::byte* out, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const uint16_t h = FloatToHalf(BitsToFloat(Load32(in + 4 * i)));
    std::memcpy(out + 2 * i, &h, 2);
  }
}

// 16-bit to F32, eight at a time; with `stream`, streaming stores once `out` is 32-byte
// aligned (the head before that, and the tail, go the scalar way).
__attribute__((target("avx2,f16c"))) void WidenAvx2(DType from, const std::byte* in,
                                                    std::byte* out, size_t n, bool stream) {
  size_t head = 0;
  if (stream) {
    head = (32 - reinterpret_cast<uintptr_t>(out) % 32) % 32;
    head = head % 4 != 0 || head / 4 > n ? n : head / 4;  // Not float-aligned: no streaming.
  }
  const auto scalar = from == DType::kBF16 ? Bf16ToF32 : F16ToF32;
  scalar(in, out, head);
  size_t i = head;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + 2 * i));
    const __m256 f = from == DType::kBF16
                         ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
                         : _mm256_cvtph_ps(h);
    if (stream) {
      _mm256_stream_ps(reinterpret_cast<float*>(out + 4 * i), f);
    } else {
      _mm256_storeu_ps(reinterpret_cast<float*>(out + 4 * i), f);
    }
  }
  if (stream) _mm_sfence();  // Streaming stores are weakly ordered: publish them first.
  scalar(in + 2 * i, out + 4 * i, n - i);
}

__attribute__((target("avx2,f16c"))) void F32ToF16Avx2(const std::byte* in, std::byte* out,
                                                       size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 f = _mm256_loadu_ps(reinterpret_cast<const float*>(in + 4 * i));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 2 * i),
                     _mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  F32ToF16(in + 4 * i, out + 2 * i, n - i);
}

void ToF32(DType from, const std::byte* in, std::byte* out, size_t n) {
  static const bool kAvx2 = CpuHasAvx2F16c();
  if (from == DType::kF32) {
    std::memcpy(out, in, 4 * n);
  } else if (kAvx2) {
    WidenAvx2(from, in, out, n, 4 * n >= kStreamingStoreBytes);
  } else if (from == DType::kBF16) {
    Bf16ToF32(in, out, n);
  } else {
    F16ToF32(in, out, n);
  }
}

void FromF32(DType to, const std::byte* in, std::byte* out, size_t n) {
  static const bool kAvx2 = CpuHasAvx2F16c();
  if (to == DType::kF32) {
    std::memcpy(out, in, 4 * n);
  } else if (to == DType::kBF16) {
    F32ToBf16(in, out, n);
  } else if (kAvx2) {
    F32ToF16Avx2(in, out, n);
  } else {
    F32ToF16(in, out, n);
  }
}

}  // namespace

bool IsFloatDType(DType dtype) {
  return dtype == DType::kF32 || dtype == DType::kBF16 || dtype == DType::kF16;
}

void Convert(DType from, std::span<const std::byte> in, DType to, std::span<std::byte> out) {
  assert(IsFloatDType(from) && IsFloatDType(to));
  const size_t n = in.size() / DTypeSize(from);
  assert(out.size() == n * DTypeSize(to));
  if (from == to) {
    std::memcpy(out.data(), in.data(), in.size());
  } else if (to == DType::kF32) {
    ToF32(from, in.data(), out.data(), n);
  } else if (from == DType::kF32) {
    FromF32(to, in.data(), out.data(), n);
  } else {
    // BF16 <-> F16 through F32 (exact widening, one rounding), a stack block at a time.
    constexpr size_t kBlock = 1024;
    alignas(32) std::byte wide[4 * kBlock];
    for (size_t at = 0; at < n; at += kBlock) {
      const size_t k = std::min(kBlock, n - at);
      ToF32(from, in.data() + 2 * at, wide, k);
      FromF32(to, wide, out.data() + 2 * at, k);
    }
  }
}

}  // namespace ckpt::formats
