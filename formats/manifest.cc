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
// The JSON's parser: formats/manifest_json.cc. Validation: formats/manifest_validate.cc.
#include "ckpt/formats/manifest.h"

#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "ckpt/base/checksum.h"
#include "ckpt/base/coding.h"
#include "ckpt/base/status_macros.h"
#include "formats/manifest_internal.h"

namespace ckpt::formats {
namespace {

using internal::Invalid;

absl::string_view Magic(ManifestKind kind) {
  return kind == ManifestKind::kManifest ? kManifestMagic : kPartMagic;
}

// JSON as nlohmann's dump(1) writes it (one space per level, each element on its own line,
// "key": value, empty containers as [] and {}), written straight into a string: building a DOM
// of a manifest of 60,000 tensors to dump it cost more than the rest of a save of them.
class PrettyJson {
 public:
  explicit PrettyJson(std::string* out) : out_(out) {}
  void BeginObject() { Open('{'); }
  void EndObject() { Close('}'); }
  void BeginArray() { Open('['); }
  void EndArray() { Close(']'); }
  // A key of the open object; its value comes next.
  void Key(absl::string_view key) {
    Element();
    Quoted(key);
    out_->append(": ");
    after_key_ = true;
  }
  void U64(uint64_t v) {
    Element();
    char digits[20];
    char* end = digits + sizeof(digits);
    char* at = end;
    do {
      *--at = static_cast<char>('0' + v % 10);
      v /= 10;
    } while (v != 0);
    out_->append(at, end);
  }
  // 16 lowercase hex digits, quoted.
  void Hex64(uint64_t v) {
    Element();
    char text[18];
    text[0] = text[17] = '"';
    for (int i = 16; i >= 1; --i, v >>= 4) text[i] = "0123456789abcdef"[v & 15];
    out_->append(text, sizeof(text));
  }
  void String(absl::string_view s) {
    Element();
    Quoted(s);
  }

 private:
  // Before a value or a key: the separator and indentation of the open container, if any.
  void Element() {
    if (after_key_) {
      after_key_ = false;
      return;
    }
    if (counts_.empty()) return;
    out_->append(counts_.back()++ == 0 ? "\n" : ",\n");
    out_->append(counts_.size(), ' ');
  }
  void Open(char c) {
    Element();
    out_->push_back(c);
    counts_.push_back(0);
  }
  void Close(char c) {
    if (counts_.back() != 0) {
      out_->push_back('\n');
      out_->append(counts_.size() - 1, ' ');
    }
    counts_.pop_back();
    out_->push_back(c);
  }
  // JSON escapes: quote, backslash and control characters; other bytes (UTF-8: IsValidName
  // requires it of names) as they are.
  void Quoted(absl::string_view s) {
    out_->push_back('"');
    for (char ch : s) {
      const unsigned char c = static_cast<unsigned char>(ch);
      switch (c) {
        case '"': out_->append("\\\""); break;
        case '\\': out_->append("\\\\"); break;
        case '\b': out_->append("\\b"); break;
        case '\t': out_->append("\\t"); break;
        case '\n': out_->append("\\n"); break;
        case '\f': out_->append("\\f"); break;
        case '\r': out_->append("\\r"); break;
        default:
          if (c < 0x20) {
            out_->append("\\u00");
            out_->push_back("0123456789abcdef"[c >> 4]);
            out_->push_back("0123456789abcdef"[c & 15]);
          } else {
            out_->push_back(ch);
          }
      }
    }
    out_->push_back('"');
  }

