// ParseManifest parses a manifest's JSON on SAX events, straight into a Manifest. Before, it
// built a DOM and walked it; that walk is kept here, verbatim, as the oracle: on every
// mutation of a valid manifest below (each value replaced by every JSON type and by integers
// at the limits, each key removed, unknown keys with nested values added, elements added and
// removed, keys repeated, other top-level values) both accept the same Manifest or refuse
// with the same message.
#include <functional>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "ckpt/base/checksum.h"
#include "ckpt/base/coding.h"
#include "ckpt/base/status_macros.h"
#include "ckpt/formats/manifest.h"
#include "formats/manifest_internal.h"
#include "formats/manifest_testing.h"
#include "formats/strict_json.h"

namespace ckpt::formats {
namespace {

using internal::Invalid;
using internal::kMaxWorldSize;
using nlohmann::json;

constexpr int kMaxJsonDepth = 16;
constexpr uint64_t kMaxRank = 64;

// Reads JSON fields with type checks; the first failure is kept and names the field.
class Reader {
 public:
  explicit Reader(std::string file) : file_(std::move(file)) {}
  absl::Status status() const { return status_; }

  const json* Field(const json& obj, const char* key, absl::string_view where) {
    if (!status_.ok()) return nullptr;
    if (!obj.is_object()) return Fail(where, "is not an object");
    auto it = obj.find(key);
    if (it == obj.end()) return Fail(where, absl::StrCat("lacks \"", key, "\""));
    return &*it;
  }
  uint64_t U64(const json& obj, const char* key, absl::string_view where, uint64_t max = ~0ull) {
    const json* v = Field(obj, key, where);
    if (v == nullptr) return 0;
    return U64Value(*v, absl::StrCat(where, ".", key), max);
  }
  uint64_t U64Value(const json& v, absl::string_view where, uint64_t max = ~0ull) {
    if (!status_.ok()) return 0;
    if (!v.is_number_unsigned()) return Fail(where, "is not an unsigned integer"), 0;
    uint64_t x = v.get<uint64_t>();
    if (x > max) return Fail(where, absl::StrCat("is ", x, ", above the limit ", max)), 0;
    return x;
  }
  std::string Str(const json& obj, const char* key, absl::string_view where) {
    const json* v = Field(obj, key, where);
    if (v == nullptr) return {};
    if (!v->is_string()) return Fail(absl::StrCat(where, ".", key), "is not a string"), "";
    return v->get_ref<const std::string&>();
  }
  const json* Array(const json& obj, const char* key, absl::string_view where) {
    const json* v = Field(obj, key, where);
    if (v == nullptr) return nullptr;
    if (!v->is_array()) return Fail(absl::StrCat(where, ".", key), "is not an array");
    return v;
  }
  std::nullptr_t Fail(absl::string_view where, absl::string_view what) {
    if (status_.ok()) status_ = absl::DataLossError(absl::StrCat(file_, ": ", where, " ", what));
    return nullptr;
  }

