// CheckpointReader: reads element ranges of tensors and blobs of one committed step.
#ifndef CKPT_CHECKPOINT_READER_H_
#define CKPT_CHECKPOINT_READER_H_

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>
#include "absl/strings/string_view.h"

#include "absl/status/statusor.h"
#include "ckpt/env.h"
#include "ckpt/formats/manifest.h"
#include "ckpt/options.h"

namespace ckpt {

// Holds a step's validated manifest and open data files. Every chunk a read touches is
// checksummed before its bytes are used. Thread safety: immutable after Open, so ReadRange,
// ReadBlob and manifest() are safe to call concurrently from any number of threads (each read
// uses its own buffers; the data files are read with positioned reads only).
class CheckpointReader {
 public:
  // Opens the step directory `step_dir`: parses and validates MANIFEST, opens every data file
  // and checks its header and size. kNotFound if MANIFEST is missing; kDataLoss (naming the
  // file and offset) for any damage, and when the directory is named for another step than
  // its MANIFEST's; kUnimplemented for a newer format version; kFailedPrecondition when
  // MANIFEST or a data file is a symbolic link or not a regular file. Uses options.env,
  // direct_io and read_threads.
  static absl::StatusOr<std::unique_ptr<CheckpointReader>> Open(const std::string& step_dir,
                                                                const StoreOptions& options);
  ~CheckpointReader();

  const formats::Manifest& manifest() const { return manifest_; }
  uint64_t step() const { return manifest_.step; }
  const std::string& dir() const { return dir_; }
  // kNotFound for an unknown name.
  absl::StatusOr<const formats::TensorInfo*> FindTensor(absl::string_view name) const;
  // True when the step's pieces of `tensor` (any ranks') cover elements [begin, begin + count);
  // false for an unknown tensor.
  bool Covers(absl::string_view tensor, uint64_t begin, uint64_t count) const;

  // Reads elements [begin, begin + count) of `tensor` into `out` (count elements of its
  // dtype), from whichever ranks' pieces hold them. kNotFound for an unknown tensor or when no
  // piece holds part of the range; kInvalidArgument for a range outside the tensor or a
  // size mismatch; kDataLoss naming file, chunk and offset when a chunk fails its checksum.
  // `out` is unspecified after a failure.
  absl::Status ReadRange(absl::string_view tensor, uint64_t begin, uint64_t count,
                         std::span<std::byte> out) const;
  // One range of ReadRanges: elements [begin, begin + count) of `tensor` into `out`.
  struct RangeRead {
    std::string tensor;
    uint64_t begin = 0;
    uint64_t count = 0;
    std::span<std::byte> out;
  };
  // Reads every range as ReadRange does, all in one pipeline: the reads of every range overlap,
  // and a chunk that serves several ranges is read and checksummed once. Returns the first
  // error (each range's as ReadRange's); what any `out` holds after a failure is unspecified.
  absl::Status ReadRanges(std::span<const RangeRead> ranges) const;
  // Reads a whole blob. kNotFound if rank `rank` stored no blob `name`.
  absl::StatusOr<std::string> ReadBlob(absl::string_view name, uint32_t rank = 0) const;

  // Raw bytes decompressed so far by this reader. A compressed chunk read in parts (diff,
  // export-hf and reshard read in bounded batches) is decoded as a stream that the next read
  // of the same chunk continues (up to four chunks' streams are kept, each holding zstd's
  // window, not the decoded chunk): a chunk read front to back costs one decode, whatever the
  // batch, and one that decompresses to 1 GiB from a few kilobytes never takes 1 GiB of memory.
  // A read behind its chunk's stream decodes that chunk again from its start.
  uint64_t decoded_bytes() const;

 private:
  struct ChunkRead;
  struct DecodeCache;
  struct Index;
  CheckpointReader(std::string dir, const StoreOptions& options, Env* env);
  // Appends the chunk reads of ReadRange(tensor, begin, count, out) to `reads`.
  absl::Status PlanRange(absl::string_view tensor, uint64_t begin, uint64_t count,
                         std::span<std::byte> out, std::vector<ChunkRead>* reads) const;
  absl::Status ReadChunks(const std::vector<ChunkRead>& reads) const;
  // One pass of ReadChunks: small neighbouring chunks merged into one read when `merge`
  // (`*merged` says whether any were).
  absl::Status ReadChunksOnce(const std::vector<ChunkRead>& reads, bool merge,
                              bool* merged) const;
  // Checks one chunk whose whole extent is `bytes`, then delivers each of `reads` (all of that
  // chunk) from it.
  absl::Status DeliverChunk(std::span<const ChunkRead* const> reads,
                            std::span<const std::byte> bytes) const;
  // Delivers one read from its chunk's checked `payload`.
  absl::Status CopyOut(const ChunkRead& read, std::span<const std::byte> payload,
                       const std::string& path) const;

  const std::string dir_;
  const StoreOptions options_;
  Env* const env_;
  formats::Manifest manifest_;
  std::vector<std::unique_ptr<RandomAccessFile>> files_;  // Parallel to manifest_.files.
  std::unique_ptr<DecodeCache> cache_;
  // Built by Open from manifest_: tensors by name and each tensor's pieces by begin, so that
  // finding a tensor and planning a range cost neither a scan of every tensor nor of every
  // piece (a load of T tensors was O(T^2)).
  std::unique_ptr<const Index> index_;
};

}  // namespace ckpt

#endif  // CKPT_CHECKPOINT_READER_H_
