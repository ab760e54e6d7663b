#include "ckpt/bench/store_bench.h"

#include <cerrno>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "ckpt/base/status_macros.h"
#include "ckpt/env.h"
#include "tests/support/fault_injection_env.h"
#include "tests/support/status_matchers.h"

namespace ckpt::bench {
namespace {

using ::ckpt::testing::StatusIs;

TEST(StoreBenchTest, ADiskThatFillsUpDuringTheRawBoundLeavesNoScratchFiles) {
  std::unique_ptr<Env> mem = NewMemEnv();
  testing::FaultInjectionEnv fault(mem.get());
  CKPT_ASSERT_OK(mem->CreateDir("/bench"));
  fault.FailNth(3, ENOSPC, testing::FaultInjectionEnv::Op::kAppend);
  IoBenchOptions o;
  o.env = &fault;
  o.dir = "/bench";
  o.bytes = uint64_t{64} << 20;
  EXPECT_THAT(RunIoBench(o).status(), StatusIs(absl::StatusCode::kResourceExhausted));
  auto left = mem->GetChildren("/bench");
  CKPT_ASSERT_OK(left);
  for (const std::string& name : *left) {
    EXPECT_FALSE(absl::StartsWith(name, ".ckpt-bench-raw")) << name << " was left behind";
  }
}

}  // namespace
}  // namespace ckpt::bench
