// ckpt-tool end to end: bench io writes a real store, inspect and verify read it, damage is
// reported with exit code 1, gc deletes old steps, and SIGKILL at random moments never leaves a
// store that fails to open and verify.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <random>
#include <thread>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "ckpt/base/coding.h"
#include "ckpt/base/status_macros.h"
#include "ckpt/checkpoint_store.h"
#include "ckpt/coordinator.h"
#include "ckpt/formats/float_convert.h"
#include "ckpt/hf_checkpoint.h"
#include "ckpt/optimizer/checkpointer.h"
#include "ckpt/verify.h"
#include "tests/support/run_command.h"
#include "tests/support/status_matchers.h"
#include "tests/support/temp_dir.h"
#include "tests/support/testdata.h"

namespace ckpt {
namespace {

using ::testing::HasSubstr;

using Result = testing::CommandResult;

Result RunTool(const std::string& args) {
  return testing::RunCommand(std::string(CKPT_TOOL_PATH) + " " + args);
}

class CliTest : public ::testing::Test {
 protected:
  std::string Root() { return tmp_.path() + "/ckpt-bench"; }
  testing::ScopedTempDir tmp_;
};

TEST_F(CliTest, BenchInspectVerifyAndGcWorkEndToEnd) {
  for (int i = 0; i < 3; ++i) {
    Result bench = RunTool("bench io --dir " + tmp_.path() + " --size 8M --ranks 2 --keep --json");
    ASSERT_EQ(bench.exit_code, 0) << bench.output;
    nlohmann::json j = nlohmann::json::parse(bench.output);
    EXPECT_EQ(j["step"].get<uint64_t>(), static_cast<uint64_t>(i + 1));
    EXPECT_GT(j["save_gbps"].get<double>(), 0);
    EXPECT_GT(j["write_bound_gbps"].get<double>(), 0);
    EXPECT_TRUE(j.contains("load_ratio"));
  }
  Result inspect = RunTool("inspect " + Root() + " --json");
  ASSERT_EQ(inspect.exit_code, 0) << inspect.output;
  nlohmann::json j = nlohmann::json::parse(inspect.output);
  EXPECT_EQ(j["latest"].get<uint64_t>(), 3u);
  EXPECT_EQ(j["steps"].size(), 3u);
  EXPECT_EQ(j["details"]["files"].size(), 2u);
  EXPECT_EQ(j["details"]["tensors"][0]["bytes"].get<uint64_t>(), 8u << 20);
  Result human = RunTool("inspect " + Root());
  EXPECT_THAT(human.output, HasSubstr("<- LATEST"));

  Result verify = RunTool("verify " + Root() + " --all");
  EXPECT_EQ(verify.exit_code, 0) << verify.output;

  Result gc = RunTool("gc " + Root() + " --keep-last 1 --json");
  ASSERT_EQ(gc.exit_code, 0) << gc.output;
  EXPECT_EQ(nlohmann::json::parse(gc.output)["deleted"], nlohmann::json({1, 2}));
}

TEST_F(CliTest, VerifyNamesDamagedFileChunkAndOffsetWithExitOne) {
  ASSERT_EQ(RunTool("bench io --dir " + tmp_.path() + " --size 1M --keep --json").exit_code, 0);
  const std::string data = Root() + "/step-00000001/rank-00000.data";
  FILE* f = std::fopen(data.c_str(), "r+b");
  ASSERT_NE(f, nullptr);
  std::fseek(f, 4096 + 100, SEEK_SET);  // Inside chunk 0's payload.
  int c = std::fgetc(f);
  std::fseek(f, 4096 + 100, SEEK_SET);
  std::fputc(c ^ 0x04, f);
  std::fclose(f);
  Result verify = RunTool("verify " + Root());
  EXPECT_EQ(verify.exit_code, 1) << verify.output;
  EXPECT_THAT(verify.output, HasSubstr("rank-00000.data chunk 0 offset 4096"));
  Result json = RunTool("verify " + Root() + " --json");
  EXPECT_EQ(json.exit_code, 1);
  EXPECT_FALSE(nlohmann::json::parse(json.output)["ok"].get<bool>());
}

TEST_F(CliTest, HfPathsInspectVerifyAndReshard) {
  const std::string qwen = std::string(CKPT_HF_TESTDATA) + "/qwen3-tiny";
  CKPT_SKIP_OR_FAIL_WITHOUT_TESTDATA(qwen);
  Result inspect = RunTool("inspect " + qwen + " --json");
  ASSERT_EQ(inspect.exit_code, 0) << inspect.output;
  nlohmann::json j = nlohmann::json::parse(inspect.output);
  EXPECT_EQ(j["tensors"].size(), 25u);
  EXPECT_TRUE(j["sharded"].get<bool>());
  EXPECT_EQ(j["tensors"][0]["shard"], "model-00003-of-00003.safetensors");  // lm_head.weight
  EXPECT_EQ(RunTool("verify " + qwen).exit_code, 0);
  const std::string out = tmp_.path() + "/resharded";
  Result reshard = RunTool("hf-reshard " + qwen + " " + out + " --max-shard-size 200K --json");
  ASSERT_EQ(reshard.exit_code, 0) << reshard.output;
  EXPECT_EQ(nlohmann::json::parse(reshard.output)["files"].get<int>(), 3);
  EXPECT_EQ(RunTool("verify " + out).exit_code, 0);
  // Damage: cut a shard short. verify names the file and the rule, exit 1.
  const std::string shard = out + "/model-00002-of-00003.safetensors";
  ASSERT_EQ(::truncate(shard.c_str(), 5000), 0);
  Result bad = RunTool("verify " + out);
  EXPECT_EQ(bad.exit_code, 1) << bad.output;
  EXPECT_THAT(bad.output, HasSubstr("model-00002-of-00003.safetensors: MetadataIncompleteBuffer"));
  EXPECT_EQ(RunTool("inspect " + out).exit_code, 1);
}

TEST_F(CliTest, BenchSafetensorsReportsPairedBoundAndRemovesItsFiles) {
  Result r = RunTool("bench safetensors --dir " + tmp_.path() +
                     " --size 8M --tensors 8 --rounds 3 --threads 2 --json");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  nlohmann::json j = nlohmann::json::parse(r.output);
  // 8 BF16 tensors of 512 Ki elements plus the header.
  EXPECT_GT(j["file_bytes"].get<uint64_t>(), uint64_t{8} << 20);
  EXPECT_EQ(j["f32_output_bytes"].get<uint64_t>(), uint64_t{16} << 20);
  ASSERT_EQ(j["rounds"].size(), 3u);
  for (const auto& round : j["rounds"]) {
    EXPECT_GT(round["read_to_f32_gbps"].get<double>(), 0);
    EXPECT_GT(round["read_bound_gbps"].get<double>(), 0);
  }
  EXPECT_DOUBLE_EQ(j["ratio"].get<double>(),
                   j["read_to_f32_gbps"].get<double>() / j["read_bound_gbps"].get<double>());
  Result ls = testing::RunCommand("ls -A " + tmp_.path());
  EXPECT_EQ(ls.output, "") << "benchmark files left behind";
}

TEST_F(CliTest, BenchAdamwCpuReportsRateBoundAndRatio) {
  Result r = RunTool("bench adamw --params 100000 --engine cpu --threads 2 --steps 2 --json");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  nlohmann::json cpu = nlohmann::json::parse(r.output)["cpu"];
  EXPECT_GT(cpu["gparams_per_s"].get<double>(), 0);
  EXPECT_GT(cpu["bound_gparams_per_s"].get<double>(), 0);
  EXPECT_DOUBLE_EQ(cpu["ratio"].get<double>(),
                   cpu["gparams_per_s"].get<double>() / cpu["bound_gparams_per_s"].get<double>());
  EXPECT_EQ(cpu["device_bytes"].get<uint64_t>(), 0u);
  EXPECT_EQ(RunTool("bench adamw --params 0").exit_code, 2);  // A usage error.
}

TEST_F(CliTest, BenchOverlapHidesTheStepBehindTheBackwardAndReportsItsBound) {
  const std::string common =
      "bench overlap --params 400000 --buckets 8 --backward-ms 16 --unit-bytes 65536 --threads 2 "
      "--steps 1 --json";
  Result r = RunTool(common);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  nlohmann::json j = nlohmann::json::parse(r.output);
  // Units of 16384 parameters finish during the backward and the speculation holds.
  EXPECT_GT(j["speculated_units"].get<uint64_t>(), 0u);
  EXPECT_TRUE(j["speculation_held"].get<bool>());
  const double backward = j["backward_seconds"].get<double>();
  const double step_bound = j["step_bound_seconds"].get<double>();
  EXPECT_GE(backward, 0.016);
  EXPECT_DOUBLE_EQ(step_bound, 400000 * 30.0 / (j["bound_gbps"].get<double>() * 1e9));
  EXPECT_DOUBLE_EQ(j["bound_seconds"].get<double>(),
                   std::max(backward + step_bound / 8, backward / 8 + step_bound));
  EXPECT_DOUBLE_EQ(j["exposed_seconds"].get<double>(),
                   j["overlap_seconds"].get<double>() - backward);
  EXPECT_DOUBLE_EQ(j["ratio"].get<double>(),
                   j["overlap_seconds"].get<double>() / j["bound_seconds"].get<double>());
  // The host time inside Release: one call per layer, part of the overlapped step.
  EXPECT_EQ(j["release_calls"].get<int>(), 8);
  EXPECT_GT(j["release_seconds"].get<double>(), 0);
  EXPECT_LT(j["release_seconds"].get<double>(), j["overlap_seconds"].get<double>());

  // Clipping that fires: the speculation is redone, and BF16 moments count 8 fewer bytes.
  Result clip = RunTool(common + " --clip-fires --moments BF16");
  ASSERT_EQ(clip.exit_code, 0) << clip.output;
  nlohmann::json c = nlohmann::json::parse(clip.output);
  EXPECT_FALSE(c["speculation_held"].get<bool>());
  EXPECT_DOUBLE_EQ(c["bytes_per_param"].get<double>(), 22.0);

  EXPECT_EQ(RunTool("bench overlap --params 3 --buckets 4").exit_code, 2);
  EXPECT_EQ(RunTool("bench overlap --params 100 --backward-ms 0").exit_code, 2);
  // Without a device (or CUDA), the CUDA engine says why and fails.
  Result cuda = RunTool("bench overlap --params 1000 --engine cuda --steps 1");
  if (cuda.exit_code != 0) {
    EXPECT_THAT(cuda.output, HasSubstr("CUDA"));
  }
}

TEST_F(CliTest, BenchMuonReportsTheStepAgainstTheProductsAndMemoryBounds) {
  Result r = RunTool("bench muon --rows 48 --cols 80 --matrices 3 --threads 2 --steps 1 --json");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  nlohmann::json j = nlohmann::json::parse(r.output);
  // Five iterations of X X^T (2 m m n), b G + c G G (2 m^3) and a X + H X (2 m m n), m = 48.
  EXPECT_DOUBLE_EQ(j["flops_per_matrix"].get<double>(),
                   5 * (2.0 * 48 * 48 * 80 + 2.0 * 48 * 48 * 48 + 2.0 * 48 * 48 * 80));
  EXPECT_DOUBLE_EQ(j["state_bytes"].get<double>(), 22.0 * 48 * 80 * 3);
  EXPECT_DOUBLE_EQ(j["bound_seconds"].get<double>(),
                   std::max(j["gemm_seconds"].get<double>(), j["memory_seconds"].get<double>()));
  EXPECT_DOUBLE_EQ(j["ratio"].get<double>(),
                   j["bound_seconds"].get<double>() / j["step_seconds"].get<double>());
  EXPECT_DOUBLE_EQ(j["matrices_per_s"].get<double>(), 3 / j["step_seconds"].get<double>());
  EXPECT_EQ(RunTool("bench muon --rows 0").exit_code, 2);
  // On the CUDA engine, PCIe bounds the state (8 bytes each way per element); without a device
  // (or CUDA) it says why and fails.
  Result cuda = RunTool("bench muon --rows 40 --cols 24 --matrices 2 --steps 1 --engine cuda --json");
  if (cuda.exit_code != 0) {
    EXPECT_THAT(cuda.output, HasSubstr("CUDA"));
    return;
  }
  nlohmann::json c = nlohmann::json::parse(cuda.output);
  EXPECT_DOUBLE_EQ(c["state_bytes"].get<double>(), 8.0 * 40 * 24 * 2);
  EXPECT_DOUBLE_EQ(c["memory_seconds"].get<double>(),
                   c["state_bytes"].get<double>() / (c["pcie_gbps"].get<double>() * 1e9));
  EXPECT_DOUBLE_EQ(c["bound_seconds"].get<double>(),
                   std::max(c["gemm_seconds"].get<double>(), c["memory_seconds"].get<double>()));
}

TEST_F(CliTest, BenchAdamwCountsTheBytesOfEachStateLayout) {
  // FP32 gradients: 30 bytes per parameter with FP32 moments, 22 with BF16 ones; 16-bit
  // gradients 2 fewer. The bound is the triad bandwidth over exactly those bytes.
  for (auto [flags, bytes] : {std::pair{"", 30.0}, std::pair{" --moments BF16", 22.0},
                              std::pair{" --grad-dtype BF16 --moments BF16", 20.0}}) {
    SCOPED_TRACE(flags);
    Result r =
        RunTool(std::string("bench adamw --params 50000 --threads 2 --steps 1 --json") + flags);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    nlohmann::json cpu = nlohmann::json::parse(r.output)["cpu"];
    EXPECT_DOUBLE_EQ(cpu["bytes_per_param"].get<double>(), bytes);
    EXPECT_DOUBLE_EQ(cpu["bound_gparams_per_s"].get<double>(),
                     cpu["triad_gbps"].get<double>() / bytes);
    EXPECT_GT(cpu["step_shaped_bound_gparams_per_s"].get<double>(), 0);
  }
  EXPECT_EQ(RunTool("bench adamw --params 1000 --moments F16").exit_code, 2);
  Result checked =
      RunTool("bench adamw --params 50000 --threads 2 --steps 1 --check-finite --json");
  ASSERT_EQ(checked.exit_code, 0) << checked.output;
  EXPECT_TRUE(nlohmann::json::parse(checked.output)["cpu"]["check_finite"].get<bool>());
}

TEST_F(CliTest, InspectShowsTheOptimizerRecordOfAStep) {
  using optimizer::ParamGroup;
  optimizer::StagedAdamWOptions o;
  o.params = {{"w", {1000}, formats::DType::kF32, 0},
              {"b", {10}, formats::DType::kF32, 0},
              {"c", {10}, formats::DType::kF32, 1}};
  o.groups = {ParamGroup{.lr = 2.5e-4, .weight_decay = 0.1}, ParamGroup{.lr = 1e-3}};
  o.pieces = {{0, 0, 1000}, {1, 0, 10}, {2, 0, 10}};
  o.moment_dtype = optimizer::MomentDType::kBF16;
  std::vector<float> weights(1020, 0.25f), grads(1020, 0.5f);
  auto opt = optimizer::StagedAdamW::Create(o, std::as_bytes(std::span(weights)));
  ASSERT_THAT(opt, testing::IsOk());
  ASSERT_THAT((*opt)->Step({grads.data(), formats::DType::kF32, 1.0f, weights.data()}),
              testing::IsOk());
  // "b" has no gradient in the second step: one step behind its group.
  optimizer::StepArgs skip_b{grads.data(), formats::DType::kF32, 1.0f, weights.data()};
  const std::vector<uint8_t> stepped = {1, 0, 1};
  skip_b.stepped = stepped;
  ASSERT_THAT((*opt)->Step(skip_b), testing::IsOk());
  auto store = CheckpointStore::Open(Root(), StoreOptions{});
  ASSERT_THAT(store, testing::IsOk());
  SingleProcessCoordinator single;
  auto ckpt = optimizer::Checkpointer::Create(opt->get(), store->get(), &single);
  ASSERT_THAT(ckpt, testing::IsOk());
  ASSERT_THAT((*ckpt)->Save(7), testing::IsOk());
  Result r = RunTool("inspect " + Root() + " --json");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  nlohmann::json j = nlohmann::json::parse(r.output);
  const nlohmann::json& rec = j["details"]["optimizer"];
  EXPECT_EQ(rec["moment_dtype"], "BF16");
  EXPECT_EQ(rec["kind"], "adamw");
  EXPECT_EQ(rec["world_size"], 1);
  EXPECT_EQ(rec["params"], 3);
  EXPECT_EQ(rec["elements"], 1020);
  EXPECT_EQ(rec["groups"][0]["lr"].get<double>(), 2.5e-4);
  EXPECT_EQ(rec["groups"][0]["step"], 2);
  EXPECT_EQ(rec["param_steps"], nlohmann::json({{"b", 1}}));
  Result human = RunTool("inspect " + Root());
  EXPECT_THAT(human.output, HasSubstr("optimizer: adamw, 3 parameters (1020 elements), moments BF16"));
  EXPECT_THAT(human.output, HasSubstr("1 parameter(s) at a step count below their group's: b (1)"));
}

TEST_F(CliTest, BenchCkptReportsSaveAndBothLoadsAgainstTheirBounds) {
  Result r = RunTool("bench ckpt --dir " + tmp_.path() + " --params 300000 --ranks 2 --json");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  nlohmann::json j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j["state_bytes"].get<uint64_t>(), 300000u * 14);
  for (const char* key : {"save_gbps", "write_bound_gbps", "load_gbps", "load_spill_gbps",
                          "read_bound_gbps", "save_ratio", "load_ratio", "load_spill_ratio"}) {
    EXPECT_GT(j[key].get<double>(), 0) << key;
  }
  EXPECT_FALSE(std::filesystem::exists(tmp_.path() + "/ckpt-bench-optimizer"))
      << "the benchmark's store is removed";
  EXPECT_EQ(RunTool("bench ckpt --dir " + tmp_.path() + " --params 0").exit_code, 2);
  // Seven parameters over two ranks: the middle one is cut between them.
  r = RunTool("bench ckpt --dir " + tmp_.path() + " --params 300001 --ranks 2 --tensors 7 --json");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j["tensors"].get<uint64_t>(), 7u);
  EXPECT_EQ(j["state_bytes"].get<uint64_t>(), 300001u * 14);
  EXPECT_GT(j["load_fresh_gbps"].get<double>(), 0);
  EXPECT_NE(RunTool("bench ckpt --dir " + tmp_.path() + " --params 5 --tensors 6").exit_code, 0);
}

