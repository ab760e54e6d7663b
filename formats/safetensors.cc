// safetensors, as specified by the reference implementation (huggingface/safetensors 0.8):
//
//   file   := n:u64le header:u8[n] data
//   header := UTF-8 JSON object, optionally preceded and followed by JSON whitespace (space,
//             tab, LF, CR; safetensors 0.8 reads such headers: checked on the GPU host)
//             {"__metadata__": {str: str, ...}?,
//              NAME: {"dtype": DTYPE, "shape": [u64...], "data_offsets": [begin, end]}, ...}
//   data   := the tensors' bytes; data_offsets are relative to its start
//
// Rules checked, each reported with the reference's name for it, the tensor and the byte offset:
//   HeaderTooLarge      n > 100,000,000
//   InvalidHeaderLength 8 + n > file size
//   InvalidHeaderStart  the header's first byte that is not JSON whitespace is not '{'
//   InvalidHeader       not UTF-8 JSON; trailing bytes other than JSON whitespace (a NUL, a form
//                       feed, a no-break space are not); a non-object where an
//                       object belongs; a missing or mistyped field; nesting deeper than 8;
//                       a duplicate key at any level (the reference's maps would drop one)
//   InvalidDtype        a dtype outside the 22 of safetensors 0.8
//   ValidationOverflow  element count or bit count overflows 64 bits
//   MisalignedSlice     element count x bits is not a whole number of bytes
//   InvalidOffset       begin > end, or tensors (sorted by begin) are not back to back from 0
//   TensorInvalidInfo   end - begin differs from the tensor's byte size
//   MetadataIncompleteBuffer  the last tensor does not end exactly at the end of the file
#include "ckpt/formats/safetensors.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <set>

#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "ckpt/base/coding.h"
#include "ckpt/base/status_macros.h"
#include "formats/strict_json.h"

