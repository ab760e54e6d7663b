// Test data that is not in the repository: the transformers-written checkpoints in
// ../shared/testdata, beside the clone (each test target gets the path as CKPT_HF_TESTDATA).
// A test that needs it skips, naming the directory, where it is missing; with
// CKPT_REQUIRE_TESTDATA=1 in the environment (CI, .ci/run) it fails instead, so a suite that
// should have read the data can never pass by skipping.
#ifndef CKPT_TESTS_SUPPORT_TESTDATA_H_
#define CKPT_TESTS_SUPPORT_TESTDATA_H_

#include <optional>
#include <string>

#include <gtest/gtest.h>

namespace ckpt::testing {

// `dir` if it is a directory (links followed), nullopt otherwise.
std::optional<std::string> TestdataDir(const std::string& dir);

// True when CKPT_REQUIRE_TESTDATA=1: a missing testdata directory is a failure.
bool TestdataRequired();

// Why a test cannot run without `dir`, and whether that fails or skips it.
std::string MissingTestdataMessage(const std::string& dir);

}  // namespace ckpt::testing

// In a test body or a fixture's SetUp: when the directory `dir` is missing, fails the test if
// TestdataRequired() and skips it otherwise, and returns from the function.
#define CKPT_SKIP_OR_FAIL_WITHOUT_TESTDATA(dir)                                     \
  do {                                                                              \
    const std::string ckpt_testdata_dir = (dir);                                    \
    if (!::ckpt::testing::TestdataDir(ckpt_testdata_dir).has_value()) {             \
      if (::ckpt::testing::TestdataRequired()) {                                    \
        GTEST_FAIL() << ::ckpt::testing::MissingTestdataMessage(ckpt_testdata_dir); \
      }                                                                             \
      GTEST_SKIP() << ::ckpt::testing::MissingTestdataMessage(ckpt_testdata_dir);   \
    }                                                                               \
  } while (0)

#endif  // CKPT_TESTS_SUPPORT_TESTDATA_H_
