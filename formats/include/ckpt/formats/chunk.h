// Byte-level framing of ckpt data files and of LATEST (format v1). Pure functions over bytes;
// the grammar is at the top of chunk.cc and in docs/formats/ckpt-v1.md.
#ifndef CKPT_FORMATS_CHUNK_H_
#define CKPT_FORMATS_CHUNK_H_

#include <cstddef>
#include <cstdint>
#include <memory>
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

// Decodes one zstd payload front to back across several calls, so a chunk read in parts (diff,
// export-hf and reshard read bounded batches) is decoded once, holding only zstd's window (at
// most 128 MiB; 512 KiB at ckpt's default level), never the whole decoded chunk. Each call is
// handed the payload again: the same bytes, which the caller has checked against the chunk's
// checksum; the stream resumes where it stopped. Not thread-safe.
class ZstdPayloadStream {
 public:
  // `raw_bytes` is what the payload must decode to; `file` and `offset` name the chunk in
  // errors. kInternal if zstd cannot make a context.
  static absl::StatusOr<std::unique_ptr<ZstdPayloadStream>> Create(uint64_t raw_bytes,
                                                                   std::string file,
                                                                   uint64_t offset);
  ~ZstdPayloadStream();
  ZstdPayloadStream(const ZstdPayloadStream&) = delete;  // Owns a zstd context.
  ZstdPayloadStream& operator=(const ZstdPayloadStream&) = delete;

  // Raw bytes decoded so far (delivered or skipped).
  uint64_t position() const { return position_; }
  // Decodes raw bytes [raw_offset, raw_offset + out.size()) into `out`, first decoding and
  // dropping those from position() to raw_offset. kInvalidArgument when raw_offset is behind
  // position() or the range passes raw_bytes; kDataLoss naming file and offset when the
  // payload does not decode (at its end: to exactly raw_bytes).
  absl::Status Read(std::span<const std::byte> stored, uint64_t raw_offset,
                    std::span<std::byte> out);

 private:
  struct Context;
  ZstdPayloadStream(uint64_t raw_bytes, std::string file, uint64_t offset);
  // Decodes into `out` whole; kDataLoss when the payload ends first.
  absl::Status Fill(std::span<const std::byte> stored, std::span<std::byte> out);

  const uint64_t raw_bytes_;
  const std::string file_;
  const uint64_t offset_;
  std::unique_ptr<Context> ctx_;
  uint64_t position_ = 0;  // Raw bytes produced.
  uint64_t consumed_ = 0;  // Payload bytes zstd has taken.
  bool frame_done_ = false;
};

// Checks that a stored payload decodes to exactly raw_bytes, decoding in bounded pieces (what
// verify needs: the bytes are dropped). kDataLoss naming `file` and `offset` otherwise.
absl::Status CheckPayloadDecodes(Codec codec, std::span<const std::byte> stored,
                                 uint64_t raw_bytes, absl::string_view file, uint64_t offset);

// LATEST: names the newest committed step.
std::string EncodeLatest(uint64_t step);
// kDataLoss naming `file` on any damage.
absl::StatusOr<uint64_t> DecodeLatest(std::span<const std::byte> bytes, absl::string_view file);

}  // namespace ckpt::formats

#endif  // CKPT_FORMATS_CHUNK_H_
