// Checkpointer: resume is bit-exact at any data-parallel layout; a load that fails anywhere
// leaves every rank exactly as before (both undo sources), or poisoned when the rollback fails
// too; preflight refusals touch nothing. Ranks run as threads over a ThreadGroup; the store
// lives in a MemEnv behind a FaultInjectionEnv.
#include "ckpt/optimizer/checkpointer.h"

#include <array>
#include <cerrno>
#include <cstring>
#include <cstdio>
#include <functional>
#include <map>
#include <thread>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "ckpt/base/status_macros.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "ckpt/formats/float_convert.h"
#include "ckpt/optimizer/layout.h"
#include "ckpt/verify.h"
#include "tests/support/fault_injection_env.h"
#include "tests/support/status_matchers.h"
#include "tests/support/toy_model.h"
#include "optimizer/checkpointer_test_job.h"

namespace ckpt::optimizer {
namespace {

using formats::DType;
using testing::IsOk;
using testing::StatusIs;
using test_job::ExpectAll;
using test_job::ExpectAllOk;
using test_job::Job;
using test_job::kRoot;
using testing::ToyGroups;
using testing::ToyModel;

class CheckpointerTest : public ::testing::Test {
 protected:
  CheckpointerTest() : mem_(NewMemEnv()), env_(mem_.get()) {}

  // Flips one byte in the middle of the first chunk of rank `rank`'s data file of `step`.
  // Flips a payload byte of the first chunk of a master piece that `rank` saved in `step`
  // (what every load reads: the weights are the masters rounded and are not read).
  void DamageChunk(uint64_t step, int rank) {
    const std::string path =
        absl::StrCat(kRoot, "/", StepDirectoryName(step), "/rank-0000", rank, ".data");
    uint64_t at = 0;
    {
      const std::unique_ptr<CheckpointReader> reader = test_job::OpenStep(mem_.get(), kRoot, step);
      const formats::Manifest& m = reader->manifest();
      for (const formats::PieceInfo& p : m.pieces) {
        if (p.rank != static_cast<uint32_t>(rank) ||
            m.tensors[p.tensor].name.rfind("optimizer.master.", 0) != 0) {
          continue;
        }
        at = m.files[p.file].chunks[p.first_chunk].offset + formats::kChunkHeaderBytes + 1;
        break;
      }
    }
    ASSERT_GT(at, 0u) << "rank " << rank << " saved no master piece";
    auto bytes = ReadFileToString(mem_.get(), path, UINT64_MAX);
    ASSERT_THAT(bytes, IsOk());
    (*bytes)[at] ^= 0x10;
    ASSERT_THAT(mem_->RemoveFile(path), IsOk());
    auto file = mem_->NewWritableFile(path, FileOptions{});
    ASSERT_THAT(file, IsOk());
    ASSERT_THAT((*file)->Append(std::as_bytes(std::span(*bytes))), IsOk());
    ASSERT_THAT((*file)->Close(), IsOk());
  }
  // A 2-rank job saves step 1 after one step and loads it back; returns the loaded state.
  std::string SaveAndLoadStepOne() {
    Job job(&env_, 2, 500);
    job.Step(0);
    ExpectAllOk(job.Save(1));
    ExpectAllOk(job.Load(1));
    return job.Gather();
  }

