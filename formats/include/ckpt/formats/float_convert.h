// Conversions between FP32 and the 16-bit float formats, exact where they can be and rounded to
// nearest even where they cannot, bit-compatible with the x86 F16C instructions (vcvtph2ps,
// vcvtps2ph): NaNs come out quiet with their payload's top bits. The one definition used by the
// safetensors reader and the optimizer's kernels; bulk conversions go through convert.h.
#ifndef CKPT_FORMATS_FLOAT_CONVERT_H_
#define CKPT_FORMATS_FLOAT_CONVERT_H_

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace ckpt::formats {

inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float BitsToFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float Bf16ToFloat(uint16_t h) { return BitsToFloat(static_cast<uint32_t>(h) << 16); }

inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ff;
  if (exp == 0) {
    if (mant == 0) return BitsToFloat(sign);
    uint32_t e = 113;  // Normalise a subnormal half.
    do {
      mant <<= 1;
      --e;
    } while ((mant & 0x400) == 0);
    return BitsToFloat(sign | (e << 23) | ((mant & 0x3ff) << 13));
  }
  if (exp == 31) {  // Inf, or a NaN made quiet.
    return BitsToFloat(sign | 0x7f800000u | (mant << 13) | (mant != 0 ? 0x400000u : 0));
  }
  return BitsToFloat(sign | ((exp + 112) << 23) | (mant << 13));
}

inline uint16_t FloatToBf16(float f) {
  const uint32_t bits = FloatBits(f);
  if ((bits & 0x7fffffff) > 0x7f800000) return static_cast<uint16_t>((bits >> 16) | 0x40);  // NaN.
  return static_cast<uint16_t>((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

// f rounded to the nearest BF16 value, as an FP32 (FloatToBf16, then widened back exactly).
inline float RoundToBf16(float f) { return Bf16ToFloat(FloatToBf16(f)); }

// RoundToBf16 of each of x[0, n), in place, the same bits; branch-free so that it vectorizes
// (Muon rounds whole products as torch's BF16 matmuls do).
inline void RoundAllToBf16(float* x, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const uint32_t bits = FloatBits(x[i]);
    const uint32_t rounded = (bits + 0x7fff + ((bits >> 16) & 1)) & 0xffff0000u;
    const uint32_t nan = (bits | 0x400000u) & 0xffff0000u;
    x[i] = BitsToFloat((bits & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
  }
}

inline uint16_t FloatToHalf(float f) {
  const uint32_t bits = FloatBits(f);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000);
  const uint32_t exp = (bits >> 23) & 0xff;
  const uint32_t mant = bits & 0x7fffff;
  if (exp == 0xff) {  // Inf stays Inf; NaN becomes quiet with its payload's top bits.
    return static_cast<uint16_t>(sign | 0x7c00 | (mant != 0 ? 0x200 | (mant >> 13) : 0));
  }
  const int e = static_cast<int>(exp) - 112;  // Half exponent field if normal.
  if (e >= 31) return static_cast<uint16_t>(sign | 0x7c00);
  if (e <= 0) {  // Subnormal half (or zero): shift the full significand, round to even.
    const uint32_t shift = static_cast<uint32_t>(14 - e);
    if (shift > 24) return sign;
    const uint32_t m = exp == 0 ? mant : (mant | 0x800000);
    uint32_t r = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1))) ++r;
    return static_cast<uint16_t>(sign | r);
  }
  uint32_t r = (static_cast<uint32_t>(e) << 10) | (mant >> 13);
  const uint32_t rem = mant & 0x1fff;
  if (rem > 0x1000 || (rem == 0x1000 && (r & 1))) ++r;  // A carry may reach Inf, as it should.
  return static_cast<uint16_t>(sign | r);
}

}  // namespace ckpt::formats

#endif  // CKPT_FORMATS_FLOAT_CONVERT_H_
