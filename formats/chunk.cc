// Framing of data files and LATEST, format v1. All integers little-endian.
//
//   data_file   := file_header chunk*
//   file_header := "CKPTDATA" version:u32 rank:u32 world_size:u32 reserved:u32(=0) step:u64
//                  zero padding to byte 4088, checksum:u64     (4096 bytes; checksum is the
//                  XXH3-64 of bytes [0, 4088))
//   chunk       := chunk_header payload zero padding to a multiple of 4096 bytes
//   chunk_header:= "CKC1" codec:u8 reserved:u8[3](=0) raw_bytes:u64 stored_bytes:u64
//                  (24 bytes; codec 0 = raw, 1 = zstd; raw needs stored_bytes == raw_bytes)
//   The manifest records each chunk's offset (a multiple of 4096), sizes, codec and the XXH3-64
//   of its whole extent (header, payload and padding), so every byte of a data file is covered
//   by a checksum: the file header by its own, each chunk by the manifest's.
//
//   LATEST      := "CKLATEST" version:u32 reserved:u32(=0) step:u64 checksum:u64
//                  (32 bytes; checksum is the XXH3-64 of bytes [0, 24))
#include "ckpt/formats/chunk.h"

#include <zstd.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "ckpt/base/checksum.h"
#include "ckpt/base/coding.h"
#include "ckpt/base/status_macros.h"

