// Byte-level framing of ckpt data files and of LATEST (format v1). Pure functions over bytes;
// the grammar is at the top of chunk.cc and in docs/formats/ckpt-v1.md.
#ifndef CKPT_FORMATS_CHUNK_H_
#define CKPT_FORMATS_CHUNK_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include "absl/strings/string_view.h"

#include "absl/status/statusor.h"

namespace ckpt::formats {

inline constexpr uint32_t kFormatVersion = 1;
// Data files are laid out in units of this many bytes so O_DIRECT can move them.
inline constexpr uint64_t kBlockBytes = 4096;
inline constexpr uint64_t kDataFileHeaderBytes = kBlockBytes;
inline constexpr uint64_t kChunkHeaderBytes = 24;
inline constexpr uint64_t kLatestBytes = 32;
// The first bytes of a data file and of LATEST (recovery recognises ckpt's own files by them).
inline constexpr absl::string_view kDataFileMagic = "CKPTDATA";
inline constexpr absl::string_view kLatestMagic = "CKLATEST";
// Hard cap on one chunk's raw or stored size; a reader refuses larger claims.
inline constexpr uint64_t kMaxChunkBytes = uint64_t{1} << 30;

enum class Codec : uint8_t { kRaw = 0, kZstd = 1 };
absl::string_view CodecName(Codec codec);

struct DataFileHeader {
  uint64_t step = 0;
  uint32_t rank = 0;
  uint32_t world_size = 0;
};

// The first kDataFileHeaderBytes of a data file.
std::string EncodeDataFileHeader(const DataFileHeader& header);
// kDataLoss (naming `file`) on bad magic, bad checksum or short input; kUnimplemented for a
// newer version.
absl::StatusOr<DataFileHeader> DecodeDataFileHeader(std::span<const std::byte> block,
                                                    absl::string_view file);

struct ChunkHeader {
  Codec codec = Codec::kRaw;
  uint64_t raw_bytes = 0;
  uint64_t stored_bytes = 0;
};

std::string EncodeChunkHeader(const ChunkHeader& header);
// kDataLoss naming `file` and `offset` on bad magic, unknown codec or absurd sizes.
absl::StatusOr<ChunkHeader> DecodeChunkHeader(std::span<const std::byte> bytes,
                                              absl::string_view file, uint64_t offset);

// Bytes a chunk with `stored_bytes` of payload occupies in its file (header, payload, zero
// padding to kBlockBytes).
uint64_t ChunkExtentBytes(uint64_t stored_bytes);

// zstd compression of one chunk's payload. kInternal if zstd fails.
absl::StatusOr<std::string> CompressZstd(std::span<const std::byte> raw, int level);
// Decodes a stored payload into `out` (exactly raw_bytes long). kDataLoss naming `file` and
// `offset` when the payload does not decode to exactly out.size() bytes.
absl::Status DecodeChunkPayload(Codec codec, std::span<const std::byte> stored,
                                std::span<std::byte> out, absl::string_view file, uint64_t offset);

// LATEST: names the newest committed step.
std::string EncodeLatest(uint64_t step);
// kDataLoss naming `file` on any damage.
absl::StatusOr<uint64_t> DecodeLatest(std::span<const std::byte> bytes, absl::string_view file);

}  // namespace ckpt::formats

#endif  // CKPT_FORMATS_CHUNK_H_
