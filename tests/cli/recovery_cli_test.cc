// The recovery table through ckpt-tool: for every case, `gc --dry-run` prints exactly the
// recovery lines the real `gc` then prints (and does); a real bind mount of another store's
// step is never entered nor adopted; retention's dry run says per step what gc then does (a
// step holding a user's file is quarantined, one holding a mount point is left whole); adopt
// and quarantine are the operator's ways on.
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "ckpt/checkpoint_store.h"
#include "ckpt/formats/chunk.h"
#include "tests/support/recovery_cases.h"
#include "tests/support/run_command.h"
#include "tests/support/synthetic_state.h"
#include "tests/support/temp_dir.h"
#include "tests/support/tree_snapshot.h"

namespace ckpt {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

// The tool under test; CKPT_TOOL overrides it (to show that a case fails on an older build).
std::string Tool() {
  const char* override_path = std::getenv("CKPT_TOOL");
  return override_path != nullptr ? override_path : CKPT_TOOL_PATH;
}

testing::CommandResult RunTool(const std::string& args) {
  return testing::RunCommand(Tool() + " " + args);
}

// The lines of `output` that start with `prefix`, without it.
std::vector<std::string> LinesAfter(const std::string& output, absl::string_view prefix) {
  std::vector<std::string> out;
  std::istringstream in(output);
  for (std::string line; std::getline(in, line);) {
    absl::string_view view = line;
    if (absl::ConsumePrefix(&view, prefix)) out.emplace_back(view);
  }
  return out;
}

void Spit(const std::string& path, const std::string& bytes) {
  fs::remove(path);
  std::ofstream(path, std::ios::binary) << bytes;
}

class RecoveryCliTest : public ::testing::TestWithParam<testing::RecoveryCase> {};

TEST_P(RecoveryCliTest, GcDryRunPrintsExactlyWhatGcThenDoes) {
  const testing::RecoveryCase& c = GetParam();
  testing::ScopedTempDir tmp;
  const std::string root = tmp.path() + "/store", scratch = tmp.path() + "/scratch";
  fs::create_directory(scratch);
  ASSERT_TRUE(testing::PlantThreeSteps(root).ok());
  c.plant(root, scratch);
  const testing::TreeSnapshot before = testing::SnapshotTree(root);
  const testing::CommandResult dry = RunTool("gc " + root + " --keep-last 1000 --dry-run");
  EXPECT_EQ(testing::DescribeDifference(before, testing::SnapshotTree(root)), "");
  const testing::CommandResult real = RunTool("gc " + root + " --keep-last 1000");
  EXPECT_EQ(dry.exit_code, real.exit_code) << dry.output << "\n---\n" << real.output;
  EXPECT_EQ(dry.exit_code, c.code == absl::StatusCode::kOk ? 0 : 2) << dry.output;
  const std::vector<std::string> planned = LinesAfter(dry.output, "recovery would: ");
  EXPECT_EQ(planned, LinesAfter(real.output, "recovery: ")) << real.output;
  EXPECT_EQ(planned.size(), c.verdicts.size()) << dry.output;
  if (c.code != absl::StatusCode::kOk) {
    EXPECT_THAT(real.output, HasSubstr("nothing was changed"));
    EXPECT_EQ(testing::DescribeDifference(before, testing::SnapshotTree(root)), "");
  }
}

INSTANTIATE_TEST_SUITE_P(Table, RecoveryCliTest, ::testing::ValuesIn(testing::RecoveryCases()),
                         [](const ::testing::TestParamInfo<testing::RecoveryCase>& p) {
                           return std::string(p.param.name);
                         });

TEST(RecoveryCliMountTest, BindMountedStepOfAnotherStoreSurvivesGc) {
  testing::ScopedTempDir tmp;
  const std::string root = tmp.path() + "/store", other = tmp.path() + "/other";
  ASSERT_TRUE(testing::PlantThreeSteps(root).ok());
  // Step 9 of the other store, mounted as this root's step 9, with this root's LATEST damaged
  // so that a fallback would look for the newest intact step.
  StoreOptions options;
  options.chunk_bytes = 1000;
  ASSERT_TRUE(testing::SaveSyntheticStep(other, options, 2, 9).ok());
  ASSERT_EQ(RunTool("verify " + other).exit_code, 0);
  fs::create_directory(root + "/step-00000009");
  Spit(root + "/LATEST", "garbage");
  const std::string tool = Tool();
  // A private mount namespace: the mount ends with the shell, whatever happens.
  const testing::CommandResult r = testing::RunCommand(absl::StrCat(
      "unshare -m sh -c 'mount --bind ", other, "/step-00000009 ", root,
      "/step-00000009 || exit 77; ", tool, " gc ", root, " --keep-last 1; echo gc=$?; ", tool,
      " gc ", root, " --keep-last 1; echo again=$?; ", tool,
      " verify ", other, "; echo verify=$?'"));
  ASSERT_NE(r.exit_code, 77) << "mount --bind is not permitted here: " << r.output;
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("gc=0"));
  EXPECT_THAT(r.output, HasSubstr("again=0"));  // Now with an intact LATEST below it.
  EXPECT_THAT(r.output, HasSubstr("keep step-00000009: a mount point"));
  EXPECT_THAT(r.output, HasSubstr("LATEST := step 3"));
  EXPECT_THAT(r.output, HasSubstr("verify=0"));
  EXPECT_EQ(RunTool("verify " + other + " --all").exit_code, 0);
  EXPECT_TRUE(fs::exists(other + "/step-00000009/MANIFEST"));
}

