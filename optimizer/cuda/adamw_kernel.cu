// The fused AdamW kernel: the same float operations, in the same order, as the CPU kernels
// (optimizer/cpu_kernels.cc), compiled with --fmad=false and IEEE division and square root, so
// the two engines agree bit for bit.
#include "optimizer/cuda/adamw_kernel.h"
#include "optimizer/cuda/device_elements.cuh"

namespace ckpt::optimizer::internal {
namespace {

using DType = KernelType;
using device::LoadGrad;
using device::LoadMoment;
using device::StoreMoment;
using device::StoreParam;

// Block row y updates run a.segment[y]; the element arithmetic is the same for every run.
template <DType G, DType P, DType M>
__global__ void AdamwUnitKernel(DeviceUnitArgs a) {
  const DeviceSegment& s = a.segment[blockIdx.y];
  const KernelConstants c = s.c;
  for (uint64_t j = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; j < s.n;
       j += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    const uint64_t i = s.at + j;  // In the unit's buffers; j in the run's.
    const float g = __fmul_rn(LoadGrad<G>(s.grads, j), a.grad_scale);
    float p = __fmul_rn(a.master_in[i], c.decay);
    const float m = __fadd_rn(__fmul_rn(c.beta1, LoadMoment<M>(a.m_in, i)), __fmul_rn(c.omb1, g));
    const float v =
        __fadd_rn(__fmul_rn(c.beta2, LoadMoment<M>(a.v_in, i)), __fmul_rn(c.omb2, __fmul_rn(g, g)));
    float d = v;  // What the denominator takes the root of.
    if (a.x_in != nullptr) {
      const float x = LoadMoment<M>(a.x_in, i);
      if (c.amsgrad) {
        d = (v > x || v != v) ? v : x;  // A NaN on either side wins, as torch.maximum.
        StoreMoment<M>(a.x_out, i, d);
      } else {
        StoreMoment<M>(a.x_out, i, x);
      }
    }
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(d), c.bc2_sqrt), c.eps);
    p = __fsub_rn(p, __fdiv_rn(__fmul_rn(c.step_size, m), denom));
    a.master_out[i] = p;
    StoreMoment<M>(a.m_out, i, m);
    StoreMoment<M>(a.v_out, i, v);
    StoreParam<P>(s.params, j, p);
  }
}

template <DType G>
__global__ void CountNonFiniteKernel(const void* grads, uint64_t n, float scale,
                                     unsigned long long* count) {
  unsigned long long local = 0;
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    if (!isfinite(__fmul_rn(LoadGrad<G>(grads, i), scale))) ++local;
  }
  if (local > 0) atomicAdd(count, local);
}

template <DType P>
__global__ void RoundMastersKernel(const float* master, void* params, uint64_t n) {
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    StoreParam<P>(params, i, master[i]);
  }
}

constexpr int kThreads = 256;

unsigned Blocks(uint64_t n) {
  const uint64_t want = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(want < 4096 ? (want == 0 ? 1 : want) : 4096);
}

template <DType G, DType P>
cudaError_t LaunchForMoments(const DeviceUnitArgs& a, DType m, cudaStream_t s) {
  if (a.segments < 1 || a.segments > kMaxSegments) return cudaErrorInvalidValue;
  uint64_t longest = 0;
  for (int k = 0; k < a.segments; ++k) longest = longest > a.segment[k].n ? longest : a.segment[k].n;
  const dim3 grid(Blocks(longest), static_cast<unsigned>(a.segments));
  if (m == DType::kF32) {
    AdamwUnitKernel<G, P, DType::kF32><<<grid, kThreads, 0, s>>>(a);
  } else {
    AdamwUnitKernel<G, P, DType::kBF16><<<grid, kThreads, 0, s>>>(a);
  }
  return cudaGetLastError();
}

template <DType G>
cudaError_t LaunchForParam(const DeviceUnitArgs& a, DType p, DType m, cudaStream_t s) {
  switch (p) {
    case DType::kF32:
      return LaunchForMoments<G, DType::kF32>(a, m, s);
    case DType::kBF16:
      return LaunchForMoments<G, DType::kBF16>(a, m, s);
    case DType::kF16:
      return LaunchForMoments<G, DType::kF16>(a, m, s);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t LaunchAdamwUnit(const DeviceUnitArgs& a, DType grad, DType param, DType moments,
                            cudaStream_t stream) {
  switch (grad) {
    case DType::kF32:
      return LaunchForParam<DType::kF32>(a, param, moments, stream);
    case DType::kBF16:
      return LaunchForParam<DType::kBF16>(a, param, moments, stream);
    case DType::kF16:
      return LaunchForParam<DType::kF16>(a, param, moments, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

cudaError_t LaunchCountNonFinite(const void* grads, DType grad, uint64_t n, float scale,
                                 unsigned long long* count, cudaStream_t stream) {
  switch (grad) {
    case DType::kF32:
      CountNonFiniteKernel<DType::kF32><<<Blocks(n), kThreads, 0, stream>>>(grads, n, scale, count);
      break;
    case DType::kBF16:
      CountNonFiniteKernel<DType::kBF16>
          <<<Blocks(n), kThreads, 0, stream>>>(grads, n, scale, count);
      break;
    case DType::kF16:
      CountNonFiniteKernel<DType::kF16><<<Blocks(n), kThreads, 0, stream>>>(grads, n, scale, count);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t LaunchRoundMasters(const float* master, void* params, DType param, uint64_t n,
                               cudaStream_t stream) {
  switch (param) {
    case DType::kF32:
      RoundMastersKernel<DType::kF32><<<Blocks(n), kThreads, 0, stream>>>(master, params, n);
      break;
    case DType::kBF16:
      RoundMastersKernel<DType::kBF16><<<Blocks(n), kThreads, 0, stream>>>(master, params, n);
      break;
    case DType::kF16:
      RoundMastersKernel<DType::kF16><<<Blocks(n), kThreads, 0, stream>>>(master, params, n);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace ckpt::optimizer::internal