TEST_F(CliTest, BenchAsyncSaveReportsReturnStepsAndDurabilityAgainstTheirBounds) {
  Result r = RunTool("bench async-save --dir " + tmp_.path() + " --params 300000 --json");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  nlohmann::json j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j["state_bytes"].get<uint64_t>(), 300000u * 14);
  for (const char* key : {"return_ms", "step_ms", "step_during_save_ms", "step_ratio",
                          "durable_s", "sync_save_s", "durable_ratio", "write_bound_gbps",
                          "copy_bound_gbps"}) {
    EXPECT_GT(j[key].get<double>(), 0) << key;
  }
  EXPECT_GE(j["steps_during_save"].get<int>(), 1);
  EXPECT_GT(j["units"].get<uint64_t>(), 0u);
  EXPECT_FALSE(std::filesystem::exists(tmp_.path() + "/ckpt-bench-async"))
      << "the benchmark's store is removed";
  EXPECT_EQ(RunTool("bench async-save --dir " + tmp_.path() + " --params 0").exit_code, 2);
  EXPECT_EQ(RunTool("bench async-save --dir " + tmp_.path() + " --params 10 --staging lots")
                .exit_code,
            2);
  Result no_cuda = RunTool("bench async-save --dir " + tmp_.path() + " --params 10 --engine tpu");
  EXPECT_EQ(no_cuda.exit_code, 2);
}

