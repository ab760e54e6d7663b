// Retention deletes a retired step only when it holds exactly what its commit wrote; anything
// else moves whole into quarantine/, and a step that is or holds a mount point stays in place
// (libckpt/store/retention.cc). A dry run returns exactly what the real run then does. Runs on
// a real directory through PosixEnv; mounts are reported by an Env, as a bind mount shows.
#include <sys/stat.h>

#include <filesystem>
#include <fstream>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "ckpt/checkpoint_store.h"
#include "tests/support/status_matchers.h"
#include "tests/support/synthetic_state.h"
#include "tests/support/temp_dir.h"
#include "tests/support/tree_snapshot.h"

namespace ckpt {
namespace {

namespace fs = std::filesystem;
using Kind = RecoveryAction::Kind;
using ::testing::ElementsAre;
using ::testing::IsEmpty;

// An Env that reports everything below `prefix` on another mount.
class OtherMountEnv : public EnvWrapper {
 public:
  OtherMountEnv(Env* target, std::string prefix) : EnvWrapper(target), prefix_(std::move(prefix)) {}
  absl::StatusOr<FileInfo> Stat(const std::string& path) override {
    absl::StatusOr<FileInfo> info = target()->Stat(path);
    if (info.ok() && (path == prefix_ || absl::StartsWith(path, prefix_ + "/"))) {
      info->mount_id += 1000;
    }
    return info;
  }

 private:
  std::string prefix_;
};

class RetentionTest : public ::testing::Test {
 protected:
  RetentionTest() : posix_(NewPosixEnv()) {
    root_ = tmp_.path() + "/store";
    options_.env = posix_.get();
    options_.chunk_bytes = 1000;
  }
  void SaveSteps(uint64_t last) {
    for (uint64_t step = 1; step <= last; ++step)
      CKPT_ASSERT_OK(testing::SaveSyntheticStep(root_, options_, 2, step));
  }
  std::string Step(int step) { return root_ + "/step-0000000" + std::to_string(step); }
  std::unique_ptr<CheckpointStore> Open(Env* env = nullptr) {
    StoreOptions o = options_;
    if (env != nullptr) o.env = env;
    auto store = CheckpointStore::Open(root_, o);
    EXPECT_TRUE(store.ok()) << store.status();
    return store.ok() ? std::move(*store) : nullptr;
  }
  // Applies keep_last = 1 as a dry run, then for real, and checks that both say the same.
  RetentionReport RetireAllButLatest(CheckpointStore& store) {
    auto dry = store.ApplyRetention({.keep_last = 1}, /*dry_run=*/true);
    EXPECT_TRUE(dry.ok()) << dry.status();
    auto real = store.ApplyRetention({.keep_last = 1});
    EXPECT_TRUE(real.ok()) << real.status();
    if (!dry.ok() || !real.ok()) return {};
    EXPECT_EQ(dry->actions.size(), real->actions.size());
    for (size_t i = 0; i < dry->actions.size() && i < real->actions.size(); ++i) {
      EXPECT_EQ(DescribeRetention(dry->actions[i], false),
                DescribeRetention(real->actions[i], false));
    }
    return *real;
  }
  // The one entry of quarantine/ that holds step `step`.
  std::string Quarantined(const RetentionReport& report) {
    EXPECT_EQ(report.quarantined.size(), 1u);
    return report.quarantined.empty() ? "" : root_ + "/" + report.quarantined[0];
  }