namespace ckpt::formats {
namespace {

constexpr absl::string_view kDataMagic = kDataFileMagic;
constexpr absl::string_view kChunkMagic = "CKC1";

bool HasMagic(std::span<const std::byte> bytes, absl::string_view magic) {
  return bytes.size() >= magic.size() && std::memcmp(bytes.data(), magic.data(), magic.size()) == 0;
}

}  // namespace

absl::string_view CodecName(Codec codec) { return codec == Codec::kZstd ? "zstd" : "raw"; }

std::string EncodeDataFileHeader(const DataFileHeader& header) {
  std::string out(kDataMagic);
  PutFixed32(&out, kFormatVersion);
  PutFixed32(&out, header.rank);
  PutFixed32(&out, header.world_size);
  PutFixed32(&out, 0);
  PutFixed64(&out, header.step);
  out.resize(kDataFileHeaderBytes - 8, '\0');
  PutFixed64(&out, Checksum(AsBytes(out)));
  return out;
}

absl::StatusOr<DataFileHeader> DecodeDataFileHeader(std::span<const std::byte> block,
                                                    absl::string_view file) {
  if (block.size() < kDataFileHeaderBytes) {
    return absl::DataLossError(absl::StrCat(file, ": data file header truncated at ", block.size(),
                                            " bytes (need ", kDataFileHeaderBytes, ")"));
  }
  if (!HasMagic(block, kDataMagic)) {
    return absl::DataLossError(absl::StrCat(file, ": bad data file magic at offset 0"));
  }
  uint64_t stored = DecodeFixed64(block.data() + kDataFileHeaderBytes - 8);
  uint64_t actual = Checksum(block.first(kDataFileHeaderBytes - 8));
  if (stored != actual) {
    return absl::DataLossError(absl::StrCat(
        file, ": data file header checksum mismatch (offset 0..", kDataFileHeaderBytes, ")"));
  }
  uint32_t version = DecodeFixed32(block.data() + 8);
  if (version != kFormatVersion) {
    return absl::UnimplementedError(
        absl::StrCat(file, ": data file format version ", version, " is not supported"));
  }
  DataFileHeader h;
  h.rank = DecodeFixed32(block.data() + 12);
  h.world_size = DecodeFixed32(block.data() + 16);
  h.step = DecodeFixed64(block.data() + 24);
  return h;
}

std::string EncodeChunkHeader(const ChunkHeader& header) {
  std::string out(kChunkMagic);
  out.push_back(static_cast<char>(header.codec));
  out.append(3, '\0');
  PutFixed64(&out, header.raw_bytes);
  PutFixed64(&out, header.stored_bytes);
  return out;
}

absl::StatusOr<ChunkHeader> DecodeChunkHeader(std::span<const std::byte> bytes,
                                              absl::string_view file, uint64_t offset) {
  if (bytes.size() < kChunkHeaderBytes) {
    return absl::DataLossError(absl::StrCat(file, ": chunk header truncated at offset ", offset));
  }
  if (!HasMagic(bytes, kChunkMagic)) {
    return absl::DataLossError(absl::StrCat(file, ": bad chunk magic at offset ", offset));
  }
  uint8_t codec = static_cast<uint8_t>(bytes[4]);
  if (codec > 1 || bytes[5] != std::byte{0} || bytes[6] != std::byte{0} ||
      bytes[7] != std::byte{0}) {
    return absl::DataLossError(
        absl::StrCat(file, ": bad chunk codec or reserved bytes at offset ", offset + 4));
  }
  ChunkHeader h;
  h.codec = static_cast<Codec>(codec);
  h.raw_bytes = DecodeFixed64(bytes.data() + 8);
  h.stored_bytes = DecodeFixed64(bytes.data() + 16);
  if (h.raw_bytes > kMaxChunkBytes || h.stored_bytes > kMaxChunkBytes ||
      (h.codec == Codec::kRaw && h.raw_bytes != h.stored_bytes)) {
    return absl::DataLossError(absl::StrCat(file, ": chunk at offset ", offset, " claims raw ",
                                            h.raw_bytes, " / stored ", h.stored_bytes, " bytes"));
  }
  return h;
}

uint64_t ChunkExtentBytes(uint64_t stored_bytes) {
  return RoundUp(kChunkHeaderBytes + stored_bytes, kBlockBytes);
}

absl::StatusOr<std::string> CompressZstd(std::span<const std::byte> raw, int level) {
  std::string out(ZSTD_compressBound(raw.size()), '\0');
  size_t n = ZSTD_compress(out.data(), out.size(), raw.data(), raw.size(), level);
  if (ZSTD_isError(n)) {
    return absl::InternalError(absl::StrCat("zstd compress: ", ZSTD_getErrorName(n)));
  }
  out.resize(n);
  return out;
}

absl::Status DecodeChunkPayload(Codec codec, std::span<const std::byte> stored,
                                std::span<std::byte> out, absl::string_view file, uint64_t offset) {
  if (codec == Codec::kRaw) {
    if (stored.size() != out.size()) {
      return absl::DataLossError(absl::StrCat(file, ": raw chunk at offset ", offset, " holds ",
                                              stored.size(), " bytes, expected ", out.size()));
    }
    std::memcpy(out.data(), stored.data(), out.size());
    return absl::OkStatus();
  }
  size_t n = ZSTD_decompress(out.data(), out.size(), stored.data(), stored.size());
  if (ZSTD_isError(n) || n != out.size()) {
    return absl::DataLossError(absl::StrCat(
        file, ": zstd chunk at offset ", offset, " does not decode to ", out.size(), " bytes",
        ZSTD_isError(n) ? absl::StrCat(" (", ZSTD_getErrorName(n), ")") : std::string()));
  }
  return absl::OkStatus();
}

struct ZstdPayloadStream::Context {
  ZSTD_DCtx* dctx = nullptr;
  ~Context() { ZSTD_freeDCtx(dctx); }
};

ZstdPayloadStream::ZstdPayloadStream(uint64_t raw_bytes, std::string file, uint64_t offset)
    : raw_bytes_(raw_bytes), file_(std::move(file)), offset_(offset),
      ctx_(std::make_unique<Context>()) {}

ZstdPayloadStream::~ZstdPayloadStream() = default;

absl::StatusOr<std::unique_ptr<ZstdPayloadStream>> ZstdPayloadStream::Create(uint64_t raw_bytes,
                                                                             std::string file,
                                                                             uint64_t offset) {
  std::unique_ptr<ZstdPayloadStream> s(new ZstdPayloadStream(raw_bytes, std::move(file), offset));
  s->ctx_->dctx = ZSTD_createDCtx();
  if (s->ctx_->dctx == nullptr) return absl::InternalError("zstd: cannot create a context");
  return s;
}

absl::Status ZstdPayloadStream::Fill(std::span<const std::byte> stored, std::span<std::byte> out) {
  auto damaged = [&](absl::string_view why) {
    return absl::DataLossError(absl::StrCat(file_, ": zstd chunk at offset ", offset_,
                                            " does not decode to ", raw_bytes_, " bytes (", why,
                                            " at raw byte ", position_, ")"));
  };
  if (consumed_ > stored.size()) return damaged("the payload shrank");
  ZSTD_inBuffer in{stored.data(), stored.size(), consumed_};
  ZSTD_outBuffer o{out.data(), out.size(), 0};
  while (o.pos < o.size) {
    if (frame_done_) return damaged("it ends early");
    const size_t before_in = in.pos, before_out = o.pos;
    const size_t r = ZSTD_decompressStream(ctx_->dctx, &o, &in);
    if (ZSTD_isError(r)) return damaged(ZSTD_getErrorName(r));
    frame_done_ = r == 0;
    if (in.pos == before_in && o.pos == before_out && !frame_done_) {
      return damaged("it is truncated");
    }
  }
  consumed_ = in.pos;
  position_ += o.pos;
  // A frame that ends as this read's buffer fills, short of raw_bytes, is damage now, not at
  // the next read.
  if (frame_done_ && position_ < raw_bytes_) return damaged("it ends early");
  if (position_ == raw_bytes_ && !frame_done_) {
    // Every byte is out; the frame must end here, with nothing after it.
    std::byte extra[1];
    ZSTD_outBuffer x{extra, sizeof(extra), 0};
    const size_t r = ZSTD_decompressStream(ctx_->dctx, &x, &in);
    if (ZSTD_isError(r)) return damaged(ZSTD_getErrorName(r));
    if (x.pos != 0 || r != 0) return damaged(x.pos != 0 ? "it holds more" : "it is truncated");
    frame_done_ = true;
    consumed_ = in.pos;
  }
  if (position_ == raw_bytes_ && consumed_ != stored.size()) {
    return damaged("bytes follow its frame");
  }
  return absl::OkStatus();
}

absl::Status ZstdPayloadStream::Read(std::span<const std::byte> stored, uint64_t raw_offset,
                                     std::span<std::byte> out) {
  if (raw_offset < position_ || raw_offset > raw_bytes_ ||
      out.size() > raw_bytes_ - raw_offset) {
    return absl::InvalidArgumentError(
        absl::StrCat(file_, ": zstd chunk at offset ", offset_, ": raw range [", raw_offset,
                     ", +", out.size(), ") is not ahead of byte ", position_, " within ",
                     raw_bytes_));
  }
  if (raw_offset > position_) {
    constexpr uint64_t kSkipBytes = 256 << 10;
    auto scratch = std::make_unique_for_overwrite<std::byte[]>(
        std::min<uint64_t>(kSkipBytes, raw_offset - position_));
    while (position_ < raw_offset) {
      const uint64_t n = std::min<uint64_t>(kSkipBytes, raw_offset - position_);
      CKPT_RETURN_IF_ERROR(Fill(stored, std::span<std::byte>(scratch.get(), n)));
    }
  }
  return Fill(stored, out);
}

absl::Status CheckPayloadDecodes(Codec codec, std::span<const std::byte> stored,
                                 uint64_t raw_bytes, absl::string_view file, uint64_t offset) {
  if (codec == Codec::kRaw) {
    if (stored.size() == raw_bytes) return absl::OkStatus();
    return absl::DataLossError(absl::StrCat(file, ": raw chunk at offset ", offset, " holds ",
                                            stored.size(), " bytes, expected ", raw_bytes));
  }
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<ZstdPayloadStream> stream,
                        ZstdPayloadStream::Create(raw_bytes, std::string(file), offset));
  return stream->Read(stored, raw_bytes, {});
}

