#include "ckpt/formats/safetensors.h"

#include <string>
#include <utility>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "ckpt/base/coding.h"
#include "tests/support/status_matchers.h"

namespace ckpt::formats {
namespace {

using ::ckpt::testing::IsOk;
using ::ckpt::testing::StatusIs;
using ::testing::HasSubstr;

// A safetensors file: 8-byte length, `header` verbatim, then `data_bytes` bytes of data.
std::string File(const std::string& header, size_t data_bytes) {
  std::string out;
  PutFixed64(&out, header.size());
  return out + header + std::string(data_bytes, '\x5a');
}
std::string RawLength(uint64_t n, const std::string& rest) {
  std::string out;
  PutFixed64(&out, n);
  return out + rest;
}
const std::string kT = R"("t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]})";
std::string One(const std::string& info, size_t data) {
  return File("{\"t\": " + info + "}", data);
}

struct Case {
  std::string name;
  std::string bytes;
  std::string rule;  // Empty: the file is valid.
};

std::vector<Case> Cases() {
  return {
      // Prefix and framing.
      {"empty_file", "", "HeaderTooSmall"},
      {"seven_bytes", std::string(7, '\0'), "HeaderTooSmall"},
      {"length_over_cap", RawLength(100'000'001, "{}"), "HeaderTooLarge"},
      {"length_near_2_64", RawLength(~0ull - 3, "{}"), "HeaderTooLarge"},
      {"length_past_eof", RawLength(64, "{}"), "InvalidHeaderLength"},
      {"length_exactly_cap_past_eof", RawLength(100'000'000, "{}"), "InvalidHeaderLength"},
      {"zero_length_header", RawLength(0, ""), "InvalidHeaderStart"},
      {"header_starts_with_nul", File(std::string(1, '\0') + "{" + kT + "}", 8),
       "InvalidHeaderStart"},
      {"header_starts_with_nbsp", File("\xc2\xa0{" + kT + "}", 8), "InvalidHeaderStart"},
      {"header_starts_with_form_feed", File("\f{" + kT + "}", 8), "InvalidHeaderStart"},
      {"header_starts_with_bom", File("\xef\xbb\xbf{" + kT + "}", 8), "InvalidHeaderStart"},
      {"header_is_array", File("[]", 0), "InvalidHeaderStart"},
      {"header_only_spaces", File("        ", 0), "InvalidHeaderStart"},
      // JSON syntax and padding.
      {"truncated_json", File("{\"t\": {\"dtype\"", 0), "InvalidHeader"},
      {"trailing_garbage", File("{" + kT + "}x", 8), "InvalidHeader"},
      {"trailing_form_feed", File("{" + kT + "}\f", 8), "InvalidHeader"},
      {"trailing_nul_padding", File("{" + kT + "}" + std::string(3, '\0'), 8), "InvalidHeader"},
      {"trailing_nbsp_padding", File("{" + kT + "}\xc2\xa0", 8), "InvalidHeader"},
      {"two_objects", File("{}{}", 0), "InvalidHeader"},
      {"invalid_utf8_key",
       File("{\"\xff\": {\"dtype\": \"F32\", \"shape\": [0], \"data_offsets\": [0, 0]}}", 0),
       "InvalidHeader"},
      {"invalid_utf8_metadata", File("{\"__metadata__\": {\"k\": \"\xc3\x28\"}}", 0),
       "InvalidHeader"},
      {"overlong_utf8",
       File("{\"\xc0\xaf\": {\"dtype\": \"F32\", \"shape\": [0], \"data_offsets\": [0, 0]}}", 0),
       "InvalidHeader"},
      {"raw_control_char_in_name",
       File("{\"a\nb\": {\"dtype\": \"F32\", \"shape\": [0], \"data_offsets\": [0, 0]}}", 0),
       "InvalidHeader"},
      {"unterminated_escape", File("{\"a\\\": 1}", 0), "InvalidHeader"},
      {"single_quotes", File("{'t': 1}", 0), "InvalidHeader"},
      {"comment", File("{/* x */}", 0), "InvalidHeader"},
      {"nan_literal", One(R"({"dtype": "F32", "shape": [NaN], "data_offsets": [0, 8]})", 8),
       "InvalidHeader"},
      {"nesting_bomb",
       File("{\"t\": {\"dtype\": \"F32\", \"shape\": " + std::string(5000, '[') +
                std::string(5000, ']') + ", \"data_offsets\": [0, 0]}}",
            0),
       "InvalidHeader"},
      {"deep_metadata",
       File("{\"__metadata__\": " + std::string(20, '{') + std::string(20, '}') + "}", 0),
       "InvalidHeader"},
      // Structure.
      {"duplicate_tensor", File("{" + kT + ", " + kT + "}", 8), "InvalidHeader"},
      {"duplicate_field",
       One(R"({"dtype": "F32", "dtype": "F16", "shape": [2], "data_offsets": [0, 8]})", 8),
       "InvalidHeader"},
      {"duplicate_metadata", File(R"({"__metadata__": {}, "__metadata__": {}})", 0),
       "InvalidHeader"},
      {"metadata_not_object", File(R"({"__metadata__": "pt"})", 0), "InvalidHeader"},
      {"metadata_value_number", File(R"({"__metadata__": {"format": 1}})", 0), "InvalidHeader"},
      {"metadata_value_null", File(R"({"__metadata__": {"format": null}})", 0), "InvalidHeader"},
      {"tensor_info_string", One(R"("F32")", 0), "InvalidHeader"},
      {"tensor_info_array", One(R"(["F32", [2], [0, 8]])", 8), "InvalidHeader"},
      {"missing_dtype", One(R"({"shape": [2], "data_offsets": [0, 8]})", 8), "InvalidHeader"},
      {"missing_shape", One(R"({"dtype": "F32", "data_offsets": [0, 8]})", 8), "InvalidHeader"},
      {"missing_offsets", One(R"({"dtype": "F32", "shape": [2]})", 8), "InvalidHeader"},
      {"dtype_number", One(R"({"dtype": 7, "shape": [2], "data_offsets": [0, 8]})", 8),
       "InvalidHeader"},
      {"dtype_unknown", One(R"({"dtype": "F33", "shape": [2], "data_offsets": [0, 8]})", 8),
       "InvalidDtype"},
      {"dtype_lowercase", One(R"({"dtype": "f32", "shape": [2], "data_offsets": [0, 8]})", 8),
       "InvalidDtype"},
      {"dtype_torch_name", One(R"({"dtype": "float32", "shape": [2], "data_offsets": [0, 8]})", 8),
       "InvalidDtype"},
      {"shape_not_array", One(R"({"dtype": "F32", "shape": 2, "data_offsets": [0, 8]})", 8),
       "InvalidHeader"},
      {"shape_negative", One(R"({"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]})", 8),
       "InvalidHeader"},
      {"shape_float", One(R"({"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]})", 8),
       "InvalidHeader"},
      {"shape_string", One(R"({"dtype": "F32", "shape": ["2"], "data_offsets": [0, 8]})", 8),
       "InvalidHeader"},
      {"shape_beyond_u64",
       One(R"({"dtype": "F32", "shape": [18446744073709551616], "data_offsets": [0, 8]})", 8),
       "InvalidHeader"},
      {"offsets_one_element", One(R"({"dtype": "F32", "shape": [2], "data_offsets": [8]})", 8),
       "InvalidHeader"},
      {"offsets_three_elements",
       One(R"({"dtype": "F32", "shape": [2], "data_offsets": [0, 8, 8]})", 8), "InvalidHeader"},
      {"offsets_negative", One(R"({"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]})", 8),
       "InvalidHeader"},
      {"offsets_float", One(R"({"dtype": "F32", "shape": [2], "data_offsets": [0, 8.0]})", 8),
       "InvalidHeader"},
      {"offsets_object", One(R"({"dtype": "F32", "shape": [2], "data_offsets": {"0": 8}})", 8),
       "InvalidHeader"},
      // Layout.
      {"offsets_reversed", One(R"({"dtype": "F32", "shape": [0], "data_offsets": [8, 0]})", 8),
       "InvalidOffset"},
      {"first_tensor_not_at_zero",
       One(R"({"dtype": "F32", "shape": [2], "data_offsets": [4, 12]})", 12), "InvalidOffset"},
      {"gap_between_tensors",
       File(
           R"({"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}, "b": {"dtype": "U8", "shape": [2], "data_offsets": [3, 5]}})",
           5),
       "InvalidOffset"},
      {"overlapping_tensors",
       File(
           R"({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}, "b": {"dtype": "U8", "shape": [2], "data_offsets": [2, 4]}})",
           4),
       "InvalidOffset"},
      {"same_offsets_twice",
       File(
           R"({"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}, "b": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}})",
           2),
       "InvalidOffset"},
      {"size_too_big", One(R"({"dtype": "F32", "shape": [2], "data_offsets": [0, 9]})", 9),
       "TensorInvalidInfo"},
      {"size_too_small", One(R"({"dtype": "F32", "shape": [2], "data_offsets": [0, 7]})", 7),
       "TensorInvalidInfo"},
      {"element_count_overflow",
       One(R"({"dtype": "U8", "shape": [4294967296, 4294967296, 2], "data_offsets": [0, 0]})", 0),
       "ValidationOverflow"},
      {"bit_count_overflow",
       One(R"({"dtype": "F64", "shape": [4611686018427387904], "data_offsets": [0, 0]})", 0),
       "ValidationOverflow"},
      {"f4_odd_count", One(R"({"dtype": "F4", "shape": [3], "data_offsets": [0, 2]})", 2),
       "MisalignedSlice"},
      {"f6_single_element", One(R"({"dtype": "F6_E3M2", "shape": [1], "data_offsets": [0, 1]})", 1),
       "MisalignedSlice"},
      {"data_longer_than_tensors",
       One(R"({"dtype": "F32", "shape": [2], "data_offsets": [0, 8]})", 9),
       "MetadataIncompleteBuffer"},
      {"tensors_past_end_of_file",
       One(R"({"dtype": "F32", "shape": [2], "data_offsets": [0, 8]})", 4),
       "MetadataIncompleteBuffer"},
      {"no_tensors_but_data", File("{}", 16), "MetadataIncompleteBuffer"},
      {"offsets_near_2_64",
       One(R"({"dtype": "U8", "shape": [1], "data_offsets": [18446744073709551614, 18446744073709551615]})",
           0),
       "InvalidOffset"},
      // Valid edge cases.
      {"valid_zero_tensors", File("{}", 0), ""},
      {"valid_only_metadata", File(R"({"__metadata__": {"format": "pt"}})", 0), ""},
      {"valid_scalar", One(R"({"dtype": "F32", "shape": [], "data_offsets": [0, 4]})", 4), ""},
      {"valid_zero_size_tensor",
       One(R"({"dtype": "F32", "shape": [0], "data_offsets": [0, 0]})", 0), ""},
      {"valid_zero_size_among_others",
       File(
           R"({"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}, "z": {"dtype": "BF16", "shape": [3, 0], "data_offsets": [2, 2]}, "b": {"dtype": "U8", "shape": [1], "data_offsets": [2, 3]}})",
           3),
       ""},
      {"valid_padded_to_page", File("{" + kT + "}" + std::string(4096 - 2 - kT.size(), ' '), 8),
       ""},
      // JSON whitespace on either side of the object: safetensors 0.8 reads these (checked
      // against it on the GPU host: space, tab, LF, CR before and after; NUL, form feed,
      // no-break space and a BOM refused).
      {"valid_leading_space", File(" {" + kT + "}", 8), ""},
      {"valid_leading_json_whitespace", File("\t\n\r {" + kT + "}", 8), ""},
      {"valid_trailing_newline", File("{" + kT + "}\n", 8), ""},
      {"valid_trailing_tab_padding", File("{" + kT + "}\t", 8), ""},
      {"valid_trailing_mixed_whitespace", File("{" + kT + "} \t\r\n", 8), ""},
      {"valid_unaligned_data",
       File(R"({"u": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]}})", 3), ""},
      {"valid_name_with_escapes",
       File(R"({"a\"b\\c\u00e9\n\t\u0000": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}})",
            1),
       ""},
      {"valid_reverse_listing",
       File(
           R"({"b": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}, "a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}})",
           2),
       ""},
      {"valid_f4_even", One(R"({"dtype": "F4", "shape": [4], "data_offsets": [0, 2]})", 2), ""},
      {"valid_f6_four", One(R"({"dtype": "F6_E2M3", "shape": [4], "data_offsets": [0, 3]})", 3),
       ""},
      {"valid_extra_field_ignored",
       One(R"({"dtype": "F32", "shape": [2], "data_offsets": [0, 8], "note": "x"})", 8), ""},
      {"valid_inner_newlines", File("{\n  " + kT + "\n}", 8), ""},
      {"valid_unicode_metadata", File(R"({"__metadata__": {"名前": "値"}})", 0), ""},
      {"valid_empty_name",
       File(R"({"": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}})", 1), ""},
  };
}

