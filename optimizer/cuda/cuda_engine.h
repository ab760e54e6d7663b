// The CUDA streamed engine (built only with CUDA).
#ifndef CKPT_OPTIMIZER_CUDA_CUDA_ENGINE_H_
#define CKPT_OPTIMIZER_CUDA_CUDA_ENGINE_H_

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "optimizer/engine.h"

namespace ckpt::optimizer::internal {

absl::StatusOr<std::unique_ptr<internal::Engine>> NewCudaEngineImpl(
    const StagedAdamWOptions& options, const std::vector<Unit>& units, bool max_slab);

}  // namespace ckpt::optimizer::internal

#endif  // CKPT_OPTIMIZER_CUDA_CUDA_ENGINE_H_
