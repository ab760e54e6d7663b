// A manifest's JSON (formats/manifest.cc has the format) parsed straight into a Manifest on
// SAX events, under StrictSax's rules: no DOM (a manifest of 60,000 tensors built one at several
// allocations per field, most of what a load of it cost). The fields are checked as the walk of
// a DOM checked them (formats/manifest_parse_test.cc keeps that walk as the oracle), and the
// first error in that walk's order is the one reported: the root's format, version, step and
// world_size, then each section in turn (tensors, files, pieces, blobs), its records in order,
// each record's fields in a fixed order. Keys outside the schema are allowed and skipped.
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "ckpt/base/status_macros.h"
#include "ckpt/formats/manifest.h"
#include "formats/manifest_internal.h"
#include "formats/strict_json.h"

namespace ckpt::formats {
namespace {

using internal::Invalid;
using internal::kMaxRank;
using internal::kMaxWorldSize;

constexpr int kMaxJsonDepth = 16;

bool ParseHex64(absl::string_view s, uint64_t* out) {
  if (s.size() != 16) return false;
  for (char c : s) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return absl::SimpleHexAtoi(s, out);
}

enum class Kind : uint8_t { kAbsent, kUnsigned, kString, kArray, kOther };
struct Value {
  Value() = default;
  explicit Value(Kind k, uint64_t x = 0, std::string text = {})
      : kind(k), u(x), s(std::move(text)) {}
  Kind kind = Kind::kAbsent;
  uint64_t u = 0;
  std::string s;
};

enum Section { kTensors, kFiles, kPieces, kBlobs, kSectionCount };
constexpr const char* kSectionNames[kSectionCount] = {"tensors", "files", "pieces", "blobs"};
// Each object's known keys, by index into its Value slots. The root's sections are its slots
// kFirstSection on, in Section order.
constexpr int kMaxFields = 8;
constexpr const char* kRootFields[kMaxFields] = {"format", "version", "step", "world_size",
                                                 "tensors", "files", "pieces", "blobs"};
constexpr const char* kTensorFields[kMaxFields] = {"name", "dtype", "shape"};
constexpr const char* kFileFields[kMaxFields] = {"name", "rank", "size", "chunks"};
constexpr const char* kPieceFields[kMaxFields] = {"tensor", "rank", "begin", "count",
                                                  "file", "first_chunk", "chunk_count",
                                                  "chunk_elems"};
constexpr const char* kBlobFields[kMaxFields] = {"name", "rank", "file", "size",
                                                 "first_chunk", "chunk_count"};
constexpr const char* const* kRecordFields[kSectionCount] = {kTensorFields, kFileFields,
                                                             kPieceFields, kBlobFields};
constexpr int kFirstSection = 4;  // Of the root.
constexpr int kShapeField = 2;   // Of a tensor.
constexpr int kChunksField = 3;  // Of a file.

// The fields of one object, checked in the order they are asked for; the first failure is
// kept, as "<where> <what>" (where: "manifest", "tensors[3]", ...). `where` is called only to
// name a failure, and must outlive this.
class Fields {
 public:
  Fields(Value* values, std::string* error, absl::FunctionRef<std::string()> where)
      : values_(values), error_(error), where_(where) {}
  bool ok() const { return error_->empty(); }
  uint64_t U64(int i, const char* key, uint64_t max = ~0ull) {
    const Value& v = values_[i];
    if (!Present(v, key)) return 0;
    if (v.kind != Kind::kUnsigned) return Fail(absl::StrCat(where_(), ".", key), "is not an unsigned integer"), 0;
    if (v.u > max) {
      return Fail(absl::StrCat(where_(), ".", key), absl::StrCat("is ", v.u, ", above the limit ", max)), 0;
    }
    return v.u;
  }
  std::string Str(int i, const char* key) {
    Value& v = values_[i];
    if (!Present(v, key)) return {};
    if (v.kind != Kind::kString) return Fail(absl::StrCat(where_(), ".", key), "is not a string"), "";
    return std::move(v.s);
  }
  bool Array(int i, const char* key) {
    const Value& v = values_[i];
    if (!Present(v, key)) return false;
    if (v.kind != Kind::kArray) return Fail(absl::StrCat(where_(), ".", key), "is not an array"), false;
    return true;
  }
  void Fail(absl::string_view at, absl::string_view what) {
    if (error_->empty()) *error_ = absl::StrCat(at, " ", what);
  }
  void FailHere(absl::string_view what) { Fail(where_(), what); }

 private:
  bool Present(const Value& v, const char* key) {
    if (!ok()) return false;
    if (v.kind == Kind::kAbsent) return FailHere(absl::StrCat("lacks \"", key, "\"")), false;
    return true;
  }
  Value* values_;
  std::string* error_;
  absl::FunctionRef<std::string()> where_;
};

class ManifestSax : public internal::StrictSax {
 public:
  ManifestSax() : StrictSax(kMaxJsonDepth) {}