namespace ckpt::formats {
namespace {

using nlohmann::json;

constexpr int kMaxHeaderDepth = 8;

struct StDTypeEntry {
  StDType dtype;
  absl::string_view name;
  uint32_t bits;
};

constexpr std::array<StDTypeEntry, 22> kStDTypes = {{
    {StDType::kBool, "BOOL", 8},
    {StDType::kF4, "F4", 4},
    {StDType::kF6_E2M3, "F6_E2M3", 6},
    {StDType::kF6_E3M2, "F6_E3M2", 6},
    {StDType::kU8, "U8", 8},
    {StDType::kI8, "I8", 8},
    {StDType::kF8_E5M2, "F8_E5M2", 8},
    {StDType::kF8_E4M3, "F8_E4M3", 8},
    {StDType::kF8_E8M0, "F8_E8M0", 8},
    {StDType::kF8_E4M3FNUZ, "F8_E4M3FNUZ", 8},
    {StDType::kF8_E5M2FNUZ, "F8_E5M2FNUZ", 8},
    {StDType::kI16, "I16", 16},
    {StDType::kU16, "U16", 16},
    {StDType::kF16, "F16", 16},
    {StDType::kBF16, "BF16", 16},
    {StDType::kI32, "I32", 32},
    {StDType::kU32, "U32", 32},
    {StDType::kF32, "F32", 32},
    {StDType::kC64, "C64", 64},
    {StDType::kF64, "F64", 64},
    {StDType::kI64, "I64", 64},
    {StDType::kU64, "U64", 64},
}};

absl::Status Rule(absl::string_view file, absl::string_view rule, absl::string_view detail) {
  return absl::DataLossError(absl::StrCat(file, ": ", rule, ": ", detail));
}

// Reads a JSON array of unsigned integers.
bool ReadU64Array(const json& v, std::vector<uint64_t>* out) {
  if (!v.is_array()) return false;
  for (const json& x : v) {
    if (!x.is_number_unsigned()) return false;
    out->push_back(x.get<uint64_t>());
  }
  return true;
}

absl::Status ParseTensorEntry(const std::string& name, const json& info, absl::string_view file,
                              SafetensorsTensor* out) {
  const std::string what = absl::StrCat("tensor \"", name, "\"");
  if (!info.is_object()) return Rule(file, "InvalidHeader", what + " is not an object");
  auto dtype = info.find("dtype");
  auto shape = info.find("shape");
  auto offsets = info.find("data_offsets");
  if (dtype == info.end() || shape == info.end() || offsets == info.end()) {
    return Rule(file, "InvalidHeader", what + " lacks dtype, shape or data_offsets");
  }
  if (!dtype->is_string()) return Rule(file, "InvalidHeader", what + " has a non-string dtype");
  absl::StatusOr<StDType> parsed = ParseStDType(dtype->get_ref<const std::string&>());
  if (!parsed.ok()) {
    return Rule(file, "InvalidDtype",
                absl::StrCat(what, " has dtype \"", dtype->get_ref<const std::string&>(), "\""));
  }
  out->name = name;
  out->dtype = *parsed;
  if (!ReadU64Array(*shape, &out->shape)) {
    return Rule(file, "InvalidHeader",
                what + " has a shape that is not an array of unsigned integers");
  }
  std::vector<uint64_t> range;
  if (!ReadU64Array(*offsets, &range) || range.size() != 2) {
    return Rule(file, "InvalidHeader",
                what + " has data_offsets that are not two unsigned integers");
  }
  out->begin = range[0];
  out->end = range[1];
  return absl::OkStatus();
}

absl::Status ValidateLayout(const SafetensorsHeader& h, uint64_t file_size,
                            absl::string_view file) {
  const uint64_t data_bytes = file_size - h.data_offset;
  uint64_t expected_begin = 0;
  for (const SafetensorsTensor& t : h.tensors) {
    const std::string what =
        absl::StrCat("tensor \"", t.name, "\" at byte ", h.data_offset + t.begin);
    if (t.begin > t.end) {
      return Rule(file, "InvalidOffset",
                  absl::StrCat(what, " has data_offsets [", t.begin, ", ", t.end, "] reversed"));
    }
    if (t.begin != expected_begin) {
      return Rule(file, "InvalidOffset",
                  absl::StrCat(what,
                               t.begin < expected_begin ? " overlaps the previous tensor"
                                                        : " leaves a gap after the previous tensor",
                               " (expected data offset ", expected_begin, ")"));
    }
    uint64_t numel = 1;
    for (uint64_t d : t.shape) {
      if (d != 0 && numel > UINT64_MAX / d)
        return Rule(file, "ValidationOverflow", what + " has an element count that overflows");
      numel *= d;
    }
    const uint64_t bits_per = StDTypeBits(t.dtype);
    if (numel > UINT64_MAX / bits_per)
      return Rule(file, "ValidationOverflow", what + " has a bit count that overflows");
    const uint64_t bits = numel * bits_per;
    if (bits % 8 != 0) {
      return Rule(file, "MisalignedSlice",
                  absl::StrCat(what, " holds ", bits, " bits, not whole bytes"));
    }
    if (t.end - t.begin != bits / 8) {
      return Rule(file, "TensorInvalidInfo",
                  absl::StrCat(what, " spans ", t.end - t.begin,
                               " bytes but its dtype and shape need ", bits / 8));
    }
    expected_begin = t.end;
  }
  if (expected_begin != data_bytes) {
    return Rule(
        file, "MetadataIncompleteBuffer",
        absl::StrCat("tensors end at data offset ", expected_begin, " but the data section holds ",
                     data_bytes, " bytes (file offset ", h.data_offset + expected_begin, ")"));
  }
  return absl::OkStatus();
}

// Strict UTF-8 (no overlongs, no surrogates, nothing above U+10FFFF).
bool IsValidUtf8(absl::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    size_t len = c < 0x80           ? 1
                 : (c >> 5) == 0x6  ? 2
                 : (c >> 4) == 0xe  ? 3
                 : (c >> 3) == 0x1e ? 4
                                    : 0;
    if (len == 0 || i + len > s.size()) return false;
    uint32_t cp = len == 1 ? c : len == 2 ? (c & 0x1f) : len == 3 ? (c & 0x0f) : (c & 0x07);
    for (size_t k = 1; k < len; ++k) {
      unsigned char cc = static_cast<unsigned char>(s[i + k]);
      if ((cc >> 6) != 0x2) return false;
      cp = (cp << 6) | (cc & 0x3f);
    }
    static constexpr uint32_t kMin[] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < kMin[len] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return false;
    i += len;
  }
  return true;
}

}  // namespace

