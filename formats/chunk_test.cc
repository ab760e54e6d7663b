#include "ckpt/formats/chunk.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "ckpt/base/coding.h"
#include "tests/support/status_matchers.h"

namespace ckpt::formats {
namespace {

using ::ckpt::testing::StatusIs;

TEST(ChunkTest, DataFileHeaderRoundTripsAndDetectsEveryBitFlip) {
  std::string block = EncodeDataFileHeader({1200, 3, 8});
  ASSERT_EQ(block.size(), kDataFileHeaderBytes);
  auto h = DecodeDataFileHeader(AsBytes(block), "f");
  CKPT_ASSERT_OK(h);
  EXPECT_EQ(h->step, 1200u);
  EXPECT_EQ(h->rank, 3u);
  EXPECT_EQ(h->world_size, 8u);
  for (size_t bit = 0; bit < block.size() * 8; bit += 7) {
    std::string bad = block;
    bad[bit / 8] ^= static_cast<char>(1 << (bit % 8));
    EXPECT_THAT(DecodeDataFileHeader(AsBytes(bad), "f"), StatusIs(absl::StatusCode::kDataLoss))
        << bit;
  }
}

TEST(ChunkTest, ChunkHeaderRejectsAbsurdSizesAndUnknownCodecs) {
  std::string ok = EncodeChunkHeader({Codec::kZstd, 100, 40});
  auto h = DecodeChunkHeader(AsBytes(ok), "f", 4096);
  CKPT_ASSERT_OK(h);
  EXPECT_EQ(h->stored_bytes, 40u);
  EXPECT_THAT(DecodeChunkHeader(AsBytes(EncodeChunkHeader({Codec::kRaw, 100, 40})), "f", 0),
              StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_THAT(
      DecodeChunkHeader(AsBytes(EncodeChunkHeader({Codec::kRaw, 1ull << 40, 1ull << 40})), "f", 0),
      StatusIs(absl::StatusCode::kDataLoss));
  std::string bad_codec = ok;
  bad_codec[4] = 7;
  EXPECT_THAT(DecodeChunkHeader(AsBytes(bad_codec), "f", 0), StatusIs(absl::StatusCode::kDataLoss));
}

TEST(ChunkTest, ZstdRoundTripsAndRejectsWrongSizes) {
  std::string raw(100000, 'a');
  auto packed = CompressZstd(AsBytes(raw), 3);
  CKPT_ASSERT_OK(packed);
  EXPECT_LT(packed->size(), raw.size());
  std::string out(raw.size(), '\0');
  CKPT_ASSERT_OK(DecodeChunkPayload(Codec::kZstd, AsBytes(*packed),
                                    std::as_writable_bytes(std::span(out)), "f", 0));
  EXPECT_EQ(out, raw);
  std::string shorter(raw.size() - 1, '\0');
  EXPECT_THAT(DecodeChunkPayload(Codec::kZstd, AsBytes(*packed),
                                 std::as_writable_bytes(std::span(shorter)), "f", 0),
              StatusIs(absl::StatusCode::kDataLoss));
}

TEST(ChunkTest, LatestRoundTripsAndDetectsDamage) {
  std::string latest = EncodeLatest(42);
  auto step = DecodeLatest(AsBytes(latest), "LATEST");
  CKPT_ASSERT_OK(step);
  EXPECT_EQ(*step, 42u);
  for (size_t i = 0; i < latest.size(); ++i) {
    std::string bad = latest;
    bad[i] ^= 0x10;
    EXPECT_THAT(DecodeLatest(AsBytes(bad), "LATEST"), StatusIs(absl::StatusCode::kDataLoss)) << i;
  }
  EXPECT_THAT(DecodeLatest(AsBytes(latest.substr(0, 31)), "LATEST"),
              StatusIs(absl::StatusCode::kDataLoss));
}

TEST(ChunkTest, ExtentPadsToBlocks) {
  EXPECT_EQ(ChunkExtentBytes(0), kBlockBytes);
  EXPECT_EQ(ChunkExtentBytes(kBlockBytes - kChunkHeaderBytes), kBlockBytes);
  EXPECT_EQ(ChunkExtentBytes(kBlockBytes - kChunkHeaderBytes + 1), 2 * kBlockBytes);
}

}  // namespace
}  // namespace ckpt::formats
