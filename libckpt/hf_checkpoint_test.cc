#include "ckpt/hf_checkpoint.h"

#include <cmath>
#include <cstring>
#include <random>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "ckpt/base/coding.h"
#include "ckpt/formats/float_convert.h"
#include "tests/support/status_matchers.h"
#include "tests/support/temp_dir.h"
#include "tests/support/testdata.h"

namespace ckpt {
namespace {

using formats::StDType;
using ::testing::HasSubstr;
using testing::IsOk;
using testing::StatusIs;

const std::string kTestdata = CKPT_HF_TESTDATA;

struct Model {
  const char* dir;
  size_t shards;
};

class HfTestdataTest : public ::testing::TestWithParam<Model> {
 protected:
  void SetUp() override { CKPT_SKIP_OR_FAIL_WITHOUT_TESTDATA(kTestdata + "/" + GetParam().dir); }
};

// Reads every tensor of the transformers-written checkpoint, writes it back through our writer
// (sharded like the original, and as one file), and requires every tensor's bytes to match.
TEST_P(HfTestdataTest, EveryTensorRoundTripsThroughOurWriterByteForByte) {
  auto env = NewPosixEnv();
  const std::string src = kTestdata + "/" + GetParam().dir;
  auto reader = HfCheckpointReader::Open(src, {.env = env.get()});
  CKPT_ASSERT_OK(reader);
  EXPECT_EQ((*reader)->sharded(), GetParam().shards > 1);
  EXPECT_EQ((*reader)->shard_metadata().size(), GetParam().shards);
  std::vector<std::string> storage;
  std::vector<HfTensorData> tensors;
  uint64_t total = 0;
  for (const HfTensor& t : (*reader)->tensors()) {
    std::string bytes(t.byte_size, '\0');
    CKPT_ASSERT_OK(
        (*reader)->ReadBytes(t.name, 0, t.numel, std::as_writable_bytes(std::span(bytes))));
    storage.push_back(std::move(bytes));
    total += t.byte_size;
  }
  ASSERT_GT(storage.size(), 3u);
  if ((*reader)->index().has_value()) {
    EXPECT_EQ((*reader)->index()->total_size, std::optional<uint64_t>(total));
  }
  for (size_t i = 0; i < storage.size(); ++i) {
    const HfTensor& t = (*reader)->tensors()[i];
    tensors.push_back({t.name, t.dtype, t.shape, AsBytes(storage[i])});
  }
  testing::ScopedTempDir tmp;
  for (uint64_t max_shard : {uint64_t{0}, total / 3 + 1}) {
    const std::string out = tmp.path() + "/export-" + std::to_string(max_shard);
    CKPT_ASSERT_OK(
        WriteHfCheckpoint(out, tensors, {.env = env.get(), .max_shard_bytes = max_shard}));
    auto back = HfCheckpointReader::Open(out, {.env = env.get()});
    CKPT_ASSERT_OK(back);
    EXPECT_EQ((*back)->sharded(), max_shard > 0);
    ASSERT_EQ((*back)->tensors().size(), storage.size());
    for (size_t i = 0; i < storage.size(); ++i) {
      const HfTensor& t = (*back)->tensors()[i];
      EXPECT_EQ(t.name, tensors[i].name);
      EXPECT_EQ(t.shape, tensors[i].shape);
      std::string bytes(t.byte_size, '\0');
      CKPT_ASSERT_OK(
          (*back)->ReadBytes(t.name, 0, t.numel, std::as_writable_bytes(std::span(bytes))));
      EXPECT_EQ(bytes, storage[i]) << t.name;
    }
    if (max_shard > 0) {
      EXPECT_EQ((*back)->index()->total_size, std::optional<uint64_t>(total));
    }
  }
}

TEST_P(HfTestdataTest, RangesConvertToF32LikeWholeTensors) {
  auto env = NewPosixEnv();
  auto reader = HfCheckpointReader::Open(kTestdata + "/" + GetParam().dir, {.env = env.get()});
  CKPT_ASSERT_OK(reader);
  for (const HfTensor& t : (*reader)->tensors()) {
    ASSERT_EQ(t.dtype, StDType::kBF16) << t.name;
    std::vector<float> whole(t.numel);
    CKPT_ASSERT_OK((*reader)->ReadAsF32(t.name, 0, t.numel, whole));
    std::vector<uint16_t> raw(t.numel);
    CKPT_ASSERT_OK(
        (*reader)->ReadBytes(t.name, 0, t.numel, std::as_writable_bytes(std::span(raw))));
    for (uint64_t i = 0; i < t.numel; ++i) {
      uint32_t bits;
      std::memcpy(&bits, &whole[i], 4);
      ASSERT_EQ(bits, static_cast<uint32_t>(raw[i]) << 16) << t.name << "[" << i << "]";
    }
    if (t.numel > 10) {  // A range that a rank's piece would cut.
      std::vector<float> part(t.numel / 3);
      CKPT_ASSERT_OK((*reader)->ReadAsF32(t.name, 5, part.size(), part));
      EXPECT_TRUE(std::equal(part.begin(), part.end(), whole.begin() + 5)) << t.name;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(TransformersCheckpoints, HfTestdataTest,
                         ::testing::Values(Model{"qwen3-tiny", 3}, Model{"qwen3-moe-tiny", 2},
                                           Model{"llama-tied-tiny", 1}),
                         [](const ::testing::TestParamInfo<Model>& p) {
                           std::string n = p.param.dir;
                           for (char& c : n) c = c == '-' ? '_' : c;
                           return n;
                         });

class HfIndexConsistencyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    env_ = NewMemEnv();
    CKPT_ASSERT_OK(env_->CreateDir("/m"));
    a_ = {1, 2, 3, 4};
    b_ = {5, 6};
    CKPT_ASSERT_OK(WriteHfCheckpoint(
        "/m", {{"a", StDType::kF32, {4}, AsF(a_)}, {"b", StDType::kF32, {2}, AsF(b_)}},
        {.env = env_.get(), .max_shard_bytes = 16}));
  }
  static std::span<const std::byte> AsF(const std::vector<float>& v) {
    return std::as_bytes(std::span(v));
  }
  absl::Status ReplaceIndex(const std::string& json) {
    return WriteFileAtomically(env_.get(), "/m/model.safetensors.index.json", json);
  }
  absl::StatusOr<std::unique_ptr<HfCheckpointReader>> Open() {
    return HfCheckpointReader::Open("/m", {.env = env_.get()});
  }
  std::unique_ptr<Env> env_;
  std::vector<float> a_, b_;
};

TEST_F(HfIndexConsistencyTest, WriterShardsAndIndexReadBack) {
  auto r = Open();
  CKPT_ASSERT_OK(r);
  EXPECT_TRUE((*r)->sharded());
  EXPECT_EQ((*r)->Find("b").value()->shard, "model-00002-of-00002.safetensors");
  EXPECT_EQ((*r)->shard_metadata().at("model-00001-of-00002.safetensors").at("format"), "pt");
  std::vector<float> out(2);
  CKPT_ASSERT_OK((*r)->ReadAsF32("a", 1, 2, out));
  EXPECT_EQ(out, (std::vector<float>{2, 3}));
}

TEST_F(HfIndexConsistencyTest, MissingShardIsRejected) {
  CKPT_ASSERT_OK(env_->RemoveFile("/m/model-00002-of-00002.safetensors"));
  EXPECT_THAT(Open(), StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_THAT(std::string(Open().status().message()), HasSubstr("MissingShard"));
}

TEST_F(HfIndexConsistencyTest, ListedTensorAbsentFromItsShardIsRejected) {
  CKPT_ASSERT_OK(ReplaceIndex(
      R"({"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors", "c": "model-00002-of-00002.safetensors"}})"));
  EXPECT_THAT(std::string(Open().status().message()), HasSubstr("MissingTensor"));
}

TEST_F(HfIndexConsistencyTest, TensorInTheWrongShardIsRejected) {
  CKPT_ASSERT_OK(ReplaceIndex(
      R"({"weight_map": {"a": "model-00002-of-00002.safetensors", "b": "model-00002-of-00002.safetensors", "x": "model-00001-of-00002.safetensors"}})"));
  EXPECT_THAT(std::string(Open().status().message()), HasSubstr("WrongShard"));
}

TEST_F(HfIndexConsistencyTest, TensorInTwoShardsIsRejected) {
  // Rewrite shard 2 to also hold "a".
  CKPT_ASSERT_OK(WriteHfCheckpoint(
      "/other", {{"a", StDType::kF32, {4}, AsF(a_)}, {"b", StDType::kF32, {2}, AsF(b_)}},
      {.env = env_.get()}));
  auto both = ReadFileToString(env_.get(), "/other/model.safetensors", UINT64_MAX);
  CKPT_ASSERT_OK(both);
  CKPT_ASSERT_OK(WriteFileAtomically(env_.get(), "/m/model-00002-of-00002.safetensors", *both));
  EXPECT_THAT(std::string(Open().status().message()),
              ::testing::AnyOf(HasSubstr("DuplicateTensor"), HasSubstr("WrongShard")));
}

TEST_F(HfIndexConsistencyTest, UnlistedTensorInAShardIsRejected) {
  CKPT_ASSERT_OK(ReplaceIndex(
      R"({"weight_map": {"a": "model-00001-of-00002.safetensors", "zz": "model-00002-of-00002.safetensors"}})"));
  EXPECT_THAT(std::string(Open().status().message()), HasSubstr("UnlistedTensor"));
}

TEST_F(HfIndexConsistencyTest, PathLeavingTheDirectoryIsRejectedBeforeAnyOpen) {
  CKPT_ASSERT_OK(ReplaceIndex(R"({"weight_map": {"a": "../m/model-00001-of-00002.safetensors"}})"));
  EXPECT_THAT(std::string(Open().status().message()), HasSubstr("UnsafeShardPath"));
}

TEST_F(HfIndexConsistencyTest, SingleFileExportReplacesTheIndex) {
  CKPT_ASSERT_OK(
      WriteHfCheckpoint("/m", {{"a", StDType::kF32, {4}, AsF(a_)}}, {.env = env_.get()}));
  auto r = Open();
  CKPT_ASSERT_OK(r);
  EXPECT_FALSE((*r)->sharded());
  EXPECT_EQ((*r)->tensors().size(), 1u);
}

// Tensors at odd file offsets (a 3-byte U8 tensor shifts the rest), larger than the reader's
// 8 MiB slices, read in one call as whole tensors, overlapping ranges, ranges that start and end
// mid-slice, and an empty range: every element must equal the reference conversion of its
// source bits. Slices are cut on the file's absolute grid, so this is where a cut through an
// element, a lost or doubled slice, or a wrong position in a merged extent would show.
class HfReadPlanTest : public ::testing::TestWithParam<int> {};

TEST_P(HfReadPlanTest, ManyRangesAtOddOffsetsAcrossSliceBoundariesConvertExactly) {
  testing::ScopedTempDir tmp;
  auto env = NewPosixEnv();
  std::mt19937 rng(11);
  std::vector<uint8_t> a = {1, 2, 3};
  std::vector<uint16_t> b(5'000'003), d(1'000'001);
  std::vector<uint32_t> c(3'000'007);
  for (auto& x : b) x = static_cast<uint16_t>(rng() & 0x7f7f);  // Finite BF16.
  for (auto& x : c) x = rng() & 0x7f7fffff;                     // Finite F32.
  for (auto& x : d) x = static_cast<uint16_t>(rng() & 0x7bff);  // Finite F16.
  CKPT_ASSERT_OK(WriteHfCheckpoint(tmp.path(),
                                   {{"a", StDType::kU8, {3}, std::as_bytes(std::span(a))},
                                    {"b", StDType::kBF16, {b.size()}, std::as_bytes(std::span(b))},
                                    {"c", StDType::kF32, {c.size()}, std::as_bytes(std::span(c))},
                                    {"d", StDType::kF16, {d.size()}, std::as_bytes(std::span(d))}},
                                   {.env = env.get()}));
  auto r = HfCheckpointReader::Open(tmp.path(), {.env = env.get(), .read_threads = GetParam()});
  CKPT_ASSERT_OK(r);
  for (const char* name : {"b", "c", "d"}) {
    auto t = (*r)->Find(name);
    CKPT_ASSERT_OK(t);
    EXPECT_NE((*t)->file_offset % 2, 0u) << name << " should sit at an odd offset";
  }
  auto expected = [&](const std::string& name, uint64_t i) -> uint32_t {
    if (name == "b") return static_cast<uint32_t>(b[i]) << 16;
    if (name == "c") return c[i];
    return formats::FloatBits(formats::HalfToFloat(d[i]));
  };
  struct Range {
    std::string name;
    uint64_t begin, count;
  };
  const std::vector<Range> ranges = {
      {"b", 0, b.size()},    {"c", 0, c.size()},  {"d", 0, d.size()},
      {"b", 100, 4'000'000}, {"c", 7, 2'500'000}, {"c", 2'999'000, 1'007},
      {"b", 4'194'303, 3},   {"d", 500'000, 0},   {"d", 999'999, 2}};
  std::vector<std::vector<float>> outs;
  std::vector<HfCheckpointReader::F32Request> requests;
  for (const Range& g : ranges) outs.emplace_back(g.count, -1.0f);
  for (size_t k = 0; k < ranges.size(); ++k)
    requests.push_back({ranges[k].name, ranges[k].begin, ranges[k].count, outs[k]});
  CKPT_ASSERT_OK((*r)->ReadManyAsF32(requests));
  for (size_t k = 0; k < ranges.size(); ++k) {
    for (uint64_t i = 0; i < ranges[k].count; ++i) {
      ASSERT_EQ(formats::FloatBits(outs[k][i]), expected(ranges[k].name, ranges[k].begin + i))
          << "request " << k << " (" << ranges[k].name << ") element " << i;
    }
  }
  std::vector<uint8_t> got_a(3);
  CKPT_ASSERT_OK((*r)->ReadBytes("a", 0, 3, std::as_writable_bytes(std::span(got_a))));
  EXPECT_EQ(got_a, a);
  std::vector<uint32_t> got_c(c.size());
  CKPT_ASSERT_OK((*r)->ReadBytes("c", 0, c.size(), std::as_writable_bytes(std::span(got_c))));
  EXPECT_EQ(got_c, c);
}

INSTANTIATE_TEST_SUITE_P(Threads, HfReadPlanTest, ::testing::Values(1, 3, 8));

TEST(HfReaderTest, BadRequestsAreRefused) {
  auto env = NewMemEnv();
  std::vector<uint16_t> h = {0x3c00, 0x8001, 0x7c00,
                             0x0400};  // 1, -tiny subnormal, inf, min normal
  std::vector<int32_t> ints = {1, 2};
  CKPT_ASSERT_OK(WriteHfCheckpoint("/h",
                                   {{"h", StDType::kF16, {4}, std::as_bytes(std::span(h))},
                                    {"i", StDType::kI32, {2}, std::as_bytes(std::span(ints))}},
                                   {.env = env.get()}));
  auto r = HfCheckpointReader::Open("/h/model.safetensors", {.env = env.get()});
  CKPT_ASSERT_OK(r);
  std::vector<float> f(4);
  CKPT_ASSERT_OK((*r)->ReadAsF32("h", 0, 4, f));
  EXPECT_EQ(f[0], 1.0f);
  EXPECT_EQ(f[1], -std::ldexp(1.0f, -24));
  EXPECT_TRUE(std::isinf(f[2]));
  EXPECT_EQ(f[3], std::ldexp(1.0f, -14));
  EXPECT_THAT((*r)->ReadAsF32("i", 0, 2, std::span(f).first(2)),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT((*r)->ReadAsF32("h", 3, 2, std::span(f).first(2)),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT((*r)->ReadAsF32("nope", 0, 1, std::span(f).first(1)),
              StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(HfCheckpointReader::Open("/nowhere", {.env = env.get()}),
              StatusIs(absl::StatusCode::kNotFound));
  CKPT_ASSERT_OK(env->CreateDir("/empty"));
  EXPECT_THAT(HfCheckpointReader::Open("/empty", {.env = env.get()}),
              StatusIs(absl::StatusCode::kNotFound));
  std::vector<float> wrong(3);
  EXPECT_THAT(WriteHfCheckpoint("/w", {{"x", StDType::kF32, {4}, std::as_bytes(std::span(wrong))}},
                                {.env = env.get()}),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace ckpt
