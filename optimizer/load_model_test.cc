// Checkpointer::LoadModel: from each transformers-written tiny model (sharded and single file,
// tied embeddings), from F32 safetensors and from ckpt steps, at DP 1 and 3, the masters are the
// source's values widened to FP32, the moments zero, the steps 0, the hyper-parameters kept, and
// the next step equals a fresh optimizer made from those weights. Renames and tied weights map
// names; preflight refusals touch nothing and list the names; a failure at every Env call
// leaves the state as it was or poisoned. The files live in a MemEnv behind a FaultInjectionEnv.
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "ckpt/base/coding.h"
#include "ckpt/formats/float_convert.h"
#include "ckpt/hf_checkpoint.h"
#include "ckpt/optimizer/checkpointer.h"
#include "optimizer/checkpointer_test_job.h"
#include "tests/support/fault_injection_env.h"
#include "tests/support/status_matchers.h"
#include "tests/support/testdata.h"

namespace ckpt::optimizer {
namespace {

using formats::DType;
using formats::StDType;
using test_job::ExpectAll;
using test_job::ExpectAllOk;
using test_job::Job;
using test_job::kRoot;
using testing::IsOk;
using testing::StatusIs;
using ::testing::HasSubstr;

const std::string kModels = CKPT_HF_TESTDATA;
constexpr uint64_t kBucket = 3000;  // Small enough that DP 3 cuts through tensors.

// A tensor's bits by name: what the source holds (BF16 or F32 bits widened into uint32).
using Values = std::map<std::string, std::vector<float>>;

class LoadModelTest : public ::testing::Test {
 protected:
  LoadModelTest() : mem_(NewMemEnv()), env_(mem_.get()) {}

  // Copies the files of directory `from` on disk into `to` in the MemEnv.
  void CopyIn(const std::string& from, const std::string& to) {
    ASSERT_THAT(mem_->CreateDir(to), IsOk());
    for (const auto& entry : std::filesystem::directory_iterator(from)) {
      std::ifstream in(entry.path(), std::ios::binary);
      std::stringstream bytes;
      bytes << in.rdbuf();
      auto file = mem_->NewWritableFile(absl::StrCat(to, "/", entry.path().filename().string()),
                                        FileOptions{});
      ASSERT_THAT(file, IsOk());
      ASSERT_THAT((*file)->Append(AsBytes(bytes.str())), IsOk());
      ASSERT_THAT((*file)->Close(), IsOk());
    }
  }
  // The model's parameters as a trainer declares them: every tensor of the file, BF16, vectors
  // without weight decay (group 1).
  static std::vector<ParamSpec> ParamsOf(const HfCheckpointReader& hf) {
    std::vector<ParamSpec> out;
    for (const HfTensor& t : hf.tensors()) {
      out.push_back({t.name, t.shape, DType::kBF16, t.shape.size() == 1 ? 1u : 0u});
    }
    return out;
  }
  static Values ValuesOf(const HfCheckpointReader& hf) {
    Values out;
    for (const HfTensor& t : hf.tensors()) {
      std::vector<float>& v = out[t.name];
      v.resize(t.numel);
      EXPECT_THAT(hf.ReadAsF32(t.name, 0, t.numel, v), IsOk());
    }
    return out;
  }
  // After a model load: the masters bit for bit `values` (param -> source tensor via `source`),
  // weights the masters rounded, moments zero, every group's step 0 and its lr `lrs`.
  static void ExpectLoaded(Job& job, const std::vector<ParamSpec>& params, const Values& values,
                           const std::map<std::string, std::string>& source,
                           const std::vector<double>& lrs) {
    for (int r = 0; r < job.size(); ++r) {
      const StagedAdamW& opt = *job.rank(r).opt;
      uint64_t at = 0, mismatches = 0;
      for (const Piece& p : opt.options().pieces) {
        const std::string& name = params[p.param].name;
        const std::vector<float>& v = values.at(source.count(name) ? source.at(name) : name);
        for (uint64_t i = 0; i < p.count; ++i, ++at) {
          const float want = v[p.begin + i];
          mismatches += formats::FloatBits(opt.master()[at]) != formats::FloatBits(want) ||
                        job.rank(r).weights[at] != formats::FloatToBf16(want);
        }
      }
      EXPECT_EQ(mismatches, 0u) << "rank " << r;
      for (std::span<const std::byte> m : {opt.exp_avg_bytes(), opt.exp_avg_sq_bytes()}) {
        EXPECT_EQ(std::count(m.begin(), m.end(), std::byte{0}), static_cast<ptrdiff_t>(m.size()))
            << "rank " << r << ": moments not zero";
      }
      ASSERT_EQ(opt.groups().size(), lrs.size());
      for (size_t g = 0; g < lrs.size(); ++g) {
        EXPECT_EQ(opt.groups()[g].step, 0u);
        EXPECT_EQ(opt.groups()[g].lr, lrs[g]) << "the learning rate changed";
      }
    }
  }
  static std::vector<double> Lrs(Job& job) {
    std::vector<double> out;
    for (const ParamGroup& g : job.rank(0).opt->groups()) out.push_back(g.lr);
    return out;
  }
  static std::vector<absl::StatusOr<ModelLoadReport>> LoadModel(
      Job& job, const std::string& source, const ModelLoadOptions& options = {}) {
    std::vector<absl::StatusOr<ModelLoadReport>> out(job.size());
    std::vector<absl::Status> st = job.OnEveryRank([&](int r) {
      out[r] = job.rank(r).ckpt->LoadModel(source, options);
      if (!out[r].ok()) return out[r].status();
      return job.WriteWeights(r);
    });
    return out;
  }
  static std::vector<absl::Status> Statuses(
      const std::vector<absl::StatusOr<ModelLoadReport>>& reports) {
    std::vector<absl::Status> out;
    for (const auto& r : reports) out.push_back(r.status());
    return out;
  }

