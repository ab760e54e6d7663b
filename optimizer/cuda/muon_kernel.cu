// Muon's step of one whole matrix on the GPU (muon_kernel.h), the CPU's passes (optimizer/muon.cc)
// in the same order:
// 1. MomentumKernel: buf = lerp(buf, g, 1 - momentum), kept in the momentum (rounded when the
//    slab is BF16); u = nesterov ? lerp(g, buf, momentum) : buf; X = bf16(u), transposed when
//    the matrix has more rows than columns (X is m x n, m <= n); each block's sum of X's squares
//    in double.
// 2. NormKernel: the partial sums added in a fixed tree; norm = max(bf16(sqrt(sum)), bf16(eps)).
// 3. ScaleKernel: X = bf16(X / norm).
// 4. ns_steps times: G = bf16(X X^T); H = bf16(c G G + b G); X' = bf16(H X + a X).
// 5. UpdateKernel: master = fma(O, -lr', master * (1 - lr wd)) with O = X (transposed back), and
//    the weights = the masters rounded.
// The products (GemmBf16Kernel) run on tensor cores (WMMA, BF16 in, FP32 accumulation): tiles of
// 128 x 128 per block of 8 warps, 32 of k at a time through shared memory in two stages (the next
// tile's asynchronous copies fly while this one's products run), each warp 64 x 32 of the result,
// zero-padded at the edges so that any shape works. A product with too few tiles for the GPU and
// a long k (X X^T of a matrix with a short side) splits k into slices whose FP32 sums are added
// in order. Every sum runs in a fixed order: a step is the same from run to run.
// The elementwise passes use explicit roundings (__fmul_rn, __fmaf_rn) as the CPU's code does;
// the library is compiled with --fmad=false.
#include <mma.h>

#include <algorithm>
#include <type_traits>

#include "optimizer/cuda/device_elements.cuh"
#include "optimizer/cuda/muon_kernel.h"

namespace ckpt::optimizer::internal {
namespace {

using DType = KernelType;
using device::Bf16Bits;
using device::LoadGrad;
using device::LoadMoment;
using device::StoreMoment;
using device::StoreParam;
using device::ToBf16;
namespace wmma = nvcuda::wmma;

// ---- The BF16 product.

// Each block: kBm x kBn of the result, kBk of k at a time, 8 warps of 64 x 32 each.
constexpr int kBm = 128, kBn = 128, kBk = 32, kPad = 8, kGemmThreads = 256;
constexpr int kLdA = kBk + kPad;               // Shared rows padded against bank conflicts.
constexpr int kTileElems = kBm * kLdA;          // A's tile; B's (either layout) fits in as many.
static_assert(kBk * (kBn + kPad) <= kTileElems, "B's row-major tile must fit");
constexpr int kMaxSplit = 8;  // Slices of k for products with too few tiles to fill the GPU.

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
// 16 bytes global -> shared without the registers (sm_80's cp.async), completed by CpWait.
__device__ __forceinline__ void CpAsync16(void* shared, const void* global) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(shared));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(global));
}
__device__ __forceinline__ void CpCommit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void CpWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Rows [r0, r0 + Rows) x columns [c0, c0 + Cols) of the row-major rows x cols matrix `g`
// (leading dimension ld) into shared `s` (leading dimension lds), zeros outside the matrix.
// `vec`: 16-byte copies are aligned (ld a multiple of 8, base aligned); those go asynchronously.
template <int Rows, int Cols>
__device__ __forceinline__ void LoadTile(const uint16_t* g, int rows, int cols, int ld, int r0,
                                         int c0, bool vec, uint16_t* s, int lds) {
  constexpr int kPerRow = Cols / 8;
  for (int v = threadIdx.x; v < Rows * kPerRow; v += kGemmThreads) {
    const int r = v / kPerRow, c = (v % kPerRow) * 8;
    const int gr = r0 + r, gc = c0 + c;
    uint16_t* dst = s + r * lds + c;
    if (vec && gr < rows && gc + 8 <= cols) {
      CpAsync16(dst, g + static_cast<size_t>(gr) * ld + gc);
    } else {
      for (int e = 0; e < 8; ++e) {
        dst[e] = (gr < rows && gc + e < cols) ? g[static_cast<size_t>(gr) * ld + gc + e]
                                              : static_cast<uint16_t>(0);
      }
    }
  }
}
#endif

