// Adafactor (docs/design/adafactor.md): each step matches torch's algorithm computed here in
// double (within the documented tolerance), for matrices (factored), tensors of three
// dimensions (batched factors), vectors and scalars (whole variance), with weight decay,
// maximize, eps1 and clipping; its state (the master and row_var / col_var / variance, shaped
// unlike the parameter) is saved, async-saved under steps, resharded 1 -> 3 -> 2 and loaded at
// two ranks, and a failed load rolls it back, each bit for bit; bad hyper-parameters and
// parameters are refused by name.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "ckpt/checkpoint_reader.h"
#include "ckpt/checkpoint_store.h"
#include "ckpt/coordinator.h"
#include "ckpt/env.h"
#include "ckpt/formats/chunk.h"
#include "ckpt/formats/optimizer_record.h"
#include "ckpt/optimizer/checkpointer.h"
#include "ckpt/optimizer/reshard.h"
#include "ckpt/optimizer/staged_adamw.h"
#include "tests/support/status_matchers.h"

namespace ckpt::optimizer {
namespace {

using formats::DType;
using testing::IsOk;
using testing::StatusIs;
using testing::StatusIsWith;

// torch.optim.Adafactor's hyper-parameters for one group.
struct Hyper {
  double lr = 0.01, weight_decay = 0.0, beta2_decay = -0.8, eps2 = 1e-3, d = 1.0;
  double eps1 = -1;  // < 0: None (FP32's epsilon).
  bool maximize = false;
};

ParamGroup Adafactor(const Hyper& h) {
  ParamGroup g;
  g.algorithm = Algorithm::kAdafactor;
  g.lr = h.lr;
  g.weight_decay = h.weight_decay;
  g.hyper = {{"beta2_decay", h.beta2_decay}, {"eps2", h.eps2}, {"d", h.d},
             {"maximize", h.maximize ? 1.0 : 0.0}};
  if (h.eps1 >= 0) g.hyper["eps1"] = h.eps1;
  return g;
}

// torch's _single_tensor_adafactor on one FP32 parameter, in double.
struct Reference {
  std::vector<uint64_t> shape;
  std::vector<double> p, row, col, var;
  uint64_t t = 0;