  // After RunStrict returned true: the manifest, or the first error in the walk's order.
  absl::StatusOr<Manifest> Finish(absl::string_view file) &&;

  bool null() override { return Scalar(Value(Kind::kOther)); }
  bool boolean(bool) override { return Scalar(Value(Kind::kOther)); }
  bool number_integer(number_integer_t) override { return Scalar(Value(Kind::kOther)); }
  bool number_unsigned(number_unsigned_t v) override { return Scalar(Value(Kind::kUnsigned, v)); }
  bool number_float(number_float_t, const string_t&) override {
    return Scalar(Value(Kind::kOther));
  }
  bool string(string_t& v) override { return Scalar(Value(Kind::kString, 0, std::move(v))); }
  bool binary(binary_t&) override { return Scalar(Value(Kind::kOther)); }
  bool start_object(std::size_t) override { return Open(/*object=*/true); }
  bool start_array(std::size_t) override { return Open(/*object=*/false); }
  bool end_object() override { return Close(); }
  bool end_array() override { return Close(); }
  bool key(string_t& k) override;

 private:
  enum class Role : uint8_t { kRoot, kSection, kRecord, kShape, kChunks, kChunk, kSkip };
  struct Frame {
    Role role = Role::kSkip;
    Section section = kTensors;
    uint64_t index = 0;  // Arrays: the elements so far.
    uint32_t seen = 0;   // Root and records: a bit per known key seen.
    int pending = -1;    // Objects: the slot of the next value (-1: a key outside the schema).
    // Keys outside the schema (every key of a skipped object), to refuse one seen twice.
    std::unique_ptr<std::set<std::string>> other_keys;
  };
  // Where the next value goes: a slot, or nowhere (nullptr) when it is skipped.
  Value* Slot();
  // Opens a container as the next value, placed by the frame it is in.
  bool Open(bool object);
  bool Close();
  bool Scalar(Value v);
  Role ContainerRole(bool object);
  void StartRecord(Section section, uint64_t index);
  void FinishRecord();
  void FinishChunk(uint64_t index, uint64_t count);
  std::string RecordWhere() const { return absl::StrCat(kSectionNames[section_], "[", record_, "]"); }