absl::string_view StDTypeName(StDType dtype) { return kStDTypes[static_cast<size_t>(dtype)].name; }
uint32_t StDTypeBits(StDType dtype) { return kStDTypes[static_cast<size_t>(dtype)].bits; }

absl::StatusOr<StDType> ParseStDType(absl::string_view name) {
  for (const StDTypeEntry& e : kStDTypes) {
    if (e.name == name) return e.dtype;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown safetensors dtype \"", name, "\""));
}

uint64_t SafetensorsTensor::numel() const {
  uint64_t n = 1;
  for (uint64_t d : shape) n *= d;
  return n;
}

absl::StatusOr<uint64_t> ParseSafetensorsPrefix(std::span<const std::byte> prefix,
                                                uint64_t file_size, absl::string_view file) {
  if (prefix.size() < 8 || file_size < 8) {
    return Rule(file, "HeaderTooSmall",
                absl::StrCat("file of ", file_size, " bytes has no 8-byte length prefix"));
  }
  const uint64_t n = DecodeFixed64(prefix.data());
  if (n > kMaxSafetensorsHeaderBytes) {
    return Rule(
        file, "HeaderTooLarge",
        absl::StrCat("header length ", n, " at byte 0 exceeds ", kMaxSafetensorsHeaderBytes));
  }
  if (n > file_size - 8) {
    return Rule(file, "InvalidHeaderLength",
                absl::StrCat("header length ", n, " at byte 0 runs past the end of the ", file_size,
                             "-byte file"));
  }
  return n;
}

