#include "libckpt/chunk_writer.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "ckpt/base/checksum.h"
#include "ckpt/base/status_macros.h"

namespace ckpt::internal {
namespace {

// Checksummed right after being copied, while in cache.
constexpr size_t kSliceBytes = 256 << 10;

}  // namespace

ChunkWriter::ChunkWriter(Env* env, WritableFile* file, int threads)
    : env_(env), file_(file), threads_(std::clamp(threads, 1, 64)) {}

ChunkWriter::~ChunkWriter() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  work_.notify_all();
  for (std::unique_ptr<EnvThread>& t : workers_) t->Join();
}

absl::StatusOr<uint64_t> ChunkWriter::Submit(Job job) {
  std::unique_lock<std::mutex> lock(mu_);
  if (workers_.empty()) {
    for (int i = 0; i < threads_; ++i) workers_.push_back(env_->StartThread([this] { WorkerMain(); }));
  }
  const size_t max_queued = 2 * static_cast<size_t>(threads_);
  changed_.wait(lock, [&] { return !error_.ok() || queue_.size() < max_queued; });
  if (!error_.ok()) {
    changed_.wait(lock, [&] { return QuietLocked(); });
    return error_;
  }
  const uint64_t n = submitted_++;
  flags_.push_back(0);
  checksums_.push_back(0);
  queue_.emplace_back(n, std::move(job));
  work_.notify_one();
  return n;
}

absl::Status ChunkWriter::WaitFor(uint64_t n, const uint64_t* watermark) {
  std::unique_lock<std::mutex> lock(mu_);
  // After a failure, only once nothing runs: the caller may then free what the jobs read.
  changed_.wait(lock, [&] { return error_.ok() ? *watermark >= n : QuietLocked(); });
  return error_;
}

void ChunkWriter::Cancel(absl::Status why) {
  std::unique_lock<std::mutex> lock(mu_);
  if (error_.ok()) {
    error_ = why.ok() ? absl::CancelledError("chunk writer cancelled") : std::move(why);
  }
  changed_.wait(lock, [&] { return QuietLocked(); });
}

absl::Status ChunkWriter::WaitConsumed(uint64_t n) { return WaitFor(n, &consumed_through_); }
absl::Status ChunkWriter::WaitWritten(uint64_t n) { return WaitFor(n, &written_through_); }

absl::Status ChunkWriter::Drain() {
  uint64_t n;
  {
    std::lock_guard<std::mutex> lock(mu_);
    n = submitted_;
  }
  return WaitWritten(n);
}

uint64_t ChunkWriter::checksum(uint64_t n) const {
  std::lock_guard<std::mutex> lock(mu_);
  return checksums_[n];
}

void ChunkWriter::MarkLocked(uint64_t n, Flag flag) {
  flags_[n] |= flag;
  while (consumed_through_ < submitted_ && (flags_[consumed_through_] & kConsumed)) {
    ++consumed_through_;
  }
  while (written_through_ < submitted_ && (flags_[written_through_] & kWritten)) {
    ++written_through_;
  }
}

void ChunkWriter::WorkerMain() {
  AlignedBuffer buffer;  // This worker's, grown to the largest extent it builds.
  for (;;) {
    std::pair<uint64_t, Job> next;
    {
      std::unique_lock<std::mutex> lock(mu_);
      work_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // Stopping.
      next = std::move(queue_.front());
      queue_.pop_front();
      if (stopping_ || !error_.ok()) {
        // Skipped: after a failure (or at teardown) no caller memory is read.
        MarkLocked(next.first, Flag(kConsumed | kWritten));
        changed_.notify_all();
        continue;
      }
      ++running_;
      changed_.notify_all();  // A queue slot is free.
    }
    absl::Status s = Run(next.second, next.first, &buffer);
    std::lock_guard<std::mutex> lock(mu_);
    --running_;
    error_.Update(s);
    MarkLocked(next.first, Flag(kConsumed | kWritten));
    changed_.notify_all();
  }
}

absl::Status ChunkWriter::Run(const Job& job, uint64_t n, AlignedBuffer* buffer) {
  const std::span<const std::byte> body =
      job.owned.empty() ? job.borrowed : std::as_bytes(std::span(job.owned));
  const size_t used = job.prefix.size() + body.size();
  const size_t extent = (used + kWriteAtAlignment - 1) / kWriteAtAlignment * kWriteAtAlignment;
  if (buffer->size() < extent) {
    *buffer = AlignedBuffer();  // The old one goes first: one buffer per worker at a time.
    CKPT_ASSIGN_OR_RETURN(*buffer, AlignedBuffer::Create(extent, AlignedBuffer::Fill::kUninitialized,
                                                         extent >= kHugePageBytes
                                                             ? AlignedBuffer::Pages::kHuge
                                                             : AlignedBuffer::Pages::kSmall));
  }
  std::byte* out = buffer->data();
  StreamingChecksum sum;
  std::memcpy(out, job.prefix.data(), job.prefix.size());
  if (job.checksum) sum.Update({out, job.prefix.size()});
  for (size_t pos = 0; pos < body.size(); pos += kSliceBytes) {
    const size_t len = std::min(kSliceBytes, body.size() - pos);
    std::byte* to = out + job.prefix.size() + pos;
    std::memcpy(to, body.data() + pos, len);
    if (job.checksum) sum.Update({to, len});
  }
  std::memset(out + used, 0, extent - used);
  if (job.checksum) sum.Update({out + used, extent - used});
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (job.checksum) checksums_[n] = sum.Digest();
    MarkLocked(n, kConsumed);
  }
  changed_.notify_all();
  absl::Status written = file_->WriteAt(job.offset, {out, extent});
  if (!written.ok() && !job.what.empty()) return Annotate(written, job.what);
  return written;
}

}  // namespace ckpt::internal
