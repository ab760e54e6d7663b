// cuBLAS for Muon's BF16 products when the process can load it (docs/design/muon.md): NVIDIA's
// GEMMs run 3-5x faster than ckpt's own WMMA kernel (muon_kernel.cu) on Hopper, and every GPU
// host that runs torch has the library (torch's wheels ship it). It is loaded at run time with
// dlopen, never linked: ckpt builds and runs without it (the build machine has no cuBLAS), and
// the products then run on ckpt's kernel. CKPT_CUBLAS=off keeps ckpt's kernel; CKPT_CUBLAS=<path>
// names the library; otherwise libcublas.so.<major> of the CUDA runtime ckpt was built with
// (13), from the loader's search path or the process (a Python process that imported torch
// already holds it). Each handle disallows reduced-precision reductions (every product is
// rounded to BF16 once), and is used from one stream at a time: cuBLAS's results repeat bit for
// bit only so (its reproducibility rules), so the engine keeps one handle per slot.
#ifndef CKPT_OPTIMIZER_CUDA_CUBLAS_GEMM_H_
#define CKPT_OPTIMIZER_CUDA_CUBLAS_GEMM_H_

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "optimizer/cuda/muon_kernel.h"

namespace ckpt::optimizer::internal {

// One cuBLAS handle (one slot's). Move-only; empty when cuBLAS is not loaded.
class CublasGemm {
 public:
  CublasGemm() = default;
  // A handle, or an empty one (and why, in *why) when cuBLAS is off or cannot be loaded.
  static CublasGemm Create(std::string* why);
  ~CublasGemm();
  CublasGemm(const CublasGemm&) = delete;
  CublasGemm& operator=(const CublasGemm&) = delete;
  CublasGemm(CublasGemm&& o) noexcept;
  CublasGemm& operator=(CublasGemm&& o) noexcept;

  bool valid() const { return handle_ != nullptr; }
  // The backend for MuonDeviceArgs::gemm; its products as LaunchGemmBf16's contract says (BF16
  // in and out, FP32 sums, one rounding), through cublasGemmEx.
  GemmBackend backend() const;

 private:
  void* handle_ = nullptr;  // cublasHandle_t.
};

}  // namespace ckpt::optimizer::internal

#endif  // CKPT_OPTIMIZER_CUDA_CUBLAS_GEMM_H_