 private:
  std::string file_;
  absl::Status status_;
};

bool ParseHex64(absl::string_view s, uint64_t* out) {
  if (s.size() != 16) return false;
  for (char c : s) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return absl::SimpleHexAtoi(s, out);
}

void ParseTensors(Reader& r, const json& root, Manifest* m) {
  const json* tensors = r.Array(root, "tensors", "manifest");
  if (tensors == nullptr) return;
  for (size_t i = 0; i < tensors->size() && r.status().ok(); ++i) {
    const json& t = (*tensors)[i];
    std::string where = absl::StrCat("tensors[", i, "]");
    TensorInfo info;
    info.name = r.Str(t, "name", where);
    std::string dtype = r.Str(t, "dtype", where);
    if (!r.status().ok()) return;
    absl::StatusOr<DType> parsed = ParseDType(dtype);
    if (!parsed.ok()) return void(r.Fail(where, absl::StrCat("has unknown dtype \"", dtype, "\"")));
    info.dtype = *parsed;
    const json* shape = r.Array(t, "shape", where);
    if (shape == nullptr) return;
    if (shape->size() > kMaxRank) return void(r.Fail(where, "has too many dimensions"));
    for (size_t d = 0; d < shape->size(); ++d) {
      info.shape.push_back(r.U64Value((*shape)[d], absl::StrCat(where, ".shape[", d, "]")));
    }
    m->tensors.push_back(std::move(info));
  }
}

void ParseFiles(Reader& r, const json& root, Manifest* m) {
  const json* files = r.Array(root, "files", "manifest");
  if (files == nullptr) return;
  for (size_t i = 0; i < files->size() && r.status().ok(); ++i) {
    const json& f = (*files)[i];
    std::string where = absl::StrCat("files[", i, "]");
    DataFileInfo info;
    info.name = r.Str(f, "name", where);
    info.rank = static_cast<uint32_t>(r.U64(f, "rank", where, kMaxWorldSize));
    info.size_bytes = r.U64(f, "size", where);
    const json* chunks = r.Array(f, "chunks", where);
    if (chunks == nullptr) return;
    for (size_t c = 0; c < chunks->size() && r.status().ok(); ++c) {
      const json& e = (*chunks)[c];
      std::string cw = absl::StrCat(where, ".chunks[", c, "]");
      if (!e.is_array() || e.size() != 5) return void(r.Fail(cw, "is not a 5-element array"));
      ChunkInfo ci;
      ci.offset = r.U64Value(e[0], cw);
      ci.stored_bytes = r.U64Value(e[1], cw, kMaxChunkBytes);
      ci.raw_bytes = r.U64Value(e[2], cw, kMaxChunkBytes);
      ci.codec = static_cast<Codec>(r.U64Value(e[3], cw, 1));
      if (!r.status().ok()) return;
      if (!e[4].is_string() || !ParseHex64(e[4].get_ref<const std::string&>(), &ci.checksum)) {
        return void(r.Fail(cw, "has a checksum that is not 16 lowercase hex digits"));
      }
      info.chunks.push_back(ci);
    }
    m->files.push_back(std::move(info));
  }
}

void ParsePieces(Reader& r, const json& root, Manifest* m) {
  const json* pieces = r.Array(root, "pieces", "manifest");
  if (pieces == nullptr) return;
  for (size_t i = 0; i < pieces->size() && r.status().ok(); ++i) {
    const json& p = (*pieces)[i];
    std::string where = absl::StrCat("pieces[", i, "]");
    PieceInfo info;
    info.tensor = static_cast<uint32_t>(r.U64(p, "tensor", where, UINT32_MAX));
    info.rank = static_cast<uint32_t>(r.U64(p, "rank", where, kMaxWorldSize));
    info.begin = r.U64(p, "begin", where);
    info.count = r.U64(p, "count", where);
    info.file = static_cast<uint32_t>(r.U64(p, "file", where, UINT32_MAX));
    info.first_chunk = r.U64(p, "first_chunk", where);
    info.chunk_count = r.U64(p, "chunk_count", where);
    info.chunk_elems = r.U64(p, "chunk_elems", where);
    m->pieces.push_back(info);
  }
}

void ParseBlobs(Reader& r, const json& root, Manifest* m) {
  const json* blobs = r.Array(root, "blobs", "manifest");
  if (blobs == nullptr) return;
  for (size_t i = 0; i < blobs->size() && r.status().ok(); ++i) {
    const json& b = (*blobs)[i];
    std::string where = absl::StrCat("blobs[", i, "]");
    BlobInfo info;
    info.name = r.Str(b, "name", where);
    info.rank = static_cast<uint32_t>(r.U64(b, "rank", where, kMaxWorldSize));
    info.file = static_cast<uint32_t>(r.U64(b, "file", where, UINT32_MAX));
    info.size_bytes = r.U64(b, "size", where);
    info.first_chunk = r.U64(b, "first_chunk", where);
    info.chunk_count = r.U64(b, "chunk_count", where);
    m->blobs.push_back(std::move(info));
  }
}


absl::StatusOr<Manifest> ParseByDomWalk(absl::string_view text, absl::string_view file) {
  internal::StrictJson parsed = internal::ParseStrictJson(text, kMaxJsonDepth);
  if (parsed.too_deep) return Invalid(file, "JSON nests too deeply");
  if (!parsed.duplicate.empty()) {
    return Invalid(file, absl::StrCat("key \"", parsed.duplicate, "\" appears twice"));
  }
  if (!parsed.ok()) return Invalid(file, "JSON does not parse");
  const json& root = parsed.value;

  Reader r{std::string(file)};
  Manifest m;
  if (r.Str(root, "format", "manifest") != "ckpt" && r.status().ok()) {
    return Invalid(file, "JSON format field is not \"ckpt\"");
  }
  if (r.U64(root, "version", "manifest") != kFormatVersion && r.status().ok()) {
    return Invalid(file, "JSON version disagrees with the header");
  }
  m.step = r.U64(root, "step", "manifest");
  m.world_size = static_cast<uint32_t>(r.U64(root, "world_size", "manifest", kMaxWorldSize));
  ParseTensors(r, root, &m);
  ParseFiles(r, root, &m);
  ParsePieces(r, root, &m);
  ParseBlobs(r, root, &m);
  CKPT_RETURN_IF_ERROR(r.status());
  CKPT_RETURN_IF_ERROR(ValidateManifest(m, file));
  return m;
}

using testing::Frame;

// Both parsers on `text`: the same manifest, or the same error.
void ExpectSame(const std::string& text, const std::string& what) {
  absl::StatusOr<Manifest> walked = ParseByDomWalk(text, "M");
  const std::string framed = Frame(text);
  absl::StatusOr<Manifest> parsed = ParseManifest(AsBytes(framed), "M");
  ASSERT_EQ(parsed.ok(), walked.ok()) << what << "\n" << parsed.status() << "\n"
                                      << walked.status() << "\n" << text;
  if (parsed.ok()) {
    EXPECT_EQ(EncodeManifest(*parsed), EncodeManifest(*walked)) << what;
  } else {
    EXPECT_EQ(parsed.status(), walked.status()) << what << "\n" << text;
  }
}

// Every value of `node`, by pointer, with a name for the failure message.
void Values(json& node, const std::string& path, std::vector<std::pair<json*, std::string>>* out) {
  out->push_back({&node, path});
  if (node.is_object()) {
    for (auto& [k, v] : node.items()) Values(v, path + "." + k, out);
  } else if (node.is_array()) {
    for (size_t i = 0; i < node.size(); ++i) Values(node[i], absl::StrCat(path, "[", i, "]"), out);
  }
}

TEST(ManifestParseTest, AgreesWithTheDomWalkOnEveryMutation) {
  const std::string valid =
      EncodeManifest(testing::ValidManifest()).substr(kManifestHeaderBytes);
  ExpectSame(valid, "valid");
  const json replacements[] = {
      json("x"), json(-1), json(1.5), json(true), json(nullptr), json::object(), json::array(),
      json::array({1}), json::parse(R"({"a": {"b": [1, {"c": 2}]}})"), json(0),
      json(~0ull), json(uint64_t{1} << 20), json((uint64_t{1} << 20) + 1), json(UINT32_MAX),
      json(uint64_t{UINT32_MAX} + 1), json(kMaxChunkBytes + 1), json(2), json("F32"),
      json("0000000000000001"), json("000000000000000G"), json::array({1, 2, 3, 4, "0000000000000009"}),
      json::array({4096, 1, 1, 0, "0000000000000009", 5}), json(std::vector<uint64_t>(65, 1)),
      json(std::vector<uint64_t>(64, 1)), json::array({1, "x"}), json::object({{"name", "q"}})};
  const json base = json::parse(valid);
  size_t values = 0;
  {
    json probe = base;
    std::vector<std::pair<json*, std::string>> all;
    Values(probe, "$", &all);
    values = all.size();
  }
  ASSERT_GT(values, 80u);
  for (size_t i = 0; i < values; ++i) {
    for (const json& with : replacements) {
      json doc = base;
      std::vector<std::pair<json*, std::string>> all;
      Values(doc, "$", &all);
      *all[i].first = with;
      ExpectSame(doc.dump(1), absl::StrCat(all[i].second, " = ", with.dump()));
    }
    json doc = base;
    std::vector<std::pair<json*, std::string>> all;
    Values(doc, "$", &all);
    json& node = *all[i].first;
    if (node.is_object()) {
      std::vector<std::string> keys;
      for (auto it = node.begin(); it != node.end(); ++it) keys.push_back(it.key());
      for (const std::string& k : keys) {
        json without = doc;
        std::vector<std::pair<json*, std::string>> again;
        Values(without, "$", &again);
        again[i].first->erase(k);
        ExpectSame(without.dump(1), absl::StrCat(all[i].second, " without ", k));
      }
      json extra = doc;
      std::vector<std::pair<json*, std::string>> again;
      Values(extra, "$", &again);
      (*again[i].first)["zz_unknown"] = json::parse(R"([{"a": 1, "b": [2, {"c": null}]}])");
      ExpectSame(extra.dump(1), absl::StrCat(all[i].second, " with an unknown key"));
    } else if (node.is_array()) {
      for (int change : {0, 1, 2}) {
        json edited = doc;
        std::vector<std::pair<json*, std::string>> again;
        Values(edited, "$", &again);
        json& a = *again[i].first;
        if (change == 0) a.push_back(a.empty() ? json(1) : a[0]);
        if (change == 1 && !a.empty()) a.erase(a.size() - 1);
        if (change == 2) a.push_back(json::object({{"k", 1}}));
        ExpectSame(edited.dump(1), absl::StrCat(all[i].second, " edit ", change));
      }
    }
  }
  // Text the DOM cannot hold: repeated keys (root, record, chunk list, unknown object), other
  // top-level values, depth, syntax.
  const std::string repeated[][2] = {
      {"{\n \"blobs\"", "{\n \"step\": 7,\n \"step\": 7,\n \"blobs\""},
      {"\"name\": \"w\"", "\"name\": \"w\", \"name\": \"w\""},
      {"\"name\": \"w\"", "\"name\": \"w\", \"q\": {\"a\": 1, \"a\": 2}"},
      {"\"name\": \"w\"", "\"name\": \"w\", \"q\": 1, \"q\": 2"},
      {"\"chunk_count\": 1,", "\"chunk_count\": 1, \"chunk_count\": 1,"},
      {"\"size\": 8192", "\"size\": 8192, \"x\": [[{\"y\": 1, \"y\": 1}]]"},
  };
  for (const auto& [from, to] : repeated) {
    ASSERT_NE(valid.find(from), std::string::npos) << from;
    ExpectSame(absl::StrReplaceAll(valid, {{from, to}}), to);
  }
  for (const std::string& text : std::vector<std::string>{
           "[]", "1", "\"s\"", "null", "{}", "", "{", "{\"format\": \"ckpt\",}",
        std::string(15, '[') + std::string(15, ']'), std::string(16, '[') + std::string(16, ']'),
        std::string(17, '[') + std::string(17, ']'), valid + " x", valid + " ",
        "{\"a\": " + std::string(15, '[') + std::string(15, ']') + "}",
        "{\"tensors\": [" + std::string(14, '[') + std::string(14, ']') + "]}"}) {
    ExpectSame(text, text.substr(0, 40));
  }
}

}  // namespace
}  // namespace ckpt::formats
