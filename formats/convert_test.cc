// Convert equals the per-element definitions of float_convert.h bit for bit, for every pair of
// F32, BF16 and F16, on its vector paths (AVX2/F16C where the CPU has them, streaming stores
// for large widenings) and its scalar tails: zeros, subnormals, ties in both directions, the
// largest finite values (which round to Inf), infinities, quiet and signalling NaNs with
// payloads, every 16-bit pattern and a million random FP32 patterns; at lengths and offsets
// that leave heads and tails, and from unaligned buffers.
#include "ckpt/formats/convert.h"

#include <cstring>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "ckpt/formats/float_convert.h"

namespace ckpt::formats {
namespace {

// The reference: one element at a time through float_convert.h.
float RefToFloat(DType d, const std::byte* p) {
  if (d == DType::kF32) {
    float f;
    std::memcpy(&f, p, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, p, 2);
  return d == DType::kBF16 ? Bf16ToFloat(h) : HalfToFloat(h);
}

void RefFromFloat(DType d, float f, std::byte* p) {
  if (d == DType::kF32) {
    std::memcpy(p, &f, 4);
    return;
  }
  const uint16_t h = d == DType::kBF16 ? FloatToBf16(f) : FloatToHalf(f);
  std::memcpy(p, &h, 2);
}

// Elements of `from` as bytes: the special values of its width, then random patterns.
std::vector<std::byte> Inputs(DType from) {
  std::vector<std::byte> out;
  if (from == DType::kF32) {
    std::vector<uint32_t> bits = {0x00000000, 0x80000000, 0x00000001, 0x807fffff, 0x3f808000,
                                  0x3f818000, 0x3f80ffff, 0x7f7fffff, 0xff7fffff, 0x7f800000,
                                  0xff800000, 0x7fc00000, 0x7f800001, 0xffbfffff, 0x7fff8000,
                                  0x33800000, 0x33000000, 0x38800000, 0x387fe000, 0x477ff000,
                                  0x477fefff, 0x477fe000};
    std::mt19937 gen(7);
    for (int i = 0; i < 1'000'000; ++i) bits.push_back(gen());
    out.resize(bits.size() * 4);
    std::memcpy(out.data(), bits.data(), out.size());
    return out;
  }
  // Every 16-bit pattern, twice (so that long runs use the vector paths throughout).
  for (int round = 0; round < 2; ++round) {
    for (uint32_t h = 0; h < 0x10000; ++h) {
      const uint16_t v = static_cast<uint16_t>(h);
      out.resize(out.size() + 2);
      std::memcpy(out.data() + out.size() - 2, &v, 2);
    }
  }
  return out;
}

class ConvertTest : public ::testing::TestWithParam<std::pair<DType, DType>> {};

TEST_P(ConvertTest, EqualsThePerElementDefinitionBitForBit) {
  const auto [from, to] = GetParam();
  const std::vector<std::byte> all = Inputs(from);
  const size_t in_size = DTypeSize(from), out_size = DTypeSize(to);
  const size_t total = all.size() / in_size;
  // Whole (streaming stores for a large F32 output), short lengths with tails, odd offsets.
  for (const auto& [skip, n] : {std::pair<size_t, size_t>{0, total}, {0, 1}, {1, 7}, {3, 33},
                                {5, 4099}, {1, total - 1}}) {
    // One spare byte in front of each buffer: both are unaligned.
    std::vector<std::byte> in(1 + n * in_size), out(1 + n * out_size), want(n * out_size);
    std::memcpy(in.data() + 1, all.data() + skip * in_size, n * in_size);
    Convert(from, std::span(in).subspan(1), to, std::span(out).subspan(1));
    for (size_t i = 0; i < n; ++i) {
      const std::byte* element = in.data() + 1 + i * in_size;
      if (from == to) {
        std::memcpy(want.data() + i * out_size, element, out_size);  // A copy, NaNs untouched.
      } else {
        RefFromFloat(to, RefToFloat(from, element), want.data() + i * out_size);
      }
    }
    for (size_t i = 0; i < n; ++i) {
      ASSERT_EQ(std::memcmp(out.data() + 1 + i * out_size, want.data() + i * out_size, out_size), 0)
          << DTypeName(from) << " -> " << DTypeName(to) << " element " << i << " of " << n;
    }
  }
}

TEST(ConvertTest, AlignedLargeWideningStreamsTheSameBits) {
  // A 32-byte aligned F32 output of at least kStreamingStoreBytes takes the streaming path.
  const size_t n = kStreamingStoreBytes / 4 + 13;
  std::vector<uint16_t> in(n);
  for (size_t i = 0; i < n; ++i) in[i] = static_cast<uint16_t>(i * 2654435761u >> 7);
  for (DType from : {DType::kBF16, DType::kF16}) {
    std::vector<float> out(n + 8);
    float* aligned = out.data();
    while (reinterpret_cast<uintptr_t>(aligned) % 32 != 0) ++aligned;
    Convert(from, std::as_bytes(std::span(in)), DType::kF32,
            std::as_writable_bytes(std::span(aligned, n)));
    for (size_t i = 0; i < n; ++i) {
      const float want = from == DType::kBF16 ? Bf16ToFloat(in[i]) : HalfToFloat(in[i]);
      ASSERT_EQ(FloatBits(aligned[i]), FloatBits(want)) << DTypeName(from) << " element " << i;
    }
  }
}

// The bulk rounding Muon uses is the per-element definition, bit for bit: ties to even, NaNs
// made quiet, infinities, overflow to infinity, subnormals and both zeros.
TEST(ConvertTest, RoundAllToBf16IsRoundToBf16OfEachElement) {
  std::vector<uint32_t> bits = {0x00000000u, 0x80000000u, 0x00000001u, 0x007fffffu, 0x3f808000u,
                                0x3f818000u, 0x3f807fffu, 0x7f7fffffu, 0x7f800000u, 0xff800000u,
                                0x7f800001u, 0xffc00001u, 0x7fffffffu, 0x3f800000u};
  std::mt19937 gen(7);
  for (int i = 0; i < 4096; ++i) bits.push_back(static_cast<uint32_t>(gen()));
  std::vector<float> x(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) std::memcpy(&x[i], &bits[i], 4);
  std::vector<float> bulk = x;
  RoundAllToBf16(bulk.data(), bulk.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const float one = RoundToBf16(x[i]);
    EXPECT_EQ(std::memcmp(&one, &bulk[i], 4), 0) << std::hex << bits[i];
    EXPECT_EQ(FloatToBf16(bulk[i]), FloatToBf16(x[i])) << std::hex << bits[i];
  }
}

TEST(ConvertTest, OnlyTheThreeFloatTypesAreServed) {
  EXPECT_TRUE(IsFloatDType(DType::kF32));
  EXPECT_TRUE(IsFloatDType(DType::kBF16));
  EXPECT_TRUE(IsFloatDType(DType::kF16));
  for (DType d : {DType::kF64, DType::kI64, DType::kI32, DType::kI16, DType::kI8, DType::kU8,
                  DType::kBool}) {
    EXPECT_FALSE(IsFloatDType(d)) << DTypeName(d);
  }
}

std::vector<std::pair<DType, DType>> AllPairs() {
  std::vector<std::pair<DType, DType>> out;
  for (DType a : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (DType b : {DType::kF32, DType::kBF16, DType::kF16}) out.emplace_back(a, b);
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(AllPairs, ConvertTest, ::testing::ValuesIn(AllPairs()),
                         [](const ::testing::TestParamInfo<std::pair<DType, DType>>& p) {
                           return std::string(DTypeName(p.param.first)) + "To" +
                                  std::string(DTypeName(p.param.second));
                         });

}  // namespace
}  // namespace ckpt::formats
