// The seam between StagedAdamW::Step and an async save in flight (optimizer/async_save.h): while
// the save's writer has not written a unit, the step may change it only after the fence has let
// it go (written, or its bytes copied into the save's staging pool). Not part of the API.
#ifndef CKPT_OPTIMIZER_UNIT_FENCE_H_
#define CKPT_OPTIMIZER_UNIT_FENCE_H_

#include <cstddef>
#include <vector>

namespace ckpt::optimizer::internal {

class UnitFence {
 public:
  virtual ~UnitFence() = default;
  // Blocks until at least one unit i with !done[i] may be updated, and appends to `ready` every
  // unit it lets go now (each with !done[i]). `done` has one entry per unit of the optimizer.
  // REQUIRES: some unit is not done.
  virtual void Acquire(const std::vector<bool>& done, std::vector<size_t>* ready) = 0;
};

}  // namespace ckpt::optimizer::internal

#endif  // CKPT_OPTIMIZER_UNIT_FENCE_H_
