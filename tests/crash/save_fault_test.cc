// ENOSPC, EDQUOT and EIO injected at every mutating call of a 2-rank save: the save fails with a
// Status naming the file and cause, and the previous checkpoint stays committed and verifying.
#include <cerrno>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "ckpt/checkpoint_store.h"
#include "tests/support/fault_injection_env.h"
#include "tests/support/status_matchers.h"
#include "tests/support/synthetic_state.h"

namespace ckpt {
namespace {

using testing::CheckStoreConsistent;
using testing::FaultInjectionEnv;
using ::testing::HasSubstr;
using testing::SaveSyntheticStep;

constexpr char kRoot[] = "/ckpt";

struct Injected {
  int errnum;
  absl::StatusCode code;
  const char* cause;
};

class SaveFaultTest : public ::testing::TestWithParam<Injected> {};

TEST_P(SaveFaultTest, EveryFailedCallLeavesThePreviousCheckpoint) {
  auto run = [&](std::optional<uint64_t> fail_at, uint64_t* calls) -> absl::Status {
    auto mem = NewMemEnv();
    FaultInjectionEnv fault(mem.get());
    StoreOptions options;
    options.env = &fault;
    options.chunk_bytes = 4096;
    EXPECT_THAT(SaveSyntheticStep(kRoot, options, 2, 1), testing::IsOk());
    const uint64_t before = fault.mutating_calls();
    if (fail_at.has_value()) fault.FailNth(*fail_at, GetParam().errnum);
    absl::Status saved = SaveSyntheticStep(kRoot, options, 2, 2);
    *calls = fault.mutating_calls() - before;
    fault.Disarm();
    absl::StatusOr<std::optional<uint64_t>> state = CheckStoreConsistent(kRoot, options);
    EXPECT_THAT(state, testing::IsOk());
    if (state.ok()) {
      EXPECT_EQ(*state, std::optional<uint64_t>(saved.ok() ? 2 : 1));
    }
    return saved;
  };
  uint64_t n = 0;
  CKPT_ASSERT_OK(run(std::nullopt, &n));
  ASSERT_GT(n, 10u);
  for (uint64_t k = 1; k <= n; ++k) {
    SCOPED_TRACE(::testing::Message() << "failing mutating call " << k << " of " << n);
    uint64_t calls = 0;
    absl::Status saved = run(k, &calls);
    ASSERT_FALSE(saved.ok()) << "an injected failure must fail the save";
    EXPECT_EQ(saved.code(), GetParam().code) << saved;
    EXPECT_THAT(std::string(saved.message()), HasSubstr(kRoot)) << "must name the file";
    EXPECT_THAT(std::string(saved.message()), HasSubstr(GetParam().cause));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Errnos, SaveFaultTest,
    ::testing::Values(Injected{ENOSPC, absl::StatusCode::kResourceExhausted,
                               "No space left on device"},
                      Injected{EDQUOT, absl::StatusCode::kResourceExhausted, "Disk quota exceeded"},
                      Injected{EIO, absl::ErrnoToStatusCode(EIO), "Input/output error"}),
    [](const ::testing::TestParamInfo<Injected>& p) {
      return std::string(p.param.errnum == ENOSPC   ? "ENOSPC"
                         : p.param.errnum == EDQUOT ? "EDQUOT"
                                                    : "EIO");
    });

TEST(TornWriteTest, TornAppendFailsTheSaveAndKeepsThePrevious) {
  auto mem = NewMemEnv();
  FaultInjectionEnv fault(mem.get());
  StoreOptions options;
  options.env = &fault;
  options.chunk_bytes = 4096;
  CKPT_ASSERT_OK(SaveSyntheticStep(kRoot, options, 2, 1));
  // A data file's chunk extents are 8 KiB here: the torn write keeps the first block of one.
  fault.TearNthAppend(5, 4096 + 100, /*crash=*/false);
  EXPECT_FALSE(SaveSyntheticStep(kRoot, options, 2, 2).ok());
  auto state = CheckStoreConsistent(kRoot, options);
  CKPT_ASSERT_OK(state);
  EXPECT_EQ(*state, std::optional<uint64_t>(1));
}

}  // namespace
}  // namespace ckpt
