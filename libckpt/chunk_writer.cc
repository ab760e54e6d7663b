#include "libckpt/chunk_writer.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
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
  std::vector<Job> one;
  one.push_back(std::move(job));
  return SubmitBatch(std::move(one));
}

absl::StatusOr<uint64_t> ChunkWriter::SubmitBatch(std::vector<Job> jobs) {
  if (jobs.empty()) return absl::InvalidArgumentError("an empty batch of chunk writes");
  for (size_t i = 1; i < jobs.size(); ++i) {
    if (jobs[i].offset != jobs[i - 1].offset + ExtentBytes(jobs[i - 1])) {
      return absl::InvalidArgumentError(absl::StrCat("a batch of chunk writes whose job ", i,
                                                     " does not begin where the one before ends"));
    }
  }
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
  const uint64_t n = submitted_;
  submitted_ += jobs.size();
  flags_.resize(submitted_, 0);
  checksums_.resize(submitted_, 0);
  queue_.push_back({n, std::move(jobs)});
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

absl::Status ChunkWriter::error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
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

size_t ChunkWriter::ExtentBytes(const Job& job) {
  const size_t used =
      job.prefix.size() + (job.owned.empty() ? job.borrowed.size() : job.owned.size());
  return (used + kWriteAtAlignment - 1) / kWriteAtAlignment * kWriteAtAlignment;
}

void ChunkWriter::WorkerMain() {
  AlignedBuffer buffer;  // This worker's, grown to the largest entry it builds.
  for (;;) {
    Entry next;
    {
      std::unique_lock<std::mutex> lock(mu_);
      work_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // Stopping.
      next = std::move(queue_.front());
      queue_.pop_front();
      if (stopping_ || !error_.ok()) {
        // Skipped: after a failure (or at teardown) no caller memory is read.
        for (size_t i = 0; i < next.jobs.size(); ++i) {
          MarkLocked(next.first + i, Flag(kConsumed | kWritten));
        }
        changed_.notify_all();
        continue;
      }
      ++running_;
      changed_.notify_all();  // A queue slot is free.
    }
    absl::Status s = Run(next, &buffer);
    std::lock_guard<std::mutex> lock(mu_);
    --running_;
    error_.Update(s);
    for (size_t i = 0; i < next.jobs.size(); ++i) {
      MarkLocked(next.first + i, Flag(kConsumed | kWritten));
    }
    changed_.notify_all();
  }
}

absl::Status ChunkWriter::Run(const Entry& entry, AlignedBuffer* buffer) {
  const Job& first = entry.jobs.front();
  const Job& last = entry.jobs.back();
  const size_t total = last.offset + ExtentBytes(last) - first.offset;
  if (buffer->size() < total) {
    *buffer = AlignedBuffer();  // The old one goes first: one buffer per worker at a time.
    CKPT_ASSIGN_OR_RETURN(*buffer, AlignedBuffer::Create(total, AlignedBuffer::Fill::kUninitialized,
                                                         total >= kHugePageBytes
                                                             ? AlignedBuffer::Pages::kHuge
                                                             : AlignedBuffer::Pages::kSmall));
  }
  for (size_t i = 0; i < entry.jobs.size(); ++i) {
    const Job& job = entry.jobs[i];
    const std::span<const std::byte> body =
        job.owned.empty() ? job.borrowed : std::as_bytes(std::span(job.owned));
    const size_t used = job.prefix.size() + body.size();
    const size_t extent = ExtentBytes(job);
    std::byte* out = buffer->data() + (job.offset - first.offset);
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
      if (job.checksum) checksums_[entry.first + i] = sum.Digest();
      MarkLocked(entry.first + i, kConsumed);
    }
    changed_.notify_all();
  }
  absl::Status written = file_->WriteAt(first.offset, {buffer->data(), total});
  if (written.ok() || first.what.empty()) return written;
  if (entry.jobs.size() == 1) return Annotate(written, first.what);
  return Annotate(written, absl::StrCat(first.what, " (the first of ", entry.jobs.size(),
                                        " chunks written together, the last ", last.what, ")"));
}

}  // namespace ckpt::internal