absl::StatusOr<SafetensorsHeader> ParseSafetensorsHeader(std::span<const std::byte> bytes,
                                                         uint64_t file_size,
                                                         absl::string_view file) {
  SafetensorsHeader h;
  h.header_bytes = bytes.size();
  h.data_offset = 8 + bytes.size();
  if (h.data_offset > file_size) {
    return Rule(file, "InvalidHeaderLength", "header runs past the end of the file");
  }
  absl::string_view text = AsStringView(bytes);
  // JSON's whitespace, which the reference's JSON parser skips on both sides of the object.
  constexpr absl::string_view kJsonWhitespace = " \t\n\r";
  const size_t first = text.find_first_not_of(kJsonWhitespace);
  if (first == absl::string_view::npos || text[first] != '{') {
    return Rule(file, "InvalidHeaderStart",
                absl::StrCat("header does not begin with '{' (after JSON whitespace) at byte ",
                             8 + (first == absl::string_view::npos ? 0 : first)));
  }
  const size_t last = text.find_last_not_of(kJsonWhitespace);
  if (text[last] != '}') {
    return Rule(file, "InvalidHeader",
                absl::StrCat("byte ", 8 + last,
                             " after the JSON object is not JSON whitespace padding"));
  }
  text = text.substr(first, last + 1 - first);
  internal::StrictJson parsed = internal::ParseStrictJson(text, kMaxHeaderDepth);
  if (parsed.too_deep) return Rule(file, "InvalidHeader", "JSON nests too deeply");
  if (!parsed.duplicate.empty()) {
    return Rule(file, "InvalidHeader",
                absl::StrCat("key \"", parsed.duplicate, "\" appears twice"));
  }
  if (!parsed.ok() || !parsed.value.is_object()) {
    return Rule(file, "InvalidHeader", "header is not a UTF-8 JSON object");
  }
  const json& root = parsed.value;
  for (auto it = root.begin(); it != root.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (!it.value().is_object())
        return Rule(file, "InvalidHeader", "__metadata__ is not an object");
      for (auto m = it.value().begin(); m != it.value().end(); ++m) {
        if (!m.value().is_string()) {
          return Rule(file, "InvalidHeader",
                      absl::StrCat("__metadata__ entry \"", m.key(), "\" is not a string"));
        }
        h.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    SafetensorsTensor t;
    CKPT_RETURN_IF_ERROR(ParseTensorEntry(it.key(), it.value(), file, &t));
    h.tensors.push_back(std::move(t));
  }
  std::sort(h.tensors.begin(), h.tensors.end(),
            [](const SafetensorsTensor& a, const SafetensorsTensor& b) {
              return std::tie(a.begin, a.end) < std::tie(b.begin, b.end);
            });
  CKPT_RETURN_IF_ERROR(ValidateLayout(h, file_size, file));
  return h;
}

absl::StatusOr<SafetensorsHeader> ParseSafetensors(std::span<const std::byte> file_bytes,
                                                   absl::string_view file) {
  CKPT_ASSIGN_OR_RETURN(uint64_t n, ParseSafetensorsPrefix(file_bytes, file_bytes.size(), file));
  return ParseSafetensorsHeader(file_bytes.subspan(8, n), file_bytes.size(), file);
}

absl::StatusOr<std::string> EncodeSafetensorsHeader(
    std::vector<SafetensorsTensor>* tensors, const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json root = nlohmann::ordered_json::object();
  for (const auto& [k, v] : metadata) {
    if (!IsValidUtf8(k) || !IsValidUtf8(v))
      return absl::InvalidArgumentError("metadata is not UTF-8");
  }
  if (!metadata.empty()) root["__metadata__"] = metadata;
  std::set<std::string> names;
  uint64_t offset = 0;
  for (SafetensorsTensor& t : *tensors) {
    if (t.name == "__metadata__" || !IsValidUtf8(t.name) || !names.insert(t.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor name \"", t.name, "\" is reserved, repeated or not UTF-8"));
    }
    uint64_t numel = 1;
    for (uint64_t d : t.shape) {
      if (d != 0 && numel > (UINT64_MAX / 64) / d) {
        return absl::InvalidArgumentError(absl::StrCat("tensor \"", t.name, "\" is too large"));
      }
      numel *= d;
    }
    const uint64_t bits = numel * StDTypeBits(t.dtype);
    if (bits % 8 != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor \"", t.name, "\" is not a whole number of bytes"));
    }
    t.begin = offset;
    t.end = offset + bits / 8;
    offset = t.end;
    root[t.name] = {{"dtype", std::string(StDTypeName(t.dtype))},
                    {"shape", t.shape},
                    {"data_offsets", {t.begin, t.end}}};
  }
  std::string text = root.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::strict);
  text.append((8 - text.size() % 8) % 8, ' ');
  if (text.size() > kMaxSafetensorsHeaderBytes) {
    return absl::InvalidArgumentError("safetensors header would exceed 100,000,000 bytes");
  }
  std::string out;
  PutFixed64(&out, text.size());
  return out + text;
}

// --- model.safetensors.index.json -------------------------------------------------------------

std::vector<std::string> HfIndex::shards() const {
  std::set<std::string> s;
  for (const auto& [tensor, shard] : weight_map) s.insert(shard);
  return {s.begin(), s.end()};
}

bool IsSafeRelativePath(absl::string_view path) {
  if (path.empty() || path.front() == '/' || absl::StrContains(path, '\\')) return false;
  for (absl::string_view part : absl::StrSplit(path, '/')) {
    if (part.empty() || part == "." || part == "..") return false;
    for (char c : part) {
      if (static_cast<unsigned char>(c) < 0x20) return false;
    }
  }
  return true;
}

