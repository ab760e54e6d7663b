// Save protocol (DESIGN.md §3). R ranks; rank 0 runs on the primary store handle.
// 1. Begin, collective: rank 0 checks that the step is newer than LATEST and that no save is
//    in flight, creates <root>/.staging-step-N-<nonce>/ and broadcasts its name or its error
//    (then every rank fails BeginSave). Recovery deletes staging directories, so a crash
//    anywhere before step 8 leaves exactly the previous state.
// 2. Each rank creates rank-r.data in the staging directory, and writes the file header with
//    its first chunk (or at step 3 when it writes none: a rank waiting to write holds no write
//    buffers), then each chunk (header, payload, zero padding to 4 KiB) at an extent it
//    reserves in order. A few writer threads (libckpt/chunk_writer.h) build and write the
//    extents, several at once, computing each chunk's XXH3-64 as they copy it: the bytes are
//    checksummed once, on their way out, never re-read. Small chunks (extents of at most
//    kBatchChunkBytes) are gathered and queued together, up to kBatchBytes, to be written by one
//    WriteAt; a wait of any kind queues what is gathered first. Where the batches end depends
//    only on the calls made, never on timing. WritePiece returns once its bytes are
//    copied; the piece stream's Queue sooner, for a caller that keeps its memory unchanged
//    until WaitWritten or WaitCopied.
// 3-10. Commit: libckpt/store/commit.cc, where those steps are written.
#include "libckpt/store/store_impl.h"

#include <algorithm>
#include <cstring>
#include <map>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "ckpt/base/checksum.h"
#include "ckpt/base/coding.h"
#include "ckpt/base/status_macros.h"
#include "ckpt/checkpoint_store.h"
#include "libckpt/chunk_writer.h"
#include "libckpt/filename.h"