// A ckpt root holding one committed step with tensor "w" (F32 `values`) and "ids" (I32).
void SaveStep(const std::string& root, uint64_t step, const std::vector<float>& values) {
  auto store = CheckpointStore::Open(root, StoreOptions{});
  ASSERT_THAT(store, testing::IsOk());
  auto txn = (*store)->BeginSave(step);
  ASSERT_THAT(txn, testing::IsOk());
  const int32_t ids[3] = {7, 8, 9};
  ASSERT_THAT((*txn)->DeclareTensor({"w", formats::DType::kF32, {values.size()}}),
              testing::IsOk());
  ASSERT_THAT((*txn)->DeclareTensor({"ids", formats::DType::kI32, {3}}), testing::IsOk());
  ASSERT_THAT((*txn)->WritePiece("w", 0, values.size(), std::as_bytes(std::span(values))),
              testing::IsOk());
  ASSERT_THAT((*txn)->WritePiece("ids", 0, 3, std::as_bytes(std::span(ids))), testing::IsOk());
  ASSERT_THAT((*txn)->Commit(), testing::IsOk());
}

TEST_F(CliTest, DiffComparesCkptStepsAndHfModelsTensorByTensor) {
  const std::string qwen = std::string(CKPT_HF_TESTDATA) + "/qwen3-tiny";
  const std::string llama = std::string(CKPT_HF_TESTDATA) + "/llama-tied-tiny";
  CKPT_SKIP_OR_FAIL_WITHOUT_TESTDATA(qwen);
  Result same = RunTool("diff " + qwen + " " + qwen);
  EXPECT_EQ(same.exit_code, 0) << same.output;
  EXPECT_THAT(same.output, HasSubstr("EQUAL: 25 tensor(s)"));

  Result other = RunTool("diff " + qwen + " " + llama + " --json");
  EXPECT_EQ(other.exit_code, 1) << other.output;
  nlohmann::json j = nlohmann::json::parse(other.output);
  EXPECT_FALSE(j["equal"].get<bool>());
  EXPECT_THAT(j["only_in_a"].get<std::vector<std::string>>(),
              ::testing::Contains("lm_head.weight"));
  bool saw_shape = false;
  for (const auto& t : j["tensors"]) saw_shape |= t["status"] == "shape";
  EXPECT_TRUE(saw_shape) << "the models' k/v projections differ in shape";

  // Two ckpt steps: equal; then one element off by 1e-4, which --atol 1e-3 forgives.
  const std::string root = tmp_.path() + "/diff-root";
  SaveStep(root, 1, {1, 2, 3, 4});
  SaveStep(root, 2, {1, 2, 3.0001f, 4});
  EXPECT_EQ(RunTool("diff " + root + " " + root + " --step 1 --step-b 1").exit_code, 0);
  Result off = RunTool("diff " + root + " " + root + " --step 1 --json");
  EXPECT_EQ(off.exit_code, 1) << off.output;
  nlohmann::json k = nlohmann::json::parse(off.output);
  for (const auto& t : k["tensors"]) {
    if (t["name"] == "w") {
      EXPECT_EQ(t["differing"].get<uint64_t>(), 1u);
      EXPECT_NEAR(t["max_abs"].get<double>(), 1e-4, 1e-6);
    } else {
      EXPECT_EQ(t["status"], "equal") << t;
    }
  }
  EXPECT_EQ(RunTool("diff " + root + " " + root + " --step 1 --atol 1e-3").exit_code, 0);

  // A ckpt step against a .safetensors file of the same values: equal across formats.
  const std::vector<float> w = {1, 2, 3, 4};
  const int32_t ids[3] = {7, 8, 9};
  std::vector<HfTensorData> tensors = {
      {"w", formats::StDType::kF32, {4}, std::as_bytes(std::span(w))},
      {"ids", formats::StDType::kI32, {3}, std::as_bytes(std::span(ids))}};
  ASSERT_THAT(WriteHfCheckpoint(tmp_.path() + "/hf", tensors), testing::IsOk());
  Result cross = RunTool("diff " + root + " " + tmp_.path() + "/hf --step 1");
  EXPECT_EQ(cross.exit_code, 0) << cross.output;

  // Dtypes: BF16 against F32 compares values (and says so); F64 compares values (-0 == +0);
  // sub-byte F4 compares the tensor's bytes; infinities of opposite signs differ without bound.
  const uint16_t w_bf16[4] = {formats::FloatToBf16(1), formats::FloatToBf16(2),
                              formats::FloatToBf16(3), formats::FloatToBf16(4)};
  const double zeros_a[2] = {0.0, 1.0}, zeros_b[2] = {-0.0, 1.0};
  const uint8_t f4[2] = {0x12, 0x34};
  const float inf_a[1] = {INFINITY}, inf_b[1] = {-INFINITY};
  auto write = [&](const std::string& dir, const void* bf16_or_f32, bool bf16, const void* f64,
                   const void* fp4, const void* inf) {
    std::vector<HfTensorData> t = {
        {"w", bf16 ? formats::StDType::kBF16 : formats::StDType::kF32, {4},
         {static_cast<const std::byte*>(bf16_or_f32), bf16 ? 8u : 16u}},
        {"d", formats::StDType::kF64, {2}, {static_cast<const std::byte*>(f64), 16}},
        {"q", formats::StDType::kF4, {4}, {static_cast<const std::byte*>(fp4), 2}},
        {"i", formats::StDType::kF32, {1}, {static_cast<const std::byte*>(inf), 4}}};
    ASSERT_THAT(WriteHfCheckpoint(tmp_.path() + "/" + dir, t), testing::IsOk());
  };
  write("dt-a", w.data(), false, zeros_a, f4, inf_a);
  write("dt-b", w_bf16, true, zeros_b, f4, inf_a);
  write("dt-c", w.data(), false, zeros_a, f4, inf_b);
  Result dtypes = RunTool("diff " + tmp_.path() + "/dt-a " + tmp_.path() + "/dt-b --json");
  EXPECT_EQ(dtypes.exit_code, 0) << dtypes.output;
  nlohmann::json dj = nlohmann::json::parse(dtypes.output);
  for (const auto& t : dj["tensors"]) {
    if (t["name"] == "w") {
      EXPECT_EQ(t["dtype_a"], "F32");
      EXPECT_EQ(t["dtype_b"], "BF16");
    }
    if (t["name"] == "q") {
      EXPECT_EQ(t["compared"], "bytes");
    }
  }
  Result inf = RunTool("diff " + tmp_.path() + "/dt-a " + tmp_.path() + "/dt-c --json");
  EXPECT_EQ(inf.exit_code, 1) << inf.output;
  for (const auto& t : nlohmann::json::parse(inf.output)["tensors"]) {
    if (t["name"] == "i") {
      EXPECT_EQ(t["max_abs"], "inf");
      EXPECT_EQ(t["max_rel"], "inf");
    }
  }

  // Usage: a step of an HF path, a negative tolerance, a path that is not there.
  EXPECT_EQ(RunTool("diff " + qwen + " " + qwen + " --step 1").exit_code, 2);
  EXPECT_EQ(RunTool("diff " + root + " " + root + " --atol -1").exit_code, 2);
  EXPECT_EQ(RunTool("diff " + root + " " + tmp_.path() + "/missing").exit_code, 2);
  EXPECT_EQ(RunTool("diff " + root + " " + root + " --step 9").exit_code, 2);
}