// C = bf16(alpha A op(B) + beta D) over k in [k_begin, k_end) of tiles. With `partial` set, the
// block writes its FP32 sums there instead (slice blockIdx.z of a split k, at partial +
// z * m * n), and ReduceSlices finishes them.
template <bool kTransB>
__global__ void __launch_bounds__(kGemmThreads)
    GemmBf16Kernel(const uint16_t* a, const uint16_t* b, const uint16_t* d, uint16_t* c, int m,
                   int n, int k, float alpha, float beta, bool vec_a, bool vec_b, int k_per_slice,
                   float* partial) {
  // BF16 tensor cores need compute capability 8.0: the engine refuses older devices before any
  // launch (GpuSupportsMuon), and their code (a build for 7.5) has an empty kernel.
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  constexpr int kBCols = kTransB ? kBk : kBn;  // B's tile as stored: n x k, or k x n.
  constexpr int kLdB = kBCols + kPad;
  // Two stages of A's and B's tiles: the next k's copies fly while this one's products run.
  // After the loop the same memory holds each warp's 16 x 16 FP32 piece of the epilogue.
  __shared__ __align__(128) uint16_t tiles[2][2][kTileElems];
  using BLayout = std::conditional_t<kTransB, wmma::col_major, wmma::row_major>;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wr = warp / 4, wc = warp % 4;  // 2 x 4 warps, each 64 x 32 of C.
  const int row0 = blockIdx.y * kBm, col0 = blockIdx.x * kBn;
  const int k_begin = static_cast<int>(blockIdx.z) * k_per_slice;  // Below k: no overflow.
  const int k_end = static_cast<int>(
      min(static_cast<long long>(k), static_cast<long long>(k_begin) + k_per_slice));
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[4][2];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[i][j], 0.0f);
  auto load = [&](int stage, int k0) {
    LoadTile<kBm, kBk>(a, m, k, k, row0, k0, vec_a, tiles[stage][0], kLdA);
    if constexpr (kTransB) {
      LoadTile<kBn, kBk>(b, n, k, k, col0, k0, vec_b, tiles[stage][1], kLdB);
    } else {
      LoadTile<kBk, kBn>(b, k, n, n, k0, col0, vec_b, tiles[stage][1], kLdB);
    }
    CpCommit();
  };
  if (k_begin < k_end) load(0, k_begin);
  int stage = 0;
  for (int k0 = k_begin; k0 < k_end; k0 += kBk, stage ^= 1) {
    if (k0 + kBk < k_end) {
      load(stage ^ 1, k0 + kBk);
      CpWait<1>();  // This stage's copies have landed; the next stage's may still fly.
    } else {
      CpWait<0>();
    }
    __syncthreads();
    const uint16_t* as = tiles[stage][0];
    const uint16_t* bs = tiles[stage][1];
#pragma unroll
    for (int kk = 0; kk < kBk; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa[4];
      wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, BLayout> fb[2];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        wmma::load_matrix_sync(
            fa[i], reinterpret_cast<const __nv_bfloat16*>(as + (wr * 64 + i * 16) * kLdA + kk),
            kLdA);
      }
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const uint16_t* p = kTransB ? bs + (wc * 32 + j * 16) * kLdB + kk
                                    : bs + kk * kLdB + wc * 32 + j * 16;
        wmma::load_matrix_sync(fb[j], reinterpret_cast<const __nv_bfloat16*>(p), kLdB);
      }
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
    }
    __syncthreads();  // Every warp is done with this stage before it is loaded again.
  }
  // Each warp writes its 16 x 16 pieces through its own FP32 tile, bounds checked.
  float* cs = reinterpret_cast<float*>(&tiles[0][0][0]) + warp * 256;
  float* out = partial == nullptr ? nullptr : partial + static_cast<size_t>(blockIdx.z) * m * n;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      wmma::store_matrix_sync(cs, acc[i][j], 16, wmma::mem_row_major);
      __syncwarp();
      for (int e = lane; e < 256; e += 32) {
        const int gr = row0 + wr * 64 + i * 16 + e / 16;
        const int gc = col0 + wc * 32 + j * 16 + e % 16;
        if (gr < m && gc < n) {
          const size_t at = static_cast<size_t>(gr) * n + gc;
          if (out != nullptr) {
            out[at] = cs[e];
            continue;
          }
          float v = __fmul_rn(alpha, cs[e]);
          if (d != nullptr) v = __fadd_rn(v, __fmul_rn(beta, Bf16Bits(d[at])));
          c[at] = ToBf16(v);
        }
      }
      __syncwarp();
    }
  }
