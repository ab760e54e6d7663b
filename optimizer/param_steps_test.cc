// Per parameter, as torch AdamW: a parameter without a gradient in a step (StepArgs::stepped)
// is left exactly as it is and its count does not advance, and each parameter's bias
// correction uses its own count; SetMasters, through which a trainer's in-place edit of a
// parameter reaches its master; and parameters of several dtypes in one optimizer.
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "ckpt/checkpoint_store.h"
#include "ckpt/coordinator.h"
#include "ckpt/env.h"
#include "ckpt/formats/convert.h"
#include "ckpt/formats/float_convert.h"
#include "ckpt/optimizer/checkpointer.h"
#include "ckpt/optimizer/staged_adamw.h"
#include "tests/support/status_matchers.h"

namespace ckpt::optimizer {
namespace {

using formats::DType;
using ::ckpt::testing::IsOk;
using ::ckpt::testing::StatusIs;

// Four parameters in two groups; "a" is cut into two pieces with another parameter's piece
// between them, and units of 64 elements cut every parameter.
StagedAdamWOptions Options(CpuIsa isa) {
  StagedAdamWOptions o;
  o.params = {{"a", {37, 3}, DType::kBF16, 0},
              {"b", {1001}, DType::kBF16, 1},
              {"c", {17}, DType::kBF16, 0},
              {"d", {5, 129}, DType::kBF16, 1}};
  o.groups = {ParamGroup{.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8,
                         .weight_decay = 0.1},
              ParamGroup{.lr = 3e-3, .beta1 = 0.8, .beta2 = 0.95, .eps = 1e-6,
                         .weight_decay = 0.05}};
  o.pieces = {{0, 5, 100}, {1, 0, 1001}, {2, 0, 17}, {3, 100, 400}, {0, 105, 6}};
  o.unit_bytes = 256;
  o.threads = 3;
  o.isa = isa;
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

std::vector<uint16_t> Bf16(const std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  formats::Convert(DType::kF32, std::as_bytes(std::span(v)), DType::kBF16,
                   std::as_writable_bytes(std::span(out)));
  return out;
}

// Which parameters have a gradient in each step of the tests' run: every combination of a
// skipped parameter within a group, a whole group skipped, none, and every parameter.
const std::vector<std::vector<uint8_t>> kMasks = {
    {1, 1, 1, 1}, {1, 0, 1, 1}, {0, 1, 1, 0}, {0, 0, 0, 0}, {1, 1, 0, 1}, {1, 1, 1, 0}};

// torch.optim.AdamW in double, each parameter with its own step count.
struct Reference {
  std::vector<double> p, m, v;
  std::vector<uint64_t> t;
  Reference(const StagedAdamWOptions& o, const std::vector<uint16_t>& weights)
      : m(Size(o), 0.0), v(Size(o), 0.0), t(o.params.size(), 0) {
    for (uint16_t w : weights) p.push_back(formats::Bf16ToFloat(w));
  }
  void Step(const StagedAdamWOptions& o, const std::vector<float>& g,
            const std::vector<uint8_t>& stepped) {
    uint64_t at = 0;
    for (const Piece& piece : o.pieces) {
      const ParamGroup& pg = o.groups[o.params[piece.param].group];
      const double t1 = static_cast<double>(t[piece.param] + 1);
      for (uint64_t i = at; i < at + piece.count && stepped[piece.param]; ++i) {
        p[i] *= 1.0 - pg.lr * pg.weight_decay;
        m[i] = pg.beta1 * m[i] + (1.0 - pg.beta1) * g[i];
        v[i] = pg.beta2 * v[i] + (1.0 - pg.beta2) * g[i] * g[i];
        const double bc1 = 1.0 - std::pow(pg.beta1, t1), bc2 = 1.0 - std::pow(pg.beta2, t1);
        p[i] -= pg.lr / bc1 * m[i] / (std::sqrt(v[i]) / std::sqrt(bc2) + pg.eps);
      }
      at += piece.count;
    }
    for (size_t i = 0; i < t.size(); ++i) t[i] += stepped[i] ? 1 : 0;
  }
};

// The run of kMasks through flat buffers and through each piece's own buffers (with null
// buffers for the pieces of parameters that are skipped), on the scalar and the widest ISA:
// skipped parameters keep every bit of their state and weights, counts are per parameter, and
// the result matches the per-parameter double reference.
TEST(ParamStepsTest, ASkippedParameterIsLeftExactlyAndKeepsItsOwnCount) {
  for (CpuIsa isa : {CpuIsa::kScalar, CpuIsa::kAuto}) {
    for (bool pieces : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "isa " << static_cast<int>(isa) << " pieces " << pieces);
      const StagedAdamWOptions o = Options(isa);
      const uint64_t n = Size(o);
      const std::vector<uint16_t> init = Bf16(Random(n, 7, 1.0f));
      auto made = StagedAdamW::Create(o, std::as_bytes(std::span(init)));
      ASSERT_THAT(made, IsOk());
      StagedAdamW& opt = **made;
      Reference ref(o, init);
      std::vector<uint16_t> params = init;
      for (size_t s = 0; s < kMasks.size(); ++s) {
        const std::vector<uint8_t>& mask = kMasks[s];
        const std::vector<float> g = Random(n, 100 + static_cast<uint32_t>(s), 0.3f);
        const std::vector<float> master_before(opt.master().begin(), opt.master().end());
        const std::vector<float> m_before(opt.exp_avg().begin(), opt.exp_avg().end());
        const std::vector<uint16_t> params_before = params;
        StepArgs args;
        args.grad_dtype = DType::kF32;
        args.stepped = mask;
        std::vector<PieceBuffers> buffers;
        if (pieces) {
          uint64_t at = 0;
          for (const Piece& p : o.pieces) {
            if (mask[p.param]) buffers.push_back({g.data() + at, params.data() + at});
            else buffers.push_back({nullptr, nullptr});
            at += p.count;
          }
          args.pieces = buffers;
        } else {
          args.grads = g.data();
          args.params = params.data();
        }
        auto report = opt.Step(args);
        ASSERT_THAT(report, IsOk());
        ASSERT_FALSE(report->skipped);
        ref.Step(o, g, mask);
        uint64_t at = 0;
        for (const Piece& p : o.pieces) {
          for (uint64_t i = at; i < at + p.count && !mask[p.param]; ++i) {
            ASSERT_EQ(params[i], params_before[i]) << "step " << s << " element " << i;
            ASSERT_EQ(opt.master()[i], master_before[i]) << "step " << s << " element " << i;
            ASSERT_EQ(opt.exp_avg()[i], m_before[i]) << "step " << s << " element " << i;
          }
          at += p.count;
        }
      }
      EXPECT_EQ(opt.param_steps(), ref.t);
      EXPECT_EQ(opt.param_steps(), (std::vector<uint64_t>{4, 4, 4, 3}));
      EXPECT_EQ(opt.groups()[0].step, 4u);  // The largest count of its parameters.
      EXPECT_EQ(opt.groups()[1].step, 4u);
      double worst = 0;
      for (uint64_t i = 0; i < n; ++i) {
        if (std::abs(ref.p[i]) < 0.05) continue;
        worst = std::max(worst, std::abs(opt.master()[i] - ref.p[i]) / std::abs(ref.p[i]));
        ASSERT_EQ(params[i], formats::FloatToBf16(opt.master()[i])) << i;
      }
      EXPECT_LE(worst, 2e-6);
    }
  }
}

TEST(ParamStepsTest, AMaskOfTheWrongSizeIsRefusedWithTheStateUntouched) {
  const StagedAdamWOptions o = Options(CpuIsa::kAuto);
  const std::vector<uint16_t> init = Bf16(Random(Size(o), 7, 1.0f));
  auto opt = StagedAdamW::Create(o, std::as_bytes(std::span(init)));
  ASSERT_THAT(opt, IsOk());
  std::vector<float> g(Size(o), 0.1f);
  std::vector<uint16_t> params = init;
  const std::vector<uint8_t> three = {1, 1, 1};
  StepArgs args{g.data(), DType::kF32, 1.0f, params.data()};
  args.stepped = three;
  EXPECT_THAT((*opt)->Step(args), StatusIs(absl::StatusCode::kInvalidArgument));
  // A stepped parameter's piece with a null buffer is refused, naming it.
  const std::vector<uint8_t> mask = {0, 1, 0, 0};
  std::vector<PieceBuffers> buffers(o.pieces.size());
  StepArgs own;
  own.pieces = buffers;
  own.stepped = mask;
  auto refused = (*opt)->Step(own);
  EXPECT_THAT(refused, StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(std::string(refused.status().message()), ::testing::HasSubstr("(b)"));
  EXPECT_EQ((*opt)->param_steps(), (std::vector<uint64_t>{0, 0, 0, 0}));
  EXPECT_EQ(params, init);
}

// A parameter of no elements (torch steps one: its state is its step count) has one empty
// piece, with null buffers: it is counted as the others are, in plain and overlapped steps,
// and changes nothing else; an empty piece of a parameter with elements is still refused.
TEST(ParamStepsTest, AParameterOfNoElementsHasAnEmptyPieceAndItsOwnCount) {
  // "e" lies inside a unit of 64 elements, [256, 320), between "a" and "b".
  StagedAdamWOptions without = Options(CpuIsa::kAuto);
  without.params = {{"a", {300}, DType::kBF16, 0}, {"b", {3, 100}, DType::kBF16, 0}};
  without.pieces = {{0, 0, 300}, {1, 0, 300}};
  without.groups.resize(1);
  StagedAdamWOptions with = without;
  with.params.insert(with.params.begin() + 1, {"e", {0, 5}, DType::kBF16, 0});
  with.pieces = {{0, 0, 300}, {1, 0, 0}, {2, 0, 300}};
  const std::vector<uint16_t> init = Bf16(Random(Size(with), 7, 1.0f));
  auto a = StagedAdamW::Create(with, std::as_bytes(std::span(init)));
  auto b = StagedAdamW::Create(without, std::as_bytes(std::span(init)));
  ASSERT_THAT(a, IsOk());
  ASSERT_THAT(b, IsOk());
  std::vector<uint16_t> pa = init, pb = init;
  const std::vector<float> g = Random(Size(with), 9, 0.1f);
  // Per-piece buffers into the flat arrays; the empty piece's stay null.
  std::vector<PieceBuffers> buffers;
  uint64_t at = 0;
  for (const Piece& piece : with.pieces) {
    buffers.push_back(piece.count == 0 ? PieceBuffers{}
                                       : PieceBuffers{g.data() + at, pa.data() + at});
    at += piece.count;
  }
  StepArgs plain;
  plain.pieces = buffers;
  ASSERT_THAT((*a)->Step(plain), IsOk());
  ASSERT_THAT((*b)->Step({g.data(), DType::kF32, 1.0f, pb.data()}), IsOk());
  EXPECT_EQ(pa, pb);
  EXPECT_EQ((*a)->param_steps(), (std::vector<uint64_t>{1, 1, 1}));
  // Overlapped, "e" released first (a hook runs for it too); then a step that skips it.
  for (const std::vector<uint8_t>& mask :
       {std::vector<uint8_t>{1, 1, 1}, std::vector<uint8_t>{1, 0, 1}}) {
    auto ov = (*a)->BeginOverlap(plain);
    ASSERT_THAT(ov, IsOk());
    for (uint32_t k : {1u, 2u, 0u}) ASSERT_THAT(ov->Release({&k, 1}), IsOk());
    ov->Drain();
    StepArgs finish = plain;
    finish.stepped = mask;
    auto report = ov->Finish(finish);
    ASSERT_THAT(report, IsOk());
    // No unit holds "e": whether it is stepped changes no unit's update.
    EXPECT_TRUE(report->speculation_held);
    ASSERT_THAT((*b)->Step({g.data(), DType::kF32, 1.0f, pb.data()}), IsOk());
    EXPECT_EQ(pa, pb);
  }
  EXPECT_EQ((*a)->param_steps(), (std::vector<uint64_t>{3, 2, 3}));
  StagedAdamWOptions bad = without;
  bad.pieces = {{0, 0, 300}, {1, 0, 0}, {1, 0, 300}};
  auto refused = StagedAdamW::Create(bad, std::as_bytes(std::span(init)));
  EXPECT_THAT(refused, StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(std::string(refused.status().message()), ::testing::HasSubstr("\"b\" is empty"));
}

// A trainer's in-place edit of a parameter reaches its master through SetMasters: the next step
// continues from the edited value, as torch AdamW continues from the edited parameter, while
// the moments and counts stay.
TEST(SetMastersTest, TheNextStepContinuesFromTheMastersSet) {
  const StagedAdamWOptions o = Options(CpuIsa::kAuto);
  const uint64_t n = Size(o);
  const std::vector<uint16_t> init = Bf16(Random(n, 7, 1.0f));
  auto edited = StagedAdamW::Create(o, std::as_bytes(std::span(init)));
  ASSERT_THAT(edited, IsOk());
  std::vector<uint16_t> params = init;
  const std::vector<float> g0 = Random(n, 1, 0.3f), g1 = Random(n, 2, 0.3f);
  ASSERT_THAT((*edited)->Step({g0.data(), DType::kF32, 1.0f, params.data()}), IsOk());
  // Elements [100, 1101) are parameter b: set them to twice their value.
  std::vector<float> doubled((*edited)->master().begin() + 100,
                             (*edited)->master().begin() + 1101);
  for (float& x : doubled) x *= 2;
  const std::vector<float> m_before((*edited)->exp_avg().begin(), (*edited)->exp_avg().end());
  ASSERT_THAT((*edited)->SetMasters(100, doubled), IsOk());
  EXPECT_EQ(std::vector<float>((*edited)->exp_avg().begin(), (*edited)->exp_avg().end()),
            m_before);
  EXPECT_EQ((*edited)->master()[100], doubled[0]);
  // The same state reached by SetState: the next steps are equal bit for bit.
  auto reference = StagedAdamW::Create(o, std::as_bytes(std::span(init)));
  ASSERT_THAT(reference, IsOk());
  std::vector<float> master((*edited)->master().begin(), (*edited)->master().end());
  std::vector<float> v((*edited)->exp_avg_sq().begin(), (*edited)->exp_avg_sq().end());
  ASSERT_THAT((*reference)->SetState(master, m_before, v, (*edited)->param_steps()), IsOk());
  std::vector<uint16_t> params_ref = params;
  ASSERT_THAT((*edited)->Step({g1.data(), DType::kF32, 1.0f, params.data()}), IsOk());
  ASSERT_THAT((*reference)->Step({g1.data(), DType::kF32, 1.0f, params_ref.data()}), IsOk());
  EXPECT_EQ(params, params_ref);
  EXPECT_EQ(std::memcmp((*edited)->master().data(), (*reference)->master().data(), n * 4), 0);
}

TEST(SetMastersTest, OutOfRangeOrNonFiniteValuesAreRefusedWithTheMastersUntouched) {
  const StagedAdamWOptions o = Options(CpuIsa::kAuto);
  const uint64_t n = Size(o);
  const std::vector<uint16_t> init = Bf16(Random(n, 7, 1.0f));
  auto opt = StagedAdamW::Create(o, std::as_bytes(std::span(init)));
  ASSERT_THAT(opt, IsOk());
  const std::vector<float> before((*opt)->master().begin(), (*opt)->master().end());
  std::vector<float> two(2, 1.0f);
  EXPECT_THAT((*opt)->SetMasters(n - 1, two), StatusIs(absl::StatusCode::kInvalidArgument));
  two[1] = std::nanf("");
  const absl::Status nan = (*opt)->SetMasters(10, two);
  EXPECT_THAT(nan, StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(std::string(nan.message()), ::testing::HasSubstr("slab element 11"));
  {
    StagedAdamW::LoadScope scope = (*opt)->BeginLoad();
    EXPECT_THAT((*opt)->SetMasters(0, std::vector<float>(1, 1.0f)),
                StatusIs(absl::StatusCode::kFailedPrecondition));
    scope.RolledBack();
  }
  EXPECT_EQ(std::vector<float>((*opt)->master().begin(), (*opt)->master().end()), before);
}

// Parameters of FP32, BF16 and FP16 in one optimizer, pieces in slab order in a flat buffer with
// each piece at a multiple of its element size.
StagedAdamWOptions MixedOptions(CpuIsa isa) {
  StagedAdamWOptions o = Options(isa);
  o.params[0].dtype = DType::kF32;
  o.params[2].dtype = DType::kF16;
  return o;
}

// The flat model-weight buffer of `o` from FP32 values (each rounded to its piece's dtype),
// with the byte offset of each piece; `widened` receives the values each weight holds.
std::vector<std::byte> MixedWeights(const StagedAdamWOptions& o, const std::vector<float>& values,
                                    std::vector<uint64_t>* offsets, std::vector<float>* widened) {
  std::vector<std::byte> out;
  uint64_t at = 0;
  widened->clear();
  for (const Piece& p : o.pieces) {
    const DType d = o.params[p.param].dtype;
    const size_t size = formats::DTypeSize(d);
    out.resize((out.size() + size - 1) / size * size);
    offsets->push_back(out.size());
    out.resize(out.size() + p.count * size);
    const std::span<std::byte> piece(out.data() + offsets->back(), p.count * size);
    formats::Convert(DType::kF32, std::as_bytes(std::span(values).subspan(at, p.count)), d, piece);
    std::vector<float> back(p.count);
    formats::Convert(d, piece, DType::kF32, std::as_writable_bytes(std::span(back)));
    widened->insert(widened->end(), back.begin(), back.end());
    at += p.count;
  }
  return out;
}

// Each element's update does not depend on its parameter's dtype: a mixed optimizer's masters
// equal, bit for bit, those of an FP32 optimizer started from the same values, through flat
// buffers and through each piece's own, and each weight is its master rounded to its dtype.
TEST(MixedDtypesTest, EachParameterIsSteppedAndWrittenInItsOwnDtype) {
  for (CpuIsa isa : {CpuIsa::kScalar, CpuIsa::kAuto}) {
    for (bool pieces : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "isa " << static_cast<int>(isa) << " pieces " << pieces);
      const StagedAdamWOptions o = MixedOptions(isa);
      const uint64_t n = Size(o);
      std::vector<uint64_t> offsets;
      std::vector<float> widened;
      std::vector<std::byte> weights = MixedWeights(o, Random(n, 7, 1.0f), &offsets, &widened);
      auto mixed = StagedAdamW::Create(o, weights);
      ASSERT_THAT(mixed, IsOk());
      EXPECT_TRUE((*mixed)->mixed_dtypes());
      EXPECT_EQ((*mixed)->weight_bytes(), weights.size());
      StagedAdamWOptions f32 = o;
      for (ParamSpec& p : f32.params) p.dtype = DType::kF32;
      auto reference = StagedAdamW::Create(f32, std::as_bytes(std::span(widened)));
      ASSERT_THAT(reference, IsOk());
      std::vector<float> ref_params(n);
      for (int s = 0; s < 3; ++s) {
        const std::vector<float> g = Random(n, 100 + static_cast<uint32_t>(s), 0.3f);
        StepArgs args{g.data(), DType::kF32, 1.0f, weights.data()};
        std::vector<PieceBuffers> buffers;
        if (pieces) {
          uint64_t at = 0;
          for (size_t k = 0; k < o.pieces.size(); ++k) {
            buffers.push_back({g.data() + at, weights.data() + offsets[k]});
            at += o.pieces[k].count;
          }
          args.pieces = buffers;
        }
        ASSERT_THAT((*mixed)->Step(args), IsOk());
        ASSERT_THAT((*reference)->Step({g.data(), DType::kF32, 1.0f, ref_params.data()}), IsOk());
      }
      ASSERT_EQ(std::memcmp((*mixed)->master().data(), (*reference)->master().data(), 4 * n), 0);
      std::vector<uint64_t> unused;
      std::vector<float> written;
      EXPECT_EQ(MixedWeights(o, ref_params, &unused, &written), weights);
      // WriteModelWeights writes the same, flat and into each piece's own buffer.
      std::vector<std::byte> flat(weights.size()), own(weights.size());
      ASSERT_THAT((*mixed)->WriteModelWeights(flat.data()), IsOk());
      EXPECT_EQ(flat, weights);
      std::vector<PieceBuffers> dest;
      for (size_t k = 0; k < o.pieces.size(); ++k) dest.push_back({nullptr, own.data() + offsets[k]});
      ASSERT_THAT((*mixed)->WriteModelWeights(dest), IsOk());
      EXPECT_EQ(own, weights);
    }
  }
}

// A checkpoint of a mixed optimizer stores each parameter's weights in its own dtype, and a
// load (sync or async save) brings back every master and count.
TEST(MixedDtypesTest, CheckpointsKeepEachParametersDtype) {
  const StagedAdamWOptions o = MixedOptions(CpuIsa::kAuto);
  const uint64_t n = Size(o);
  std::vector<uint64_t> offsets;
  std::vector<float> widened;
  std::vector<std::byte> weights = MixedWeights(o, Random(n, 7, 1.0f), &offsets, &widened);
  std::unique_ptr<Env> mem = NewMemEnv();
  StoreOptions so;
  so.env = mem.get();
  auto store = CheckpointStore::Open("/store", so);
  ASSERT_THAT(store, IsOk());
  SingleProcessCoordinator solo;
  auto opt = StagedAdamW::Create(o, weights);
  ASSERT_THAT(opt, IsOk());
  auto ckpt = Checkpointer::Create(opt->get(), store->get(), &solo, {});
  ASSERT_THAT(ckpt, IsOk());
  const std::vector<float> g = Random(n, 3, 0.3f);
  const std::vector<uint8_t> mask = {1, 1, 0, 1};
  StepArgs args{g.data(), DType::kF32, 1.0f, weights.data()};
  args.stepped = mask;
  ASSERT_THAT((*opt)->Step(args), IsOk());
  ASSERT_THAT((*ckpt)->Save(1), IsOk());
  auto pending = (*ckpt)->SaveAsync(2);
  ASSERT_THAT(pending, IsOk());
  ASSERT_THAT((*pending)->Finalize(), IsOk());
  for (uint64_t step : {1, 2}) {
    auto reader = (*store)->OpenStep(step);
    ASSERT_THAT(reader, IsOk());
    for (const ParamSpec& p : o.params) {
      auto info = (*reader)->FindTensor(p.name);
      ASSERT_THAT(info, IsOk());
      EXPECT_EQ((*info)->dtype, p.dtype) << p.name;
    }
    // Parameter "a" (F32): its weights are its masters.
    std::vector<float> a(100);
    ASSERT_THAT((*reader)->ReadRange("a", 5, 100, std::as_writable_bytes(std::span(a))), IsOk());
    EXPECT_EQ(std::memcmp(a.data(), (*opt)->master().data(), 400), 0);
    std::vector<uint64_t> unused;
    auto fresh = StagedAdamW::Create(o, MixedWeights(o, Random(n, 9, 1.0f), &unused, &widened));
    ASSERT_THAT(fresh, IsOk());
    auto loader = Checkpointer::Create(fresh->get(), store->get(), &solo, {});
    ASSERT_THAT(loader, IsOk());
    ASSERT_THAT((*loader)->Load(step).status(), IsOk());
    EXPECT_EQ(std::memcmp((*fresh)->master().data(), (*opt)->master().data(), 4 * n), 0);
    EXPECT_EQ((*fresh)->param_steps(), (std::vector<uint64_t>{1, 1, 0, 1}));
    std::vector<std::byte> back(weights.size());
    ASSERT_THAT((*fresh)->WriteModelWeights(back.data()), IsOk());
    EXPECT_EQ(back, weights);
  }
}

// Parameters added after some steps (torch's add_param_group) start fresh: the run equals, bit
// for bit, one that had them from the start and skipped them until then; the earlier
// parameters' state is kept exactly through the growth of the slabs.
TEST(AddParamsTest, AddedParametersStartFreshAndTheOthersKeepTheirState) {
  const StagedAdamWOptions all = MixedOptions(CpuIsa::kAuto);
  const uint64_t n = Size(all);
  std::vector<uint64_t> offsets;
  std::vector<float> widened;
  std::vector<std::byte> weights = MixedWeights(all, Random(n, 7, 1.0f), &offsets, &widened);
  // "a", "b" and "c" (each whole) first; "d" is added after two steps.
  StagedAdamWOptions whole = all;
  whole.pieces = {{0, 0, 111}, {1, 0, 1001}, {2, 0, 17}, {3, 100, 400}};
  StagedAdamWOptions first = whole;
  first.params.resize(3);
  first.pieces.resize(3);
  first.groups = {whole.groups[0], whole.groups[1]};
  const std::vector<float> values = Random(Size(whole), 11, 1.0f);
  std::vector<float> unused_widened;
  std::vector<uint64_t> whole_offsets, first_offsets, d_offsets;
  std::vector<std::byte> whole_weights = MixedWeights(whole, values, &whole_offsets, &unused_widened);
  std::vector<std::byte> first_weights =
      MixedWeights(first, std::vector<float>(values.begin(), values.end() - 400), &first_offsets,
                   &unused_widened);
  StagedAdamWOptions d_only = whole;
  d_only.pieces = {{3, 100, 400}};
  std::vector<std::byte> d_weights = MixedWeights(
      d_only, std::vector<float>(values.end() - 400, values.end()), &d_offsets, &unused_widened);
  auto grown = StagedAdamW::Create(first, first_weights);
  auto reference = StagedAdamW::Create(whole, whole_weights);
  ASSERT_THAT(grown, IsOk());
  ASSERT_THAT(reference, IsOk());
  const uint64_t total = Size(whole);
  std::vector<std::byte> ref_params(whole_weights.size());
  const std::vector<uint8_t> without_d = {1, 1, 1, 0};
  for (int s = 0; s < 4; ++s) {
    const std::vector<float> g = Random(total, 50 + static_cast<uint32_t>(s), 0.3f);
    if (s == 2) {
      ASSERT_THAT((*grown)->AddParams({whole.params[3]}, {}, {{3, 100, 400}}, d_weights), IsOk());
      EXPECT_EQ((*grown)->size(), total);
      EXPECT_EQ((*grown)->param_steps(), (std::vector<uint64_t>{2, 2, 2, 0}));
    }
    std::vector<std::byte> params((*grown)->weight_bytes());
    StepArgs args{g.data(), DType::kF32, 1.0f, params.data()};
    ASSERT_THAT((*grown)->Step(args), IsOk());
    StepArgs ref{g.data(), DType::kF32, 1.0f, ref_params.data()};
    if (s < 2) ref.stepped = without_d;
    ASSERT_THAT((*reference)->Step(ref), IsOk());
  }
  EXPECT_EQ((*grown)->param_steps(), (*reference)->param_steps());
  EXPECT_EQ(std::memcmp((*grown)->master().data(), (*reference)->master().data(), 4 * total), 0);
  EXPECT_EQ(std::memcmp((*grown)->exp_avg().data(), (*reference)->exp_avg().data(), 4 * total), 0);
  // Refused with the optimizer unchanged: a name taken, weights of the wrong size, a piece of a
  // parameter that does not exist.
  const std::vector<float> before((*grown)->master().begin(), (*grown)->master().end());
  EXPECT_THAT((*grown)->AddParams({whole.params[3]}, {}, {{4, 0, 400}}, d_weights),
              StatusIs(absl::StatusCode::kInvalidArgument));
  ParamSpec e{"e", {8}, DType::kF32, 0};
  EXPECT_THAT((*grown)->AddParams({e}, {}, {{4, 0, 8}}, std::vector<std::byte>(31)),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT((*grown)->AddParams({e}, {}, {{5, 0, 8}}, std::vector<std::byte>(32)),
              StatusIs(absl::StatusCode::kInvalidArgument));
  ParamSpec e_in_new_group{"e", {8}, DType::kF32, 2};
  EXPECT_THAT((*grown)->AddParams({e_in_new_group}, {}, {{4, 0, 8}}, std::vector<std::byte>(32)),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(std::vector<float>((*grown)->master().begin(), (*grown)->master().end()), before);
  EXPECT_EQ((*grown)->size(), total);
  // And a new group with it.
  ASSERT_THAT((*grown)->AddParams({e_in_new_group}, {ParamGroup{.lr = 1e-3}}, {{4, 0, 8}},
                                  std::vector<std::byte>(32)),
              IsOk());
  EXPECT_EQ((*grown)->groups().size(), 3u);
  EXPECT_EQ((*grown)->size(), total + 8);
}

TEST(AddParamsTest, RefusedWhileAnAsyncSaveIsInFlight) {
  const StagedAdamWOptions o = Options(CpuIsa::kAuto);
  const std::vector<uint16_t> init = Bf16(Random(Size(o), 7, 1.0f));
  auto opt = StagedAdamW::Create(o, std::as_bytes(std::span(init)));
  ASSERT_THAT(opt, IsOk());
  std::unique_ptr<Env> mem = NewMemEnv();
  StoreOptions so;
  so.env = mem.get();
  auto store = CheckpointStore::Open("/store", so);
  ASSERT_THAT(store, IsOk());
  SingleProcessCoordinator solo;
  auto ckpt = Checkpointer::Create(opt->get(), store->get(), &solo, {});
  ASSERT_THAT(ckpt, IsOk());
  auto pending = (*ckpt)->SaveAsync(1);
  ASSERT_THAT(pending, IsOk());
  const ParamSpec e{"e", {8}, DType::kBF16, 0};
  EXPECT_THAT((*opt)->AddParams({e}, {}, {{4, 0, 8}}, std::vector<std::byte>(16)),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  ASSERT_THAT((*pending)->Finalize(), IsOk());
  EXPECT_THAT((*opt)->AddParams({e}, {}, {{4, 0, 8}}, std::vector<std::byte>(16)), IsOk());
  // The Checkpointer saves and loads the grown state.
  ASSERT_THAT((*ckpt)->Save(2), IsOk());
  ASSERT_THAT((*ckpt)->Load(2).status(), IsOk());
  EXPECT_EQ((*opt)->options().params.size(), 5u);
}

}  // namespace
}  // namespace ckpt::optimizer
