// The overlapped step (docs/design/overlap.md) against the plain Step, bit for bit: each test
// runs the same steps on two optimizers built alike, one plainly and one overlapped, and
// compares weights, masters, moments and step counts after every step.
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "ckpt/base/status_macros.h"
#include "ckpt/optimizer/staged_adamw.h"
#include "optimizer/engine.h"
#include "optimizer/unit_fence.h"
#include "tests/support/status_matchers.h"
#include "tests/support/tensor_gen.h"

namespace ckpt::optimizer {

// Reaches StagedAdamW's engine (a friend): wraps it to inject failures.
class StagedAdamWPeer {
 public:
  template <typename Wrap>
  static void WrapEngine(StagedAdamW& opt, Wrap wrap) {
    opt.engine_ = wrap(std::move(opt.engine_));
  }
};

namespace {

using formats::DType;

// The engine it wraps, except that an armed Step call updates the first unit of its batch and
// then fails, as a device error part-way through a batch would.
class FailingEngine : public internal::Engine {
 public:
  explicit FailingEngine(std::unique_ptr<internal::Engine> inner) : inner_(std::move(inner)) {}
  bool armed = false;
  int failures = 0;

  absl::StatusOr<StepReport> Step(const StepArgs& args, const std::vector<Unit>& units,
                                  const StepPlan& plan, const SlabView& slabs,
                                  uint64_t elements) override {
    if (!armed || units.size() < 2) return inner_->Step(args, units, plan, slabs, elements);
    armed = false;
    ++failures;
    const std::vector<Unit> first(units.begin(), units.begin() + 1);
    CKPT_RETURN_IF_ERROR(inner_->Step(args, first, plan, slabs, elements).status());
    return absl::InternalError("injected: the engine failed after the batch's first unit");
  }
  absl::StatusOr<StepReport> CheckFinite(const StepArgs& args, const std::vector<Unit>& units,
                                         const StepPlan& plan, const SlabView& slabs,
                                         uint64_t elements) override {
    return inner_->CheckFinite(args, units, plan, slabs, elements);
  }
  absl::Status WriteWeights(const SlabView& slabs, const std::vector<Unit>& units,
                            const StepArgs& dest,
                            const std::optional<CudaStreamView>& stream) override {
    return inner_->WriteWeights(slabs, units, dest, stream);
  }
  void SetSpareCores(int cores) override { inner_->SetSpareCores(cores); }
  absl::Status Synchronize() override { return inner_->Synchronize(); }
  std::string name() const override { return inner_->name(); }

 private:
  std::unique_ptr<internal::Engine> inner_;
};
using testing::IsOk;
using testing::StatusIs;
using testing::StatusIsWith;

struct Variant {
  MomentDType moments;
  bool amsgrad;  // Group 1 keeps max_exp_avg_sq; group 0 does not.
  const char* name;
};

// Two groups; pieces that cut tensors; 64-element units that cut pieces.
StagedAdamWOptions Options(const Variant& v) {
  StagedAdamWOptions o;
  o.params = {{"a", {37, 3}, DType::kBF16, 0},
              {"b", {1001}, DType::kBF16, 1},
              {"c", {17}, DType::kF32, 0},
              {"d", {5, 129}, DType::kBF16, 1}};
  o.groups = {
      ParamGroup{.lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .weight_decay = 0.1f},
      ParamGroup{.lr = 3e-3f, .beta1 = 0.8f, .beta2 = 0.95f, .eps = 1e-6f, .weight_decay = 0.0f,
                 .amsgrad = v.amsgrad}};
  o.pieces = {{0, 5, 100}, {1, 0, 1001}, {2, 0, 17}, {3, 100, 400}, {0, 105, 6}};
  o.unit_bytes = 256;
  o.threads = 2;
  o.moment_dtype = v.moments;
  return o;
}

// One optimizer and its model: each piece's own gradient (FP32) and weight buffers.
struct Model {
  std::unique_ptr<StagedAdamW> opt;
  std::vector<std::vector<float>> grads;
  std::vector<std::vector<std::byte>> weights;

