// AMSGrad (torch's amsgrad=True), per param group: every instruction set and moment dtype
// gives the bits of a host emulation of torch's formula (x = max(x, v), the denominator from
// sqrt(x)); the max_exp_avg_sq slab exists once some group asks for it, and set, read, grown
// and checkpointed with the rest of the state (resume at any DP size, async save under steps,
// reshard); loads across amsgrad and no amsgrad are refused by name with nothing touched.
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "ckpt/formats/convert.h"
#include "ckpt/formats/float_convert.h"
#include "ckpt/optimizer/reshard.h"
#include "ckpt/optimizer/staged_adamw.h"
#include "ckpt/verify.h"
#include "optimizer/checkpointer_test_job.h"
#include "optimizer/cpu_kernels.h"
#include "optimizer/engine.h"
#include "tests/support/status_matchers.h"

namespace ckpt::optimizer {
namespace {

using formats::DType;
using test_job::ExpectAll;
using test_job::ExpectAllOk;
using test_job::Job;
using test_job::kRoot;
using testing::IsOk;
using testing::StatusIs;

// Group 0 with AMSGrad and a short second-moment memory (beta2 0.95, so v falls below its
// maximum within a few steps); group 1 without. Pieces cut tensors; units of 64 elements.
StagedAdamWOptions Options(DType model, CpuIsa isa, MomentDType moments) {
  StagedAdamWOptions o;
  o.params = {{"a", {37, 3}, model, 0},
              {"b", {1001}, model, 1},
              {"c", {17}, model, 0},
              {"d", {5, 129}, model, 1}};
  o.groups = {ParamGroup{.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8,
                         .weight_decay = 0.1, .amsgrad = true},
              ParamGroup{.lr = 3e-3, .beta1 = 0.8, .beta2 = 0.999, .eps = 1e-6,
                         .weight_decay = 0.0}};
  o.pieces = {{0, 5, 100}, {1, 0, 1001}, {2, 0, 17}, {3, 100, 400}, {0, 105, 6}};
  o.unit_bytes = 256;
  o.threads = 3;
  o.isa = isa;
  o.moment_dtype = moments;
  return o;
}

uint64_t Size(const StagedAdamWOptions& o) {
  uint64_t n = 0;
  for (const Piece& p : o.pieces) n += p.count;
  return n;
}

std::vector<float> Random(uint64_t n, uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> out(n);
  for (float& x : out) x = d(rng);
  return out;
}

std::vector<std::byte> Encode(const std::vector<float>& v, DType dtype) {
  std::vector<std::byte> out(v.size() * formats::DTypeSize(dtype));
  formats::Convert(DType::kF32, std::as_bytes(std::span(v)), dtype, out);
  return out;
}

// Step s's gradients: large in step 0, then smaller, zero on every third element, so that the
// second moment falls below its maximum.
std::vector<float> Gradients(uint64_t n, int s) {
  std::vector<float> g = Random(n, 100 + s, s == 0 ? 2.0f : 0.3f);
  for (size_t i = 0; i < n; i += 3) g[i] = 0.0f;
  return g;
}

struct State {
  std::vector<float> master, m, v, x;  // Moments widened to float.
  std::vector<std::byte> params;
};

std::vector<float> Widen(std::span<const std::byte> bytes, MomentDType moments) {
  std::vector<float> out(bytes.size() / MomentBytes(moments));
  formats::Convert(moments == MomentDType::kF32 ? DType::kF32 : DType::kBF16, bytes, DType::kF32,
                   std::as_writable_bytes(std::span(out)));
  return out;
}

State RunSteps(const StagedAdamWOptions& o, DType grad_dtype, int steps) {
  const uint64_t n = Size(o);
  const std::vector<std::byte> weights = Encode(Random(n, 1, 1.0f), o.params[0].dtype);
  auto opt = StagedAdamW::Create(o, weights);
  EXPECT_THAT(opt, IsOk());
  std::vector<std::byte> params(weights.size());
  for (int s = 0; s < steps; ++s) {
    const std::vector<std::byte> g = Encode(Gradients(n, s), grad_dtype);
    EXPECT_THAT((*opt)->Step({g.data(), grad_dtype, 1.5f, params.data()}), IsOk());
  }
  State r;
  r.master.assign((*opt)->master().begin(), (*opt)->master().end());
  r.m = Widen((*opt)->exp_avg_bytes(), o.moment_dtype);
  r.v = Widen((*opt)->exp_avg_sq_bytes(), o.moment_dtype);
  r.x = Widen((*opt)->max_exp_avg_sq_bytes(), o.moment_dtype);
  r.params = params;
  return r;
}

// torch's AdamW with amsgrad per group, one float operation at a time as the kernels run them
// (volatile: no FMA), each stored moment rounded to the slab's dtype.
State Emulate(const StagedAdamWOptions& o, DType grad_dtype, int steps) {
  const uint64_t n = Size(o);
  const DType model = o.params[0].dtype;
  const std::vector<std::byte> weights = Encode(Random(n, 1, 1.0f), model);
  auto stored = [&](float f) {
    return o.moment_dtype == MomentDType::kF32 ? f
                                               : formats::Bf16ToFloat(formats::FloatToBf16(f));
  };
  State r;
  r.master.resize(n);
  formats::Convert(model, weights, DType::kF32, std::as_writable_bytes(std::span(r.master)));
  r.m.assign(n, 0.0f);
  r.v.assign(n, 0.0f);
  r.x.assign(n, 0.0f);
  std::vector<uint32_t> group;
  for (const Piece& piece : o.pieces) {
    group.insert(group.end(), piece.count, o.params[piece.param].group);
  }
  for (int s = 0; s < steps; ++s) {
    std::vector<float> g(n);
    formats::Convert(grad_dtype, Encode(Gradients(n, s), grad_dtype), DType::kF32,
                     std::as_writable_bytes(std::span(g)));
    for (uint64_t i = 0; i < n; ++i) {
      const StepConstants c = ComputeStepConstants(o.groups[group[i]], s + 1);
      volatile float gs = g[i] * 1.5f;
      volatile float pd = r.master[i] * c.decay;
      volatile float mt = c.beta1 * r.m[i];
      volatile float mg = c.omb1 * gs;
      const float mm = mt + mg;
      volatile float vt = c.beta2 * r.v[i];
      volatile float gg = gs * gs;
      volatile float vg = c.omb2 * gg;
      const float vv = vt + vg;
      float d = vv;
      if (c.amsgrad) {
        d = std::max(r.x[i], vv);
        r.x[i] = stored(d);
      }
      volatile float den = std::sqrt(d) / c.bc2_sqrt + c.eps;
      volatile float num = c.step_size * mm;
      r.master[i] = pd - num / den;
      r.m[i] = stored(mm);
      r.v[i] = stored(vv);
    }
  }
  r.params = Encode(r.master, model);
  return r;
}

TEST(AmsgradTest, EveryIsaAndMomentDtypeGivesTheBitsOfTorchsFormula) {
  for (MomentDType moments : {MomentDType::kF32, MomentDType::kBF16}) {
    for (CpuIsa isa : {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
      if (!internal::CpuSupports(isa)) continue;
      for (DType model : {DType::kF32, DType::kBF16, DType::kF16}) {
        for (DType grad : {DType::kF32, DType::kBF16}) {
          SCOPED_TRACE(::testing::Message()
                       << internal::IsaName(isa) << ", " << formats::DTypeName(grad)
                       << " grads, " << formats::DTypeName(model) << " model, "
                       << (moments == MomentDType::kF32 ? "F32" : "BF16") << " moments");
          const StagedAdamWOptions o = Options(model, isa, moments);
          const State got = RunSteps(o, grad, 4);
          const State want = Emulate(o, grad, 4);
          ASSERT_EQ(std::memcmp(got.master.data(), want.master.data(), 4 * want.master.size()),
                    0);
          ASSERT_EQ(got.m, want.m);
          ASSERT_EQ(got.v, want.v);
          ASSERT_EQ(got.x, want.x);
          ASSERT_EQ(got.params, want.params);
        }
      }
    }
  }
  // The maximum matters in the run above, and only group 0 keeps one.
  const StagedAdamWOptions o = Options(DType::kBF16, CpuIsa::kAuto, MomentDType::kF32);
  const State s = RunSteps(o, DType::kF32, 4);
  uint64_t above = 0, at = 0;
  for (const Piece& piece : o.pieces) {
    for (uint64_t i = 0; i < piece.count; ++i, ++at) {
      if (o.params[piece.param].group == 1) {
        EXPECT_EQ(s.x[at], 0.0f) << "a group without amsgrad keeps no maximum";
      } else if (s.x[at] > s.v[at]) {
        ++above;
      }
    }
  }
  EXPECT_GT(above, 50u) << "the test's gradients must make the maximum differ from v";
}

TEST(AmsgradTest, TheSlabExistsOnlyOnceSomeGroupAsksForIt) {
  StagedAdamWOptions o = Options(DType::kBF16, CpuIsa::kAuto, MomentDType::kF32);
  o.groups[0].amsgrad = false;
  const std::vector<std::byte> weights = Encode(Random(Size(o), 1, 1.0f), DType::kBF16);
  auto opt = StagedAdamW::Create(o, weights);
  ASSERT_THAT(opt, IsOk());
  EXPECT_FALSE((*opt)->has_max_exp_avg_sq());
  EXPECT_TRUE((*opt)->max_exp_avg_sq_bytes().empty());
  ParamGroup g = o.groups[0];
  g.amsgrad = true;
  g.lr = 5.0;
  absl::Status refused = (*opt)->SetGroup(0, g);
  EXPECT_THAT(refused, StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_TRUE(absl::StrContains(refused.message(), "amsgrad")) << refused;
  EXPECT_EQ((*opt)->groups()[0].lr, o.groups[0].lr) << "a refused SetGroup changes nothing";
  std::vector<float> out((*opt)->size());
  EXPECT_THAT((*opt)->CopyStateAsF32(StagedAdamW::StateTensor::kMaxExpAvgSq, out),
              StatusIs(absl::StatusCode::kInvalidArgument));
  std::vector<float> zeros((*opt)->size(), 0.0f);
  std::vector<uint64_t> steps(o.params.size(), 0);
  EXPECT_THAT((*opt)->SetState({}, zeros, zeros, steps, zeros),
              StatusIs(absl::StatusCode::kInvalidArgument));

  // With the slab, a group may turn amsgrad off and on again (its maximum stays meanwhile).
  o.groups[0].amsgrad = true;
  auto with = StagedAdamW::Create(o, weights);
  ASSERT_THAT(with, IsOk());
  EXPECT_TRUE((*with)->has_max_exp_avg_sq());
  g.amsgrad = false;
  EXPECT_THAT((*with)->SetGroup(0, g), IsOk());
  EXPECT_FALSE((*with)->groups()[0].amsgrad);
  g.amsgrad = true;
  EXPECT_THAT((*with)->SetGroup(0, g), IsOk());
}

TEST(AmsgradTest, SetStateAndCopyStateCarryTheMaximumAndAddParamsKeepsIt) {
  const StagedAdamWOptions o = Options(DType::kBF16, CpuIsa::kAuto, MomentDType::kF32);
  const uint64_t n = Size(o);
  const std::vector<std::byte> weights = Encode(Random(n, 1, 1.0f), DType::kBF16);
  auto opt = StagedAdamW::Create(o, weights);
  ASSERT_THAT(opt, IsOk());
  std::vector<float> m = Random(n, 2, 0.1f), v(n), x(n);
  for (uint64_t i = 0; i < n; ++i) {
    v[i] = 0.01f * static_cast<float>(i % 7);
    x[i] = v[i] + 0.5f;
  }
  std::vector<uint64_t> steps(o.params.size(), 3);
  ASSERT_THAT((*opt)->SetState({}, m, v, steps, x), IsOk());
  std::vector<float> out(n);
  ASSERT_THAT((*opt)->CopyStateAsF32(StagedAdamW::StateTensor::kMaxExpAvgSq, out), IsOk());
  EXPECT_EQ(out, x);
  // Parameters added later start with no maximum; the others keep theirs bit for bit.
  const std::vector<std::byte> extra = Encode(Random(10, 3, 1.0f), DType::kBF16);
  ASSERT_THAT((*opt)->AddParams({{"e", {10}, DType::kBF16, 2}},
                                {ParamGroup{.lr = 1e-3}}, {{4, 0, 10}}, extra),
              IsOk());
  EXPECT_TRUE((*opt)->has_max_exp_avg_sq());
  out.assign(n + 10, -1.0f);
  ASSERT_THAT((*opt)->CopyStateAsF32(StagedAdamW::StateTensor::kMaxExpAvgSq, out), IsOk());
  EXPECT_TRUE(std::equal(x.begin(), x.end(), out.begin()));
  for (uint64_t i = n; i < n + 10; ++i) EXPECT_EQ(out[i], 0.0f);
  // An empty maximum in SetState zeroes it.
  std::vector<float> zeros(n + 10, 0.0f);
  std::vector<uint64_t> five(5, 0);
  ASSERT_THAT((*opt)->SetState({}, zeros, zeros, five), IsOk());
  ASSERT_THAT((*opt)->CopyStateAsF32(StagedAdamW::StateTensor::kMaxExpAvgSq, out), IsOk());
  EXPECT_EQ(out, zeros);
}

class AmsgradCheckpointTest : public ::testing::Test {
 protected:
  AmsgradCheckpointTest() : mem_(NewMemEnv()) {}
  std::unique_ptr<Job> NewJob(int dp, bool amsgrad, MomentDType moments = MomentDType::kF32,
                              const std::string& root = kRoot) {
    return std::make_unique<Job>(mem_.get(), dp, dp == 2 ? 500 : 300, testing::ToyModel(),
                                 moments, CheckpointerOptions{}, root, nullptr, amsgrad);
  }
  std::unique_ptr<Env> mem_;
};

TEST_F(AmsgradCheckpointTest, ResumesBitForBitAtAnyDataParallelSize) {
  for (MomentDType moments : {MomentDType::kF32, MomentDType::kBF16}) {
    const std::string root = moments == MomentDType::kF32 ? "/f32" : "/bf16";
    std::string want;
    {
      std::unique_ptr<Job> job = NewJob(2, true, moments, root);
      for (int s = 0; s < 3; ++s) job->Step(s);
      ExpectAllOk(job->Save(3));
      for (int s = 3; s < 5; ++s) job->Step(s);
      want = job->Gather();
    }
    for (int dp : {2, 1, 3}) {
      std::unique_ptr<Job> job = NewJob(dp, true, moments, root);
      ExpectAllOk(job->Load(std::nullopt));
      for (int s = 3; s < 5; ++s) job->Step(s);
      EXPECT_TRUE(job->Gather() == want) << "resumed at DP " << dp;
    }
    const std::unique_ptr<CheckpointReader> step = test_job::OpenStep(mem_.get(), root, 3);
    auto max = step->FindTensor("optimizer.max_exp_avg_sq.embed");
    ASSERT_THAT(max, IsOk());
    EXPECT_EQ((*max)->dtype, moments == MomentDType::kF32 ? DType::kF32 : DType::kBF16);
  }
}

TEST_F(AmsgradCheckpointTest, AnAsyncSaveUnderStepsKeepsTheMaximumOfItsStep) {
  std::string saved, after;
  {
    std::unique_ptr<Job> job = NewJob(2, true);
    for (int s = 0; s < 2; ++s) job->Step(s);
    saved = job->Gather();
    std::vector<absl::Status> started;
    std::vector<std::unique_ptr<PendingSave>> pending = job->SaveAsync(2, &started);
    ExpectAllOk(started);
    for (int s = 2; s < 4; ++s) job->Step(s);  // Through the fence: units copied aside.
    ExpectAllOk(job->Finalize(pending));
    after = job->Gather();
  }
  std::unique_ptr<Job> job = NewJob(2, true);
  ExpectAllOk(job->Load(2));
  EXPECT_TRUE(job->Gather() == saved) << "the save must hold the state of its step";
  for (int s = 2; s < 4; ++s) job->Step(s);
  EXPECT_TRUE(job->Gather() == after);
}

TEST_F(AmsgradCheckpointTest, LoadsAcrossAmsgradAreRefusedByNameTouchingNothing) {
  {
    std::unique_ptr<Job> with = NewJob(2, true, MomentDType::kF32, "/with");
    with->Step(0);
    ExpectAllOk(with->Save(1));
    std::unique_ptr<Job> without = NewJob(2, false, MomentDType::kF32, "/without");
    without->Step(0);
    ExpectAllOk(without->Save(1));
  }
  for (const auto& [root, amsgrad] : {std::pair{"/with", false}, std::pair{"/without", true}}) {
    std::unique_ptr<Job> job = NewJob(2, amsgrad, MomentDType::kF32, root);
    job->Step(0);
    job->Step(1);
    const std::string before = job->Gather();
    std::vector<absl::Status> st = job->Load(1);
    ExpectAll(st, absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(st[0].message(), "amsgrad")) << st[0];
    EXPECT_TRUE(job->Gather() == before);
  }
}

TEST_F(AmsgradCheckpointTest, ReshardCarriesTheMaximumToAnyDataParallelSize) {
  std::string state;
  {
    std::unique_ptr<Job> job = NewJob(2, true);
    for (int s = 0; s < 3; ++s) job->Step(s);
    ExpectAllOk(job->Save(3));
    state = job->Gather();
  }
  const std::unique_ptr<CheckpointReader> source = test_job::OpenStep(mem_.get(), kRoot, 3);
  ReshardOptions o;
  o.dp = 3;
  o.buckets = {.bucket_elems = 300, .pad_to = 8};
  o.store.env = mem_.get();
  o.store.chunk_bytes = 1000;
  ASSERT_THAT(Reshard(*source, "/dp3", o), IsOk());
  auto verified = VerifyStore(mem_.get(), "/dp3", std::nullopt, /*all=*/true);
  ASSERT_THAT(verified, IsOk());
  EXPECT_TRUE(verified->ok());
  std::unique_ptr<Job> job = NewJob(3, true, MomentDType::kF32, "/dp3");
  ExpectAllOk(job->Load(3));
  EXPECT_TRUE(job->Gather() == state);
}

}  // namespace
}  // namespace ckpt::optimizer
