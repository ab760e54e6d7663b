// The HF reader's read plan, pure: byte ranges of files (a loader's tensors) become slices on
// each file's absolute grid of `slice_bytes`, so that requests are large and aligned however the
// tensors fall, a page shared by two tensors is read once, and no slice splits an element of a
// range. No IO: HfCheckpointReader reads the slices (libckpt/read_pipeline.h).
#ifndef CKPT_LIBCKPT_HF_READ_PLAN_H_
#define CKPT_LIBCKPT_HF_READ_PLAN_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace ckpt::internal {

// Bytes [offset, offset + length) of file `file`, made of elements of `element_bytes` (>= 1).
struct ByteRange {
  size_t file = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
  uint64_t element_bytes = 1;
};

struct ReadPlan {
  // The ranges' indices sorted by (file, offset).
  std::vector<size_t> order;
  // Bytes [begin, end) of `file`; order[first, last) are the ranges that may overlap it.
  struct Slice {
    size_t file;
    uint64_t begin, end;
    size_t first, last;
  };
  std::vector<Slice> slices;
};

// Ranges that touch or overlap merge into extents; each extent is cut at the multiples of
// `slice_bytes` inside it, a cut that would split an element of a range moved up to that
// element's end. The slices of a file tile the union of its ranges exactly, in order; empty
// ranges are dropped. REQUIRES: slice_bytes > 0.
ReadPlan PlanSlices(std::span<const ByteRange> ranges, uint64_t slice_bytes);

}  // namespace ckpt::internal

#endif  // CKPT_LIBCKPT_HF_READ_PLAN_H_
