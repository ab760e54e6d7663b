// ExportHf: a Checkpointer step exported as safetensors and loaded back with LoadModel
// round-trips bit for bit (weights in their dtype; masters as F32), single file and sharded,
// in pieces smaller than a tensor; config.json is copied; bad requests are refused.
#include "ckpt/optimizer/export_hf.h"

#include <algorithm>
#include <cerrno>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "ckpt/hf_checkpoint.h"
#include "optimizer/checkpointer_test_job.h"
#include "tests/support/fault_injection_env.h"
#include "tests/support/status_matchers.h"

namespace ckpt::optimizer {
namespace {

using formats::DType;
using test_job::ExpectAllOk;
using test_job::Job;
using test_job::kRoot;
using testing::IsOk;
using testing::StatusIs;
using ::testing::HasSubstr;

class ExportHfTest : public ::testing::Test {
 protected:
  ExportHfTest() : env_(NewMemEnv()) {}

  // Per element (param, index): the rank's weight bits and master bits.
  static std::map<std::pair<uint32_t, uint64_t>, std::pair<uint16_t, float>> State(Job& job) {
    std::map<std::pair<uint32_t, uint64_t>, std::pair<uint16_t, float>> out;
    for (int r = 0; r < job.size(); ++r) {
      uint64_t at = 0;
      for (const Piece& p : job.rank(r).opt->options().pieces) {
        for (uint64_t i = 0; i < p.count; ++i, ++at) {
          out[{p.param, p.begin + i}] = {job.rank(r).weights[at], job.rank(r).opt->master()[at]};
        }
      }
    }
    return out;
  }
  std::vector<absl::Status> LoadModel(Job& job, const std::string& source) {
    return job.OnEveryRank(
        [&](int r) -> absl::Status {
          CKPT_RETURN_IF_ERROR(job.rank(r).ckpt->LoadModel(source).status());
          return job.WriteWeights(r);
        });
  }

