#include "ckpt/optimizer/staged_adamw.h"

#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <random>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "optimizer/cpu_kernels.h"
#include "optimizer/engine.h"
#include "optimizer/host_buffer.h"
#include "tests/support/numeric.h"
#include "tests/support/status_matchers.h"
#include "tests/support/tensor_gen.h"

namespace ckpt::optimizer {
namespace {

using formats::DType;
using internal::Bf16ToFloat;
using internal::FloatToBf16;
using internal::FloatToHalf;
using internal::HalfToFloat;
using testing::IsOk;
using testing::MaxRelError;
constexpr auto Random = testing::RandomNormal;
constexpr auto Encode = testing::EncodeFloats;
using testing::StatusIs;

// Two groups; odd sizes; pieces that cut tensors; one piece of a tensor in the middle.
StagedAdamWOptions TestOptions(DType model, CpuIsa isa) {
  StagedAdamWOptions o;
  o.params = {{"a", {37, 3}, model, 0},
              {"b", {1001}, model, 1},
              {"c", {17}, model, 0},
              {"d", {5, 129}, model, 1}};
  o.groups = {
      ParamGroup{.lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .weight_decay = 0.1f},
      ParamGroup{.lr = 3e-3f, .beta1 = 0.8f, .beta2 = 0.95f, .eps = 1e-6f, .weight_decay = 0.0f}};
  o.pieces = {{0, 5, 100}, {1, 0, 1001}, {2, 0, 17}, {3, 100, 400}, {0, 105, 6}};
  o.unit_bytes = 256;  // 64 elements: units cut tensors.
  o.threads = 3;
  o.isa = isa;
  return o;
}

uint64_t Size(const StagedAdamWOptions& o) {
  uint64_t n = 0;
  for (const Piece& p : o.pieces) n += p.count;
  return n;
}

float Decode(const std::byte* p, DType dtype, size_t i) {
  if (dtype == DType::kF32) {
    float f;
    std::memcpy(&f, p + 4 * i, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, p + 2 * i, 2);
  return dtype == DType::kBF16 ? Bf16ToFloat(h) : HalfToFloat(h);
}

struct Outcome {
  std::vector<float> master, m, v;
  std::vector<std::byte> params;
};

// Gradients of step s (from 0): Random(seed 100 + s), zero on every third element, encoded.
std::vector<std::byte> StepGradients(uint64_t n, int s, DType dtype) {
  std::vector<float> g = Random(n, 100 + s, 0.5f);
  for (size_t i = 0; i < n; i += 3) g[i] = 0.0f;
  return Encode(g, dtype);
}

// The initial model weights, and each slab element's param group.
std::vector<std::byte> InitialWeights(const StagedAdamWOptions& o) {
  return Encode(Random(Size(o), 1, 1.0f), o.params[0].dtype);
}
std::vector<uint32_t> ElementGroups(const StagedAdamWOptions& o) {
  std::vector<uint32_t> group;
  for (const Piece& piece : o.pieces)
    group.insert(group.end(), piece.count, o.params[piece.param].group);
  return group;
}

// A learning-rate schedule: step s (from 0) runs every group at its lr times lr_factor[s].
using LrFactors = std::vector<double>;

// Runs `steps` steps with StepGradients, setting each group's lr before each step when
// `lr_factor` is given.
Outcome RunSteps(const StagedAdamWOptions& o, DType grad_dtype, int steps, float scale,
                 const LrFactors* lr_factor = nullptr) {
  const uint64_t n = Size(o);
  std::vector<std::byte> weights = InitialWeights(o);
  auto opt = StagedAdamW::Create(o, weights);
  EXPECT_THAT(opt, IsOk());
  Outcome r;
  // A 64-byte-aligned destination, so the AVX-512 path takes its streaming-store branch.
  std::vector<std::byte> storage(weights.size() + 64);
  std::byte* params = storage.data() + (64 - reinterpret_cast<uintptr_t>(storage.data()) % 64) % 64;
  for (int s = 0; s < steps; ++s) {
    for (size_t g = 0; lr_factor != nullptr && g < o.groups.size(); ++g) {
      ParamGroup group = o.groups[g];
      group.lr *= (*lr_factor)[static_cast<size_t>(s)];
      EXPECT_THAT((*opt)->SetGroup(g, group), IsOk());
    }
    std::vector<std::byte> gbytes = StepGradients(n, s, grad_dtype);
    auto report = (*opt)->Step({gbytes.data(), grad_dtype, scale, params});
    EXPECT_THAT(report, IsOk());
  }
  r.params.assign(params, params + weights.size());
  r.master.assign((*opt)->master().begin(), (*opt)->master().end());
  if (o.moment_dtype == MomentDType::kF32) {
    r.m.assign((*opt)->exp_avg().begin(), (*opt)->exp_avg().end());
    r.v.assign((*opt)->exp_avg_sq().begin(), (*opt)->exp_avg_sq().end());
  } else {
    for (uint64_t i = 0; i < n; ++i) {
      r.m.push_back(Decode((*opt)->exp_avg_bytes().data(), DType::kBF16, i));
      r.v.push_back(Decode((*opt)->exp_avg_sq_bytes().data(), DType::kBF16, i));
    }
  }
  return r;
}

// The torch.optim.AdamW formula in double, from the same initial weights and gradients.
Outcome Reference(const StagedAdamWOptions& o, DType grad_dtype, int steps, float scale,
                  const LrFactors* lr_factor = nullptr) {
  const uint64_t n = Size(o);
  const DType model = o.params[0].dtype;
  std::vector<std::byte> weights = InitialWeights(o);
  std::vector<double> p(n), m(n, 0.0), v(n, 0.0);
  for (uint64_t i = 0; i < n; ++i) p[i] = Decode(weights.data(), model, i);
  const std::vector<uint32_t> group = ElementGroups(o);
  for (int s = 0; s < steps; ++s) {
    std::vector<std::byte> gbytes = StepGradients(n, s, grad_dtype);
    for (uint64_t i = 0; i < n; ++i) {
      const ParamGroup& pg = o.groups[group[i]];
      const double t = s + 1, b1 = pg.beta1, b2 = pg.beta2;
      const double lr = pg.lr * (lr_factor != nullptr ? (*lr_factor)[static_cast<size_t>(s)] : 1.0);
      const double gi = static_cast<double>(Decode(gbytes.data(), grad_dtype, i)) * scale;
      p[i] *= 1.0 - lr * pg.weight_decay;
      m[i] = b1 * m[i] + (1.0 - b1) * gi;
      v[i] = b2 * v[i] + (1.0 - b2) * gi * gi;
      const double bc1 = 1.0 - std::pow(b1, t), bc2 = 1.0 - std::pow(b2, t);
      p[i] -= lr / bc1 * m[i] / (std::sqrt(v[i]) / std::sqrt(bc2) + pg.eps);
    }
  }
  Outcome r;
  for (uint64_t i = 0; i < n; ++i) {
    r.master.push_back(static_cast<float>(p[i]));
    r.m.push_back(static_cast<float>(m[i]));
    r.v.push_back(static_cast<float>(v[i]));
  }
  return r;
}

// Elementwise relative error for elements at least `floor` in magnitude.
double MaxElementwiseRelError(const std::vector<float>& got, const std::vector<float>& want,
                              double floor) {
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::abs(want[i]) < floor) continue;
    worst = std::max(worst, std::abs(static_cast<double>(got[i]) - want[i]) /
                                std::abs(static_cast<double>(want[i])));
  }
  return worst;
}

struct DTypes {
  DType grad, model;
};

class AdamWMathTest : public ::testing::TestWithParam<DTypes> {};

TEST_P(AdamWMathTest, MatchesDoubleReferenceAndRoundsMastersBitForBit) {
  StagedAdamWOptions o = TestOptions(GetParam().model, CpuIsa::kAuto);
  Outcome got = RunSteps(o, GetParam().grad, 5, 0.75f);
  Outcome want = Reference(o, GetParam().grad, 5, 0.75f);
  EXPECT_LE(MaxRelError(got.master, want.master), 2e-6);
  EXPECT_LE(MaxRelError(got.m, want.m), 2e-6);
  EXPECT_LE(MaxRelError(got.v, want.v), 2e-6);
  // Masters away from zero (nearly all of them) also hold elementwise.
  EXPECT_LE(MaxElementwiseRelError(got.master, want.master, 0.05), 2e-6);
  std::vector<std::byte> rounded = Encode(got.master, GetParam().model);
  EXPECT_EQ(got.params, rounded) << "model weights must be the masters rounded to nearest even";
}

INSTANTIATE_TEST_SUITE_P(
    GradAndModelDtypes, AdamWMathTest,
    ::testing::Values(DTypes{DType::kF32, DType::kF32}, DTypes{DType::kF32, DType::kBF16},
                      DTypes{DType::kF32, DType::kF16}, DTypes{DType::kBF16, DType::kBF16},
                      DTypes{DType::kBF16, DType::kF32}, DTypes{DType::kF16, DType::kF16},
                      DTypes{DType::kF16, DType::kBF16}, DTypes{DType::kBF16, DType::kF16},
                      DTypes{DType::kF16, DType::kF32}),
    [](const ::testing::TestParamInfo<DTypes>& p) {
      return std::string(formats::DTypeName(p.param.grad)) + "_grads_" +
             std::string(formats::DTypeName(p.param.model)) + "_model";
    });

// Warmup then decay, as a trainer's scheduler sets it through SetGroup before each step, with
// several hyper-parameter sets (torch's defaults, high beta2, strong decay, tiny eps).
TEST(AdamWScheduleTest, PerStepLearningRatesMatchTheDoubleReference) {
  const LrFactors warmup_then_decay = {0.1, 0.4, 1.0, 0.8, 0.5, 0.2};
  const std::vector<std::vector<ParamGroup>> sets = {
      {ParamGroup{}, ParamGroup{.lr = 1e-3, .weight_decay = 0.0}},
      {ParamGroup{.lr = 3e-4, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.1},
       ParamGroup{.lr = 3e-4, .beta1 = 0.9, .beta2 = 0.9999, .eps = 1e-8, .weight_decay = 0.0}},
      {ParamGroup{.lr = 1e-2, .beta1 = 0.8, .beta2 = 0.95, .eps = 1e-6, .weight_decay = 0.5},
       ParamGroup{.lr = 5e-3, .beta1 = 0.0, .beta2 = 0.5, .eps = 1e-12, .weight_decay = 0.01}},
  };
  for (size_t k = 0; k < sets.size(); ++k) {
    StagedAdamWOptions o = TestOptions(DType::kF32, CpuIsa::kAuto);
    for (size_t g = 0; g < o.groups.size(); ++g) o.groups[g] = sets[k][g % sets[k].size()];
    Outcome got = RunSteps(o, DType::kF32, 6, 1.0f, &warmup_then_decay);
    Outcome want = Reference(o, DType::kF32, 6, 1.0f, &warmup_then_decay);
    EXPECT_LE(MaxRelError(got.master, want.master), 2e-6) << "set " << k;
    EXPECT_LE(MaxRelError(got.m, want.m), 2e-6) << "set " << k;
    EXPECT_LE(MaxRelError(got.v, want.v), 2e-6) << "set " << k;
    // A constant schedule would end elsewhere: the schedule really reached the engine.
    Outcome constant = RunSteps(o, DType::kF32, 6, 1.0f);
    EXPECT_GT(MaxRelError(constant.master, want.master), 1e-5) << "set " << k;
  }
}

TEST(AdamWScheduleTest, HyperParametersAreKeptInDouble) {
  // 1 - beta2 from a double 0.999 is 1.0000000000000009e-3; from a float it would be off by
  // 1.3e-5 relative. The per-step constant is rounded once, from the double.
  StepConstants c = ComputeStepConstants(ParamGroup{.beta2 = 0.999}, 1);
  EXPECT_EQ(c.omb2, static_cast<float>(1.0 - 0.999));
  EXPECT_NE(c.omb2, static_cast<float>(1.0 - static_cast<double>(0.999f)));
}

TEST(AdamWScheduleTest, SetGroupValidatesAndKeepsTheStepCounter) {
  StagedAdamWOptions o = TestOptions(DType::kF32, CpuIsa::kAuto);
  std::vector<std::byte> weights = InitialWeights(o);
  auto opt = StagedAdamW::Create(o, weights);
  ASSERT_THAT(opt, IsOk());
  std::vector<std::byte> grads = StepGradients(Size(o), 0, DType::kF32);
  std::vector<std::byte> params(weights.size());
  ASSERT_THAT((*opt)->Step({grads.data(), DType::kF32, 1.0f, params.data()}), IsOk());
  ParamGroup next{.lr = 5e-4, .beta1 = 0.85, .weight_decay = 0.2, .step = 999};
  ASSERT_THAT((*opt)->SetGroup(0, next), IsOk());
  EXPECT_EQ((*opt)->groups()[0].lr, 5e-4);
  EXPECT_EQ((*opt)->groups()[0].beta1, 0.85);
  EXPECT_EQ((*opt)->groups()[0].step, 1u) << "the group's own step counter is kept";
  for (ParamGroup bad :
       {ParamGroup{.lr = -1}, ParamGroup{.lr = INFINITY}, ParamGroup{.beta1 = 1.0},
        ParamGroup{.beta2 = -0.1}, ParamGroup{.eps = -1e-8}, ParamGroup{.weight_decay = NAN}}) {
    EXPECT_THAT((*opt)->SetGroup(0, bad), StatusIs(absl::StatusCode::kInvalidArgument));
  }
  EXPECT_THAT((*opt)->SetGroup(o.groups.size(), ParamGroup{}),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ((*opt)->groups()[0].lr, 5e-4) << "a refused SetGroup changes nothing";
}

TEST(AdamWIsaTest, SimdPathsEqualTheScalarPathBitForBit) {
  for (DType model : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (DType grad : {DType::kF32, DType::kBF16, DType::kF16}) {
      Outcome scalar = RunSteps(TestOptions(model, CpuIsa::kScalar), grad, 3, 1.5f);
      for (CpuIsa isa : {CpuIsa::kAvx2, CpuIsa::kAvx512}) {
        if (!internal::CpuSupports(isa)) continue;
        SCOPED_TRACE(internal::IsaName(isa));
        Outcome simd = RunSteps(TestOptions(model, isa), grad, 3, 1.5f);
        ASSERT_EQ(std::memcmp(simd.master.data(), scalar.master.data(), 4 * scalar.master.size()),
                  0);
        ASSERT_EQ(std::memcmp(simd.m.data(), scalar.m.data(), 4 * scalar.m.size()), 0);
        ASSERT_EQ(std::memcmp(simd.v.data(), scalar.v.data(), 4 * scalar.v.size()), 0);
        ASSERT_EQ(simd.params, scalar.params);
      }
    }
  }
}

// Precision-aware mode: the same recurrence with each stored moment rounded to BF16 (nearest
// even) after its FP32 update, emulated on the host one operation at a time; every ISA must give
// exactly its bits, for every gradient dtype.
Outcome Bf16MomentsEmulation(const StagedAdamWOptions& o, DType grad_dtype, int steps,
                             float scale) {
  const uint64_t n = Size(o);
  const DType model = o.params[0].dtype;
  std::vector<std::byte> weights = InitialWeights(o);
  std::vector<float> p(n);
  std::vector<uint16_t> m(n, 0), v(n, 0);
  for (uint64_t i = 0; i < n; ++i) p[i] = Decode(weights.data(), model, i);
  const std::vector<uint32_t> group = ElementGroups(o);
  for (int step = 0; step < steps; ++step) {
    std::vector<std::byte> gb = StepGradients(n, step, grad_dtype);
    std::vector<StepConstants> c;
    for (const ParamGroup& pg : o.groups) c.push_back(ComputeStepConstants(pg, step + 1));
    for (uint64_t i = 0; i < n; ++i) {
      const StepConstants& sc = c[group[i]];
      volatile float gs = Decode(gb.data(), grad_dtype, i) * scale;  // volatile: no FMA.
      volatile float pd = p[i] * sc.decay;
      volatile float mt = sc.beta1 * Bf16ToFloat(m[i]);
      volatile float mg = sc.omb1 * gs;
      const float mm = mt + mg;
      volatile float vt = sc.beta2 * Bf16ToFloat(v[i]);
      volatile float gg = gs * gs;
      volatile float vg = sc.omb2 * gg;
      const float vv = vt + vg;
      volatile float den = std::sqrt(vv) / sc.bc2_sqrt + sc.eps;
      volatile float num = sc.step_size * mm;
      p[i] = pd - num / den;
      m[i] = FloatToBf16(mm);
      v[i] = FloatToBf16(vv);
    }
  }
  Outcome r;
  r.master = p;
  for (uint64_t i = 0; i < n; ++i) {
    r.m.push_back(Bf16ToFloat(m[i]));
    r.v.push_back(Bf16ToFloat(v[i]));
  }
  r.params = Encode(p, model);
  return r;
}

TEST(Bf16MomentsTest, EveryIsaMatchesAHostEmulationBitForBit) {
  for (CpuIsa isa : {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (!internal::CpuSupports(isa)) continue;
    for (DType model : {DType::kF32, DType::kBF16, DType::kF16}) {
      for (DType grad : {DType::kF32, DType::kBF16, DType::kF16}) {
        SCOPED_TRACE(::testing::Message()
                     << internal::IsaName(isa) << " " << formats::DTypeName(grad) << " grads, "
                     << formats::DTypeName(model) << " model");
        StagedAdamWOptions o = TestOptions(model, isa);
        o.moment_dtype = MomentDType::kBF16;
        Outcome got = RunSteps(o, grad, 3, 1.5f);
        Outcome want = Bf16MomentsEmulation(o, grad, 3, 1.5f);
        ASSERT_EQ(std::memcmp(got.master.data(), want.master.data(), 4 * want.master.size()), 0);
        ASSERT_EQ(got.m, want.m);
        ASSERT_EQ(got.v, want.v);
        ASSERT_EQ(got.params, want.params);
      }
    }
  }
}

TEST(Bf16MomentsTest, StayCloseToTheFp32Reference) {
  // Each stored moment is rounded once per step, by at most 2^-9 of itself, and the error is
  // carried on scaled by beta < 1: after three steps at most 3 * 2^-9 of the moment's scale.
  // Masters stay FP32, updated from the unrounded moments of each step.
  StagedAdamWOptions o = TestOptions(DType::kBF16, CpuIsa::kAuto);
  o.moment_dtype = MomentDType::kBF16;
  Outcome got = RunSteps(o, DType::kF32, 3, 1.5f);
  Outcome ref = Reference(o, DType::kF32, 3, 1.5f);
  EXPECT_LE(MaxRelError(got.m, ref.m), 3.0 / 512);
  EXPECT_LE(MaxRelError(got.v, ref.v), 3.0 / 512);
  EXPECT_LE(MaxRelError(got.master, ref.master), 1e-3);
  EXPECT_GT(MaxRelError(got.m, ref.m), 0.0);  // They are rounded, not FP32 after all.
}

__attribute__((target("f16c"))) uint16_t HardwareHalf(float f) {
  return static_cast<uint16_t>(
      _mm_extract_epi16(_mm_cvtps_ph(_mm_set_ss(f), _MM_FROUND_TO_NEAREST_INT), 0));
}
__attribute__((target("f16c"))) float HardwareHalfToFloat(uint16_t h) {
  return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h)));
}

