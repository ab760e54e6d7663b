#include "libckpt/hf/read_plan.h"

#include <algorithm>

namespace ckpt::internal {
namespace {

uint64_t RoundUp(uint64_t n, uint64_t to) { return (n + to - 1) / to * to; }

}  // namespace

ReadPlan PlanSlices(std::span<const ByteRange> ranges, uint64_t slice_bytes) {
  ReadPlan plan;
  std::vector<size_t>& order = plan.order;
  order.resize(ranges.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    if (ranges[a].file != ranges[b].file) return ranges[a].file < ranges[b].file;
    return ranges[a].offset < ranges[b].offset;
  });
  auto end_of = [&](size_t k) { return ranges[order[k]].offset + ranges[order[k]].length; };
  for (size_t i = 0; i < order.size();) {
    if (ranges[order[i]].length == 0) {
      ++i;
      continue;
    }
    const size_t file = ranges[order[i]].file;
    const uint64_t lo = ranges[order[i]].offset;
    uint64_t hi = end_of(i);
    size_t j = i + 1;
    for (; j < order.size() && ranges[order[j]].file == file && ranges[order[j]].offset <= hi; ++j) {
      hi = std::max(hi, end_of(j));
    }
    // Grid lines inside (lo, hi), each moved past any element it would split. `k` walks the
    // ranges: those before it end at or before the current slice's start (prefix maximum).
    uint64_t begin = lo, ends_before = 0;
    size_t k = i;
    for (uint64_t line = (lo / slice_bytes + 1) * slice_bytes; begin < hi; line += slice_bytes) {
      if (line <= begin) continue;  // A cut moved past this line already.
      while (k < j && std::max(ends_before, end_of(k)) <= begin) {
        ends_before = std::max(ends_before, end_of(k));
        ++k;
      }
      // Moving the cut to the end of one range's element may land inside another's (ranges
      // of other element widths may overlap): move until no range's element is split. The cut
      // only grows, and never past the end of the range that moved it (a whole number of
      // elements), so never past hi.
      uint64_t cut = std::min(line, hi);
      size_t last = k;
      for (bool moved = true; moved;) {
        moved = false;
        for (last = k; last < j && ranges[order[last]].offset < cut; ++last) {
          const ByteRange& r = ranges[order[last]];
          if (cut >= r.offset + r.length) continue;
          const uint64_t whole = r.offset + RoundUp(cut - r.offset, r.element_bytes);
          moved |= whole != cut;
          cut = whole;
        }
      }
      plan.slices.push_back({file, begin, cut, k, last});
      begin = cut;
    }
    i = j;
  }
  return plan;
}

}  // namespace ckpt::internal