#else
  __trap();  // Never launched on such a device (GpuSupportsMuon); loud if its code ever runs.
#endif
}

// A split k's slices added in order (slice 0 first), then the product's epilogue.
__global__ void ReduceSlices(const float* partial, int slices, const uint16_t* d, uint16_t* c,
                             uint64_t count, float alpha, float beta) {
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    float sum = partial[i];
    for (int s = 1; s < slices; ++s) sum = __fadd_rn(sum, partial[s * count + i]);
    float v = __fmul_rn(alpha, sum);
    if (d != nullptr) v = __fadd_rn(v, __fmul_rn(beta, Bf16Bits(d[i])));
    c[i] = ToBf16(v);
  }
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// ---- The elementwise passes.

constexpr int kThreads = 256;
constexpr int kNormBlocks = 512;  // Fixed: the norm's partial sums are added in a fixed order.

unsigned Blocks(uint64_t n) {
  const uint64_t want = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(want < 4096 ? (want == 0 ? 1 : want) : 4096);
}

// torch's lerp: self + w (end - self) for |w| < 0.5, else end - (end - self)(1 - w), one FMA each.
__device__ __forceinline__ float Lerp(float self, float end, float w) {
  const float diff = __fsub_rn(end, self);
  return fabsf(w) < 0.5f ? __fmaf_rn(w, diff, self) : __fmaf_rn(__fsub_rn(w, 1.0f), diff, end);
}

// Where element (r, c) of the rows x cols matrix sits in X (m x n, the transpose when rows > cols).
__device__ __forceinline__ uint64_t XIndex(uint64_t i, uint64_t rows, uint64_t cols) {
  if (rows <= cols) return i;
  const uint64_t r = i / cols, c = i % cols;
  return c * rows + r;
}

__device__ __forceinline__ double BlockSum(double v, double* shared) {
  shared[threadIdx.x] = v;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s /= 2) {
    if (threadIdx.x < s) shared[threadIdx.x] += shared[threadIdx.x + s];
    __syncthreads();
  }
  return shared[0];
}

template <DType G, DType M>
__global__ void __launch_bounds__(kThreads)
    MomentumKernel(MuonDeviceArgs a, uint16_t* x, double* partial) {
  __shared__ double sums[kThreads];
  const MuonKernelConstants k = a.k;
  const uint64_t total = a.rows * a.cols;
  double sq = 0;
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    const float g = __fmul_rn(LoadGrad<G>(a.grads, i), a.grad_scale);
    const float buf = Lerp(LoadMoment<M>(a.momentum_in, i), g, k.lerp_weight);
    StoreMoment<M>(a.momentum_out, i, buf);
    const uint16_t h = ToBf16(k.nesterov ? Lerp(g, buf, k.nesterov_weight) : buf);
    x[XIndex(i, a.rows, a.cols)] = h;
    const double v = Bf16Bits(h);
    sq += v * v;
  }
  const double s = BlockSum(sq, sums);
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