std::string EncodeLatest(uint64_t step) {
  std::string out(kLatestMagic);
  PutFixed32(&out, kFormatVersion);
  PutFixed32(&out, 0);
  PutFixed64(&out, step);
  PutFixed64(&out, Checksum(AsBytes(out)));
  return out;
}

absl::StatusOr<uint64_t> DecodeLatest(std::span<const std::byte> bytes, absl::string_view file) {
  if (bytes.size() != kLatestBytes) {
    return absl::DataLossError(
        absl::StrCat(file, ": LATEST is ", bytes.size(), " bytes, expected ", kLatestBytes));
  }
  if (!HasMagic(bytes, kLatestMagic)) {
    return absl::DataLossError(absl::StrCat(file, ": bad LATEST magic at offset 0"));
  }
  if (DecodeFixed64(bytes.data() + 24) != Checksum(bytes.first(24))) {
    return absl::DataLossError(absl::StrCat(file, ": LATEST checksum mismatch"));
  }
  uint32_t version = DecodeFixed32(bytes.data() + 8);
  if (version != kFormatVersion) {
    return absl::UnimplementedError(
        absl::StrCat(file, ": LATEST format version ", version, " is not supported"));
  }
  return DecodeFixed64(bytes.data() + 16);
}

}  // namespace ckpt::formats