class SafetensorsCaseTest : public ::testing::TestWithParam<Case> {};

TEST_P(SafetensorsCaseTest, FollowsTheRule) {
  const Case& c = GetParam();
  absl::StatusOr<SafetensorsHeader> h = ParseSafetensors(AsBytes(c.bytes), "m.safetensors");
  if (c.rule.empty()) {
    EXPECT_THAT(h, IsOk());
  } else {
    ASSERT_THAT(h, StatusIs(absl::StatusCode::kDataLoss));
    EXPECT_THAT(std::string(h.status().message()), HasSubstr("m.safetensors: " + c.rule));
  }
}

INSTANTIATE_TEST_SUITE_P(Rules, SafetensorsCaseTest, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<Case>& p) { return p.param.name; });

TEST(SafetensorsTest, AllDtypesParseWithTheirBitWidths) {
  const char* names[] = {"BOOL",    "F4",      "F6_E2M3", "F6_E3M2",     "U8",          "I8",
                         "F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "I16",
                         "U16",     "F16",     "BF16",    "I32",         "U32",         "F32",
                         "C64",     "F64",     "I64",     "U64"};
  std::string header = "{";
  uint64_t offset = 0;
  for (const char* n : names) {
    auto dtype = ParseStDType(n);
    CKPT_ASSERT_OK(dtype);
    EXPECT_EQ(StDTypeName(*dtype), n);
    uint64_t bytes = StDTypeBits(*dtype);  // 8 elements: exactly `bits` bytes.
    if (offset > 0) header += ", ";
    header += "\"" + std::string(n) + "\": {\"dtype\": \"" + n +
              "\", \"shape\": [8], \"data_offsets\": [" + std::to_string(offset) + ", " +
              std::to_string(offset + bytes) + "]}";
    offset += bytes;
  }
  header += "}";
  auto h = ParseSafetensors(AsBytes(File(header, offset)), "all");
  CKPT_ASSERT_OK(h);
  EXPECT_EQ(h->tensors.size(), 22u);
}