__global__ void __launch_bounds__(kNormBlocks)
    NormKernel(const double* partial, float eps, float* norm) {
  __shared__ double sums[kNormBlocks];
  const double s = BlockSum(partial[threadIdx.x], sums);
  if (threadIdx.x == 0) {
    const float rounded = Bf16Bits(ToBf16(__double2float_rn(sqrt(s))));
    const float floor = Bf16Bits(ToBf16(eps));
    *norm = rounded < floor ? floor : rounded;  // std::max(|X|, eps), as the CPU: NaN stays.
  }
}

__global__ void ScaleKernel(uint16_t* x, uint64_t n, const float* norm) {
  const float by = *norm;
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    x[i] = ToBf16(__fdiv_rn(Bf16Bits(x[i]), by));
  }
}

template <DType P>
__global__ void UpdateKernel(MuonDeviceArgs a, const uint16_t* o) {
  const uint64_t total = a.rows * a.cols;
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    const float u = Bf16Bits(o[XIndex(i, a.rows, a.cols)]);
    const float p = __fmaf_rn(u, a.k.neg_lr, __fmul_rn(a.master_in[i], a.k.decay));
    a.master_out[i] = p;
    StoreParam<P>(a.params, i, p);
  }
}

// Where each part of the scratch starts.
struct ScratchLayout {
  size_t x, y, gram, poly, partial, norm, split, total;
  size_t split_floats;  // The split products' FP32 slices (the m x m ones).
};

size_t Align256(size_t v) { return (v + 255) / 256 * 256; }

// `own_kernel`: ckpt's kernel runs the products (room for its split slices).
ScratchLayout Layout(uint64_t rows, uint64_t cols, bool own_kernel) {
  const uint64_t m = rows < cols ? rows : cols;
  const uint64_t n = rows < cols ? cols : rows;
  ScratchLayout l;
  l.x = 0;
  l.y = l.x + Align256(m * n * 2);
  l.gram = l.y + Align256(m * n * 2);
  l.poly = l.gram + Align256(m * m * 2);
  l.partial = l.poly + Align256(m * m * 2);
  l.norm = l.partial + Align256(kNormBlocks * sizeof(double));
  l.split = l.norm + 256;
  // Only the m x m products can have too few tiles for the GPU (with m <= n, X's product has as
  // many tiles as H X's m x n), and only when m is small: kMaxSplit slices of them, at most
  // 16 MiB per slice's worth.
  const uint64_t mm = m * m;
  l.split_floats = own_kernel && mm <= (uint64_t{4} << 20) ? kMaxSplit * mm : 0;
  l.total = l.split + Align256(l.split_floats * sizeof(float));
  return l;
}

// The ns_steps iterations on the X in the scratch; *result: where the last X is (the scratch's x
// or y).
cudaError_t Iterate(const ScratchLayout& l, std::byte* base, int m, int n,
                    const MuonKernelConstants& k, const GemmBackend& products, cudaStream_t s,
                    uint16_t** result) {
  auto* x = reinterpret_cast<uint16_t*>(base + l.x);
  auto* y = reinterpret_cast<uint16_t*>(base + l.y);
  auto* gram = reinterpret_cast<uint16_t*>(base + l.gram);
  auto* poly = reinterpret_cast<uint16_t*>(base + l.poly);
  auto* split = reinterpret_cast<float*>(base + l.split);
  auto gemm = [&](const uint16_t* pa, const uint16_t* pb, bool trans_b, const uint16_t* d,
                  uint16_t* c, int pm, int pn, int pk, float alpha, float beta) {
    if (products.gemm != nullptr)
      return products.gemm(products.ctx, pa, pb, trans_b, d, c, pm, pn, pk, alpha, beta, s);
    return LaunchGemmBf16(pa, pb, trans_b, d, c, pm, pn, pk, alpha, beta, split, l.split_floats,
                          s);
  };
  cudaError_t e;
  for (unsigned step = 0; step < k.ns_steps; ++step) {
    // G = X X^T; H = c G G + b G; X' = H X + a X.
    if ((e = gemm(x, x, /*trans_b=*/true, nullptr, gram, m, m, n, 1.0f, 0.0f)) != cudaSuccess)
      return e;
    if ((e = gemm(gram, gram, false, gram, poly, m, m, m, k.c, k.b)) != cudaSuccess) return e;
    if ((e = gemm(poly, x, false, x, y, m, n, m, 1.0f, k.a)) != cudaSuccess) return e;
    uint16_t* t = x;
    x = y;
    y = t;
  }
  *result = x;
  return cudaSuccess;
}

