// Element loads and stores of the CUDA kernels (adamw_kernel.cu, muon_kernel.cu): BF16 with the
// CPU's rounding bits (nearest even, NaN made quiet), FP16, FP32. Device code only; nvcc, C++17.
#ifndef CKPT_OPTIMIZER_CUDA_DEVICE_ELEMENTS_CUH_
#define CKPT_OPTIMIZER_CUDA_DEVICE_ELEMENTS_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "optimizer/cuda/adamw_kernel.h"

namespace ckpt::optimizer::internal::device {

using DType = KernelType;

__device__ __forceinline__ float Bf16Bits(uint16_t h) {
  return __uint_as_float(static_cast<uint32_t>(h) << 16);
}

__device__ __forceinline__ uint16_t ToBf16(float f) {
  const uint32_t bits = __float_as_uint(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

template <DType G>
__device__ __forceinline__ float LoadGrad(const void* p, uint64_t i) {
  if constexpr (G == DType::kF32) {
    return static_cast<const float*>(p)[i];
  } else if constexpr (G == DType::kBF16) {
    return Bf16Bits(static_cast<const uint16_t*>(p)[i]);
  } else {
    return __half2float(static_cast<const __half*>(p)[i]);
  }
}

template <DType P>
__device__ __forceinline__ void StoreParam(void* p, uint64_t i, float v) {
  if constexpr (P == DType::kF32) {
    static_cast<float*>(p)[i] = v;
  } else if constexpr (P == DType::kBF16) {
    static_cast<uint16_t*>(p)[i] = ToBf16(v);
  } else {
    static_cast<__half*>(p)[i] = __float2half_rn(v);
  }
}

template <DType M>
__device__ __forceinline__ float LoadMoment(const void* p, uint64_t i) {
  if constexpr (M == DType::kF32)
    return static_cast<const float*>(p)[i];
  else
    return Bf16Bits(static_cast<const uint16_t*>(p)[i]);
}

template <DType M>
__device__ __forceinline__ void StoreMoment(void* p, uint64_t i, float v) {
  if constexpr (M == DType::kF32)
    static_cast<float*>(p)[i] = v;
  else
    static_cast<uint16_t*>(p)[i] = ToBf16(v);
}

}  // namespace ckpt::optimizer::internal::device

#endif  // CKPT_OPTIMIZER_CUDA_DEVICE_ELEMENTS_CUH_
