// SaveTransaction: one rank's side of writing one checkpoint step, and its PieceStream. Both are
// interfaces; the save protocol's steps are at the top of libckpt/store/transaction.cc (begin,
// write) and libckpt/store/commit.cc (the commit).
#ifndef CKPT_CHECKPOINT_WRITER_H_
#define CKPT_CHECKPOINT_WRITER_H_

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "ckpt/formats/dtype.h"

namespace ckpt {

struct TensorSpec {
  std::string name;
  formats::DType dtype = formats::DType::kF32;
  std::vector<uint64_t> shape;  // Global shape; {} is a scalar.
};

// The streaming side of a save (SaveTransaction::stream()): for a writer that owns its memory
// and keeps the transaction's writer threads busy across pieces (the async save, reshard).
class PieceStream {
 public:
  virtual ~PieceStream() = default;
  // As SaveTransaction::WritePiece, but returns once the piece is queued: the transaction's
  // writer threads go on reading `data` until WaitCopied(t) (or WaitWritten(t)) returns for
  // the returned ticket t or a later one, so `data` must stay alive and unchanged until then.
  // After an IO error (one that makes the transaction vote no) no piece's data is read any
  // more; a refused piece (kInvalidArgument) leaves the pieces queued before it queued.
  virtual absl::StatusOr<uint64_t> Queue(absl::string_view tensor, uint64_t begin,
                                         uint64_t count, std::span<const std::byte> data) = 0;
  // Waits until every piece up to `ticket` is written to the data file (not yet durable: that
  // is Prepare's or Commit's). Returns the transaction's first IO error.
  virtual absl::Status WaitWritten(uint64_t ticket) = 0;
  // Waits until the writer threads have copied every piece up to `ticket` out of its memory
  // (written or not): that memory may then change. Returns the transaction's first IO error.
  virtual absl::Status WaitCopied(uint64_t ticket) = 0;
  // This rank's half of the commit's step 3 without a collective: makes its data durable and
  // writes its part, so that a background writer does the slow work and Commit only votes.
  // Optional (Commit prepares an unprepared transaction); after it, DeclareTensor, WritePiece
  // and WriteBlob refuse with kFailedPrecondition. Returns the error this rank will vote no
  // with.
  virtual absl::Status Prepare() = 0;
  // Makes this rank vote no at Commit with `why`: an error of the caller's that the
  // transaction did not see (e.g. a writer that stopped before writing everything). Every rank
  // then returns `why`, annotated with this rank. Stops the writer threads first: once it
  // returns, no piece's data is read any more (the caller may change it).
  virtual void MarkFailed(absl::Status why) = 0;
};

// Writes this rank's pieces and blobs of one step straight into its data file in the staging
// directory, checksumming each chunk as it is written. Nothing is visible to readers until
// Commit() succeeds on every rank. Every rank of the job must end the transaction with exactly
// one Commit() or Abort() (destruction without either counts as Abort()), because both are
// collective: a "no" from any rank aborts the step everywhere. Not thread-safe. Made by
// CheckpointStore::BeginSave; implemented in libckpt/store/.
class SaveTransaction {
 public:
  virtual ~SaveTransaction() = default;

  virtual uint64_t step() const = 0;

  // Declares a tensor. Ranks that declare the same name must agree on dtype and shape (checked
  // at Commit). kInvalidArgument for a bad name, dtype or shape, or a second declaration here.
  virtual absl::Status DeclareTensor(const TensorSpec& spec) = 0;
  // Writes elements [begin, begin + count) of a declared tensor from `data` (count elements of
  // its dtype); returns once the bytes are copied. kInvalidArgument for an undeclared tensor, a
  // range outside it, an empty range or a size mismatch (the transaction stays usable); an IO
  // error (kResourceExhausted for ENOSPC or EDQUOT) poisons the transaction, which then votes
  // no.
  virtual absl::Status WritePiece(absl::string_view tensor, uint64_t begin, uint64_t count,
                                  std::span<const std::byte> data) = 0;
  // Stores opaque bytes under `name` (unique per rank). Errors as WritePiece.
  virtual absl::Status WriteBlob(absl::string_view name, std::span<const std::byte> data) = 0;
  // The streaming side of this transaction, valid while it lives.
  virtual PieceStream& stream() = 0;

  // Collective. Finishes this rank's file, votes, and (rank 0) commits. Returns OK on every
  // rank when the step is durable and LATEST names it; otherwise the same failure on every rank
  // (the first error of the rank that failed, annotated with that rank) and the previous
  // checkpoint is untouched. kFailedPrecondition if the transaction has already ended.
  virtual absl::Status Commit() = 0;
  // Collective. Votes no, so the step is abandoned on every rank and its staging directory
  // removed. Returns why the others ended, or OK.
  virtual absl::Status Abort() = 0;

 protected:
  SaveTransaction() = default;
  SaveTransaction(const SaveTransaction&) = delete;  // Owns a file and a place in a vote.
  SaveTransaction& operator=(const SaveTransaction&) = delete;
};

}  // namespace ckpt

#endif  // CKPT_CHECKPOINT_WRITER_H_
