#include "ckpt/formats/optimizer_record.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/support/status_matchers.h"

namespace ckpt::formats {
namespace {

using ::ckpt::testing::IsOk;
using ::ckpt::testing::StatusIs;
using ::testing::HasSubstr;

OptimizerRecord Sample() {
  OptimizerRecord r;
  r.moment_dtype = DType::kBF16;
  r.world_size = 3;
  r.params = {{"embed.weight", {32000, 1024}, DType::kBF16, 0, std::nullopt},
              {"norm.bias", {1024}, DType::kBF16, 1, std::nullopt},
              {"scalar", {}, DType::kF32, 1, std::nullopt}};
  r.groups = {{1e-3, 0.9, 0.95, 1e-8, 0.1, 120}, {3.0000000000000004e-4, 0.8, 0.999, 0, 0, 7}};
  return r;
}

TEST(OptimizerRecordTest, RoundTripsExactlyWithItsKind) {
  const std::string text = EncodeOptimizerRecord(Sample());
  EXPECT_THAT(text, HasSubstr("\"kind\":\"adamw\""));
  auto back = ParseOptimizerRecord(text, "step 5");
  CKPT_ASSERT_OK(back);
  EXPECT_EQ(*back, Sample());
}

TEST(OptimizerRecordTest, ARecordWithoutAKindIsAdamWs) {
  auto r = ParseOptimizerRecord(
      R"({"format":"ckpt-optimizer","version":1,"moment_dtype":"F32","world_size":1,)"
      R"("params":[{"name":"w","shape":[2],"dtype":"F32","group":0}],)"
      R"("groups":[{"lr":0.1,"beta1":0.9,"beta2":0.99,"eps":1e-8,"weight_decay":0,"step":3}]})",
      "old");
  CKPT_ASSERT_OK(r);
  EXPECT_EQ(r->kind, kOptimizerKindAdamW);
  EXPECT_EQ(r->groups[0].step, 3u);
}

TEST(OptimizerRecordTest, EveryMalformedFieldIsDataLossNamingIt) {
  const std::string good = EncodeOptimizerRecord(Sample());
  auto damaged = [&](const std::string& from, const std::string& to) {
    std::string text = good;
    const size_t at = text.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    text.replace(at, from.size(), to);
    return ParseOptimizerRecord(text, "step 5").status();
  };
  struct Case {
    std::string from, to, names;
  };
  const std::vector<Case> cases = {
      {"\"ckpt-optimizer\"", "\"ckpt\"", "record"},
      {"\"moment_dtype\":\"BF16\"", "\"moment_dtype\":\"F16\"", "moment_dtype F16"},
      {"\"moment_dtype\":\"BF16\"", "\"moment_dtype\":\"Q8\"", "moment_dtype \"Q8\""},
      {"\"world_size\":3", "\"world_size\":0", "world_size"},
      {"\"group\":1", "\"group\":2", "\"norm.bias\" is in no group"},
      {"\"name\":\"scalar\"", "\"name\":\"norm.bias\"", "\"norm.bias\" twice"},
      {"\"step\":7", "\"step\":-7", "group 1 lacks a step"},
      {"\"lr\":0.001", "\"lr\":\"0.001\"", "group 0 lacks lr"},
      {"[32000,1024]", "[32000,-1]", "\"embed.weight\" has a shape of non-integers"},
      {"\"dtype\":\"F32\"", "\"dtype\":7", "\"scalar\" dtype that is not a dtype name"},
      {"\"world_size\":3", "\"world_size\":3,\"world_size\":3", "repeats key \"world_size\""},
  };
  for (const Case& c : cases) {
    const absl::Status s = damaged(c.from, c.to);
    EXPECT_THAT(s, StatusIs(absl::StatusCode::kDataLoss)) << c.to;
    EXPECT_THAT(s.message(), HasSubstr("step 5: optimizer record")) << c.to;
    EXPECT_THAT(s.message(), HasSubstr(c.names)) << c.to << ": " << s.message();
  }
  EXPECT_THAT(ParseOptimizerRecord("[1,2", "x"), StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_THAT(damaged("\"version\":1", "\"version\":6"),
              StatusIs(absl::StatusCode::kUnimplemented));
  EXPECT_THAT(damaged("\"group\":1", "\"group\":1,\"step\":-1"),
              StatusIs(absl::StatusCode::kDataLoss));
}

TEST(OptimizerRecordTest, ParameterStepsRoundTripAsVersionTwo) {
  OptimizerRecord record;
  record.params = {{"a", {2}, DType::kBF16, 0, std::nullopt}, {"b", {3}, DType::kBF16, 0, 4}};
  record.groups = {{1e-3, 0.9, 0.999, 1e-8, 0.1, 9}};
  const std::string text = EncodeOptimizerRecord(record);
  EXPECT_THAT(text, HasSubstr("\"version\":2"));
  absl::StatusOr<OptimizerRecord> parsed = ParseOptimizerRecord(text, "x");
  ASSERT_THAT(parsed, IsOk());
  EXPECT_EQ(*parsed, record);
  EXPECT_EQ(ParamStep(*parsed, 0), 9u);  // Its group's.
  EXPECT_EQ(ParamStep(*parsed, 1), 4u);  // Its own.
  record.params[1].step.reset();
  EXPECT_THAT(EncodeOptimizerRecord(record), HasSubstr("\"version\":1"));
}

TEST(OptimizerRecordTest, AmsgradGroupsRoundTripAsVersionThree) {
  OptimizerRecord record = Sample();
  record.groups[1].amsgrad = true;
  const std::string text = EncodeOptimizerRecord(record);
  EXPECT_THAT(text, HasSubstr("\"version\":3"));
  EXPECT_THAT(text, HasSubstr("\"amsgrad\":true"));
  absl::StatusOr<OptimizerRecord> parsed = ParseOptimizerRecord(text, "x");
  ASSERT_THAT(parsed, IsOk());
  EXPECT_EQ(*parsed, record);
  EXPECT_FALSE(parsed->groups[0].amsgrad);
  std::string bad = text;
  bad.replace(bad.find("\"amsgrad\":true"), 14, "\"amsgrad\":1");
  const absl::Status s = ParseOptimizerRecord(bad, "x").status();
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_THAT(s.message(), HasSubstr("group 1 has an amsgrad that is not a bool"));
}

TEST(OptimizerRecordTest, MuonGroupsRoundTripAsVersionFourEveryGroupSayingItsAlgorithm) {
  OptimizerRecord record = Sample();
  record.kind = kOptimizerKindMuon;
  record.groups[0].muon = OptimizerRecordMuon{0.95, true, 3.4445, -4.775, 2.0315, 5,
                                              kMuonLrMatchRmsAdamW};
  const std::string text = EncodeOptimizerRecord(record);
  EXPECT_THAT(text, HasSubstr("\"version\":4"));
  EXPECT_THAT(text, HasSubstr("\"algorithm\":\"muon\""));
  EXPECT_THAT(text, HasSubstr("\"algorithm\":\"adamw\""));
  EXPECT_THAT(text, HasSubstr("\"ns_coefficients\":[3.4445,-4.775,2.0315]"));
  absl::StatusOr<OptimizerRecord> parsed = ParseOptimizerRecord(text, "x");
  ASSERT_THAT(parsed, IsOk());
  EXPECT_EQ(*parsed, record);
  EXPECT_FALSE(parsed->groups[1].muon.has_value());
  struct Case {
    std::string from, to, names;
  };
  const std::vector<Case> cases = {
      {"\"algorithm\":\"muon\"", "\"algorithm\":\"sgd\"", "group 0 has algorithm \"sgd\""},
      {"\"algorithm\":\"muon\"", "\"algorithm\":1", "group 0 has an algorithm that is not"},
      {"\"nesterov\":true", "\"nesterov\":1", "group 0 lacks nesterov"},
      {"[3.4445,-4.775,2.0315]", "[3.4445,-4.775]", "group 0 lacks three ns_coefficients"},
      {"\"ns_steps\":5", "\"ns_steps\":-5", "group 0 lacks ns_steps"},
      {"\"match_rms_adamw\"", "\"fast\"", "group 0 lacks adjust_lr"},
      {"\"momentum\":0.95", "\"momentum\":null", "group 0 lacks momentum"},
  };
  for (const Case& c : cases) {
    std::string bad = text;
    bad.replace(bad.find(c.from), c.from.size(), c.to);
    const absl::Status s = ParseOptimizerRecord(bad, "x").status();
    EXPECT_THAT(s, StatusIs(absl::StatusCode::kDataLoss)) << c.to;
    EXPECT_THAT(s.message(), HasSubstr(c.names)) << c.to << ": " << s.message();
  }
}

// Version 5: a group of another rule names it and carries that rule's hyper-parameters by
// name; every group then says its algorithm, AdamW's and Muon's as before.
TEST(OptimizerRecordTest, OtherRulesRoundTripAsVersionFiveWithHyperParametersByName) {
  OptimizerRecord record = Sample();
  record.kind = "adafactor";
  record.groups[0].algorithm = "adafactor";
  record.groups[0].hyper = {{"beta2_decay", -0.8}, {"eps2", 1e-3}, {"d", 1.0}};
  const std::string text = EncodeOptimizerRecord(record);
  EXPECT_THAT(text, HasSubstr("\"version\":5"));
  EXPECT_THAT(text, HasSubstr("\"algorithm\":\"adafactor\""));
  EXPECT_THAT(text, HasSubstr("\"algorithm\":\"adamw\""));
  EXPECT_THAT(text, HasSubstr("\"hyper_parameters\":{\"beta2_decay\":-0.8,\"d\":1.0,\"eps2\":0.001}"));
  absl::StatusOr<OptimizerRecord> parsed = ParseOptimizerRecord(text, "x");
  ASSERT_THAT(parsed, IsOk());
  EXPECT_EQ(*parsed, record);
  struct Case {
    std::string from, to, names;
  };
  const std::vector<Case> cases = {
      {"{\"beta2_decay\":-0.8,\"d\":1.0,\"eps2\":0.001}", "7",
       "group 0 has hyper_parameters that are not an object"},
      {"\"beta2_decay\":-0.8", "\"beta2_decay\":\"-0.8\"",
       "group 0 has hyper-parameter \"beta2_decay\" that is not a number"},
      {"\"algorithm\":\"adafactor\"", "\"algorithm\":\"\"", "group 0 has algorithm \"\""},
  };
  for (const Case& c : cases) {
    std::string bad = text;
    bad.replace(bad.find(c.from), c.from.size(), c.to);
    const absl::Status st = ParseOptimizerRecord(bad, "x").status();
    EXPECT_THAT(st, StatusIs(absl::StatusCode::kDataLoss)) << c.to;
    EXPECT_THAT(st.message(), HasSubstr(c.names)) << c.to << ": " << st.message();
  }
  // Before version 5 a group of another rule is damage, not a rule to look up.
  std::string v4 = text;
  v4.replace(v4.find("\"version\":5"), 11, "\"version\":4");
  EXPECT_THAT(ParseOptimizerRecord(v4, "x"), StatusIs(absl::StatusCode::kDataLoss));
}

// A version 4 record as the build before version 5 wrote it (golden): read as it always was.
TEST(OptimizerRecordTest, AVersionFourRecordAsWrittenBeforeVersionFiveStillReads) {
  const std::string golden =
      R"({"format":"ckpt-optimizer","groups":[{"adjust_lr":"original","algorithm":"muon",)"
      R"("beta1":0.9,"beta2":0.999,"eps":1e-07,"lr":0.02,"momentum":0.95,)"
      R"("ns_coefficients":[3.4445,-4.775,2.0315],"ns_steps":5,"nesterov":true,"step":3,)"
      R"("weight_decay":0.1},{"algorithm":"adamw","beta1":0.9,"beta2":0.999,"eps":1e-08,)"
      R"("lr":0.003,"step":3,"weight_decay":0.01}],"kind":"muon","moment_dtype":"F32",)"
      R"("params":[{"dtype":"BF16","group":0,"name":"w1","shape":[8,16]},)"
      R"({"dtype":"F32","group":1,"name":"norm","shape":[8]}],"version":4,"world_size":1})";
  absl::StatusOr<OptimizerRecord> parsed = ParseOptimizerRecord(golden, "x");
  ASSERT_THAT(parsed, IsOk());
  EXPECT_EQ(parsed->kind, kOptimizerKindMuon);
  ASSERT_EQ(parsed->groups.size(), 2u);
  ASSERT_TRUE(parsed->groups[0].muon.has_value());
  EXPECT_EQ(parsed->groups[0].muon->ns_c, 2.0315);
  EXPECT_TRUE(parsed->groups[0].algorithm.empty());
  EXPECT_TRUE(parsed->groups[0].hyper.empty());
  EXPECT_FALSE(parsed->groups[1].muon.has_value());
  EXPECT_EQ(parsed->groups[1].lr, 0.003);
  EXPECT_EQ(parsed->params[0].shape, (std::vector<uint64_t>{8, 16}));
}

}  // namespace
}  // namespace ckpt::formats
