// The recovery table through ckpt-tool: for every case, `gc --dry-run` prints exactly the
// recovery lines the real `gc` then prints (and does); a real bind mount of another store's
// step is never entered; adopt and quarantine are the operator's ways on.
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
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
