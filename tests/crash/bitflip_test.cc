// Every single-bit flip in a small committed checkpoint (MANIFEST and data files) is reported by
// verify and refused by the reader with kDataLoss.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "ckpt/base/coding.h"
#include "ckpt/base/status_macros.h"
#include "ckpt/checkpoint_store.h"
#include "ckpt/verify.h"
#include "tests/support/status_matchers.h"
#include "tests/support/synthetic_state.h"

namespace ckpt {
namespace {

using testing::StatusIs;

constexpr char kRoot[] = "/ckpt";
constexpr char kStep[] = "/ckpt/step-00000001";

// Reads every tensor and blob of the step through a fresh reader.
absl::Status ReadEverything(Env* env) {
  StoreOptions options;
  options.env = env;
  CKPT_ASSIGN_OR_RETURN(auto reader, CheckpointReader::Open(kStep, options));
  for (const formats::TensorInfo& t : reader->manifest().tensors) {
    std::vector<std::byte> out(t.numel() * formats::DTypeSize(t.dtype));
    CKPT_RETURN_IF_ERROR(reader->ReadRange(t.name, 0, t.numel(), out));
  }
  for (const formats::BlobInfo& b : reader->manifest().blobs) {
    CKPT_RETURN_IF_ERROR(reader->ReadBlob(b.name, b.rank).status());
  }
  return absl::OkStatus();
}

absl::Status Overwrite(Env* env, const std::string& path, const std::string& bytes) {
  CKPT_RETURN_IF_ERROR(env->RemoveFile(path));  // NewWritableFile never replaces a name.
  CKPT_ASSIGN_OR_RETURN(auto file, env->NewWritableFile(path, FileOptions{}));
  CKPT_RETURN_IF_ERROR(file->Append(AsBytes(bytes)));
  return file->Close();
}

TEST(BitFlipTest, EveryFlipIsReportedByVerifyAndRefusedByTheReader) {
  auto env = NewMemEnv();
  StoreOptions options;
  options.env = env.get();
  CKPT_ASSERT_OK(testing::SaveSyntheticStep(kRoot, options, 1, 1));
  CKPT_ASSERT_OK(ReadEverything(env.get()));
  for (const std::string name : {"MANIFEST", "rank-00000.data"}) {
    const std::string path = std::string(kStep) + "/" + name;
    auto original = ReadFileToString(env.get(), path, UINT64_MAX);
    CKPT_ASSERT_OK(original);
    for (size_t bit = 0; bit < original->size() * 8; ++bit) {
      std::string damaged = *original;
      damaged[bit / 8] ^= static_cast<char>(1 << (bit % 8));
      CKPT_ASSERT_OK(Overwrite(env.get(), path, damaged));
      auto report = VerifyStepDir(env.get(), kStep);
      CKPT_ASSERT_OK(report);
      ASSERT_FALSE(report->problems.empty()) << name << " bit " << bit;
      ASSERT_THAT(ReadEverything(env.get()), StatusIs(absl::StatusCode::kDataLoss))
          << name << " bit " << bit;
    }
    CKPT_ASSERT_OK(Overwrite(env.get(), path, *original));
  }
  CKPT_EXPECT_OK(ReadEverything(env.get()));
}

}  // namespace
}  // namespace ckpt
