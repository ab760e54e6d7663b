// Muon on the CPU (optimizer/rules/muon/muon.h).
#include "optimizer/rules/muon/muon.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <span>

#include "ckpt/formats/convert.h"
#include "ckpt/formats/float_convert.h"
#include "optimizer/rules/torch_math.h"

namespace ckpt::optimizer::internal {
namespace {

using formats::RoundAllToBf16;
using formats::RoundToBf16;

float Lerp(float self, float end, float w) { return TorchLerp(self, end, w); }

// Elements per chunk of an elementwise pass.
constexpr size_t kChunk = size_t{1} << 15;

// fn(begin, end) over [0, total) in chunks of `chunk`, on the caller's threads.
void ForChunks(const ParallelFor& parallel, size_t total, size_t chunk,
               const std::function<void(size_t, size_t)>& fn) {
  const size_t chunks = (total + chunk - 1) / chunk;
  auto one = [&](size_t c) { fn(c * chunk, std::min(total, (c + 1) * chunk)); };
  if (parallel == nullptr || chunks <= 1) {
    for (size_t c = 0; c < chunks; ++c) one(c);
    return;
  }
  parallel(chunks, one);
}

// Copies the rows x cols `from` into `to` (rounded to BF16 when `round`), transposed when asked,
// in chunks of rows.
void CopyMatrix(const ParallelFor& parallel, const float* from, size_t rows, size_t cols,
                bool transpose, bool round, float* to) {
  ForChunks(parallel, rows, std::max<size_t>(1, kChunk / std::max<size_t>(1, cols)),
            [&](size_t r0, size_t r1) {
              for (size_t r = r0; r < r1; ++r) {
                for (size_t c = 0; c < cols; ++c) {
                  const float v = round ? RoundToBf16(from[r * cols + c]) : from[r * cols + c];
                  (transpose ? to[c * rows + r] : to[r * cols + c]) = v;
                }
              }
            });
}

float ReadElement(const std::byte* base, formats::DType dtype, size_t i) {
  switch (dtype) {
    case formats::DType::kF32: {
      float v;
      std::memcpy(&v, base + i * 4, 4);
      return v;
    }
    case formats::DType::kBF16: {
      uint16_t h;
      std::memcpy(&h, base + i * 2, 2);
      return formats::Bf16ToFloat(h);
    }
    default: {
      uint16_t h;
      std::memcpy(&h, base + i * 2, 2);
      return formats::HalfToFloat(h);
    }
  }
}

}  // namespace

MuonConstants ComputeMuonConstants(const ParamGroup& g) {
  MuonConstants k;
  k.lerp_weight = static_cast<float>(1.0 - g.muon.momentum);
  k.nesterov_weight = static_cast<float>(g.muon.momentum);
  k.nesterov = g.muon.nesterov;
  k.decay = static_cast<float>(1.0 - g.lr * g.weight_decay);
  k.lr = g.lr;
  k.adjust = g.muon.adjust_lr;
  k.a = static_cast<float>(g.muon.ns_a);
  k.b = static_cast<float>(g.muon.ns_b);
  k.c = static_cast<float>(g.muon.ns_c);
  k.eps = static_cast<float>(g.eps);
  k.ns_steps = g.muon.ns_steps;
  return k;
}

void NewtonSchulz(const float* u, uint64_t rows, uint64_t cols, const MuonConstants& k,
                  MuonScratch& s, float* out, const ParallelFor& parallel) {
  // X is m x n with m <= n: the matrix, or its transpose when it has more rows than columns.
  const bool transpose = rows > cols;
  const auto m = static_cast<int>(transpose ? cols : rows);
  const auto n = static_cast<int>(transpose ? rows : cols);
  const size_t mn = static_cast<size_t>(m) * static_cast<size_t>(n);
  const size_t mm = static_cast<size_t>(m) * static_cast<size_t>(m);
  s.x.resize(mn);
  s.y.resize(mn);
  s.gram.resize(mm);
  s.poly.resize(mm);
  float* x = s.x.data();
  float* y = s.y.data();
  CopyMatrix(parallel, u, rows, cols, transpose, /*round=*/true, x);
  // X / max(|X|_F, eps): torch's BF16 norm (accumulated wider, rounded to BF16), clamped, and a
  // BF16 division. The sum goes chunk by chunk, the chunks' in order.
  std::vector<double> partial((mn + kChunk - 1) / kChunk, 0.0);
  ForChunks(parallel, mn, kChunk, [&](size_t b, size_t e) {
    double sq = 0;
    for (size_t i = b; i < e; ++i) sq += static_cast<double>(x[i]) * x[i];
    partial[b / kChunk] = sq;
  });
  double sq = 0;
  for (double p : partial) sq += p;
  const float norm = std::max(RoundToBf16(static_cast<float>(std::sqrt(sq))), RoundToBf16(k.eps));
  ForChunks(parallel, mn, kChunk, [&](size_t b, size_t e) {
    for (size_t i = b; i < e; ++i) x[i] = RoundToBf16(x[i] / norm);
  });
  auto round_all = [&](float* v, size_t count) {
    ForChunks(parallel, count, kChunk, [&](size_t b, size_t e) { RoundAllToBf16(v + b, e - b); });
  };
  auto copy = [&](float* to, const float* from, size_t count) {
    ForChunks(parallel, count, kChunk,
              [&](size_t b, size_t e) { std::memcpy(to + b, from + b, (e - b) * 4); });
  };
  for (uint32_t step = 0; step < k.ns_steps; ++step) {
    float* gram = s.gram.data();
    float* poly = s.poly.data();
    // G = X X^T.
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, m, n, 1.0f, x, n, x, n, 0.0f, gram, m);
    round_all(gram, mm);
    // H = b G + c G G (torch.addmm(G, G, G, beta=b, alpha=c)).
    copy(poly, gram, mm);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, m, m, k.c, gram, m, gram, m, k.b,
                poly, m);
    round_all(poly, mm);
    // X = a X + H X (torch.addmm(X, H, X, beta=a)).
    copy(y, x, mn);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, n, m, 1.0f, poly, m, x, n, k.a, y,
                n);
    round_all(y, mn);
    std::swap(x, y);
  }
  // Back to rows x cols: X is m x n, the transpose of the result when it was transposed.
  CopyMatrix(parallel, x, static_cast<size_t>(m), static_cast<size_t>(n), transpose,
             /*round=*/false, out);
}

