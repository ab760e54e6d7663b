// MANIFEST and rank-part encoding, format v1. Integers little-endian.
//
//   manifest := magic:u8[8] version:u32 reserved:u32(=0) json_bytes:u64 checksum:u64 json
//     magic    "CKPTMANI" for a committed MANIFEST, "CKPTPART" for a rank's part
//     checksum XXH3-64 of the first 24 header bytes followed by the json bytes
//     json     UTF-8 JSON, exactly json_bytes long, nesting depth at most 16:
//   {"format": "ckpt", "version": 1, "step": u64, "world_size": u32,
//    "tensors": [{"name": str, "dtype": "F32"|"BF16"|..., "shape": [u64...]}],
//    "files":   [{"name": str, "rank": u32, "size": u64,
//                 "chunks": [[offset, stored_bytes, raw_bytes, codec, "xxh3 as 16 hex"]...]}],
//    "pieces":  [{"tensor": index, "rank": u32, "begin": u64, "count": u64, "file": index,
//                 "first_chunk": u64, "chunk_count": u64, "chunk_elems": u64}],
//    "blobs":   [{"name": str, "rank": u32, "file": index, "size": u64,
//                 "first_chunk": u64, "chunk_count": u64}]}
//
// Validation: formats/manifest_validate.cc.
#include "ckpt/formats/manifest.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <set>

#include <nlohmann/json.hpp>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "ckpt/base/checksum.h"
#include "ckpt/base/coding.h"
#include "ckpt/base/status_macros.h"
#include "formats/manifest_internal.h"
#include "formats/strict_json.h"

namespace ckpt::formats {
namespace {

using internal::Invalid;
using internal::kMaxWorldSize;
using nlohmann::json;

constexpr int kMaxJsonDepth = 16;
constexpr uint64_t kMaxRank = 64;  // dims of a tensor

absl::string_view Magic(ManifestKind kind) {
  return kind == ManifestKind::kManifest ? kManifestMagic : kPartMagic;
}

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

json ChunkToJson(const ChunkInfo& c) {
  return json::array({c.offset, c.stored_bytes, c.raw_bytes, static_cast<uint64_t>(c.codec),
                      absl::StrFormat("%016x", c.checksum)});
}

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

}  // namespace

uint64_t TensorInfo::numel() const {
  uint64_t n = 1;
  for (uint64_t d : shape) n *= d;
  return n;
}

std::string EncodeManifest(const Manifest& m, ManifestKind kind) {
  json root = json::object();
  root["format"] = "ckpt";
  root["version"] = kFormatVersion;
  root["step"] = m.step;
  root["world_size"] = m.world_size;
  json tensors = json::array();
  for (const TensorInfo& t : m.tensors) {
    tensors.push_back(
        {{"name", t.name}, {"dtype", std::string(DTypeName(t.dtype))}, {"shape", t.shape}});
  }
  json files = json::array();
  for (const DataFileInfo& f : m.files) {
    json chunks = json::array();
    for (const ChunkInfo& c : f.chunks) chunks.push_back(ChunkToJson(c));
    files.push_back(
        {{"name", f.name}, {"rank", f.rank}, {"size", f.size_bytes}, {"chunks", chunks}});
  }
  json pieces = json::array();
  for (const PieceInfo& p : m.pieces) {
    pieces.push_back({{"tensor", p.tensor},
                      {"rank", p.rank},
                      {"begin", p.begin},
                      {"count", p.count},
                      {"file", p.file},
                      {"first_chunk", p.first_chunk},
                      {"chunk_count", p.chunk_count},
                      {"chunk_elems", p.chunk_elems}});
  }
  json blobs = json::array();
  for (const BlobInfo& b : m.blobs) {
    blobs.push_back({{"name", b.name},
                     {"rank", b.rank},
                     {"file", b.file},
                     {"size", b.size_bytes},
                     {"first_chunk", b.first_chunk},
                     {"chunk_count", b.chunk_count}});
  }
  root["tensors"] = std::move(tensors);
  root["files"] = std::move(files);
  root["pieces"] = std::move(pieces);
  root["blobs"] = std::move(blobs);
  // Replacement of invalid UTF-8 keeps dump() from aborting under -fno-exceptions; names are
  // validated before they get here, so it never changes a valid manifest.
  std::string body = root.dump(1, ' ', false, json::error_handler_t::replace);

  std::string out(Magic(kind));
  PutFixed32(&out, kFormatVersion);
  PutFixed32(&out, 0);
  PutFixed64(&out, body.size());
  StreamingChecksum sum;
  sum.Update(AsBytes(out));
  sum.Update(AsBytes(body));
  PutFixed64(&out, sum.Digest());
  out += body;
  return out;
}

absl::StatusOr<Manifest> ParseManifest(std::span<const std::byte> bytes, absl::string_view file,
                                       ManifestKind kind) {
  if (bytes.size() < kManifestHeaderBytes) {
    return Invalid(file, absl::StrCat("truncated: ", bytes.size(), " bytes, header needs ",
                                      kManifestHeaderBytes));
  }
  absl::string_view magic = Magic(kind);
  if (std::memcmp(bytes.data(), magic.data(), magic.size()) != 0) {
    return Invalid(file, absl::StrCat("bad magic at offset 0 (want ", magic, ")"));
  }
  uint64_t json_bytes = DecodeFixed64(bytes.data() + 16);
  if (json_bytes > kMaxManifestBytes || json_bytes != bytes.size() - kManifestHeaderBytes) {
    return Invalid(file, absl::StrCat("header claims ", json_bytes, " JSON bytes but ",
                                      bytes.size() - kManifestHeaderBytes, " follow offset 32"));
  }
  StreamingChecksum sum;
  sum.Update(bytes.first(24));
  sum.Update(bytes.subspan(kManifestHeaderBytes));
  if (sum.Digest() != DecodeFixed64(bytes.data() + 24)) {
    return Invalid(file, "checksum mismatch over header and JSON (offset 0..end)");
  }
  uint32_t version = DecodeFixed32(bytes.data() + 8);
  if (version != kFormatVersion) {
    return absl::UnimplementedError(
        absl::StrCat(file, ": manifest format version ", version, " is not supported"));
  }
  absl::string_view text = AsStringView(bytes.subspan(kManifestHeaderBytes));
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

}  // namespace ckpt::formats