TEST_F(CliTest, UsageErrorsExitTwo) {
  EXPECT_EQ(RunTool("verify " + tmp_.path() + "/missing").exit_code, 2);
  EXPECT_EQ(RunTool("inspect").exit_code, 2);
  EXPECT_EQ(RunTool("frobnicate").exit_code, 2);
  EXPECT_EQ(RunTool("bench io --dir " + tmp_.path() + " --size lots").exit_code, 2);
}

// A job of `ranks` ranks (threads) loads the model at `hf` with LoadModel, takes a step and
// saves it as step 1 of `root`.
void SaveLoadedModel(const std::string& hf_path, const std::string& root, int ranks) {
  auto hf = HfCheckpointReader::Open(hf_path);
  ASSERT_THAT(hf, testing::IsOk());
  std::vector<optimizer::ParamSpec> params;
  for (const HfTensor& t : (*hf)->tensors()) {
    params.push_back({t.name, t.shape, formats::DType::kBF16, t.shape.size() == 1 ? 1u : 0u});
  }
  auto buckets = optimizer::BuildBuckets(params, {.bucket_elems = 30000}, ranks);
  ASSERT_THAT(buckets, testing::IsOk());
  const auto pieces = optimizer::RankPieces(*buckets, ranks);
  ThreadGroup group(ranks);
  std::vector<absl::Status> st(ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      st[r] = [&]() -> absl::Status {
        optimizer::StagedAdamWOptions o;
        o.params = params;
        o.groups = {optimizer::ParamGroup{}, optimizer::ParamGroup{.weight_decay = 0}};
        o.pieces = pieces[r];
        o.threads = 1;
        uint64_t elements = 0;
        for (const auto& p : o.pieces) elements += p.count;
        std::vector<uint16_t> weights(elements, 0);
        CKPT_ASSIGN_OR_RETURN(auto opt,
                              optimizer::StagedAdamW::Create(o, std::as_bytes(std::span(weights))));
        StoreOptions so;
        so.primary = r == 0;
        if (r > 0) {
          CKPT_RETURN_IF_ERROR(group.member(r)->Barrier());  // Rank 0 creates the root first.
        }
        CKPT_ASSIGN_OR_RETURN(auto store, CheckpointStore::Open(root, so));
        if (r == 0) CKPT_RETURN_IF_ERROR(group.member(r)->Barrier());
        CKPT_ASSIGN_OR_RETURN(
            auto ckpt, optimizer::Checkpointer::Create(opt.get(), store.get(),
                           group.member(r)));
        CKPT_RETURN_IF_ERROR(ckpt->LoadModel(hf_path).status());
        return ckpt->Save(1, {{"rank", std::to_string(r)}});
      }();
    });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < ranks; ++r) ASSERT_THAT(st[r], testing::IsOk()) << "rank " << r;
}

