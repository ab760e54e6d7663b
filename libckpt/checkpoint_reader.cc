#include "ckpt/checkpoint_reader.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <tuple>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "ckpt/base/checksum.h"
#include "ckpt/base/coding.h"
#include "ckpt/base/status_macros.h"
#include "libckpt/aligned_buffer.h"
#include "libckpt/filename.h"
#include "libckpt/read_pipeline.h"

namespace ckpt {

using formats::ChunkInfo;

// One chunk to read and the slice of its raw bytes that goes to `out`.
struct CheckpointReader::ChunkRead {
  uint32_t file;
  uint64_t chunk;
  uint64_t raw_offset;  // Within the chunk's raw bytes.
  uint64_t length;
  std::byte* out;
  // What the chunk holds, for errors: the manifest's name of its tensor (elements [first,
  // first + count)) or blob (bytes [first, first + count)).
  const std::string* holder;
  bool blob;
  uint64_t first;
  uint64_t count;
};

// The zstd streams of the compressed chunks last read in part (see decoded_bytes()). A read
// takes its chunk's stream out of the table while it decodes (other chunks' reads go on) and
// puts it back unless it reached the chunk's end; the least recently used stream goes first.
struct CheckpointReader::DecodeCache {
  static constexpr size_t kStreams = 4;
  struct Entry {
    uint32_t file;
    uint64_t chunk;
    std::unique_ptr<formats::ZstdPayloadStream> stream;
  };
  std::mutex mu;
  std::vector<Entry> entries;  // Guarded by mu; most recently used last.
  std::atomic<uint64_t> decoded_bytes{0};

  // The stream of (file, chunk) if it has not passed raw_offset yet.
  std::unique_ptr<formats::ZstdPayloadStream> Take(uint32_t file, uint64_t chunk,
                                                   uint64_t raw_offset) {
    std::lock_guard<std::mutex> lock(mu);
    for (auto it = entries.begin(); it != entries.end(); ++it) {
      if (it->file != file || it->chunk != chunk) continue;
      std::unique_ptr<formats::ZstdPayloadStream> s = std::move(it->stream);
      entries.erase(it);
      if (s->position() <= raw_offset) return s;
      return nullptr;  // Behind the read: a fresh stream starts from the chunk's first byte.
    }
    return nullptr;
  }
  void Put(uint32_t file, uint64_t chunk, std::unique_ptr<formats::ZstdPayloadStream> s) {
    std::lock_guard<std::mutex> lock(mu);
    // Two reads of one chunk that missed at once: the later stream replaces the earlier.
    std::erase_if(entries, [&](const Entry& e) { return e.file == file && e.chunk == chunk; });
    if (entries.size() == kStreams) entries.erase(entries.begin());
    entries.push_back({file, chunk, std::move(s)});
  }
};

// The manifest's lookups, made once: a tensor's index by name (the first tensor of a name, as
// a scan in manifest order finds it) and each tensor's pieces ordered by begin, with `reach`,
// the largest end among a piece and those before it in that order. The pieces that overlap
// [begin, end) all lie from the first position whose reach passes begin up to the first
// piece that begins at or after end.
struct CheckpointReader::Index {
  absl::flat_hash_map<std::string, uint32_t> tensor_of;
  std::vector<uint32_t> order;   // Piece indices, grouped by tensor, each group by begin.
  std::vector<uint64_t> reach;   // Parallel to order.
  std::vector<size_t> first;     // Tensor t's group is order[first[t], first[t + 1]).

  explicit Index(const formats::Manifest& m) {
    tensor_of.reserve(m.tensors.size());
    for (uint32_t t = 0; t < m.tensors.size(); ++t) tensor_of.emplace(m.tensors[t].name, t);
    first.assign(m.tensors.size() + 1, 0);
    for (const formats::PieceInfo& p : m.pieces) {
      if (p.tensor < m.tensors.size()) ++first[p.tensor + 1];
    }
    for (size_t t = 0; t < m.tensors.size(); ++t) first[t + 1] += first[t];
    order.resize(first.back());
    std::vector<size_t> at(first.begin(), first.end() - 1);
    for (uint32_t i = 0; i < m.pieces.size(); ++i) {
      if (m.pieces[i].tensor < m.tensors.size()) order[at[m.pieces[i].tensor]++] = i;
    }
    reach.resize(order.size());
    for (size_t t = 0; t < m.tensors.size(); ++t) {
      const auto group_begin = order.begin() + static_cast<ptrdiff_t>(first[t]);
      const auto group_end = order.begin() + static_cast<ptrdiff_t>(first[t + 1]);
      std::stable_sort(group_begin, group_end, [&](uint32_t a, uint32_t b) {
        return m.pieces[a].begin < m.pieces[b].begin;
      });
      uint64_t most = 0;
      for (size_t k = first[t]; k < first[t + 1]; ++k) {
        const formats::PieceInfo& p = m.pieces[order[k]];
        most = std::max(most, p.begin + p.count);
        reach[k] = most;
      }
    }
  }