// Retention's lines of `output` ("deleted step-...", "would quarantine step-..."), each as
// the real run words it: "would delete" -> "deleted", "would quarantine" -> "quarantined",
// "would leave" -> "left".
std::vector<std::string> RetentionLines(const std::string& output) {
  std::vector<std::string> out;
  std::istringstream in(output);
  for (std::string line; std::getline(in, line);) {
    using Words = std::pair<const char*, const char*>;
    for (auto [dry, real] : {Words{"would delete step-", "deleted step-"},
                             Words{"would quarantine step-", "quarantined step-"},
                             Words{"would leave step-", "left step-"},
                             Words{"deleted step-", "deleted step-"},
                             Words{"quarantined step-", "quarantined step-"},
                             Words{"left step-", "left step-"}}) {
      absl::string_view view = line;
      if (absl::ConsumePrefix(&view, dry)) out.push_back(absl::StrCat(real, view));
    }
  }
  return out;
}

TEST(RetentionCliTest, GcDryRunSaysPerStepWhatRetentionThenDoes) {
  testing::ScopedTempDir tmp;
  const std::string root = tmp.path() + "/store";
  ASSERT_TRUE(testing::PlantThreeSteps(root).ok());
  Spit(root + "/step-00000001/notes.txt", "a user's notes");
  const testing::CommandResult dry = RunTool("gc " + root + " --keep-last 1 --dry-run");
  ASSERT_EQ(dry.exit_code, 0) << dry.output;
  EXPECT_THAT(dry.output, HasSubstr("would quarantine step-00000001 (holds notes.txt"));
  EXPECT_THAT(dry.output, HasSubstr("would delete step-00000002"));
  EXPECT_THAT(dry.output, HasSubstr("would delete 1 step(s): 2"));
  const testing::CommandResult real = RunTool("gc " + root + " --keep-last 1");
  ASSERT_EQ(real.exit_code, 0) << real.output;
  EXPECT_EQ(RetentionLines(dry.output), RetentionLines(real.output)) << real.output;
  EXPECT_EQ(RetentionLines(real.output).size(), 2u) << real.output;
  EXPECT_FALSE(fs::exists(root + "/step-00000001"));
  bool kept = false;
  for (const auto& e : fs::directory_iterator(root + "/quarantine")) {
    kept |= fs::exists(e.path() / "notes.txt");
  }
  EXPECT_TRUE(kept) << "the user's file went with its step into quarantine/";
}