  void Step(const std::vector<double>& grad, const Hyper& h) {
    const uint64_t n = p.size();
    std::vector<double> g = grad;
    if (h.maximize) {
      for (double& x : g) x = -x;
    }
    ++t;
    const double w = std::pow(static_cast<double>(t), h.beta2_decay);
    const double rho = std::min(h.lr, 1 / std::sqrt(static_cast<double>(t)));
    const double eps1 = h.eps1 >= 0 ? h.eps1 : FLT_EPSILON;
    double psq = 0;
    for (double x : p) psq += x * x;
    const double alpha = std::max(h.eps2, std::sqrt(psq) / std::sqrt(static_cast<double>(n))) * rho;
    if (h.weight_decay != 0) {
      for (double& x : p) x *= 1 - h.lr * h.weight_decay;
    }
    std::vector<double> v(n);
    if (shape.size() >= 2) {
      const uint64_t cols = shape.back(), rows_per = shape[shape.size() - 2];
      const uint64_t rows = n / cols, batches = rows / rows_per;
      row.resize(rows, 0.0);
      col.resize(batches * cols, 0.0);
      for (uint64_t r = 0; r < rows; ++r) {
        double s = 0;
        for (uint64_t j = 0; j < cols; ++j) s += g[r * cols + j] * g[r * cols + j];
        row[r] += w * (s / static_cast<double>(cols) - row[r]);
      }
      for (uint64_t b = 0; b < batches; ++b) {
        for (uint64_t j = 0; j < cols; ++j) {
          double s = 0;
          for (uint64_t r = 0; r < rows_per; ++r) {
            const double x = g[(b * rows_per + r) * cols + j];
            s += x * x;
          }
          col[b * cols + j] += w * (s / static_cast<double>(rows_per) - col[b * cols + j]);
        }
        double mean = 0;
        for (uint64_t r = 0; r < rows_per; ++r) mean += row[b * rows_per + r];
        mean = std::max(mean / static_cast<double>(rows_per), eps1);
        for (uint64_t r = 0; r < rows_per; ++r) {
          for (uint64_t j = 0; j < cols; ++j) {
            v[(b * rows_per + r) * cols + j] = row[b * rows_per + r] * col[b * cols + j] / mean;
          }
        }
      }
    } else {
      var.resize(n, 0.0);
      for (uint64_t i = 0; i < n; ++i) {
        var[i] += w * (g[i] * g[i] - var[i]);
        v[i] = var[i];
      }
    }
    std::vector<double> u(n);
    double usq = 0;
    for (uint64_t i = 0; i < n; ++i) {
      u[i] = g[i] / std::sqrt(std::max(v[i], eps1 * eps1));
      usq += u[i] * u[i];
    }
    const double denom = std::max(1.0, std::sqrt(usq) / (std::sqrt(static_cast<double>(n)) * h.d));
    for (uint64_t i = 0; i < n; ++i) p[i] -= alpha / denom * u[i];
  }
};

// A matrix, a 3-D tensor, a vector and a scalar; all F32 so the weights are the masters.
StagedAdamWOptions Model(const Hyper& h) {
  StagedAdamWOptions o;
  o.params = {{"w", {6, 10}, DType::kF32, 0},
              {"conv", {2, 3, 5}, DType::kF32, 0},
              {"bias", {7}, DType::kF32, 0},
              {"scale", {}, DType::kF32, 0}};
  o.groups = {Adafactor(h)};
  o.pieces = {{0, 0, 60}, {1, 0, 30}, {2, 0, 7}, {3, 0, 1}};
  o.threads = 2;
  o.unit_bytes = 64;
  return o;
}

float Initial(uint32_t param, uint64_t i) {
  return 0.3f - 0.011f * static_cast<float>((param * 17 + i * 5) % 53);
}

float Gradient(uint32_t param, uint64_t i, int step) {
  return 0.02f * static_cast<float>((param * 7 + i * 13 + static_cast<uint64_t>(step) * 29) % 37) -
         0.35f;
}

std::vector<float> Flat(const StagedAdamWOptions& o, int step) {
  std::vector<float> out;
  for (const Piece& p : o.pieces) {
    for (uint64_t i = p.begin; i < p.begin + p.count; ++i) {
      out.push_back(step < 0 ? Initial(p.param, i) : Gradient(p.param, i, step));
    }
  }
  return out;
}

struct State {
  std::vector<float> master, aux;
  bool operator==(const State&) const = default;
};

State Of(const StagedAdamW& opt) {
  return {{opt.master().begin(), opt.master().end()}, {opt.aux().begin(), opt.aux().end()}};
}

class AdafactorTest : public ::testing::Test {
 protected:
  AdafactorTest() : env_(NewMemEnv()) {}

  std::unique_ptr<CheckpointStore> Store(const std::string& root) {
    StoreOptions so;
    so.env = env_.get();
    so.chunk_bytes = 96;
    auto store = CheckpointStore::Open(root, so);
    EXPECT_THAT(store, IsOk());
    return *std::move(store);
  }

  std::unique_ptr<StagedAdamW> Optimizer(const StagedAdamWOptions& o) {
    const std::vector<float> w = Flat(o, -1);
    auto opt = StagedAdamW::Create(o, std::as_bytes(std::span(w)));
    EXPECT_THAT(opt, IsOk());
    return opt.ok() ? *std::move(opt) : nullptr;
  }

  static void Step(StagedAdamW& opt, int s) {
    const std::vector<float> g = Flat(opt.options(), s);
    std::vector<float> out(opt.size());
    ASSERT_THAT(opt.Step(StepArgs{g.data(), DType::kF32, 1.0f, out.data()}), IsOk());
    ASSERT_EQ(std::memcmp(out.data(), opt.master().data(), out.size() * 4), 0);
  }