TEST(ConversionTest, ScalarHalfConversionsMatchF16cEverywhereSampled) {
  if (!internal::CpuSupports(CpuIsa::kAvx2)) GTEST_SKIP() << "no F16C here";
  for (uint64_t bits = 0; bits <= 0xffffffffull; bits += 997) {
    float f;
    uint32_t b = static_cast<uint32_t>(bits);
    std::memcpy(&f, &b, 4);
    ASSERT_EQ(FloatToHalf(f), HardwareHalf(f)) << std::hex << b;
  }
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    float a = HalfToFloat(static_cast<uint16_t>(h)),
          b = HardwareHalfToFloat(static_cast<uint16_t>(h));
    ASSERT_EQ(std::memcmp(&a, &b, 4), 0) << std::hex << h;
  }
}

TEST(ConversionTest, Bf16RoundsToNearestEven) {
  EXPECT_EQ(FloatToBf16(1.0f), 0x3f80);
  float halfway;  // 1 + 2^-8: exactly between two BF16 values; ties to the even one (1.0).
  uint32_t b = 0x3f808000;
  std::memcpy(&halfway, &b, 4);
  EXPECT_EQ(FloatToBf16(halfway), 0x3f80);
  b = 0x3f818000;  // Tie with an odd lower neighbour rounds up.
  std::memcpy(&halfway, &b, 4);
  EXPECT_EQ(FloatToBf16(halfway), 0x3f82);
  EXPECT_EQ(FloatToBf16(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(std::nanf("")))));
}

