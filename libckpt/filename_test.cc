#include "libckpt/filename.h"

#include <cstdint>
#include <limits>
#include <optional>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace ckpt::internal {
namespace {

using ::testing::MatchesRegex;

class FileNameTest : public ::testing::Test {
 protected:
  // The step a name parses to, or nullopt when it is refused.
  static std::optional<uint64_t> Parse(const std::string& name) { return ParseStepDirName(name); }
};

TEST_F(FileNameTest, StepDirNameIsZeroPaddedToEightDigits) {
  EXPECT_EQ(StepDirName(0), "step-00000000");
  EXPECT_EQ(StepDirName(1200), "step-00001200");
}

TEST_F(FileNameTest, StepDirNameRoundTrips) {
  for (uint64_t step : {uint64_t{0}, uint64_t{1}, uint64_t{99999999}}) {
    EXPECT_EQ(Parse(StepDirName(step)), std::optional<uint64_t>(step)) << step;
  }
}

TEST_F(FileNameTest, StepAboveEightDigitsUsesMoreDigitsAndRoundTrips) {
  EXPECT_EQ(StepDirName(123456789), "step-123456789");
  for (uint64_t step :
       {uint64_t{100000000}, uint64_t{123456789}, std::numeric_limits<uint64_t>::max()}) {
    EXPECT_EQ(Parse(StepDirName(step)), std::optional<uint64_t>(step)) << step;
  }
}

TEST_F(FileNameTest, NonCanonicalStepNamesAreRefused) {
  for (const char* name :
       {"step-1", "step-0000001", "step-000000001", "step-0000000a", "step--0000001",
        "xstep-00000001", "step-00000001 ", " step-00000001", "step-+0000001", "Step-00000001",
        "step_00000001", "step-", "", "step-00000001.tmp", "step-99999999999999999999"}) {
    EXPECT_EQ(Parse(name), std::nullopt) << "\"" << name << "\"";
  }
}

TEST_F(FileNameTest, DataAndPartFileNamesCarryTheRankInFiveDigits) {
  EXPECT_EQ(DataFileName(0), "rank-00000.data");
  EXPECT_EQ(DataFileName(3), "rank-00003.data");
  EXPECT_EQ(PartFileName(3), "rank-00003.part");
  EXPECT_EQ(PartFileName(12345), "rank-12345.part");
}

TEST_F(FileNameTest, StagingAndDeletingNamesEmbedStepAndNonce) {
  EXPECT_EQ(StagingDirName(1300, "0123456789abcdef"), ".staging-step-00001300-0123456789abcdef");
  EXPECT_EQ(DeletingDirName(1100, "fedcba9876543210"), ".deleting-step-00001100-fedcba9876543210");
}

TEST_F(FileNameTest, StagingAndDeletingDirectoriesAreGarbage) {
  EXPECT_TRUE(IsGarbageName(StagingDirName(7, NewNonce())));
  EXPECT_TRUE(IsGarbageName(DeletingDirName(7, NewNonce())));
}

TEST_F(FileNameTest, LatestTmpIsGarbage) { EXPECT_TRUE(IsGarbageName("LATEST.tmp")); }

TEST_F(FileNameTest, CommittedNamesAreNotGarbage) {
  for (const std::string& name : {StepDirName(7), std::string(kLatestName), std::string(kLockName),
                                  std::string(kManifestName), DataFileName(0)}) {
    EXPECT_FALSE(IsGarbageName(name)) << name;
  }
}

TEST_F(FileNameTest, NonceIsSixteenLowercaseHexDigits) {
  EXPECT_THAT(NewNonce(), MatchesRegex("[0-9a-f]{16}"));
}

TEST_F(FileNameTest, TwoNoncesDiffer) { EXPECT_NE(NewNonce(), NewNonce()); }

}  // namespace
}  // namespace ckpt::internal
