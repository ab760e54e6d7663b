// Checkpointer: reloading the very step the state equals (the one it was last saved as or
// loaded from, unchanged since, its manifest the same) reads nothing into the slabs and needs
// no undo source, so it works on a read-only handle and on a full disk (Load's step 2(a'),
// optimizer/checkpointer_load.cc). A state that moved on, or a step replaced on disk since,
// takes the usual path. Ranks run as threads; the store lives in a MemEnv behind a
// FaultInjectionEnv.
#include <cerrno>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "ckpt/optimizer/checkpointer.h"
#include "optimizer/checkpointer_test_job.h"
#include "tests/support/fault_injection_env.h"
#include "tests/support/status_matchers.h"

namespace ckpt::optimizer {
namespace {

using testing::IsOk;
using test_job::ExpectAllOk;
using test_job::Job;
using test_job::kRoot;

class CheckpointerReloadTest : public ::testing::Test {
 protected:
  CheckpointerReloadTest() : mem_(NewMemEnv()), env_(mem_.get()) {}

  // Whether an undo spill (.undo-*) was ever left in the root.
  bool AnyUndoDirectory() {
    auto names = mem_->GetChildren(kRoot);
    EXPECT_THAT(names, IsOk());
    for (const std::string& name : *names) {
      if (absl::StartsWith(name, ".undo-")) return true;
    }
    return false;
  }
  // Saves step 1 after one step, and step 2 after another, through a 1-rank job.
  void SaveTwoSteps() {
    Job job(&env_, 1, 500);
    job.Step(0);
    ExpectAllOk(job.Save(1));
    job.Step(1);
    ExpectAllOk(job.Save(2));
  }

  std::unique_ptr<Env> mem_;
  testing::FaultInjectionEnv env_;
};

TEST_F(CheckpointerReloadTest, AReadOnlyCheckpointerReloadsTheStepItJustLoaded) {
  SaveTwoSteps();
  Job fresh(&env_, 1, 500);
  StoreOptions so;
  so.env = &env_;
  so.primary = false;
  so.read_only = true;
  auto store = CheckpointStore::Open(kRoot, so);
  ASSERT_THAT(store, IsOk());
  SingleProcessCoordinator solo;
  auto ck = Checkpointer::Create(fresh.rank(0).opt.get(), store->get(), &solo);
  ASSERT_THAT(ck, IsOk());
  auto first = (*ck)->Load(1);
  ASSERT_THAT(first, IsOk());
  EXPECT_FALSE(first->unchanged);
  const std::string loaded = fresh.Gather();
  auto again = (*ck)->Load(1);
  ASSERT_THAT(again, IsOk()) << "a read-only handle reloads the step the state equals";
  EXPECT_TRUE(again->unchanged);
  EXPECT_FALSE(again->undo_spilled);
  EXPECT_EQ(fresh.Gather(), loaded);
}

TEST_F(CheckpointerReloadTest, AWritableCheckpointerReloadsAnUnchangedStepWithoutWriting) {
  SaveTwoSteps();
  Job job(&env_, 2, 500);
  ExpectAllOk(job.Load(2));
  job.Step(2);
  ExpectAllOk(job.Load(1));  // The state moved on: step 2 is no undo source, step 1 is read.
  const std::string loaded = job.Gather();
  // Every write fails from here: a reload that spilled or wrote anything would fail.
  env_.FailNth(1, ENOSPC);
  const uint64_t calls = env_.mutating_calls();
  std::vector<char> unchanged(2, 0);  // Not vector<bool>: the ranks write from their threads.
  ExpectAllOk(job.OnEveryRank([&](int r) -> absl::Status {
    CKPT_ASSIGN_OR_RETURN(LoadReport report, job.rank(r).ckpt->Load(1));
    unchanged[r] = report.unchanged && !report.undo_spilled;
    return job.WriteWeights(r);
  }));
  env_.Disarm();
  EXPECT_TRUE(unchanged[0] && unchanged[1]);
  EXPECT_EQ(env_.mutating_calls(), calls);
  EXPECT_FALSE(AnyUndoDirectory());
  EXPECT_EQ(job.Gather(), loaded);
}

TEST_F(CheckpointerReloadTest, ReloadingAStepJustSavedReadsNothing) {
  Job job(&env_, 1, 500);
  job.Step(0);
  ExpectAllOk(job.Save(1));
  const std::string saved = job.Gather();
  env_.FailNth(1, ENOSPC);
  auto report = job.rank(0).ckpt->Load(1);
  env_.Disarm();
  ASSERT_THAT(report, IsOk());
  EXPECT_TRUE(report->unchanged);
  EXPECT_EQ(job.Gather(), saved);
}

TEST_F(CheckpointerReloadTest, AfterAStepReloadingTheStepTakesTheUsualPath) {
  SaveTwoSteps();
  Job job(&env_, 1, 500);
  ExpectAllOk(job.Load(1));
  const std::string at_one = job.Gather();
  job.Step(1);
  auto report = job.rank(0).ckpt->Load(1);
  ASSERT_THAT(report, IsOk());
  EXPECT_FALSE(report->unchanged);
  EXPECT_TRUE(report->undo_spilled) << "the state moved on: the usual undo, a spill";
  ASSERT_THAT(job.WriteWeights(0), IsOk());
  EXPECT_EQ(job.Gather(), at_one);
}

TEST_F(CheckpointerReloadTest, AStepReplacedOnDiskSinceIsReadAfresh) {
  SaveTwoSteps();
  // The loader's optimizer comes from a job on a scratch root; it loads through a non-primary
  // handle on the store, so that another run can own the store meanwhile.
  Job loader(&env_, 1, 500, testing::ToyModel(), MomentDType::kF32, {}, "/scratch");
  StoreOptions so;
  so.env = &env_;
  so.primary = false;
  auto store = CheckpointStore::Open(kRoot, so);
  ASSERT_THAT(store, IsOk());
  SingleProcessCoordinator solo;
  auto ck = Checkpointer::Create(loader.rank(0).opt.get(), store->get(), &solo);
  ASSERT_THAT(ck, IsOk());
  ASSERT_THAT((*ck)->Load(1), IsOk());
  ASSERT_THAT(loader.WriteWeights(0), IsOk());
  const std::string old_one = loader.Gather();
  // Another run quarantines every step and saves a different step 1 in their place.
  std::string new_one;
  {
    StoreOptions primary;
    primary.env = &env_;
    {
      auto owner = CheckpointStore::Open(kRoot, primary);
      ASSERT_THAT(owner, IsOk());
      ASSERT_THAT((*owner)->QuarantineAll(), IsOk());
    }
    Job other(&env_, 1, 500);
    for (int s = 0; s < 3; ++s) other.Step(s);
    ExpectAllOk(other.Save(1));
    new_one = other.Gather();
  }
  ASSERT_NE(new_one, old_one);
  auto report = (*ck)->Load(1);
  ASSERT_THAT(report, IsOk());
  EXPECT_FALSE(report->unchanged);
  ASSERT_THAT(loader.WriteWeights(0), IsOk());
  EXPECT_EQ(loader.Gather(), new_one) << "the new step 1's data, not the stale state";
}

}  // namespace
}  // namespace ckpt::optimizer
