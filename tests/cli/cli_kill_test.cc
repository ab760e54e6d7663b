// SIGKILL at random moments of `ckpt-tool bench io --keep` never leaves a store that fails to
// open, verify and name a committed LATEST. CTest label: slow (still run in CI).
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <random>
#include <thread>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "ckpt/base/coding.h"
#include "ckpt/checkpoint_store.h"
#include "ckpt/verify.h"
#include "tests/support/run_command.h"
#include "tests/support/status_matchers.h"
#include "tests/support/temp_dir.h"

namespace ckpt {
namespace {

using ::testing::HasSubstr;

using Result = testing::CommandResult;

[[maybe_unused]] Result RunTool(const std::string& args) {
  return testing::RunCommand(std::string(CKPT_TOOL_PATH) + " " + args);
}

class CliKillTest : public ::testing::Test {
 protected:
  std::string Root() { return tmp_.path() + "/ckpt-bench"; }
  testing::ScopedTempDir tmp_;
};

TEST_F(CliKillTest, SigkillDuringBenchAlwaysLeavesAnOpenableVerifiedStore) {
  ASSERT_EQ(
      RunTool("bench io --dir " + tmp_.path() + " --size 4M --ranks 2 --keep --json").exit_code, 0);
  const uint64_t seed = 20261130;
  std::mt19937_64 rng(seed);
  int kills = 0;
  for (int i = 0; i < 60; ++i) {
    SCOPED_TRACE(::testing::Message() << "seed " << seed << " iteration " << i);
    pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      std::string dir = tmp_.path();
      ::execl(CKPT_TOOL_PATH, CKPT_TOOL_PATH, "bench", "io", "--dir", dir.c_str(), "--size", "16M",
              "--ranks", "2", "--keep", "--json", static_cast<char*>(nullptr));
      ::_exit(127);
    }
    // A random moment in the run, not a synchronization: the point is to land anywhere.
    std::this_thread::sleep_for(std::chrono::microseconds(rng() % 120000));
    ::kill(pid, SIGKILL);
    int status = 0;
    ::waitpid(pid, &status, 0);
    // Count only runs the signal ended; a run that finished first proves less.
    if (WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) ++kills;
    StoreOptions options;
    options.env = NewPosixEnv().release();
    std::unique_ptr<Env> owned(options.env);
    auto store = CheckpointStore::Open(Root(), options);
    CKPT_ASSERT_OK(store);
    ASSERT_TRUE((*store)->latest_step().has_value());
    auto report = VerifyStore(options.env, Root(), std::nullopt, /*all=*/true);
    CKPT_ASSERT_OK(report);
    ASSERT_TRUE(report->ok());
    CKPT_ASSERT_OK((*store)->OpenLatest());
    // Keep the directory small: retention through the same primary handle.
    CKPT_ASSERT_OK((*store)->ApplyRetention({.keep_last = 2}));
  }
  EXPECT_GE(kills, 50) << "only " << kills << " runs were killed before they finished";
}

}  // namespace
}  // namespace ckpt