template <DType G, DType M>
cudaError_t LaunchMomentum(const MuonDeviceArgs& a, uint16_t* x, double* partial,
                           cudaStream_t s) {
  MomentumKernel<G, M><<<kNormBlocks, kThreads, 0, s>>>(a, x, partial);
  return cudaGetLastError();
}

template <DType G>
cudaError_t LaunchMomentumFor(const MuonDeviceArgs& a, DType moments, uint16_t* x,
                              double* partial, cudaStream_t s) {
  return moments == DType::kF32 ? LaunchMomentum<G, DType::kF32>(a, x, partial, s)
                                : LaunchMomentum<G, DType::kBF16>(a, x, partial, s);
}

template <DType P>
cudaError_t LaunchUpdate(const MuonDeviceArgs& a, const uint16_t* o, cudaStream_t s) {
  UpdateKernel<P><<<Blocks(a.rows * a.cols), kThreads, 0, s>>>(a, o);
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchGemmBf16(const uint16_t* a, const uint16_t* b, bool trans_b, const uint16_t* d,
                           uint16_t* c, int m, int n, int k, float alpha, float beta,
                           float* workspace, size_t workspace_floats, cudaStream_t stream) {
  if (m < 1 || n < 1 || k < 1 || d == c) return cudaErrorInvalidValue;
  dim3 grid((n + kBn - 1) / kBn, (m + kBm - 1) / kBm, 1);
  if (grid.y > 65535) return cudaErrorInvalidValue;
  // Too few tiles to fill the GPU and a long k: k in slices of whole kBk steps, each slice's
  // FP32 sums in the workspace, added in order by ReduceSlices.
  int sms = 0, device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (e != cudaSuccess) return e;
  // In 64 bits: k may come close to 2^31.
  const int64_t tiles = static_cast<int64_t>(grid.x) * grid.y;
  const int64_t k_steps = (static_cast<int64_t>(k) + kBk - 1) / kBk;
  int64_t slices = 1;
  if (tiles < sms && k_steps >= 16) {
    slices = std::min<int64_t>({kMaxSplit, (2 * sms + tiles - 1) / tiles, k_steps / 8});
    const size_t need = static_cast<size_t>(slices) * static_cast<size_t>(m) * n;
    if (slices < 2 || workspace == nullptr || need > workspace_floats) slices = 1;
  }
  const int k_per_slice = static_cast<int>(
      std::min<int64_t>((k_steps + slices - 1) / slices * kBk, k));
  slices = (static_cast<int64_t>(k) + k_per_slice - 1) / k_per_slice;  // Every slice non-empty.
  grid.z = static_cast<unsigned>(slices);
  float* partial = slices > 1 ? workspace : nullptr;
  const bool vec_a = k % 8 == 0 && Aligned16(a);
  if (trans_b) {
    GemmBf16Kernel<true><<<grid, kGemmThreads, 0, stream>>>(
        a, b, d, c, m, n, k, alpha, beta, vec_a, k % 8 == 0 && Aligned16(b), k_per_slice, partial);
  } else {
    GemmBf16Kernel<false><<<grid, kGemmThreads, 0, stream>>>(
        a, b, d, c, m, n, k, alpha, beta, vec_a, n % 8 == 0 && Aligned16(b), k_per_slice, partial);
  }
  if ((e = cudaGetLastError()) != cudaSuccess || slices == 1) return e;
  const uint64_t count = static_cast<uint64_t>(m) * static_cast<uint64_t>(n);
  ReduceSlices<<<Blocks(count), kThreads, 0, stream>>>(partial, static_cast<int>(slices), d, c,
                                                       count, alpha, beta);
  return cudaGetLastError();
}

size_t MuonScratchBytes(uint64_t rows, uint64_t cols, bool own_kernel) {
  return Layout(rows, cols, own_kernel).total;
}

cudaError_t LaunchMuonProducts(void* scratch, uint64_t rows, uint64_t cols,
                               const MuonKernelConstants& k, const GemmBackend& products,
                               cudaStream_t stream) {
  if (rows == 0 || cols == 0 || rows >= (1ull << 31) || cols >= (1ull << 31))
    return cudaErrorInvalidValue;
  uint16_t* result = nullptr;
  return Iterate(Layout(rows, cols, products.gemm == nullptr), static_cast<std::byte*>(scratch),
                 static_cast<int>(std::min(rows, cols)), static_cast<int>(std::max(rows, cols)), k,
                 products, stream, &result);
}

cudaError_t GpuSupportsMuon(bool* supported) {
  int device = 0, major = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  *supported = e == cudaSuccess && major >= 8;
  return e;
}

cudaError_t LaunchMuonMatrix(const MuonDeviceArgs& a, DType grad, DType param, DType moments,
                             cudaStream_t s) {
  if (a.rows == 0 || a.cols == 0 || a.rows >= (1ull << 31) || a.cols >= (1ull << 31))
    return cudaErrorInvalidValue;
  const ScratchLayout l = Layout(a.rows, a.cols, a.products.gemm == nullptr);
  auto* base = static_cast<std::byte*>(a.scratch);
  auto* x = reinterpret_cast<uint16_t*>(base + l.x);
  auto* partial = reinterpret_cast<double*>(base + l.partial);
  auto* norm = reinterpret_cast<float*>(base + l.norm);
  const int m = static_cast<int>(a.rows < a.cols ? a.rows : a.cols);
  const int n = static_cast<int>(a.rows < a.cols ? a.cols : a.rows);
  const uint64_t mn = static_cast<uint64_t>(m) * static_cast<uint64_t>(n);
  // 1. Momentum and X.
  cudaError_t e;
  switch (grad) {
    case DType::kF32:
      e = LaunchMomentumFor<DType::kF32>(a, moments, x, partial, s);
      break;
    case DType::kBF16:
      e = LaunchMomentumFor<DType::kBF16>(a, moments, x, partial, s);
      break;
    case DType::kF16:
      e = LaunchMomentumFor<DType::kF16>(a, moments, x, partial, s);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  if (e != cudaSuccess) return e;
  if (a.momentum_written != nullptr && (e = cudaEventRecord(a.momentum_written, s)) != cudaSuccess)
    return e;
  // 2-3. X / max(|X|, eps).
  NormKernel<<<1, kNormBlocks, 0, s>>>(partial, a.k.eps, norm);
  if ((e = cudaGetLastError()) != cudaSuccess) return e;
  ScaleKernel<<<Blocks(mn), kThreads, 0, s>>>(x, mn, norm);
  if ((e = cudaGetLastError()) != cudaSuccess) return e;
  // 4. The iterations.
  if ((e = Iterate(l, base, m, n, a.k, a.products, s, &x)) != cudaSuccess) return e;
  // 5. The masters and the weights.
  if (a.master_ready != nullptr && (e = cudaStreamWaitEvent(s, a.master_ready, 0)) != cudaSuccess)
    return e;
  switch (param) {
    case DType::kF32:
      return LaunchUpdate<DType::kF32>(a, x, s);
    case DType::kBF16:
      return LaunchUpdate<DType::kBF16>(a, x, s);
    case DType::kF16:
      return LaunchUpdate<DType::kF16>(a, x, s);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace ckpt::optimizer::internal
