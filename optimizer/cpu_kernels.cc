// Fused AdamW kernels. The float operations, in order, for every element:
//   g = grad * scale
//   p = p * decay
//   m = beta1 * m + omb1 * g
//   v = beta2 * v + omb2 * (g * g)
//   p = p - (step_size * m) / (sqrt(v) / bc2_sqrt + eps)
//   param = round_to_model_dtype(p)
// With AMSGrad (the kernels' template flag A) the running maximum x = max(x, v) (a NaN on
// either side wins, as torch.maximum) is stored, and sqrt(x) replaces sqrt(v).
// Compiled with -ffp-contract=off, so the scalar path never fuses into FMAs; the SIMD paths use
// separate mul/add intrinsics. Division and sqrt are correctly rounded everywhere, hence the
// paths agree bit for bit.
#include "optimizer/cpu_kernels.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>


namespace ckpt::optimizer::internal {
namespace {

using formats::DType;

template <DType G>
inline float LoadGrad(const void* p, size_t i) {
  if constexpr (G == DType::kF32) {
    return static_cast<const float*>(p)[i];
  } else if constexpr (G == DType::kBF16) {
    return Bf16ToFloat(static_cast<const uint16_t*>(p)[i]);
  } else {
    return HalfToFloat(static_cast<const uint16_t*>(p)[i]);
  }
}

template <DType P>
inline void StoreParam(void* p, size_t i, float v) {
  if constexpr (P == DType::kF32) {
    static_cast<float*>(p)[i] = v;
  } else if constexpr (P == DType::kBF16) {
    static_cast<uint16_t*>(p)[i] = FloatToBf16(v);
  } else {
    static_cast<uint16_t*>(p)[i] = FloatToHalf(v);
  }
}

// Software prefetch. The step is bound by how many cache-line misses a core keeps in flight, not
// by the memory channels (16 cores of the H200 host move 30 B x 5 Gparam/s = 150 GB/s, a fraction
// of the socket's bandwidth), and the hardware prefetchers restart at every 4 KiB page of each
// of the nine streams. So each read stream's line is asked for twice ahead: into L2 8 KiB ahead
// and into L1 2 KiB ahead (kPrefetchL2Bytes, kPrefetchL1Bytes in cpu_kernels.h). Lab kernel on the
// H200 host (16 threads, 1e9 parameters, FP32 gradients, three passes each, two sessions):
// none 4.30-4.67 Gparam/s; L1 1 KiB 4.84-4.99; L1 1 KiB + L2 4 KiB 4.83-5.30; L1 512 B + L2 2
// KiB 4.86-4.98; L1 2 KiB + L2 8 KiB 5.04-5.07 (best in every pass of its session); streaming
// stores for master and moments 4.45-4.54.

inline void PrefetchLine(const char* p) {
  _mm_prefetch(p + kPrefetchL2Bytes, _MM_HINT_T1);
  _mm_prefetch(p + kPrefetchL1Bytes, _MM_HINT_T0);
}

// Called once per 16 elements. A line of a 16-bit stream holds 32 elements: every other call
// names a new one.
// Bytes of one element of a stream the kernels read: FP32, or a 16-bit type (BF16, F16).
template <DType D>
constexpr size_t kStreamBytes = D == DType::kF32 ? 4 : 2;

template <DType G, DType M, bool A = false>
inline void PrefetchStreams(const KernelArgs& a, size_t i) {
  // The math kernels' `a` has its sources set (WithSources); the memory-only ones run in place.
  PrefetchLine(reinterpret_cast<const char*>((a.master_in ? a.master_in : a.master) + i));
  if (M == DType::kF32 || i % 32 == 0) {
    PrefetchLine(static_cast<const char*>(a.exp_avg_in ? a.exp_avg_in : a.exp_avg) +
                 i * kStreamBytes<M>);
    PrefetchLine(static_cast<const char*>(a.exp_avg_sq_in ? a.exp_avg_sq_in : a.exp_avg_sq) +
                 i * kStreamBytes<M>);
    if constexpr (A)
      PrefetchLine(static_cast<const char*>(a.max_exp_avg_sq_in) + i * kStreamBytes<M>);
  }
  if (G == DType::kF32 || i % 32 == 0) {
    PrefetchLine(static_cast<const char*>(a.grads) + i * kStreamBytes<G>);
  }
}

// Moments are FP32 or BF16 (M); a BF16 moment is read and written exactly as a BF16 gradient is
// read and a BF16 parameter written (round to nearest even). The update uses the FP32 values
// computed in this step; only what is stored is rounded.
template <DType G, DType P, DType M, bool A>
inline void ScalarRange(const KernelArgs& a, size_t begin, size_t end) {
  const StepConstants& c = a.c;
  for (size_t i = begin; i < end; ++i) {
    const float g = LoadGrad<G>(a.grads, i) * a.grad_scale;
    float p = a.master_in[i] * c.decay;
    const float m = c.beta1 * LoadGrad<M>(a.exp_avg_in, i) + c.omb1 * g;
    const float v = c.beta2 * LoadGrad<M>(a.exp_avg_sq_in, i) + c.omb2 * (g * g);
    float d = v;  // What the denominator takes the root of.
    if constexpr (A) {
      const float x = LoadGrad<M>(a.max_exp_avg_sq_in, i);
      d = (v > x || v != v) ? v : x;  // NOLINT: v != v is the NaN test.
      StoreParam<M>(a.max_exp_avg_sq, i, d);
    }
    p = p - (c.step_size * m) / (std::sqrt(d) / c.bc2_sqrt + c.eps);
    a.master[i] = p;
    StoreParam<M>(a.exp_avg, i, m);
    StoreParam<M>(a.exp_avg_sq, i, v);
    StoreParam<P>(a.params, i, p);
  }
}

template <DType G, DType P, DType M, bool A>
void ScalarKernel(const KernelArgs& args) {
  const KernelArgs a = WithSources(args);
  ScalarRange<G, P, M, A>(a, 0, a.n);
}

// The memory-only twin of ScalarRange (see Avx512Block).
template <DType G, DType P, DType M>
inline void ShapedScalarRange(const KernelArgs& a, size_t begin, size_t end) {
  for (size_t i = begin; i < end; ++i) {
    const float g = LoadGrad<G>(a.grads, i) * a.grad_scale;
    a.master[i] += g;
    StoreParam<M>(a.exp_avg, i, LoadGrad<M>(a.exp_avg, i) + g);
    StoreParam<M>(a.exp_avg_sq, i, LoadGrad<M>(a.exp_avg_sq, i) + g);
    StoreParam<P>(a.params, i, a.master[i]);
  }
}

template <DType G, DType P, DType M>
void ScalarShapedKernel(const KernelArgs& a) {
  ShapedScalarRange<G, P, M>(a, 0, a.n);
}

// --- AVX2 (+FMA-free arithmetic, F16C conversions) -------------------------------------------

template <DType G>
__attribute__((target("avx2,f16c"))) inline __m256 LoadGrad8(const void* p, size_t i) {
  if constexpr (G == DType::kF32) {
    return _mm256_loadu_ps(static_cast<const float*>(p) + i);
  } else if constexpr (G == DType::kBF16) {
    __m128i h =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else {
    __m128i h =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i));
    return _mm256_cvtph_ps(h);
  }
}

template <DType P>
__attribute__((target("avx2,f16c"))) inline void StoreParam8(void* p, size_t i, __m256 v) {
  if constexpr (P == DType::kF32) {
    _mm256_storeu_ps(static_cast<float*>(p) + i, v);
  } else if constexpr (P == DType::kBF16) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_srli_epi32(
        _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i nan = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
    const __m256 is_nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    rounded = _mm256_blendv_epi8(rounded, nan, _mm256_castps_si256(is_nan));
    // Pack the low halves of the eight 32-bit lanes.
    const __m128i lo = _mm256_castsi256_si128(rounded), hi = _mm256_extracti128_si256(rounded, 1);
    const __m128i packed = _mm_packus_epi32(_mm_and_si128(lo, _mm_set1_epi32(0xffff)),
                                            _mm_and_si128(hi, _mm_set1_epi32(0xffff)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(p) + i), packed);
  } else {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(p) + i),
                     _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}

template <DType G, DType P, DType M, bool kMath, bool A>
__attribute__((target("avx2,f16c"))) void Avx2Loop(const KernelArgs& args) {
  const KernelArgs a = WithSources(args);
  const StepConstants& c = a.c;
  const __m256 scale = _mm256_set1_ps(a.grad_scale), decay = _mm256_set1_ps(c.decay);
  const __m256 b1 = _mm256_set1_ps(c.beta1), b2 = _mm256_set1_ps(c.beta2);
  const __m256 omb1 = _mm256_set1_ps(c.omb1), omb2 = _mm256_set1_ps(c.omb2);
  const __m256 step = _mm256_set1_ps(c.step_size), bc2 = _mm256_set1_ps(c.bc2_sqrt),
               eps = _mm256_set1_ps(c.eps);
  size_t i = 0;
  for (; i + 8 <= a.n; i += 8) {
    if (i % 16 == 0) PrefetchStreams<G, M, A>(a, i);  // Once per 64-byte line of FP32 streams.
    const __m256 g = _mm256_mul_ps(LoadGrad8<G>(a.grads, i), scale);
    __m256 p, m, v;
    if constexpr (kMath) {
      p = _mm256_mul_ps(_mm256_loadu_ps(a.master_in + i), decay);
      m = _mm256_add_ps(_mm256_mul_ps(b1, LoadGrad8<M>(a.exp_avg_in, i)), _mm256_mul_ps(omb1, g));
      v = _mm256_add_ps(_mm256_mul_ps(b2, LoadGrad8<M>(a.exp_avg_sq_in, i)),
                        _mm256_mul_ps(omb2, _mm256_mul_ps(g, g)));
      __m256 d = v;
      if constexpr (A) {
        const __m256 x = LoadGrad8<M>(a.max_exp_avg_sq_in, i);
        const __m256 take_v =
            _mm256_or_ps(_mm256_cmp_ps(v, x, _CMP_GT_OQ), _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        d = _mm256_blendv_ps(x, v, take_v);
        StoreParam8<M>(a.max_exp_avg_sq, i, d);
      }
      const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(d), bc2), eps);
      p = _mm256_sub_ps(p, _mm256_div_ps(_mm256_mul_ps(step, m), denom));
    } else {
      p = _mm256_add_ps(_mm256_loadu_ps(a.master + i), g);
      m = _mm256_add_ps(LoadGrad8<M>(a.exp_avg, i), g);
      v = _mm256_add_ps(LoadGrad8<M>(a.exp_avg_sq, i), g);
    }
    _mm256_storeu_ps(a.master + i, p);
    StoreParam8<M>(a.exp_avg, i, m);
    StoreParam8<M>(a.exp_avg_sq, i, v);
    StoreParam8<P>(a.params, i, p);
  }
  if constexpr (kMath) {
    ScalarRange<G, P, M, A>(a, i, a.n);
  } else {
    ShapedScalarRange<G, P, M>(a, i, a.n);
  }
}