TEST(SafetensorsTest, EncoderOutputParsesAndIsPaddedToEightBytes) {
  std::vector<SafetensorsTensor> tensors = {{"w", StDType::kBF16, {3, 5}, 0, 0},
                                            {"s", StDType::kF32, {}, 0, 0}};
  auto header = EncodeSafetensorsHeader(&tensors, {{"format", "pt"}});
  CKPT_ASSERT_OK(header);
  EXPECT_EQ(header->size() % 8, 0u);
  EXPECT_EQ(tensors[1].begin, 30u);
  auto h = ParseSafetensors(AsBytes(*header + std::string(34, '\0')), "enc");
  CKPT_ASSERT_OK(h);
  EXPECT_EQ(h->metadata.at("format"), "pt");
  EXPECT_EQ(h->tensors[0].name, "w");
  std::vector<SafetensorsTensor> dup = {{"a", StDType::kU8, {1}, 0, 0},
                                        {"a", StDType::kU8, {1}, 0, 0}};
  EXPECT_THAT(EncodeSafetensorsHeader(&dup, {}), StatusIs(absl::StatusCode::kInvalidArgument));
  std::vector<SafetensorsTensor> bad_utf8 = {{"\xff", StDType::kU8, {1}, 0, 0}};
  EXPECT_THAT(EncodeSafetensorsHeader(&bad_utf8, {}), StatusIs(absl::StatusCode::kInvalidArgument));
}

