// Seeded generators of test tensors.
#ifndef CKPT_TESTS_SUPPORT_TENSOR_GEN_H_
#define CKPT_TESTS_SUPPORT_TENSOR_GEN_H_

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <span>
#include <vector>

#include "ckpt/formats/dtype.h"
#include "ckpt/formats/float_convert.h"

namespace ckpt::testing {

// `count` floats drawn from a seeded generator: the same seed gives the same values.
inline std::vector<float> RandomFloats(size_t count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> out(count);
  for (float& x : out) x = dist(rng);
  return out;
}

// `count` normal floats with standard deviation `scale`, from a seeded generator.
inline std::vector<float> RandomNormal(size_t count, uint64_t seed, float scale) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> out(count);
  for (float& x : out) x = dist(rng);
  return out;
}

// `values` in `dtype` (F32, BF16 or F16; rounded to nearest even), as bytes.
inline std::vector<std::byte> EncodeFloats(const std::vector<float>& values, formats::DType dtype) {
  std::vector<std::byte> out(values.size() * formats::DTypeSize(dtype));
  for (size_t i = 0; i < values.size(); ++i) {
    if (dtype == formats::DType::kF32) {
      std::memcpy(out.data() + 4 * i, &values[i], 4);
    } else {
      const uint16_t h = dtype == formats::DType::kBF16 ? formats::FloatToBf16(values[i])
                                                        : formats::FloatToHalf(values[i]);
      std::memcpy(out.data() + 2 * i, &h, 2);
    }
  }
  return out;
}

template <typename T>
std::span<const std::byte> Bytes(const std::vector<T>& v) {
  return std::as_bytes(std::span<const T>(v));
}

}  // namespace ckpt::testing

#endif  // CKPT_TESTS_SUPPORT_TENSOR_GEN_H_