  std::unique_ptr<Env> mem_;
  testing::FaultInjectionEnv env_;
};

struct ModelCase {
  const char* model;
  int dp;
};

class LoadModelFromTinyModelsTest : public LoadModelTest,
                                    public ::testing::WithParamInterface<ModelCase> {};

TEST_P(LoadModelFromTinyModelsTest, MastersAreTheFileMomentsZeroStepsZeroAndTheNextStepIsFresh) {
  const std::string dir = kModels + "/" + GetParam().model;
  CKPT_SKIP_OR_FAIL_WITHOUT_TESTDATA(dir);
  auto hf = HfCheckpointReader::Open(dir);
  ASSERT_THAT(hf, IsOk());
  std::vector<ParamSpec> params = ParamsOf(**hf);
  const bool tied = !(*hf)->Find("lm_head.weight").ok();
  if (tied) {  // The file ties lm_head to the embeddings and omits it; this trainer unties.
    ParamSpec head = params[0];
    for (const ParamSpec& p : params)
      if (p.name == "model.embed_tokens.weight") head = p;
    head.name = "lm_head.weight";
    params.push_back(head);
  }
  const Values values = ValuesOf(**hf);
  CopyIn(dir, "/model");
  const int dp = GetParam().dp;
  Job job(&env_, dp, kBucket, params);
  for (int s = 0; s < 3; ++s) job.Step(s);
  const std::vector<double> lrs = Lrs(job);
  auto reports = LoadModel(job, "/model");
  ExpectAllOk(Statuses(reports));
  EXPECT_TRUE(reports[0]->hf);
  EXPECT_EQ(reports[0]->tensors, params.size());
  EXPECT_EQ(reports[0]->tied,
            tied ? std::vector<std::string>{"lm_head.weight"} : std::vector<std::string>{});
  std::map<std::string, std::string> source;
  if (tied) source["lm_head.weight"] = "model.embed_tokens.weight";
  ExpectLoaded(job, params, values, source, lrs);

  // A fresh optimizer made from the file's weights steps to the same bits.
  Job fresh(&env_, dp, kBucket, params, MomentDType::kF32, {}, "/fresh",
            [&](uint32_t p, uint64_t i) {
              const std::string& name = params[p].name;
              return formats::FloatToBf16(
                  values.at(source.count(name) ? source.at(name) : name)[i]);
            });
  for (int s = 3; s < 6; ++s) {
    job.Step(s);
    fresh.Step(s);
    ASSERT_TRUE(job.Gather() == fresh.Gather()) << "after step " << s;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Models, LoadModelFromTinyModelsTest,
    ::testing::Values(ModelCase{"qwen3-tiny", 1}, ModelCase{"qwen3-tiny", 3},
                      ModelCase{"qwen3-moe-tiny", 1}, ModelCase{"qwen3-moe-tiny", 3},
                      ModelCase{"llama-tied-tiny", 1}, ModelCase{"llama-tied-tiny", 3}),
    [](const auto& i) {
      std::string name = absl::StrCat(i.param.model, "_dp", i.param.dp);
      std::replace(name.begin(), name.end(), '-', '_');
      return name;
    });

// Toy-model values that BF16 cannot hold, as F32 safetensors under `names`.
Values WriteF32Model(Env* env, const std::string& dir, const std::vector<ParamSpec>& params,
                     const std::vector<std::string>& names) {
  Values values;
  std::vector<HfTensorData> tensors;
  for (size_t p = 0; p < params.size(); ++p) {
    std::vector<float>& v = values[names[p]];
    for (uint64_t i = 0; i < params[p].numel(); ++i) {
      v.push_back(testing::ToyInitialValue(static_cast<uint32_t>(p), i) * 1.0001f + 1e-7f);
    }
    tensors.push_back({names[p], StDType::kF32, params[p].shape, std::as_bytes(std::span(v))});
  }
  EXPECT_THAT(WriteHfCheckpoint(dir, tensors, {.env = env}), IsOk());
  return values;
}

std::vector<std::string> NamesOf(const std::vector<ParamSpec>& params) {
  std::vector<std::string> out;
  for (const ParamSpec& p : params) out.push_back(p.name);
  return out;
}

TEST_F(LoadModelTest, F32SourceGivesBitExactMastersAndErasesTheHistory) {
  const std::vector<ParamSpec> params = testing::ToyModel();
  const Values values = WriteF32Model(mem_.get(), "/f32", params, NamesOf(params));
  Job job(&env_, 3, 500, params);
  for (int s = 0; s < 4; ++s) job.Step(s);
  const std::vector<double> lrs = Lrs(job);
  ExpectAllOk(Statuses(LoadModel(job, "/f32/model.safetensors")));
  ExpectLoaded(job, params, values, {}, lrs);
  // A job that never stepped, loaded from the same file, is the same from here on.
  Job fresh(&env_, 2, 700, params, MomentDType::kF32, {}, "/fresh");
  ExpectAllOk(Statuses(LoadModel(fresh, "/f32")));
  for (int s = 4; s < 7; ++s) {
    job.Step(s);
    fresh.Step(s);
    ASSERT_TRUE(job.Gather() == fresh.Gather()) << "after step " << s;
  }
}

TEST_F(LoadModelTest, BF16MomentModeZeroesItsMoments) {
  const std::vector<ParamSpec> params = testing::ToyModel();
  const Values values = WriteF32Model(mem_.get(), "/f32", params, NamesOf(params));
  Job job(&env_, 2, 500, params, MomentDType::kBF16);
  job.Step(0);
  const std::vector<double> lrs = Lrs(job);
  ExpectAllOk(Statuses(LoadModel(job, "/f32")));
  ExpectLoaded(job, params, values, {}, lrs);
}

TEST_F(LoadModelTest, FromCkptStepsOfThisStoreAndOfAnotherRoot) {
  const std::vector<ParamSpec> params = testing::ToyModel();
  Job saver(&env_, 2, 500, params);
  for (int s = 0; s < 3; ++s) saver.Step(s);
  ExpectAllOk(saver.Save(3));
  // The step's model tensors are its BF16 weights.
  Values values;
  for (int r = 0; r < saver.size(); ++r) {
    uint64_t at = 0;
    for (const Piece& p : saver.rank(r).opt->options().pieces) {
      std::vector<float>& v = values[params[p.param].name];
      v.resize(params[p.param].numel());
      for (uint64_t i = 0; i < p.count; ++i, ++at)
        v[p.begin + i] = formats::Bf16ToFloat(saver.rank(r).weights[at]);
    }
  }
  saver.Step(3);
  saver.Step(4);
  const std::vector<double> lrs = Lrs(saver);
  // This store: its LATEST, from the Checkpointer's own handle ("").
  auto own = LoadModel(saver, "");
  ExpectAllOk(Statuses(own));
  EXPECT_FALSE(own[0]->hf);
  EXPECT_EQ(own[0]->step, 3u);
  ExpectLoaded(saver, params, values, {}, lrs);
  // Another root, read-only, at another DP size and a step named.
  Job other(&env_, 3, 900, params, MomentDType::kF32, {}, "/other");
  other.Step(0);
  ExpectAllOk(Statuses(LoadModel(other, kRoot, {.step = 3})));
  ExpectLoaded(other, params, values, {}, Lrs(other));
  for (int s = 5; s < 7; ++s) {
    saver.Step(s);
    other.Step(s);
    ASSERT_TRUE(saver.Gather() == other.Gather()) << "after step " << s;
  }
}

TEST_F(LoadModelTest, RenameRulesMapMegatronNamesAndTiedWeightsFillIn) {
  std::vector<ParamSpec> params = testing::ToyModel();
  params.push_back({"head", params[0].shape, DType::kBF16, 0});
  // The file holds three of the four parameters under other names; "head" is tied to "embed".
  std::vector<ParamSpec> stored(params.begin(), params.begin() + 3);
  const Values values = WriteF32Model(mem_.get(), "/meg", stored,
                                      {"module.embedding.word", "module.layer.w", "module.layer.b"});
  Job job(&env_, 2, 500, params);
  job.Step(0);
  ModelLoadOptions o;
  o.rename = {{R"(^module\.)", ""}, {R"(^embedding\.word$)", "embed"}, {R"(\.w$)", ".weight"},
              {R"(\.b$)", ".bias"}};
  o.tied = {{"head", "embed"}};
  auto reports = LoadModel(job, "/meg", o);
  ExpectAllOk(Statuses(reports));
  EXPECT_EQ(reports[0]->tied, std::vector<std::string>{"head"});
  ExpectLoaded(job, params, values,
               {{"embed", "module.embedding.word"},
                {"layer.weight", "module.layer.w"},
                {"layer.bias", "module.layer.b"},
                {"head", "module.embedding.word"}},
               Lrs(job));
}

TEST_F(LoadModelTest, PreflightRefusalsListTheNamesAndTouchNothing) {
  const std::vector<ParamSpec> params = testing::ToyModel();
  Job job(&env_, 2, 500, params);
  job.Step(0);
  ExpectAllOk(job.Save(1));
  job.Step(1);
  // 12 extra tensors and one parameter missing.
  std::vector<ParamSpec> extra(params.begin(), params.begin() + 2);
  std::vector<std::string> names = {"embed", "layer.weight"};
  for (int i = 0; i < 12; ++i) {
    extra.push_back({absl::StrCat("extra.", i), {4}, DType::kF32, 0});
    names.push_back(absl::StrCat("extra.", i));
  }
  WriteF32Model(mem_.get(), "/extra", extra, names);
  std::vector<ParamSpec> reshaped = params;
  reshaped[1].shape = {3002};
  WriteF32Model(mem_.get(), "/reshaped", reshaped, NamesOf(params));
  {
    const int32_t ints[4] = {1, 2, 3, 4};
    ASSERT_THAT(WriteHfCheckpoint("/ints",
                                  {{"embed", StDType::kI32, {4}, std::as_bytes(std::span(ints))}},
                                  {.env = mem_.get()}),
                IsOk());
  }
  WriteF32Model(mem_.get(), "/good", params, NamesOf(params));
  struct Refusal {
    std::string source;
    ModelLoadOptions options;
    std::vector<std::string> says;
  };
  const std::vector<Refusal> refusals = {
      {"/extra", {}, {"missing 1: layer.bias", "unexpected 12: extra.0, extra.1", "and 2 more"}},
      {"/reshaped", {}, {"\"layer.weight\" is F32 [3002]", "needs [3001]"}},
      {"/good", {.rename = {{"(", "x"}}}, {"rename rule \"(\""}},
      {"/good", {.rename = {{"a", "\\3"}}}, {"rename rule \"a\""}},
      {"/good", {.rename = {{".*", "same"}}}, {"are both renamed to \"same\""}},
      {"/good", {.step = 1}, {"has no step 1"}},
      {"/nowhere", {}, {"/nowhere"}},
      {"/", {}, {"neither model.safetensors"}},
      {"", {.step = 9}, {"step"}},
  };
  for (const Refusal& r : refusals) {
    const std::string before = job.Gather();
    const std::vector<std::string> entries = test_job::RootEntries(mem_.get());
    std::vector<absl::Status> st = Statuses(LoadModel(job, r.source, r.options));
    for (size_t i = 0; i < st.size(); ++i) {
      EXPECT_FALSE(st[i].ok()) << r.source;
      for (const std::string& s : r.says) {
        EXPECT_THAT(st[i].message(), HasSubstr(s)) << r.source;
      }
    }
    EXPECT_TRUE(job.Gather() == before) << r.source;
    EXPECT_EQ(test_job::RootEntries(mem_.get()), entries)
        << "a refused model load wrote something: " << r.source;
    EXPECT_EQ(job.rank(0).opt->lifecycle(), Lifecycle::kClean);
  }
  // With ignore_unexpected the extras are counted, and the missing name still refuses.
  ModelLoadOptions ignore{.ignore_unexpected = true};
  std::vector<absl::Status> st = Statuses(LoadModel(job, "/extra", ignore));
  EXPECT_THAT(st[0], StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(st[0].message(), ::testing::Not(HasSubstr("unexpected")));
}

TEST_F(LoadModelTest, UnexpectedNamesAreIgnoredWhenAsked) {
  std::vector<ParamSpec> params = testing::ToyModel();
  std::vector<ParamSpec> stored = params;
  stored.push_back({"rotary.inv_freq", {8}, DType::kF32, 0});
  std::vector<std::string> names = NamesOf(params);
  names.push_back("rotary.inv_freq");
  const Values values = WriteF32Model(mem_.get(), "/m", stored, names);
  Job job(&env_, 2, 500, params);
  job.Step(0);
  ExpectAll(Statuses(LoadModel(job, "/m")), absl::StatusCode::kInvalidArgument);
  auto reports = LoadModel(job, "/m", {.ignore_unexpected = true});
  ExpectAllOk(Statuses(reports));
  EXPECT_EQ(reports[0]->ignored, 1u);
  ExpectLoaded(job, params, values, {}, Lrs(job));
}

// A failure at every Env call of a model load, from safetensors (open failures; write failures
// of the spill) and from a ckpt step with a damaged chunk (the apply fails; then open failures
// reach the rollback): every rank loads, or is exactly as before, or is poisoned.
TEST_F(LoadModelTest, EveryFailedCallRestoresOrPoisons) {
  const std::vector<ParamSpec> params = testing::ToyModel();
  WriteF32Model(mem_.get(), "/f32", params, NamesOf(params));
  std::string loaded;
  {
    Job job(&env_, 2, 300, params);
    job.Step(0);
    ExpectAllOk(job.Save(1));
    job.Step(1);  // The hyper-parameters of step 1 stay through the model load.
    ExpectAllOk(Statuses(LoadModel(job, "/f32")));
    loaded = job.Gather();
  }
  int failures = 0, poisonings = 0;
  for (int kind = 0; kind < 3; ++kind) {
    if (kind == 2) {
      // Flip a byte of step 1's first chunk of rank 1: a model load from it fails in the apply.
      const std::string path = absl::StrCat(kRoot, "/", StepDirectoryName(1), "/rank-00001.data");
      auto bytes = ReadFileToString(mem_.get(), path, UINT64_MAX);
      ASSERT_THAT(bytes, IsOk());
      (*bytes)[4096 + 100] ^= 0x10;
      ASSERT_THAT(mem_->RemoveFile(path), IsOk());
      auto file = mem_->NewWritableFile(path, FileOptions{});
      ASSERT_THAT(file, IsOk());
      ASSERT_THAT((*file)->Append(std::as_bytes(std::span(*bytes))), IsOk());
      ASSERT_THAT((*file)->Close(), IsOk());
    }
    for (int k = 0;; ++k) {
      Job job(&env_, 2, 300, params);
      job.Step(0);
      job.Step(1);  // Dirty: the undo source is a spill.
      const std::string before = job.Gather();
      const bool failed = test_job::LoadUnderFault(
          env_, job,
          [&] { return Statuses(LoadModel(job, kind == 2 ? std::string() : "/f32")); },
          [&] {
            if (kind != 1) env_.FailReadOpens("", EIO, k);
            if (kind == 1) env_.FailNth(static_cast<uint64_t>(k) + 1, EIO);
          },
          before, kind == 2 ? std::string() : loaded);
      const bool poisoned = job.rank(0).opt->lifecycle() == Lifecycle::kPoisoned ||
                            job.rank(1).opt->lifecycle() == Lifecycle::kPoisoned;
      failures += failed;
      poisonings += poisoned;
      if (kind == 2) {
        EXPECT_TRUE(failed) << "a load of a damaged step succeeded";
      }
      if (poisoned && kind != 2) {
        ExpectAllOk(Statuses(LoadModel(job, "/f32")));  // A complete load clears the poison.
        EXPECT_TRUE(job.Gather() == loaded);
      }
      if (!failed || (kind == 2 && !poisoned && k > 40)) break;
      ASSERT_LT(k, 500) << "the load never got through";
    }
  }
  std::printf("%d injected failures failed the model load, %d of them poisoned\n", failures,
              poisonings);
  EXPECT_GT(failures, 10);
  EXPECT_GT(poisonings, 0) << "no failure reached the rollback";
}

TEST_F(LoadModelTest, RefusedWhileAnAsyncSaveIsInFlight) {
  const std::vector<ParamSpec> params = testing::ToyModel();
  WriteF32Model(mem_.get(), "/f32", params, NamesOf(params));
  Job job(&env_, 1, 500, params);
  job.Step(0);
  auto handles = job.SaveAsync(1);
  ASSERT_NE(handles[0], nullptr);
  const absl::Status refused = job.rank(0).ckpt->LoadModel("/f32").status();
  EXPECT_THAT(refused, StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(refused.message(), HasSubstr("in flight"));
  ExpectAllOk(job.Finalize(handles));
  EXPECT_THAT(job.rank(0).ckpt->LoadModel("/f32").status(), IsOk());
}

}  // namespace
}  // namespace ckpt::optimizer