  testing::ScopedTempDir tmp_;
  std::unique_ptr<Env> posix_;
  std::string root_;
  StoreOptions options_;
};

TEST_F(RetentionTest, AStepHoldingOnlyCkptsFilesIsDeleted) {
  SaveSteps(3);
  auto store = Open();
  RetentionReport report = RetireAllButLatest(*store);
  EXPECT_THAT(StepsOf(report, Kind::kRemove), ElementsAre(1, 2));
  EXPECT_THAT(report.quarantined, IsEmpty());
  EXPECT_THAT(*store->ListSteps(), ElementsAre(3));
  EXPECT_THAT(*store->ListQuarantine(), IsEmpty());
}

TEST_F(RetentionTest, AStepHoldingAUserFileIsQuarantinedWholeNotDeleted) {
  SaveSteps(3);
  std::ofstream(Step(1) + "/notes.txt") << "my results";
  const testing::TreeSnapshot before = testing::SnapshotTree(Step(1));
  auto store = Open();
  RetentionReport report = RetireAllButLatest(*store);
  EXPECT_THAT(StepsOf(report, Kind::kQuarantine), ElementsAre(1));
  EXPECT_THAT(StepsOf(report, Kind::kRemove), ElementsAre(2));
  EXPECT_TRUE(absl::StrContains(report.actions[0].reason, "notes.txt"));
  EXPECT_EQ(testing::DescribeDifference(before, testing::SnapshotTree(Quarantined(report))), "");
  EXPECT_THAT(*store->ListSteps(), ElementsAre(3));
}

TEST_F(RetentionTest, AStepHoldingAFifoIsQuarantined) {
  SaveSteps(2);
  ASSERT_EQ(::mkfifo((Step(1) + "/pipe").c_str(), 0600), 0);
  auto store = Open();
  RetentionReport report = RetireAllButLatest(*store);
  EXPECT_THAT(StepsOf(report, Kind::kQuarantine), ElementsAre(1));
  EXPECT_TRUE(fs::is_fifo(fs::symlink_status(Quarantined(report) + "/pipe")));
}

TEST_F(RetentionTest, AStepHoldingANestedStoreIsQuarantinedAndTheNestedStoreStillOpens) {
  SaveSteps(2);
  // Saved beside, then moved in: a store is never opened inside another's step.
  CKPT_ASSERT_OK(testing::SaveSyntheticStep(tmp_.path() + "/nested", options_, 1, 7));
  fs::rename(tmp_.path() + "/nested", Step(1) + "/nested");
  auto store = Open();
  RetentionReport report = RetireAllButLatest(*store);
  EXPECT_THAT(StepsOf(report, Kind::kQuarantine), ElementsAre(1));
  auto state = testing::CheckStoreConsistent(Quarantined(report) + "/nested", options_);
  CKPT_ASSERT_OK(state);
  EXPECT_EQ(*state, std::optional<uint64_t>(7));
}

TEST_F(RetentionTest, AStepHoldingALinkIsQuarantinedAndTheTargetUntouched) {
  SaveSteps(2);
  std::ofstream(tmp_.path() + "/outside.txt") << "keep me";
  fs::create_symlink(tmp_.path() + "/outside.txt", Step(1) + "/link");
  auto store = Open();
  RetentionReport report = RetireAllButLatest(*store);
  EXPECT_THAT(StepsOf(report, Kind::kQuarantine), ElementsAre(1));
  EXPECT_TRUE(fs::is_symlink(Quarantined(report) + "/link"));
  EXPECT_TRUE(fs::exists(tmp_.path() + "/outside.txt"));
}

TEST_F(RetentionTest, AStepHoldingADataFileItsManifestDoesNotListIsQuarantined) {
  SaveSteps(2);
  fs::copy_file(Step(1) + "/rank-00000.data", Step(1) + "/rank-00009.data");
  auto store = Open();
  RetentionReport report = RetireAllButLatest(*store);
  EXPECT_THAT(StepsOf(report, Kind::kQuarantine), ElementsAre(1));
}

TEST_F(RetentionTest, AStepHoldingAMountPointIsLeftWholeAndNothingElseOfItIsRenamed) {
  SaveSteps(3);
  fs::create_directory(Step(1) + "/mnt");
  std::ofstream(Step(1) + "/mnt/theirs.txt") << "on another file system";
  std::ofstream(Step(1) + "/notes.txt") << "a user's file beside the mount";
  OtherMountEnv env(posix_.get(), Step(1) + "/mnt");
  const testing::TreeSnapshot before = testing::SnapshotTree(Step(1));
  auto store = Open(&env);
  RetentionReport report = RetireAllButLatest(*store);
  EXPECT_THAT(StepsOf(report, Kind::kKeep), ElementsAre(1));
  EXPECT_THAT(StepsOf(report, Kind::kRemove), ElementsAre(2));
  EXPECT_TRUE(absl::StrContains(report.actions[0].reason, "mnt"));
  EXPECT_THAT(report.quarantined, IsEmpty());
  EXPECT_EQ(testing::DescribeDifference(before, testing::SnapshotTree(Step(1))), "");
}

TEST_F(RetentionTest, AStepThatIsAMountPointNeitherCountsNorGoes) {
  SaveSteps(3);
  OtherMountEnv env(posix_.get(), Step(2));
  auto store = Open(&env);
  RetentionReport report = RetireAllButLatest(*store);
  EXPECT_THAT(StepsOf(report, Kind::kRemove), ElementsAre(1));
  EXPECT_THAT(*store->ListSteps(), ElementsAre(2, 3));
}

TEST_F(RetentionTest, RetentionAfterACommitQuarantinesAStepHoldingAUserFile) {
  SaveSteps(2);
  std::ofstream(Step(1) + "/notes.txt") << "my results";
  options_.retention = {.keep_last = 1};
  CKPT_ASSERT_OK(testing::SaveSyntheticStep(root_, options_, 2, 3));
  auto store = Open();
  EXPECT_THAT(*store->ListSteps(), ElementsAre(3));
  auto quarantine = store->ListQuarantine();
  CKPT_ASSERT_OK(quarantine);
  ASSERT_EQ(quarantine->size(), 1u);
  EXPECT_TRUE(fs::exists(root_ + "/quarantine/" + (*quarantine)[0] + "/notes.txt"));
}

TEST_F(RetentionTest, KeepOnlyQuarantinesAStepHoldingAUserDirectory) {
  SaveSteps(3);
  fs::create_directory(Step(2) + "/my-results");
  auto store = Open();
  auto report = store->ApplyRetention({.keep_only = std::vector<uint64_t>{}});
  CKPT_ASSERT_OK(report);
  EXPECT_THAT(StepsOf(*report, Kind::kRemove), ElementsAre(1));
  EXPECT_THAT(StepsOf(*report, Kind::kQuarantine), ElementsAre(2));
  EXPECT_TRUE(fs::is_directory(Quarantined(*report) + "/my-results"));
}

}  // namespace
}  // namespace ckpt
