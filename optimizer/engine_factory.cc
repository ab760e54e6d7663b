// The one place that knows whether CUDA was built in (STYLE.md §7).
#include "absl/strings/str_cat.h"
#include "optimizer/engine.h"
#include "optimizer/host_buffer.h"

#if CKPT_HAVE_CUDA
#include "optimizer/cuda/cuda_engine.h"
#endif

namespace ckpt::optimizer {

absl::StatusOr<std::unique_ptr<internal::Engine>> NewCudaEngine(const StagedAdamWOptions& options,
                                                                const std::vector<Unit>& units,
                                                                bool max_slab) {
#if CKPT_HAVE_CUDA
  return internal::NewCudaEngineImpl(options, units, max_slab);
#else
  (void)options;
  (void)units;
  (void)max_slab;
  return absl::UnimplementedError(
      "CUDA engine unavailable: ckpt was built without CUDA (CKPT_CUDA=OFF or no toolkit)");
#endif
}

namespace internal {

#if !CKPT_HAVE_CUDA
absl::Status RegisterPinned(void*, size_t bytes) {
  return absl::UnimplementedError(
      absl::StrCat("pinned host memory (", bytes, " bytes) needs a CUDA build"));
}
void UnregisterPinned(void*) {}
#endif

}  // namespace internal
}  // namespace ckpt::optimizer
