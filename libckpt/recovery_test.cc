// Recovery never deletes what it cannot read (recovery.cc): for each way the step LATEST names
// can be unreadable, Open either refuses and changes nothing, or falls back and sets the newer
// steps aside in quarantine/, byte for byte. Runs on a real directory through PosixEnv, with
// EACCES injected by a FaultInjectionEnv (the tests may run as root, whom chmod does not stop).
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <set>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "ckpt/base/coding.h"
#include "ckpt/base/status_macros.h"
#include "ckpt/checkpoint_store.h"
#include "tests/support/fault_injection_env.h"
#include "tests/support/recovery_cases.h"
#include "tests/support/status_matchers.h"
#include "tests/support/synthetic_state.h"
#include "tests/support/temp_dir.h"
#include "tests/support/tree_snapshot.h"

namespace ckpt {
namespace {

namespace fs = std::filesystem;
using testing::FaultInjectionEnv;
using testing::StatusIs;
using testing::TreeSnapshot;

std::string Slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void Spit(const std::string& path, const std::string& bytes) {
  fs::remove(path);
  std::ofstream(path, std::ios::binary) << bytes;
}

struct Case {
  const char* name;
  // Damages the store under `root`; may arm `env`.
  std::function<void(const std::string& root, FaultInjectionEnv* env)> damage;
  // kOk: recovery falls back to step 2, step 3 set aside. Otherwise the code Open returns.
  absl::StatusCode open_code;
  std::optional<uint64_t> latest_after = std::nullopt;
};

class RecoveryTest : public ::testing::Test {
 protected:
  RecoveryTest() : posix_(NewPosixEnv()), env_(posix_.get()) {
    root_ = tmp_.path() + "/store";
    options_.env = posix_.get();
    options_.chunk_bytes = 1000;
  }
  void SaveThreeSteps() {
    for (uint64_t step : {1, 2, 3})
      CKPT_ASSERT_OK(testing::SaveSyntheticStep(root_, options_, 2, step));
  }
  std::string Step(int step) { return root_ + "/step-0000000" + std::to_string(step); }