  std::unique_ptr<Env> env_;
  SingleProcessCoordinator coordinator_;
};

// Documented tolerance (docs/design/adafactor.md): masters within 2e-6 relative of the double
// reference after each of 6 steps (torch's own float sums differ from it by as much).
void ExpectMatches(const Hyper& h) {
  const StagedAdamWOptions o = Model(h);
  const std::vector<float> w = Flat(o, -1);
  auto opt = StagedAdamW::Create(o, std::as_bytes(std::span(w)));
  ASSERT_THAT(opt, IsOk());
  std::vector<Reference> ref(o.params.size());
  uint64_t at = 0;
  for (size_t k = 0; k < o.pieces.size(); ++k) {
    ref[k].shape = o.params[k].shape;
    for (uint64_t i = 0; i < o.pieces[k].count; ++i) ref[k].p.push_back(w[at + i]);
    at += o.pieces[k].count;
  }
  for (int s = 0; s < 6; ++s) {
    const std::vector<float> g = Flat(o, s);
    std::vector<float> out((*opt)->size());
    ASSERT_THAT((*opt)->Step(StepArgs{g.data(), DType::kF32, 1.0f, out.data()}), IsOk());
    at = 0;
    for (size_t k = 0; k < ref.size(); ++k) {
      const std::vector<double> grad(g.begin() + static_cast<ptrdiff_t>(at),
                                     g.begin() + static_cast<ptrdiff_t>(at + ref[k].p.size()));
      ref[k].Step(grad, h);
      for (size_t i = 0; i < ref[k].p.size(); ++i) {
        const double want = ref[k].p[i], got = (*opt)->master()[at + i];
        ASSERT_NEAR(got, want, 2e-6 * std::max(1.0, std::fabs(want)))
            << "step " << s << ", parameter " << o.params[k].name << ", element " << i;
      }
      at += ref[k].p.size();
    }
  }
}

TEST_F(AdafactorTest, StepsMatchTorchsAlgorithmForEveryShape) { ExpectMatches(Hyper{}); }

TEST_F(AdafactorTest, StepsMatchWithWeightDecayMaximizeEps1AndClipping) {
  Hyper h;
  h.lr = 0.5;  // rho = 1/sqrt(t) then: the large steps of the first few
  h.weight_decay = 0.1;
  h.maximize = true;
  h.eps1 = 1e-4;
  h.eps2 = 1e-2;
  h.d = 1.0;  // The update's RMS exceeds 1 at the first steps: the clipping divides.
  h.beta2_decay = -0.5;
  ExpectMatches(h);
}

TEST_F(AdafactorTest, ItsFactorsAreShapedUnlikeTheParameterAndSavedThatWay) {
  auto store = Store("/run");
  auto a = Optimizer(Model(Hyper{}));
  ASSERT_NE(a, nullptr);
  // Aux: w's 6 + 10, conv's 2x3 + 2x5, bias's 7, scale's 1.
  EXPECT_EQ(a->aux().size(), 16u + 16u + 7u + 1u);
  auto ck = Checkpointer::Create(a.get(), store.get(), &coordinator_);
  ASSERT_THAT(ck, IsOk());
  Step(*a, 0);
  ASSERT_THAT((*ck)->Save(1), IsOk());
  auto reader = store->OpenStep(1);
  ASSERT_THAT(reader, IsOk());
  auto shape = [&](const char* name) {
    auto t = (*reader)->FindTensor(name);
    return t.ok() ? (*t)->shape : std::vector<uint64_t>{999};
  };
  EXPECT_EQ(shape("optimizer.row_var.w"), (std::vector<uint64_t>{6, 1}));
  EXPECT_EQ(shape("optimizer.col_var.w"), (std::vector<uint64_t>{1, 10}));
  EXPECT_EQ(shape("optimizer.row_var.conv"), (std::vector<uint64_t>{2, 3, 1}));
  EXPECT_EQ(shape("optimizer.col_var.conv"), (std::vector<uint64_t>{2, 1, 5}));
  EXPECT_EQ(shape("optimizer.variance.bias"), (std::vector<uint64_t>{7}));
  EXPECT_EQ(shape("optimizer.variance.scale"), (std::vector<uint64_t>{}));
  EXPECT_FALSE((*reader)->FindTensor("optimizer.exp_avg.w").ok());
  EXPECT_FALSE((*reader)->FindTensor("optimizer.variance.w").ok());
  auto record = (*reader)->ReadBlob(formats::kOptimizerRecordBlob, 0);
  ASSERT_THAT(record, IsOk());
  auto parsed = formats::ParseOptimizerRecord(*record, "x");
  ASSERT_THAT(parsed, IsOk());
  EXPECT_EQ(parsed->kind, "adafactor");
  EXPECT_EQ(parsed->groups[0].algorithm, "adafactor");
  EXPECT_EQ(parsed->groups[0].hyper.at("beta2_decay"), -0.8);
  EXPECT_EQ(record->find("\"version\":5") != std::string::npos, true) << *record;
}

TEST_F(AdafactorTest, SavedAndLoadedItResumesBitForBitWithTheSavedHyperParameters) {
  auto store = Store("/run");
  auto a = Optimizer(Model(Hyper{}));
  ASSERT_NE(a, nullptr);
  auto ck = Checkpointer::Create(a.get(), store.get(), &coordinator_);
  ASSERT_THAT(ck, IsOk());
  for (int s = 0; s < 3; ++s) Step(*a, s);
  ASSERT_THAT((*ck)->Save(3), IsOk());
  for (int s = 3; s < 6; ++s) Step(*a, s);

  Hyper other;
  other.beta2_decay = -0.3;
  other.lr = 1.0;
  auto b = Optimizer(Model(other));
  ASSERT_NE(b, nullptr);
  auto ck_b = Checkpointer::Create(b.get(), store.get(), &coordinator_);
  ASSERT_THAT(ck_b, IsOk());
  ASSERT_THAT((*ck_b)->Load(3), IsOk());
  EXPECT_EQ(b->groups()[0].hyper.at("beta2_decay"), -0.8);
  EXPECT_EQ(b->groups()[0].lr, 0.01);
  EXPECT_EQ(b->param_steps()[0], 3u);
  for (int s = 3; s < 6; ++s) Step(*b, s);
  EXPECT_EQ(Of(*b), Of(*a));
}

TEST_F(AdafactorTest, AnAsyncSaveUnderStepsHoldsTheStateItWasStartedOn) {
  auto store = Store("/run");
  auto a = Optimizer(Model(Hyper{}));
  ASSERT_NE(a, nullptr);
  auto ck = Checkpointer::Create(a.get(), store.get(), &coordinator_);
  ASSERT_THAT(ck, IsOk());
  for (int s = 0; s < 2; ++s) Step(*a, s);
  const State at2 = Of(*a);
  auto pending = (*ck)->SaveAsync(2);
  ASSERT_THAT(pending, IsOk());
  for (int s = 2; s < 4; ++s) Step(*a, s);
  ASSERT_THAT((*pending)->Finalize(), IsOk());
  auto b = Optimizer(Model(Hyper{}));
  ASSERT_NE(b, nullptr);
  auto ck_b = Checkpointer::Create(b.get(), store.get(), &coordinator_);
  ASSERT_THAT(ck_b, IsOk());
  ASSERT_THAT((*ck_b)->Load(2), IsOk());
  EXPECT_EQ(Of(*b), at2);
}

// A load whose col_var chunk is damaged fails with the state as it was and the optimizer clean.
TEST_F(AdafactorTest, AFailedLoadRollsTheFactorsBack) {
  auto store = Store("/run");
  auto a = Optimizer(Model(Hyper{}));
  ASSERT_NE(a, nullptr);
  auto ck = Checkpointer::Create(a.get(), store.get(), &coordinator_);
  ASSERT_THAT(ck, IsOk());
  for (int s = 0; s < 2; ++s) Step(*a, s);
  ASSERT_THAT((*ck)->Save(2), IsOk());
  for (int s = 2; s < 4; ++s) Step(*a, s);
  const State before = Of(*a);
  uint64_t at = 0;
  {
    auto reader = store->OpenStep(2);
    ASSERT_THAT(reader, IsOk());
    const formats::Manifest& m = (*reader)->manifest();
    for (const formats::PieceInfo& p : m.pieces) {
      if (m.tensors[p.tensor].name == "optimizer.col_var.conv") {
        at = m.files[p.file].chunks[p.first_chunk].offset + formats::kChunkHeaderBytes + 1;
      }
    }
  }
  ASSERT_GT(at, 0u);
  const std::string path = "/run/" + StepDirectoryName(2) + "/rank-00000.data";
  auto bytes = ReadFileToString(env_.get(), path, UINT64_MAX);
  ASSERT_THAT(bytes, IsOk());
  (*bytes)[at] ^= 0x10;
  ASSERT_THAT(env_->RemoveFile(path), IsOk());
  auto file = env_->NewWritableFile(path, FileOptions{});
  ASSERT_THAT(file, IsOk());
  ASSERT_THAT((*file)->Append(std::as_bytes(std::span(*bytes))), IsOk());
  ASSERT_THAT((*file)->Close(), IsOk());
  EXPECT_THAT((*ck)->Load(2), StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_EQ(Of(*a), before);
  EXPECT_EQ(a->lifecycle(), Lifecycle::kClean);
}

// Saved at one rank, resharded to three and then to two (each parameter and its factors whole
// on one rank), loaded at two ranks: the two go on bit for bit as the one did.
TEST_F(AdafactorTest, ReshardedOneToThreeToTwoItResumesAtTwoRanksBitForBit) {
  auto store = Store("/run");
  auto a = Optimizer(Model(Hyper{}));
  ASSERT_NE(a, nullptr);
  auto ck = Checkpointer::Create(a.get(), store.get(), &coordinator_);
  ASSERT_THAT(ck, IsOk());
  for (int s = 0; s < 2; ++s) Step(*a, s);
  ASSERT_THAT((*ck)->Save(2), IsOk());
  for (int s = 2; s < 4; ++s) Step(*a, s);
  ReshardOptions ro;
  ro.store.env = env_.get();
  ro.store.chunk_bytes = 96;
  ro.dp = 3;
  {
    auto source = store->OpenStep(2);
    ASSERT_THAT(source, IsOk());
    ASSERT_THAT(Reshard(**source, "/dp3", ro), IsOk());
  }
  {
    auto dp3 = Store("/dp3");
    auto source = dp3->OpenStep(2);
    ASSERT_THAT(source, IsOk());
    EXPECT_EQ((*source)->manifest().world_size, 3u);
    ro.dp = 2;
    ASSERT_THAT(Reshard(**source, "/dp2", ro), IsOk());
  }
  // The two ranks' pieces, as the reshard laid them out: each parameter whole on one rank.
  StagedAdamWOptions whole = Model(Hyper{});
  auto pieces = RankPiecesKeepingWhole(whole.params, std::vector<bool>(4, true),
                                       ro.buckets, 2);
  ASSERT_THAT(pieces, IsOk());
  ThreadGroup group(2);
  auto dp2 = Store("/dp2");
  std::vector<std::unique_ptr<StagedAdamW>> ranks(2);
  std::vector<absl::Status> status(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    StagedAdamWOptions o = whole;
    o.pieces = (*pieces)[static_cast<size_t>(r)];
    ranks[static_cast<size_t>(r)] = Optimizer(o);
    ASSERT_NE(ranks[static_cast<size_t>(r)], nullptr);
  }
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      auto c = Checkpointer::Create(ranks[static_cast<size_t>(r)].get(), dp2.get(),
                                    group.member(r));
      status[static_cast<size_t>(r)] = c.ok() ? (*c)->Load(2).status() : c.status();
    });
  }
  for (std::thread& t : threads) t.join();
  ASSERT_THAT(status[0], IsOk());
  ASSERT_THAT(status[1], IsOk());
  for (auto& rank : ranks) {
    for (int s = 2; s < 4; ++s) Step(*rank, s);
  }
  // Each rank's masters are those of its parameters in `a`.
  for (size_t r = 0; r < 2; ++r) {
    const StagedAdamWOptions& o = ranks[r]->options();
    uint64_t at = 0;
    for (const Piece& p : o.pieces) {
      uint64_t in_a = 0;
      for (const Piece& q : whole.pieces) {
        if (q.param == p.param) break;
        in_a += q.count;
      }
      for (uint64_t i = 0; i < p.count; ++i) {
        ASSERT_EQ(ranks[r]->master()[at + i], a->master()[in_a + i])
            << "rank " << r << ", parameter " << o.params[p.param].name << ", element " << i;
      }
      at += p.count;
    }
  }
}