namespace ckpt {
namespace {

using formats::ChunkInfo;

// A chunk whose extent is at most this is written together with its neighbours (each such
// write extends the file, and a file system serializes those: one write per 4 KiB chunk ran at
// 0.01 of the disk's rate).
constexpr uint64_t kBatchChunkBytes = uint64_t{256} << 10;
// The most bytes one write of gathered chunks carries.
constexpr uint64_t kBatchBytes = uint64_t{4} << 20;

}  // namespace

internal::Transaction::Transaction(StoreImpl* store, Coordinator* coordinator, uint64_t step,
                                 std::string staging_dir, absl::Status begin_error)
    : store_(store),
      env_(store->env()),
      coordinator_(coordinator),
      step_(step),
      staging_dir_(std::move(staging_dir)),
      next_offset_(formats::kDataFileHeaderBytes),
      error_(std::move(begin_error)) {
  const uint32_t rank = static_cast<uint32_t>(coordinator_->rank());
  part_.step = step;
  part_.world_size = static_cast<uint32_t>(coordinator_->size());
  part_.files.push_back({internal::DataFileName(rank), rank, 0, {}});
  if (!error_.ok()) return;
  // Step 2: the data file and its header.
  const std::string path = JoinPath(staging_dir_, internal::DataFileName(rank));
  absl::StatusOr<std::unique_ptr<WritableFile>> file =
      env_->NewWritableFile(path, FileOptions{.direct_io = store_->options().direct_io});
  if (!file.ok()) {
    Fail(file.status()).IgnoreError();  // Kept in error_; reported by Commit.
    return;
  }
  file_ = std::move(file).value();
}

absl::Status internal::Transaction::WriteHeaderOnce() {
  if (header_written_) return absl::OkStatus();
  header_written_ = true;
  if (writer_ == nullptr) {
    writer_ = std::make_unique<internal::ChunkWriter>(env_, file_.get(),
                                                      store_->options().write_threads);
  }
  formats::DataFileHeader header{step_, part_.files[0].rank, part_.world_size};
  internal::ChunkWriter::Job job;
  job.offset = 0;
  job.prefix = formats::EncodeDataFileHeader(header);
  job.what = absl::StrCat("save step ", step_, " data file header");
  CKPT_RETURN_IF_ERROR(writer_->Submit(std::move(job)).status());
  ++jobs_;
  return absl::OkStatus();
}

absl::Status internal::Transaction::FlushPending() {
  if (pending_.empty()) return absl::OkStatus();
  std::vector<internal::ChunkWriter::Job> jobs = std::move(pending_);
  pending_.clear();
  pending_bytes_ = 0;
  const uint64_t first = jobs_ - jobs.size();
  CKPT_ASSIGN_OR_RETURN(const uint64_t n, writer_->SubmitBatch(std::move(jobs)));
  if (n != first) {
    return absl::InternalError(absl::StrCat("save step ", step_, ": the writer numbered job ",
                                            first, " as ", n));
  }
  return absl::OkStatus();
}

absl::Status internal::Transaction::WaitFor(uint64_t jobs, bool written) {
  if (writer_ == nullptr) return error_;  // Nothing queued, or every job done (FinishLocal).
  if (absl::Status s = FlushPending(); !s.ok()) return Fail(s);
  jobs = std::min(jobs, jobs_);            // A ticket never handed out waits for them all.
  absl::Status s = written ? writer_->WaitWritten(jobs) : writer_->WaitConsumed(jobs);
  if (!s.ok()) return Fail(s);  // Named by the job that failed.
  return absl::OkStatus();
}

internal::Transaction::~Transaction() {
  // Destruction without Commit is an abort; the others are waiting for this rank's vote.
  if (!ended_) Abort().IgnoreError();  // Destructors never report.
}

absl::Status internal::Transaction::Fail(absl::Status s) {
  error_.Update(s);
  if (!s.ok()) pending_.clear();  // Never queued: their memory is not read.
  // A poisoned transaction writes nothing more; once this returns, no caller memory is read.
  if (writer_ != nullptr && !s.ok()) writer_->Cancel(s);
  return s;
}

absl::Status internal::Transaction::DeclareTensor(const TensorSpec& spec) {
  if (ended_) return absl::FailedPreconditionError("save transaction already ended");
  if (prepared_) return absl::FailedPreconditionError("save transaction already prepared");
  if (!formats::IsValidName(spec.name)) {
    // Escaped: the name may hold bytes that are no UTF-8, which an error message must not.
    return absl::InvalidArgumentError(
        absl::StrCat("invalid tensor name \"", absl::CHexEscape(spec.name), "\""));
  }
  if (tensor_index_.count(spec.name)) {
    return absl::InvalidArgumentError(absl::StrCat("tensor \"", spec.name, "\" declared twice"));
  }
  formats::Manifest probe;
  probe.tensors.push_back({spec.name, spec.dtype, spec.shape});
  absl::Status valid = formats::ValidateManifest(probe, spec.name);
  if (!valid.ok()) return absl::InvalidArgumentError(valid.message());
  tensor_index_[spec.name] = static_cast<uint32_t>(part_.tensors.size());
  part_.tensors.push_back({spec.name, spec.dtype, spec.shape});
  ranges_.emplace_back();
  return absl::OkStatus();
}

absl::Status internal::Transaction::AppendChunk(std::span<const std::byte> raw, ChunkInfo* info,
                                          std::string what) {
  CKPT_RETURN_IF_ERROR(WriteHeaderOnce());
  const StoreOptions& options = store_->options();
  std::string compressed;
  std::span<const std::byte> payload = raw;
  formats::Codec codec = formats::Codec::kRaw;
  if (options.codec == formats::Codec::kZstd) {
    absl::StatusOr<std::string> z = formats::CompressZstd(raw, options.zstd_level);
    if (!z.ok()) return Annotate(z.status(), what);
    compressed = *std::move(z);
    if (compressed.size() < raw.size()) {  // Incompressible chunks stay raw.
      payload = AsBytes(compressed);
      codec = formats::Codec::kZstd;
    }
  }
  internal::ChunkWriter::Job job;
  job.offset = next_offset_;
  job.prefix = formats::EncodeChunkHeader({codec, raw.size(), payload.size()});
  job.checksum = true;
  job.what = std::move(what);  // The writer threads' errors name the chunk's tensor or blob.
  const uint64_t extent = formats::ChunkExtentBytes(payload.size());
  const bool small = extent <= kBatchChunkBytes;
  if (codec != formats::Codec::kRaw) {
    job.owned = std::move(compressed);
  } else if (copy_small_ && small) {
    job.owned.assign(reinterpret_cast<const char*>(raw.data()), raw.size());
  } else {
    job.borrowed = raw;
    borrowed_ = true;
  }
  info->offset = next_offset_;
  info->raw_bytes = raw.size();
  info->stored_bytes = payload.size();
  info->codec = codec;
  info->checksum = 0;  // FinishLocal fills it in from the writer.
  // One way to the writer for every chunk: a larger one is queued alone, at once.
  if (!small || pending_bytes_ + extent > kBatchBytes) CKPT_RETURN_IF_ERROR(FlushPending());
  pending_.push_back(std::move(job));
  pending_bytes_ += extent;
  chunk_job_.push_back(jobs_++);
  next_offset_ += extent;
  return small ? absl::OkStatus() : FlushPending();
}

absl::Status internal::Transaction::WritePiece(absl::string_view tensor, uint64_t begin, uint64_t count,
                                         std::span<const std::byte> data) {
  // Small chunks are copied as they are gathered (they may wait for their neighbours); a piece
  // with a larger one waits until the writer threads have copied it.
  copy_small_ = true;
  borrowed_ = false;
  absl::StatusOr<uint64_t> ticket = Queue(tensor, begin, count, data);
  copy_small_ = false;
  if (!ticket.ok() || !borrowed_) return ticket.status();
  return WaitFor(*ticket, /*written=*/false);  // The caller may then reuse `data`.
}

absl::Status internal::Transaction::WaitWritten(uint64_t ticket) {
  return WaitFor(ticket, /*written=*/true);
}

absl::Status internal::Transaction::WaitCopied(uint64_t ticket) {
  return WaitFor(ticket, /*written=*/false);
}

absl::StatusOr<uint64_t> internal::Transaction::Queue(absl::string_view tensor,
                                                             uint64_t begin, uint64_t count,
                                                             std::span<const std::byte> data) {
  if (ended_) return absl::FailedPreconditionError("save transaction already ended");
  if (prepared_) return absl::FailedPreconditionError("save transaction already prepared");
  CKPT_RETURN_IF_ERROR(error_);
  // A write that failed since the last call fails this one: small chunks are gathered without
  // touching the writer, which would otherwise report it only at the next flush, up to
  // kBatchBytes later. Fail waits until no job runs and names the chunk that failed.
  if (writer_ != nullptr) {
    if (absl::Status s = writer_->error(); !s.ok()) return Fail(s);
  }
  auto found = tensor_index_.find(tensor);
  if (found == tensor_index_.end()) {
    return absl::InvalidArgumentError(absl::StrCat("tensor \"", tensor, "\" was not declared"));
  }
  const uint32_t index = found->second;
  const formats::TensorInfo* it = &part_.tensors[index];
  const uint64_t numel = it->numel();
  const uint64_t esize = formats::DTypeSize(it->dtype);
  if (count == 0 || begin > numel || count > numel - begin) {
    return absl::InvalidArgumentError(absl::StrCat("piece [", begin, ", +", count, ") of \"",
                                                   tensor, "\" lies outside its ", numel,
                                                   " elements"));
  }
  if (data.size() != count * esize) {
    return absl::InvalidArgumentError(absl::StrCat("piece of \"", tensor, "\" has ", data.size(),
                                                   " bytes, expected ", count * esize));
  }
  // This rank's ranges of the tensor, by begin: only the neighbours can overlap.
  std::map<uint64_t, uint64_t>& ranges = ranges_[index];
  auto next = ranges.lower_bound(begin);
  if ((next != ranges.end() && next->first < begin + count) ||
      (next != ranges.begin() && std::prev(next)->second > begin)) {
    return absl::InvalidArgumentError(
        absl::StrCat("piece [", begin, ", +", count, ") of \"", tensor, "\" overlaps another"));
  }
  const uint64_t chunk_elems = std::max<uint64_t>(1, store_->options().chunk_bytes / esize);
  std::vector<ChunkInfo>& chunks = part_.files[0].chunks;
  // A piece that continues the one written last (same tensor, adjacent elements, its chunks
  // the last in the file and all full) extends it: a range streamed in several calls is
  // recorded as one piece, as if written in one.
  if (!part_.pieces.empty()) {
    formats::PieceInfo& last = part_.pieces.back();
    if (last.tensor == index && last.begin + last.count == begin &&
        last.count % last.chunk_elems == 0 && last.chunk_elems == chunk_elems &&
        last.first_chunk + last.chunk_count == chunks.size()) {
      for (uint64_t done = 0; done < count; done += chunk_elems) {
        const uint64_t n = std::min(chunk_elems, count - done);
        ChunkInfo info;
        absl::Status s = AppendChunk(data.subspan(done * esize, n * esize), &info,
                                     absl::StrCat("save step ", step_, " tensor ", tensor));
        if (!s.ok()) return Fail(s);
        chunks.push_back(info);
        ++last.chunk_count;
        last.count += n;
      }
      ranges[last.begin] = last.begin + last.count;
      return jobs_;
    }
  }
  formats::PieceInfo piece;
  piece.tensor = index;
  piece.rank = part_.files[0].rank;
  piece.begin = begin;
  piece.count = count;
  piece.file = 0;
  piece.chunk_elems = chunk_elems;
  piece.first_chunk = chunks.size();
  for (uint64_t done = 0; done < count; done += piece.chunk_elems) {
    uint64_t n = std::min(piece.chunk_elems, count - done);
    ChunkInfo info;
    absl::Status s = AppendChunk(data.subspan(done * esize, n * esize), &info,
                                 absl::StrCat("save step ", step_, " tensor ", tensor));
    if (!s.ok()) return Fail(s);
    chunks.push_back(info);
  }
  piece.chunk_count = chunks.size() - piece.first_chunk;
  part_.pieces.push_back(piece);
  ranges.emplace(begin, begin + count);
  return jobs_;
}

absl::Status internal::Transaction::WriteBlob(absl::string_view name, std::span<const std::byte> data) {
  if (ended_) return absl::FailedPreconditionError("save transaction already ended");
  if (prepared_) return absl::FailedPreconditionError("save transaction already prepared");
  CKPT_RETURN_IF_ERROR(error_);
  if (!formats::IsValidName(name)) {
    return absl::InvalidArgumentError(
        absl::StrCat("invalid blob name \"", absl::CHexEscape(name), "\""));
  }
  if (data.size() > formats::kMaxBlobBytes) {
    return absl::InvalidArgumentError(absl::StrCat("blob \"", name, "\" has ", data.size(),
                                                   " bytes, more than a blob may hold (",
                                                   formats::kMaxBlobBytes, ")"));
  }
  for (const formats::BlobInfo& b : part_.blobs) {
    if (b.name == name)
      return absl::InvalidArgumentError(absl::StrCat("blob \"", name, "\" written twice"));
  }
  formats::BlobInfo blob{std::string(name), part_.files[0].rank, 0, data.size(), 0, 0};
  std::vector<ChunkInfo>& chunks = part_.files[0].chunks;
  blob.first_chunk = chunks.size();
  const uint64_t chunk_bytes = std::max<uint64_t>(1, store_->options().chunk_bytes);
  for (uint64_t done = 0; done < data.size(); done += chunk_bytes) {
    ChunkInfo info;
    absl::Status s =
        AppendChunk(data.subspan(done, std::min(chunk_bytes, data.size() - done)), &info,
                    absl::StrCat("save step ", step_, " blob ", name));
    if (!s.ok()) return Fail(s);
    chunks.push_back(info);
  }
  blob.chunk_count = chunks.size() - blob.first_chunk;
  part_.blobs.push_back(std::move(blob));
  return WaitFor(jobs_, /*written=*/false);  // The caller may then reuse `data`.
}

}  // namespace ckpt
