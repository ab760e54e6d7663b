#include "optimizer/bench/cpu_bounds.h"

#include <immintrin.h>

#include <algorithm>
#include <chrono>

#include "optimizer/cpu_kernels.h"
#include "optimizer/engine.h"
#include "optimizer/host_buffer.h"
#include "optimizer/thread_pool.h"

namespace ckpt::optimizer::internal {
namespace {

using Clock = std::chrono::steady_clock;

// Runs `pass` (which covers all `n` elements in tasks of TaskElems) `passes` times on `pool` and
// returns the shortest wall time in seconds.
template <typename Fn>
double BestSeconds(ThreadPool& pool, uint64_t n, int passes, Fn task) {
  const uint64_t per = TaskElems(n, pool.size());
  const size_t tasks = static_cast<size_t>((n + per - 1) / per);
  double best = 1e30;
  for (int p = 0; p < std::max(passes, 1); ++p) {
    const Clock::time_point start = Clock::now();
    pool.ParallelFor(tasks, [&](size_t i) {
      const uint64_t begin = i * per;
      task(begin, std::min(per, n - begin));
    });
    best = std::min(best, std::chrono::duration<double>(Clock::now() - start).count());
  }
  return best;
}

}  // namespace

namespace {

void TriadScalar(float* a, const float* b, const float* c, float s, size_t begin, size_t end) {
  for (size_t i = begin; i < end; ++i) a[i] = b[i] + s * c[i];
}

// Scalar up to the first `align`-byte boundary of `a`, so the vector loop can stream.
size_t TriadHead(float* a, const float* b, const float* c, float s, size_t n, size_t align) {
  const size_t mis = reinterpret_cast<uintptr_t>(a) % align;
  if (mis % sizeof(float) != 0) return n;  // Cannot ever align: all scalar.
  const size_t head = std::min(n, mis == 0 ? 0 : (align - mis) / sizeof(float));
  TriadScalar(a, b, c, s, 0, head);
  return head;
}

template <bool kStream>
__attribute__((target("avx512f"))) void TriadAvx512(float* a, const float* b, const float* c,
                                                    float s, size_t n) {
  size_t i = kStream ? TriadHead(a, b, c, s, n, 64) : 0;
  const __m512 vs = _mm512_set1_ps(s);
  for (; i + 16 <= n; i += 16) {
    for (const float* p : {b + i, c + i}) {
      _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchL2Bytes, _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchL1Bytes, _MM_HINT_T0);
    }
    const __m512 r =
        _mm512_add_ps(_mm512_loadu_ps(b + i), _mm512_mul_ps(vs, _mm512_loadu_ps(c + i)));
    if constexpr (kStream) {
      _mm512_stream_ps(a + i, r);
    } else {
      _mm512_storeu_ps(a + i, r);
    }
  }
  if constexpr (kStream) _mm_sfence();
  TriadScalar(a, b, c, s, i, n);
}

template <bool kStream>
__attribute__((target("avx2"))) void TriadAvx2(float* a, const float* b, const float* c, float s,
                                               size_t n) {
  size_t i = kStream ? TriadHead(a, b, c, s, n, 32) : 0;
  const __m256 vs = _mm256_set1_ps(s);
  for (; i + 8 <= n; i += 8) {
    if (i % 16 == 0) {
      for (const float* p : {b + i, c + i}) {
        _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchL2Bytes, _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchL1Bytes, _MM_HINT_T0);
      }
    }
    const __m256 r =
        _mm256_add_ps(_mm256_loadu_ps(b + i), _mm256_mul_ps(vs, _mm256_loadu_ps(c + i)));
    if constexpr (kStream) {
      _mm256_stream_ps(a + i, r);
    } else {
      _mm256_storeu_ps(a + i, r);
    }
  }
  if constexpr (kStream) _mm_sfence();
  TriadScalar(a, b, c, s, i, n);
}

}  // namespace

void TriadKernel(CpuIsa isa, bool streaming, float* a, const float* b, const float* c, float s,
                 size_t n) {
  switch (ResolveIsa(isa)) {
    case CpuIsa::kAvx512:
      return streaming ? TriadAvx512<true>(a, b, c, s, n) : TriadAvx512<false>(a, b, c, s, n);
    case CpuIsa::kAvx2:
      return streaming ? TriadAvx2<true>(a, b, c, s, n) : TriadAvx2<false>(a, b, c, s, n);
    default:
      return TriadScalar(a, b, c, s, 0, n);
  }
}