// Parameters added after some steps start fresh beside the others, whose masters and factors
// are kept bit for bit (the aux slab grows, its offsets with it), and every one steps on.
TEST_F(AdafactorTest, AddedParametersStartFreshAndTheOthersKeepTheirFactors) {
  auto a = Optimizer(Model(Hyper{}));
  ASSERT_NE(a, nullptr);
  for (int s = 0; s < 2; ++s) Step(*a, s);
  const State before = Of(*a);
  Hyper h;
  h.beta2_decay = -0.6;
  const std::vector<float> w(12, 0.25f);
  ASSERT_THAT(a->AddParams({{"extra", {3, 4}, DType::kF32, 1}}, {Adafactor(h)}, {{4, 0, 12}},
                           std::as_bytes(std::span(w))),
              IsOk());
  ASSERT_EQ(a->aux().size(), before.aux.size() + 3 + 4);
  EXPECT_EQ(a->piece_aux_offset(4), before.aux.size());
  EXPECT_TRUE(std::equal(before.aux.begin(), before.aux.end(), a->aux().begin()));
  EXPECT_TRUE(std::equal(before.master.begin(), before.master.end(), a->master().begin()));
  EXPECT_EQ(a->groups()[1].hyper.at("beta2_decay"), -0.6);
  Step(*a, 2);
  // The new matrix's factors after its first step: the mean of its squared gradients.
  const std::vector<float> g = Flat(a->options(), 2);
  const uint64_t at = a->piece_aux_offset(4);
  for (uint64_t r = 0; r < 3; ++r) {
    double sum = 0;
    for (uint64_t c = 0; c < 4; ++c) {
      const double x = g[before.master.size() + r * 4 + c];
      sum += x * x;
    }
    EXPECT_NEAR(a->aux()[at + r], sum / 4, 1e-6) << "row " << r;
  }
}

