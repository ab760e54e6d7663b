// The checkpoint store's implementation, behind the interfaces of ckpt/checkpoint_store.h and
// ckpt/checkpoint_writer.h (as LevelDB's DBImpl behind DB): StoreImpl, one handle on a root, and
// Transaction, one rank's save through it. They share the store's state: the LOCK, LATEST as
// this handle knows it, the one save in flight, and the remover of retired steps.
// Where each protocol is written:
//   store.cc        Open, BeginSave (the save's step 1), adopt and quarantine;
//   transaction.cc  the save's step 2 (declare, write pieces and blobs, the piece stream);
//   commit.cc       the save's steps 3 to 10 (vote, MANIFEST, rename, LATEST, retention);
//   retention.cc    retiring steps (rename, sync, remove in the background);
//   recovery.cc     recovery at Open.
// Private to libckpt/.
#ifndef CKPT_LIBCKPT_STORE_STORE_IMPL_H_
#define CKPT_LIBCKPT_STORE_STORE_IMPL_H_

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "ckpt/checkpoint_store.h"
#include "ckpt/checkpoint_writer.h"
#include "ckpt/coordinator.h"
#include "ckpt/env.h"
#include "ckpt/formats/manifest.h"
#include "libckpt/chunk_writer.h"

namespace ckpt::internal {

class Transaction;

class StoreImpl final : public CheckpointStore {
 public:
  StoreImpl(std::string root, const StoreOptions& options, Env* env);
  ~StoreImpl() override;

  const std::string& root() const override { return root_; }
  Env* env() const override { return env_; }
  const StoreOptions& options() const override { return options_; }
  const RecoveryReport& recovery() const override { return recovery_; }
  std::optional<uint64_t> latest_step() const override;
  absl::StatusOr<std::vector<uint64_t>> ListSteps() const override;
  absl::StatusOr<std::vector<std::string>> ListQuarantine() const override;
  absl::StatusOr<std::unique_ptr<SaveTransaction>> BeginSave(uint64_t step,
                                                             Coordinator* coordinator) override;
  absl::StatusOr<std::unique_ptr<CheckpointReader>> OpenStep(uint64_t step) const override;
  absl::StatusOr<std::unique_ptr<CheckpointReader>> OpenLatest() const override;
  absl::StatusOr<RetentionReport> ApplyRetention(const RetentionPolicy& policy,
                                                 bool dry_run) override;
  void WaitForRemovals() override;
  absl::StatusOr<std::vector<std::string>> PurgeQuarantine(bool dry_run) override;
  absl::Status Adopt(uint64_t step) override;
  absl::StatusOr<std::string> QuarantineStep(uint64_t step) override;
  absl::StatusOr<std::vector<std::string>> QuarantineAll() override;

 private:
  friend class Transaction;
  friend class ckpt::CheckpointStore;  // Open.
  // Recovery (recovery.cc).
  absl::Status Recover();
  // Renames each entry of the root named in `names` into quarantine/<name>-<nonce>, then
  // syncs quarantine/ and the root. Returns the new names ("quarantine/<name>-<nonce>").
  absl::StatusOr<std::vector<std::string>> QuarantineEntries(const std::vector<std::string>& names);
  absl::Status CheckWritableIdle(absl::string_view what);
  // BeginSave, rank 0: moves an entry named like `step` (above LATEST) into quarantine/.
  absl::Status SetAsideUnpublished(uint64_t step);
  void Log(absl::string_view message) const;
  // ApplyRetention; with `background`, the renamed steps are removed by the remover thread.
  absl::StatusOr<RetentionReport> Retire(const RetentionPolicy& policy, bool dry_run,
                                         bool background);
  void RemoverMain();
  // Called by rank 0's transaction once LATEST durably names `step`.
  void OnCommitted(uint64_t step);
  void OnSaveEnded();
  // A commit wrote LATEST naming `step` but could neither make it durable nor put the previous
  // one back: what LATEST names is unknown until recovery, so further saves are refused.
  void OnLatestUncertain(uint64_t step);

  const std::string root_;
  const StoreOptions options_;
  Env* const env_;
  std::unique_ptr<FileLock> lock_;
  RecoveryReport recovery_;
  // latest_ is written by the committing thread and read by any: guarded.
  mutable std::mutex mu_;
  std::optional<uint64_t> latest_;
  bool save_in_flight_ = false;
  std::optional<uint64_t> latest_uncertain_;  // See OnLatestUncertain.
  // Retired step directories (renamed to .deleting-*) the remover thread has yet to remove;
  // recovery removes any a crash leaves.
  std::mutex remove_mu_;
  std::condition_variable remove_cv_;
  std::deque<std::string> to_remove_;  // Guarded by remove_mu_, as the two flags.
  bool removing_ = false;
  bool remover_stop_ = false;
  // Started (Env::StartThread) by the first background removal; joined by the destructor.
  std::unique_ptr<EnvThread> remover_;
};

// One rank's save through a StoreImpl, and its piece stream (the same object).
class Transaction final : public SaveTransaction, public PieceStream {
 public:
  // `begin_error` (not OK) makes the transaction vote no at its end.
  Transaction(StoreImpl* store, Coordinator* coordinator, uint64_t step, std::string staging_dir,
              absl::Status begin_error);
  ~Transaction() override;