struct IndexCase {
  std::string name;
  std::string json;
  std::string rule;
};

class HfIndexCaseTest : public ::testing::TestWithParam<IndexCase> {};

TEST_P(HfIndexCaseTest, FollowsTheRule) {
  const IndexCase& c = GetParam();
  auto index = ParseHfIndex(AsBytes(c.json), "model.safetensors.index.json");
  if (c.rule.empty()) {
    EXPECT_THAT(index, IsOk());
  } else {
    ASSERT_THAT(index, StatusIs(absl::StatusCode::kDataLoss));
    EXPECT_THAT(std::string(index.status().message()),
                HasSubstr("model.safetensors.index.json: " + c.rule));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Rules, HfIndexCaseTest,
    ::testing::Values(
        IndexCase{
            "valid",
            R"({"metadata": {"total_size": 10}, "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}})",
            ""},
        IndexCase{"valid_no_metadata", R"({"weight_map": {"a": "m.safetensors"}})", ""},
        IndexCase{"valid_null_metadata", R"({"metadata": null, "weight_map": {}})", ""},
        IndexCase{"valid_extra_metadata",
                  R"({"metadata": {"total_parameters": 5, "total_size": 10}, "weight_map": {}})",
                  ""},
        IndexCase{"valid_subdirectory", R"({"weight_map": {"a": "shards/m.safetensors"}})", ""},
        IndexCase{"not_json", R"({"weight_map": )", "InvalidIndex"},
        IndexCase{"not_object", R"(["weight_map"])", "InvalidIndex"},
        IndexCase{"missing_weight_map", R"({"metadata": {}})", "InvalidIndex"},
        IndexCase{"weight_map_array", R"({"weight_map": ["a"]})", "InvalidIndex"},
        IndexCase{"entry_not_string", R"({"weight_map": {"a": 1}})", "InvalidIndex"},
        IndexCase{"duplicate_tensor",
                  R"({"weight_map": {"a": "x.safetensors", "a": "y.safetensors"}})",
                  "InvalidIndex"},
        IndexCase{"absolute_path", R"({"weight_map": {"a": "/etc/x.safetensors"}})",
                  "UnsafeShardPath"},
        IndexCase{"parent_path", R"({"weight_map": {"a": "../x.safetensors"}})", "UnsafeShardPath"},
        IndexCase{"inner_parent_path", R"({"weight_map": {"a": "s/../../x.safetensors"}})",
                  "UnsafeShardPath"},
        IndexCase{"dot_component", R"({"weight_map": {"a": "./x.safetensors"}})",
                  "UnsafeShardPath"},
        IndexCase{"backslash", R"({"weight_map": {"a": "..\\x.safetensors"}})", "UnsafeShardPath"},
        IndexCase{"empty_path", R"({"weight_map": {"a": ""}})", "UnsafeShardPath"},
        IndexCase{"double_slash", R"({"weight_map": {"a": "s//x.safetensors"}})",
                  "UnsafeShardPath"},
        IndexCase{"not_safetensors", R"({"weight_map": {"a": "pytorch_model.bin"}})",
                  "InvalidIndex"},
        IndexCase{"total_size_negative", R"({"metadata": {"total_size": -1}, "weight_map": {}})",
                  "InvalidIndex"},
        IndexCase{"total_size_string", R"({"metadata": {"total_size": "10"}, "weight_map": {}})",
                  "InvalidIndex"},
        IndexCase{"metadata_array", R"({"metadata": [], "weight_map": {}})", "InvalidIndex"},
        IndexCase{"nesting_bomb",
                  "{\"metadata\": " + std::string(1000, '[') + std::string(1000, ']') +
                      ", \"weight_map\": {}}",
                  "InvalidIndex"}),
    [](const ::testing::TestParamInfo<IndexCase>& p) { return p.param.name; });