// Past one chunk of the kernel's passes (2^15 elements) and one column block (256): the same
// reference, and the same bits on one thread as on three.
TEST_F(AdafactorTest, ALargeMatrixMatchesAndItsBitsDoNotDependOnTheThreads) {
  StagedAdamWOptions o;
  o.params = {{"big", {150, 300}, DType::kF32, 0}};
  o.groups = {Adafactor(Hyper{})};
  o.pieces = {{0, 0, 45000}};
  std::vector<std::vector<float>> masters;
  for (int threads : {1, 3}) {
    o.threads = threads;
    auto opt = Optimizer(o);
    ASSERT_NE(opt, nullptr);
    Reference ref{{150, 300}, {}, {}, {}, {}, 0};
    for (float x : Flat(o, -1)) ref.p.push_back(x);
    for (int s = 0; s < 3; ++s) {
      Step(*opt, s);
      const std::vector<float> g = Flat(o, s);
      ref.Step(std::vector<double>(g.begin(), g.end()), Hyper{});
    }
    for (size_t i = 0; i < ref.p.size(); i += 97) {
      ASSERT_NEAR(opt->master()[i], ref.p[i], 2e-6 * std::max(1.0, std::fabs(ref.p[i]))) << i;
    }
    masters.emplace_back(opt->master().begin(), opt->master().end());
  }
  EXPECT_EQ(masters[0], masters[1]);
}

