// Seeded generators of test tensors.
#ifndef CKPT_TESTS_SUPPORT_TENSOR_GEN_H_
#define CKPT_TESTS_SUPPORT_TENSOR_GEN_H_

#include <cstddef>
#include <cstdint>
#include <random>
#include <span>
#include <vector>

namespace ckpt::testing {

// `count` floats drawn from a seeded generator: the same seed gives the same values.
inline std::vector<float> RandomFloats(size_t count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> out(count);
  for (float& x : out) x = dist(rng);
  return out;
}

template <typename T>
std::span<const std::byte> Bytes(const std::vector<T>& v) {
  return std::as_bytes(std::span<const T>(v));
}

}  // namespace ckpt::testing

#endif  // CKPT_TESTS_SUPPORT_TENSOR_GEN_H_
