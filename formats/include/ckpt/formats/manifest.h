// The MANIFEST of a ckpt checkpoint (format v1): which tensors exist, which rank holds which
// pieces of them, in which chunks of which data file, with every chunk's checksum. Also the
// per-rank part a rank writes into the staging directory before the vote. Pure functions over
// bytes; grammar at the top of manifest.cc and in docs/formats/ckpt-v1.md.
#ifndef CKPT_FORMATS_MANIFEST_H_
#define CKPT_FORMATS_MANIFEST_H_

#include <cstdint>
#include <span>
#include <string>
#include <vector>
#include "absl/strings/string_view.h"

#include "absl/status/statusor.h"
#include "ckpt/formats/chunk.h"
#include "ckpt/formats/dtype.h"

namespace ckpt::formats {

inline constexpr uint64_t kManifestHeaderBytes = 32;
// The first bytes of a MANIFEST and of a rank's part.
inline constexpr absl::string_view kManifestMagic = "CKPTMANI";
inline constexpr absl::string_view kPartMagic = "CKPTPART";
// A manifest larger than this is refused before parsing.
inline constexpr uint64_t kMaxManifestBytes = uint64_t{1} << 30;
// Blobs are small opaque records (scheduler, RNG, data position); a reader allocates a blob's
// declared size before its chunks are decoded, so the size is capped (zstd chunks can declare
// far more raw bytes than the file holds).
inline constexpr uint64_t kMaxBlobBytes = uint64_t{256} << 20;

struct TensorInfo {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<uint64_t> shape;
  // Product of shape (1 for a scalar). Validated not to overflow by ParseManifest.
  uint64_t numel() const;
};

struct ChunkInfo {
  uint64_t offset = 0;        // Multiple of kBlockBytes; where the chunk header starts.
  uint64_t stored_bytes = 0;  // Payload bytes on disk.
  uint64_t raw_bytes = 0;     // Payload bytes after decoding.
  Codec codec = Codec::kRaw;
  uint64_t checksum = 0;  // XXH3-64 of the whole extent: header, payload, padding.
};

struct DataFileInfo {
  std::string name;  // A bare file name inside the step directory.
  uint32_t rank = 0;
  uint64_t size_bytes = 0;
  std::vector<ChunkInfo> chunks;  // In file order.
};

// Elements [begin, begin + count) of tensor `tensor`, held by `rank` in chunks
// [first_chunk, first_chunk + chunk_count) of files[file]; chunk j holds elements
// [begin + j * chunk_elems, ...) and all but the last hold exactly chunk_elems.
struct PieceInfo {
  uint32_t tensor = 0;
  uint32_t rank = 0;
  uint64_t begin = 0;
  uint64_t count = 0;
  uint32_t file = 0;
  uint64_t first_chunk = 0;
  uint64_t chunk_count = 0;
  uint64_t chunk_elems = 0;
};

// Opaque bytes (scheduler state, RNG state) stored by one rank in consecutive chunks.
struct BlobInfo {
  std::string name;
  uint32_t rank = 0;
  uint32_t file = 0;
  uint64_t size_bytes = 0;
  uint64_t first_chunk = 0;
  uint64_t chunk_count = 0;
};

enum class ManifestKind : uint8_t {
  kManifest,  // MANIFEST of a committed step: "CKPTMANI".
  kRankPart,  // One rank's part in the staging directory: "CKPTPART".
};

struct Manifest {
  uint64_t step = 0;
  uint32_t world_size = 1;
  std::vector<TensorInfo> tensors;
  std::vector<DataFileInfo> files;
  std::vector<PieceInfo> pieces;
  std::vector<BlobInfo> blobs;
};

// Serializes `manifest` (which the caller has built consistently).
std::string EncodeManifest(const Manifest& manifest, ManifestKind kind = ManifestKind::kManifest);

// Parses and validates. `file` names the input in errors. kDataLoss for damage (bad magic,
// checksum mismatch, truncation, malformed JSON) and for any rule broken (names with "/" or
// "..", pieces outside their tensor, overlapping pieces, chunks outside their file, absurd
// sizes); kUnimplemented for a newer format version. Never crashes on any input.
absl::StatusOr<Manifest> ParseManifest(std::span<const std::byte> bytes, absl::string_view file,
                                       ManifestKind kind = ManifestKind::kManifest);

// Checks the rules ParseManifest checks, on a Manifest built in memory.
absl::Status ValidateManifest(const Manifest& manifest, absl::string_view file);

// True if `name` may name a tensor, blob or file: non-empty, at most 4096 bytes of valid UTF-8
// (a manifest is JSON: other bytes could not be written as they are), no "/", no "..", no
// control characters, no backslash, not ".".
bool IsValidName(absl::string_view name);

}  // namespace ckpt::formats

#endif  // CKPT_FORMATS_MANIFEST_H_