template <DType G, DType P, DType M, bool A>
void Avx2Kernel(const KernelArgs& a) {
  Avx2Loop<G, P, M, true, A>(a);
}

template <DType G, DType P, DType M>
void Avx2ShapedKernel(const KernelArgs& a) {
  Avx2Loop<G, P, M, false, false>(a);
}

// --- AVX-512 ---------------------------------------------------------------------------------

template <DType G>
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512 LoadGrad16(const void* p,
                                                                              size_t i) {
  if constexpr (G == DType::kF32) {
    return _mm512_loadu_ps(static_cast<const float*>(p) + i);
  } else if constexpr (G == DType::kBF16) {
    __m256i h =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(p) + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    __m256i h =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(p) + i));
    return _mm512_cvtph_ps(h);
  }
}

template <DType P, bool kStream>
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline void StoreParam16(void* p, size_t i,
                                                                              __m512 v) {
  if constexpr (P == DType::kF32) {
    if constexpr (kStream) {
      _mm512_stream_ps(static_cast<float*>(p) + i, v);
    } else {
      _mm512_storeu_ps(static_cast<float*>(p) + i, v);
    }
  } else if constexpr (P == DType::kBF16) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __m512i nan = _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
    const __mmask16 is_nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    rounded = _mm512_mask_blend_epi32(is_nan, rounded, nan);
    auto* dst = reinterpret_cast<__m256i*>(static_cast<uint16_t*>(p) + i);
    if constexpr (kStream) {
      _mm256_stream_si256(dst, _mm512_cvtepi32_epi16(rounded));
    } else {
      _mm256_storeu_si256(dst, _mm512_cvtepi32_epi16(rounded));
    }
  } else {
    auto* dst = reinterpret_cast<__m256i*>(static_cast<uint16_t*>(p) + i);
    const __m256i h = _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    if constexpr (kStream) {
      _mm256_stream_si256(dst, h);
    } else {
      _mm256_storeu_si256(dst, h);
    }
  }
}