absl::StatusOr<double> MeasureTriadGBps(uint64_t n, int threads, CpuIsa isa, int passes) {
  if (n == 0) return absl::InvalidArgumentError("triad over zero elements");
  if (!CpuSupports(isa)) return absl::FailedPreconditionError("this CPU lacks the requested ISA");
  absl::StatusOr<HostBuffer> a = HostBuffer::Create(n * 4, 0, /*pinned=*/false);
  if (!a.ok()) return a.status();
  absl::StatusOr<HostBuffer> b = HostBuffer::Create(n * 4, kSlabStagger, false);
  if (!b.ok()) return b.status();
  absl::StatusOr<HostBuffer> c = HostBuffer::Create(n * 4, 2 * kSlabStagger, false);
  if (!c.ok()) return c.status();
  auto* pa = reinterpret_cast<float*>(a->data());
  auto* pb = reinterpret_cast<float*>(b->data());
  auto* pc = reinterpret_cast<float*>(c->data());
  ThreadPool pool(threads);
  // First touch on the pool's threads, as the slabs' pages are touched by the first step.
  BestSeconds(pool, n, 1, [&](uint64_t begin, uint64_t count) {
    std::fill_n(pb + begin, count, 1.0f);
    std::fill_n(pc + begin, count, 2.0f);
    std::fill_n(pa + begin, count, 0.0f);
  });
  // Streaming stores move 12 bytes per element, plain stores 16 (the destination line is read
  // before it is written). Which moves more per second depends on the machine: take the better.
  double best_gbps = 0;
  for (const bool streaming : {true, false}) {
    const double seconds = BestSeconds(pool, n, passes, [&](uint64_t begin, uint64_t count) {
      TriadKernel(isa, streaming, pa + begin, pb + begin, pc + begin, 3.0f, count);
    });
    if (pa[n / 2] != 7.0f) return absl::InternalError("triad computed a wrong value");
    best_gbps =
        std::max(best_gbps, (streaming ? 12.0 : 16.0) * static_cast<double>(n) / seconds / 1e9);
  }
  return best_gbps;
}

absl::StatusOr<double> MeasureShapedGparams(const void* grads, formats::DType grad_dtype,
                                            void* params, uint64_t n, int threads, CpuIsa isa,
                                            int passes, MomentDType moments) {
  if (n == 0) return absl::InvalidArgumentError("shaped pass over zero elements");
  KernelFn kernel = SelectShapedKernel(isa, grad_dtype, formats::DType::kBF16, moments);
  if (kernel == nullptr) return absl::InvalidArgumentError("unsupported gradient dtype");
  if (!CpuSupports(isa)) return absl::FailedPreconditionError("this CPU lacks the requested ISA");
  const size_t msize = MomentBytes(moments);
  HostBuffer slabs[3];
  for (int s = 0; s < 3; ++s) {
    absl::StatusOr<HostBuffer> b =
        HostBuffer::Create(n * (s == 0 ? 4 : msize), s * kSlabStagger, false);
    if (!b.ok()) return b.status();
    slabs[s] = std::move(*b);
  }
  auto* master = reinterpret_cast<float*>(slabs[0].data());
  std::byte* m = slabs[1].data();
  std::byte* v = slabs[2].data();
  const size_t gsize = formats::DTypeSize(grad_dtype);
  ThreadPool pool(threads);
  auto run = [&](uint64_t begin, uint64_t count) {
    KernelArgs a{master + begin,
                 m + begin * msize,
                 v + begin * msize,
                 nullptr,
                 static_cast<const std::byte*>(grads) + begin * gsize,
                 static_cast<std::byte*>(params) + begin * 2,
                 count,
                 1.0f,
                 StepConstants{}};
    kernel(a);
  };
  BestSeconds(pool, n, 1, run);  // Touches the slabs' pages, as a first step does.
  return static_cast<double>(n) / BestSeconds(pool, n, passes, run) / 1e9;
}

}  // namespace ckpt::optimizer::internal