// eps1 None is the machine epsilon of the parameter's dtype, as torch takes it: for a BF16
// parameter 2^-7, not FP32's.
TEST_F(AdafactorTest, Eps1NoneIsTheParametersDtypeEpsilon) {
  std::vector<std::vector<float>> masters;
  for (double eps1 : {-1.0, 0x1p-7}) {
    Hyper h;
    h.eps1 = eps1;
    StagedAdamWOptions o;
    o.params = {{"w", {4, 6}, DType::kBF16, 0}};
    o.groups = {Adafactor(h)};
    o.pieces = {{0, 0, 24}};
    std::vector<uint16_t> w(24, 0x3f80);  // 1.0
    auto opt = StagedAdamW::Create(o, std::as_bytes(std::span(w)));
    ASSERT_THAT(opt, IsOk());
    std::vector<float> g(24);
    for (size_t i = 0; i < g.size(); ++i) g[i] = 1e-4f * static_cast<float>(i % 5);
    std::vector<uint16_t> out(24);
    ASSERT_THAT((*opt)->Step(StepArgs{g.data(), DType::kF32, 1.0f, out.data()}), IsOk());
    masters.emplace_back((*opt)->master().begin(), (*opt)->master().end());
  }
  EXPECT_EQ(masters[0], masters[1]);
}

