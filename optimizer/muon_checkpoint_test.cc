// Checkpoints of an optimizer with Muon groups (docs/design/muon.md): a hybrid (Muon for the
// matrices, AdamW for the rest) saved, async-saved under steps, resharded and loaded resumes bit
// for bit; a Muon parameter's step holds its master and optimizer.momentum.<name> and no
// second moments; loads across algorithms are refused by group with nothing touched, and the
// model-only load from the masters keeps them bit for bit and zeroes the moments; a failed load
// rolls the momentum back with the rest, and an exported step loads back as the model.
#include <algorithm>
#include <cstring>
#include <memory>
#include <set>
#include <span>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "ckpt/checkpoint_reader.h"
#include "ckpt/checkpoint_store.h"
#include "ckpt/coordinator.h"
#include "ckpt/env.h"
#include "ckpt/formats/chunk.h"
#include "ckpt/formats/float_convert.h"
#include "ckpt/formats/optimizer_record.h"
#include "ckpt/optimizer/checkpointer.h"
#include "ckpt/optimizer/export_hf.h"
#include "ckpt/optimizer/reshard.h"
#include "ckpt/optimizer/staged_adamw.h"
#include "tests/support/status_matchers.h"

namespace ckpt::optimizer {
namespace {

using formats::DType;
using testing::IsOk;
using testing::StatusIs;
using testing::StatusIsWith;

ParamGroup Muon() {
  ParamGroup g;
  g.algorithm = Algorithm::kMuon;
  g.lr = 0.02;
  g.weight_decay = 0.1;
  g.eps = 1e-7;
  return g;
}

ParamGroup AdamW() {
  ParamGroup g;
  g.lr = 3e-3;
  g.weight_decay = 0.01;
  return g;
}

// Muon for w1 and w2 (group 0), AdamW for the embedding and the norm (group 1); `all_adamw`
// puts every parameter in AdamW groups of the same shape.
StagedAdamWOptions Hybrid(bool all_adamw = false) {
  StagedAdamWOptions o;
  o.params = {{"embed", {20, 8}, DType::kBF16, 1},
              {"w1", {8, 16}, DType::kBF16, 0},
              {"norm", {8}, DType::kF32, 1},
              {"w2", {16, 8}, DType::kBF16, 0}};
  o.groups = {all_adamw ? AdamW() : Muon(), AdamW()};
  o.pieces = {{0, 0, 160}, {1, 0, 128}, {2, 0, 8}, {3, 0, 128}};
  o.threads = 2;
  o.unit_bytes = 256;
  return o;
}

// The flat weight buffer: BF16 pieces, then the F32 norm at 4-byte alignment.
std::vector<std::byte> Weights(const StagedAdamWOptions& o) {
  std::vector<std::byte> out;
  for (const Piece& p : o.pieces) {
    const DType d = o.params[p.param].dtype;
    const size_t size = formats::DTypeSize(d);
    out.resize((out.size() + size - 1) / size * size);
    for (uint64_t i = 0; i < p.count; ++i) {
      const float v = 0.2f - 0.003f * static_cast<float>((p.param * 31 + i * 7) % 137);
      if (d == DType::kF32) {
        out.resize(out.size() + 4);
        std::memcpy(out.data() + out.size() - 4, &v, 4);
      } else {
        const uint16_t h = formats::FloatToBf16(v);
        out.resize(out.size() + 2);
        std::memcpy(out.data() + out.size() - 2, &h, 2);
      }
    }
  }
  return out;
}

struct State {
  std::vector<float> master;
  std::vector<std::byte> exp_avg, exp_avg_sq;
  bool operator==(const State&) const = default;
};

State Of(const StagedAdamW& opt) {
  return {{opt.master().begin(), opt.master().end()},
          {opt.exp_avg_bytes().begin(), opt.exp_avg_bytes().end()},
          {opt.exp_avg_sq_bytes().begin(), opt.exp_avg_sq_bytes().end()}};
}

class MuonCheckpointTest : public ::testing::Test {
 protected:
  MuonCheckpointTest() : env_(NewMemEnv()) {}

  std::unique_ptr<CheckpointStore> Store(const std::string& root) {
    StoreOptions so;
    so.env = env_.get();
    so.chunk_bytes = 1000;
    auto store = CheckpointStore::Open(root, so);
    EXPECT_THAT(store, IsOk());
    return *std::move(store);
  }