// The vector constants of one step, built once per kernel call.
struct Avx512Constants {
  __m512 scale, decay, b1, b2, omb1, omb2, step, bc2, eps;
};

// One 16-element block. kMath false is the benchmark's memory-only twin: the same loads, stores
// and prefetches with one add per stream in place of the AdamW arithmetic.
template <DType G, DType P, DType M, bool kStream, bool kMath, bool A>
__attribute__((target("avx512f,avx512bw,avx512vl"), always_inline)) inline void Avx512Block(
    const KernelArgs& a, const Avx512Constants& k, size_t i) {
  const __m512 g = _mm512_mul_ps(LoadGrad16<G>(a.grads, i), k.scale);
  __m512 p, m, v;
  if constexpr (kMath) {
    p = _mm512_mul_ps(_mm512_loadu_ps(a.master_in + i), k.decay);
    m = _mm512_add_ps(_mm512_mul_ps(k.b1, LoadGrad16<M>(a.exp_avg_in, i)),
                      _mm512_mul_ps(k.omb1, g));
    v = _mm512_add_ps(_mm512_mul_ps(k.b2, LoadGrad16<M>(a.exp_avg_sq_in, i)),
                      _mm512_mul_ps(k.omb2, _mm512_mul_ps(g, g)));
    __m512 d = v;
    if constexpr (A) {
      const __m512 x = LoadGrad16<M>(a.max_exp_avg_sq_in, i);
      const __mmask16 take_v =
          _mm512_cmp_ps_mask(v, x, _CMP_GT_OQ) | _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      d = _mm512_mask_blend_ps(take_v, x, v);
      StoreParam16<M, false>(a.max_exp_avg_sq, i, d);
    }
    const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(d), k.bc2), k.eps);
    p = _mm512_sub_ps(p, _mm512_div_ps(_mm512_mul_ps(k.step, m), denom));
  } else {
    p = _mm512_add_ps(_mm512_loadu_ps(a.master + i), g);
    m = _mm512_add_ps(LoadGrad16<M>(a.exp_avg, i), g);
    v = _mm512_add_ps(LoadGrad16<M>(a.exp_avg_sq, i), g);
  }
  _mm512_storeu_ps(a.master + i, p);
  StoreParam16<M, false>(a.exp_avg, i, m);
  StoreParam16<M, false>(a.exp_avg_sq, i, v);
  StoreParam16<P, kStream>(a.params, i, p);
}

