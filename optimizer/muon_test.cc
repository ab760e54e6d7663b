// Muon on the CPU engine (docs/design/muon.md): the orthogonalisation against a plain-loop
// emulation of torch's BF16 Newton-Schulz, the momentum and master updates against torch's
// formulas element by element, a hybrid optimizer (Muon and AdamW groups) whose AdamW half
// equals an AdamW-only optimizer bit for bit, and the refusals of what is not built yet.
// Parity with torch.optim.Muon itself: python/tests/test_muon.py.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "ckpt/formats/convert.h"
#include "ckpt/formats/float_convert.h"
#include "ckpt/optimizer/checkpointer.h"
#include "ckpt/optimizer/staged_adamw.h"
#include "optimizer/rules/muon/muon.h"
#include "tests/support/status_matchers.h"

namespace ckpt::optimizer {
namespace {

using formats::DType;
using internal::MuonConstants;
using testing::IsOk;
using testing::StatusIs;
using testing::StatusIsWith;

float Bf(float x) { return formats::Bf16ToFloat(formats::FloatToBf16(x)); }

std::vector<float> Random(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

// torch's _zeropower_via_newtonschulz with plain loops: BF16 tensors, each product summed in
// FP32 in index order and rounded to BF16 once with its alpha and beta.
std::vector<float> ReferenceNs(const std::vector<float>& u, size_t rows, size_t cols,
                               const MuonConstants& k) {
  const bool t = rows > cols;
  const size_t m = t ? cols : rows, n = t ? rows : cols;
  std::vector<float> x(m * n);
  for (size_t r = 0; r < rows; ++r)
    for (size_t c = 0; c < cols; ++c) (t ? x[c * rows + r] : x[r * cols + c]) = Bf(u[r * cols + c]);
  double sq = 0;
  for (float v : x) sq += static_cast<double>(v) * v;
  const float norm = std::max(Bf(static_cast<float>(std::sqrt(sq))), Bf(k.eps));
  for (float& v : x) v = Bf(v / norm);
  for (uint32_t s = 0; s < k.ns_steps; ++s) {
    std::vector<float> g(m * m), h(m * m), y(m * n);
    for (size_t i = 0; i < m; ++i)
      for (size_t j = 0; j < m; ++j) {
        float acc = 0;
        for (size_t l = 0; l < n; ++l) acc += x[i * n + l] * x[j * n + l];
        g[i * m + j] = Bf(acc);
      }
    for (size_t i = 0; i < m; ++i)
      for (size_t j = 0; j < m; ++j) {
        float acc = 0;
        for (size_t l = 0; l < m; ++l) acc += g[i * m + l] * g[l * m + j];
        h[i * m + j] = Bf(k.c * acc + k.b * g[i * m + j]);
      }
    for (size_t i = 0; i < m; ++i)
      for (size_t j = 0; j < n; ++j) {
        float acc = 0;
        for (size_t l = 0; l < m; ++l) acc += h[i * m + l] * x[l * n + j];
        y[i * n + j] = Bf(acc + k.a * x[i * n + j]);
      }
    x = y;
  }
  std::vector<float> out(rows * cols);
  for (size_t r = 0; r < rows; ++r)
    for (size_t c = 0; c < cols; ++c) out[r * cols + c] = t ? x[c * rows + r] : x[r * cols + c];
  return out;
}

ParamGroup MuonGroup(bool nesterov = true, MuonLrAdjust adjust = MuonLrAdjust::kOriginal) {
  ParamGroup g;
  g.algorithm = Algorithm::kMuon;
  g.lr = 0.02;
  g.weight_decay = 0.1;
  g.eps = 1e-7;
  g.muon.nesterov = nesterov;
  g.muon.adjust_lr = adjust;
  return g;
}

// The elements of two orthogonalised updates differ only where the order of FP32 sums moved a
// BF16 rounding: by a few BF16 steps of the largest element at most, and rarely.
void ExpectCloseToReference(const std::vector<float>& got, const std::vector<float>& want) {
  ASSERT_EQ(got.size(), want.size());
  float top = 0, worst = 0;
  size_t differing = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    top = std::max(top, std::fabs(want[i]));
    worst = std::max(worst, std::fabs(got[i] - want[i]));
    differing += got[i] != want[i];
  }
  EXPECT_GT(top, 0.05f);
  EXPECT_LE(worst, top * 0.04f) << "largest difference";
  EXPECT_LE(differing, got.size() / 2) << "elements that differ at all";
}

TEST(MuonTest, NewtonSchulzFollowsTorchsBf16IterationForWideTallAndSquareMatrices) {
  const MuonConstants k = internal::ComputeMuonConstants(MuonGroup());
  internal::MuonScratch scratch;
  for (auto [rows, cols] : {std::pair<size_t, size_t>{16, 40}, {40, 16}, {24, 24}, {1, 7}}) {
    SCOPED_TRACE(::testing::Message() << rows << " x " << cols);
    const std::vector<float> u = Random(rows * cols, static_cast<uint32_t>(rows * 100 + cols));
    std::vector<float> got(rows * cols);
    internal::NewtonSchulz(u.data(), rows, cols, k, scratch, got.data());
    ExpectCloseToReference(got, ReferenceNs(u, rows, cols, k));
    for (float v : got) EXPECT_EQ(v, Bf(v)) << "every element is a BF16 value";
  }
}

TEST(MuonTest, NewtonSchulzOfZeroIsZeroThanksToEps) {
  const MuonConstants k = internal::ComputeMuonConstants(MuonGroup());
  internal::MuonScratch scratch;
  std::vector<float> u(12, 0.0f), out(12, 1.0f);
  internal::NewtonSchulz(u.data(), 3, 4, k, scratch, out.data());
  for (float v : out) EXPECT_EQ(v, 0.0f);
}

TEST(MuonTest, AdjustedLrFollowsBothOfTorchsRules) {
  ParamGroup g = MuonGroup();
  MuonConstants k = internal::ComputeMuonConstants(g);
  EXPECT_EQ(internal::MuonAdjustedLr(k, 64, 16), static_cast<float>(0.02 * std::sqrt(4.0)));
  EXPECT_EQ(internal::MuonAdjustedLr(k, 16, 64), static_cast<float>(0.02));
  g.muon.adjust_lr = MuonLrAdjust::kMatchRmsAdamW;
  k = internal::ComputeMuonConstants(g);
  EXPECT_EQ(internal::MuonAdjustedLr(k, 16, 64), static_cast<float>(0.02 * 0.2 * std::sqrt(64.0)));
}

// Element by element, torch's formulas: buf.lerp_(g, 1 - mu); u = g.lerp(buf, mu) or buf;
// p = p * (1 - lr wd) - lr' NS(u).
struct Expected {
  std::vector<float> master, momentum;
};
Expected ReferenceStep(const std::vector<float>& master, const std::vector<float>& momentum,
                       const std::vector<float>& grad, size_t rows, size_t cols,
                       const ParamGroup& g) {
  const MuonConstants k = internal::ComputeMuonConstants(g);
  auto lerp = [](float s, float e, float w) {
    return std::fabs(w) < 0.5f ? std::fma(w, e - s, s) : std::fma(w - 1.0f, e - s, e);
  };
  Expected out{master, momentum};
  std::vector<float> u(grad.size());
  for (size_t i = 0; i < grad.size(); ++i) {
    out.momentum[i] = lerp(momentum[i], grad[i], static_cast<float>(1.0 - g.muon.momentum));
    u[i] = g.muon.nesterov ? lerp(grad[i], out.momentum[i], static_cast<float>(g.muon.momentum))
                           : out.momentum[i];
  }
  const std::vector<float> o = ReferenceNs(u, rows, cols, k);
  const float lr = internal::MuonAdjustedLr(k, rows, cols);
  for (size_t i = 0; i < grad.size(); ++i) {
    out.master[i] = std::fma(o[i], -lr, master[i] * static_cast<float>(1.0 - g.lr * g.weight_decay));
  }
  return out;
}

class MuonStepTest : public ::testing::TestWithParam<std::tuple<bool, MuonLrAdjust, MomentDType>> {};

// A Muon-only optimizer over a tall and a wide matrix, three steps: the momentum (FP32) equals
// torch's formula bit for bit and the masters are within the orthogonalisation's tolerance.
TEST_P(MuonStepTest, StepsEachMatrixAsTorchsMuon) {
  const auto [nesterov, adjust, moments] = GetParam();
  StagedAdamWOptions o;
  o.params = {{"tall", {48, 20}, DType::kF32, 0}, {"wide", {12, 30}, DType::kBF16, 0}};
  o.groups = {MuonGroup(nesterov, adjust)};
  o.pieces = {{0, 0, 960}, {1, 0, 360}};
  o.moment_dtype = moments;
  o.unit_bytes = 256;  // Smaller than either matrix: a Muon unit is its matrix whatever this says.
  o.threads = 2;
  const std::vector<float> w0 = Random(960 + 360, 1, 0.1f);
  std::vector<std::byte> weights(960 * 4 + 360 * 2);
  formats::Convert(DType::kF32, std::as_bytes(std::span(w0).first(960)), DType::kF32,
                   std::span(weights).first(960 * 4));
  formats::Convert(DType::kF32, std::as_bytes(std::span(w0).subspan(960)), DType::kBF16,
                   std::span(weights).subspan(960 * 4));
  auto opt = StagedAdamW::Create(o, weights);
  ASSERT_THAT(opt, IsOk());
  std::vector<float> master((*opt)->master().begin(), (*opt)->master().end());
  std::vector<float> momentum(master.size(), 0.0f);
  for (int s = 0; s < 3; ++s) {
    const std::vector<float> grad = Random(master.size(), 10 + s);
    std::vector<std::byte> out(weights.size());
    StepArgs args{grad.data(), DType::kF32, 1.0f, out.data()};
    ASSERT_THAT((*opt)->Step(args), IsOk());
    std::vector<float> want_master, want_momentum;
    for (auto [at, rows, cols] : {std::tuple<size_t, size_t, size_t>{0, 48, 20}, {960, 12, 30}}) {
      const size_t n = rows * cols;
      auto part = [&](const std::vector<float>& v) {
        return std::vector<float>(v.begin() + at, v.begin() + at + n);
      };
      Expected e = ReferenceStep(part(master), part(momentum), part(grad), rows, cols,
                                 o.groups[0]);
      want_master.insert(want_master.end(), e.master.begin(), e.master.end());
      want_momentum.insert(want_momentum.end(), e.momentum.begin(), e.momentum.end());
    }
    std::span<const float> got_master = (*opt)->master();
    std::span<const std::byte> got_momentum = (*opt)->exp_avg_bytes();
    for (size_t i = 0; i < master.size(); ++i) {
      const float m = moments == MomentDType::kF32
                          ? reinterpret_cast<const float*>(got_momentum.data())[i]
                          : formats::Bf16ToFloat(
                                reinterpret_cast<const uint16_t*>(got_momentum.data())[i]);
      ASSERT_EQ(m, moments == MomentDType::kF32 ? want_momentum[i] : Bf(want_momentum[i]))
          << "momentum " << i << " step " << s;
      // lr' * (a few BF16 steps of the update's largest element, about 0.3).
      ASSERT_NEAR(got_master[i], want_master[i], 0.02 * 2 * 0.02) << "master " << i << " step " << s;
    }
    // The weights are the masters rounded to each parameter's dtype.
    EXPECT_EQ(std::memcmp(out.data(), got_master.data(), 960 * 4), 0);
    for (size_t i = 0; i < 360; ++i) {
      uint16_t h;
      std::memcpy(&h, out.data() + 960 * 4 + i * 2, 2);
      ASSERT_EQ(h, formats::FloatToBf16(got_master[960 + i]));
    }
    master.assign(got_master.begin(), got_master.end());
    for (size_t i = 0; i < master.size(); ++i) {
      momentum[i] = moments == MomentDType::kF32
                        ? reinterpret_cast<const float*>(got_momentum.data())[i]
                        : formats::Bf16ToFloat(
                              reinterpret_cast<const uint16_t*>(got_momentum.data())[i]);
    }
  }
}

std::string StepTestName(const ::testing::TestParamInfo<MuonStepTest::ParamType>& info) {
  return std::string(std::get<0>(info.param) ? "Nesterov" : "Plain") +
         (std::get<1>(info.param) == MuonLrAdjust::kOriginal ? "Original" : "MatchRmsAdamW") +
         (std::get<2>(info.param) == MomentDType::kF32 ? "F32" : "BF16");
}

INSTANTIATE_TEST_SUITE_P(
    NesterovAdjustMoments, MuonStepTest,
    ::testing::Combine(::testing::Bool(),
                     ::testing::Values(MuonLrAdjust::kOriginal, MuonLrAdjust::kMatchRmsAdamW),
                     ::testing::Values(MomentDType::kF32, MomentDType::kBF16)),
    StepTestName);

// The usual hybrid: Muon for the matrices, AdamW for the rest, in one optimizer. The AdamW
// parameters step bit for bit as in an AdamW-only optimizer; a Muon matrix without a gradient
// is left exactly as it is; a NaN anywhere skips the whole step.
TEST(MuonTest, AHybridOptimizerStepsItsAdamWGroupExactlyAsAnAdamWOptimizer) {
  ParamGroup adamw;
  adamw.lr = 3e-3;
  StagedAdamWOptions hybrid;
  hybrid.params = {{"embed", {50, 8}, DType::kF32, 1},
                   {"w1", {8, 16}, DType::kF32, 0},
                   {"norm", {8}, DType::kF32, 1},
                   {"w2", {16, 8}, DType::kF32, 0}};
  hybrid.groups = {MuonGroup(), adamw};
  hybrid.pieces = {{0, 0, 400}, {1, 0, 128}, {2, 0, 8}, {3, 0, 128}};
  hybrid.threads = 2;
  StagedAdamWOptions plain;
  plain.params = {{"embed", {50, 8}, DType::kF32, 0}, {"norm", {8}, DType::kF32, 0}};
  plain.groups = {adamw};
  plain.pieces = {{0, 0, 400}, {1, 0, 8}};
  plain.threads = 2;
  const std::vector<float> w = Random(664, 3, 0.1f);
  std::vector<float> wp(w.begin(), w.begin() + 400);
  wp.insert(wp.end(), w.begin() + 528, w.begin() + 536);
  auto h = StagedAdamW::Create(hybrid, std::as_bytes(std::span(w)));
  auto p = StagedAdamW::Create(plain, std::as_bytes(std::span(wp)));
  ASSERT_THAT(h, IsOk());
  ASSERT_THAT(p, IsOk());
  std::vector<float> hw(664), pw(408);
  for (int s = 0; s < 3; ++s) {
    std::vector<float> g = Random(664, 20 + s);
    std::vector<float> gp(g.begin(), g.begin() + 400);
    gp.insert(gp.end(), g.begin() + 528, g.begin() + 536);
    // Step 1: w2 has no gradient (its byte 0), and is left as it is.
    const uint8_t stepped[] = {1, 1, 1, static_cast<uint8_t>(s == 1 ? 0 : 1)};
    const std::vector<float> w2_before((*h)->master().begin() + 536, (*h)->master().end());
    StepArgs ha{g.data(), DType::kF32, 1.0f, hw.data()};
    ha.stepped = stepped;
    ASSERT_THAT((*h)->Step(ha), IsOk());
    ASSERT_THAT((*p)->Step(StepArgs{gp.data(), DType::kF32, 1.0f, pw.data()}), IsOk());
    std::span<const float> hm = (*h)->master(), pm = (*p)->master();
    EXPECT_TRUE(std::equal(pm.begin(), pm.begin() + 400, hm.begin()));
    EXPECT_TRUE(std::equal(pm.begin() + 400, pm.end(), hm.begin() + 528));
    if (s == 1) {
      EXPECT_TRUE(std::equal(w2_before.begin(), w2_before.end(), hm.begin() + 536));
    }
  }
  // A NaN in an AdamW gradient skips the Muon matrices too.
  const std::vector<float> before((*h)->master().begin(), (*h)->master().end());
  std::vector<float> g = Random(664, 99);
  g[3] = std::nanf("");
  StepArgs bad{g.data(), DType::kF32, 1.0f, hw.data()};
  bad.check_finite = true;
  auto report = (*h)->Step(bad);
  ASSERT_THAT(report, IsOk());
  EXPECT_TRUE(report->skipped);
  EXPECT_TRUE(std::equal(before.begin(), before.end(), (*h)->master().begin()));
}

TEST(MuonTest, RefusesWhatMuonCannotStepOrWhatIsNotBuiltYet) {
  StagedAdamWOptions o;
  o.params = {{"w", {4, 6}, DType::kF32, 0}, {"b", {6}, DType::kF32, 0}};
  o.groups = {MuonGroup()};
  o.pieces = {{0, 0, 24}, {1, 0, 6}};
  std::vector<float> w(30, 0.5f);
  auto weights = std::as_bytes(std::span(w));
  // A 1-D parameter in a Muon group.
  EXPECT_THAT(StagedAdamW::Create(o, weights),
              StatusIsWith(absl::StatusCode::kInvalidArgument, "\"b\" is in Muon group 0"));
  o.params[1].group = 1;
  o.groups.push_back(ParamGroup{});
  // A rank holding part of a Muon matrix.
  StagedAdamWOptions cut = o;
  cut.pieces = {{0, 0, 12}, {0, 12, 12}, {1, 0, 6}};
  EXPECT_THAT(StagedAdamW::Create(cut, weights),
              StatusIsWith(absl::StatusCode::kInvalidArgument, "part of a Muon parameter"));
  // Bad Muon hyper-parameters, named.
  StagedAdamWOptions bad = o;
  bad.groups[0].muon.ns_steps = 100;
  EXPECT_THAT(StagedAdamW::Create(bad, weights),
              StatusIsWith(absl::StatusCode::kInvalidArgument, "ns_steps"));
  bad = o;
  bad.groups[0].muon.momentum = -0.5;
  EXPECT_THAT(StagedAdamW::Create(bad, weights),
              StatusIsWith(absl::StatusCode::kInvalidArgument, "momentum"));
  bad = o;
  bad.groups[0].amsgrad = true;
  EXPECT_THAT(StagedAdamW::Create(bad, weights),
              StatusIsWith(absl::StatusCode::kInvalidArgument, "amsgrad"));
  auto opt = StagedAdamW::Create(o, weights);
  ASSERT_THAT(opt, IsOk());
  // A group's algorithm is fixed.
  EXPECT_THAT((*opt)->SetGroup(0, ParamGroup{}),
              StatusIsWith(absl::StatusCode::kInvalidArgument, "algorithm"));
  ParamGroup faster = MuonGroup();
  faster.lr = 0.05;
  EXPECT_THAT((*opt)->SetGroup(0, faster), IsOk());
  std::vector<float> g(30, 0.1f), out(30);
  StepArgs args{g.data(), DType::kF32, 1.0f, out.data()};
  EXPECT_THAT((*opt)->BeginOverlap(args), StatusIs(absl::StatusCode::kUnimplemented));
  EXPECT_THAT((*opt)->Step(args), IsOk());
}

}  // namespace
}  // namespace ckpt::optimizer