  std::vector<PieceBuffers> Buffers() {
    std::vector<PieceBuffers> b;
    for (size_t k = 0; k < grads.size(); ++k) b.push_back({grads[k].data(), weights[k].data()});
    return b;
  }
};

Model Build(const StagedAdamWOptions& o) {
  Model m;
  std::vector<std::byte> flat;
  for (size_t k = 0; k < o.pieces.size(); ++k) {
    const DType dtype = o.params[o.pieces[k].param].dtype;
    std::vector<std::byte> w =
        testing::EncodeFloats(testing::RandomNormal(o.pieces[k].count, 10 + k, 1.0f), dtype);
    // Each piece starts at a multiple of its element size in the flat buffer.
    flat.resize((flat.size() + 3) / 4 * 4);
    flat.insert(flat.end(), w.begin(), w.end());
    m.weights.push_back(w);
    m.grads.emplace_back(o.pieces[k].count, 0.0f);
  }
  auto opt = StagedAdamW::Create(o, flat);
  EXPECT_THAT(opt, IsOk());
  m.opt = std::move(*opt);
  return m;
}

// Gradients of step s for both models; `poison` puts a NaN into piece `poison_piece`.
void FillGradients(Model& a, Model& b, int s, int poison_piece = -1) {
  for (size_t k = 0; k < a.grads.size(); ++k) {
    std::vector<float> g = testing::RandomNormal(a.grads[k].size(), 1000 * s + k, 0.5f);
    if (static_cast<int>(k) == poison_piece) g[g.size() / 2] = std::nanf("");
    a.grads[k] = g;
    b.grads[k] = g;
  }
}

template <typename T>
std::vector<T> Copy(std::span<const T> s) {
  return std::vector<T>(s.begin(), s.end());
}

// Weights, masters, moments (their stored bytes) and step counts are the same bits.
void ExpectSame(Model& a, Model& b) {
  ASSERT_THAT(a.opt->Synchronize(), IsOk());
  ASSERT_THAT(b.opt->Synchronize(), IsOk());
  EXPECT_TRUE(a.weights == b.weights) << "weights differ";
  const std::span<const float> ma = a.opt->master(), mb = b.opt->master();
  EXPECT_EQ(0, std::memcmp(ma.data(), mb.data(), ma.size_bytes())) << "masters differ";
  EXPECT_EQ(Copy(a.opt->exp_avg_bytes()), Copy(b.opt->exp_avg_bytes()));
  EXPECT_EQ(Copy(a.opt->exp_avg_sq_bytes()), Copy(b.opt->exp_avg_sq_bytes()));
  EXPECT_EQ(Copy(a.opt->max_exp_avg_sq_bytes()), Copy(b.opt->max_exp_avg_sq_bytes()));
  EXPECT_EQ(a.opt->param_steps(), b.opt->param_steps());
}

StepArgs Final(float scale, bool check_finite = false, std::span<const uint8_t> stepped = {}) {
  StepArgs args;
  args.grad_dtype = DType::kF32;
  args.grad_scale = scale;
  args.check_finite = check_finite;
  args.stepped = stepped;
  return args;
}

// Backward's order: the pieces released last to first, one at a time.
std::vector<uint32_t> BackwardOrder(size_t pieces) {
  std::vector<uint32_t> order;
  for (size_t k = pieces; k-- > 0;) order.push_back(static_cast<uint32_t>(k));
  return order;
}

// An overlapped step of `m`: opened with `speculated_scale`, every piece in `order` released,
// finished with `final_args` (its pieces set to the model's).
absl::StatusOr<StepReport> Overlapped(Model& m, float speculated_scale, StepArgs final_args,
                                      const std::vector<uint32_t>& order) {
  StepArgs begin;
  begin.grad_dtype = DType::kF32;
  begin.grad_scale = speculated_scale;
  CKPT_ASSIGN_OR_RETURN(StagedAdamW::Overlap overlap, m.opt->BeginOverlap(begin));
  const std::vector<PieceBuffers> buffers = m.Buffers();
  for (uint32_t k : order) {
    CKPT_RETURN_IF_ERROR(overlap.Release({&k, 1}, {&buffers[k], 1}));
  }
  overlap.Drain();  // Every released unit speculated (Finish would otherwise take some).
  final_args.pieces = buffers;
  return overlap.Finish(final_args);
}

// An overlapped step of `m` opened with scale 1 and every piece released in backward's order;
// drained, so that every unit is speculated, unless `drain` is false.
absl::StatusOr<StagedAdamW::Overlap> OpenAndRelease(Model& m, bool drain = true) {
  StepArgs begin;
  begin.grad_dtype = DType::kF32;
  CKPT_ASSIGN_OR_RETURN(StagedAdamW::Overlap overlap, m.opt->BeginOverlap(begin));
  const std::vector<PieceBuffers> buffers = m.Buffers();
  for (uint32_t k : BackwardOrder(buffers.size())) {
    CKPT_RETURN_IF_ERROR(overlap.Release({&k, 1}, {&buffers[k], 1}));
  }
  if (drain) overlap.Drain();
  return overlap;
}

absl::StatusOr<StepReport> Plain(Model& m, StepArgs args) {
  const std::vector<PieceBuffers> buffers = m.Buffers();
  args.pieces = buffers;
  return m.opt->Step(args);
}

class OverlapTest : public ::testing::TestWithParam<Variant> {
 protected:
  void SetUp() override {
    options_ = Options(GetParam());
    plain_ = Build(options_);
    overlapped_ = Build(options_);
  }
  StagedAdamWOptions options_;
  Model plain_, overlapped_;
};

TEST_P(OverlapTest, HeldSpeculationEqualsThePlainStep) {
  for (int s = 0; s < 4; ++s) {
    FillGradients(plain_, overlapped_, s);
    ASSERT_THAT(Plain(plain_, Final(1.0f, true)), IsOk());
    auto report = Overlapped(overlapped_, 1.0f, Final(1.0f, true),
                             BackwardOrder(options_.pieces.size()));
    ASSERT_THAT(report, IsOk());
    EXPECT_TRUE(report->speculation_held);
    EXPECT_EQ(report->speculated_units, overlapped_.opt->units().size());
    ExpectSame(plain_, overlapped_);
  }
  EXPECT_GT(overlapped_.opt->spare_bytes(), 0u);
}

TEST_P(OverlapTest, AGateOnTheCpuEngineIsTheUngatedStep) {
  // The CPU engine's Finish has written every weight when it returns: nothing to await.
  for (int s = 0; s < 3; ++s) {
    FillGradients(plain_, overlapped_, s);
    ASSERT_THAT(Plain(plain_, Final(1.0f)), IsOk());
    StepArgs begin;
    begin.grad_dtype = DType::kF32;
    OverlapOptions options;
    options.gate = true;
    options.window = 1;
    auto overlap = overlapped_.opt->BeginOverlap(begin, options);
    ASSERT_THAT(overlap, IsOk());
    const std::vector<PieceBuffers> buffers = overlapped_.Buffers();
    for (uint32_t k : BackwardOrder(buffers.size()))
      ASSERT_THAT(overlap->Release({&k, 1}, {&buffers[k], 1}), IsOk());
    StepArgs final_args = Final(1.0f);
    final_args.pieces = buffers;
    auto report = overlap->Finish(final_args);
    ASSERT_THAT(report, IsOk());
    EXPECT_FALSE(report->gated);
    EXPECT_FALSE(overlapped_.opt->gate_open());
    const uint32_t piece = 0;
    EXPECT_THAT(overlapped_.opt->AwaitPieces({&piece, 1}, CudaStreamView::Legacy()), IsOk());
    const uint32_t missing = static_cast<uint32_t>(options_.pieces.size());
    EXPECT_THAT(overlapped_.opt->AwaitPieces({&missing, 1}, CudaStreamView::Legacy()),
                StatusIsWith(absl::StatusCode::kInvalidArgument, "does not exist"));
    EXPECT_THAT(overlapped_.opt->AwaitStep(CudaStreamView::Legacy()), IsOk());
    ExpectSame(plain_, overlapped_);
  }
}

TEST_P(OverlapTest, AGatedStepOnTheCpuEngineIsThePlainStep) {
  // StepArgs::gate: the CPU engine's Step has written every weight when it returns.
  for (int s = 0; s < 3; ++s) {
    FillGradients(plain_, overlapped_, s);
    ASSERT_THAT(Plain(plain_, Final(0.5f)), IsOk());
    const std::vector<PieceBuffers> buffers = overlapped_.Buffers();
    StepArgs gated = Final(0.5f);
    gated.pieces = buffers;
    gated.gate = true;
    auto report = overlapped_.opt->Step(gated);
    ASSERT_THAT(report, IsOk());
    EXPECT_FALSE(report->gated);
    EXPECT_FALSE(overlapped_.opt->gate_open());
    ExpectSame(plain_, overlapped_);
  }
}

TEST_P(OverlapTest, AnEngineFailingPartWayThroughABatchLeavesTheWeightsAsTheMasters) {
  // Piece 1 ("b", 1001 elements) lies in many 64-element units, all made ready by its one
  // Release: one batch, whose first unit the engine updates (weights written) before failing.
  // The abandoned step must put every weight of that batch back: the model equals the plain
  // optimizer's that has not stepped, and the next step equals its step.
  FailingEngine* failing = nullptr;
  StagedAdamWPeer::WrapEngine(*overlapped_.opt, [&](std::unique_ptr<internal::Engine> inner) {
    auto wrapped = std::make_unique<FailingEngine>(std::move(inner));
    failing = wrapped.get();
    return wrapped;
  });
  FillGradients(plain_, overlapped_, 0);
  const std::vector<std::vector<std::byte>> before = overlapped_.weights;
  failing->armed = true;
  absl::StatusOr<StepReport> report =
      Overlapped(overlapped_, 1.0f, Final(1.0f), BackwardOrder(options_.pieces.size()));
  EXPECT_THAT(report, StatusIsWith(absl::StatusCode::kInternal, "injected"));
  EXPECT_EQ(failing->failures, 1);
  ASSERT_THAT(overlapped_.opt->Synchronize(), IsOk());
  EXPECT_TRUE(overlapped_.weights == before) << "a weight the failed batch wrote stayed";
  ExpectSame(plain_, overlapped_);  // Neither has stepped.
  for (int s = 1; s < 3; ++s) {  // And the step goes on as the plain one.
    FillGradients(plain_, overlapped_, s);
    ASSERT_THAT(Plain(plain_, Final(1.0f)), IsOk());
    ASSERT_THAT(Overlapped(overlapped_, 1.0f, Final(1.0f), BackwardOrder(options_.pieces.size())),
                IsOk());
    ExpectSame(plain_, overlapped_);
  }
}

TEST_P(OverlapTest, FinishRacingTheFeederGivesTheSameBits) {
  // No Drain: Finish stops the feeder wherever it is and updates what it had not taken.
  for (int s = 0; s < 12; ++s) {
    FillGradients(plain_, overlapped_, s);
    const float scale = s % 3 == 2 ? 0.6f : 1.0f;
    ASSERT_THAT(Plain(plain_, Final(scale)), IsOk());
    auto overlap = OpenAndRelease(overlapped_, /*drain=*/false);
    ASSERT_THAT(overlap, IsOk());
    const std::vector<PieceBuffers> buffers = overlapped_.Buffers();
    StepArgs final_args = Final(scale);
    final_args.pieces = buffers;
    ASSERT_THAT(overlap->Finish(final_args), IsOk());
    ExpectSame(plain_, overlapped_);
  }
}

TEST_P(OverlapTest, ClippingThatFiresRedoesTheStepWithTheFinalScale) {
  const float clip[] = {1.0f, 0.37f, 1.0f, 0.81f};
  for (int s = 0; s < 4; ++s) {
    FillGradients(plain_, overlapped_, s);
    ASSERT_THAT(Plain(plain_, Final(clip[s])), IsOk());
    auto report = Overlapped(overlapped_, 1.0f, Final(clip[s]),
                             BackwardOrder(options_.pieces.size()));
    ASSERT_THAT(report, IsOk());
    EXPECT_EQ(report->speculation_held, clip[s] == 1.0f) << "step " << s;
    ExpectSame(plain_, overlapped_);
  }
}

TEST_P(OverlapTest, NonFiniteGradientsSkipTheStepAndPutTheWeightsBack) {
  FillGradients(plain_, overlapped_, 0);
  ASSERT_THAT(Plain(plain_, Final(1.0f, true)), IsOk());
  ASSERT_THAT(Overlapped(overlapped_, 1.0f, Final(1.0f, true),
                         BackwardOrder(options_.pieces.size())),
              IsOk());
  // The NaN is in the piece backward releases last: every other unit was speculated, and its
  // weights written, before the step turns out to be skipped.
  FillGradients(plain_, overlapped_, 1, /*poison_piece=*/0);
  auto plain = Plain(plain_, Final(1.0f, true));
  ASSERT_THAT(plain, IsOk());
  ASSERT_TRUE(plain->skipped);
  auto report = Overlapped(overlapped_, 1.0f, Final(1.0f, true),
                           BackwardOrder(options_.pieces.size()));
  ASSERT_THAT(report, IsOk());
  EXPECT_TRUE(report->skipped);
  EXPECT_EQ(report->nonfinite, plain->nonfinite);
  EXPECT_EQ(report->first_nonfinite, plain->first_nonfinite);
  EXPECT_GT(report->speculated_units, 0u);
  ExpectSame(plain_, overlapped_);
  // And the next step goes on as the plain one.
  FillGradients(plain_, overlapped_, 2);
  ASSERT_THAT(Plain(plain_, Final(1.0f, true)), IsOk());
  ASSERT_THAT(Overlapped(overlapped_, 1.0f, Final(1.0f, true),
                         BackwardOrder(options_.pieces.size())),
              IsOk());
  ExpectSame(plain_, overlapped_);
}

TEST_P(OverlapTest, AParameterWithoutAGradientIsLeftAsItIs) {
  // "c" (piece 2) is never released and not stepped: the units it lies in wait for Finish, and
  // the rest is committed; its state is copied across to the new side.
  const std::vector<uint8_t> stepped = {1, 1, 0, 1};
  for (int s = 0; s < 3; ++s) {
    FillGradients(plain_, overlapped_, s);
    ASSERT_THAT(Plain(plain_, Final(1.0f, false, stepped)), IsOk());
    auto report = Overlapped(overlapped_, 1.0f, Final(1.0f, false, stepped),
                             {4, 3, 1, 0});
    ASSERT_THAT(report, IsOk());
    EXPECT_TRUE(report->speculation_held);
    EXPECT_LT(report->speculated_units, overlapped_.opt->units().size());
    ExpectSame(plain_, overlapped_);
  }
  EXPECT_EQ(overlapped_.opt->param_steps()[2], 0u);
}

TEST_P(OverlapTest, AReleasedParameterThatIsNotSteppedRedoesTheStep) {
  const std::vector<uint8_t> stepped = {1, 0, 1, 1};
  FillGradients(plain_, overlapped_, 0);
  ASSERT_THAT(Plain(plain_, Final(1.0f, false, stepped)), IsOk());
  auto report = Overlapped(overlapped_, 1.0f, Final(1.0f, false, stepped),
                           BackwardOrder(options_.pieces.size()));
  ASSERT_THAT(report, IsOk());
  EXPECT_FALSE(report->speculation_held);
  ExpectSame(plain_, overlapped_);
}

TEST_P(OverlapTest, GradientsChangedInPlaceAfterReleaseRedoTheStep) {
  // torch's clip_grad_norm_ multiplies the gradients in place: the caller says so.
  FillGradients(plain_, overlapped_, 0);
  auto overlap = OpenAndRelease(overlapped_);
  ASSERT_THAT(overlap, IsOk());
  const std::vector<PieceBuffers> buffers = overlapped_.Buffers();
  for (Model* m : {&plain_, &overlapped_}) {
    for (auto& g : m->grads) {
      for (float& x : g) x *= 0.25f;
    }
  }
  overlap->Invalidate();
  StepArgs final_args = Final(1.0f);
  final_args.pieces = buffers;
  auto report = overlap->Finish(final_args);
  ASSERT_THAT(report, IsOk());
  EXPECT_FALSE(report->speculation_held);
  ASSERT_THAT(Plain(plain_, Final(1.0f)), IsOk());
  ExpectSame(plain_, overlapped_);
}

TEST_P(OverlapTest, ALearningRateChangedBeforeFinishRedoesTheStep) {
  FillGradients(plain_, overlapped_, 0);
  ParamGroup g = options_.groups[1];
  g.lr = 7e-3;
  ASSERT_THAT(plain_.opt->SetGroup(1, g), IsOk());
  ASSERT_THAT(Plain(plain_, Final(1.0f)), IsOk());
  auto overlap = OpenAndRelease(overlapped_);
  ASSERT_THAT(overlap, IsOk());
  const std::vector<PieceBuffers> buffers = overlapped_.Buffers();
  ASSERT_THAT(overlapped_.opt->SetGroup(1, g), IsOk());  // A scheduler between backward and step.
  StepArgs final_args = Final(1.0f);
  final_args.pieces = buffers;
  auto report = overlap->Finish(final_args);
  ASSERT_THAT(report, IsOk());
  EXPECT_FALSE(report->speculation_held);
  ExpectSame(plain_, overlapped_);
}

TEST_P(OverlapTest, ASecondBackwardIsRefusedAndTheWeightsAreTheMastersAgain) {
  FillGradients(plain_, overlapped_, 0);
  auto overlap = OpenAndRelease(overlapped_);
  ASSERT_THAT(overlap, IsOk());
  const std::vector<PieceBuffers> buffers = overlapped_.Buffers();
  EXPECT_FALSE(plain_.weights == overlapped_.weights);  // Speculation wrote them.
  uint32_t again = 3;
  EXPECT_THAT(overlap->Release({&again, 1}, {&buffers[again], 1}),
              StatusIsWith(absl::StatusCode::kFailedPrecondition, ("\"d\"")));
  EXPECT_FALSE(overlapped_.opt->overlap_open());
  ExpectSame(plain_, overlapped_);  // Nothing stepped, the weights back.
  EXPECT_THAT(overlap->Finish(Final(1.0f)),
              StatusIs(absl::StatusCode::kFailedPrecondition));
}

TEST_P(OverlapTest, AnAbandonedStepLeavesTheStateAndTheWeightsAsTheyWere) {
  FillGradients(plain_, overlapped_, 0);
  {
    StepArgs begin;
    begin.grad_dtype = DType::kF32;
    auto overlap = overlapped_.opt->BeginOverlap(begin);
    ASSERT_THAT(overlap, IsOk());
    const std::vector<PieceBuffers> buffers = overlapped_.Buffers();
    for (uint32_t k : {4u, 3u})
      ASSERT_THAT(overlap->Release({&k, 1}, {&buffers[k], 1}), IsOk());
    overlap->Drain();
    EXPECT_THAT(overlapped_.opt->Step(Final(1.0f)),
                StatusIsWith(absl::StatusCode::kFailedPrecondition, ("overlapped step is open")));
  }
  EXPECT_FALSE(overlapped_.opt->overlap_open());
  ExpectSame(plain_, overlapped_);
}

TEST_P(OverlapTest, FlatBuffersAndStepsWithoutSpeculationGiveTheSameBits) {
  // Flat buffers for a third optimizer built alike; the first step speculates nothing.
  std::vector<std::byte> flat;
  for (const auto& w : plain_.weights) {
    flat.resize((flat.size() + 3) / 4 * 4);
    flat.insert(flat.end(), w.begin(), w.end());
  }
  auto opt = StagedAdamW::Create(options_, flat);
  ASSERT_THAT(opt, IsOk());
  std::vector<float> grads((*opt)->size());
  for (int s = 0; s < 3; ++s) {
    FillGradients(plain_, overlapped_, s);
    ASSERT_THAT(Plain(plain_, Final(0.5f)), IsOk());
    size_t at = 0;
    for (const auto& g : plain_.grads) {
      std::copy(g.begin(), g.end(), grads.begin() + static_cast<ptrdiff_t>(at));
      at += g.size();
    }
    StepArgs args = Final(0.5f);
    args.grads = grads.data();
    args.params = flat.data();
    auto overlap = (*opt)->BeginOverlap(args, /*speculate=*/s > 0);
    ASSERT_THAT(overlap, IsOk());
    for (uint32_t k : BackwardOrder(options_.pieces.size()))
      ASSERT_THAT(overlap->Release({&k, 1}), IsOk());
    overlap->Drain();
    auto report = overlap->Finish(args);
    ASSERT_THAT(report, IsOk());
    EXPECT_EQ(report->speculation_held, s > 0);
    ASSERT_THAT((*opt)->Synchronize(), IsOk());
    const std::span<const float> ma = plain_.opt->master(), mb = (*opt)->master();
    EXPECT_EQ(0, std::memcmp(ma.data(), mb.data(), ma.size_bytes()));
    EXPECT_EQ(Copy(plain_.opt->exp_avg_sq_bytes()), Copy((*opt)->exp_avg_sq_bytes()));
  }
}

// A fence that lets every unit go at once, counting its calls.
class OpenFence : public internal::UnitFence {
 public:
  void Acquire(const std::vector<bool>& done, std::vector<size_t>* ready) override {
    ++calls;
    for (size_t i = 0; i < done.size(); ++i) {
      if (!done[i]) ready->push_back(i);
    }
  }
  int calls = 0;
};

TEST_P(OverlapTest, UnderAnAsyncSaveFenceUnitsWaitForFinishAndPassTheFence) {
  FillGradients(plain_, overlapped_, 0);
  ASSERT_THAT(Plain(plain_, Final(1.0f)), IsOk());
  OpenFence fence;
  {
    StagedAdamW::FenceScope scope = overlapped_.opt->InstallFence(&fence);
    auto report = Overlapped(overlapped_, 1.0f, Final(1.0f),
                             BackwardOrder(options_.pieces.size()));
    ASSERT_THAT(report, IsOk());
    EXPECT_EQ(report->speculated_units, 0u);
  }
  EXPECT_GT(fence.calls, 0);
  ExpectSame(plain_, overlapped_);
}

TEST_P(OverlapTest, WhatTheOpenStepRefuses) {
  StepArgs begin;
  begin.grad_dtype = DType::kF32;
  auto overlap = overlapped_.opt->BeginOverlap(begin);
  ASSERT_THAT(overlap, IsOk());
  EXPECT_THAT(overlapped_.opt->BeginOverlap(begin),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  std::vector<float> masters(overlapped_.opt->size(), 1.0f);
  EXPECT_THAT(overlapped_.opt->SetMasters(0, masters),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(overlapped_.opt->ReleaseDevice(), StatusIs(absl::StatusCode::kFailedPrecondition));
  uint32_t missing = 9;
  PieceBuffers b = overlapped_.Buffers()[0];
  EXPECT_THAT(overlap->Release({&missing, 1}, {&b, 1}),
              StatusIsWith(absl::StatusCode::kInvalidArgument, ("piece 9")));
  uint32_t k = 0;
  EXPECT_THAT(overlap->Release({&k, 1}), StatusIs(absl::StatusCode::kInvalidArgument));
  PieceBuffers null_grads{nullptr, b.params};
  EXPECT_THAT(overlap->Release({&k, 1}, {&null_grads, 1}),
              StatusIsWith(absl::StatusCode::kInvalidArgument, ("\"a\"")));
}

INSTANTIATE_TEST_SUITE_P(
    Moments, OverlapTest,
    ::testing::Values(Variant{MomentDType::kF32, false, "F32"},
                      Variant{MomentDType::kBF16, false, "BF16"},
                      Variant{MomentDType::kF32, true, "F32AmsGrad"},
                      Variant{MomentDType::kBF16, true, "BF16AmsGrad"}),
    [](const ::testing::TestParamInfo<Variant>& p) { return std::string(p.param.name); });

}  // namespace
}  // namespace ckpt::optimizer