  std::unique_ptr<Env> env_;
};

TEST_F(ExportHfTest, WeightsAndMastersRoundTripThroughLoadModel) {
  Job saver(env_.get(), 3, 500);
  for (int s = 0; s < 3; ++s) saver.Step(s);
  ExpectAllOk(saver.Save(3));
  const auto saved = State(saver);
  const std::unique_ptr<CheckpointReader> step = test_job::OpenStep(env_.get(), kRoot, 3);
  struct Case {
    ExportFrom from;
    std::optional<DType> dtype;
    uint64_t max_shard, buffer;
  };
  for (const Case& c : {Case{ExportFrom::kWeights, std::nullopt, 0, 32 << 20},
                        Case{ExportFrom::kMasters, DType::kF32, 5000, 100},
                        Case{ExportFrom::kWeights, std::nullopt, 3000, 64}}) {
    const std::string out = absl::StrCat("/out-", static_cast<int>(c.from), "-", c.max_shard);
    uint64_t last_done = 0, total = 0;
    ExportHfOptions o;
    o.env = env_.get();
    o.from = c.from;
    o.dtype = c.dtype;
    o.max_shard_bytes = c.max_shard;
    o.buffer_bytes = c.buffer;
    o.progress = [&](uint64_t d, uint64_t t) {
      EXPECT_GE(d, last_done);
      last_done = d;
      total = t;
    };
    auto report = ExportHf(*step, out, o);
    ASSERT_THAT(report, IsOk());
    EXPECT_EQ(report->tensors, testing::ToyModel().size());
    EXPECT_EQ(last_done, total);
    EXPECT_EQ(report->bytes, total);
    auto hf = HfCheckpointReader::Open(out, {.env = env_.get()});
    ASSERT_THAT(hf, IsOk());
    EXPECT_EQ((*hf)->sharded(), c.max_shard != 0) << out;
    EXPECT_EQ(report->sharded, c.max_shard != 0);
    EXPECT_EQ((*hf)->tensors()[0].dtype,
              c.dtype == DType::kF32 ? formats::StDType::kF32 : formats::StDType::kBF16);
    // A job at another DP size loads the export: weights (BF16) or masters (F32) bit for bit.
    Job loader(env_.get(), 2, 700, testing::ToyModel(), MomentDType::kF32, {}, "/loader");
    loader.Step(0);
    ExpectAllOk(LoadModel(loader, out));
    const auto loaded = State(loader);
    uint64_t mismatches = 0;
    for (const auto& [key, value] : saved) {
      const auto& got = loaded.at(key);
      if (c.from == ExportFrom::kMasters) {
        mismatches += formats::FloatBits(got.second) != formats::FloatBits(value.second);
      }
      mismatches += got.first != value.first;  // The masters round to the saved weights.
    }
    EXPECT_EQ(mismatches, 0u) << out;
  }
}

TEST_F(ExportHfTest, ConfigIsCopiedAndBadRequestsAreRefused) {
  Job saver(env_.get(), 1, 500);
  saver.Step(0);
  ExpectAllOk(saver.Save(1));
  const std::unique_ptr<CheckpointReader> step = test_job::OpenStep(env_.get(), kRoot, 1);
  ASSERT_THAT(WriteFileAtomically(env_.get(), "/config.json", R"({"model_type": "toy"})"), IsOk());
  ASSERT_THAT(WriteFileAtomically(env_.get(), "/bad.json", "[1, 2"), IsOk());
  ExportHfOptions o;
  o.env = env_.get();
  o.config = "/config.json";
  o.dtype = DType::kF16;
  ASSERT_THAT(ExportHf(*step, "/out", o), IsOk());
  auto config = ReadFileToString(env_.get(), "/out/config.json", 1 << 20);
  ASSERT_THAT(config, IsOk());
  EXPECT_EQ(*config, R"({"model_type": "toy"})");
  auto hf = HfCheckpointReader::Open("/out", {.env = env_.get()});
  ASSERT_THAT(hf, IsOk());
  EXPECT_EQ((*hf)->tensors()[0].dtype, formats::StDType::kF16);

  o.config = "/bad.json";
  EXPECT_THAT(ExportHf(*step, "/out2", o), StatusIs(absl::StatusCode::kInvalidArgument));
  o.config = "/missing.json";
  EXPECT_THAT(ExportHf(*step, "/out2", o), StatusIs(absl::StatusCode::kNotFound));
  o.config.clear();
  o.dtype = DType::kI32;
  EXPECT_THAT(ExportHf(*step, "/out2", o), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(env_->IsDirectory("/out2"), StatusIs(absl::StatusCode::kNotFound))
      << "a refused export wrote something";
}

TEST_F(ExportHfTest, AStepWithoutMastersCannotExportThem) {
  // A plain store step (no optimizer.* tensors): its tensors export, its masters do not exist.
  StoreOptions so;
  so.env = env_.get();
  auto store = CheckpointStore::Open("/plain", so);
  ASSERT_THAT(store, IsOk());
  auto txn = (*store)->BeginSave(1);
  ASSERT_THAT(txn, IsOk());
  const float values[3] = {1.5f, -2.0f, 0.25f};
  ASSERT_THAT((*txn)->DeclareTensor({"w", DType::kF32, {3}}), IsOk());
  ASSERT_THAT((*txn)->WritePiece("w", 0, 3, std::as_bytes(std::span(values))), IsOk());
  ASSERT_THAT((*txn)->Commit(), IsOk());
  auto step = (*store)->OpenStep(1);
  ASSERT_THAT(step, IsOk());
  ExportHfOptions o;
  o.env = env_.get();
  ASSERT_THAT(ExportHf(**step, "/plain-out", o), IsOk());
  o.from = ExportFrom::kMasters;
  auto refused = ExportHf(**step, "/plain-out2", o);
  EXPECT_THAT(refused, StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(refused.status().message(), HasSubstr("optimizer.master.w"));
}

// The output is a new directory, published whole: a non-empty directory, or one inside the
// store, is refused untouched; a failure at any mutating call leaves nothing at the output and
// no staging sibling; configs Python's json.load would refuse are refused.
TEST_F(ExportHfTest, OutputIsPublishedWholeOrNotAtAll) {
  testing::FaultInjectionEnv fault(env_.get());
  Job saver(env_.get(), 2, 500);
  saver.Step(0);
  ExpectAllOk(saver.Save(1));
  const std::unique_ptr<CheckpointReader> step = test_job::OpenStep(env_.get(), kRoot, 1);
  ExportHfOptions o;
  o.env = &fault;
  o.max_shard_bytes = 3000;  // Three files and an index.
  ASSERT_THAT(ExportHf(*step, "/model", o), IsOk());
  auto first = ReadFileToString(env_.get(), "/model/model.safetensors.index.json", 1 << 20);
  ASSERT_THAT(first, IsOk());
  // Into the existing model: refused, the model as it was.
  EXPECT_THAT(ExportHf(*step, "/model", o), StatusIs(absl::StatusCode::kFailedPrecondition));
  auto again = ReadFileToString(env_.get(), "/model/model.safetensors.index.json", 1 << 20);
  EXPECT_TRUE(again.ok() && *again == *first);
  // Inside the store it reads: refused.
  for (const std::string& inside : {std::string(kRoot), std::string(kRoot) + "/x",
                                   std::string(kRoot) + "/" + StepDirectoryName(1)}) {
    EXPECT_THAT(ExportHf(*step, inside, o), StatusIs(absl::StatusCode::kInvalidArgument)) << inside;
  }
  // An empty directory is replaced.
  ASSERT_THAT(env_->CreateDir("/empty"), IsOk());
  EXPECT_THAT(ExportHf(*step, "/empty", o), IsOk());
  // A failure at every mutating call: the output absent, no hidden sibling left.
  const uint64_t start = fault.mutating_calls();
  ASSERT_THAT(ExportHf(*step, "/probe", o), IsOk());
  const uint64_t calls = fault.mutating_calls() - start;
  ASSERT_THAT(RemoveRecursively(env_.get(), "/probe"), IsOk());
  auto before = env_->GetChildren("/");
  ASSERT_THAT(before, IsOk());
  std::sort(before->begin(), before->end());
  for (uint64_t k = 1; k <= calls; ++k) {
    fault.FailNth(k, EIO);
    auto failed = ExportHf(*step, "/out", o);
    fault.Disarm();
    if (failed.ok()) {  // Only a failed SyncDir after the publishing rename may pass unseen.
      ASSERT_THAT(RemoveRecursively(env_.get(), "/out"), IsOk());
      continue;
    }
    auto after = env_->GetChildren("/");
    ASSERT_THAT(after, IsOk());
    std::sort(after->begin(), after->end());
    EXPECT_EQ(*after, *before) << "failure at call " << k << ": " << failed.status();
  }
  // Configs json.load refuses.
  ASSERT_THAT(WriteFileAtomically(env_.get(), "/nul.json", std::string("{\"a\": 1}\0junk", 13)),
              IsOk());
  ASSERT_THAT(WriteFileAtomically(env_.get(), "/bom.json", "\xEF\xBB\xBF{\"a\": 1}"), IsOk());
  for (const char* config : {"/nul.json", "/bom.json"}) {
    o.config = config;
    EXPECT_THAT(ExportHf(*step, "/cfg", o), StatusIs(absl::StatusCode::kInvalidArgument)) << config;
  }
  EXPECT_THAT(env_->IsDirectory("/cfg"), StatusIs(absl::StatusCode::kNotFound));
}

TEST_F(ExportHfTest, MastersExportAsF32UnlessToldOtherwise) {
  Job saver(env_.get(), 1, 500);
  saver.Step(0);
  ExpectAllOk(saver.Save(1));
  const std::unique_ptr<CheckpointReader> step = test_job::OpenStep(env_.get(), kRoot, 1);
  ExportHfOptions o;
  o.env = env_.get();
  o.from = ExportFrom::kMasters;
  ASSERT_THAT(ExportHf(*step, "/m", o), IsOk());
  auto hf = HfCheckpointReader::Open("/m", {.env = env_.get()});
  ASSERT_THAT(hf, IsOk());
  for (const HfTensor& t : (*hf)->tensors()) EXPECT_EQ(t.dtype, formats::StDType::kF32) << t.name;
}

}  // namespace
}  // namespace ckpt::optimizer
