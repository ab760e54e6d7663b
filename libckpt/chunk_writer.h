// ChunkWriter: the threads that build and write the blocks of one data file (a SaveTransaction's
// step 2, libckpt/store/transaction.cc).
//
// A job is one extent of the file: a prefix (a chunk header, or the file header) and a body,
// zero-padded to whole blocks, at an offset its caller reserved. A worker copies the job's
// bytes into a block-aligned buffer of its own, checksumming (XXH3-64) each slice right after
// copying it, while it is still in cache, then writes the buffer with WritableFile::WriteAt.
// Workers take jobs in the order they were queued and several work at once, so the copying,
// the checksumming and the disk's writes of different chunks overlap: one thread no longer
// bounds a save when other work (a training step) competes for memory bandwidth.
//
// SubmitBatch queues jobs that lie back to back in the file as one entry: one worker builds
// them all (each checksummed on its own, each consumed as it is copied) and writes them with one
// WriteAt. The save transaction gathers its small chunks so (libckpt/store/transaction.cc):
// a checkpoint of many small tensors is then written in requests of megabytes, not one 4 KiB
// request per chunk, which the file system serializes (each extends the file).
//
// Memory: one buffer of the largest extent (or batch) per worker, and the entries queued (at
// most two per worker; a job's body is the caller's memory unless the job owns it).
#ifndef CKPT_LIBCKPT_CHUNK_WRITER_H_
#define CKPT_LIBCKPT_CHUNK_WRITER_H_

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "ckpt/env.h"
#include "libckpt/aligned_buffer.h"

namespace ckpt::internal {

class ChunkWriter {
 public:
  struct Job {
    uint64_t offset = 0;  // A multiple of kWriteAtAlignment.
    std::string prefix;   // Copied first.
    // The body: `owned` when it is not empty, else `borrowed`, which the caller keeps unchanged
    // until the job is consumed (WaitConsumed).
    std::span<const std::byte> borrowed;
    std::string owned;
    bool checksum = false;  // Checksum the whole extent (prefix, body and padding).
    std::string what;       // What the job writes, for its error (e.g. "save step 3 tensor w").
  };

  // `threads` workers (1 to 64), started through `env` by the first Submit. Not owned: `env`
  // and `file`, which outlive this writer.
  ChunkWriter(Env* env, WritableFile* file, int threads);
  // Skips the jobs still queued, waits for those running, joins the workers.
  ~ChunkWriter();
  ChunkWriter(const ChunkWriter&) = delete;  // Owns threads that point into it.
  ChunkWriter& operator=(const ChunkWriter&) = delete;

  // Queues `job` and returns its number (0, 1, ... in the order of the calls); blocks while two
  // entries per worker wait. After a failure returns the first error, once no job runs any more.
  absl::StatusOr<uint64_t> Submit(Job job);
  // Queues `jobs` (not empty; each at the offset where the one before it ends) to be written
  // by one WriteAt, and returns the number of the first; the others have the numbers after it.
  // Its error names the first and the last job.
  absl::StatusOr<uint64_t> SubmitBatch(std::vector<Job> jobs);
  // Wait until jobs [0, n) have been copied out of the caller's memory (consumed) or written
  // to the file (WriteAt returned). Return the first error of any job; then no job runs any
  // more and none will (the queued ones are skipped), so no caller memory is read after it.
  absl::Status WaitConsumed(uint64_t n);
  absl::Status WaitWritten(uint64_t n);
  // Every job queued so far: WaitWritten of them all.
  absl::Status Drain();
  // Fails the writer with `why` (unless it failed already) and waits until no job runs: the
  // queued jobs are skipped, so no caller memory is read once it returns.
  void Cancel(absl::Status why);
  // The first error of any job so far, without waiting (OK while none failed). A caller that
  // queues without waiting checks it to report a failure at its next call, not megabytes later.
  absl::Status error() const;
  // The checksum of job `n`, a checksummed job that WaitWritten has seen written.
  uint64_t checksum(uint64_t n) const;

 private:
  enum Flag : uint8_t { kConsumed = 1, kWritten = 2 };
  struct Entry {
    uint64_t first = 0;     // The number of jobs[0].
    std::vector<Job> jobs;  // Back to back in the file.
  };
  void WorkerMain();
  // Builds the entry's extents in `buffer` (grown as needed), marking each job consumed as it
  // is copied, then writes them in one WriteAt.
  absl::Status Run(const Entry& entry, AlignedBuffer* buffer);
  static size_t ExtentBytes(const Job& job);
  void MarkLocked(uint64_t n, Flag flag);  // REQUIRES: mu_ held.
  absl::Status WaitFor(uint64_t n, const uint64_t* watermark);
  bool QuietLocked() const { return running_ == 0 && queue_.empty(); }  // REQUIRES: mu_ held.

  Env* const env_;
  WritableFile* const file_;
  const int threads_;
  mutable std::mutex mu_;
  std::condition_variable work_;     // A job was queued, or the writer stops.
  std::condition_variable changed_;  // A job was taken or finished.
  std::deque<Entry> queue_;  // Guarded by mu_, as everything below.
  uint64_t submitted_ = 0;
  std::vector<uint8_t> flags_;        // Per job: Flag bits.
  std::vector<uint64_t> checksums_;   // Per job.
  uint64_t consumed_through_ = 0;     // Jobs [0, this) are consumed.
  uint64_t written_through_ = 0;      // Jobs [0, this) are written.
  int running_ = 0;                   // Jobs a worker has taken and not finished.
  bool stopping_ = false;
  absl::Status error_;
  // Started by the first Submit; joined by the destructor.
  std::vector<std::unique_ptr<EnvThread>> workers_;
};

}  // namespace ckpt::internal

#endif  // CKPT_LIBCKPT_CHUNK_WRITER_H_
