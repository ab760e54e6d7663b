#include "ckpt/formats/manifest.h"

#include <functional>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "absl/strings/str_format.h"
#include "ckpt/base/checksum.h"
#include "ckpt/base/coding.h"
#include "formats/manifest_testing.h"
#include "tests/support/status_matchers.h"

namespace ckpt::formats {
namespace {

using ::ckpt::testing::IsOk;
using ::ckpt::testing::StatusIs;

using testing::Frame;
using testing::ValidManifest;

TEST(ManifestTest, RoundTripsEveryField) {
  Manifest m = ValidManifest();
  std::string bytes = EncodeManifest(m);
  absl::StatusOr<Manifest> parsed = ParseManifest(AsBytes(bytes), "MANIFEST");
  CKPT_ASSERT_OK(parsed);
  EXPECT_EQ(EncodeManifest(*parsed), bytes);
  EXPECT_EQ(parsed->step, 7u);
  EXPECT_EQ(parsed->files[0].chunks[1].checksum, 2u);
  EXPECT_EQ(parsed->tensors[1].numel(), 1u);
}

TEST(ManifestTest, RankPartHasItsOwnMagic) {
  std::string part = EncodeManifest(ValidManifest(), ManifestKind::kRankPart);
  EXPECT_THAT(ParseManifest(AsBytes(part), "p", ManifestKind::kRankPart), IsOk());
  EXPECT_THAT(ParseManifest(AsBytes(part), "p", ManifestKind::kManifest),
              StatusIs(absl::StatusCode::kDataLoss));
}

std::string JsonOf(const Manifest& m) { return EncodeManifest(m).substr(kManifestHeaderBytes); }

// The JSON of a manifest is what nlohmann's dump(1) of the same fields as a DOM writes (how
// it was encoded before it was written straight into a string): the format's bytes, key order
// and layout included, do not change; names with quotes, non-ASCII UTF-8, empty shapes and
// empty lists included.
TEST(ManifestTest, EncodingIsTheJsonDumpOfItsFields) {
  using nlohmann::json;
  Manifest m = ValidManifest();
  m.tensors.push_back({"quote\"d \xc3\xa9t\xc3\xa9 \xf0\x9f\x99\x82", DType::kBF16, {3, 1, 4}});
  m.step = ~0ull;
  for (const Manifest& each : {m, Manifest{}}) {
    json root = json::object();
    root["format"] = "ckpt";
    root["version"] = kFormatVersion;
    root["step"] = each.step;
    root["world_size"] = each.world_size;
    json tensors = json::array(), files = json::array(), pieces = json::array(),
         blobs = json::array();
    for (const TensorInfo& t : each.tensors) {
      tensors.push_back(
          {{"name", t.name}, {"dtype", std::string(DTypeName(t.dtype))}, {"shape", t.shape}});
    }
    for (const DataFileInfo& f : each.files) {
      json chunks = json::array();
      for (const ChunkInfo& c : f.chunks) {
        chunks.push_back(json::array({c.offset, c.stored_bytes, c.raw_bytes,
                                      static_cast<uint64_t>(c.codec),
                                      absl::StrFormat("%016x", c.checksum)}));
      }
      files.push_back(
          {{"name", f.name}, {"rank", f.rank}, {"size", f.size_bytes}, {"chunks", chunks}});
    }
    for (const PieceInfo& p : each.pieces) {
      pieces.push_back({{"tensor", p.tensor}, {"rank", p.rank}, {"begin", p.begin},
                        {"count", p.count}, {"file", p.file}, {"first_chunk", p.first_chunk},
                        {"chunk_count", p.chunk_count}, {"chunk_elems", p.chunk_elems}});
    }
    for (const BlobInfo& b : each.blobs) {
      blobs.push_back({{"name", b.name}, {"rank", b.rank}, {"file", b.file},
                       {"size", b.size_bytes}, {"first_chunk", b.first_chunk},
                       {"chunk_count", b.chunk_count}});
    }
    root["tensors"] = tensors;
    root["files"] = files;
    root["pieces"] = pieces;
    root["blobs"] = blobs;
    EXPECT_EQ(JsonOf(each), root.dump(1));
  }
  m.tensors.back().name = "tab\there";  // Escaped as JSON requires (IsValidName refuses it).
  EXPECT_THAT(JsonOf(m), ::testing::HasSubstr("\"tab\\there\""));
}

struct BadCase {
  std::string rule;
  std::function<std::string()> bytes;
  absl::StatusCode code = absl::StatusCode::kDataLoss;
};

std::string Mutated(const std::function<void(Manifest&)>& change) {
  Manifest m = ValidManifest();
  change(m);
  return Frame(JsonOf(m));
}

std::string ReplaceInJson(const std::string& from, const std::string& to) {
  std::string json = JsonOf(ValidManifest());
  size_t pos = json.find(from);
  if (pos == std::string::npos) return "not found: " + from;
  json.replace(pos, from.size(), to);
  return Frame(json);
}

class MalformedManifestTest : public ::testing::TestWithParam<BadCase> {};

TEST_P(MalformedManifestTest, IsRejectedWithAClearError) {
  std::string bytes = GetParam().bytes();
  absl::StatusOr<Manifest> parsed = ParseManifest(AsBytes(bytes), "step-7/MANIFEST");
  ASSERT_THAT(parsed, StatusIs(GetParam().code)) << GetParam().rule;
  EXPECT_THAT(std::string(parsed.status().message()), ::testing::HasSubstr("step-7/MANIFEST"));
}

const BadCase kBadCases[] = {
    {"empty input", [] { return std::string(); }},
    {"truncated header", [] { return EncodeManifest(ValidManifest()).substr(0, 20); }},
    {"truncated json",
     [] {
       std::string b = EncodeManifest(ValidManifest());
       return b.substr(0, b.size() - 3);
     }},
    {"trailing garbage", [] { return EncodeManifest(ValidManifest()) + "x"; }},
    {"bad magic",
     [] {
       std::string b = EncodeManifest(ValidManifest());
       b[0] = 'X';
       return b;
     }},
    {"wrong checksum",
     [] {
       std::string b = EncodeManifest(ValidManifest());
       b[40] ^= 1;
       return b;
     }},
    {"absurd json length",
     [] {
       std::string b = EncodeManifest(ValidManifest());
       b[23] = '\x7f';
       return b;
     }},
    {"newer version", [] { return Frame(JsonOf(ValidManifest()), 2); },
     absl::StatusCode::kUnimplemented},
    {"not json", [] { return Frame("{\"format\": "); }},
    {"byte-order mark before the json",
     [] { return Frame("\xEF\xBB\xBF" + JsonOf(ValidManifest())); }},
    {"json array at top", [] { return Frame("[1, 2]"); }},
    {"nesting bomb", [] { return Frame(std::string(100000, '[') + std::string(100000, ']')); }},
    {"format field wrong", [] { return ReplaceInJson("\"ckpt\"", "\"nope\""); }},
    {"negative step", [] { return ReplaceInJson("\"step\": 7", "\"step\": -7"); }},
    {"float step", [] { return ReplaceInJson("\"step\": 7", "\"step\": 7.5"); }},
    {"string step", [] { return ReplaceInJson("\"step\": 7", "\"step\": \"7\""); }},
    {"missing tensors", [] { return ReplaceInJson("\"tensors\"", "\"tensorz\""); }},
    {"world size zero", [] { return Mutated([](Manifest& m) { m.world_size = 0; }); }},
    {"unknown dtype", [] { return ReplaceInJson("\"F32\"", "\"F31\""); }},
    {"tensor name with slash",
     [] { return Mutated([](Manifest& m) { m.tensors[0].name = "a/b"; }); }},
    {"tensor name with dotdot",
     [] { return Mutated([](Manifest& m) { m.tensors[0].name = "a..b"; }); }},
    {"empty tensor name", [] { return Mutated([](Manifest& m) { m.tensors[0].name = ""; }); }},
    {"duplicate tensor", [] { return Mutated([](Manifest& m) { m.tensors[1].name = "w"; }); }},
    {"shape product overflows",
     [] { return Mutated([](Manifest& m) {
            m.tensors[0].shape = {1ull << 40, 1ull << 40};
          }); }},
    {"byte size overflows",
     [] { return Mutated([](Manifest& m) {
            m.tensors[0].shape = {1ull << 49, 4};
          }); }},
    {"file name with slash",
     [] { return Mutated([](Manifest& m) { m.files[0].name = "../rank-00000.data"; }); }},
    {"file rank outside world", [] { return Mutated([](Manifest& m) { m.files[1].rank = 2; }); }},
    {"two files for one rank", [] { return Mutated([](Manifest& m) { m.files[1].rank = 0; }); }},
    {"chunk misaligned",
     [] { return Mutated([](Manifest& m) { m.files[0].chunks[1].offset += 1; }); }},
    {"chunk past end of file",
     [] { return Mutated([](Manifest& m) { m.files[0].size_bytes = 3 * kBlockBytes; }); }},
    {"file longer than its chunks",
     [] { return Mutated([](Manifest& m) { m.files[0].size_bytes += kBlockBytes; }); }},
    {"absurd chunk size",
     [] { return Mutated([](Manifest& m) { m.files[0].chunks[0].stored_bytes = 1ull << 62; }); }},
    {"raw chunk sizes disagree",
     [] { return Mutated([](Manifest& m) { m.files[0].chunks[0].stored_bytes = 20; }); }},
    {"unknown codec", [] { return ReplaceInJson("24,\n    0,", "24,\n    9,"); }},
    {"checksum not hex",
     [] { return ReplaceInJson("\"0000000000000001\"", "\"000000000000000g\""); }},
    {"chunk entry too short", [] { return ReplaceInJson("\"0000000000000001\"", "1"); }},
    {"piece outside tensor", [] { return Mutated([](Manifest& m) { m.pieces[1].begin = 7; }); }},
    {"piece begin past end",
     [] { return Mutated([](Manifest& m) { m.pieces[1].begin = ~0ull - 1; }); }},
    {"empty piece", [] { return Mutated([](Manifest& m) { m.pieces[1].count = 0; }); }},
    {"overlapping pieces",
     [] {
       return Mutated([](Manifest& m) {
         m.pieces[1].begin = 5;
         m.pieces[1].count = 4;
         m.files[0].chunks[1].raw_bytes = m.files[0].chunks[1].stored_bytes = 16;
       });
     }},
    {"piece names no tensor", [] { return Mutated([](Manifest& m) { m.pieces[0].tensor = 9; }); }},
    {"piece in another rank's file",
     [] { return Mutated([](Manifest& m) { m.pieces[2].file = 0; }); }},
    {"piece chunks outside file",
     [] { return Mutated([](Manifest& m) { m.pieces[1].first_chunk = 3; }); }},
    {"piece chunk count wrong",
     [] { return Mutated([](Manifest& m) { m.pieces[1].chunk_count = 2; }); }},
    {"piece chunk holds wrong bytes",
     [] {
       return Mutated([](Manifest& m) {
         m.pieces[1].count = 3;
         m.pieces[1].chunk_elems = 3;
       });
     }},
    {"zero chunk elems", [] { return Mutated([](Manifest& m) { m.pieces[0].chunk_elems = 0; }); }},
    {"two owners of one chunk",
     [] {
       return Mutated([](Manifest& m) {
         m.blobs[0].first_chunk = 1;
         m.blobs[0].size_bytes = 16;
       });
     }},
    {"chunk without owner", [] { return Mutated([](Manifest& m) { m.blobs.clear(); }); }},
    {"blob size wrong", [] { return Mutated([](Manifest& m) { m.blobs[0].size_bytes = 6; }); }},
    {"blob name with slash",
     [] { return Mutated([](Manifest& m) { m.blobs[0].name = "/etc/passwd"; }); }},
    {"duplicate blob", [] { return Mutated([](Manifest& m) { m.blobs.push_back(m.blobs[0]); }); }},
};

INSTANTIATE_TEST_SUITE_P(Rules, MalformedManifestTest, ::testing::ValuesIn(kBadCases),
                         [](const ::testing::TestParamInfo<BadCase>& p) {
                           std::string name;
                           for (char c : p.param.rule)
                             name.push_back(isalnum(static_cast<unsigned char>(c)) ? c : '_');
                           return name;
                         });

TEST(ManifestTest, EveryTruncationIsRejected) {
  std::string bytes = EncodeManifest(ValidManifest());
  for (size_t n = 0; n < bytes.size(); ++n) {
    EXPECT_THAT(ParseManifest(AsBytes(bytes).first(n), "m"), StatusIs(absl::StatusCode::kDataLoss))
        << n;
  }
}

TEST(ManifestTest, ChunkElemsLargerThanThePieceIsOneChunk) {
  Manifest m = ValidManifest();
  m.pieces[0].chunk_elems = ~0ull;  // Readers must not overflow computing chunk bounds.
  EXPECT_THAT(ParseManifest(AsBytes(EncodeManifest(m)), "m"), IsOk());
}

// A tensor of more dimensions than the parser reads back is refused before it is written: a
// committed manifest must always parse (ckpt.dcp committed a 65-dimension tensor it could not
// read back).
TEST(ManifestTest, ATensorOfMoreDimensionsThanTheParserReadsIsRefusedBeforeWriting) {
  Manifest m = ValidManifest();
  m.tensors[1].shape.assign(64, 1);
  EXPECT_THAT(ValidateManifest(m, "m"), IsOk());
  EXPECT_THAT(ParseManifest(AsBytes(EncodeManifest(m)), "m"), IsOk());
  m.tensors[1].shape.assign(65, 1);
  EXPECT_THAT(ValidateManifest(m, "m"), StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_THAT(ParseManifest(AsBytes(EncodeManifest(m)), "m"),
              StatusIs(absl::StatusCode::kDataLoss));
}

TEST(NameTest, AcceptsDottedModelNamesAndRejectsPaths) {
  EXPECT_TRUE(IsValidName("model.layers.0.mlp.weight"));
  EXPECT_FALSE(IsValidName(".."));
  EXPECT_FALSE(IsValidName("."));
  EXPECT_FALSE(IsValidName("a/b"));
  EXPECT_FALSE(IsValidName(std::string("a\0b", 3)));
}

TEST(NameTest, AcceptsUtf8AndRejectsOtherBytes) {
  EXPECT_TRUE(IsValidName("caf\xc3\xa9.\xe4\xb8\xad.\xf0\x9f\x99\x82.\xf4\x8f\xbf\xbf"));
  for (const char* bad : {"\xff", "latin1 caf\xe9", "\xc0\x80", "\xc3", "\xe2\x82",
                          "\xed\xa0\x80", "\xe0\x80\x80", "\xf0\x80\x80\x80",
                          "\xf4\x90\x80\x80", "\x80", "\xc3\xa9\xa9"}) {
    EXPECT_FALSE(IsValidName(bad)) << bad;
  }
}

}  // namespace
}  // namespace ckpt::formats
