// How Checkpointer lays optimizer state out in a step (the table at the top of
// ckpt/optimizer/checkpointer.h), shared by its save, load and model-only load.
#ifndef CKPT_OPTIMIZER_CHECKPOINTER_LAYOUT_H_
#define CKPT_OPTIMIZER_CHECKPOINTER_LAYOUT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "ckpt/formats/dtype.h"
#include "ckpt/formats/manifest.h"
#include "ckpt/optimizer/staged_adamw.h"

namespace ckpt::optimizer::internal {

inline constexpr char kLayoutBlob[] = "optimizer.layout";
inline constexpr char kTrainerPrefix[] = "trainer.";
// Every name that starts so is optimizer state; the other tensors are the model's.
inline constexpr char kOptimizerPrefix[] = "optimizer.";
inline constexpr const char* kStatePrefixes[3] = {"optimizer.master.", "optimizer.exp_avg.",
                                                  "optimizer.exp_avg_sq."};

inline formats::DType MomentDTypeOf(MomentDType m) {
  return m == MomentDType::kF32 ? formats::DType::kF32 : formats::DType::kBF16;
}

// True when the pieces of tensor `index` in `m` cover [begin, begin + count).
bool Covers(const formats::Manifest& m, uint32_t index, uint64_t begin, uint64_t count);

// The optimizer record (blob kLayoutBlob) of a step saved by `world_size` ranks: JSON with the
// parameters (name, shape, model dtype, group), the groups (hyper-parameters in double and
// step counters) and the moments' dtype (docs/formats/ckpt-v1.md).
std::string LayoutRecord(const std::vector<ParamSpec>& params,
                         const std::vector<ParamGroup>& groups, MomentDType moments,
                         int world_size);

// The first 10 names, then how many more: "a, b, c and 12 more".
std::string ListNames(const std::vector<std::string>& names);

}  // namespace ckpt::optimizer::internal

#endif  // CKPT_OPTIMIZER_CHECKPOINTER_LAYOUT_H_
