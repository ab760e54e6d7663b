// The demo trainer end to end: a run killed in the middle of a save resumes from LATEST and ends
// with a state (--dump-state) byte for byte that of a run that never crashed; the store
// verifies; the exported model opens.
#include <cstdio>
#include <fstream>
#include <optional>
#include <filesystem>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "ckpt/base/coding.h"
#include "ckpt/hf_checkpoint.h"
#include "ckpt/verify.h"
#include "tests/support/run_command.h"
#include "tests/support/status_matchers.h"
#include "tests/support/temp_dir.h"
#include "tests/support/testdata.h"

namespace ckpt {
namespace {

using testing::CommandResult;
using ::testing::HasSubstr;

// ckpt-demo-trainer's exit code for --engine cuda where CUDA cannot run (its engine probe found
// a build without CUDA or no usable device). Every other error exits 2.
constexpr int kExitNoEngine = 3;

CommandResult Trainer(const std::string& args) {
  return testing::RunCommand(std::string(CKPT_DEMO_TRAINER_PATH) + " " + args);
}

// The losses (column 1) or learning rates (column 2) the trainer printed, in step order.
std::vector<double> Column(const std::string& output, int column) {
  std::vector<double> out;
  const std::regex line(R"(step +\d+  loss ([0-9.e+-]+)  lr ([0-9.e+-]+))");
  for (auto it = std::sregex_iterator(output.begin(), output.end(), line);
       it != std::sregex_iterator(); ++it) {
    out.push_back(std::stod((*it)[column]));
  }
  return out;
}
std::vector<double> Losses(const std::string& output) { return Column(output, 1); }
std::vector<double> LearningRates(const std::string& output) { return Column(output, 2); }

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

size_t FirstDifference(const std::string& a, const std::string& b) {
  size_t i = 0;
  while (i < a.size() && i < b.size() && a[i] == b[i]) ++i;
  return i;
}

// The framing of a state dump (demo/demo_model.h): per rank its elements, bytes per moment and
// every group's step.
struct Dump {
  struct Rank {
    uint64_t elements = 0;
    uint32_t moment_bytes = 0;
    std::vector<uint64_t> steps;
  };
  std::vector<Rank> ranks;
};

// nullopt unless `bytes` is a dump that parses to its exact end.
std::optional<Dump> ParseDump(const std::string& bytes) {
  const std::string magic = "ckpt-demo-state 1\n";
  if (bytes.compare(0, magic.size(), magic) != 0) return std::nullopt;
  size_t at = magic.size();
  auto take = [&](size_t n) -> const std::byte* {
    if (bytes.size() - at < n) return nullptr;
    const std::byte* p = reinterpret_cast<const std::byte*>(bytes.data()) + at;
    at += n;
    return p;
  };
  const std::byte* p = take(4);
  if (p == nullptr) return std::nullopt;
  Dump dump;
  dump.ranks.resize(DecodeFixed32(p));
  for (Dump::Rank& rank : dump.ranks) {
    if ((p = take(12)) == nullptr) return std::nullopt;
    rank.elements = DecodeFixed64(p);
    rank.moment_bytes = DecodeFixed32(p + 8);
    const uint64_t slabs = rank.elements * (4 + 2 * uint64_t{rank.moment_bytes} + 2);
    if (take(slabs) == nullptr || (p = take(4)) == nullptr) return std::nullopt;
    rank.steps.resize(DecodeFixed32(p));
    for (uint64_t& step : rank.steps) {
      if ((p = take(8 + 5 * 8)) == nullptr) return std::nullopt;
      step = DecodeFixed64(p);
    }
  }
  if (at != bytes.size()) return std::nullopt;
  return dump;
}

struct Case {
  std::string flags;          // Extra trainer flags, the same for every run.
  int ranks = 3;              // Of the run that crashes.
  int resume_ranks = 3;       // Of the resumed run and of the uninterrupted one.
  uint32_t moment_bytes = 4;  // Per moment element in the slabs: 4 FP32, 2 BF16.
  bool cuda = false;          // Skips (only) where the trainer finds no CUDA.
};

// Crashes a 9-step run on c.ranks ranks at step 8, resumes it on c.resume_ranks and requires its
// final state to equal byte for byte that of an uninterrupted run on c.resume_ranks.
void CrashAndResume(const std::string& out, const Case& c) {
  const std::string common = c.flags + " --steps 9 --save-every 3";
  CommandResult crashed =
      Trainer("--out " + out + common + " --ranks " + std::to_string(c.ranks) + " --crash-at 8");
  if (c.cuda && crashed.exit_code == kExitNoEngine) {
    GTEST_SKIP() << "no CUDA here: " << crashed.output;
  }
  ASSERT_EQ(crashed.exit_code, 128 + 9) << crashed.output;  // SIGKILL, mid-save.
  EXPECT_THAT(crashed.output,
              HasSubstr(c.flags.find("--sync-save") != std::string::npos
                            ? "step   8  save written, killed at its commit vote"
                            : "step   8  killed while its async save was in flight"));
  const std::vector<double> before = Losses(crashed.output);
  ASSERT_EQ(before.size(), 8u) << crashed.output;
  std::smatch params;
  ASSERT_TRUE(std::regex_search(crashed.output, params, std::regex(R"(, (\d+) parameters over)")))
      << crashed.output;
  const uint64_t elements = std::stoull(params[1]);

  const std::string resumed_state = out + ".resumed-state";
  CommandResult resumed =
      Trainer("--out " + out + common + " --ranks " + std::to_string(c.resume_ranks) +
              " --resume --dump-state " + resumed_state);
  EXPECT_EQ(resumed.exit_code, 0) << resumed.output;  // 1: its own comparison found a difference.
  EXPECT_THAT(resumed.output, HasSubstr("recovery removed .staging-step-00000008"));
  EXPECT_THAT(resumed.output, HasSubstr("resumed from step 6 (LATEST)"));
  const std::vector<double> after = Losses(resumed.output);
  ASSERT_EQ(after.size(), 3u) << resumed.output;  // Steps 7, 8, 9.
  EXPECT_EQ(after[0], before[6]);                 // Step 7 again, from the same state.
  EXPECT_EQ(after[1], before[7]);
  EXPECT_LT(after[2], before[0]);  // It trains.
  // The schedule came back from its blob: steps 7 and 8 ran at the same learning rates.
  const std::vector<double> lr_before = LearningRates(crashed.output);
  const std::vector<double> lr_after = LearningRates(resumed.output);
  ASSERT_EQ(lr_after.size(), 3u);
  EXPECT_EQ(lr_after[0], lr_before[6]);
  EXPECT_EQ(lr_after[1], lr_before[7]);
  EXPECT_NE(lr_before[6], lr_before[7]) << "the learning rate does not change";

  // The same job, never interrupted, in another directory: its final state is the reference.
  const std::string reference_state = out + ".uninterrupted-state";
  CommandResult reference =
      Trainer("--out " + out + "-uninterrupted" + common + " --ranks " +
              std::to_string(c.resume_ranks) + " --dump-state " + reference_state);
  ASSERT_EQ(reference.exit_code, 0) << reference.output;
  const std::string want = ReadFile(reference_state), got = ReadFile(resumed_state);
  std::optional<Dump> dump = ParseDump(want);
  ASSERT_TRUE(dump.has_value()) << reference_state << " is not a state dump";
  ASSERT_EQ(dump->ranks.size(), static_cast<size_t>(c.resume_ranks));
  uint64_t covered = 0;
  for (const Dump::Rank& rank : dump->ranks) {
    covered += rank.elements;
    EXPECT_EQ(rank.moment_bytes, c.moment_bytes);
    EXPECT_THAT(rank.steps, ::testing::Each(9u));
    EXPECT_FALSE(rank.steps.empty());
  }
  EXPECT_EQ(covered, elements);
  EXPECT_TRUE(got == want) << "the resumed run's state (" << got.size()
                           << " bytes) differs from the uninterrupted run's (" << want.size()
                           << " bytes) from byte " << FirstDifference(got, want);

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
  CrashAndResume(tmp.path() + "/run", {});
}

// The old way: a synchronous save, killed at its commit vote once every rank wrote its files.
TEST(DemoTrainerTest, KilledAtTheCommitVoteOfASyncSaveResumesBitForBit) {
  testing::ScopedTempDir tmp;
  CrashAndResume(tmp.path() + "/run", {.flags = " --sync-save"});
}

// Precision-aware mode: the moments are BF16 in the slabs and in the checkpoint.
TEST(DemoTrainerTest, KilledMidSaveResumesBitForBitWithBf16Moments) {
  testing::ScopedTempDir tmp;
  CrashAndResume(tmp.path() + "/run", {.flags = " --moments BF16", .moment_bytes = 2});
}

TEST(DemoTrainerTest, KilledMidSaveResumesBitForBitOnATransformersModel) {
  const std::string model = std::string(CKPT_HF_TESTDATA) + "/qwen3-tiny";
  CKPT_SKIP_OR_FAIL_WITHOUT_TESTDATA(model);
  testing::ScopedTempDir tmp;
  CrashAndResume(tmp.path() + "/run", {.flags = " --model " + model});
}

// The checkpoint records pieces of a flat index, not a layout: a job saved by 2 ranks resumes on
// 5 (other buckets, other cuts through tensors) and still ends bit for bit where an
// uninterrupted 5-rank run ends, since the update is elementwise.
TEST(DemoTrainerTest, KilledMidSaveResumesOnAnotherDataParallelSize) {
  testing::ScopedTempDir tmp;
  CrashAndResume(tmp.path() + "/run", {.flags = "", .ranks = 2, .resume_ranks = 5});
}

// CTest label cuda: skips only where the trainer finds no CUDA (a build without it, or no
// device); any other error, kUnimplemented and kFailedPrecondition included, fails.
TEST(DemoTrainerTest, CudaEngineKilledMidSaveResumesBitForBit) {
  testing::ScopedTempDir tmp;
  CrashAndResume(tmp.path() + "/run", {.flags = " --engine cuda", .cuda = true});
}

TEST(DemoTrainerTest, CudaEngineWithBf16MomentsKilledMidSaveResumesBitForBit) {
  testing::ScopedTempDir tmp;
  CrashAndResume(tmp.path() + "/run",
                 {.flags = " --engine cuda --moments BF16", .moment_bytes = 2, .cuda = true});
}

// The engine probe is for --engine cuda only: the CPU engine never exits as "no engine here".
TEST(DemoTrainerTest, CpuEngineNeverReportsAMissingEngine) {
  testing::ScopedTempDir tmp;
  CommandResult r = Trainer("--out " + tmp.path() + "/run --steps 1 --engine cpu");
  EXPECT_EQ(r.exit_code, 0) << r.output;
}

// A checkpoint with FP32 moments resumes as BF16 ones: the load rounds them, and the trainer
// says that no uninterrupted run is a bit-exact reference for it.
TEST(DemoTrainerTest, ResumingWithOtherMomentsThanSavedConvertsThem) {
  testing::ScopedTempDir tmp;
  const std::string common = "--out " + tmp.path() + "/run --steps 4 --save-every 2";
  CommandResult crashed = Trainer(common + " --crash-at 4");
  ASSERT_EQ(crashed.exit_code, 128 + 9) << crashed.output;
  const std::string state = tmp.path() + "/state";
  CommandResult resumed = Trainer(common + " --resume --moments BF16 --dump-state " + state);
  EXPECT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_THAT(resumed.output, HasSubstr("F32 moments converted to BF16"));
  EXPECT_THAT(resumed.output, HasSubstr("not compared"));
  std::optional<Dump> dump = ParseDump(ReadFile(state));
  ASSERT_TRUE(dump.has_value());
  for (const Dump::Rank& rank : dump->ranks) EXPECT_EQ(rank.moment_bytes, 2u);
}

TEST(DemoTrainerTest, ResumingARunThatAlreadyExportedReplacesItsOwnExportWhole) {
  testing::ScopedTempDir tmp;
  const std::string out = tmp.path() + "/run";
  CommandResult first = Trainer("--out " + out + " --steps 3 --save-every 3 --ranks 2");
  ASSERT_EQ(first.exit_code, 0) << first.output;
  CommandResult again = Trainer("--out " + out + " --steps 3 --save-every 3 --ranks 2 --resume");
  EXPECT_EQ(again.exit_code, 0) << again.output;
  EXPECT_THAT(again.output, HasSubstr("exported step 3"));
  absl::StatusOr<std::unique_ptr<HfCheckpointReader>> hf =
      HfCheckpointReader::Open(out + "/final-model");
  ASSERT_THAT(hf, testing::IsOk());
  for (const auto& entry : std::filesystem::directory_iterator(out)) {
    EXPECT_EQ(entry.path().filename().string().rfind(".final-model", 0), std::string::npos)
        << entry.path() << " left behind";
  }
}

TEST(DemoTrainerTest, BadFlagsExitTwoAndSayWhy) {
  for (const char* args : {"", "--out /tmp/x --frobnicate 1", "--out /tmp/x --steps many",
                           "--out /tmp/x --crash-at 3 --resume", "--out /tmp/x --ranks 0",
                           "--out /tmp/x --steps 3 --crash-at 5", "--out /tmp/x --engine tpu",
                           "--out /tmp/x --moments F16", "--out /tmp/x --dump-state"}) {
    CommandResult r = Trainer(args);
    EXPECT_EQ(r.exit_code, 2) << args;
    EXPECT_THAT(r.output, HasSubstr("usage:")) << args;
  }
}

}  // namespace
}  // namespace ckpt
