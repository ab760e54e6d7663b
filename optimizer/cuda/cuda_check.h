// CUDA error handling (STYLE.md §2): every runtime call goes through CKPT_CUDA_RETURN_IF_ERROR,
// which clears the sticky error and names it.
#ifndef CKPT_OPTIMIZER_CUDA_CUDA_CHECK_H_
#define CKPT_OPTIMIZER_CUDA_CUDA_CHECK_H_

#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace ckpt::optimizer::internal {

inline absl::Status CudaStatus(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();  // Clear the sticky error so later calls are not blamed for this one.
  std::string message =
      absl::StrCat(what, ": ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")");
  if (err == cudaErrorMemoryAllocation) return absl::ResourceExhaustedError(message);
  if (err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver ||
      err == cudaErrorInvalidDevice || err == cudaErrorDevicesUnavailable ||
      err == cudaErrorCallRequiresNewerDriver) {
    return absl::FailedPreconditionError(message);
  }
  return absl::InternalError(message);
}

}  // namespace ckpt::optimizer::internal

#define CKPT_CUDA_RETURN_IF_ERROR(call)                                                        \
  do {                                                                                         \
    ::absl::Status ckpt_cuda_status_ = ::ckpt::optimizer::internal::CudaStatus((call), #call); \
    if (!ckpt_cuda_status_.ok()) return ckpt_cuda_status_;                                     \
  } while (0)

#endif  // CKPT_OPTIMIZER_CUDA_CUDA_CHECK_H_
