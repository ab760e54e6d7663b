// The demo trainer end to end: a run killed in the middle of a save resumes from LATEST and ends
// bit for bit where a run that never crashed ends; the store verifies; the exported model opens.
#include <sys/stat.h>

#include <cstdio>
#include <regex>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "ckpt/hf_checkpoint.h"
#include "ckpt/verify.h"
#include "tests/support/run_command.h"
#include "tests/support/status_matchers.h"
#include "tests/support/temp_dir.h"

namespace ckpt {
namespace {

using testing::CommandResult;
using ::testing::HasSubstr;

CommandResult Trainer(const std::string& args) {
  return testing::RunCommand(std::string(CKPT_DEMO_TRAINER_PATH) + " " + args);
}

// The losses the trainer printed, in order.
std::vector<double> Losses(const std::string& output) {
  std::vector<double> out;
  const std::regex line(R"(step +\d+  loss ([0-9.e+-]+))");
  for (auto it = std::sregex_iterator(output.begin(), output.end(), line);
       it != std::sregex_iterator(); ++it) {
    out.push_back(std::stod((*it)[1]));
  }
  return out;
}

// Crashes a run on `ranks` ranks at step 8 and resumes it on `resume_ranks`.
void CrashAndResume(const std::string& out, const std::string& flags, int ranks = 3,
                    int resume_ranks = 3) {
  const std::string common = "--out " + out + flags + " --steps 9 --save-every 3";
  CommandResult crashed = Trainer(common + " --ranks " + std::to_string(ranks) + " --crash-at 8");
  if (crashed.exit_code == 2 && (crashed.output.find("UNIMPLEMENTED") != std::string::npos ||
                                 crashed.output.find("FAILED_PRECONDITION") != std::string::npos)) {
    GTEST_SKIP() << "no engine here: " << crashed.output;  // Only --engine cuda can say so.
  }
  ASSERT_EQ(crashed.exit_code, 128 + 9) << crashed.output;  // SIGKILL, mid-save.
  EXPECT_THAT(crashed.output, HasSubstr("step   8  save half written"));
  const std::vector<double> before = Losses(crashed.output);
  ASSERT_EQ(before.size(), 8u) << crashed.output;

  CommandResult resumed =
      Trainer(common + " --ranks " + std::to_string(resume_ranks) + " --resume");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_THAT(resumed.output, HasSubstr("recovery removed .staging-step-00000008"));
  EXPECT_THAT(resumed.output, HasSubstr("resumed from step 6 (LATEST)"));
  EXPECT_THAT(resumed.output, HasSubstr("equals an uninterrupted one bit for bit"));
  const std::vector<double> after = Losses(resumed.output);
  ASSERT_EQ(after.size(), 3u) << resumed.output;  // Steps 7, 8, 9.
  EXPECT_EQ(after[0], before[6]);                 // Step 7 again, from the same state.
  EXPECT_EQ(after[1], before[7]);
  EXPECT_LT(after[2], before[0]);  // It trains.

  // Every committed step verifies; the export is a valid safetensors model of BF16 tensors.
  absl::StatusOr<StoreVerifyReport> report =
      VerifyStore(Env::Default(), out + "/store", std::nullopt, /*all=*/true);
  ASSERT_THAT(report, testing::IsOk());
  EXPECT_TRUE(report->ok());
  EXPECT_EQ(report->steps.size(), 3u);  // Steps 3, 6 and 9; the torn save of 8 is gone.
  absl::StatusOr<std::unique_ptr<HfCheckpointReader>> hf =
      HfCheckpointReader::Open(out + "/final-model");
  ASSERT_THAT(hf, testing::IsOk());
  for (const HfTensor& t : (*hf)->tensors()) EXPECT_EQ(t.dtype, formats::StDType::kBF16) << t.name;
}

TEST(DemoTrainerTest, KilledMidSaveResumesBitForBitOnItsOwnModel) {
  testing::ScopedTempDir tmp;
  CrashAndResume(tmp.path() + "/run", "");
}

TEST(DemoTrainerTest, KilledMidSaveResumesBitForBitOnATransformersModel) {
  const std::string model = std::string(CKPT_HF_TESTDATA) + "/qwen3-tiny";
  struct stat st;
  if (stat(model.c_str(), &st) != 0) GTEST_SKIP() << model << " is not here";
  testing::ScopedTempDir tmp;
  CrashAndResume(tmp.path() + "/run", " --model " + model);
}

// The checkpoint records pieces of a flat index, not a layout: a job saved by 2 ranks resumes on
// 5 (other buckets, other cuts through tensors) and still ends bit for bit where an
// uninterrupted 5-rank run ends, since the update is elementwise.
TEST(DemoTrainerTest, KilledMidSaveResumesOnAnotherDataParallelSize) {
  testing::ScopedTempDir tmp;
  CrashAndResume(tmp.path() + "/run", "", /*ranks=*/2, /*resume_ranks=*/5);
}

// CTest label cuda: skips (as the trainer reports) without a CUDA build or device.
TEST(DemoTrainerTest, CudaEngineKilledMidSaveResumesBitForBit) {
  testing::ScopedTempDir tmp;
  CrashAndResume(tmp.path() + "/run", " --engine cuda");
}

TEST(DemoTrainerTest, BadFlagsExitTwoAndSayWhy) {
  for (const char* args : {"", "--out /tmp/x --frobnicate 1", "--out /tmp/x --steps many",
                           "--out /tmp/x --crash-at 3 --resume", "--out /tmp/x --ranks 0",
                           "--out /tmp/x --steps 3 --crash-at 5", "--out /tmp/x --engine tpu"}) {
    CommandResult r = Trainer(args);
    EXPECT_EQ(r.exit_code, 2) << args;
    EXPECT_THAT(r.output, HasSubstr("usage:")) << args;
  }
}

}  // namespace
}  // namespace ckpt