  uint64_t step() const override { return step_; }
  absl::Status DeclareTensor(const TensorSpec& spec) override;
  absl::Status WritePiece(absl::string_view tensor, uint64_t begin, uint64_t count,
                          std::span<const std::byte> data) override;
  absl::Status WriteBlob(absl::string_view name, std::span<const std::byte> data) override;
  PieceStream& stream() override { return *this; }
  absl::Status Commit() override;
  absl::Status Abort() override;

  // PieceStream.
  absl::StatusOr<uint64_t> Queue(absl::string_view tensor, uint64_t begin, uint64_t count,
                                 std::span<const std::byte> data) override;
  absl::Status WaitWritten(uint64_t ticket) override;
  absl::Status WaitCopied(uint64_t ticket) override;
  absl::Status Prepare() override;
  void MarkFailed(absl::Status why) override;

  // A coordinator the transaction owns (BeginSave's single process when given none).
  void Own(std::unique_ptr<Coordinator> coordinator) { own_coordinator_ = std::move(coordinator); }

 private:
  // Reserves the next extent of the data file for a chunk of `raw` (compressed first when the
  // codec says so) and queues it for the writer threads, which read `raw` until its job is
  // consumed. `what` names the chunk's tensor or blob in its errors.
  absl::Status AppendChunk(std::span<const std::byte> raw, formats::ChunkInfo* info,
                           std::string what);
  absl::Status WaitFor(uint64_t jobs, bool written);
  absl::Status Fail(absl::Status s);
  // Step 2: the data file's header, before the first chunk or at the commit.
  absl::Status WriteHeaderOnce();
  // Queues pending_ on writer_ as one batch.
  absl::Status FlushPending();
  absl::Status FinishLocal(std::string* vote);
  absl::Status Finish(bool vote_yes);
  absl::Status CommitAsRoot(const std::vector<std::string>& votes);
  absl::Status Publish(const formats::Manifest& manifest);

  StoreImpl* store_;
  Env* env_;
  Coordinator* coordinator_;
  std::unique_ptr<Coordinator> own_coordinator_;
  const uint64_t step_;
  const std::string staging_dir_;
  std::unique_ptr<WritableFile> file_;
  // Step 2's writer threads, made with the first chunk; they write file_ with WriteAt. Declared
  // after file_ so that they stop before it goes; stopped (queued jobs skipped) by FinishLocal.
  std::unique_ptr<ChunkWriter> writer_;
  uint64_t next_offset_;            // Where the next chunk's extent goes.
  // Job numbers handed out (the file header's included): those queued on writer_, then those
  // of pending_.
  uint64_t jobs_ = 0;
  std::vector<uint64_t> chunk_job_;  // Per chunk of part_.files[0]: its job (for its checksum).
  // Small chunks gathered to be written together (ChunkWriter::SubmitBatch), not queued yet:
  // jobs jobs_ - pending_.size() to jobs_ - 1. Queued when they would pass kBatchBytes, before
  // a chunk that is not small (which then passes through alone), and before any wait
  // (FlushPending).
  std::vector<ChunkWriter::Job> pending_;
  uint64_t pending_bytes_ = 0;
  // Set by WritePiece: small chunks take a copy of their bytes (so that the piece's memory is
  // free at once and its chunks may wait in pending_); `borrowed_` then says whether a chunk
  // still reads the caller's memory.
  bool copy_small_ = false;
  bool borrowed_ = false;
  formats::Manifest part_;  // This rank's tensors, file, pieces and blobs.
  // Lookups into part_: tensor index by name; per tensor, this rank's ranges (begin -> end).
  absl::flat_hash_map<std::string, uint32_t> tensor_index_;
  std::vector<std::map<uint64_t, uint64_t>> ranges_;  // Per tensor (empty maps allocate nothing).
  absl::Status error_;      // First local error; the rank votes no when set.
  bool ended_ = false;
  bool latest_may_name_step_ = false;  // Publish could not undo a LATEST it wrote (step 8).
  bool renamed_ = false;               // Publish renamed staging to the step directory (step 7).
  bool header_written_ = false;        // The data file's header (step 2).
  bool prepared_ = false;
  absl::Status prepare_status_;  // FinishLocal's result once prepared_.
  std::string prepared_vote_;
};

}  // namespace ckpt::internal

#endif  // CKPT_LIBCKPT_STORE_STORE_IMPL_H_
