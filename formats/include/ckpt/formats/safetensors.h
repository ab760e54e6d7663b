// safetensors headers and HuggingFace sharded-checkpoint indexes: parsers that hostile input
// cannot break, and encoders our writer uses. Pure functions over bytes; the rules are at the
// top of safetensors.cc and in docs/formats/safetensors.md.
#ifndef CKPT_FORMATS_SAFETENSORS_H_
#define CKPT_FORMATS_SAFETENSORS_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace ckpt::formats {

// Every dtype of safetensors 0.8, in the reference implementation's order.
enum class StDType : uint8_t {
  kBool,
  kF4,
  kF6_E2M3,
  kF6_E3M2,
  kU8,
  kI8,
  kF8_E5M2,
  kF8_E4M3,
  kF8_E8M0,
  kF8_E4M3FNUZ,
  kF8_E5M2FNUZ,
  kI16,
  kU16,
  kF16,
  kBF16,
  kI32,
  kU32,
  kF32,
  kC64,
  kF64,
  kI64,
  kU64,
};
absl::string_view StDTypeName(StDType dtype);
absl::StatusOr<StDType> ParseStDType(absl::string_view name);
// Bits per element (4 for F4, 6 for the F6 types).
uint32_t StDTypeBits(StDType dtype);

// The header of a safetensors file is capped at this many bytes, as in the reference.
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100'000'000;

struct SafetensorsTensor {
  std::string name;
  StDType dtype = StDType::kF32;
  std::vector<uint64_t> shape;
  uint64_t begin = 0;  // data_offsets, relative to the start of the data section.
  uint64_t end = 0;
  uint64_t numel() const;  // Validated not to overflow by the parser.
};

struct SafetensorsHeader {
  uint64_t header_bytes = 0;  // N, the JSON length from the 8-byte prefix.
  uint64_t data_offset = 0;   // 8 + N: where the data section starts in the file.
  std::map<std::string, std::string> metadata;
  std::vector<SafetensorsTensor> tensors;  // Sorted by data offset.
};

// Reads the 8-byte little-endian prefix. kDataLoss (naming `file`) when fewer than 8 bytes, when
// N exceeds kMaxSafetensorsHeaderBytes, or when 8 + N exceeds `file_size`.
absl::StatusOr<uint64_t> ParseSafetensorsPrefix(std::span<const std::byte> prefix,
                                                uint64_t file_size, absl::string_view file);
// Parses and validates the N header bytes of a file of `file_size` bytes. kDataLoss naming the
// file, the rule, the tensor and the byte offset for every violation.
absl::StatusOr<SafetensorsHeader> ParseSafetensorsHeader(std::span<const std::byte> json,
                                                         uint64_t file_size,
                                                         absl::string_view file);
// Parses a whole safetensors file held in memory (prefix, header and data).
absl::StatusOr<SafetensorsHeader> ParseSafetensors(std::span<const std::byte> file_bytes,
                                                   absl::string_view file);

// The 8-byte prefix and the JSON header (space-padded to a multiple of 8 bytes) for tensors
// laid out back to back in the given order; fills each tensor's begin/end. kInvalidArgument
// for a bad or duplicate name or a size that does not fit.
absl::StatusOr<std::string> EncodeSafetensorsHeader(
    std::vector<SafetensorsTensor>* tensors, const std::map<std::string, std::string>& metadata);

// model.safetensors.index.json.
struct HfIndex {
  std::optional<uint64_t> total_size;           // metadata.total_size, when present.
  std::map<std::string, std::string> metadata;  // Other metadata entries, as JSON text.
  std::vector<std::pair<std::string, std::string>> weight_map;  // tensor -> shard, sorted.
  std::vector<std::string> shards() const;                      // Distinct shard paths, sorted.
};

// kDataLoss naming `file` and the rule: not a JSON object, no weight_map, non-string entries,
// duplicate tensors, shard paths that are absolute, contain "..", "." or empty components or a
// backslash, or do not end in ".safetensors".
absl::StatusOr<HfIndex> ParseHfIndex(std::span<const std::byte> bytes, absl::string_view file);
std::string EncodeHfIndex(const HfIndex& index);

// True if `path` may name a shard inside a model directory (see ParseHfIndex).
bool IsSafeRelativePath(absl::string_view path);

// Checks an index against what its shards hold: `stored` lists every tensor of every shard as
// (tensor, shard), in any order. kDataLoss naming `index_file` and the rule: UnlistedTensor (a
// stored tensor weight_map lacks), DuplicateTensor (stored in two shards), WrongShard (stored
// in another shard than weight_map says), MissingTensor (in weight_map, stored nowhere).
absl::Status CheckHfIndexAgainstShards(
    const HfIndex& index, const std::vector<std::pair<std::string, std::string>>& stored,
    absl::string_view index_file);

}  // namespace ckpt::formats

#endif  // CKPT_FORMATS_SAFETENSORS_H_