TEST(HfIndexTest, EncodeRoundTrips) {
  HfIndex index;
  index.total_size = 42;
  index.weight_map = {{"b", "model-00002-of-00002.safetensors"},
                      {"a", "model-00001-of-00002.safetensors"}};
  auto parsed = ParseHfIndex(AsBytes(EncodeHfIndex(index)), "i");
  CKPT_ASSERT_OK(parsed);
  EXPECT_EQ(parsed->total_size, std::optional<uint64_t>(42));
  EXPECT_EQ(parsed->weight_map.size(), 2u);
  EXPECT_EQ(parsed->shards().size(), 2u);
}

TEST(HfIndexShardsTest, EachRuleOfIndexAgainstShardsIsDamageNamingIt) {
  HfIndex index;
  index.weight_map = {{"a", "s1.safetensors"}, {"b", "s2.safetensors"}};
  using Stored = std::vector<std::pair<std::string, std::string>>;
  EXPECT_THAT(CheckHfIndexAgainstShards(index, Stored{{"b", "s2.safetensors"}, {"a", "s1.safetensors"}},
                                        "idx"),
              IsOk());
  const std::pair<Stored, const char*> cases[] = {
      {{{"a", "s1.safetensors"}, {"b", "s2.safetensors"}, {"c", "s2.safetensors"}}, "UnlistedTensor"},
      {{{"a", "s1.safetensors"}, {"a", "s1.safetensors"}, {"b", "s2.safetensors"}}, "DuplicateTensor"},
      {{{"a", "s2.safetensors"}, {"b", "s2.safetensors"}}, "WrongShard"},
      {{{"a", "s1.safetensors"}}, "MissingTensor"},
  };
  for (const auto& [stored, rule] : cases) {
    const absl::Status s = CheckHfIndexAgainstShards(index, stored, "idx");
    EXPECT_THAT(s, StatusIs(absl::StatusCode::kDataLoss)) << rule;
    EXPECT_THAT(std::string(s.message()), HasSubstr(rule));
    EXPECT_THAT(std::string(s.message()), HasSubstr("idx"));
  }
}

}  // namespace
}  // namespace ckpt::formats