  std::string* out_;
  std::vector<uint64_t> counts_;  // Elements written so far in each open container.
  bool after_key_ = false;
};

}  // namespace

uint64_t TensorInfo::numel() const {
  uint64_t n = 1;
  for (uint64_t d : shape) n *= d;
  return n;
}

std::string EncodeManifest(const Manifest& m, ManifestKind kind) {
  // Keys in sorted order, as the DOM this once was dumped them (the format's bytes unchanged).
  std::string body;
  body.reserve(256 + 80 * m.tensors.size() + 160 * m.pieces.size() + 160 * m.blobs.size() +
               [&] {
                 size_t chunks = 0;
                 for (const DataFileInfo& f : m.files) chunks += f.chunks.size();
                 return 100 * chunks;
               }());
  PrettyJson w(&body);
  w.BeginObject();
  w.Key("blobs");
  w.BeginArray();
  for (const BlobInfo& b : m.blobs) {
    w.BeginObject();
    w.Key("chunk_count"), w.U64(b.chunk_count);
    w.Key("file"), w.U64(b.file);
    w.Key("first_chunk"), w.U64(b.first_chunk);
    w.Key("name"), w.String(b.name);
    w.Key("rank"), w.U64(b.rank);
    w.Key("size"), w.U64(b.size_bytes);
    w.EndObject();
  }
  w.EndArray();
  w.Key("files");
  w.BeginArray();
  for (const DataFileInfo& f : m.files) {
    w.BeginObject();
    w.Key("chunks");
    w.BeginArray();
    for (const ChunkInfo& c : f.chunks) {
      w.BeginArray();
      w.U64(c.offset), w.U64(c.stored_bytes), w.U64(c.raw_bytes);
      w.U64(static_cast<uint64_t>(c.codec));
      w.Hex64(c.checksum);
      w.EndArray();
    }
    w.EndArray();
    w.Key("name"), w.String(f.name);
    w.Key("rank"), w.U64(f.rank);
    w.Key("size"), w.U64(f.size_bytes);
    w.EndObject();
  }
  w.EndArray();
  w.Key("format"), w.String("ckpt");
  w.Key("pieces");
  w.BeginArray();
  for (const PieceInfo& p : m.pieces) {
    w.BeginObject();
    w.Key("begin"), w.U64(p.begin);
    w.Key("chunk_count"), w.U64(p.chunk_count);
    w.Key("chunk_elems"), w.U64(p.chunk_elems);
    w.Key("count"), w.U64(p.count);
    w.Key("file"), w.U64(p.file);
    w.Key("first_chunk"), w.U64(p.first_chunk);
    w.Key("rank"), w.U64(p.rank);
    w.Key("tensor"), w.U64(p.tensor);
    w.EndObject();
  }
  w.EndArray();
  w.Key("step"), w.U64(m.step);
  w.Key("tensors");
  w.BeginArray();
  for (const TensorInfo& t : m.tensors) {
    w.BeginObject();
    w.Key("dtype"), w.String(DTypeName(t.dtype));
    w.Key("name"), w.String(t.name);
    w.Key("shape");
    w.BeginArray();
    for (uint64_t d : t.shape) w.U64(d);
    w.EndArray();
    w.EndObject();
  }
  w.EndArray();
  w.Key("version"), w.U64(kFormatVersion);
  w.Key("world_size"), w.U64(m.world_size);
  w.EndObject();

  return internal::FrameManifestJson(body, kind, kFormatVersion);
}

std::string internal::FrameManifestJson(absl::string_view json, ManifestKind kind,
                                        uint32_t version) {
  std::string out(Magic(kind));
  PutFixed32(&out, version);
  PutFixed32(&out, 0);
  PutFixed64(&out, json.size());
  StreamingChecksum sum;
  sum.Update(AsBytes(out));
  sum.Update(AsBytes(json));
  PutFixed64(&out, sum.Digest());
  out.append(json.data(), json.size());
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
  CKPT_ASSIGN_OR_RETURN(Manifest m, internal::ParseManifestJson(
                                        AsStringView(bytes.subspan(kManifestHeaderBytes)), file));
  CKPT_RETURN_IF_ERROR(ValidateManifest(m, file));
  return m;
}

}  // namespace ckpt::formats
