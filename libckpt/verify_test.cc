#include "ckpt/verify.h"

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "ckpt/base/coding.h"
#include "ckpt/base/status_macros.h"
#include "ckpt/checkpoint_store.h"
#include "ckpt/env.h"
#include "ckpt/formats/chunk.h"
#include "ckpt/formats/manifest.h"
#include "tests/support/status_matchers.h"
#include "tests/support/synthetic_state.h"

namespace ckpt {
namespace {

using ::testing::IsEmpty;
using testing::IsOk;
using ::testing::SizeIs;
using testing::StatusIs;

constexpr char kRoot[] = "/store";
constexpr uint64_t kOld = 10;  // Two committed steps; LATEST names kNew.
constexpr uint64_t kNew = 20;
constexpr uint64_t kMaxFileBytes = uint64_t{1} << 30;

// Fails GetChildren of one directory, as a permission error would.
class UnlistableDirEnv : public EnvWrapper {
 public:
  UnlistableDirEnv(Env* target, std::string dir) : EnvWrapper(target), dir_(std::move(dir)) {}
  absl::StatusOr<std::vector<std::string>> GetChildren(const std::string& dir) override {
    if (dir == dir_) return absl::PermissionDeniedError(dir);
    return EnvWrapper::GetChildren(dir);
  }

 private:
  const std::string dir_;
};

// Renames a step directory away (as retention does) at the first open of one of its files.
class RetireDuringVerifyEnv : public EnvWrapper {
 public:
  RetireDuringVerifyEnv(Env* target, std::string dir) : EnvWrapper(target), dir_(std::move(dir)) {}
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> NewRandomAccessFile(
      const std::string& path, const FileOptions& options) override {
    if (!retired_ && path.rfind(dir_ + "/", 0) == 0 && path.find(".data") != std::string::npos) {
      retired_ = true;
      CKPT_RETURN_IF_ERROR(target()->RenameFile(dir_, dir_ + ".retired"));
    }
    return EnvWrapper::NewRandomAccessFile(path, options);
  }

 private:
  const std::string dir_;
  bool retired_ = false;
};

class VerifyTest : public ::testing::Test {
 protected:
  VerifyTest() : env_(NewMemEnv()) {
    options_.env = env_.get();
    options_.chunk_bytes = 1000;  // Several chunks per data file.
  }
  void SetUp() override {
    for (uint64_t step : {kOld, kNew}) {
      CKPT_ASSERT_OK(testing::SaveSyntheticStep(kRoot, options_, 2, step));
    }
  }

  static std::string StepDir(uint64_t step) { return JoinPath(kRoot, StepDirectoryName(step)); }
  absl::StatusOr<StoreVerifyReport> VerifyAll() {
    return VerifyStore(env_.get(), kRoot, std::nullopt, /*all=*/true);
  }
  // The report of `step` in `report`, or null.
  static const StepVerifyReport* StepReport(const StoreVerifyReport& report, uint64_t step) {
    for (const StepVerifyReport& s : report.steps) {
      if (s.step == step) return &s;
    }
    return nullptr;
  }
  // Expects `step` to have been checked and found intact.
  static void ExpectIntact(const StoreVerifyReport& report, uint64_t step) {
    const StepVerifyReport* s = StepReport(report, step);
    ASSERT_NE(s, nullptr) << "step " << step << " not checked";
    EXPECT_THAT(s->problems, IsEmpty()) << "step " << step;
    EXPECT_GT(s->chunks_checked, 0u) << "step " << step;
  }

  // Expects the store to be reported damaged through exactly one problem, in `step`, naming
  // `file`, and the other step intact. Returns that problem (null when there is not exactly one).
  static const VerifyProblem* ExpectOnlyProblem(const StoreVerifyReport& report, uint64_t step,
                                                const std::string& file, uint64_t intact) {
    EXPECT_FALSE(report.ok());
    const StepVerifyReport* s = StepReport(report, step);
    EXPECT_NE(s, nullptr) << "step " << step << " not checked";
    if (s == nullptr) return nullptr;
    EXPECT_THAT(s->problems, SizeIs(1));
    if (s->problems.size() != 1) return nullptr;
    EXPECT_EQ(s->problems[0].file, file);
    ExpectIntact(report, intact);
    return &s->problems[0];
  }