// An optimizer of AdamW and Adafactor groups: async-saved under steps, resharded to two ranks
// and loaded at one, its masters, AdamW's moments and Adafactor's factors come back bit for bit.
TEST_F(AdafactorTest, AMixedOptimizerAsyncSavedAndReshardedLoadsBitForBit) {
  StagedAdamWOptions o = Model(Hyper{});
  o.params.push_back({"embed", {50}, DType::kF32, 1});
  o.groups.push_back(ParamGroup{});
  o.pieces.push_back({4, 0, 50});
  auto store = Store("/run");
  auto a = Optimizer(o);
  ASSERT_NE(a, nullptr);
  auto ck = Checkpointer::Create(a.get(), store.get(), &coordinator_);
  ASSERT_THAT(ck, IsOk());
  for (int s = 0; s < 2; ++s) Step(*a, s);
  const State at2 = Of(*a);
  const std::vector<std::byte> exp_avg(a->exp_avg_bytes().begin(), a->exp_avg_bytes().end());
  auto pending = (*ck)->SaveAsync(2);
  ASSERT_THAT(pending, IsOk());
  for (int s = 2; s < 4; ++s) Step(*a, s);
  ASSERT_THAT((*pending)->Finalize(), IsOk());
  {
    auto source = store->OpenStep(2);
    ASSERT_THAT(source, IsOk());
    ReshardOptions ro;
    ro.store.env = env_.get();
    ro.store.chunk_bytes = 96;
    ro.dp = 2;
    ro.buckets.bucket_elems = 16;  // The AdamW embedding cut across the ranks.
    ASSERT_THAT(Reshard(**source, "/dp2", ro), IsOk());
  }
  auto dp2 = Store("/dp2");
  auto b = Optimizer(o);
  ASSERT_NE(b, nullptr);
  auto ck_b = Checkpointer::Create(b.get(), dp2.get(), &coordinator_);
  ASSERT_THAT(ck_b, IsOk());
  ASSERT_THAT((*ck_b)->Load(2), IsOk());
  EXPECT_EQ(Of(*b), at2);
  EXPECT_TRUE(std::equal(exp_avg.begin(), exp_avg.end(), b->exp_avg_bytes().begin()));
}

TEST_F(AdafactorTest, BadHyperParametersAndParametersAreRefusedByName) {
  auto create = [&](StagedAdamWOptions o) {
    const std::vector<float> w = Flat(o, -1);
    return StagedAdamW::Create(o, std::as_bytes(std::span(w))).status();
  };
  Hyper h;
  h.d = 0.5;
  EXPECT_THAT(create(Model(h)), StatusIsWith(absl::StatusCode::kInvalidArgument, "d = 0.5"));
  h = Hyper{};
  h.beta2_decay = 0.1;
  EXPECT_THAT(create(Model(h)),
              StatusIsWith(absl::StatusCode::kInvalidArgument, "beta2_decay = 0.1"));
  StagedAdamWOptions unknown = Model(Hyper{});
  unknown.groups[0].hyper["beta3"] = 1;
  EXPECT_THAT(create(unknown), StatusIsWith(absl::StatusCode::kInvalidArgument, "\"beta3\""));
  StagedAdamWOptions empty = Model(Hyper{});
  empty.params.push_back({"empty", {0, 4}, DType::kF32, 0});
  empty.pieces.push_back({4, 0, 0});
  EXPECT_THAT(create(empty), StatusIsWith(absl::StatusCode::kInvalidArgument, "\"empty\""));
  StagedAdamWOptions cut = Model(Hyper{});
  cut.pieces[0] = {0, 0, 30};  // Half of w: Adafactor steps each parameter whole.
  EXPECT_THAT(create(cut), StatusIs(absl::StatusCode::kInvalidArgument));
  StagedAdamWOptions cuda = Model(Hyper{});
  cuda.engine = EngineKind::kCuda;
  EXPECT_THAT(create(cuda), StatusIs(absl::StatusCode::kUnimplemented));
}

}  // namespace
}  // namespace ckpt::optimizer
