// PlanSlices tiles the union of each file's ranges exactly, in order, never splits an element of
// a range, cuts on the file's absolute grid (a cut moves at most an element's width past its
// line), reads a shared page once, and names for each slice every range that overlaps it.
#include "libckpt/hf/read_plan.h"

#include <algorithm>
#include <random>
#include <set>
#include <vector>

#include <gtest/gtest.h>

namespace ckpt::internal {
namespace {

TEST(ReadPlanTest, TouchingRangesMergeAndCutOnTheGrid) {
  // Two BF16 tensors that tile [100, 300) of file 0, and one of file 1.
  const std::vector<ByteRange> ranges = {
      {0, 200, 100, 2}, {1, 0, 64, 4}, {0, 100, 100, 2}, {0, 300, 0, 4}};
  const ReadPlan plan = PlanSlices(ranges, 128);
  // File 0's extent [100, 300) cut at the lines 128 and 256; file 1's range whole; the empty
  // range dropped.
  ASSERT_EQ(plan.slices.size(), 4u);
  const uint64_t want[4][3] = {{0, 100, 128}, {0, 128, 256}, {0, 256, 300}, {1, 0, 64}};
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(plan.slices[i].file, want[i][0]) << i;
    EXPECT_EQ(plan.slices[i].begin, want[i][1]) << i;
    EXPECT_EQ(plan.slices[i].end, want[i][2]) << i;
  }
  // A line inside an F32 element moves to the element's end.
  const std::vector<ByteRange> odd = {{0, 2, 400, 4}};
  const ReadPlan moved = PlanSlices(odd, 128);
  EXPECT_EQ(moved.slices[0].end, 130u);
  EXPECT_EQ(moved.slices[1].begin, 130u);
}

TEST(ReadPlanTest, RandomRangesAreTiledExactlyWithWholeElements) {
  std::mt19937 gen(11);
  for (int round = 0; round < 500; ++round) {
    const uint64_t slice = 16 + gen() % 64;
    std::vector<ByteRange> ranges;
    const int n = 1 + static_cast<int>(gen() % 8);
    for (int i = 0; i < n; ++i) {
      const uint64_t esize = uint64_t{1} << (gen() % 4);
      ranges.push_back({gen() % 2, gen() % 300, esize * (gen() % 40), esize});
    }
    const ReadPlan plan = PlanSlices(ranges, slice);
    // Which bytes of each file the ranges cover, and which the slices deliver (once each).
    std::set<std::pair<size_t, uint64_t>> want, got;
    for (const ByteRange& r : ranges) {
      for (uint64_t b = r.offset; b < r.offset + r.length; ++b) want.insert({r.file, b});
    }
    for (const ReadPlan::Slice& s : plan.slices) {
      ASSERT_LT(s.begin, s.end);
      for (uint64_t b = s.begin; b < s.end; ++b) {
        ASSERT_TRUE(got.insert({s.file, b}).second) << "byte " << b << " read twice";
      }
      for (const ByteRange& r : ranges) {
        const bool overlaps = r.file == s.file && r.offset < s.end && s.begin < r.offset + r.length;
        if (!overlaps) continue;
        // No element of the range straddles the slice's ends.
        if (s.begin > r.offset) {
          ASSERT_EQ((s.begin - r.offset) % r.element_bytes, 0u);
        }
        if (s.end < r.offset + r.length) {
          ASSERT_EQ((s.end - r.offset) % r.element_bytes, 0u);
        }
        // The slice names the range.
        bool named = false;
        for (size_t k = s.first; k < s.last; ++k) named |= &ranges[plan.order[k]] == &r;
        ASSERT_TRUE(named) << "round " << round;
      }
    }
    ASSERT_EQ(got, want) << "round " << round;
  }
}

TEST(ReadPlanTest, TensorsThatTileAFileAreCutWithinAnElementOfEachLine) {
  // As a safetensors file lays tensors out: back to back, each of its own element width.
  std::mt19937 gen(5);
  for (int round = 0; round < 200; ++round) {
    std::vector<ByteRange> ranges;
    uint64_t at = gen() % 16;
    for (int i = 0; i < 20; ++i) {
      const uint64_t esize = uint64_t{1} << (gen() % 4);
      const uint64_t length = esize * (gen() % 50);
      ranges.push_back({0, at, length, esize});
      at += length;
    }
    std::shuffle(ranges.begin(), ranges.end(), gen);
    const uint64_t slice = 64;
    const ReadPlan plan = PlanSlices(ranges, slice);
    for (const ReadPlan::Slice& s : plan.slices) {
      // Each end is a line of the grid, moved less than one element (8 bytes at most), or the
      // end of the data.
      ASSERT_TRUE(s.end % slice < 8 || s.end == at) << s.end;
      ASSERT_LE(s.end - s.begin, slice + 8);
    }
  }
}

}  // namespace
}  // namespace ckpt::internal