// The model-dtype copy is written and not read again by the step: with a suitably aligned
// destination it goes out with non-temporal stores, which skip the read-for-ownership of every
// destination line (2 of the 32 bytes a BF16 step moves per parameter). Two blocks per
// iteration, their prefetches first: +2-4 % on the H200 host (lab, 1e9 parameters, two passes).
template <DType G, DType P, DType M, bool kStream, bool kMath, bool A>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void Avx512Loop(const KernelArgs& args) {
  const KernelArgs a = WithSources(args);
  const StepConstants& c = a.c;
  const Avx512Constants k{
      _mm512_set1_ps(a.grad_scale), _mm512_set1_ps(c.decay),    _mm512_set1_ps(c.beta1),
      _mm512_set1_ps(c.beta2),      _mm512_set1_ps(c.omb1),     _mm512_set1_ps(c.omb2),
      _mm512_set1_ps(c.step_size),  _mm512_set1_ps(c.bc2_sqrt), _mm512_set1_ps(c.eps)};
  size_t i = 0;
  for (; i + 32 <= a.n; i += 32) {
    PrefetchStreams<G, M, A>(a, i);
    PrefetchStreams<G, M, A>(a, i + 16);
    Avx512Block<G, P, M, kStream, kMath, A>(a, k, i);
    Avx512Block<G, P, M, kStream, kMath, A>(a, k, i + 16);
  }
  if (i + 16 <= a.n) {
    Avx512Block<G, P, M, kStream, kMath, A>(a, k, i);
    i += 16;
  }
  if constexpr (kStream) _mm_sfence();  // Order the streaming stores before the step returns.
  if constexpr (kMath) {
    ScalarRange<G, P, M, A>(a, i, a.n);
  } else {
    ShapedScalarRange<G, P, M>(a, i, a.n);
  }
}

template <DType G, DType P, DType M, bool kMath, bool A>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void Avx512Dispatch(const KernelArgs& a) {
  // A 16-lane store of the copy is 64 (F32) or 32 bytes wide; streaming needs that alignment.
  const size_t width = P == DType::kF32 ? 64 : 32;
  if (reinterpret_cast<uintptr_t>(a.params) % width == 0) {
    Avx512Loop<G, P, M, true, kMath, A>(a);
  } else {
    Avx512Loop<G, P, M, false, kMath, A>(a);
  }
}