  absl::StatusOr<formats::Manifest> ManifestOf(uint64_t step) {
    const std::string path = JoinPath(StepDir(step), "MANIFEST");
    CKPT_ASSIGN_OR_RETURN(std::string bytes, ReadFileToString(env_.get(), path, kMaxFileBytes));
    return formats::ParseManifest(AsBytes(bytes), path);
  }
  // Replaces the file at `path` with edit(its bytes).
  absl::Status Rewrite(const std::string& path, const std::function<void(std::string*)>& edit) {
    CKPT_ASSIGN_OR_RETURN(std::string bytes, ReadFileToString(env_.get(), path, kMaxFileBytes));
    edit(&bytes);
    return WriteFileAtomically(env_.get(), path, bytes);
  }

  std::unique_ptr<Env> env_;
  StoreOptions options_;
};

TEST_F(VerifyTest, IntactStoreHasNoProblems) {
  auto report = VerifyAll();
  CKPT_ASSERT_OK(report);
  EXPECT_TRUE(report->ok());
  EXPECT_EQ(report->latest, std::optional<uint64_t>(kNew));
  EXPECT_THAT(report->problems, IsEmpty());
  ASSERT_THAT(report->steps, SizeIs(2));
  ExpectIntact(*report, kOld);
  ExpectIntact(*report, kNew);
}

TEST_F(VerifyTest, WithoutAllOnlyTheLatestStepIsChecked) {
  auto report = VerifyStore(env_.get(), kRoot, std::nullopt, /*all=*/false);
  CKPT_ASSERT_OK(report);
  ASSERT_THAT(report->steps, SizeIs(1));
  ExpectIntact(*report, kNew);
}

TEST_F(VerifyTest, FlippedChunkByteIsReportedWithFileAndChunk) {
  auto m = ManifestOf(kOld);
  CKPT_ASSERT_OK(m);
  const formats::DataFileInfo& f = m->files[0];
  ASSERT_GT(f.chunks.size(), 2u);
  const std::string path = JoinPath(StepDir(kOld), f.name);
  const uint64_t offset = f.chunks[1].offset;
  CKPT_ASSERT_OK(
      Rewrite(path, [&](std::string* b) { b->at(offset + formats::kChunkHeaderBytes) ^= 0x01; }));
  auto report = VerifyAll();
  CKPT_ASSERT_OK(report);
  const VerifyProblem* problem = ExpectOnlyProblem(*report, kOld, path, kNew);
  ASSERT_NE(problem, nullptr);
  EXPECT_EQ(problem->chunk, std::optional<uint64_t>(1));
  EXPECT_EQ(problem->offset, offset);
}

TEST_F(VerifyTest, UnexpectedFileInStepDirectoryIsReported) {
  const std::string extra = JoinPath(StepDir(kOld), "notes.txt");
  CKPT_ASSERT_OK(WriteFileAtomically(env_.get(), extra, "hello"));
  auto report = VerifyAll();
  CKPT_ASSERT_OK(report);
  ExpectOnlyProblem(*report, kOld, extra, kNew);
}

TEST_F(VerifyTest, TruncatedDataFileIsReported) {
  const std::string path = JoinPath(StepDir(kOld), "rank-00001.data");
  CKPT_ASSERT_OK(Rewrite(path, [](std::string* b) { b->pop_back(); }));
  auto report = VerifyAll();
  CKPT_ASSERT_OK(report);
  ExpectOnlyProblem(*report, kOld, path, kNew);
}

TEST_F(VerifyTest, DamagedLatestIsReported) {
  const std::string latest = JoinPath(kRoot, "LATEST");
  CKPT_ASSERT_OK(Rewrite(latest, [](std::string* b) { b->at(b->size() / 2) ^= 0x01; }));
  auto report = VerifyAll();
  CKPT_ASSERT_OK(report);
  EXPECT_FALSE(report->ok());
  ASSERT_THAT(report->problems, SizeIs(1));
  EXPECT_EQ(report->problems[0].file, latest);
  ExpectIntact(*report, kOld);
  ExpectIntact(*report, kNew);
}

TEST_F(VerifyTest, LatestNamingMissingStepIsReported) {
  CKPT_ASSERT_OK(RemoveRecursively(env_.get(), StepDir(kNew)));
  auto report = VerifyAll();
  CKPT_ASSERT_OK(report);
  EXPECT_FALSE(report->ok());
  EXPECT_EQ(report->latest, std::optional<uint64_t>(kNew));
  ASSERT_THAT(report->problems, SizeIs(1));
  EXPECT_EQ(report->problems[0].file, JoinPath(kRoot, "LATEST"));
  ASSERT_THAT(report->steps, SizeIs(1));
  ExpectIntact(*report, kOld);
}

TEST_F(VerifyTest, MissingLatestWhileStepsExistIsReported) {
  CKPT_ASSERT_OK(env_->RemoveFile(JoinPath(kRoot, "LATEST")));
  auto report = VerifyAll();
  CKPT_ASSERT_OK(report);
  EXPECT_FALSE(report->ok());
  EXPECT_EQ(report->latest, std::nullopt);
  ASSERT_THAT(report->problems, SizeIs(1));
  ExpectIntact(*report, kOld);
  ExpectIntact(*report, kNew);
}

TEST_F(VerifyTest, AllGoesOnPastAStepEntryThatIsNotADirectory) {
  const uint64_t between = (kOld + kNew) / 2;
  CKPT_ASSERT_OK(WriteFileAtomically(env_.get(), StepDir(between), "not a step"));
  auto report = VerifyAll();
  CKPT_ASSERT_OK(report);
  EXPECT_FALSE(report->ok());
  ASSERT_THAT(report->steps, SizeIs(3));
  const StepVerifyReport* file = StepReport(*report, between);
  ASSERT_NE(file, nullptr);
  EXPECT_THAT(file->problems, SizeIs(1));
  ExpectIntact(*report, kOld);
  ExpectIntact(*report, kNew);
}

TEST_F(VerifyTest, AllGoesOnPastAStepThatCannotBeListed) {
  UnlistableDirEnv env(env_.get(), StepDir(kOld));
  auto report = VerifyStore(&env, kRoot, std::nullopt, /*all=*/true);
  CKPT_ASSERT_OK(report);
  EXPECT_FALSE(report->ok());
  const StepVerifyReport* old_step = StepReport(*report, kOld);
  ASSERT_NE(old_step, nullptr);
  EXPECT_THAT(old_step->problems, SizeIs(1));
  ExpectIntact(*report, kNew);
}

TEST_F(VerifyTest, MissingRootIsNotFound) {
  EXPECT_THAT(VerifyStore(env_.get(), "/nowhere", std::nullopt, /*all=*/true),
              StatusIs(absl::StatusCode::kNotFound));
}

TEST_F(VerifyTest, ChosenStepThatDoesNotExistIsNotFound) {
  EXPECT_THAT(VerifyStore(env_.get(), kRoot, kNew + 1, /*all=*/false),
              StatusIs(absl::StatusCode::kNotFound));
}

TEST_F(VerifyTest, ProgressIsNonDecreasingAndEndsAtTotal) {
  std::vector<std::pair<uint64_t, uint64_t>> calls;
  auto report = VerifyStepDir(env_.get(), StepDir(kNew), [&](uint64_t done, uint64_t total) {
    calls.emplace_back(done, total);
  });
  CKPT_ASSERT_OK(report);
  EXPECT_THAT(report->problems, IsEmpty());
  ASSERT_THAT(calls, ::testing::Not(IsEmpty()));
  const uint64_t total = calls.back().second;
  for (size_t i = 0; i < calls.size(); ++i) {
    EXPECT_EQ(calls[i].second, total) << "call " << i;
    EXPECT_GE(calls[i].first, i == 0 ? 0 : calls[i - 1].first) << "call " << i;
  }
  EXPECT_EQ(calls.back().first, total);
  EXPECT_EQ(report->bytes_checked, total);
}

TEST_F(VerifyTest, AStepRetentionRemovesDuringVerifyAllIsReportedRemovedNotDamaged) {
  RetireDuringVerifyEnv env(env_.get(), StepDir(kOld));
  auto report = VerifyStore(&env, kRoot, std::nullopt, /*all=*/true);
  CKPT_ASSERT_OK(report);
  const StepVerifyReport* old = StepReport(*report, kOld);
  ASSERT_NE(old, nullptr);
  EXPECT_TRUE(old->removed);
  EXPECT_THAT(old->problems, IsEmpty());
  ExpectIntact(*report, kNew);
  EXPECT_TRUE(report->ok());
}

}  // namespace
}  // namespace ckpt