  // Tensor `t`'s pieces that overlap [begin, end), by begin, until `fn` returns false.
  template <typename Fn>
  void ForEachOverlapping(const formats::Manifest& m, uint32_t t, uint64_t begin, uint64_t end,
                          Fn&& fn) const {
    const auto from = std::upper_bound(reach.begin() + static_cast<ptrdiff_t>(first[t]),
                                       reach.begin() + static_cast<ptrdiff_t>(first[t + 1]),
                                       begin);
    for (size_t k = static_cast<size_t>(from - reach.begin()); k < first[t + 1]; ++k) {
      const formats::PieceInfo& p = m.pieces[order[k]];
      if (p.begin >= end) break;
      if (begin < p.begin + p.count && !fn(p)) break;
    }
  }
};

CheckpointReader::CheckpointReader(std::string dir, const StoreOptions& options, Env* env)
    : dir_(std::move(dir)), options_(options), env_(env), cache_(std::make_unique<DecodeCache>()) {}

uint64_t CheckpointReader::decoded_bytes() const { return cache_->decoded_bytes.load(); }

CheckpointReader::~CheckpointReader() = default;

absl::StatusOr<std::unique_ptr<CheckpointReader>> CheckpointReader::Open(
    const std::string& step_dir, const StoreOptions& options) {
  Env* env = options.env != nullptr ? options.env : Env::Default();
  std::unique_ptr<CheckpointReader> reader(new CheckpointReader(step_dir, options, env));
  const std::string manifest_path = JoinPath(step_dir, internal::kManifestName);
  CKPT_ASSIGN_OR_RETURN(std::string bytes,
                        ReadFileToString(env, manifest_path, formats::kMaxManifestBytes,
                                         FileOptions{.follow_symlinks = false}));
  CKPT_ASSIGN_OR_RETURN(reader->manifest_, formats::ParseManifest(AsBytes(bytes), manifest_path));
  // A step directory holds the step its name says: a MANIFEST copied or renamed from another
  // step would hand out the wrong state under the right name.
  absl::string_view base = step_dir;
  while (base.size() > 1 && base.back() == '/') base.remove_suffix(1);
  base = base.substr(base.rfind('/') + 1);
  if (std::optional<uint64_t> named = internal::ParseStepDirName(base);
      named.has_value() && *named != reader->manifest_.step) {
    return absl::DataLossError(absl::StrCat(manifest_path, ": names step ", reader->manifest_.step,
                                            ", but its directory is ", base));
  }
  for (const formats::DataFileInfo& f : reader->manifest_.files) {
    const std::string path = JoinPath(step_dir, f.name);
    CKPT_ASSIGN_OR_RETURN(std::unique_ptr<RandomAccessFile> file,
                          env->NewRandomAccessFile(path, FileOptions{.direct_io = options.direct_io,
                                                                     .follow_symlinks = false}));
    if (file->size() != f.size_bytes) {
      return absl::DataLossError(
          absl::StrCat(path, ": is ", file->size(), " bytes, MANIFEST says ", f.size_bytes));
    }
    CKPT_ASSIGN_OR_RETURN(internal::AlignedBuffer header,
                          internal::AlignedBuffer::Create(formats::kDataFileHeaderBytes));
    CKPT_RETURN_IF_ERROR(file->Read(0, header.span()));
    CKPT_ASSIGN_OR_RETURN(formats::DataFileHeader h,
                          formats::DecodeDataFileHeader(header.span(), path));
    if (h.rank != f.rank || h.step != reader->manifest_.step ||
        h.world_size != reader->manifest_.world_size) {
      return absl::DataLossError(absl::StrCat(path, ": header names rank ", h.rank, " step ",
                                              h.step, ", MANIFEST says rank ", f.rank, " step ",
                                              reader->manifest_.step));
    }
    reader->files_.push_back(std::move(file));
  }
  reader->index_ = std::make_unique<const Index>(reader->manifest_);
  return reader;
}

absl::StatusOr<const formats::TensorInfo*> CheckpointReader::FindTensor(
    absl::string_view name) const {
  const auto it = index_->tensor_of.find(name);
  if (it != index_->tensor_of.end()) return &manifest_.tensors[it->second];
  return absl::NotFoundError(absl::StrCat(dir_, ": no tensor \"", name, "\""));
}

bool CheckpointReader::Covers(absl::string_view tensor, uint64_t begin, uint64_t count) const {
  const auto it = index_->tensor_of.find(tensor);
  if (it == index_->tensor_of.end()) return false;
  if (count == 0) return true;
  const uint64_t numel = manifest_.tensors[it->second].numel();
  if (begin >= numel || count > numel - begin) return false;  // No piece lies past the end.
  const uint64_t end = begin + count;
  uint64_t at = begin;
  // The pieces that overlap the range, by begin: each extends `at` until one begins past it
  // (a hole: those after it begin later still) or `at` reaches the end.
  index_->ForEachOverlapping(manifest_, it->second, begin, end, [&](const formats::PieceInfo& p) {
    if (p.begin > at) return false;
    at = std::max(at, p.begin + p.count);
    return at < end;
  });
  return at >= end;
}

absl::Status CheckpointReader::DeliverChunk(std::span<const ChunkRead* const> reads,
                                            std::span<const std::byte> bytes) const {
  const ChunkRead& first = *reads.front();
  const formats::DataFileInfo& f = manifest_.files[first.file];
  const ChunkInfo& c = f.chunks[first.chunk];
  const std::string path = JoinPath(dir_, f.name);
  if (Checksum(bytes) != c.checksum) {
    return absl::DataLossError(absl::StrCat(
        path, ": chunk ", first.chunk, " at offset ", c.offset, " (",
        first.blob ? "blob" : "tensor", " \"", *first.holder, "\", ",
        first.blob ? "bytes" : "elements", " [", first.first, ", ", first.first + first.count,
        ")) fails its checksum"));
  }
  CKPT_ASSIGN_OR_RETURN(formats::ChunkHeader h, formats::DecodeChunkHeader(bytes, path, c.offset));
  if (h.codec != c.codec || h.raw_bytes != c.raw_bytes || h.stored_bytes != c.stored_bytes) {
    return absl::DataLossError(absl::StrCat(path, ": chunk ", first.chunk, " at offset ", c.offset,
                                            " disagrees with MANIFEST"));
  }
  std::span<const std::byte> payload = bytes.subspan(formats::kChunkHeaderBytes, c.stored_bytes);
  for (const ChunkRead* read : reads) {
    CKPT_RETURN_IF_ERROR(CopyOut(*read, payload, path));
  }
  return absl::OkStatus();
}

absl::Status CheckpointReader::CopyOut(const ChunkRead& read, std::span<const std::byte> payload,
                                       const std::string& path) const {
  const ChunkInfo& c = manifest_.files[read.file].chunks[read.chunk];
  if (c.codec == formats::Codec::kRaw) {
    std::memcpy(read.out, payload.data() + read.raw_offset, read.length);
    return absl::OkStatus();
  }
  if (read.length == c.raw_bytes) {
    const absl::Status decoded = formats::DecodeChunkPayload(
        c.codec, payload, std::span<std::byte>(read.out, read.length), path, c.offset);
    cache_->decoded_bytes += c.raw_bytes;
    return decoded;
  }
  // In part: decoded from where this chunk's stream stopped, so reading a chunk in batches
  // front to back decodes it once. Its stored bytes were verified above, as on every read.
  std::unique_ptr<formats::ZstdPayloadStream> stream =
      cache_->Take(read.file, read.chunk, read.raw_offset);
  if (stream == nullptr) {
    CKPT_ASSIGN_OR_RETURN(stream, formats::ZstdPayloadStream::Create(c.raw_bytes, path, c.offset));
  }
  const uint64_t before = stream->position();
  CKPT_RETURN_IF_ERROR(
      stream->Read(payload, read.raw_offset, std::span<std::byte>(read.out, read.length)));
  cache_->decoded_bytes += stream->position() - before;
  if (stream->position() < c.raw_bytes) cache_->Put(read.file, read.chunk, std::move(stream));
  return absl::OkStatus();
}

// Chunks are read on read_threads I/O threads and checked and copied out on worker threads
// (libckpt/read_pipeline.h), so the device is kept busy while earlier chunks are checksummed.
// A chunk is read (and checksummed) once however many of `reads` it serves, and its slices
// are delivered in order of their offset (a compressed chunk's stream then only goes forward).
// Small chunks (extents of at most kMergeChunkBytes) near each other in one file are read as
// one extent (up to kMergedReadBytes, skipping gaps of at most kMergeGapBytes): a checkpoint of
// many small tensors is then read in requests of megabytes, not one 4 KiB request per chunk.
// Larger chunks keep a range each, so that their checks and copies spread over the workers.
// A merged read also reads bytes nobody asked for (the gaps, the chunks between): when it fails
// short of a checksum (EIO on a bad sector), every chunk is read again alone, so that damage
// outside the chunks asked for fails nothing that would have read without the merging.
absl::Status CheckpointReader::ReadChunks(const std::vector<ChunkRead>& reads) const {
  bool merged = false;
  absl::Status s = ReadChunksOnce(reads, /*merge=*/true, &merged);
  if (s.ok() || !merged || s.code() == absl::StatusCode::kDataLoss) return s;
  return ReadChunksOnce(reads, /*merge=*/false, &merged);
}

absl::Status CheckpointReader::ReadChunksOnce(const std::vector<ChunkRead>& reads, bool merge,
                                              bool* merged) const {
  constexpr uint64_t kMergeChunkBytes = uint64_t{256} << 10;
  constexpr uint64_t kMergedReadBytes = uint64_t{4} << 20;
  constexpr uint64_t kMergeGapBytes = uint64_t{64} << 10;
  std::vector<const ChunkRead*> order;
  order.reserve(reads.size());
  for (const ChunkRead& r : reads) order.push_back(&r);
  std::stable_sort(order.begin(), order.end(), [](const ChunkRead* a, const ChunkRead* b) {
    return std::tie(a->file, a->chunk, a->raw_offset) < std::tie(b->file, b->chunk, b->raw_offset);
  });
  std::vector<size_t> group_begin;  // Into `order`; one group per chunk.
  for (size_t i = 0; i < order.size(); ++i) {
    if (i > 0 && order[i]->file == order[i - 1]->file && order[i]->chunk == order[i - 1]->chunk) {
      continue;
    }
    group_begin.push_back(i);
  }
  const size_t groups = group_begin.size();
  group_begin.push_back(order.size());
  auto chunk = [&](size_t g) -> const ChunkInfo& {
    const ChunkRead& first = *order[group_begin[g]];
    return manifest_.files[first.file].chunks[first.chunk];
  };
  // Each range reads the chunks of groups [range_begin[k], range_begin[k + 1]), in offset order
  // (chunks are numbered in the order of their offsets within a file).
  std::vector<internal::PipelinedRead> ranges;
  std::vector<size_t> range_begin;
  bool last_small = false;  // The last range holds small chunks only.
  for (size_t g = 0; g < groups; ++g) {
    const ChunkInfo& c = chunk(g);
    const uint64_t end = c.offset + formats::ChunkExtentBytes(c.stored_bytes);
    const bool small = end - c.offset <= kMergeChunkBytes;
    const RandomAccessFile* file = files_[order[group_begin[g]]->file].get();
    if (merge && small && last_small) {
      internal::PipelinedRead& last = ranges.back();
      const uint64_t last_end = last.offset + last.length;
      if (last.file == file && c.offset >= last_end && c.offset - last_end <= kMergeGapBytes &&
          end - last.offset <= kMergedReadBytes) {
        last.length = end - last.offset;
        *merged = true;
        continue;
      }
    }
    ranges.push_back({file, c.offset, end - c.offset});
    range_begin.push_back(g);
    last_small = small;
  }
  range_begin.push_back(groups);
  return internal::RunReadPipeline(
      env_, ranges, options_.read_threads, [&](size_t k, std::span<const std::byte> bytes) {
        const uint64_t base = ranges[k].offset;
        for (size_t g = range_begin[k]; g < range_begin[k + 1]; ++g) {
          const ChunkInfo& c = chunk(g);
          CKPT_RETURN_IF_ERROR(DeliverChunk(
              std::span<const ChunkRead* const>(order.data() + group_begin[g],
                                                group_begin[g + 1] - group_begin[g]),
              bytes.subspan(c.offset - base, formats::ChunkExtentBytes(c.stored_bytes))));
        }
        return absl::OkStatus();
      });
}

absl::Status CheckpointReader::ReadRange(absl::string_view tensor, uint64_t begin, uint64_t count,
                                         std::span<std::byte> out) const {
  std::vector<ChunkRead> reads;
  CKPT_RETURN_IF_ERROR(PlanRange(tensor, begin, count, out, &reads));
  return ReadChunks(reads);
}

absl::Status CheckpointReader::ReadRanges(std::span<const RangeRead> ranges) const {
  std::vector<ChunkRead> reads;
  for (const RangeRead& r : ranges) {
    CKPT_RETURN_IF_ERROR(PlanRange(r.tensor, r.begin, r.count, r.out, &reads));
  }
  return ReadChunks(reads);
}

absl::Status CheckpointReader::PlanRange(absl::string_view tensor, uint64_t begin, uint64_t count,
                                         std::span<std::byte> out,
                                         std::vector<ChunkRead>* reads) const {
  CKPT_ASSIGN_OR_RETURN(const formats::TensorInfo* t, FindTensor(tensor));
  const uint32_t index = static_cast<uint32_t>(t - manifest_.tensors.data());
  const uint64_t numel = t->numel();
  const uint64_t esize = formats::DTypeSize(t->dtype);
  if (begin > numel || count > numel - begin) {
    return absl::InvalidArgumentError(absl::StrCat("range [", begin, ", +", count, ") of \"",
                                                   tensor, "\" lies outside its ", numel,
                                                   " elements"));
  }
  if (out.size() != count * esize) {
    return absl::InvalidArgumentError(absl::StrCat("output for \"", tensor, "\" has ", out.size(),
                                                   " bytes, expected ", count * esize));
  }
  const uint64_t end = begin + count;
  std::vector<const formats::PieceInfo*> pieces;  // Those overlapping the range, by begin.
  index_->ForEachOverlapping(manifest_, index, begin, end, [&](const formats::PieceInfo& p) {
    pieces.push_back(&p);
    return true;
  });
  uint64_t covered = begin;
  for (const formats::PieceInfo* p : pieces) {
    if (p->begin > covered) break;
    const uint64_t lo = std::max(begin, p->begin);
    const uint64_t hi = std::min(end, p->begin + p->count);
    // j < chunk_count keeps j * chunk_elems below count: no overflow for any valid manifest.
    for (uint64_t j = (lo - p->begin) / p->chunk_elems; j < p->chunk_count; ++j) {
      const uint64_t offset = j * p->chunk_elems;
      const uint64_t chunk_lo = p->begin + offset;
      if (chunk_lo >= hi) break;
      const uint64_t a = std::max(lo, chunk_lo);
      const uint64_t b = std::min(hi, chunk_lo + std::min(p->chunk_elems, p->count - offset));
      reads->push_back({p->file, p->first_chunk + j, (a - chunk_lo) * esize, (b - a) * esize,
                        out.data() + (a - begin) * esize, &manifest_.tensors[index].name,
                        /*blob=*/false, chunk_lo, std::min(p->chunk_elems, p->count - offset)});
    }
    covered = hi;
  }
  if (covered < end) {
    return absl::NotFoundError(
        absl::StrCat(dir_, ": no piece holds element ", covered, " of \"", tensor, "\""));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> CheckpointReader::ReadBlob(absl::string_view name,
                                                       uint32_t rank) const {
  for (const formats::BlobInfo& b : manifest_.blobs) {
    if (b.name != name || b.rank != rank) continue;
    std::string out(b.size_bytes, '\0');
    std::vector<ChunkRead> reads;
    uint64_t pos = 0;
    for (uint64_t j = 0; j < b.chunk_count; ++j) {
      const ChunkInfo& c = manifest_.files[b.file].chunks[b.first_chunk + j];
      reads.push_back({b.file, b.first_chunk + j, 0, c.raw_bytes,
                       reinterpret_cast<std::byte*>(out.data()) + pos, &b.name, /*blob=*/true, pos,
                       c.raw_bytes});
      pos += c.raw_bytes;
    }
    CKPT_RETURN_IF_ERROR(ReadChunks(reads));
    return out;
  }
  return absl::NotFoundError(absl::StrCat(dir_, ": rank ", rank, " stored no blob \"", name, "\""));
}

}  // namespace ckpt
