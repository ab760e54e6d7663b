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

// Muon's matrices lie whole on one rank each, the largest first onto the least loaded; the
// other parameters are cut as RankPieces cuts them, and every element has one owner.
TEST(LayoutTest, WholeParametersGoWholeToTheLeastLoadedRank) {
  const std::vector<ParamSpec> params = {{"embed", {1000}},  {"w1", {64, 64}}, {"norm", {37}},
                                         {"w2", {32, 64}},   {"w3", {64, 64}}, {"head", {2000}},
                                         {"w4", {16, 16}}};
  const std::vector<bool> whole = {false, true, false, true, true, false, true};
  for (int dp : {1, 2, 3, 5}) {
    SCOPED_TRACE(dp);
    auto ranks = RankPiecesKeepingWhole(params, whole, {.bucket_elems = 1500, .pad_to = 8}, dp);
    CKPT_ASSERT_OK(ranks);
    ASSERT_EQ(ranks->size(), static_cast<size_t>(dp));
    ExpectExactCover(params, *ranks);
    std::vector<uint64_t> load(dp, 0);
    for (int r = 0; r < dp; ++r) {
      bool seen_whole = false;
      for (const Piece& p : (*ranks)[r]) {
        load[r] += p.count;
        if (whole[p.param]) {
          EXPECT_EQ(p.begin, 0u);
          EXPECT_EQ(p.count, params[p.param].numel()) << params[p.param].name;
          seen_whole = true;
        } else {
          EXPECT_FALSE(seen_whole) << "cut pieces come first";
        }
      }
    }
    // Greedy largest-first: no rank holds more than the least loaded one plus the largest matrix.
    EXPECT_LE(*std::max_element(load.begin(), load.end()),
              *std::min_element(load.begin(), load.end()) + 4096);
  }
  // The cut parameters are cut exactly as RankPieces cuts them alone.
  auto ranks = RankPiecesKeepingWhole(params, whole, {.bucket_elems = 1500, .pad_to = 8}, 2);
  CKPT_ASSERT_OK(ranks);
  auto cut_buckets = BuildBuckets({params[0], params[2], params[5]},
                                  {.bucket_elems = 1500, .pad_to = 8}, 2);
  CKPT_ASSERT_OK(cut_buckets);
  const std::vector<std::vector<Piece>> cut = RankPieces(*cut_buckets, 2);
  const uint32_t back[] = {0, 2, 5};
  for (int r = 0; r < 2; ++r) {
    for (size_t k = 0; k < cut[r].size(); ++k) {
      EXPECT_EQ((*ranks)[r][k], (Piece{back[cut[r][k].param], cut[r][k].begin, cut[r][k].count}));
    }
  }
  EXPECT_THAT(RankPiecesKeepingWhole(params, {true}, {}, 2),
              testing::StatusIs(absl::StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace ckpt::optimizer