// A trainer loads qwen3-tiny with LoadModel and saves step 1; export-hf writes it back as
// sharded safetensors with its config, which verify accepts and diff finds equal to the
// original (weights, and masters as F32); bad requests exit 2.
TEST_F(CliTest, ExportHfOfALoadedModelEqualsTheOriginal) {
  const std::string qwen = std::string(CKPT_HF_TESTDATA) + "/qwen3-tiny";
  CKPT_SKIP_OR_FAIL_WITHOUT_TESTDATA(qwen);
  SaveLoadedModel(qwen, Root(), 1);
  const std::string out = tmp_.path() + "/exported";
  Result r = RunTool("export-hf " + Root() + " " + out + " --max-shard-size 200K --config " + qwen +
                     "/config.json --json");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  nlohmann::json j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j["step"], 1);
  EXPECT_EQ(j["tensors"], 25);
  EXPECT_TRUE(j["sharded"].get<bool>());
  EXPECT_TRUE(std::filesystem::exists(out + "/config.json"));
  EXPECT_TRUE(std::filesystem::exists(out + "/model.safetensors.index.json"));
  EXPECT_EQ(RunTool("verify " + out).exit_code, 0);
  Result same = RunTool("diff " + qwen + " " + out);
  EXPECT_EQ(same.exit_code, 0) << same.output;

  const std::string masters = tmp_.path() + "/masters";
  Result m = RunTool("export-hf " + Root() + " " + masters + " --from masters --dtype f32 --step 1");
  ASSERT_EQ(m.exit_code, 0) << m.output;
  EXPECT_THAT(m.output, HasSubstr("exported step 1"));
  auto back = HfCheckpointReader::Open(masters);
  ASSERT_THAT(back, testing::IsOk());
  EXPECT_EQ((*back)->tensors()[0].dtype, formats::StDType::kF32);
  EXPECT_EQ(RunTool("diff " + qwen + " " + masters).exit_code, 0);

  EXPECT_EQ(RunTool("export-hf " + Root() + " " + tmp_.path() + "/x --dtype F8").exit_code, 2);
  EXPECT_EQ(RunTool("export-hf " + Root() + " " + tmp_.path() + "/x --from grads").exit_code, 2);
  EXPECT_EQ(RunTool("export-hf " + Root() + " " + tmp_.path() + "/x --step 9").exit_code, 2);
  EXPECT_EQ(RunTool("export-hf " + tmp_.path() + "/nowhere " + tmp_.path() + "/x").exit_code, 2);
  EXPECT_EQ(RunTool("export-hf " + Root() + " " + tmp_.path() + "/x --step -1").exit_code, 2);
  EXPECT_FALSE(std::filesystem::exists(tmp_.path() + "/x"));
  // Into an existing model, or into the store: refused, exit 2, nothing changed.
  Result again = RunTool("export-hf " + Root() + " " + out);
  EXPECT_EQ(again.exit_code, 2);
  EXPECT_THAT(again.output, HasSubstr("not an empty directory"));
  EXPECT_EQ(RunTool("export-hf " + Root() + " " + Root() + "/step-00000001").exit_code, 2);
  EXPECT_EQ(RunTool("verify " + Root() + " --all").exit_code, 0);
  // Damage of what it reads is exit 1: a rank's data file gone; LATEST naming a vanished step.
  const std::string copy = tmp_.path() + "/copy";
  std::filesystem::copy(Root(), copy, std::filesystem::copy_options::recursive);
  std::filesystem::remove(copy + "/step-00000001/rank-00000.data");
  EXPECT_EQ(RunTool("export-hf " + copy + " " + tmp_.path() + "/y").exit_code, 1);
  std::filesystem::remove_all(copy + "/step-00000001");
  EXPECT_EQ(RunTool("export-hf " + copy + " " + tmp_.path() + "/y").exit_code, 1);
  EXPECT_EQ(RunTool("export-hf " + Root() + " " + tmp_.path() + "/y --step 2").exit_code, 2);
  EXPECT_FALSE(std::filesystem::exists(tmp_.path() + "/y"));
}