  std::vector<Frame> stack_;
  bool root_object_ = false;
  Value root_[kMaxFields];
  Manifest manifest_;
  std::string section_error_[kSectionCount];  // The first failure of a section's records.
  // The record open (at most one: records do not nest).
  Section section_ = kTensors;
  uint64_t record_ = 0;
  Value fields_[kMaxFields];
  std::vector<uint64_t> shape_;
  uint64_t shape_count_ = 0;
  int64_t bad_dim_ = -1;  // The first dimension that is not an unsigned integer.
  std::vector<ChunkInfo> chunks_;
  std::string chunk_error_;
  Value chunk_[5];
};

bool ManifestSax::key(string_t& k) {
  Frame& f = stack_.back();
  f.pending = -1;
  if (f.role == Role::kRoot || f.role == Role::kRecord) {
    const char* const* names = f.role == Role::kRoot ? kRootFields : kRecordFields[f.section];
    for (int i = 0; i < kMaxFields && names[i] != nullptr; ++i) {
      if (k == names[i]) {
        if (f.seen & (1u << i)) return Repeated(std::move(k));
        f.seen |= 1u << i;
        f.pending = i;
        return true;
      }
    }
  }
  if (f.other_keys == nullptr) f.other_keys = std::make_unique<std::set<std::string>>();
  if (!f.other_keys->insert(k).second) return Repeated(std::move(k));
  return true;
}

Value* ManifestSax::Slot() {
  Frame& f = stack_.back();
  if (f.role == Role::kRoot) return f.pending >= 0 ? &root_[f.pending] : nullptr;
  if (f.role == Role::kRecord) return f.pending >= 0 ? &fields_[f.pending] : nullptr;
  return nullptr;
}

bool ManifestSax::Scalar(Value v) {
  if (stack_.empty()) return true;  // A top-level scalar: not an object (Finish).
  Frame& f = stack_.back();
  const uint64_t index = f.index++;
  switch (f.role) {
    case Role::kRoot:
    case Role::kRecord:
      if (Value* slot = Slot()) *slot = std::move(v);
      break;
    case Role::kSection:
      if (section_error_[f.section].empty()) {
        section_error_[f.section] =
            absl::StrCat(kSectionNames[f.section], "[", index, "] is not an object");
      }
      break;
    case Role::kShape:
      if (v.kind == Kind::kUnsigned) {
        if (shape_.size() <= kMaxRank) shape_.push_back(v.u);
      } else if (bad_dim_ < 0) {
        bad_dim_ = static_cast<int64_t>(index);
      }
      ++shape_count_;
      break;
    case Role::kChunks:
      FinishChunk(index, 0);  // Not an array: refused as one of the wrong size.
      break;
    case Role::kChunk:
      if (index < 5) chunk_[index] = std::move(v);
      break;
    case Role::kSkip:
      break;
  }
  return true;
}

ManifestSax::Role ManifestSax::ContainerRole(bool object) {
  if (stack_.empty()) {
    root_object_ = object;
    return object ? Role::kRoot : Role::kSkip;
  }
  Frame& f = stack_.back();
  const uint64_t index = f.index++;
  switch (f.role) {
    case Role::kRoot:
      if (f.pending < 0) return Role::kSkip;
      root_[f.pending] = Value(object || f.pending < kFirstSection ? Kind::kOther : Kind::kArray);
      return root_[f.pending].kind == Kind::kArray ? Role::kSection : Role::kSkip;
    case Role::kRecord: {
      if (f.pending < 0) return Role::kSkip;
      const bool nested = !object && ((f.section == kTensors && f.pending == kShapeField) ||
                                      (f.section == kFiles && f.pending == kChunksField));
      fields_[f.pending] = Value(nested ? Kind::kArray : Kind::kOther);
      if (!nested) return Role::kSkip;
      return f.section == kTensors ? Role::kShape : Role::kChunks;
    }
    case Role::kSection:
      if (!object || !section_error_[f.section].empty()) {
        if (section_error_[f.section].empty()) {
          section_error_[f.section] =
              absl::StrCat(kSectionNames[f.section], "[", index, "] is not an object");
        }
        return Role::kSkip;
      }
      StartRecord(f.section, index);
      return Role::kRecord;
    case Role::kShape:
      if (bad_dim_ < 0) bad_dim_ = static_cast<int64_t>(index);
      ++shape_count_;
      return Role::kSkip;
    case Role::kChunks:
      if (object) {
        FinishChunk(index, 0);
        return Role::kSkip;
      }
      for (Value& v : chunk_) v.kind = Kind::kAbsent;
      return Role::kChunk;
    case Role::kChunk:
      if (index < 5) chunk_[index] = Value(Kind::kOther);
      return Role::kSkip;
    case Role::kSkip:
      return Role::kSkip;
  }
  return Role::kSkip;
}

bool ManifestSax::Open(bool object) {
  if (!Enter()) return false;
  const Role role = ContainerRole(object);
  Section section = stack_.empty() ? kTensors : stack_.back().section;
  if (!stack_.empty() && stack_.back().role == Role::kRoot && role == Role::kSection) {
    section = static_cast<Section>(stack_.back().pending - kFirstSection);
  }
  Frame frame;
  frame.role = role;
  frame.section = section;
  stack_.push_back(std::move(frame));
  return true;
}

bool ManifestSax::Close() {
  const Frame f = std::move(stack_.back());
  stack_.pop_back();
  Leave();
  if (f.role == Role::kRecord) FinishRecord();
  if (f.role == Role::kChunk) FinishChunk(stack_.back().index - 1, f.index);
  return true;
}

void ManifestSax::StartRecord(Section section, uint64_t index) {
  section_ = section;
  record_ = index;
  for (Value& v : fields_) v.kind = Kind::kAbsent;
  shape_.clear();
  shape_count_ = 0;
  bad_dim_ = -1;
  chunks_.clear();
  chunk_error_.clear();
}

void ManifestSax::FinishChunk(uint64_t index, uint64_t count) {
  if (!chunk_error_.empty()) return;
  auto where = [&] { return absl::StrCat(RecordWhere(), ".chunks[", index, "]"); };
  Fields c(chunk_, &chunk_error_, where);
  if (count != 5) return c.FailHere("is not a 5-element array");
  // The entries' errors name the chunk alone, not the entry.
  auto entry = [&](int i, uint64_t max) -> uint64_t {
    const Value& v = chunk_[i];
    if (!c.ok()) return 0;
    if (v.kind != Kind::kUnsigned) return c.FailHere("is not an unsigned integer"), 0;
    if (v.u > max) return c.FailHere(absl::StrCat("is ", v.u, ", above the limit ", max)), 0;
    return v.u;
  };
  ChunkInfo ci;
  ci.offset = entry(0, ~0ull);
  ci.stored_bytes = entry(1, kMaxChunkBytes);
  ci.raw_bytes = entry(2, kMaxChunkBytes);
  ci.codec = static_cast<Codec>(entry(3, 1));
  if (!c.ok()) return;
  if (chunk_[4].kind != Kind::kString || !ParseHex64(chunk_[4].s, &ci.checksum)) {
    return c.FailHere("has a checksum that is not 16 lowercase hex digits");
  }
  chunks_.push_back(ci);
}

void ManifestSax::FinishRecord() {
  std::string& error = section_error_[section_];
  if (!error.empty()) return;
  auto where = [&] { return RecordWhere(); };
  Fields r(fields_, &error, where);
  switch (section_) {
    case kTensors: {
      TensorInfo info;
      info.name = r.Str(0, "name");
      const std::string dtype = r.Str(1, "dtype");
      if (!r.ok()) return;
      absl::StatusOr<DType> parsed = ParseDType(dtype);
      if (!parsed.ok()) return r.FailHere(absl::StrCat("has unknown dtype \"", dtype, "\""));
      info.dtype = *parsed;
      if (!r.Array(kShapeField, "shape")) return;
      if (shape_count_ > kMaxRank) return r.FailHere("has too many dimensions");
      if (bad_dim_ >= 0) {
        return r.Fail(absl::StrCat(RecordWhere(), ".shape[", bad_dim_, "]"),
                      "is not an unsigned integer");
      }
      info.shape = shape_;
      manifest_.tensors.push_back(std::move(info));
      return;
    }
    case kFiles: {
      DataFileInfo info;
      info.name = r.Str(0, "name");
      info.rank = static_cast<uint32_t>(r.U64(1, "rank", kMaxWorldSize));
      info.size_bytes = r.U64(2, "size");
      if (!r.Array(kChunksField, "chunks")) return;
      if (!chunk_error_.empty()) return void(error = std::move(chunk_error_));
      info.chunks = std::move(chunks_);
      chunks_.clear();
      manifest_.files.push_back(std::move(info));
      return;
    }
    case kPieces: {
      PieceInfo info;
      info.tensor = static_cast<uint32_t>(r.U64(0, "tensor", UINT32_MAX));
      info.rank = static_cast<uint32_t>(r.U64(1, "rank", kMaxWorldSize));
      info.begin = r.U64(2, "begin");
      info.count = r.U64(3, "count");
      info.file = static_cast<uint32_t>(r.U64(4, "file", UINT32_MAX));
      info.first_chunk = r.U64(5, "first_chunk");
      info.chunk_count = r.U64(6, "chunk_count");
      info.chunk_elems = r.U64(7, "chunk_elems");
      if (r.ok()) manifest_.pieces.push_back(info);
      return;
    }
    case kBlobs: {
      BlobInfo info;
      info.name = r.Str(0, "name");
      info.rank = static_cast<uint32_t>(r.U64(1, "rank", kMaxWorldSize));
      info.file = static_cast<uint32_t>(r.U64(2, "file", UINT32_MAX));
      info.size_bytes = r.U64(3, "size");
      info.first_chunk = r.U64(4, "first_chunk");
      info.chunk_count = r.U64(5, "chunk_count");
      if (r.ok()) manifest_.blobs.push_back(std::move(info));
      return;
    }
    case kSectionCount:
      return;
  }
}

absl::StatusOr<Manifest> ManifestSax::Finish(absl::string_view file) && {
  if (!root_object_) return Invalid(file, "manifest is not an object");
  std::string error;
  auto where = [] { return std::string("manifest"); };
  Fields r(root_, &error, where);
  if (r.Str(0, "format") != "ckpt" && r.ok()) {
    return Invalid(file, "JSON format field is not \"ckpt\"");
  }
  if (r.U64(1, "version") != kFormatVersion && r.ok()) {
    return Invalid(file, "JSON version disagrees with the header");
  }
  manifest_.step = r.U64(2, "step");
  manifest_.world_size = static_cast<uint32_t>(r.U64(3, "world_size", kMaxWorldSize));
  for (int s = 0; s < kSectionCount && r.ok(); ++s) {
    if (r.Array(kFirstSection + s, kSectionNames[s]) && !section_error_[s].empty()) {
      error = std::move(section_error_[s]);
    }
  }
  if (!error.empty()) return Invalid(file, error);
  return std::move(manifest_);
}

}  // namespace

absl::StatusOr<Manifest> internal::ParseManifestJson(absl::string_view text,
                                                     absl::string_view file) {
  ManifestSax sax;
  if (!RunStrict(text, &sax)) {
    if (sax.too_deep()) return Invalid(file, "JSON nests too deeply");
    if (!sax.duplicate().empty()) {
      return Invalid(file, absl::StrCat("key \"", sax.duplicate(), "\" appears twice"));
    }
    return Invalid(file, "JSON does not parse");
  }
  return std::move(sax).Finish(file);
}

}  // namespace ckpt::formats
