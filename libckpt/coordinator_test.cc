// The one codec of what ranks exchange: statuses and results round-trip with their code and
// message (values of any bytes, errors of every code), malformed text is kInternal naming it,
// and BroadcastResult gives every rank the root's value or error.
#include "ckpt/coordinator.h"

#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "ckpt/checkpoint_store.h"
#include "ckpt/env.h"
#include "tests/support/status_matchers.h"

namespace ckpt {
namespace {

using testing::StatusIs;

TEST(CoordinatorCodecTest, StatusesAndResultsRoundTripWithCodeAndMessage) {
  EXPECT_TRUE(DecodeStatus(EncodeStatus(absl::OkStatus())).ok());
  for (int code = 1; code <= 16; ++code) {
    const absl::Status s(static_cast<absl::StatusCode>(code), "why: a b  c");
    EXPECT_EQ(DecodeStatus(EncodeStatus(s)), s);
    EXPECT_EQ(DecodeResult(EncodeResult(s)).status(), s);
  }
  for (std::string value : {std::string(), std::string("12"), std::string("ok no 3 x"),
                            std::string("a\nb\0c", 5)}) {
    absl::StatusOr<std::string> back = DecodeResult(EncodeResult(value));
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(*back, value);
  }
}

TEST(CoordinatorCodecTest, MalformedTextIsInternalNamingIt) {
  for (const char* text : {"", "ok", "no 0", "no x y", "err 3 old", "0", "yes 1"}) {
    const absl::Status s = DecodeResult(text).status();
    EXPECT_THAT(s, StatusIs(absl::StatusCode::kInternal)) << "\"" << text << "\"";
    EXPECT_NE(s.message().find(text), absl::string_view::npos) << s;
  }
  EXPECT_THAT(DecodeStatus("99 nope"), StatusIs(absl::StatusCode::kInternal));
}

TEST(CoordinatorCodecTest, BroadcastResultGivesEveryRankTheRootsValueOrError) {
  for (bool root_fails : {false, true}) {
    ThreadGroup group(3);
    std::vector<absl::StatusOr<std::string>> got(3);
    std::vector<std::thread> ranks;
    for (int r = 0; r < 3; ++r) {
      ranks.emplace_back([&, r] {
        absl::StatusOr<std::string> mine = absl::StrCat("rank ", r);
        if (root_fails && r == 1) mine = absl::NotFoundError("no LATEST");
        got[r] = BroadcastResult(*group.member(r), mine, 1);
      });
    }
    for (std::thread& t : ranks) t.join();
    for (int r = 0; r < 3; ++r) {
      if (root_fails) {
        EXPECT_EQ(got[r].status(), absl::NotFoundError("no LATEST")) << "rank " << r;
      } else {
        ASSERT_TRUE(got[r].ok()) << got[r].status();
        EXPECT_EQ(*got[r], "rank 1") << "rank " << r;
      }
    }
  }
}

// OpenStoreOnRanks: every rank gets a handle (rank 0's the primary that recovered the root,
// the others not), or every rank fails with rank 0's error and holds none.
TEST(OpenStoreOnRanksTest, EveryRankOpensAfterThePrimaryOrEveryRankFails) {
  std::unique_ptr<Env> env = NewMemEnv();
  StoreOptions options;
  options.env = env.get();
  for (bool lock_held : {false, true}) {
    // A second primary handle holds the LOCK: rank 0's open is refused.
    std::unique_ptr<CheckpointStore> holder;
    if (lock_held) holder = CheckpointStore::Open("/root", options).value();
    ThreadGroup group(3);
    std::vector<absl::StatusOr<std::unique_ptr<CheckpointStore>>> got(3);
    std::vector<std::thread> ranks;
    for (int r = 0; r < 3; ++r) {
      ranks.emplace_back([&, r] { got[r] = OpenStoreOnRanks("/root", options, group.member(r)); });
    }
    for (std::thread& t : ranks) t.join();
    for (int r = 0; r < 3; ++r) {
      if (lock_held) {
        EXPECT_THAT(got[r], StatusIs(absl::StatusCode::kFailedPrecondition)) << "rank " << r;
        continue;
      }
      ASSERT_TRUE(got[r].ok()) << "rank " << r << ": " << got[r].status();
      EXPECT_EQ((*got[r])->options().primary, r == 0) << "rank " << r;
    }
  }
}

}  // namespace
}  // namespace ckpt