// A step saved by 2 ranks resharded to 1, 3 and 8: each verifies, diff finds it equal to the
// source, and the ranks' trainer blobs follow Load's rule; a second reshard of the same step
// into the same root is refused (exit 2).
TEST_F(CliTest, ReshardToOneThreeAndEightRanksDiffsEqual) {
  const std::string qwen = std::string(CKPT_HF_TESTDATA) + "/qwen3-moe-tiny";
  CKPT_SKIP_OR_FAIL_WITHOUT_TESTDATA(qwen);
  SaveLoadedModel(qwen, Root(), 2);
  for (int dp : {1, 3, 8}) {
    const std::string dst = tmp_.path() + "/dp" + std::to_string(dp);
    Result r = RunTool("reshard " + Root() + " " + dst + " --dp " + std::to_string(dp) +
                       " --bucket-elems 20000 --json");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    nlohmann::json j = nlohmann::json::parse(r.output);
    EXPECT_EQ(j["from_ranks"], 2);
    EXPECT_EQ(j["dp"], dp);
    EXPECT_TRUE(j["optimizer"].get<bool>());
    EXPECT_EQ(RunTool("verify " + dst + " --all").exit_code, 0);
    Result same = RunTool("diff " + Root() + " " + dst);
    EXPECT_EQ(same.exit_code, 0) << same.output;
    Result inspect = RunTool("inspect " + dst + " --json");
    ASSERT_EQ(inspect.exit_code, 0) << inspect.output;
    EXPECT_EQ(nlohmann::json::parse(inspect.output)["details"]["world_size"], dp) << inspect.output;
  }
  Result again = RunTool("reshard " + Root() + " " + tmp_.path() + "/dp3 --dp 3");
  EXPECT_EQ(again.exit_code, 2);
  EXPECT_THAT(again.output, HasSubstr("not newer than LATEST"));
  Result zstd = RunTool("reshard " + Root() + " " + tmp_.path() + "/z --dp 2 --zstd 3");
  ASSERT_EQ(zstd.exit_code, 0) << zstd.output;
  EXPECT_THAT(zstd.output, HasSubstr("from 2 to 2 rank(s)"));
  EXPECT_EQ(RunTool("diff " + Root() + " " + tmp_.path() + "/z").exit_code, 0);
  for (const char* bad : {"--dp 0", "--dp 1025", "--dp 2 --step -1", "--dp 2 --zstd 23",
                          "--dp 2 --bucket-elems -1"}) {
    EXPECT_EQ(RunTool("reshard " + Root() + " " + tmp_.path() + "/q " + bad).exit_code, 2) << bad;
  }
  EXPECT_FALSE(std::filesystem::exists(tmp_.path() + "/q"));
  EXPECT_EQ(RunTool("reshard " + Root() + " " + Root() + " --dp 2").exit_code, 2);
  EXPECT_EQ(RunTool("reshard " + Root() + " " + Root() + "/step-00000001 --dp 2").exit_code, 2);
  EXPECT_EQ(RunTool("verify " + Root() + " --all").exit_code, 0);
}

}  // namespace
}  // namespace ckpt
