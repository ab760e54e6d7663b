// A store's root never lies inside another store's step or staging directory, which that
// store's retention or recovery would delete or quarantine along with everything in it
// (CheckpointStore::Open, libckpt/store/store.cc). Runs on a real directory through PosixEnv.
#include <filesystem>
#include <fstream>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "ckpt/checkpoint_store.h"
#include "tests/support/status_matchers.h"
#include "tests/support/synthetic_state.h"
#include "tests/support/temp_dir.h"

namespace ckpt {
namespace {

namespace fs = std::filesystem;
using testing::StatusIs;

class NestedRootTest : public ::testing::Test {
 protected:
  NestedRootTest() : posix_(NewPosixEnv()) {
    outer_ = tmp_.path() + "/outer";
    options_.env = posix_.get();
    options_.chunk_bytes = 1000;
  }
  void SaveOuter() {
    for (uint64_t step : {1, 2}) {
      CKPT_ASSERT_OK(testing::SaveSyntheticStep(outer_, options_, 1, step));
    }
  }
  absl::Status OpenAt(const std::string& root, bool read_only = false) {
    StoreOptions o = options_;
    o.read_only = read_only;
    return CheckpointStore::Open(root, o).status();
  }

  testing::ScopedTempDir tmp_;
  std::unique_ptr<Env> posix_;
  std::string outer_;
  StoreOptions options_;
};

TEST_F(NestedRootTest, ARootInsideAnotherStoresCommittedStepIsRefusedAndNothingIsCreated) {
  SaveOuter();
  const std::string inner = outer_ + "/step-00000001/inner";
  absl::Status s = OpenAt(inner);
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr(outer_ + "/step-00000001"));
  EXPECT_FALSE(fs::exists(inner));
  // Deeper, already there, or read-only: the same.
  fs::create_directories(inner + "/a/b");
  EXPECT_THAT(OpenAt(inner + "/a/b"), StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(OpenAt(inner, /*read_only=*/true), StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_FALSE(fs::exists(inner + "/a/b/LOCK"));
}

TEST_F(NestedRootTest, AnotherStoresStepDirectoryItselfIsRefusedAsARoot) {
  SaveOuter();
  EXPECT_THAT(OpenAt(outer_ + "/step-00000002"), StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_FALSE(fs::exists(outer_ + "/step-00000002/LOCK"));
}

TEST_F(NestedRootTest, ARootInsideAnotherStoresStagingDirectoryIsRefused) {
  SaveOuter();
  const std::string staging = outer_ + "/.staging-step-00000003-0123456789abcdef";
  fs::create_directory(staging);
  EXPECT_THAT(OpenAt(staging + "/inner"), StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_FALSE(fs::exists(staging + "/inner"));
}

// Recovery removes an undo directory whole, and gc --purge-quarantine deletes quarantine/: a
// store made inside either would go with it (an adversarial probe made both). One already
// there (a step holding it was quarantined) still opens, to be rescued.
TEST_F(NestedRootTest, ARootMadeInsideAnotherStoresUndoOrQuarantineDirectoryIsRefused) {
  SaveOuter();
  // (An undo directory itself is a load's spill, which the Checkpointer opens as a store.)
  const std::string undo = outer_ + "/.undo-rank-00000-0123456789abcdef";
  fs::create_directory(undo);
  EXPECT_THAT(OpenAt(undo + "/inner"), StatusIs(absl::StatusCode::kFailedPrecondition));
  fs::create_directory(outer_ + "/quarantine");
  EXPECT_THAT(OpenAt(outer_ + "/quarantine/inner"),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_FALSE(fs::exists(outer_ + "/quarantine/inner"));
  EXPECT_FALSE(fs::exists(undo + "/inner"));
}

TEST_F(NestedRootTest, ARootUnderADirectoryOnlyNamedLikeAStepOrBesideAStoreOpens) {
  // No MANIFEST: not a committed step, whatever its name.
  fs::create_directories(tmp_.path() + "/runs/step-00000001");
  CKPT_EXPECT_OK(OpenAt(tmp_.path() + "/runs/step-00000001/store"));
  SaveOuter();
  CKPT_EXPECT_OK(OpenAt(tmp_.path() + "/sibling"));
}

}  // namespace
}  // namespace ckpt