  testing::ScopedTempDir tmp_;
  std::unique_ptr<Env> posix_;
  FaultInjectionEnv env_;
  std::string root_;
  StoreOptions options_;
};

class UnreadableStepTest : public RecoveryTest, public ::testing::WithParamInterface<Case> {};

// Every file of `step_dir` in `before` is in `after`, byte for byte, at its place or under
// one quarantine/<step>-<nonce>/ directory.
void ExpectStepKept(const TreeSnapshot& before, const TreeSnapshot& after,
                    const std::string& name) {
  std::string moved_to;
  for (const auto& [path, what] : after) {
    if (absl::StartsWith(path, "quarantine/" + name + "-") && what == "dir" &&
        path.find('/', 11) == std::string::npos) {
      moved_to = path;
    }
  }
  for (const auto& [path, what] : before) {
    if (!absl::StartsWith(path, name + "/")) continue;
    auto here = after.find(path);
    if (here != after.end() && here->second == what) continue;
    ASSERT_FALSE(moved_to.empty()) << path << " is gone and " << name << " is not in quarantine/";
    auto there = after.find(moved_to + path.substr(name.size()));
    ASSERT_NE(there, after.end()) << path << " lost";
    EXPECT_EQ(there->second, what) << path << " changed";
  }
}

TEST_P(UnreadableStepTest, RecoveryNeverDeletesAStepItCannotRead) {
  const Case& c = GetParam();
  SaveThreeSteps();
  c.damage(root_, &env_);
  const TreeSnapshot before = testing::SnapshotTree(root_);
  StoreOptions o = options_;
  o.env = &env_;
  absl::StatusOr<std::unique_ptr<CheckpointStore>> store = CheckpointStore::Open(root_, o);
  const TreeSnapshot after = testing::SnapshotTree(root_);
  if (c.open_code != absl::StatusCode::kOk) {
    ASSERT_THAT(store, StatusIs(c.open_code));
    EXPECT_THAT(std::string(store.status().message()), ::testing::HasSubstr("nothing was changed"));
    EXPECT_EQ(testing::DescribeDifference(before, after), "");
    return;
  }
  CKPT_ASSERT_OK(store);
  EXPECT_EQ((*store)->latest_step(), c.latest_after);
  for (const char* step : {"step-00000001", "step-00000002", "step-00000003"}) {
    ExpectStepKept(before, after, step);
  }
  // What was set aside stays set aside: a second open changes nothing more.
  store->reset();
  auto again = CheckpointStore::Open(root_, o);
  CKPT_ASSERT_OK(again);
  EXPECT_EQ(testing::DescribeDifference(after, testing::SnapshotTree(root_)), "");
}

INSTANTIATE_TEST_SUITE_P(
    Cases, UnreadableStepTest,
    ::testing::Values(
        Case{"NewerManifestVersion",
             [](const std::string& root, FaultInjectionEnv*) {
               CKPT_ASSERT_OK(testing::RewriteManifestVersion(root + "/step-00000003/MANIFEST", 2));
             },
             absl::StatusCode::kFailedPrecondition},
        Case{"PermissionDeniedOnADataFile",
             [](const std::string&, FaultInjectionEnv* env) {
               env->FailReadOpens("step-00000003/rank-00001.data", EACCES);
             },
             absl::StatusCode::kFailedPrecondition},
        Case{"PermissionDeniedOnLatest",
             [](const std::string&, FaultInjectionEnv* env) {
               env->FailReadOpens("/LATEST", EACCES);
             },
             absl::StatusCode::kFailedPrecondition},
        Case{"IoErrorOnTheManifest",
             [](const std::string&, FaultInjectionEnv* env) {
               env->FailReadOpens("step-00000003/MANIFEST", EIO);
             },
             absl::StatusCode::kFailedPrecondition},
        Case{"StepDirectoryIsASymlink",
             [](const std::string& root, FaultInjectionEnv*) {
               fs::rename(root + "/step-00000003", root + "/../elsewhere");
               fs::create_directory_symlink(root + "/../elsewhere", root + "/step-00000003");
             },
             absl::StatusCode::kFailedPrecondition},
        Case{"DataFileIsASymlink",
             [](const std::string& root, FaultInjectionEnv*) {
               const std::string f = root + "/step-00000003/rank-00000.data";
               fs::rename(f, root + "/../rank-00000.data");
               fs::create_symlink(root + "/../rank-00000.data", f);
             },
             absl::StatusCode::kFailedPrecondition},
        Case{"ManifestIsAFifo",
             [](const std::string& root, FaultInjectionEnv*) {
               fs::remove(root + "/step-00000003/MANIFEST");
               ASSERT_EQ(::mkfifo((root + "/step-00000003/MANIFEST").c_str(), 0644), 0);
             },
             absl::StatusCode::kFailedPrecondition},
        Case{"LatestIsAFifo",
             [](const std::string& root, FaultInjectionEnv*) {
               fs::remove(root + "/LATEST");
               ASSERT_EQ(::mkfifo((root + "/LATEST").c_str(), 0644), 0);
             },
             absl::StatusCode::kFailedPrecondition},
        Case{"DamagedLatestAndAnUnreadableNewestStep",
             [](const std::string& root, FaultInjectionEnv* env) {
               Spit(root + "/LATEST", "garbage");
               env->FailReadOpens("step-00000003/MANIFEST", EACCES);
             },
             absl::StatusCode::kFailedPrecondition},
        Case{"OneFieldOfTheManifestDamaged",
             [](const std::string& root, FaultInjectionEnv*) {
               std::string m = Slurp(root + "/step-00000003/MANIFEST");
               m[m.size() / 2] ^= 0x04;
               Spit(root + "/step-00000003/MANIFEST", m);
             },
             absl::StatusCode::kOk, 2},
        Case{"TruncatedDataFile",
             [](const std::string& root, FaultInjectionEnv*) {
               fs::resize_file(root + "/step-00000003/rank-00001.data", 4096 + 100);
             },
             absl::StatusCode::kOk, 2},
        Case{"SparseTebibyteLatest",
             [](const std::string& root, FaultInjectionEnv*) {
               fs::resize_file(root + "/LATEST", uint64_t{1} << 40);
             },
             absl::StatusCode::kOk, 3},
        Case{"LatestNamesAMissingStep",
             [](const std::string& root, FaultInjectionEnv*) {
               Spit(root + "/LATEST", formats::EncodeLatest(99));
             },
             absl::StatusCode::kOk, 3}),
    [](const ::testing::TestParamInfo<Case>& p) { return std::string(p.param.name); });

TEST_F(RecoveryTest, AFileWithAStepNameNewerThanLatestIsQuarantinedNotDeleted) {
  SaveThreeSteps();
  Spit(root_ + "/step-00000009", "not ours");
  auto store = CheckpointStore::Open(root_, options_);
  CKPT_ASSERT_OK(store);
  EXPECT_EQ((*store)->latest_step(), std::optional<uint64_t>(3));
  ASSERT_EQ((*store)->recovery().quarantined.size(), 1u);
  EXPECT_EQ(Slurp(root_ + "/" + (*store)->recovery().quarantined[0]), "not ours");
}

TEST_F(RecoveryTest, GarbageNamesAreRemovedOnlyForTheKindOfEntryCkptMakes) {
  SaveThreeSteps();
  fs::create_directory(root_ + "/.staging-step-00000004-0123456789abcdef");
  Spit(root_ + "/LATEST.tmp", formats::EncodeLatest(4));
  fs::create_directory(root_ + "/LATEST.tmp.d");  // Not a garbage name at all.
  Spit(root_ + "/.deleting-step-00000001-0123456789abcdef", "a file, not ours");
  fs::create_symlink(tmp_.path(), root_ + "/.undo-rank-00000-0123456789abcdef");
  auto store = CheckpointStore::Open(root_, options_);
  CKPT_ASSERT_OK(store);
  EXPECT_FALSE(fs::exists(root_ + "/.staging-step-00000004-0123456789abcdef"));
  EXPECT_FALSE(fs::exists(root_ + "/LATEST.tmp"));
  EXPECT_EQ(Slurp(root_ + "/.deleting-step-00000001-0123456789abcdef"), "a file, not ours");
  EXPECT_TRUE(fs::is_symlink(root_ + "/.undo-rank-00000-0123456789abcdef"));
  EXPECT_TRUE(fs::exists(tmp_.path() + "/store/step-00000003/MANIFEST"));
}

TEST_F(RecoveryTest, ReadOnlyOpenChangesNothing) {
  SaveThreeSteps();
  fs::create_directory(root_ + "/.staging-step-00000004-0123456789abcdef");
  fs::copy(Step(3), root_ + "/step-00000005", fs::copy_options::recursive);
  const TreeSnapshot before = testing::SnapshotTree(root_);
  StoreOptions o = options_;
  o.read_only = true;
  auto store = CheckpointStore::Open(root_, o);
  CKPT_ASSERT_OK(store);
  EXPECT_EQ((*store)->latest_step(), std::optional<uint64_t>(3));
  EXPECT_THAT((*store)->ApplyRetention({1, 0}, /*dry_run=*/false),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT((*store)->BeginSave(6), StatusIs(absl::StatusCode::kFailedPrecondition));
  auto doomed = (*store)->ApplyRetention({1, 0}, /*dry_run=*/true);
  CKPT_ASSERT_OK(doomed);
  EXPECT_EQ(testing::DescribeDifference(before, testing::SnapshotTree(root_)), "");
}

TEST_F(RecoveryTest, QuarantineIsPurgedOnlyOnRequest) {
  SaveThreeSteps();
  Spit(root_ + "/LATEST", "garbage");
  fs::resize_file(Step(3) + "/rank-00000.data", 5000);
  {
    auto store = CheckpointStore::Open(root_, options_);
    CKPT_ASSERT_OK(store);
    auto listed = (*store)->ListQuarantine();
    CKPT_ASSERT_OK(listed);
    EXPECT_EQ(listed->size(), 1u);
  }
  auto store = CheckpointStore::Open(root_, options_);
  CKPT_ASSERT_OK(store);
  auto dry = (*store)->PurgeQuarantine(/*dry_run=*/true);
  CKPT_ASSERT_OK(dry);
  EXPECT_EQ(dry->size(), 1u);
  EXPECT_EQ((*store)->ListQuarantine()->size(), 1u);
  auto purged = (*store)->PurgeQuarantine();
  CKPT_ASSERT_OK(purged);
  EXPECT_EQ(purged->size(), 1u);
  EXPECT_TRUE((*store)->ListQuarantine()->empty());
  EXPECT_TRUE(fs::exists(Step(2) + "/MANIFEST"));
}

TEST_F(RecoveryTest, DanglingLockSymlinkIsRefusedAndItsTargetNotCreated) {
  SaveThreeSteps();
  fs::remove(root_ + "/LOCK");
  fs::create_symlink(tmp_.path() + "/planted-target", root_ + "/LOCK");
  EXPECT_THAT(CheckpointStore::Open(root_, options_),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_FALSE(fs::exists(tmp_.path() + "/planted-target"));
}

TEST_F(RecoveryTest, RootGivenAsASymlinkIsResolvedOnce) {
  SaveThreeSteps();
  fs::create_directory_symlink(root_, tmp_.path() + "/link");
  auto store = CheckpointStore::Open(tmp_.path() + "/link", options_);
  CKPT_ASSERT_OK(store);
  EXPECT_EQ((*store)->latest_step(), std::optional<uint64_t>(3));
  EXPECT_EQ((*store)->root(), fs::canonical(root_).string());
  CKPT_ASSERT_OK((*store)->OpenLatest());
}

TEST_F(RecoveryTest, ReaderRefusesAStepWhoseManifestNamesAnotherStep) {
  SaveThreeSteps();
  fs::copy(Step(2), root_ + "/step-00000007", fs::copy_options::recursive);
  StoreOptions o = options_;
  o.read_only = true;
  auto store = CheckpointStore::Open(root_, o);
  CKPT_ASSERT_OK(store);
  EXPECT_THAT((*store)->OpenStep(7), StatusIs(absl::StatusCode::kDataLoss));
  CKPT_ASSERT_OK((*store)->OpenStep(2));
}

// The recovery table (tests/support/recovery_cases.cc, docs/design/recovery.md): the dry run's
// plan is exactly what Open then does, each entry gets its verdict, removed entries are gone,
// quarantined ones are in quarantine/ byte for byte, everything else is untouched, and a second
// Open changes nothing more.
class RecoveryTableTest : public ::testing::TestWithParam<testing::RecoveryCase> {};

std::vector<std::string> Describe(const std::vector<RecoveryAction>& actions) {
  std::vector<std::string> out;
  for (const RecoveryAction& a : actions) out.push_back(DescribeAction(a));
  return out;
}

TEST_P(RecoveryTableTest, DryRunPlanIsWhatOpenDoesAndEachEntryGetsItsVerdict) {
  const testing::RecoveryCase& c = GetParam();
  testing::ScopedTempDir tmp;
  const std::string root = tmp.path() + "/store", scratch = tmp.path() + "/scratch";
  fs::create_directory(scratch);
  CKPT_ASSERT_OK(testing::PlantThreeSteps(root));
  c.plant(root, scratch);
  std::unique_ptr<Env> posix = NewPosixEnv();
  const TreeSnapshot before = testing::SnapshotTree(root);
  const TreeSnapshot scratch_before = testing::SnapshotTree(scratch);
  absl::StatusOr<RecoveryPlan> plan = PlanRecovery(posix.get(), root);
  EXPECT_EQ(testing::DescribeDifference(before, testing::SnapshotTree(root)), "")
      << "the dry run changed the root";
  StoreOptions options;
  options.env = posix.get();
  absl::StatusOr<std::unique_ptr<CheckpointStore>> store = CheckpointStore::Open(root, options);
  const TreeSnapshot after = testing::SnapshotTree(root);
  EXPECT_EQ(testing::DescribeDifference(scratch_before, testing::SnapshotTree(scratch)), "")
      << "recovery changed something outside the root";
  ASSERT_EQ(plan.status().code(), c.code) << plan.status();
  ASSERT_EQ(store.status().code(), c.code) << store.status();
  if (c.code != absl::StatusCode::kOk) {
    EXPECT_EQ(plan.status().message(), store.status().message());
    EXPECT_THAT(std::string(store.status().message()), ::testing::HasSubstr("nothing was changed"));
    EXPECT_EQ(testing::DescribeDifference(before, after), "");
    return;
  }
  const RecoveryReport& report = (*store)->recovery();
  EXPECT_EQ(Describe(plan->actions), Describe(report.actions));
  std::map<std::string, RecoveryAction::Kind> done;
  for (const RecoveryAction& a : report.actions) done[a.name] = a.kind;
  std::map<std::string, RecoveryAction::Kind> expected(c.verdicts.begin(), c.verdicts.end());
  EXPECT_EQ(done, expected) << ::testing::PrintToString(Describe(report.actions));
  EXPECT_EQ((*store)->latest_step(), c.latest_after);
  for (const auto& [name, kind] : c.verdicts) {
    std::string moved_to;
    for (const std::string& q : report.quarantined) {
      if (absl::StartsWith(q, "quarantine/" + name + "-")) moved_to = q;
    }
    for (const auto& [path, what] : before) {
      if (path != name && !absl::StartsWith(path, name + "/")) continue;
      auto here = after.find(path);
      switch (kind) {
        case RecoveryAction::Kind::kRemove:
          EXPECT_EQ(here, after.end()) << path << " was not removed";
          break;
        case RecoveryAction::Kind::kQuarantine: {
          EXPECT_EQ(here, after.end()) << path << " was not moved";
          ASSERT_FALSE(moved_to.empty()) << name << " is not in quarantine/";
          auto there = after.find(moved_to + path.substr(name.size()));
          ASSERT_NE(there, after.end()) << path << " lost";
          EXPECT_EQ(there->second, what) << path << " changed";
          break;
        }
        case RecoveryAction::Kind::kKeep:
          ASSERT_NE(here, after.end()) << path << " was not kept";
          EXPECT_EQ(here->second, what) << path << " changed";
          break;
        case RecoveryAction::Kind::kSetLatest:
          break;
      }
    }
  }
  // Entries no verdict names are untouched.
  for (const auto& [path, what] : before) {
    const std::string top = path.substr(0, path.find('/'));
    if (expected.count(top)) continue;
    auto here = after.find(path);
    ASSERT_NE(here, after.end()) << path << " is gone";
    EXPECT_EQ(here->second, what) << path << " changed";
  }
  store->reset();
  auto again = CheckpointStore::Open(root, options);
  CKPT_ASSERT_OK(again);
  for (const RecoveryAction& a : (*again)->recovery().actions) {
    EXPECT_EQ(a.kind, RecoveryAction::Kind::kKeep) << DescribeAction(a);
  }
  EXPECT_EQ(testing::DescribeDifference(after, testing::SnapshotTree(root)), "");
}

INSTANTIATE_TEST_SUITE_P(Table, RecoveryTableTest, ::testing::ValuesIn(testing::RecoveryCases()),
                         [](const ::testing::TestParamInfo<testing::RecoveryCase>& p) {
                           return std::string(p.param.name);
                         });

TEST(RecoveryDocTest, TheDocsTableNamesExactlyTheCasesTheTestsWalk) {
  const std::string doc = Slurp(CKPT_RECOVERY_DOC);
  ASSERT_FALSE(doc.empty()) << CKPT_RECOVERY_DOC;
  std::set<std::string> in_doc;
  size_t at = 0;
  // Table rows start with "| `CaseName` |".
  while ((at = doc.find("\n| `", at)) != std::string::npos) {
    at += 4;
    const size_t end = doc.find('`', at);
    in_doc.insert(doc.substr(at, end - at));
  }
  std::set<std::string> tested;
  for (const testing::RecoveryCase& c : testing::RecoveryCases()) tested.insert(c.name);
  EXPECT_EQ(in_doc, tested);
}

// An Env that reports everything below `prefix` on another mount, as a bind mount shows.
class OtherMountEnv : public EnvWrapper {
 public:
  OtherMountEnv(Env* target, std::string prefix) : EnvWrapper(target), prefix_(std::move(prefix)) {}
  absl::StatusOr<FileInfo> Stat(const std::string& path) override {
    CKPT_ASSIGN_OR_RETURN(FileInfo info, target()->Stat(path));
    if (path == prefix_ || absl::StartsWith(path, prefix_ + "/")) info.mount_id += 1000;
    return info;
  }

 private:
  std::string prefix_;
};

TEST_F(RecoveryTest, AStepOnAnotherMountIsNeverEnteredNorAdoptedAsLatest) {
  SaveThreeSteps();
  // Another store's committed step 9, mounted into this root.
  CKPT_ASSERT_OK(testing::SaveSyntheticStep(tmp_.path() + "/other", options_, 2, 9));
  fs::rename(tmp_.path() + "/other/step-00000009", root_ + "/step-00000009");
  Spit(root_ + "/LATEST", "garbage");  // A fallback must not pick it either.
  OtherMountEnv env(posix_.get(), root_ + "/step-00000009");
  StoreOptions o = options_;
  o.env = &env;
  const TreeSnapshot before = testing::SnapshotTree(root_ + "/step-00000009");
  auto store = CheckpointStore::Open(root_, o);
  CKPT_ASSERT_OK(store);
  EXPECT_EQ((*store)->latest_step(), std::optional<uint64_t>(3));
  EXPECT_THAT((*store)->recovery().kept, ::testing::Contains("step-00000009"));
  EXPECT_EQ(testing::DescribeDifference(before, testing::SnapshotTree(root_ + "/step-00000009")),
            "");
  // Retention leaves it alone too, and so does RemoveRecursively of a tree holding it.
  CKPT_ASSERT_OK((*store)->ApplyRetention({1, 0}));
  EXPECT_TRUE(fs::exists(root_ + "/step-00000009/MANIFEST"));
}

TEST_F(RecoveryTest, AdoptRefusesAStepOnAnotherMountOrALinkAndLatestStays) {
  SaveThreeSteps();
  CKPT_ASSERT_OK(testing::SaveSyntheticStep(tmp_.path() + "/other", options_, 2, 9));
  CKPT_ASSERT_OK(testing::SaveSyntheticStep(tmp_.path() + "/other", options_, 2, 10));
  fs::rename(tmp_.path() + "/other/step-00000009", root_ + "/step-00000009");
  OtherMountEnv env(posix_.get(), root_ + "/step-00000009");
  StoreOptions o = options_;
  o.env = &env;
  auto store = CheckpointStore::Open(root_, o);
  CKPT_ASSERT_OK(store);
  EXPECT_THAT((*store)->Adopt(9), StatusIs(absl::StatusCode::kFailedPrecondition));
  fs::create_directory_symlink(tmp_.path() + "/other/step-00000010", root_ + "/step-00000010");
  EXPECT_THAT((*store)->Adopt(10), StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_EQ((*store)->latest_step(), std::optional<uint64_t>(3));
  EXPECT_EQ(*ReadLatest(posix_.get(), root_), std::optional<uint64_t>(3));
}

TEST_F(RecoveryTest, AStagingDirectoryThatIsAMountPointIsKeptAndOneHoldingAMountIsNotRemoved) {
  SaveThreeSteps();
  const std::string mounted = root_ + "/.staging-step-00000004-0123456789abcdef";
  const std::string holding = root_ + "/.deleting-step-00000002-0123456789abcdef";
  fs::copy(Step(1), mounted, fs::copy_options::recursive);
  fs::copy(Step(2), holding, fs::copy_options::recursive);
  fs::create_directory(holding + "/step-00000001");
  Spit(holding + "/step-00000001/MANIFEST", "CKPTMANI");
  OtherMountEnv env(posix_.get(), mounted);
  OtherMountEnv env2(&env, holding + "/step-00000001");
  StoreOptions o = options_;
  o.env = &env2;
  auto store = CheckpointStore::Open(root_, o);
  CKPT_ASSERT_OK(store);
  EXPECT_TRUE(fs::exists(mounted + "/MANIFEST"));
  EXPECT_FALSE(fs::exists(holding));
  ASSERT_EQ((*store)->recovery().quarantined.size(), 1u);
  EXPECT_TRUE(fs::exists(root_ + "/" + (*store)->recovery().quarantined[0] +
                         "/step-00000001/MANIFEST"));
  EXPECT_THAT(RemoveRecursively(&env, mounted), StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_TRUE(fs::exists(mounted + "/MANIFEST"));
}

TEST_F(RecoveryTest, RemovingTheLockFileDoesNotLetASecondWriterIn) {
  SaveThreeSteps();
  auto first = CheckpointStore::Open(root_, options_);
  CKPT_ASSERT_OK(first);
  fs::remove(root_ + "/LOCK");
  EXPECT_THAT(CheckpointStore::Open(root_, options_),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  // Replaced by another file: still refused.
  Spit(root_ + "/LOCK", "");
  EXPECT_THAT(CheckpointStore::Open(root_, options_),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  // A save through a second handle is refused too; once the first is gone a second one opens.
  EXPECT_THAT(testing::SaveSyntheticStep(root_, options_, 1, 4),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  first->reset();
  CKPT_ASSERT_OK(CheckpointStore::Open(root_, options_));
}

TEST_F(RecoveryTest, ASaveOfAnUnpublishedStepNumberSetsTheOldOneAsideWhole) {
  for (uint64_t step : {1, 2, 3, 4}) {
    CKPT_ASSERT_OK(testing::SaveSyntheticStep(root_, options_, 2, step));
  }
  Spit(root_ + "/LATEST", formats::EncodeLatest(3));
  const TreeSnapshot old4 = testing::SnapshotTree(Step(4));
  CKPT_ASSERT_OK(testing::SaveSyntheticStep(root_, options_, 2, 4));
  auto store = CheckpointStore::Open(root_, options_);
  CKPT_ASSERT_OK(store);
  EXPECT_EQ((*store)->latest_step(), std::optional<uint64_t>(4));
  auto quarantined = (*store)->ListQuarantine();
  CKPT_ASSERT_OK(quarantined);
  ASSERT_EQ(quarantined->size(), 1u);
  EXPECT_EQ(testing::DescribeDifference(
                old4, testing::SnapshotTree(root_ + "/quarantine/" + (*quarantined)[0])),
            "");
}

TEST_F(RecoveryTest, AdoptMakesAnIntactUnpublishedStepLatestAndRefusesADamagedOne) {
  for (uint64_t step : {1, 2, 3, 4, 5}) {
    CKPT_ASSERT_OK(testing::SaveSyntheticStep(root_, options_, 2, step));
  }
  Spit(root_ + "/LATEST", formats::EncodeLatest(3));
  std::string data = Slurp(Step(4) + "/rank-00000.data");
  data[4096 + 100] ^= 1;  // A payload byte: only a chunk check sees it.
  Spit(Step(4) + "/rank-00000.data", data);
  auto store = CheckpointStore::Open(root_, options_);
  CKPT_ASSERT_OK(store);
  EXPECT_THAT((*store)->Adopt(4), StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_EQ((*store)->latest_step(), std::optional<uint64_t>(3));
  EXPECT_THAT((*store)->Adopt(7), StatusIs(absl::StatusCode::kNotFound));
  CKPT_ASSERT_OK((*store)->Adopt(5));
  EXPECT_EQ((*store)->latest_step(), std::optional<uint64_t>(5));
  store->reset();
  auto reopened = CheckpointStore::Open(root_, options_);
  CKPT_ASSERT_OK(reopened);
  EXPECT_EQ((*reopened)->latest_step(), std::optional<uint64_t>(5));
}

TEST_F(RecoveryTest, QuarantiningLatestFallsBackAndQuarantiningAllLeavesAnEmptyStore) {
  SaveThreeSteps();
  auto store = CheckpointStore::Open(root_, options_);
  CKPT_ASSERT_OK(store);
  auto moved = (*store)->QuarantineStep(3);
  CKPT_ASSERT_OK(moved);
  EXPECT_TRUE(fs::exists(root_ + "/" + *moved + "/MANIFEST"));
  EXPECT_EQ((*store)->latest_step(), std::optional<uint64_t>(2));
  auto all = (*store)->QuarantineAll();
  CKPT_ASSERT_OK(all);
  EXPECT_EQ(all->size(), 3u);  // LATEST, step 1, step 2.
  store->reset();
  auto empty = CheckpointStore::Open(root_, options_);
  CKPT_ASSERT_OK(empty);
  EXPECT_EQ((*empty)->latest_step(), std::nullopt);
  EXPECT_EQ((*empty)->ListQuarantine()->size(), 4u);
}

}  // namespace
}  // namespace ckpt