absl::StatusOr<HfIndex> ParseHfIndex(std::span<const std::byte> bytes, absl::string_view file) {
  if (bytes.size() > kMaxSafetensorsHeaderBytes) {
    return Rule(file, "IndexTooLarge",
                absl::StrCat(bytes.size(), " bytes exceeds ", kMaxSafetensorsHeaderBytes));
  }
  absl::string_view text = AsStringView(bytes);
  internal::StrictJson parsed = internal::ParseStrictJson(text, kMaxHeaderDepth);
  if (parsed.too_deep) return Rule(file, "InvalidIndex", "JSON nests too deeply");
  if (!parsed.duplicate.empty()) {
    return Rule(file, "InvalidIndex", absl::StrCat("key \"", parsed.duplicate, "\" appears twice"));
  }
  if (!parsed.ok() || !parsed.value.is_object())
    return Rule(file, "InvalidIndex", "not a UTF-8 JSON object");
  const json& root = parsed.value;
  HfIndex index;
  auto meta = root.find("metadata");
  if (meta != root.end() && !meta->is_null()) {
    if (!meta->is_object()) return Rule(file, "InvalidIndex", "metadata is not an object");
    for (auto it = meta->begin(); it != meta->end(); ++it) {
      if (it.key() == "total_size") {
        if (!it.value().is_number_unsigned())
          return Rule(file, "InvalidIndex", "metadata.total_size is not an unsigned integer");
        index.total_size = it.value().get<uint64_t>();
      } else {
        index.metadata[it.key()] = it.value().dump();
      }
    }
  }
  auto map = root.find("weight_map");
  if (map == root.end() || !map->is_object())
    return Rule(file, "InvalidIndex", "weight_map is missing or not an object");
  for (auto it = map->begin(); it != map->end(); ++it) {
    if (!it.value().is_string()) {
      return Rule(file, "InvalidIndex",
                  absl::StrCat("weight_map entry \"", it.key(), "\" is not a string"));
    }
    const std::string& shard = it.value().get_ref<const std::string&>();
    if (!IsSafeRelativePath(shard)) {
      return Rule(file, "UnsafeShardPath",
                  absl::StrCat("tensor \"", it.key(), "\" names shard \"", shard,
                               "\", which is absolute or leaves the directory"));
    }
    if (!absl::EndsWith(shard, ".safetensors")) {
      return Rule(file, "InvalidIndex",
                  absl::StrCat("shard \"", shard, "\" is not a .safetensors file"));
    }
    index.weight_map.emplace_back(it.key(), shard);
  }
  return index;
}

std::string EncodeHfIndex(const HfIndex& index) {
  nlohmann::ordered_json meta = nlohmann::ordered_json::object();
  for (const auto& [k, v] : index.metadata)
    meta[k] = nlohmann::ordered_json::parse(v, nullptr, false);
  if (index.total_size.has_value()) meta["total_size"] = *index.total_size;
  nlohmann::ordered_json map = nlohmann::ordered_json::object();
  std::vector<std::pair<std::string, std::string>> sorted = index.weight_map;
  std::sort(sorted.begin(), sorted.end());
  for (const auto& [tensor, shard] : sorted) map[tensor] = shard;
  nlohmann::ordered_json root = {{"metadata", meta}, {"weight_map", map}};
  return root.dump(2, ' ', false, nlohmann::ordered_json::error_handler_t::replace) + "\n";
}

absl::Status CheckHfIndexAgainstShards(
    const HfIndex& index, const std::vector<std::pair<std::string, std::string>>& stored,
    absl::string_view index_file) {
  const std::map<std::string, std::string> expected(index.weight_map.begin(),
                                                    index.weight_map.end());
  std::set<std::string> seen;
  for (const auto& [tensor, shard] : stored) {
    auto it = expected.find(tensor);
    if (it == expected.end()) {
      return absl::DataLossError(absl::StrCat(index_file, ": UnlistedTensor: tensor \"", tensor,
                                              "\" in shard ", shard, " is not in weight_map"));
    }
    if (!seen.insert(tensor).second) {
      return absl::DataLossError(absl::StrCat(index_file, ": DuplicateTensor: tensor \"", tensor,
                                              "\" is stored in more than one shard"));
    }
    if (it->second != shard) {
      return absl::DataLossError(absl::StrCat(index_file, ": WrongShard: tensor \"", tensor,
                                              "\" is in ", shard, " but weight_map says ",
                                              it->second));
    }
  }
  for (const auto& [tensor, shard] : expected) {
    if (!seen.count(tensor)) {
      return absl::DataLossError(absl::StrCat(index_file, ": MissingTensor: tensor \"", tensor,
                                              "\" is not in shard ", shard));
    }
  }
  return absl::OkStatus();
}

}  // namespace ckpt::formats