class BadInputTest : public ::testing::Test {
 protected:
  void SetUp() override {
    o_ = TestOptions(DType::kBF16, CpuIsa::kAuto);
    n_ = Size(o_);
    weights_ = Encode(Random(n_, 1, 1.0f), DType::kBF16);
    auto opt = StagedAdamW::Create(o_, weights_);
    ASSERT_THAT(opt, IsOk());
    opt_ = std::move(opt).value();
    grads_.assign(n_, 0.1f);
    params_.assign(n_ * 2, std::byte{0});
  }
  std::vector<float> Snapshot() {
    std::vector<float> s(opt_->master().begin(), opt_->master().end());
    s.insert(s.end(), opt_->exp_avg().begin(), opt_->exp_avg().end());
    s.insert(s.end(), opt_->exp_avg_sq().begin(), opt_->exp_avg_sq().end());
    return s;
  }
  StagedAdamWOptions o_;
  uint64_t n_ = 0;
  std::vector<std::byte> weights_, params_;
  std::vector<float> grads_;
  std::unique_ptr<StagedAdamW> opt_;
};

// The lifecycle changes only through a load scope: kLoading while it is open (steps and group
// changes refused), then exactly the end the scope was given; one left open poisons.
TEST_F(BadInputTest, TheLifecycleFollowsTheLoadScopeAndAnUnendedScopePoisons) {
  const StepArgs args{grads_.data(), DType::kF32, 1.0f, params_.data()};
  {
    StagedAdamW::LoadScope scope = opt_->BeginLoad();
    EXPECT_EQ(opt_->lifecycle(), Lifecycle::kLoading);
    EXPECT_THAT(opt_->Step(args), StatusIs(absl::StatusCode::kFailedPrecondition));
    EXPECT_THAT(opt_->SetGroup(0, opt_->groups()[0]),
                StatusIs(absl::StatusCode::kFailedPrecondition));
    std::vector<ParamGroup> groups = opt_->groups();
    groups[1].step = 7;
    const uint64_t version = opt_->state_version();
    scope.RestoreGroups(groups, {0, 7, 0, 7});
    EXPECT_GT(opt_->state_version(), version);
    scope.Commit();
  }
  EXPECT_EQ(opt_->lifecycle(), Lifecycle::kClean);
  EXPECT_EQ(opt_->groups()[1].step, 7u);
  CKPT_EXPECT_OK(opt_->Step(args));
  {
    StagedAdamW::LoadScope scope = opt_->BeginLoad();
    scope.Poison("load of step 9 failed (test)");
  }
  EXPECT_EQ(opt_->lifecycle(), Lifecycle::kPoisoned);
  EXPECT_EQ(opt_->poison_reason(), "load of step 9 failed (test)");
  const absl::Status refused = opt_->Step(args).status();
  EXPECT_THAT(refused, StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(refused.message(), ::testing::HasSubstr("load of step 9 failed (test)"));
  {  // A rollback keeps the lifecycle from before the load: still poisoned.
    StagedAdamW::LoadScope scope = opt_->BeginLoad();
    StagedAdamW::LoadScope moved = std::move(scope);  // The moved-from scope ends nothing.
    moved.RolledBack();
  }
  EXPECT_EQ(opt_->lifecycle(), Lifecycle::kPoisoned);
  { opt_->BeginLoad().Commit(); }
  EXPECT_EQ(opt_->lifecycle(), Lifecycle::kClean);
  EXPECT_EQ(opt_->poison_reason(), "");
  { StagedAdamW::LoadScope forgotten = opt_->BeginLoad(); }
  EXPECT_EQ(opt_->lifecycle(), Lifecycle::kPoisoned);
  EXPECT_THAT(opt_->poison_reason(), ::testing::HasSubstr("without committing or rolling back"));
}

TEST_F(BadInputTest, NonFiniteGradientsSkipTheStepWhenChecked) {
  CKPT_ASSERT_OK(opt_->Step({grads_.data(), DType::kF32, 1.0f, params_.data()}));
  std::vector<float> before = Snapshot();
  grads_[123] = std::nanf("");
  grads_[7] = std::numeric_limits<float>::infinity();
  auto report =
      opt_->Step({grads_.data(), DType::kF32, 1.0f, params_.data(), /*check_finite=*/true});
  CKPT_ASSERT_OK(report);
  EXPECT_TRUE(report->skipped);
  EXPECT_EQ(report->nonfinite, 2u);
  EXPECT_EQ(report->first_nonfinite, 7u);
  std::vector<float> after = Snapshot();
  EXPECT_EQ(std::memcmp(before.data(), after.data(), 4 * before.size()), 0)
      << "state must be untouched";
  EXPECT_EQ(opt_->groups()[0].step, 1u);
  // A finite scale that overflows a finite gradient is caught too.
  grads_[123] = 1e30f;
  grads_[7] = 0.0f;
  report = opt_->Step({grads_.data(), DType::kF32, 1e10f, params_.data(), true});
  CKPT_ASSERT_OK(report);
  EXPECT_TRUE(report->skipped);
}

// The check_finite pass: every ISA counts exactly what std::isfinite rejects in grad * scale,
// NaN and both infinities anywhere (first block, middle, scalar tail), finite values the scale
// overflows, and names the first.
TEST(NonFiniteKernelTest, EveryIsaCountsWhatIsfiniteRejects) {
  const size_t n = 1000 + 13;
  for (DType grad : {DType::kF32, DType::kBF16, DType::kF16}) {
    // Finite in every dtype; times 1e34 past FP32's range (the product is taken in FP32).
    const float big = grad == DType::kF16 ? 60000.0f : 3e38f;
    for (float scale : {1.0f, 1e34f}) {
      std::vector<float> g = Random(n, 5, 1.0f);
      g[3] = std::nanf("");
      g[500] = std::numeric_limits<float>::infinity();
      g[1001] = -std::numeric_limits<float>::infinity();
      g[n - 1] = std::nanf("");
      g[40] = big;
      g[700] = -big;
      const std::vector<std::byte> bytes = Encode(g, grad);
      uint64_t want = 0, first = ~uint64_t{0};
      for (size_t i = 0; i < n; ++i) {
        if (!std::isfinite(Decode(bytes.data(), grad, i) * scale)) {
          ++want;
          first = std::min<uint64_t>(first, i);
        }
      }
      ASSERT_EQ(want, scale == 1.0f ? 4u : 6u);
      for (CpuIsa isa : {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
        if (!internal::CpuSupports(isa)) continue;
        SCOPED_TRACE(::testing::Message() << internal::IsaName(isa) << " "
                                          << formats::DTypeName(grad) << " scale " << scale);
        const internal::NonFinite got =
            internal::SelectNonFiniteKernel(isa, grad)(bytes.data(), n, scale);
        EXPECT_EQ(got.count, want);
        EXPECT_EQ(got.first, first);
        const internal::NonFinite none = internal::SelectNonFiniteKernel(isa, grad)(
            bytes.data() + 4 * formats::DTypeSize(grad), 30, scale);  // Elements 4..33: finite.
        EXPECT_EQ(none.count, 0u);
        EXPECT_EQ(none.first, ~uint64_t{0});
      }
    }
  }
}

TEST_F(BadInputTest, NullMisalignedAndUnsupportedBuffersAreRefusedWithStateUntouched) {
  std::vector<float> before = Snapshot();
  EXPECT_THAT(opt_->Step({nullptr, DType::kF32, 1.0f, params_.data()}),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(opt_->Step({grads_.data(), DType::kF32, 1.0f, nullptr}),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(opt_->Step({reinterpret_cast<std::byte*>(grads_.data()) + 1, DType::kF32, 1.0f,
                          params_.data()}),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(opt_->Step({grads_.data(), DType::kI32, 1.0f, params_.data()}),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(opt_->Step({grads_.data(), DType::kF32, std::nanf(""), params_.data()}),
              StatusIs(absl::StatusCode::kInvalidArgument));
  std::vector<float> after = Snapshot();
  EXPECT_EQ(std::memcmp(before.data(), after.data(), 4 * before.size()), 0);
  EXPECT_EQ(opt_->groups()[0].step, 0u);
}

// The model weights are the masters rounded: WriteModelWeights writes what the last Step wrote,
// in every model dtype, and after a direct write of the masters, the new masters rounded.
TEST(WriteModelWeightsTest, WritesTheMastersRoundedAsAStepWritesThem) {
  for (DType model : {DType::kF32, DType::kBF16, DType::kF16}) {
    SCOPED_TRACE(formats::DTypeName(model));
    const StagedAdamWOptions o = TestOptions(model, CpuIsa::kAuto);
    const uint64_t n = Size(o);
    const size_t psize = formats::DTypeSize(model);
    auto opt = StagedAdamW::Create(o, InitialWeights(o));
    ASSERT_THAT(opt, IsOk());
    std::vector<std::byte> stepped(n * psize), written(n * psize, std::byte{0x5a});
    for (int s = 0; s < 2; ++s) {
      const std::vector<std::byte> g = StepGradients(n, s, DType::kF32);
      ASSERT_THAT((*opt)->Step({g.data(), DType::kF32, 1.0f, stepped.data()}), IsOk());
    }
    ASSERT_THAT((*opt)->WriteModelWeights(written.data()), IsOk());
    EXPECT_EQ(written, stepped);
    // Masters written directly (as a load does): the weights follow only when written.
    std::span<float> master = (*opt)->mutable_master();
    for (size_t i = 0; i < master.size(); ++i) master[i] = 0.1f * static_cast<float>(i % 97) - 3.3f;
    ASSERT_THAT((*opt)->WriteModelWeights(written.data()), IsOk());
    for (size_t i = 0; i < n; ++i) {
      ASSERT_EQ(Decode(written.data(), model, i),
                Decode(Encode({master[i]}, model).data(), model, 0))
          << "element " << i;
    }
  }
}

TEST_F(BadInputTest, WriteModelWeightsRefusesBadDestinationsAndAnUncleanOptimizer) {
  EXPECT_THAT(opt_->WriteModelWeights(nullptr), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(opt_->WriteModelWeights(params_.data() + 1),
              StatusIs(absl::StatusCode::kInvalidArgument));
  // The CPU engine writes host memory: a stream means the caller expected the CUDA engine.
  EXPECT_THAT(opt_->WriteModelWeights(params_.data(), CudaStreamView::Legacy()),
              StatusIs(absl::StatusCode::kInvalidArgument));
  std::vector<std::byte> before = params_;
  {
    StagedAdamW::LoadScope scope = opt_->BeginLoad();
    EXPECT_THAT(opt_->WriteModelWeights(params_.data()),
                StatusIs(absl::StatusCode::kFailedPrecondition));
    scope.Poison("test: a failed load");
  }
  const absl::Status poisoned = opt_->WriteModelWeights(params_.data());
  EXPECT_THAT(poisoned, StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(std::string(poisoned.message()), ::testing::HasSubstr("test: a failed load"));
  EXPECT_EQ(params_, before) << "a refused write changed the destination";
}

// A step on each piece's own buffers (StepArgs::pieces: a parameter's storage, no flat copy)
// is the step on flat buffers, on every instruction set and dtype, check_finite included.
TEST(PieceBuffersTest, AStepOnEachPiecesOwnBuffersEqualsTheStepOnFlatBuffers) {
  for (DType model : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (CpuIsa isa : {CpuIsa::kScalar, CpuIsa::kAuto}) {
      SCOPED_TRACE(formats::DTypeName(model));
      const StagedAdamWOptions o = TestOptions(model, isa);
      const uint64_t n = Size(o);
      const size_t psize = formats::DTypeSize(model);
      auto flat = StagedAdamW::Create(o, InitialWeights(o));
      auto own = StagedAdamW::Create(o, InitialWeights(o));
      ASSERT_THAT(flat, IsOk());
      ASSERT_THAT(own, IsOk());
      std::vector<std::byte> params(n * psize);
      // Each piece's gradients and weights in an allocation of its own.
      std::vector<std::vector<float>> piece_grads;
      std::vector<std::vector<std::byte>> piece_params;
      for (const Piece& p : o.pieces) {
        piece_grads.emplace_back(p.count);
        piece_params.emplace_back(p.count * psize);
      }
      std::vector<PieceBuffers> buffers;
      for (size_t k = 0; k < o.pieces.size(); ++k) {
        buffers.push_back({piece_grads[k].data(), piece_params[k].data()});
      }
      for (int s = 0; s < 3; ++s) {
        std::vector<float> g = Random(n, 100 + s, 0.5f);
        if (s == 2) g[n - 3] = std::nanf("");  // In the last piece: the step is skipped.
        uint64_t at = 0;
        for (size_t k = 0; k < o.pieces.size(); ++k) {
          std::copy(g.begin() + at, g.begin() + at + o.pieces[k].count, piece_grads[k].begin());
          at += o.pieces[k].count;
        }
        StepArgs flat_args{g.data(), DType::kF32, 0.5f, params.data()};
        flat_args.check_finite = true;
        StepArgs own_args;
        own_args.grad_dtype = DType::kF32;
        own_args.grad_scale = 0.5f;
        own_args.check_finite = true;
        own_args.pieces = buffers;
        auto a = (*flat)->Step(flat_args);
        auto b = (*own)->Step(own_args);
        ASSERT_THAT(a, IsOk());
        ASSERT_THAT(b, IsOk());
        EXPECT_EQ(a->skipped, s == 2);
        EXPECT_EQ(b->skipped, a->skipped);
        EXPECT_EQ(b->first_nonfinite, a->first_nonfinite);
      }
      uint64_t at = 0;
      for (size_t k = 0; k < o.pieces.size(); ++k) {
        EXPECT_TRUE(std::equal(piece_params[k].begin(), piece_params[k].end(),
                               params.begin() + at * psize))
            << "piece " << k;
        at += o.pieces[k].count;
      }
      EXPECT_EQ(std::memcmp((*own)->master().data(), (*flat)->master().data(), 4 * n), 0);
    }
  }
}

TEST_F(BadInputTest, PieceBuffersOfTheWrongCountOrNullAreRefusedNamingThePiece) {
  std::vector<PieceBuffers> buffers(o_.pieces.size(), {grads_.data(), params_.data()});
  StepArgs args;
  args.pieces = std::span(buffers).first(buffers.size() - 1);
  EXPECT_THAT(opt_->Step(args), StatusIs(absl::StatusCode::kInvalidArgument));
  buffers[1].grads = nullptr;
  args.pieces = buffers;
  const absl::StatusOr<StepReport> null = opt_->Step(args);
  EXPECT_THAT(null, StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(std::string(null.status().message()), ::testing::HasSubstr("piece 1 (b)"));
  EXPECT_EQ(opt_->groups()[0].step, 0u);
}

// SetState replaces masters, moments and step counters at once (torch's load_state_dict), and
// the next step continues from them exactly as from the same state reached by stepping.
TEST(SetStateTest, TheNextStepContinuesFromTheStateSetAsFromTheStateStepped) {
  for (MomentDType moments : {MomentDType::kF32, MomentDType::kBF16}) {
    StagedAdamWOptions o = TestOptions(DType::kF32, CpuIsa::kAuto);
    o.moment_dtype = moments;
    const uint64_t n = Size(o);
    auto stepped = StagedAdamW::Create(o, InitialWeights(o));
    auto set = StagedAdamW::Create(o, InitialWeights(o));
    ASSERT_THAT(stepped, IsOk());
    ASSERT_THAT(set, IsOk());
    std::vector<std::byte> params(n * 4), params_set(n * 4);
    for (int s = 0; s < 3; ++s) {
      const std::vector<std::byte> g = StepGradients(n, s, DType::kF32);
      ASSERT_THAT((*stepped)->Step({g.data(), DType::kF32, 1.0f, params.data()}), IsOk());
    }
    std::vector<float> master(n), m(n), v(n);
    using T = StagedAdamW::StateTensor;
    ASSERT_THAT((*stepped)->CopyStateAsF32(T::kMaster, master), IsOk());
    ASSERT_THAT((*stepped)->CopyStateAsF32(T::kExpAvg, m), IsOk());
    ASSERT_THAT((*stepped)->CopyStateAsF32(T::kExpAvgSq, v), IsOk());
    const std::vector<uint64_t> steps = {3, 3, 3, 3};
    ASSERT_THAT((*set)->SetState(master, m, v, steps), IsOk());
    EXPECT_EQ((*set)->groups()[0].step, 3u);
    const std::vector<std::byte> g = StepGradients(n, 3, DType::kF32);
    ASSERT_THAT((*stepped)->Step({g.data(), DType::kF32, 1.0f, params.data()}), IsOk());
    ASSERT_THAT((*set)->Step({g.data(), DType::kF32, 1.0f, params_set.data()}), IsOk());
    EXPECT_EQ(params_set, params);
    EXPECT_EQ(std::memcmp((*set)->master().data(), (*stepped)->master().data(), 4 * n), 0);
    EXPECT_TRUE(std::equal((*set)->exp_avg_bytes().begin(), (*set)->exp_avg_bytes().end(),
                           (*stepped)->exp_avg_bytes().begin()));
  }
}

TEST_F(BadInputTest, SetStateIsAllOrNothing) {
  const std::vector<float> before = Snapshot();
  std::vector<float> ok(n_, 0.25f), short_by_one(n_ - 1, 0.25f), bad(n_, 0.25f);
  bad[n_ / 2] = std::nanf("");
  const std::vector<uint64_t> steps = {4, 5, 4, 5}, one_step = {4};
  EXPECT_THAT(opt_->SetState(ok, short_by_one, ok, steps),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(opt_->SetState(ok, ok, ok, one_step), StatusIs(absl::StatusCode::kInvalidArgument));
  const absl::Status nan = opt_->SetState(ok, ok, bad, steps);
  EXPECT_THAT(nan, StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(std::string(nan.message()), ::testing::HasSubstr("exp_avg_sq element"));
  {
    StagedAdamW::LoadScope scope = opt_->BeginLoad();
    EXPECT_THAT(opt_->SetState(ok, ok, ok, steps), StatusIs(absl::StatusCode::kFailedPrecondition));
    scope.RolledBack();
  }
  EXPECT_EQ(Snapshot(), before);
  EXPECT_EQ(opt_->groups()[0].step, 0u);
  // Empty masters keep them; the moments and steps change.
  ASSERT_THAT(opt_->SetState({}, ok, ok, steps), IsOk());
  EXPECT_TRUE(std::equal(opt_->master().begin(), opt_->master().end(), before.begin()));
  EXPECT_EQ(opt_->exp_avg()[7], 0.25f);
  EXPECT_EQ(opt_->groups()[1].step, 5u);
}

TEST_F(BadInputTest, BadLayoutsAreRefused) {
  auto expect_invalid = [&](StagedAdamWOptions o, std::span<const std::byte> w) {
    EXPECT_THAT(StagedAdamW::Create(std::move(o), w), StatusIs(absl::StatusCode::kInvalidArgument));
  };
  expect_invalid(o_, std::span(weights_).first(weights_.size() - 2));  // Size mismatch.
  StagedAdamWOptions o = o_;
  o.pieces.push_back({1, 1000, 2});  // Outside its tensor.
  expect_invalid(o, weights_);
  o = o_;
  o.pieces[4] = {0, 100, 6};  // Overlaps {0, 5, 100}.
  expect_invalid(o, weights_);
  o = o_;
  o.groups.push_back(ParamGroup{});  // A group with no parameters.
  expect_invalid(o, weights_);
  o = o_;
  o.params[2].dtype = DType::kF32;  // Mixed model dtypes.
  expect_invalid(o, weights_);
  o = o_;
  for (auto& p : o.params) p.dtype = DType::kI32;  // Unsupported dtype.
  expect_invalid(o, weights_);
  o = o_;
  o.groups[1].beta2 = 1.0f;
  expect_invalid(o, weights_);
  o = o_;
  o.pieces[1].count = 0;
  expect_invalid(o, weights_);
}

TEST(EngineChoiceTest, CudaWithoutABuildOrDeviceSaysWhy) {
  StagedAdamWOptions o = TestOptions(DType::kBF16, CpuIsa::kAuto);
  o.engine = EngineKind::kCuda;
  std::vector<std::byte> w = Encode(Random(Size(o), 1, 1.0f), DType::kBF16);
  auto opt = StagedAdamW::Create(o, w);
  if (opt.ok()) GTEST_SKIP() << "a CUDA device is present; covered by the cuda-labelled tests";
  EXPECT_TRUE(opt.status().code() == absl::StatusCode::kUnimplemented ||
              opt.status().code() == absl::StatusCode::kFailedPrecondition)
      << opt.status();
  EXPECT_FALSE(opt.status().message().empty());
}

TEST(UnitTest, UnitsAreBoundedAndNeverCrossGroups) {
  StagedAdamWOptions o = TestOptions(DType::kBF16, CpuIsa::kAuto);
  auto opt = StagedAdamW::Create(o, Encode(Random(Size(o), 1, 1.0f), DType::kBF16));
  CKPT_ASSERT_OK(opt);
  uint64_t next = 0;
  for (const Unit& u : (*opt)->units()) {
    EXPECT_EQ(u.offset, next);
    EXPECT_LE(u.count, 64u);
    EXPECT_GT(u.count, 0u);
    next += u.count;
  }
  EXPECT_EQ(next, Size(o));
  // Piece boundaries where the group changes end a unit: pieces 0 (group 0) and 1 (group 1).
  EXPECT_EQ((*opt)->units()[1].count, 36u);  // 100 = 64 + 36, then group 1 begins.
  EXPECT_EQ((*opt)->units()[2].group, 1u);
}

}  // namespace
// Start-up runs on every core: slabs are zero-filled in 64 MiB chunks by a pool, and the
// weights are copied into the masters in blocks of 2^22 elements. A buffer of several chunks
// is zero everywhere, and masters across block and piece edges equal the weights converted.
TEST(StartupTest, SlabsAreZeroAndMastersEqualTheWeightsAcrossBlocks) {
  absl::StatusOr<internal::HostBuffer> big =
      internal::HostBuffer::Create((size_t{200} << 20) + 12345, internal::kSlabStagger, false);
  CKPT_ASSERT_OK(big);
  const std::byte* p = big->data();
  size_t nonzero = 0;
  for (size_t i = 0; i < big->size(); i += 4093) nonzero += p[i] != std::byte{0};
  nonzero += p[big->size() - 1] != std::byte{0};
  EXPECT_EQ(nonzero, 0u);

  const uint64_t n = (uint64_t{1} << 22) * 2 + 1001;  // Three blocks, the last partial.
  StagedAdamWOptions o;
  o.params = {{"a", {n}, DType::kBF16, 0}, {"b", {7}, DType::kBF16, 0}};
  o.groups = {ParamGroup{}};
  o.pieces = {{0, 0, n}, {1, 0, 7}};
  std::vector<uint16_t> weights(n + 7);
  for (uint64_t i = 0; i < weights.size(); ++i) {
    weights[i] = FloatToBf16(static_cast<float>(i % 9973) * 0.25f - 7.0f);
  }
  absl::StatusOr<std::unique_ptr<StagedAdamW>> opt =
      StagedAdamW::Create(o, std::as_bytes(std::span(weights)));
  CKPT_ASSERT_OK(opt);
  const std::span<const float> master = (*opt)->master();
  ASSERT_EQ(master.size(), weights.size());
  for (uint64_t i = 0; i < weights.size(); ++i) {
    ASSERT_EQ(master[i], Bf16ToFloat(weights[i])) << "element " << i;
  }
}

}  // namespace ckpt::optimizer