  std::unique_ptr<Env> mem_;
  testing::FaultInjectionEnv env_;
};

TEST_F(CheckpointerTest, ResumeIsBitExactAtAnyDataParallelSizeAndBucketSize) {
  std::string want;
  {
    Job job(&env_, 2, 500);
    for (int s = 0; s < 3; ++s) job.Step(s);
    ExpectAllOk(job.Save(3));
    for (int s = 3; s < 5; ++s) job.Step(s);
    want = job.Gather();
  }
  for (int dp : {2, 1, 3, 5}) {
    Job job(&env_, dp, dp == 2 ? 500 : 300);
    ExpectAllOk(job.Load(std::nullopt));
    for (int s = 3; s < 5; ++s) job.Step(s);
    EXPECT_EQ(job.Gather(), want) << "resumed at DP " << dp;
  }
}

// Parameters skipped in some steps (no gradient) keep their own step counts through a save and
// a load at any data-parallel size: the resumed run equals the uninterrupted one bit for bit,
// bias corrections included.
TEST_F(CheckpointerTest, PerParameterStepCountsResumeAtAnyDataParallelSize) {
  const size_t params = ToyModel().size();
  std::vector<uint8_t> first_skipped(params, 1), last_two_skipped(params, 1);
  first_skipped[0] = 0;
  last_two_skipped[params - 1] = last_two_skipped[params - 2] = 0;
  std::string want;
  {
    Job job(&env_, 2, 500);
    job.Step(0, first_skipped);
    job.Step(1, first_skipped);
    job.Step(2, last_two_skipped);
    EXPECT_NE(job.rank(0).opt->param_steps()[0], job.rank(0).opt->param_steps()[1]);
    ExpectAllOk(job.Save(3));
    job.Step(3, first_skipped);
    job.Step(4);
    want = job.Gather();
  }
  for (int dp : {2, 1, 3}) {
    Job job(&env_, dp, dp == 2 ? 500 : 300);
    ExpectAllOk(job.Load(std::nullopt));
    job.Step(3, first_skipped);
    job.Step(4);
    EXPECT_EQ(job.Gather(), want) << "resumed at DP " << dp;
  }
}

TEST_F(CheckpointerTest, TrainerBlobsComeBackOnEachRank) {
  Job job(&env_, 2, 500);
  ExpectAllOk(job.Save(1));
  std::vector<Blobs> got(2);
  ExpectAllOk(job.OnEveryRank([&](int r) { return job.rank(r).ckpt->Load(1, &got[r]).status(); }));
  EXPECT_EQ(got[0].at("sched"), "at 1");
  EXPECT_EQ(got[1].at("sched"), "at 1");
  EXPECT_EQ(got[1].size(), 1u);
}

TEST_F(CheckpointerTest, PreflightRefusalsTouchNothing) {
  {
    Job job(&env_, 2, 500);
    job.Step(0);
    ExpectAllOk(job.Save(1));
  }
  std::vector<ParamSpec> renamed = ToyModel(), reshaped = ToyModel(), retyped = ToyModel();
  renamed[2].name = "layer.other";
  reshaped[1].shape = {3002};
  for (ParamSpec& p : retyped) p.dtype = DType::kF16;
  for (const auto& params : {renamed, reshaped, retyped}) {
    Job job(&env_, 2, 500, params);
    job.Step(0);
    const std::string before = job.Gather();
    const std::vector<std::string> entries = test_job::RootEntries(mem_.get());
    ExpectAll(job.Load(1), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(job.Gather(), before);
    EXPECT_EQ(test_job::RootEntries(mem_.get()), entries) << "a refused load wrote something";
  }
}

TEST_F(CheckpointerTest, AFreshOptimizerResumesWithoutWritingAnythingEvenOnAFullDisk) {
  std::string saved;
  {
    Job job(&env_, 2, 500);
    job.Step(0);
    job.Step(1);
    ExpectAllOk(job.Save(1));
    saved = job.Gather();
  }
  Job fresh(&env_, 2, 500);  // A new process: the construction state.
  const uint64_t calls = env_.mutating_calls();
  env_.FailNth(1, ENOSPC);  // The disk is full: any write would fail.
  std::vector<LoadReport> reports(2);
  ExpectAllOk(fresh.OnEveryRank([&](int r) -> absl::Status {
    CKPT_ASSIGN_OR_RETURN(reports[r], fresh.rank(r).ckpt->Load(std::nullopt));
    return fresh.WriteWeights(r);
  }));
  env_.Disarm();
  EXPECT_EQ(env_.mutating_calls(), calls) << "the resume wrote to disk";
  EXPECT_TRUE(reports[0].undo_derived);
  EXPECT_FALSE(reports[0].undo_spilled);
  EXPECT_TRUE(fresh.Gather() == saved) << "the resume did not load the step";
}

TEST_F(CheckpointerTest, AFailedLoadIntoAFreshOptimizerRestoresItsConstructionState) {
  {
    Job job(&env_, 2, 500);
    job.Step(0);
    ExpectAllOk(job.Save(1));
  }
  DamageChunk(1, 1);
  Job fresh(&env_, 2, 500);
  const std::string before = fresh.Gather();
  const uint64_t calls = env_.mutating_calls();
  ExpectAll(fresh.Load(1), absl::StatusCode::kDataLoss);
  EXPECT_EQ(env_.mutating_calls(), calls);
  EXPECT_TRUE(fresh.Gather() == before) << "the rollback did not re-derive the fresh state";
  EXPECT_EQ(fresh.rank(0).opt->lifecycle(), Lifecycle::kClean);
  // It steps on as a fresh optimizer would.
  Job reference(&env_, 1, 500, ToyModel(), MomentDType::kF32, {}, "/reference");
  fresh.Step(0);
  reference.Step(0);
  EXPECT_TRUE(fresh.Gather() == reference.Gather());
}

// The model weights are not the Checkpointer's: a load changes the masters only, and
// WriteModelWeights then makes the trainer's weights the loaded step's.
TEST_F(CheckpointerTest, ALoadChangesTheMastersOnlyAndWriteModelWeightsPublishesThem) {
  Job job(&env_, 2, 500);
  job.Step(0);
  ExpectAllOk(job.Save(1));
  const std::string saved = job.Gather();
  job.Step(1);
  std::vector<std::vector<uint16_t>> stepped;
  for (int r = 0; r < job.size(); ++r) stepped.push_back(job.rank(r).weights);
  ExpectAllOk(job.OnEveryRank([&](int r) { return job.rank(r).ckpt->Load(1).status(); }));
  for (int r = 0; r < job.size(); ++r) {
    EXPECT_EQ(job.rank(r).weights, stepped[r]) << "the load wrote rank " << r << "'s weights";
  }
  ExpectAllOk(job.OnEveryRank([&](int r) { return job.WriteWeights(r); }));
  EXPECT_TRUE(job.Gather() == saved);
}

// SetState while an async save is in flight would change what its writer reads: refused.
TEST_F(CheckpointerTest, SetStateIsRefusedWhileAnAsyncSaveIsInFlight) {
  Job job(&env_, 1, 500);
  job.Step(0);
  auto handles = job.SaveAsync(1);
  ASSERT_NE(handles[0], nullptr);
  StagedAdamW& opt = *job.rank(0).opt;
  const std::vector<float> zeros(opt.size(), 0.0f);
  const std::vector<uint64_t> steps(opt.options().params.size(), 0);
  EXPECT_THAT(opt.SetState({}, zeros, zeros, steps),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  ExpectAllOk(job.Finalize(handles));
  EXPECT_THAT(opt.SetState({}, zeros, zeros, steps), IsOk());
}

// The rollback of a fresh state keeps its own copy of the masters: the trainer may have
// overwritten its weight buffer (a CUDA trainer keeps no host copy at all).
TEST_F(CheckpointerTest, AFailedLoadIntoAFreshOptimizerRestoresItWithoutTheTrainersWeights) {
  {
    Job job(&env_, 2, 500);
    job.Step(0);
    ExpectAllOk(job.Save(1));
  }
  DamageChunk(1, 1);
  Job fresh(&env_, 2, 500);
  const auto before = fresh.StateAsFloats();
  for (int r = 0; r < fresh.size(); ++r) {
    std::fill(fresh.rank(r).weights.begin(), fresh.rank(r).weights.end(), uint16_t{0x7fc0});
  }
  const uint64_t calls = env_.mutating_calls();
  ExpectAll(fresh.Load(1), absl::StatusCode::kDataLoss);
  EXPECT_EQ(env_.mutating_calls(), calls) << "the undo was written to disk";
  const auto after = fresh.StateAsFloats();
  ASSERT_EQ(after.size(), before.size());
  size_t differ = 0;
  for (const auto& [key, value] : before) {
    differ += std::memcmp(after.at(key).data(), value.data(), sizeof(value)) != 0;
  }
  EXPECT_EQ(differ, 0u) << "elements whose masters or moments did not come back";
}

// Masters that are not model-dtype values (set directly, as a trainer may, or model-loaded
// from an FP32 source into BF16 parameters) with the moments still zero: the undo is a copy of
// the masters in FP32, kept in memory (nothing written, even on a full disk), and the rollback
// restores them bit for bit. Once the state has stepped (moments not zero), it is spilled.
TEST_F(CheckpointerTest, MastersThatAreNotModelDTypeValuesAreKeptInFp32NotSpilled) {
  {
    Job job(&env_, 1, 500);
    job.Step(0);
    ExpectAllOk(job.Save(1));
  }
  DamageChunk(1, 0);
  Job job(&env_, 1, 500);
  std::span<float> master = job.rank(0).opt->mutable_master();
  master[master.size() / 2] = 1.0f + 0x1p-20f;  // Not a BF16 value.
  master[0] = -0x1p-140f;                        // Subnormal in FP32, zero in BF16.
  const std::vector<float> before(master.begin(), master.end());
  const uint64_t calls = env_.mutating_calls();
  env_.FailNth(1, ENOSPC);  // Any write would fail.
  ExpectAll(job.Load(1), absl::StatusCode::kDataLoss);
  env_.Disarm();
  EXPECT_EQ(env_.mutating_calls(), calls) << "the undo was written to disk";
  const std::span<const float> after = job.rank(0).opt->master();
  ASSERT_EQ(after.size(), before.size());
  EXPECT_EQ(std::memcmp(after.data(), before.data(), 4 * before.size()), 0);

  job.Step(1);  // Moments no longer zero: no construction state, the undo is spilled.
  const std::vector<float> stepped(after.begin(), after.end());
  const uint64_t calls_stepped = env_.mutating_calls();
  ExpectAll(job.Load(1), absl::StatusCode::kDataLoss);
  EXPECT_GT(env_.mutating_calls(), calls_stepped) << "no spill was written";
  EXPECT_EQ(std::memcmp(job.rank(0).opt->master().data(), stepped.data(), 4 * stepped.size()), 0);
}

// A fresh state's undo is kept in memory only when the copy (and the moments the load will
// touch) fit in the memory the Env says is available: Linux overcommits, so an allocation that
// succeeds may still be OOM-killed as it is touched. Otherwise the undo is spilled, and a
// read-only handle refuses, saying why; with the memory there, nothing is written.
TEST_F(CheckpointerTest, AnUndoCopyThatWouldNotFitInAvailableMemoryIsSpilled) {
  std::string saved;
  {
    Job job(&env_, 1, 500);
    job.Step(0);
    ExpectAllOk(job.Save(1));
    saved = job.Gather();
  }
  env_.SetAvailableMemory(1000);
  {
    Job fresh(&env_, 1, 500);
    auto report = fresh.rank(0).ckpt->Load(std::nullopt);
    ASSERT_THAT(report, IsOk());
    EXPECT_TRUE(report->undo_spilled);
    EXPECT_FALSE(report->undo_derived);
    ASSERT_THAT(fresh.WriteWeights(0), IsOk());
    EXPECT_TRUE(fresh.Gather() == saved);
  }
  {
    Job fresh(&env_, 1, 500);
    StoreOptions so;
    so.env = &env_;
    so.primary = false;
    so.read_only = true;
    auto read_only = CheckpointStore::Open(kRoot, so);
    ASSERT_THAT(read_only, IsOk());
    SingleProcessCoordinator solo;
    auto ck = Checkpointer::Create(fresh.rank(0).opt.get(), read_only->get(), &solo);
    ASSERT_THAT(ck, IsOk());
    auto refused = (*ck)->Load(1);
    EXPECT_THAT(refused, StatusIs(absl::StatusCode::kFailedPrecondition));
    EXPECT_THAT(std::string(refused.status().message()),
                ::testing::HasSubstr("more than the 1000 available"));
  }
  env_.SetAvailableMemory(uint64_t{1} << 40);
  Job fresh(&env_, 1, 500);
  const uint64_t calls = env_.mutating_calls();
  auto report = fresh.rank(0).ckpt->Load(std::nullopt);
  ASSERT_THAT(report, IsOk());
  EXPECT_TRUE(report->undo_derived);
  EXPECT_EQ(env_.mutating_calls(), calls);
}

TEST_F(CheckpointerTest, ALoadThatPutsParametersInOtherGroupsIsRefusedNamingThem) {
  {
    Job job(&env_, 2, 500);
    job.Step(0);
    ExpectAllOk(job.Save(1));
  }
  std::vector<ParamSpec> regrouped = ToyModel();
  regrouped[1].group = 1;  // layer.weight was in group 0 when saved.
  regrouped[2].group = 0;  // layer.bias was in group 1.
  Job other(&env_, 2, 500, regrouped);
  other.Step(0);
  const std::string before = other.Gather();
  const std::vector<absl::Status> st = other.Load(1);
  ExpectAll(st, absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st[0].message()), ::testing::HasSubstr("layer.weight"));
  EXPECT_THAT(std::string(st[0].message()), ::testing::HasSubstr("layer.bias"));
  EXPECT_TRUE(other.Gather() == before);
}

TEST_F(CheckpointerTest, ADamagedLatestSaysHowToGoOnAndLoadNewestIntactFallsBack) {
  std::string at_one;
  {
    Job job(&env_, 2, 500);
    job.Step(0);
    ExpectAllOk(job.Save(1));
    at_one = job.Gather();
    job.Step(1);
    ExpectAllOk(job.Save(2));
  }
  DamageChunk(2, 1);
  Job fresh(&env_, 2, 500);
  const std::string before = fresh.Gather();
  const std::vector<absl::Status> st = fresh.Load(std::nullopt);
  ExpectAll(st, absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(st[0].message()), ::testing::HasSubstr("rank-00001.data"));
  EXPECT_THAT(std::string(st[0].message()), ::testing::HasSubstr("LoadNewestIntact"));
  EXPECT_THAT(std::string(st[0].message()), ::testing::HasSubstr("ckpt-tool quarantine"));
  EXPECT_TRUE(fresh.Gather() == before);
  std::vector<LoadReport> reports(2);
  ExpectAllOk(fresh.OnEveryRank([&](int r) -> absl::Status {
    CKPT_ASSIGN_OR_RETURN(reports[r], fresh.rank(r).ckpt->LoadNewestIntact());
    return fresh.WriteWeights(r);
  }));
  EXPECT_EQ(reports[0].step, 1u);
  ASSERT_EQ(reports[0].skipped.size(), 1u);
  EXPECT_THAT(reports[0].skipped[0], ::testing::StartsWith("step 2: "));
  EXPECT_THAT(reports[0].skipped[0], ::testing::HasSubstr("moved into quarantine/step-00000002-"));
  EXPECT_TRUE(fresh.Gather() == at_one);
  // The damaged step is set aside (not deleted), LATEST names the loaded one: training goes on
  // and saves step 2 again.
  fresh.Step(1);
  ExpectAllOk(fresh.Save(2));
}

TEST_F(CheckpointerTest, FailedApplyRollsBackFromTheCheckpointTheStateCameFrom) {
  Job job(&env_, 2, 500);
  job.Step(0);
  ExpectAllOk(job.Save(1));
  job.Step(1);
  ExpectAllOk(job.Save(2));  // The state equals step 2: its undo source is free.
  DamageChunk(1, 1);
  const std::string before = job.Gather();
  ExpectAll(job.Load(1), absl::StatusCode::kDataLoss);
  EXPECT_EQ(job.Gather(), before);
  EXPECT_EQ(job.rank(0).opt->lifecycle(), Lifecycle::kClean);
  EXPECT_THAT(test_job::RootEntries(mem_.get()),
              ::testing::Not(::testing::Contains(::testing::StartsWith(".undo"))));
}

TEST_F(CheckpointerTest, ReloadingTheStepTheStateCameFromRollsBackFromASpill) {
  Job job(&env_, 2, 500);
  job.Step(0);
  ExpectAllOk(job.Save(1));  // Clean at step 1: but step 1 cannot undo a failed load of itself.
  DamageChunk(1, 1);
  const std::string before = job.Gather();
  // While the state still equals step 1 a reload reads nothing (Load's step 2(a')): the state
  // is what step 1's manifest describes, whatever became of its data file since.
  ExpectAllOk(job.Load(1));
  EXPECT_EQ(job.Gather(), before);
  // A load that reads it (here after a SetGroup, which changes the state's version only)
  // fails on the damage and rolls back from a spill, step 1 being no undo for itself.
  for (int r = 0; r < 2; ++r) {
    ASSERT_THAT(job.rank(r).opt->SetGroup(0, job.rank(r).opt->groups()[0]), IsOk());
  }
  ExpectAll(job.Load(1), absl::StatusCode::kDataLoss);
  EXPECT_EQ(job.Gather(), before);
  EXPECT_EQ(job.rank(0).opt->lifecycle(), Lifecycle::kClean) << "rolled back, not poisoned";
  EXPECT_EQ(job.rank(1).opt->lifecycle(), Lifecycle::kClean);
}

TEST_F(CheckpointerTest, FailedApplyRollsBackFromASpillWhenTheStateMovedOn) {
  Job job(&env_, 2, 500);
  job.Step(0);
  ExpectAllOk(job.Save(1));
  job.Step(1);  // Unsaved: only a spill can restore this.
  DamageChunk(1, 0);
  const std::string before = job.Gather();
  ExpectAll(job.Load(1), absl::StatusCode::kDataLoss);
  EXPECT_EQ(job.Gather(), before);
  job.Step(2);  // Still clean.
  EXPECT_THAT(test_job::RootEntries(mem_.get()),
              ::testing::Not(::testing::Contains(::testing::StartsWith(".undo"))));
}

// A spill that cannot be written (the disk is full) fails the load before anything changes,
// and says it was the load's undo copy that failed, not a save of the store's steps.
TEST_F(CheckpointerTest, ASpillThatFailsSaysItWasTheLoadsUndoCopy) {
  Job job(&env_, 1, 500);
  job.Step(0);
  ExpectAllOk(job.Save(1));
  job.Step(1);  // Unsaved: only a spill can restore this.
  const std::string before = job.Gather();
  env_.FailNth(4, ENOSPC, testing::FaultInjectionEnv::Op::kAppend);
  const std::vector<absl::Status> loads = job.Load(1);
  EXPECT_THAT(loads[0], StatusIs(absl::StatusCode::kResourceExhausted));
  EXPECT_THAT(std::string(loads[0].message()),
              ::testing::HasSubstr("writing the load's undo copy of the optimizer state to"));
  EXPECT_THAT(std::string(loads[0].message()),
              ::testing::HasSubstr("(the checkpoints of the store are untouched)"));
  EXPECT_EQ(job.Gather(), before);
  EXPECT_THAT(test_job::RootEntries(mem_.get()),
              ::testing::Not(::testing::Contains(::testing::StartsWith(".undo"))));
}

TEST_F(CheckpointerTest, FailedRollbackPoisonsUntilACompleteLoad) {
  Job job(&env_, 2, 500);
  job.Step(0);
  ExpectAllOk(job.Save(5));
  job.Step(1);
  ExpectAllOk(job.Save(6));
  job.Step(2);
  DamageChunk(6, 0);
  // Every rank's spill is a private single-rank store saved as its step 1: its data file opens
  // once when the undo source is fixed, then fails when the rollback opens it again.
  env_.FailReadOpens("step-00000001/rank-00000.data", EIO, /*skip=*/2);
  ExpectAll(job.Load(6), absl::StatusCode::kFailedPrecondition);  // Poisoned, not "as before".
  env_.Disarm();
  for (int r = 0; r < 2; ++r) {
    StagedAdamW& opt = *job.rank(r).opt;
    EXPECT_EQ(opt.lifecycle(), Lifecycle::kPoisoned);
    EXPECT_THAT(opt.poison_reason(), ::testing::HasSubstr("step 6"));
    std::vector<float> grads(opt.size());
    EXPECT_THAT(opt.Step({grads.data(), DType::kF32, 1.0f, job.rank(r).weights.data()}),
                StatusIs(absl::StatusCode::kFailedPrecondition));
    EXPECT_THAT(opt.SetGroup(0, ParamGroup{}), StatusIs(absl::StatusCode::kFailedPrecondition));
  }
  ExpectAll(job.Save(7), absl::StatusCode::kFailedPrecondition);
  ExpectAllOk(job.Load(5));
  EXPECT_EQ(job.rank(1).opt->lifecycle(), Lifecycle::kClean);
  job.Step(1);
}

TEST_F(CheckpointerTest, EveryFailedReadOrWriteOfADirtyLoadRestoresOrPoisons) {
  const std::string loaded = SaveAndLoadStepOne();
  int failures = 0, poisonings = 0;
  // 0: the k-th file open for reading fails with EIO (the step's files, the spill's); 1: the
  // k-th mutating call (the spill's writes, syncs, renames); 2: a chunk of the step is damaged,
  // so the apply fails on one rank, and the k-th open from then on fails, the rollback's too.
  for (int kind = 0; kind < 3; ++kind) {
    if (kind == 2) DamageChunk(1, 1);
    for (int k = 0;; ++k) {
      Job job(&env_, 2, 300);
      job.Step(0);
      job.Step(1);  // Dirty: the undo source is a spill.
      const std::string before = job.Gather();
      const bool failed = test_job::LoadUnderFault(
          env_, job, [&] { return job.Load(1); },
          [&] {
            if (kind != 1) env_.FailReadOpens("", EIO, k);
            if (kind == 1) env_.FailNth(static_cast<uint64_t>(k) + 1, EIO);
          },
          before, loaded);
      const bool poisoned = job.rank(0).opt->lifecycle() == Lifecycle::kPoisoned ||
                            job.rank(1).opt->lifecycle() == Lifecycle::kPoisoned;
      failures += failed;
      if (poisoned) {
        ++poisonings;
        env_.Disarm();
        if (kind == 2) break;      // Step 1 is damaged now: nothing complete to load.
        ExpectAllOk(job.Load(1));  // A complete load clears the poison.
        EXPECT_EQ(job.Gather(), loaded);
      }
      // Kinds 0 and 1 end when the load gets through; kind 2 (which always fails) when the
      // rollback got through.
      if (!failed || (kind == 2 && !poisoned && k > 60)) break;
      ASSERT_LT(k, 500) << "the load never got through";
    }
  }
  std::printf("%d injected failures failed the load, %d of them poisoned\n", failures, poisonings);
  EXPECT_GT(failures, 10);
  EXPECT_GT(poisonings, 0) << "no failure reached the rollback";
  // Whatever failed, the next primary Open removes the spills left behind.
  StoreOptions so;
  so.env = &env_;
  ASSERT_THAT(CheckpointStore::Open(kRoot, so), IsOk());
  EXPECT_THAT(test_job::RootEntries(mem_.get()),
              ::testing::Not(::testing::Contains(::testing::StartsWith(".undo"))));
}


// FP32 moments load into BF16-moment mode rounded to nearest even; BF16 moments load into FP32
// mode widened exactly; the masters are FP32 in both and load bit for bit.
TEST_F(CheckpointerTest, MomentsConvertBetweenF32AndBf16OnLoad) {
  std::map<std::pair<uint32_t, uint64_t>, std::array<float, 3>> f32_state, bf16_state;
  {
    Job job(&env_, 2, 500);
    for (int s = 0; s < 3; ++s) job.Step(s);
    ExpectAllOk(job.Save(3));
    f32_state = job.StateAsFloats();
  }
  {
    Job job(&env_, 3, 300, ToyModel(), MomentDType::kBF16);
    std::vector<LoadReport> reports(3);
    ExpectAllOk(job.OnEveryRank([&](int r) {
      absl::StatusOr<LoadReport> report = job.rank(r).ckpt->Load(3);
      if (!report.ok()) return report.status();
      reports[r] = *report;
      return job.WriteWeights(r);
    }));
    EXPECT_EQ(reports[0].saved_moment_dtype, DType::kF32);
    bf16_state = job.StateAsFloats();
    ASSERT_EQ(bf16_state.size(), f32_state.size());
    int nonzero = 0;
    for (const auto& [key, want] : f32_state) {
      const std::array<float, 3>& got = bf16_state[key];
      EXPECT_EQ(got[0], want[0]) << "master of " << key.first << "/" << key.second;
      for (int m = 1; m < 3; ++m) {
        EXPECT_EQ(got[m], formats::Bf16ToFloat(formats::FloatToBf16(want[m])))
            << "moment " << m << " of " << key.first << "/" << key.second;
        nonzero += want[m] != formats::Bf16ToFloat(formats::FloatToBf16(want[m]));
      }
    }
    EXPECT_GT(nonzero, 100) << "the rounding was never visible: a weak test";
    job.Step(3);
    ExpectAllOk(job.Save(4));
    bf16_state = job.StateAsFloats();
  }
  Job job(&env_, 1, 5000);
  std::vector<absl::Status> st = job.OnEveryRank([&](int r) {
    absl::StatusOr<LoadReport> report = job.rank(r).ckpt->Load(4);
    if (!report.ok()) return report.status();
    EXPECT_EQ(report->saved_moment_dtype, DType::kBF16);
    return job.WriteWeights(r);
  });
  ExpectAllOk(st);
  EXPECT_TRUE(job.StateAsFloats() == bf16_state) << "BF16 moments did not widen exactly";
}

// A rank may own no element at all (more ranks than elements, or a bucket that is all padding):
// it takes part in every collective with empty slabs, saves and loads nothing of its own.
TEST_F(CheckpointerTest, RanksOwningNothingSaveAndLoad) {
  const std::vector<ParamSpec> tiny = {{"a", {3}, DType::kBF16, 0}, {"b", {2}, DType::kBF16, 1}};
  std::string want;
  {
    Job job(&env_, 7, 5, tiny);
    int empty = 0;
    for (int r = 0; r < job.size(); ++r) empty += job.rank(r).opt->size() == 0;
    ASSERT_GT(empty, 0) << "the layout gave every rank an element";
    for (int s = 0; s < 2; ++s) job.Step(s);
    ExpectAllOk(job.Save(2));
    job.Step(2);
    want = job.Gather();
    job.Step(3);
    ExpectAllOk(job.Load(2));  // Dirty: every rank spills, the empty ones an empty state.
    job.Step(2);
    EXPECT_EQ(job.Gather(), want);
  }
  for (int dp : {1, 4}) {
    Job job(&env_, dp, 2, tiny);
    ExpectAllOk(job.Load(2));
    job.Step(2);
    EXPECT_EQ(job.Gather(), want) << "loaded at DP " << dp;
  }
}

// The process dies (the Env crashes: every later call fails, unsynced data is lost) at every
// mutating call of a dirty 2-rank load in turn. Reopened, the store holds the step it held
// before, which verifies and loads in a fresh job at another DP size, and no spill survives.
TEST_F(CheckpointerTest, ACrashAtEveryCallOfALoadLeavesTheStoreLoadable) {
  const std::string loaded = SaveAndLoadStepOne();
  int crashes = 0;
  for (uint64_t k = 0;; ++k) {
    bool crashed = false;
    {
      Job job(&env_, 2, 300);
      job.Step(0);
      job.Step(1);  // Dirty: the undo source is a spill, written (and crashed) below the root.
      env_.CrashAfter(k);
      std::vector<absl::Status> st = job.Load(1);
      crashed = env_.crashed();
      if (!crashed) ExpectAllOk(st);
    }  // The dead process's handles go; what they still try fails against the crashed Env.
    ASSERT_THAT(env_.DropUnsyncedData(k), IsOk());
    if (!crashed) break;
    ++crashes;
    {
      Job job(&env_, 3, 400);  // Its primary Open recovers the root.
      EXPECT_THAT(test_job::RootEntries(mem_.get()),
                  ::testing::Not(::testing::Contains(::testing::StartsWith(".undo"))))
          << "crash after call " << k;
      auto report = VerifyStore(&env_, kRoot, std::nullopt, /*all=*/true);
      ASSERT_THAT(report, IsOk());
      EXPECT_TRUE(report->problems.empty()) << "crash after call " << k;
      ASSERT_EQ(report->steps.size(), 1u);
      EXPECT_TRUE(report->steps[0].problems.empty()) << "crash after call " << k;
      ExpectAllOk(job.Load(std::nullopt));
      EXPECT_EQ(job.Gather(), loaded) << "crash after call " << k;
    }
    ASSERT_LT(k, 500u) << "the load never got through";
  }
  std::printf("%d crashes inside the load, each recovered\n", crashes);
  EXPECT_GT(crashes, 5);
}

}  // namespace
}  // namespace ckpt::optimizer
