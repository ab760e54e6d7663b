// StagedAdamW's slabs (one side of the state in host memory) and its open overlapped step
// (optimizer/overlap.cc). Not part of the API.
#ifndef CKPT_OPTIMIZER_SLABS_H_
#define CKPT_OPTIMIZER_SLABS_H_

#include "ckpt/optimizer/staged_adamw.h"
#include <cstdint>
#include <vector>

#include "optimizer/engine.h"
#include "optimizer/host_buffer.h"

namespace ckpt::optimizer {

struct StagedAdamW::Slabs {
  internal::HostBuffer master, exp_avg, exp_avg_sq;
  internal::HostBuffer max_exp_avg_sq;  // Allocated only with has_max_exp_avg_sq().
};

struct StagedAdamW::OverlapState {
  StepArgs args;                     // Begin's, with `pieces` pointing at `buffers`.
  bool pieces_mode = false;          // Buffers come with Release, one per piece.
  std::vector<PieceBuffers> buffers;  // Per piece (pieces mode), null until released.
  bool speculate = true;
  StepPlan plan;                            // Every piece stepped at its next step count.
  std::vector<std::vector<uint32_t>> piece_units;  // Per piece, the units it lies in.
  std::vector<uint32_t> pending;            // Per unit: pieces not yet released.
  std::vector<uint8_t> released;            // Per piece.
  std::vector<uint8_t> speculated;          // Per unit.
  std::vector<uint32_t> ready;              // Ready units not yet speculated.
  uint64_t speculated_units = 0;
  bool invalidated = false;  // Overlap::Invalidate: the speculation cannot hold.
};

}  // namespace ckpt::optimizer

#endif  // CKPT_OPTIMIZER_SLABS_H_