TEST(RetentionCliMountTest, GcLeavesADoomedStepHoldingAMountPointWholeAsItsDryRunSays) {
  testing::ScopedTempDir tmp;
  const std::string root = tmp.path() + "/store", theirs = tmp.path() + "/theirs";
  ASSERT_TRUE(testing::PlantThreeSteps(root).ok());
  fs::create_directory(theirs);
  Spit(theirs + "/data.bin", "someone else's file system");
  fs::create_directory(root + "/step-00000001/mnt");
  const testing::TreeSnapshot before = testing::SnapshotTree(root + "/step-00000001");
  const std::string tool = Tool();
  const testing::CommandResult r = testing::RunCommand(absl::StrCat(
      "unshare -m sh -c 'mount --bind ", theirs, " ", root, "/step-00000001/mnt || exit 77; ",
      tool, " gc ", root, " --keep-last 1 --dry-run; echo dry=$?; ", tool, " gc ", root,
      " --keep-last 1; echo gc=$?; test -f ", root, "/step-00000001/mnt/data.bin; echo in=$?'"));
  ASSERT_NE(r.exit_code, 77) << "mount --bind is not permitted here: " << r.output;
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("dry=0"));
  EXPECT_THAT(r.output, HasSubstr("gc=0"));
  EXPECT_THAT(r.output, HasSubstr("in=0"));
  EXPECT_THAT(r.output, HasSubstr("would leave step-00000001 (mount point: mnt"));
  EXPECT_THAT(r.output, HasSubstr("left step-00000001 (mount point: mnt"));
  const std::vector<std::string> lines = RetentionLines(r.output);
  ASSERT_EQ(lines.size(), 4u) << r.output;
  EXPECT_EQ(std::vector<std::string>(lines.begin(), lines.begin() + 2),
            std::vector<std::string>(lines.begin() + 2, lines.end()));
  EXPECT_EQ(testing::DescribeDifference(before, testing::SnapshotTree(root + "/step-00000001")),
            "");
  EXPECT_TRUE(fs::exists(theirs + "/data.bin"));
  EXPECT_FALSE(fs::exists(root + "/step-00000002"));
}

TEST(RecoveryCliMountTest, AdoptRefusesAStepThatIsABindMountOfAnotherStore) {
  testing::ScopedTempDir tmp;
  const std::string root = tmp.path() + "/store", other = tmp.path() + "/other";
  ASSERT_TRUE(testing::PlantThreeSteps(root).ok());
  StoreOptions options;
  options.chunk_bytes = 1000;
  ASSERT_TRUE(testing::SaveSyntheticStep(other, options, 2, 9).ok());
  fs::create_directory(root + "/step-00000009");
  const std::string tool = Tool();
  const testing::CommandResult r = testing::RunCommand(absl::StrCat(
      "unshare -m sh -c 'mount --bind ", other, "/step-00000009 ", root,
      "/step-00000009 || exit 77; ", tool, " adopt ", root, " 9; echo adopt=$?'"));
  ASSERT_NE(r.exit_code, 77) << "mount --bind is not permitted here: " << r.output;
  EXPECT_THAT(r.output, HasSubstr("adopt=2")) << r.output;
  EXPECT_THAT(r.output, HasSubstr("mount point"));
  absl::StatusOr<std::optional<uint64_t>> latest = ReadLatest(Env::Default(), root);
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_EQ(*latest, std::optional<uint64_t>(3));
  EXPECT_EQ(RunTool("verify " + other + " --all").exit_code, 0);
}

TEST(RecoveryCliOperatorTest, AdoptQuarantineAndStartingAfreshAfterEveryStepIsDamaged) {
  testing::ScopedTempDir tmp;
  const std::string root = tmp.path() + "/store";
  ASSERT_TRUE(testing::PlantThreeSteps(root).ok());
  EXPECT_EQ(RunTool("adopt " + root + " 2").exit_code, 0);
  EXPECT_THAT(RunTool("inspect " + root).output, HasSubstr("LATEST"));
  EXPECT_EQ(RunTool("adopt " + root + " 3").exit_code, 0);
  const testing::CommandResult q = RunTool("quarantine " + root + " 3");
  EXPECT_EQ(q.exit_code, 0) << q.output;
  EXPECT_THAT(q.output, HasSubstr("LATEST names step 2"));
  for (const char* step : {"1", "2"}) {
    fs::resize_file(root + "/step-0000000" + std::string(step) + "/rank-00001.data", 4096 + 100);
  }
  const testing::CommandResult refused = RunTool("gc " + root + " --keep-last 1");
  EXPECT_EQ(refused.exit_code, 2);
  EXPECT_THAT(refused.output, HasSubstr("no step is intact"));
  EXPECT_THAT(refused.output, HasSubstr("quarantine"));
  const testing::CommandResult fresh = RunTool("quarantine " + root + " --all");
  EXPECT_EQ(fresh.exit_code, 0) << fresh.output;
  EXPECT_EQ(RunTool("gc " + root + " --keep-last 1").exit_code, 0);
  EXPECT_FALSE(fs::exists(root + "/LATEST"));
  EXPECT_EQ(std::distance(fs::directory_iterator(root + "/quarantine"), fs::directory_iterator()),
            4);
}

}  // namespace
}  // namespace ckpt
