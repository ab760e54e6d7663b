// The standard crash test (STYLE.md §3): count the mutating Env calls N of an operation, then for
// every k in [0, N] crash after call k, drop what was not durable, recover, and require exactly
// the old or exactly the new state.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <optional>

#include "absl/strings/str_cat.h"

#include "ckpt/base/status_macros.h"
#include "ckpt/checkpoint_store.h"
#include "tests/support/fault_injection_env.h"
#include "tests/support/status_matchers.h"
#include "tests/support/synthetic_state.h"

namespace ckpt {
namespace {

using testing::CheckStoreConsistent;
using testing::FaultInjectionEnv;
using testing::SaveSyntheticStep;

constexpr char kRoot[] = "/ckpt";

class CrashTest : public ::testing::Test {
 protected:
  void Reset() {
    mem_ = NewMemEnv();
    fault_ = std::make_unique<FaultInjectionEnv>(mem_.get());
    options_.env = fault_.get();
    options_.chunk_bytes = 4096;  // Several chunks per piece.
  }
  // From a fresh store holding step 1: crashes the save of step 2 after mutating call `k`,
  // drops what was not durable (at each file's last Sync, or at a point chosen by `seed`),
  // recovers, and returns the step LATEST then names after checking it is 1 or 2 and that a save
  // that returned OK survived. `must_crash`: the save must not end before call k.
  absl::StatusOr<uint64_t> CrashSecondSaveAfter(uint64_t k, std::optional<uint64_t> seed,
                                                bool must_crash) {
    Reset();
    CKPT_RETURN_IF_ERROR(SaveSyntheticStep(kRoot, options_, 2, 1));
    CKPT_RETURN_IF_ERROR(fault_->DropUnsyncedData());
    fault_->CrashAfter(k);
    absl::Status saved = SaveSyntheticStep(kRoot, options_, 2, 2);
    if (must_crash && !fault_->crashed()) {
      return absl::InternalError(absl::StrCat("the save ended before mutating call ", k));
    }
    CKPT_RETURN_IF_ERROR(fault_->DropUnsyncedData(seed));
    CKPT_ASSIGN_OR_RETURN(std::optional<uint64_t> state, CheckStoreConsistent(kRoot, options_));
    if (!state.has_value()) return absl::InternalError("no committed step after recovery");
    EXPECT_TRUE(*state == 1 || *state == 2) << "LATEST names step " << *state;
    if (saved.ok()) {
      EXPECT_EQ(*state, 2u) << "a save that returned OK must survive";
    }
    return *state;
  }

  std::unique_ptr<Env> mem_;
  std::unique_ptr<FaultInjectionEnv> fault_;
  StoreOptions options_;
};

TEST_F(CrashTest, TwoRankSaveIsAllOrNothingAtEveryCrashPoint) {
  // Count the calls of a clean save of step 2 on top of step 1.
  Reset();
  CKPT_ASSERT_OK(SaveSyntheticStep(kRoot, options_, 2, 1));
  const uint64_t before = fault_->mutating_calls();
  CKPT_ASSERT_OK(SaveSyntheticStep(kRoot, options_, 2, 2));
  const uint64_t n = fault_->mutating_calls() - before;
  ASSERT_GT(n, 10u);
  int old_seen = 0, new_seen = 0;
  for (uint64_t k = 0; k <= n + 2; ++k) {
    SCOPED_TRACE(::testing::Message() << "crash after mutating call " << k << " of " << n);
    absl::StatusOr<uint64_t> state = CrashSecondSaveAfter(k, std::nullopt, /*must_crash=*/false);
    CKPT_ASSERT_OK(state);
    (*state == 1 ? old_seen : new_seen)++;
  }
  EXPECT_GT(old_seen, 0);
  EXPECT_GT(new_seen, 0);
}

// Crash points spread over the whole save of step 2, each unsynced tail then cut at a seeded
// random point rather than at its last Sync: the store still holds exactly step 1 or step 2.
TEST_F(CrashTest, RandomUnsyncedTailsNeverBreakTheStore) {
  Reset();
  CKPT_ASSERT_OK(SaveSyntheticStep(kRoot, options_, 2, 1));
  const uint64_t before = fault_->mutating_calls();
  CKPT_ASSERT_OK(SaveSyntheticStep(kRoot, options_, 2, 2));
  const uint64_t n = fault_->mutating_calls() - before;
  ASSERT_GT(n, 10u);
  constexpr uint64_t kSeeds = 40;
  int old_seen = 0, new_seen = 0;
  for (uint64_t seed = 1; seed <= kSeeds; ++seed) {
    const uint64_t k = seed * n / kSeeds;  // In [1, n]: every case crashes inside the save.
    SCOPED_TRACE(::testing::Message()
                 << "seed " << seed << ", crash after mutating call " << k << " of " << n);
    absl::StatusOr<uint64_t> state = CrashSecondSaveAfter(k, seed, /*must_crash=*/true);
    CKPT_ASSERT_OK(state);
    (*state == 1 ? old_seen : new_seen)++;
  }
  EXPECT_GT(old_seen, 0);
  EXPECT_GT(new_seen, 0);
}

TEST_F(CrashTest, RetentionIsAllOrNothingAtEveryCrashPoint) {
  auto prepare = [&] {
    Reset();
    for (uint64_t step = 1; step <= 4; ++step)
      CKPT_ASSERT_OK(SaveSyntheticStep(kRoot, options_, 1, step));
    CKPT_ASSERT_OK(fault_->DropUnsyncedData());
  };
  auto gc = [&]() -> absl::Status {
    CKPT_ASSIGN_OR_RETURN(auto store, CheckpointStore::Open(kRoot, options_));
    return store->ApplyRetention({.keep_last = 1}).status();
  };
  prepare();
  const uint64_t before = fault_->mutating_calls();
  CKPT_ASSERT_OK(gc());
  const uint64_t n = fault_->mutating_calls() - before;
  ASSERT_GT(n, 4u);
  for (uint64_t k = 0; k <= n + 1; ++k) {
    SCOPED_TRACE(::testing::Message() << "crash after mutating call " << k << " of " << n);
    prepare();
    fault_->CrashAfter(k);
    absl::Status done = gc();
    CKPT_ASSERT_OK(fault_->DropUnsyncedData());
    absl::StatusOr<std::optional<uint64_t>> state = CheckStoreConsistent(kRoot, options_);
    CKPT_ASSERT_OK(state);
    EXPECT_EQ(*state, std::optional<uint64_t>(4));
    auto store = CheckpointStore::Open(kRoot, options_);
    CKPT_ASSERT_OK(store);
    auto steps = (*store)->ListSteps();
    CKPT_ASSERT_OK(steps);
    const std::vector<uint64_t> old_state = {1, 2, 3, 4}, new_state = {4};
    EXPECT_TRUE(*steps == old_state || *steps == new_state) << ::testing::PrintToString(*steps);
    if (done.ok()) {
      EXPECT_EQ(*steps, new_state);
    }
  }
}

}  // namespace
}  // namespace ckpt