void MuonStepMatrix(const MuonMatrixArgs& a, const MuonConstants& k, MuonScratch& s,
                    const ParallelFor& parallel) {
  const size_t n = a.rows * a.cols;
  // The update u, then its orthogonalisation, in one buffer of the scratch's.
  std::vector<float>& update = s.update;
  update.resize(n);
  const bool bf16 = a.moment_dtype == MomentDType::kBF16;
  ForChunks(parallel, n, kChunk, [&](size_t b, size_t e) {
    for (size_t i = b; i < e; ++i) {
      const float g = ReadElement(a.grads, a.grad_dtype, i) * a.grad_scale;
      const float buf_in = bf16 ? ReadElement(a.momentum_in, formats::DType::kBF16, i)
                                : ReadElement(a.momentum_in, formats::DType::kF32, i);
      // The update uses the momentum as computed, before a BF16 slab rounds what it keeps (as
      // AdamW's BF16 moments do).
      const float buf = Lerp(buf_in, g, k.lerp_weight);
      if (bf16) {
        const uint16_t h = formats::FloatToBf16(buf);
        std::memcpy(a.momentum + i * 2, &h, 2);
      } else {
        std::memcpy(a.momentum + i * 4, &buf, 4);
      }
      update[i] = k.nesterov ? Lerp(g, buf, k.nesterov_weight) : buf;
    }
  });
  NewtonSchulz(update.data(), a.rows, a.cols, k, s, update.data(), parallel);
  const float neg_lr = -MuonAdjustedLr(k, a.rows, a.cols);
  const size_t psize = formats::DTypeSize(a.param_dtype);
  ForChunks(parallel, n, kChunk, [&](size_t b, size_t e) {
    for (size_t i = b; i < e; ++i) {
      // p.mul_(1 - lr * wd), then p.add_(O, alpha=-lr'), which torch fuses into one FMA.
      a.master[i] = std::fma(update[i], neg_lr, a.master_in[i] * k.decay);
    }
    formats::Convert(formats::DType::kF32, std::as_bytes(std::span(a.master + b, e - b)),
                     a.param_dtype, std::span(a.params + b * psize, (e - b) * psize));
  });
}

int SetBlasThreads(int threads) {
  const int before = openblas_get_num_threads();
  if (threads != before) openblas_set_num_threads(threads);
  return before;
}

}  // namespace ckpt::optimizer::internal
