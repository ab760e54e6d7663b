// SaveTransaction: one rank's side of writing one checkpoint step. The save protocol's steps are
// at the top of libckpt/checkpoint_writer.cc (begin, write) and libckpt/checkpoint_commit.cc
// (the commit).
#ifndef CKPT_CHECKPOINT_WRITER_H_
#define CKPT_CHECKPOINT_WRITER_H_

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>
#include "absl/strings/string_view.h"

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "ckpt/coordinator.h"
#include "ckpt/env.h"
#include "ckpt/formats/manifest.h"
#include "ckpt/options.h"

namespace ckpt {

class CheckpointStore;
namespace internal {
class ChunkWriter;
}  // namespace internal

struct TensorSpec {
  std::string name;
  formats::DType dtype = formats::DType::kF32;
  std::vector<uint64_t> shape;  // Global shape; {} is a scalar.
};

// Writes this rank's pieces and blobs of one step straight into its data file in the staging
// directory, checksumming each chunk as it is written. Nothing is visible to readers until
// Commit() succeeds on every rank. Every rank of the job must end the transaction with exactly
// one Commit() or Abort() (destruction without either counts as Abort()), because both are
// collective: a "no" from any rank aborts the step everywhere. Not thread-safe.
class SaveTransaction {
 public:
  ~SaveTransaction();
  SaveTransaction(const SaveTransaction&) = delete;  // Owns a file and a place in a vote.
  SaveTransaction& operator=(const SaveTransaction&) = delete;

  uint64_t step() const { return step_; }

  // Declares a tensor. Ranks that declare the same name must agree on dtype and shape (checked
  // at Commit). kInvalidArgument for a bad name, dtype or shape, or a second declaration here.
  absl::Status DeclareTensor(const TensorSpec& spec);
  // Writes elements [begin, begin + count) of a declared tensor from `data` (count elements of
  // its dtype). kInvalidArgument for an undeclared tensor, a range outside it, an empty range or
  // a size mismatch (the transaction stays usable); an IO error (kResourceExhausted for ENOSPC
  // or EDQUOT) poisons the transaction, which then votes no.
  absl::Status WritePiece(absl::string_view tensor, uint64_t begin, uint64_t count,
                          std::span<const std::byte> data);
  // As WritePiece, but returns once the piece is queued: the transaction's writer threads go on
  // reading `data` until WaitForPiecesCopied(t) (or WaitForPieces(t)) returns for the returned
  // ticket t or a later one, so `data` must stay alive and unchanged until then. Lets a caller that owns its memory keep
  // the writers busy across pieces. After an IO error (one that makes the transaction vote no)
  // no piece's data is read any more; a refused piece (kInvalidArgument) leaves the pieces
  // queued before it queued.
  absl::StatusOr<uint64_t> WritePieceDeferred(absl::string_view tensor, uint64_t begin,
                                              uint64_t count, std::span<const std::byte> data);
  // Waits until every piece up to `ticket` is written to the data file (not yet durable: that
  // is Prepare's or Commit's). Returns the transaction's first IO error.
  absl::Status WaitForPieces(uint64_t ticket);
  // Waits until the writer threads have copied every piece up to `ticket` out of its memory
  // (written or not): that memory may then change. Returns the transaction's first IO error.
  absl::Status WaitForPiecesCopied(uint64_t ticket);
  // Stores opaque bytes under `name` (unique per rank). Errors as WritePiece.
  absl::Status WriteBlob(absl::string_view name, std::span<const std::byte> data);

  // This rank's half of step 3 without a collective: makes its data durable and writes its
  // part, so that a background writer does the slow work and Commit only votes. Optional
  // (Commit prepares an unprepared transaction); after it, DeclareTensor, WritePiece and
  // WriteBlob refuse with kFailedPrecondition. Returns the error this rank will vote no with.
  absl::Status Prepare();
  // Makes this rank vote no at Commit with `why`: an error of the caller's that the
  // transaction did not see (e.g. a writer that stopped before writing everything). Every rank
  // then returns `why`, annotated with this rank. Stops the writer threads first: once it
  // returns, no piece's data is read any more (the caller may change it).
  void MarkFailed(absl::Status why);

  // Collective. Finishes this rank's file, votes, and (rank 0) commits. Returns OK on every
  // rank when the step is durable and LATEST names it; otherwise the same failure on every rank
  // (the first error of the rank that failed, annotated with that rank) and the previous
  // checkpoint is untouched. kFailedPrecondition if the transaction has already ended.
  absl::Status Commit();
  // Collective. Votes no, so the step is abandoned on every rank and its staging directory
  // removed. Returns why the others ended, or OK.
  absl::Status Abort();

 private:
  friend class CheckpointStore;
  SaveTransaction(CheckpointStore* store, Coordinator* coordinator, uint64_t step,
                  std::string staging_dir, absl::Status begin_error);

  // Reserves the next extent of the data file for a chunk of `raw` (compressed first when the
  // codec says so) and queues it for the writer threads, which read `raw` until its job is
  // consumed. `what` names the chunk's tensor or blob in its errors.
  absl::Status AppendChunk(std::span<const std::byte> raw, formats::ChunkInfo* info,
                           std::string what);
  absl::Status WaitFor(uint64_t jobs, bool written);
  absl::Status Fail(absl::Status s);
  // Step 2: the data file's header, before the first chunk or at the commit.
  absl::Status WriteHeaderOnce();
  absl::Status FinishLocal(std::string* vote);
  absl::Status Finish(bool vote_yes);
  absl::Status CommitAsRoot(const std::vector<std::string>& votes);
  absl::Status Publish(const formats::Manifest& manifest);

  CheckpointStore* store_;
  Env* env_;
  Coordinator* coordinator_;
  std::unique_ptr<Coordinator> own_coordinator_;
  const uint64_t step_;
  const std::string staging_dir_;
  std::unique_ptr<WritableFile> file_;
  // Step 2's writer threads, made with the first chunk; they write file_ with WriteAt. Declared
  // after file_ so that they stop before it goes; stopped (queued jobs skipped) by FinishLocal.
  std::unique_ptr<internal::ChunkWriter> writer_;
  uint64_t next_offset_;            // Where the next chunk's extent goes.
  uint64_t jobs_ = 0;               // Jobs queued on writer_ (the file header's included).
  std::vector<uint64_t> chunk_job_;  // Per chunk of part_.files[0]: its job (for its checksum).
  formats::Manifest part_;  // This rank's tensors, file, pieces and blobs.
  // Lookups into part_: tensor index by name; per tensor, this rank's ranges (begin -> end).
  std::map<std::string, uint32_t, std::less<>> tensor_index_;
  std::map<uint32_t, std::map<uint64_t, uint64_t>> ranges_;
  absl::Status error_;      // First local error; the rank votes no when set.
  bool ended_ = false;
  bool latest_may_name_step_ = false;  // Publish could not undo a LATEST it wrote (step 8).
  bool renamed_ = false;               // Publish renamed staging to the step directory (step 7).
  bool header_written_ = false;        // The data file's header (step 2).
  bool prepared_ = false;
  absl::Status prepare_status_;  // FinishLocal's result once prepared_.
  std::string prepared_vote_;
};

}  // namespace ckpt

#endif  // CKPT_CHECKPOINT_WRITER_H_