template <DType G, DType P, DType M, bool A>
void Avx512Kernel(const KernelArgs& a) {
  Avx512Dispatch<G, P, M, true, A>(a);
}

template <DType G, DType P, DType M>
void Avx512ShapedKernel(const KernelArgs& a) {
  Avx512Dispatch<G, P, M, false, false>(a);
}

// --- The check_finite pass -----------------------------------------------------------------
// An element is non-finite when all exponent bits of grad * scale are set (NaN or +-Inf), the
// test std::isfinite makes.

constexpr uint32_t kExponentBits = 0x7f800000u;

inline void NoteNonFinite(uint32_t mask, size_t i, NonFinite* r) {
  r->count += static_cast<uint64_t>(__builtin_popcount(mask));
  if (r->first == ~uint64_t{0}) r->first = i + static_cast<size_t>(__builtin_ctz(mask));
}

template <DType G>
void ScalarNonFiniteRange(const void* grads, size_t begin, size_t end, float scale, NonFinite* r) {
  for (size_t i = begin; i < end; ++i) {
    if (!std::isfinite(LoadGrad<G>(grads, i) * scale)) NoteNonFinite(1, i, r);
  }
}

template <DType G>
NonFinite ScalarNonFinite(const void* grads, size_t n, float scale) {
  NonFinite r;
  ScalarNonFiniteRange<G>(grads, 0, n, scale, &r);
  return r;
}

template <DType G>
__attribute__((target("avx2,f16c"))) NonFinite Avx2NonFinite(const void* grads, size_t n,
                                                             float scale) {
  NonFinite r;
  const __m256 vs = _mm256_set1_ps(scale);
  const __m256i exponent = _mm256_set1_epi32(static_cast<int>(kExponentBits));
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i bits = _mm256_castps_si256(_mm256_mul_ps(LoadGrad8<G>(grads, i), vs));
    const __m256i all_set = _mm256_cmpeq_epi32(_mm256_and_si256(bits, exponent), exponent);
    const uint32_t mask = static_cast<uint32_t>(_mm256_movemask_ps(_mm256_castsi256_ps(all_set)));
    if (mask != 0) NoteNonFinite(mask, i, &r);
  }
  ScalarNonFiniteRange<G>(grads, i, n, scale, &r);
  return r;
}

template <DType G>
__attribute__((target("avx512f,avx512bw,avx512vl"))) NonFinite Avx512NonFinite(const void* grads,
                                                                               size_t n,
                                                                               float scale) {
  NonFinite r;
  const __m512 vs = _mm512_set1_ps(scale);
  const __m512i exponent = _mm512_set1_epi32(static_cast<int>(kExponentBits));
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i bits = _mm512_castps_si512(_mm512_mul_ps(LoadGrad16<G>(grads, i), vs));
    const __mmask16 mask = _mm512_cmpeq_epi32_mask(_mm512_and_si512(bits, exponent), exponent);
    if (mask != 0) NoteNonFinite(mask, i, &r);
  }
  ScalarNonFiniteRange<G>(grads, i, n, scale, &r);
  return r;
}

int DTypeIndex(DType d) {
  return d == DType::kF32 ? 0 : d == DType::kBF16 ? 1 : d == DType::kF16 ? 2 : -1;
}

// [grad][param] for one moment dtype, then [moments][grad][param].
#define CKPT_KERNEL_TABLE(KERNEL, M)                                                  \
  {                                                                                   \
    {KERNEL<DType::kF32, DType::kF32, M>, KERNEL<DType::kF32, DType::kBF16, M>,       \
     KERNEL<DType::kF32, DType::kF16, M>},                                            \
        {KERNEL<DType::kBF16, DType::kF32, M>, KERNEL<DType::kBF16, DType::kBF16, M>, \
         KERNEL<DType::kBF16, DType::kF16, M>},                                       \
        {KERNEL<DType::kF16, DType::kF32, M>, KERNEL<DType::kF16, DType::kBF16, M>,   \
         KERNEL<DType::kF16, DType::kF16, M>},                                        \
  }
#define CKPT_KERNEL_TABLES(KERNEL) \
  { CKPT_KERNEL_TABLE(KERNEL, DType::kF32), CKPT_KERNEL_TABLE(KERNEL, DType::kBF16) }

