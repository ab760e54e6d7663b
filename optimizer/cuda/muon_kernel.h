// Muon on the GPU (muon_kernel.cu): one whole matrix's step, as optimizer/muon.cc runs it on the
// CPU: the momentum and the update of the masters elementwise in FP32 with torch's formulas, and
// the Newton-Schulz orthogonalisation with BF16 operands, FP32 accumulation and one BF16 rounding
// per product (tensor cores). Self-contained (no C++20, no absl) so nvcc compiles it in C++17.
#ifndef CKPT_OPTIMIZER_CUDA_MUON_KERNEL_H_
#define CKPT_OPTIMIZER_CUDA_MUON_KERNEL_H_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "optimizer/cuda/adamw_kernel.h"

namespace ckpt::optimizer::internal {

// C = bf16(alpha * A op(B) + beta * D), every matrix row-major BF16 (uint16_t bits):
// A is m x k (leading dimension k); B is k x n (leading dimension n), or with trans_b n x k
// (leading dimension k, so the product is A B^T); C and D are m x n (leading dimension n), D may
// be null (then beta is not read) and must not be C. Any m, n, k >= 1; products accumulate in
// FP32. With too few tiles of C for the GPU's multiprocessors, k is split into slices whose FP32
// sums go to `workspace` (device, `workspace_floats` floats; null: never split) and are added in
// order. Sums run in a fixed order, so a result does not change from run to run.
cudaError_t LaunchGemmBf16(const uint16_t* a, const uint16_t* b, bool trans_b, const uint16_t* d,
                           uint16_t* c, int m, int n, int k, float alpha, float beta,
                           float* workspace, size_t workspace_floats, cudaStream_t stream);

// Where the products of an orthogonalisation run: another implementation of LaunchGemmBf16's
// contract (`gemm`, called with `ctx`: cuBLAS, cublas_gemm.h), or ckpt's kernel (gemm null).
struct GemmBackend {
  cudaError_t (*gemm)(void* ctx, const uint16_t* a, const uint16_t* b, bool trans_b,
                      const uint16_t* d, uint16_t* c, int m, int n, int k, float alpha, float beta,
                      cudaStream_t stream) = nullptr;
  void* ctx = nullptr;
};

// One group's Muon constants (MuonConstants, optimizer/muon.h), with the matrix's adjusted lr.
struct MuonKernelConstants {
  float lerp_weight, nesterov_weight;
  int nesterov;
  float decay, neg_lr;
  float a, b, c, eps;
  unsigned ns_steps;
};

// Whether the current device has BF16 tensor cores (compute capability 8.0 or newer), which the
// products need.
cudaError_t GpuSupportsMuon(bool* supported);

// Device scratch one matrix's orthogonalisation needs: two m x n and two m x m BF16 matrices (m
// the smaller side) and the norm's partial sums, and with `own_kernel` (the products on ckpt's
// kernel, GemmBackend::gemm null) room for its split products' FP32 slices when m <= 2048. A
// slot sized for the largest matrix serves any, with the same products.
size_t MuonScratchBytes(uint64_t rows, uint64_t cols, bool own_kernel);

struct MuonDeviceArgs {
  const float* master_in;
  float* master_out;
  const void* momentum_in;  // FP32 or BF16 per `moments`.
  void* momentum_out;
  const void* grads;  // Device; the matrix's gradient.
  void* params;       // Device; the matrix's weights, written as the new masters rounded.
  float grad_scale;
  uint64_t rows, cols;
  void* scratch;  // MuonScratchBytes(rows, cols, products.gemm == nullptr) bytes of device memory.
  MuonKernelConstants k;
  GemmBackend products;
  // Optional (null: none), for a pipeline that moves the momentum and the master separately:
  // recorded once the momentum is written (it may be copied out while the orthogonalisation
  // runs), and waited for before the master is first read (its copy-in may land meanwhile).
  cudaEvent_t momentum_written = nullptr;
  cudaEvent_t master_ready = nullptr;
};

// Enqueues the ns_steps iterations alone on whatever X a rows x cols matrix's scratch holds: the
// products of one orthogonalisation as the step runs them (bench muon's bound).
cudaError_t LaunchMuonProducts(void* scratch, uint64_t rows, uint64_t cols,
                               const MuonKernelConstants& k, const GemmBackend& products,
                               cudaStream_t stream);

// Enqueues the matrix's whole step on `stream`. `moments` is kF32 or kBF16. The matrix must fit
// an int's index on each side of the products (rows, cols < 2^31).
cudaError_t LaunchMuonMatrix(const MuonDeviceArgs& args, KernelType grad, KernelType param,
                             KernelType moments, cudaStream_t stream);

}  // namespace ckpt::optimizer::internal

#endif  // CKPT_OPTIMIZER_CUDA_MUON_KERNEL_H_
