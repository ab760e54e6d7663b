// TensorSource reads a transformers-written HF checkpoint and a ckpt step alike: its tensors with
// dtypes and shapes, FP32 reads of floating tensors (16-bit ones widened exactly), bytes as
// stored, coverage of a step's pieces, the model-only view of a step, and clear refusals.
#include "ckpt/tensor_source.h"

#include <cstring>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "ckpt/formats/float_convert.h"
#include "tests/support/status_matchers.h"
#include "tests/support/testdata.h"

namespace ckpt {
namespace {

using formats::DType;
using testing::IsOk;
using testing::StatusIs;

TEST(TensorSourceTest, AnHfCheckpointReadsAsItsOwnReaderReadsIt) {
  const std::string dir = std::string(CKPT_HF_TESTDATA) + "/qwen3-tiny";
  CKPT_SKIP_OR_FAIL_WITHOUT_TESTDATA(dir);
  auto env = NewPosixEnv();
  auto source = TensorSource::OpenHf(dir, env.get());
  ASSERT_THAT(source, IsOk());
  auto reader = HfCheckpointReader::Open(dir, {.env = env.get()});
  ASSERT_THAT(reader, IsOk());
  ASSERT_EQ((*source)->tensors().size(), (*reader)->tensors().size());
  EXPECT_THAT((*source)->Describe(), ::testing::HasSubstr(dir));
  for (const HfTensor& t : (*reader)->tensors()) {
    const SourceTensor& s = (*source)->tensors().at(t.name);
    EXPECT_EQ(s.shape, t.shape) << t.name;
    EXPECT_EQ(s.numel, t.numel) << t.name;
    ASSERT_TRUE(s.floating()) << t.name;
    std::vector<float> got(t.numel), want(t.numel);
    const TensorSource::F32Request r{t.name, 0, t.numel, got};
    ASSERT_THAT((*source)->ReadF32({&r, 1}), IsOk());
    ASSERT_THAT((*reader)->ReadAsF32(t.name, 0, t.numel, want), IsOk());
    EXPECT_EQ(std::memcmp(got.data(), want.data(), 4 * t.numel), 0) << t.name;
    EXPECT_THAT((*source)->CheckCovers(t.name, 0, t.numel), IsOk());
  }
}

class StepSourceTest : public ::testing::Test {
 protected:
  StepSourceTest() : env_(NewMemEnv()) {
    options_.env = env_.get();
    store_ = CheckpointStore::Open("/root", options_).value();
    auto txn = store_->BeginSave(3).value();
    EXPECT_THAT(txn->DeclareTensor({"w", DType::kBF16, {10}}), IsOk());
    EXPECT_THAT(txn->DeclareTensor({"ids", DType::kI64, {2}}), IsOk());
    EXPECT_THAT(txn->DeclareTensor({"optimizer.master.w", DType::kF32, {10}}), IsOk());
    for (int i = 0; i < 10; ++i) bf16_.push_back(formats::FloatToBf16(0.1f * i - 0.3f));
    // Elements [0, 4) and [6, 10) of w: [4, 6) is nobody's.
    EXPECT_THAT(txn->WritePiece("w", 0, 4, std::as_bytes(std::span(bf16_).first(4))), IsOk());
    EXPECT_THAT(txn->WritePiece("w", 6, 4, std::as_bytes(std::span(bf16_).subspan(6))), IsOk());
    const int64_t ids[2] = {7, -1};
    EXPECT_THAT(txn->WritePiece("ids", 0, 2, std::as_bytes(std::span(ids))), IsOk());
    const std::vector<float> master(10, 1.0f);
    EXPECT_THAT(txn->WritePiece("optimizer.master.w", 0, 10, std::as_bytes(std::span(master))),
                IsOk());
    EXPECT_THAT(txn->Commit(), IsOk());
  }
  std::unique_ptr<Env> env_;
  StoreOptions options_;
  std::unique_ptr<CheckpointStore> store_;
  std::vector<uint16_t> bf16_;
};

TEST_F(StepSourceTest, ReadsWidenedValuesBytesAndCoverageOfAStep) {
  auto source = TensorSource::OpenRoot("/root", std::nullopt, options_);  // LATEST.
  ASSERT_THAT(source, IsOk());
  EXPECT_EQ((*source)->Describe(), "step 3 of /root");
  EXPECT_EQ((*source)->tensors().size(), 3u);
  const SourceTensor& ids = (*source)->tensors().at("ids");
  EXPECT_EQ(ids.dtype_name, "I64");
  EXPECT_FALSE(ids.floating());
  std::vector<float> got(4);
  const TensorSource::F32Request r{"w", 6, 4, got};
  ASSERT_THAT((*source)->ReadF32({&r, 1}), IsOk());
  for (int i = 0; i < 4; ++i) EXPECT_EQ(got[i], formats::Bf16ToFloat(bf16_[6 + i]));
  int64_t back[2];
  ASSERT_THAT((*source)->ReadBytes("ids", 0, 2, std::as_writable_bytes(std::span(back))), IsOk());
  EXPECT_EQ(back[1], -1);
  EXPECT_THAT((*source)->CheckCovers("w", 6, 4), IsOk());
  EXPECT_THAT((*source)->CheckCovers("w", 3, 2), StatusIs(absl::StatusCode::kInvalidArgument));
  // Not floating: no FP32 read.
  std::vector<float> two(2);
  const TensorSource::F32Request bad{"ids", 0, 2, two};
  EXPECT_THAT((*source)->ReadF32({&bad, 1}), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST_F(StepSourceTest, TheCallersFilterDecidesWhichTensorsItShows) {
  auto source = TensorSource::OpenStep(*store_, 3, [](absl::string_view name) {
    return !absl::StartsWith(name, "optimizer.");
  });
  ASSERT_THAT(source, IsOk());
  EXPECT_EQ((*source)->tensors().count("optimizer.master.w"), 0u);
  EXPECT_EQ((*source)->tensors().count("w"), 1u);
  EXPECT_THAT(TensorSource::OpenStep(*store_, 4), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(TensorSource::OpenRoot("/nowhere", std::nullopt, options_),
              StatusIs(absl::StatusCode::kNotFound));
}

}  // namespace
}  // namespace ckpt