// The update kernels with AMSGrad off or on, as the table macros take a three-argument kernel.
template <DType G, DType P, DType M>
constexpr KernelFn kScalarPlain = ScalarKernel<G, P, M, false>;
template <DType G, DType P, DType M>
constexpr KernelFn kScalarAms = ScalarKernel<G, P, M, true>;
template <DType G, DType P, DType M>
constexpr KernelFn kAvx2Plain = Avx2Kernel<G, P, M, false>;
template <DType G, DType P, DType M>
constexpr KernelFn kAvx2Ams = Avx2Kernel<G, P, M, true>;
template <DType G, DType P, DType M>
constexpr KernelFn kAvx512Plain = Avx512Kernel<G, P, M, false>;
template <DType G, DType P, DType M>
constexpr KernelFn kAvx512Ams = Avx512Kernel<G, P, M, true>;

using KernelTable = KernelFn[2][3][3];
// [amsgrad][moments][grad][param].
constexpr KernelTable kScalar[2] = {CKPT_KERNEL_TABLES(kScalarPlain),
                                    CKPT_KERNEL_TABLES(kScalarAms)};
constexpr KernelTable kAvx2[2] = {CKPT_KERNEL_TABLES(kAvx2Plain), CKPT_KERNEL_TABLES(kAvx2Ams)};
constexpr KernelTable kAvx512[2] = {CKPT_KERNEL_TABLES(kAvx512Plain),
                                    CKPT_KERNEL_TABLES(kAvx512Ams)};
constexpr KernelTable kScalarShaped = CKPT_KERNEL_TABLES(ScalarShapedKernel);
constexpr KernelTable kAvx2Shaped = CKPT_KERNEL_TABLES(Avx2ShapedKernel);
constexpr KernelTable kAvx512Shaped = CKPT_KERNEL_TABLES(Avx512ShapedKernel);

}  // namespace

namespace {

KernelFn Select(const KernelTable& scalar, const KernelTable& avx2, const KernelTable& avx512,
                CpuIsa isa, DType grad, DType param, MomentDType moments) {
  const int g = DTypeIndex(grad), p = DTypeIndex(param);
  if (g < 0 || p < 0) return nullptr;
  const int m = moments == MomentDType::kF32 ? 0 : 1;
  switch (ResolveIsa(isa)) {
    case CpuIsa::kAvx512:
      return avx512[m][g][p];
    case CpuIsa::kAvx2:
      return avx2[m][g][p];
    default:
      return scalar[m][g][p];
  }
}

}  // namespace

KernelArgs WithSources(const KernelArgs& a) {
  KernelArgs r = a;
  if (r.master_in == nullptr) r.master_in = r.master;
  if (r.exp_avg_in == nullptr) r.exp_avg_in = r.exp_avg;
  if (r.exp_avg_sq_in == nullptr) r.exp_avg_sq_in = r.exp_avg_sq;
  if (r.max_exp_avg_sq_in == nullptr) r.max_exp_avg_sq_in = r.max_exp_avg_sq;
  return r;
}

KernelFn SelectKernel(CpuIsa isa, DType grad, DType param, MomentDType moments, bool amsgrad) {
  const int a = amsgrad ? 1 : 0;
  return Select(kScalar[a], kAvx2[a], kAvx512[a], isa, grad, param, moments);
}

KernelFn SelectShapedKernel(CpuIsa isa, DType grad, DType param, MomentDType moments) {
  return Select(kScalarShaped, kAvx2Shaped, kAvx512Shaped, isa, grad, param, moments);
}

NonFiniteFn SelectNonFiniteKernel(CpuIsa isa, DType grad) {
  constexpr NonFiniteFn kScalarCheck[3] = {
      ScalarNonFinite<DType::kF32>, ScalarNonFinite<DType::kBF16>, ScalarNonFinite<DType::kF16>};
  constexpr NonFiniteFn kAvx2Check[3] = {Avx2NonFinite<DType::kF32>, Avx2NonFinite<DType::kBF16>,
                                         Avx2NonFinite<DType::kF16>};
  constexpr NonFiniteFn kAvx512Check[3] = {
      Avx512NonFinite<DType::kF32>, Avx512NonFinite<DType::kBF16>, Avx512NonFinite<DType::kF16>};
  const int g = DTypeIndex(grad);
  if (g < 0) return nullptr;
  switch (ResolveIsa(isa)) {
    case CpuIsa::kAvx512:
      return kAvx512Check[g];
    case CpuIsa::kAvx2:
      return kAvx2Check[g];
    default:
      return kScalarCheck[g];
  }
}

}  // namespace ckpt::optimizer::internal
