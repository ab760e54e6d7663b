// FloatsToBf16 (vectorised) equals FloatToBf16 bit for bit: on zeros, subnormals, ties in both
// directions, the largest finite values (which round to Inf), infinities, quiet and signalling
// NaNs with payloads, and a million random bit patterns; at lengths that leave loop tails.
#include "ckpt/formats/float_convert.h"

#include <cstring>
#include <random>
#include <vector>

#include <gtest/gtest.h>

namespace ckpt::formats {
namespace {

TEST(FloatConvertTest, BulkBf16RoundingEqualsTheScalarOneBitForBit) {
  std::vector<uint32_t> bits = {0x00000000, 0x80000000, 0x00000001, 0x807fffff, 0x3f808000,
                                0x3f818000, 0x3f80ffff, 0x7f7fffff, 0xff7fffff, 0x7f800000,
                                0xff800000, 0x7fc00000, 0x7f800001, 0xffbfffff, 0x7fff8000};
  std::mt19937 gen(7);
  for (int i = 0; i < 1'000'000; ++i) bits.push_back(gen());
  for (size_t n : {bits.size(), size_t{1}, size_t{7}, size_t{33}}) {
    std::vector<float> in(n);
    std::memcpy(in.data(), bits.data(), n * 4);
    std::vector<uint16_t> out(n);
    FloatsToBf16(in.data(), out.data(), n);
    for (size_t i = 0; i < n; ++i) {
      ASSERT_EQ(out[i], FloatToBf16(in[i])) << std::hex << "bits 0x" << bits[i];
    }
  }
}

}  // namespace
}  // namespace ckpt::formats
