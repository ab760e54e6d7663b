// The CUDA engine's factory (optimizer/cuda/cuda_engine.h): the device checked, the slots'
// buffers sized by the units the layout cut (and Muon's scratch by its largest matrix), the
// engine made and its slots restored; and the pinning of the slabs' host memory
// (optimizer/host_buffer.h). The engine's pipeline, with its numbered steps, is
// optimizer/cuda/cuda_engine.cc.
#include "optimizer/cuda/cuda_engine.h"

#include <algorithm>
#include <memory>
#include <utility>

#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"
#include "ckpt/base/status_macros.h"
#include "optimizer/cuda/cuda_check.h"
#include "optimizer/cuda/cuda_engine_impl.h"
#include "optimizer/cuda/muon_kernel.h"

namespace ckpt::optimizer::internal {

absl::StatusOr<std::unique_ptr<internal::Engine>> NewCudaEngineImpl(
    const StagedAdamWOptions& options, const std::vector<Unit>& units, bool max_slab) {
  int devices = 0;
  absl::Status counted = CudaStatus(cudaGetDeviceCount(&devices), "no usable CUDA device");
  if (!counted.ok()) return absl::FailedPreconditionError(counted.message());
  if (devices == 0) return absl::FailedPreconditionError("no CUDA device visible");
  if (options.slot_count < 1) return absl::InvalidArgumentError("slot_count must be at least 1");
  // Device buffers are sized by the units the layout actually cut, so they can never be
  // smaller than a unit whatever rule cut them.
  uint64_t unit_elems = 1;
  uint64_t muon_scratch = 0;  // Sized for the largest Muon matrix, on ckpt's kernel or cuBLAS.
  uint64_t muon_scratch_blas = 0;
  uint64_t adamw_elems = 1;   // Muon keeps no second moments: those buffers fit AdamW's units.
  for (const Unit& u : units) {
    unit_elems = std::max(unit_elems, u.count);
    if (u.rows == 0) adamw_elems = std::max(adamw_elems, u.count);
    if (u.rows != 0) {
      const uint64_t cols = u.count / u.rows;
      if (u.rows >= (uint64_t{1} << 31) || cols >= (uint64_t{1} << 31)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "a Muon matrix of ", u.rows, " x ", cols,
            " is too large for the CUDA engine's products (each side below 2^31)"));
      }
      muon_scratch = std::max<uint64_t>(muon_scratch, MuonScratchBytes(u.rows, cols, true));
      muon_scratch_blas =
          std::max<uint64_t>(muon_scratch_blas, MuonScratchBytes(u.rows, cols, false));
    }
  }
  if (muon_scratch > 0) {
    bool supported = false;
    CKPT_CUDA_RETURN_IF_ERROR(GpuSupportsMuon(&supported));
    if (!supported) {
      return absl::FailedPreconditionError(
          "the CUDA engine's Muon needs BF16 tensor cores (compute capability 8.0 or newer), "
          "which this GPU lacks: step Muon groups on the CPU engine");
    }
  }
  auto engine = std::make_unique<CudaEngine>(options.slot_count, unit_elems, adamw_elems,
                                             options.moment_dtype, max_slab, muon_scratch,
                                             muon_scratch_blas);
  CKPT_RETURN_IF_ERROR(engine->Restore());
  return std::unique_ptr<internal::Engine>(std::move(engine));
}

absl::Status RegisterPinned(void* base, size_t bytes) {
  CKPT_CUDA_RETURN_IF_ERROR(cudaHostRegister(base, bytes, cudaHostRegisterPortable));
  return absl::OkStatus();
}

void UnregisterPinned(void* base) { cudaHostUnregister(base); }

}  // namespace ckpt::optimizer::internal
