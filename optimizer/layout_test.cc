#include "ckpt/optimizer/layout.h"

#include <map>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/support/status_matchers.h"

namespace ckpt::optimizer {
namespace {

using ::testing::ElementsAre;

std::vector<ParamSpec> Model() {
  return {{"embed", {1000}}, {"norm", {37}}, {"w1", {64, 64}}, {"bias", {5}}, {"head", {2000}}};
}

// Every element of every parameter is owned by exactly one rank.
void ExpectExactCover(const std::vector<ParamSpec>& params,
                      const std::vector<std::vector<Piece>>& ranks) {
  for (uint32_t p = 0; p < params.size(); ++p) {
    std::vector<int> owners(params[p].numel(), 0);
    for (const auto& pieces : ranks) {
      for (const Piece& piece : pieces) {
        if (piece.param != p) continue;
        for (uint64_t i = piece.begin; i < piece.begin + piece.count; ++i) ++owners[i];
      }
    }
    for (uint64_t i = 0; i < owners.size(); ++i)
      ASSERT_EQ(owners[i], 1) << params[p].name << "[" << i << "]";
  }
}

TEST(LayoutTest, BucketsFillInReverseOrderAndPadToDpAndAlignment) {
  auto buckets = BuildBuckets(Model(), {.bucket_elems = 3000, .pad_to = 128}, 3);
  CKPT_ASSERT_OK(buckets);
  ASSERT_EQ(buckets->size(), 2u);
  // head (2000) + bias (5) + w1 (4096) close the first bucket at 6101 >= 3000.
  EXPECT_EQ((*buckets)[0].entries.size(), 3u);
  EXPECT_EQ((*buckets)[0].entries[0].param, 4u);
  EXPECT_EQ((*buckets)[0].elems, 6101u);
  EXPECT_EQ((*buckets)[0].padded_elems, 6144u);  // lcm(3, 128) = 384; 16 * 384.
  EXPECT_EQ((*buckets)[1].elems, 1037u);
  EXPECT_EQ((*buckets)[1].padded_elems, 1152u);
}

TEST(LayoutTest, EveryDpSizeCoversEachElementExactlyOnce) {
  for (int dp : {1, 2, 3, 4}) {
    SCOPED_TRACE(dp);
    auto buckets = BuildBuckets(Model(), {.bucket_elems = 3000, .pad_to = 128}, dp);
    CKPT_ASSERT_OK(buckets);
    auto ranks = RankPieces(*buckets, dp);
    ASSERT_EQ(ranks.size(), static_cast<size_t>(dp));
    ExpectExactCover(Model(), ranks);
    // Each rank holds at most its share of each padded bucket.
    for (const auto& pieces : ranks) {
      uint64_t n = 0;
      for (const Piece& p : pieces) n += p.count;
      uint64_t share = 0;
      for (const Bucket& b : *buckets) share += b.padded_elems / static_cast<uint64_t>(dp);
      EXPECT_LE(n, share);
    }
  }
}

TEST(LayoutTest, TwoRanksCutTensorsWhereTheBucketHalves) {
  auto buckets = BuildBuckets(Model(), {.bucket_elems = 3000, .pad_to = 128}, 2);
  CKPT_ASSERT_OK(buckets);
  auto ranks = RankPieces(*buckets, 2);
  // Bucket 0: head [0,2000) bias [2000,2005) w1 [2005,6101); padded 6144, halves at 3072.
  // Bucket 1: norm [0,37) embed [37,1037); padded 1152 (lcm(2,128)=128), halves at 576.
  EXPECT_THAT(ranks[0], ElementsAre(Piece{4, 0, 2000}, Piece{3, 0, 5}, Piece{2, 0, 1067},
                                    Piece{1, 0, 37}, Piece{0, 0, 539}));
  EXPECT_THAT(ranks[1], ElementsAre(Piece{2, 1067, 3029}, Piece{0, 539, 461}));
}

TEST(LayoutTest, RanksMayOwnNothingButPadding) {
  std::vector<ParamSpec> tiny = {{"a", {5}}};
  auto buckets = BuildBuckets(tiny, {.bucket_elems = 100, .pad_to = 128}, 4);
  CKPT_ASSERT_OK(buckets);
  auto ranks = RankPieces(*buckets, 4);
  EXPECT_THAT(ranks[0], ElementsAre(Piece{0, 0, 5}));
  EXPECT_TRUE(ranks[1].empty());
  EXPECT_TRUE(ranks[3].empty());
}

TEST(LayoutTest, BadOptionsAreRefused) {
  EXPECT_THAT(BuildBuckets(Model(), {}, 0), testing::StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(BuildBuckets(Model(), {.bucket_elems = 0}, 2),
              testing::StatusIs(absl::StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace ckpt::optimizer