  std::unique_ptr<StagedAdamW> Optimizer(const StagedAdamWOptions& o) {
    weights_ = Weights(o);
    auto opt = StagedAdamW::Create(o, weights_);
    EXPECT_THAT(opt, IsOk());
    return *std::move(opt);
  }

  // Step s with gradients of s; every parameter stepped.
  void Step(StagedAdamW& opt, int s) {
    std::vector<float> g(opt.size());
    for (size_t i = 0; i < g.size(); ++i) {
      g[i] = 0.05f * static_cast<float>(((i * 13 + static_cast<size_t>(s) * 101) % 41)) - 1.0f;
    }
    std::vector<std::byte> out(opt.weight_bytes());
    ASSERT_THAT(opt.Step(StepArgs{g.data(), DType::kF32, 1.0f, out.data()}), IsOk());
  }

  std::unique_ptr<Env> env_;
  SingleProcessCoordinator coordinator_;
  std::vector<std::byte> weights_;
};

TEST_F(MuonCheckpointTest, AHybridSavedAndLoadedResumesBitForBit) {
  auto store = Store("/run");
  auto a = Optimizer(Hybrid());
  auto ck = Checkpointer::Create(a.get(), store.get(), &coordinator_);
  ASSERT_THAT(ck, IsOk());
  for (int s = 0; s < 3; ++s) Step(*a, s);
  ASSERT_THAT((*ck)->Save(3), IsOk());
  const State at3 = Of(*a);
  for (int s = 3; s < 5; ++s) Step(*a, s);

  // The step holds each Muon matrix's momentum, and no moments of it; AdamW's as before.
  auto reader = store->OpenStep(3);
  ASSERT_THAT(reader, IsOk());
  for (const char* name : {"optimizer.momentum.w1", "optimizer.momentum.w2", "optimizer.master.w1",
                           "optimizer.exp_avg.embed", "optimizer.exp_avg_sq.norm", "w1"}) {
    EXPECT_THAT((*reader)->FindTensor(name), IsOk()) << name;
  }
  for (const char* name : {"optimizer.exp_avg.w1", "optimizer.exp_avg_sq.w2",
                           "optimizer.momentum.embed"}) {
    EXPECT_FALSE((*reader)->FindTensor(name).ok()) << name;
  }
  auto record = (*reader)->ReadBlob(formats::kOptimizerRecordBlob, 0);
  ASSERT_THAT(record, IsOk());
  auto parsed = formats::ParseOptimizerRecord(*record, "x");
  ASSERT_THAT(parsed, IsOk());
  EXPECT_EQ(parsed->kind, formats::kOptimizerKindMuon);
  ASSERT_TRUE(parsed->groups[0].muon.has_value());
  EXPECT_EQ(parsed->groups[0].muon->momentum, 0.95);
  EXPECT_FALSE(parsed->groups[1].muon.has_value());

  // A fresh optimizer with other Muon hyper-parameters takes the step's, and goes on as `a` did.
  StagedAdamWOptions other = Hybrid();
  other.groups[0].muon.momentum = 0.5;
  other.groups[0].lr = 1.0;
  auto b = Optimizer(other);
  auto ck_b = Checkpointer::Create(b.get(), store.get(), &coordinator_);
  ASSERT_THAT(ck_b, IsOk());
  ASSERT_THAT((*ck_b)->Load(3), IsOk());
  EXPECT_EQ(b->groups()[0].muon.momentum, 0.95);
  EXPECT_EQ(b->groups()[0].lr, 0.02);
  State loaded = Of(*b);
  // exp_avg_sq of Muon's elements is not state (never saved): compare AdamW's elements only.
  EXPECT_EQ(loaded.master, at3.master);
  EXPECT_EQ(loaded.exp_avg, at3.exp_avg);
  for (int s = 3; s < 5; ++s) Step(*b, s);
  EXPECT_EQ(Of(*b).master, Of(*a).master);
  EXPECT_EQ(Of(*b).exp_avg, Of(*a).exp_avg);
}

// A load whose momentum chunk is damaged fails with the state as it was (rolled back from a
// spill: the steps since the save were not saved) and the optimizer clean; a step exported
// from its masters loads into a fresh hybrid as its masters, bit for bit, momentum zero.
TEST_F(MuonCheckpointTest, AFailedLoadRollsBackAndAnExportedStepLoadsAsTheModel) {
  auto store = Store("/run");
  auto a = Optimizer(Hybrid());
  auto ck = Checkpointer::Create(a.get(), store.get(), &coordinator_);
  ASSERT_THAT(ck, IsOk());
  for (int s = 0; s < 2; ++s) Step(*a, s);
  ASSERT_THAT((*ck)->Save(2), IsOk());
  for (int s = 2; s < 4; ++s) Step(*a, s);  // Unsaved: only a spill can restore this.
  const State before = Of(*a);
  {
    uint64_t at = 0;
    {
      auto reader = store->OpenStep(2);
      ASSERT_THAT(reader, IsOk());
      const formats::Manifest& m = (*reader)->manifest();
      for (const formats::PieceInfo& p : m.pieces) {
        if (m.tensors[p.tensor].name == "optimizer.momentum.w2") {
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
  }
  EXPECT_THAT((*ck)->Load(2), StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_TRUE(Of(*a) == before) << "the momentum and the masters as before the load";
  EXPECT_EQ(a->lifecycle(), Lifecycle::kClean);
  Step(*a, 4);

  ASSERT_THAT((*ck)->Save(5), IsOk());
  const State at5 = Of(*a);
  auto reader = store->OpenStep(5);
  ASSERT_THAT(reader, IsOk());
  ExportHfOptions eo;
  eo.env = env_.get();
  eo.from = ExportFrom::kMasters;
  ASSERT_THAT(ExportHf(**reader, "/export", eo), IsOk());
  auto b = Optimizer(Hybrid());
  auto ck_b = Checkpointer::Create(b.get(), store.get(), &coordinator_);
  ASSERT_THAT(ck_b, IsOk());
  ASSERT_THAT((*ck_b)->LoadModel("/export"), IsOk());
  EXPECT_EQ(std::memcmp(b->master().data(), at5.master.data(), at5.master.size() * 4), 0);
  EXPECT_TRUE(std::all_of(b->exp_avg_bytes().begin(), b->exp_avg_bytes().end(),
                          [](std::byte x) { return x == std::byte{0}; }));
  EXPECT_EQ(b->groups()[0].step, 0u);
}

TEST_F(MuonCheckpointTest, AnAsyncSaveUnderStepsHoldsTheStateItWasStartedOn) {
  auto store = Store("/run");
  auto a = Optimizer(Hybrid());
  auto ck = Checkpointer::Create(a.get(), store.get(), &coordinator_);
  ASSERT_THAT(ck, IsOk());
  for (int s = 0; s < 2; ++s) Step(*a, s);
  const State at2 = Of(*a);
  auto pending = (*ck)->SaveAsync(2);
  ASSERT_THAT(pending, IsOk());
  for (int s = 2; s < 4; ++s) Step(*a, s);  // The fence copies units aside before they change.
  ASSERT_THAT((*pending)->Finalize(), IsOk());
  auto b = Optimizer(Hybrid());
  auto ck_b = Checkpointer::Create(b.get(), store.get(), &coordinator_);
  ASSERT_THAT(ck_b, IsOk());
  ASSERT_THAT((*ck_b)->Load(2), IsOk());
  EXPECT_EQ(Of(*b).master, at2.master);
  EXPECT_EQ(Of(*b).exp_avg, at2.exp_avg);
}

TEST_F(MuonCheckpointTest, LoadsAcrossAlgorithmsAreRefusedByGroupAndTheModelLoadKeepsTheMasters) {
  auto store = Store("/run");
  auto muon = Optimizer(Hybrid());
  auto ck = Checkpointer::Create(muon.get(), store.get(), &coordinator_);
  ASSERT_THAT(ck, IsOk());
  Step(*muon, 0);
  ASSERT_THAT((*ck)->Save(1), IsOk());

  auto adamw = Optimizer(Hybrid(/*all_adamw=*/true));
  Step(*adamw, 7);
  const State before = Of(*adamw);
  auto ck_adamw = Checkpointer::Create(adamw.get(), store.get(), &coordinator_);
  ASSERT_THAT(ck_adamw, IsOk());
  EXPECT_THAT((*ck_adamw)->Load(1),
              StatusIsWith(absl::StatusCode::kInvalidArgument,
                           "param group 0 is Muon's in the checkpoint and AdamW's here"));
  EXPECT_EQ(Of(*adamw), before);
  EXPECT_EQ(adamw->lifecycle(), Lifecycle::kClean);

  // The other way round.
  auto store2 = Store("/adamw");
  auto ck_save = Checkpointer::Create(adamw.get(), store2.get(), &coordinator_);
  ASSERT_THAT(ck_save, IsOk());
  ASSERT_THAT((*ck_save)->Save(8), IsOk());
  auto ck_muon2 = Checkpointer::Create(muon.get(), store2.get(), &coordinator_);
  ASSERT_THAT(ck_muon2, IsOk());
  EXPECT_THAT((*ck_muon2)->Load(8),
              StatusIsWith(absl::StatusCode::kInvalidArgument,
                           "param group 0 is AdamW's in the checkpoint and Muon's here"));

  // Keeping the weights and starting afresh: the model-only load of the Muon step into the
  // AdamW optimizer takes its weights (the masters as saved, rounded to each parameter's
  // dtype: BF16 but for the F32 norm) and zeroes every moment.
  auto report = (*ck_adamw)->LoadModel("/run");
  ASSERT_THAT(report, IsOk());
  std::vector<float> want(muon->master().begin(), muon->master().end());
  for (size_t i = 0; i < want.size(); ++i) {
    const bool norm = i >= 288 && i < 296;  // embed 160, w1 128, then the norm's 8.
    if (!norm) want[i] = formats::Bf16ToFloat(formats::FloatToBf16(want[i]));
  }
  EXPECT_EQ(Of(*adamw).master, want);
  for (std::byte b : adamw->exp_avg_bytes()) ASSERT_EQ(b, std::byte{0});
  // From the masters themselves: every bit the Muon optimizer kept.
  Step(*adamw, 9);
  ModelLoadOptions from_masters;
  from_masters.masters = true;
  ASSERT_THAT((*ck_adamw)->LoadModel("/run", from_masters), IsOk());
  EXPECT_EQ(Of(*adamw).master, Of(*muon).master);
  for (std::byte b : adamw->exp_avg_bytes()) ASSERT_EQ(b, std::byte{0});
  for (std::byte b : adamw->exp_avg_sq_bytes()) ASSERT_EQ(b, std::byte{0});
}

TEST_F(MuonCheckpointTest, AReshardedHybridLoadsAtOneRankBitForBit) {
  auto store = Store("/run");
  auto a = Optimizer(Hybrid());
  auto ck = Checkpointer::Create(a.get(), store.get(), &coordinator_);
  ASSERT_THAT(ck, IsOk());
  for (int s = 0; s < 2; ++s) Step(*a, s);
  ASSERT_THAT((*ck)->Save(2), IsOk());
  auto source = store->OpenStep(2);
  ASSERT_THAT(source, IsOk());
  ReshardOptions ro;
  ro.dp = 3;
  ro.buckets.bucket_elems = 64;
  ro.store.env = env_.get();
  ro.store.chunk_bytes = 1000;
  auto report = Reshard(**source, "/dp3", ro);
  ASSERT_THAT(report, IsOk());
  EXPECT_TRUE(report->optimizer_layout);
  // Each Muon matrix's tensors lie on one output rank, as the optimizer lays them out; the
  // AdamW embedding (160 elements in buckets of 64) is cut across ranks.
  {
    auto dp3_store = Store("/dp3");
    auto out = dp3_store->OpenStep(2);
    ASSERT_THAT(out, IsOk());
    const formats::Manifest& m = (*out)->manifest();
    auto ranks_of = [&](const std::string& name) {
      std::set<uint32_t> ranks;
      for (const formats::PieceInfo& p : m.pieces) {
        if (m.tensors[p.tensor].name == name) ranks.insert(p.rank);
      }
      return ranks.size();
    };
    for (const char* name : {"w1", "optimizer.master.w1", "optimizer.momentum.w2", "w2"}) {
      EXPECT_EQ(ranks_of(name), 1u) << name;
    }
    EXPECT_GT(ranks_of("optimizer.exp_avg.embed"), 1u);
  }
  auto dp3 = Store("/dp3");
  auto b = Optimizer(Hybrid());
  auto ck_b = Checkpointer::Create(b.get(), dp3.get(), &coordinator_);
  ASSERT_THAT(ck_b, IsOk());
  ASSERT_THAT((*ck_b)->Load(2), IsOk());
  EXPECT_EQ(Of(*b).master, Of(*a).master);
  EXPECT_EQ(Of(*b).exp_avg, Of(*a).exp_avg);
}

}  // namespace
}  // namespace ckpt::optimizer
