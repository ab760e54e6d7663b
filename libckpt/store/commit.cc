// Save protocol, steps 3 to 10: the commit (steps 1 and 2, beginning and writing, are at the top
// of libckpt/store/transaction.cc). R ranks; rank 0 runs on the primary store handle.
// 3. Commit, each rank: wait for the writer threads (an error of theirs is this rank's no
//    vote), then Sync and Close its data file (its bytes must be durable before any
//    manifest points at them); write rank-r.part (its tensors, pieces, blobs, chunk checksums
//    and file size); Sync; Close.
// 4. Vote (AllGather, EncodeResult): "ok <XXH3 of the part>" or "no <code> <message>". Any
//    "no" aborts.
// 5. Rank 0, all votes ok: read every other rank's part and check it against its digest (its
//    own is the one in memory), merge the parts into one manifest and validate it
//    (declarations agree; pieces do not overlap across ranks).
// 6. Rank 0: write MANIFEST; Sync; Close; remove the parts; SyncDir(staging), so the data
//    files' names, MANIFEST and the removals survive a crash.
// 7. Rank 0: rename staging -> step-N; SyncDir(root). The step now exists but is unpublished:
//    after a crash here recovery keeps it in place and reports it (never deletes it; `ckpt-tool
//    adopt` publishes it) and the previous LATEST stays the state.
// 8. Rank 0: LATEST.tmp (Append, Sync, Close), rename to LATEST, SyncDir(root). The commit
//    point: from here the new step is the state. When that SyncDir fails the rename may or may
//    not survive a crash: rank 0 puts the previous LATEST back durably and abandons the step;
//    if even that fails it keeps the step directory (LATEST may name it) and reports the error.
// 9. Rank 0 broadcasts the outcome and every rank returns it. When rank 0 fails before step 8
//    it removes the staging or step directory (best effort; recovery removes what remains).
// 10. Rank 0 applies retention (libckpt/store/retention.cc): it renames the steps it retires
//     that hold only ckpt's files to .deleting-* names (one SyncDir), moves those holding
//     anything else into quarantine/, leaves mount points, and leaves removing the renamed
//     files to the store's remover thread. Its failure is logged, not returned: the step is
//     committed.
#include "ckpt/checkpoint_writer.h"

#include <algorithm>
#include <cstring>
#include <map>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "ckpt/base/checksum.h"
#include "ckpt/base/coding.h"
#include "ckpt/base/status_macros.h"
#include "libckpt/store/store_impl.h"
#include "libckpt/chunk_writer.h"
#include "libckpt/filename.h"

namespace ckpt {
namespace {

using formats::ChunkInfo;
using formats::Manifest;

bool SameDeclaration(const formats::TensorInfo& a, const formats::TensorInfo& b) {
  return a.dtype == b.dtype && a.shape == b.shape;
}

}  // namespace

// Step 3: make this rank's data durable and describe it in its part.
absl::Status internal::Transaction::FinishLocal(std::string* vote) {
  if (!error_.ok()) {
    writer_.reset();  // Skips what is queued, waits for what runs: the file is then the caller's.
    return error_;
  }
  absl::Status written = WriteHeaderOnce();
  if (written.ok()) written = WaitFor(jobs_, /*written=*/true);
  if (written.ok()) {
    std::vector<ChunkInfo>& chunks = part_.files[0].chunks;
    for (size_t i = 0; i < chunks.size(); ++i) chunks[i].checksum = writer_->checksum(chunk_job_[i]);
  }
  writer_.reset();  // Its threads and buffers go before the commit's wait for the others.
  CKPT_RETURN_IF_ERROR(Fail(written));
  CKPT_RETURN_IF_ERROR(file_->Sync());
  CKPT_RETURN_IF_ERROR(file_->Close());
  part_.files[0].size_bytes = file_->size();
  CKPT_RETURN_IF_ERROR(formats::ValidateManifest(part_, "this rank's part"));
  const std::string part = formats::EncodeManifest(part_, formats::ManifestKind::kRankPart);
  const std::string path = JoinPath(staging_dir_, internal::PartFileName(part_.files[0].rank));
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> out,
                        env_->NewWritableFile(path, FileOptions{}));
  absl::Status s = out->Append(AsBytes(part));
  if (s.ok()) s = out->Sync();
  s.Update(out->Close());
  CKPT_RETURN_IF_ERROR(s);
  *vote = EncodeResult(absl::StrFormat("%016x", Checksum(AsBytes(part))));
  return absl::OkStatus();
}

absl::Status internal::Transaction::Prepare() {
  if (ended_) return absl::FailedPreconditionError("save transaction already ended");
  if (prepared_) return absl::FailedPreconditionError("save transaction already prepared");
  prepared_ = true;
  prepare_status_ = FinishLocal(&prepared_vote_);
  if (!prepare_status_.ok() && file_ != nullptr) file_->Close().IgnoreError();
  return prepare_status_;
}

void internal::Transaction::MarkFailed(absl::Status why) {
  if (why.ok()) return;
  error_.Update(why);
  pending_.clear();  // Never queued: their memory is not read.
  if (writer_ != nullptr) writer_->Cancel(why);
  // A prepared rank already chose its vote; a later failure still turns it into a no.
  if (prepared_) prepare_status_.Update(why);
}

absl::Status internal::Transaction::Commit() { return Finish(/*vote_yes=*/true); }

absl::Status internal::Transaction::Abort() {
  absl::Status outcome = Finish(/*vote_yes=*/false);
  // The step was abandoned as asked; only a broken group is worth reporting.
  if (outcome.code() == absl::StatusCode::kAborted || outcome.ok()) return absl::OkStatus();
  return outcome;
}

absl::Status internal::Transaction::Finish(bool vote_yes) {
  if (ended_) return absl::FailedPreconditionError("save transaction already ended");
  ended_ = true;
  const int rank = coordinator_->rank();
  if (!vote_yes) error_.Update(absl::AbortedError(absl::StrCat("save aborted by rank ", rank)));
  std::string vote;
  absl::Status local;
  if (prepared_) {
    local = prepare_status_;
    if (!vote_yes) local.Update(error_);
    vote = prepared_vote_;
  } else {
    local = FinishLocal(&vote);
  }
  if (!local.ok()) {
    // Already failing; the file is garbage (a prepared transaction closed it).
    if (file_ != nullptr && !prepared_) file_->Close().IgnoreError();
    vote = EncodeResult(local);
  }
  absl::StatusOr<std::vector<std::string>> votes = coordinator_->AllGather(vote);
  absl::Status outcome;
  if (rank == 0) {
    outcome = votes.ok() ? CommitAsRoot(*votes) : votes.status();
    if (!outcome.ok()) {
      // Best effort: recovery removes whatever this leaves behind.
      const std::string step_dir = JoinPath(store_->root(), internal::StepDirName(step_));
      RemoveRecursively(env_, staging_dir_).IgnoreError();
      // Only a step directory this transaction made, and only when LATEST cannot name it.
      if (renamed_ && store_->latest_step() != step_ && !latest_may_name_step_) {
        RemoveRecursively(env_, step_dir).IgnoreError();
      }
      env_->SyncDir(store_->root()).IgnoreError();
    }
  }
  if (votes.ok()) {
    absl::StatusOr<std::string> result = coordinator_->Broadcast(EncodeStatus(outcome), 0);
    if (!result.ok()) {
      outcome.Update(result.status());
    } else if (rank != 0) {
      outcome = DecodeStatus(*result);
    }
  } else {
    outcome.Update(votes.status());
  }
  store_->OnSaveEnded();
  if (!outcome.ok()) return outcome;
  store_->OnCommitted(step_);
  if (rank == 0 && store_->options().retention.keep_last > 0) {
    absl::StatusOr<RetentionReport> removed =
        store_->Retire(store_->options().retention, /*dry_run=*/false, /*background=*/true);
    if (!removed.ok())
      store_->Log(absl::StrCat("retention after step ", step_, ": ", removed.status().message()));
  }
  return absl::OkStatus();
}

// Steps 5-8, on rank 0.
absl::Status internal::Transaction::CommitAsRoot(const std::vector<std::string>& votes) {
  Manifest merged;
  merged.step = step_;
  merged.world_size = static_cast<uint32_t>(votes.size());
  absl::flat_hash_map<std::string, uint32_t> tensor_index;
  for (size_t r = 0; r < votes.size(); ++r) {
    absl::StatusOr<std::string> vote = DecodeResult(votes[r]);
    if (!vote.ok()) {
      return absl::Status(vote.status().code(),
                          absl::StrCat("rank ", r, " voted no: ", vote.status().message()));
    }
    // This rank's own part is the one in memory (what its file holds, validated before it
    // was written): parsing it back would cost as much as the rest of a save of many small
    // tensors.
    Manifest parsed;
    if (r != 0) {
      const std::string path =
          JoinPath(staging_dir_, internal::PartFileName(static_cast<uint32_t>(r)));
      CKPT_ASSIGN_OR_RETURN(std::string bytes,
                            ReadFileToString(env_, path, formats::kMaxManifestBytes,
                                             FileOptions{.follow_symlinks = false}));
      if (absl::StrFormat("%016x", Checksum(AsBytes(bytes))) != *vote) {
        return absl::DataLossError(
            absl::StrCat(path, ": does not match the digest rank ", r, " voted"));
      }
      CKPT_ASSIGN_OR_RETURN(parsed, formats::ParseManifest(AsBytes(bytes), path,
                                                           formats::ManifestKind::kRankPart));
    }
    // part_ is only read (copied from): the transaction's own record stays whole.
    const Manifest& part = r == 0 ? part_ : parsed;
    std::vector<uint32_t> remap;
    for (const formats::TensorInfo& t : part.tensors) {
      auto [it, inserted] =
          tensor_index.emplace(t.name, static_cast<uint32_t>(merged.tensors.size()));
      if (inserted) {
        merged.tensors.push_back(t);
      } else if (!SameDeclaration(merged.tensors[it->second], t)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tensor \"", t.name, "\" is declared differently by rank ", r, " and an earlier rank"));
      }
      remap.push_back(it->second);
    }
    const uint32_t file_index = static_cast<uint32_t>(merged.files.size());
    for (const formats::DataFileInfo& f : part.files) merged.files.push_back(f);
    for (formats::PieceInfo p : part.pieces) {
      p.tensor = remap[p.tensor];
      p.file += file_index;
      merged.pieces.push_back(p);
    }
    for (formats::BlobInfo b : part.blobs) {
      b.file += file_index;
      merged.blobs.push_back(std::move(b));
    }
  }
  absl::Status valid = formats::ValidateManifest(merged, "merged manifest");
  if (!valid.ok()) return absl::InvalidArgumentError(valid.message());
  return Publish(merged);
}

absl::Status internal::Transaction::Publish(const Manifest& manifest) {
  // Step 6.
  const std::string encoded = formats::EncodeManifest(manifest);
  {
    CKPT_ASSIGN_OR_RETURN(
        std::unique_ptr<WritableFile> out,
        env_->NewWritableFile(JoinPath(staging_dir_, internal::kManifestName), FileOptions{}));
    absl::Status s = out->Append(AsBytes(encoded));
    if (s.ok()) s = out->Sync();
    s.Update(out->Close());
    CKPT_RETURN_IF_ERROR(s);
  }
  for (uint32_t r = 0; r < manifest.world_size; ++r) {
    CKPT_RETURN_IF_ERROR(env_->RemoveFile(JoinPath(staging_dir_, internal::PartFileName(r))));
  }
  CKPT_RETURN_IF_ERROR(env_->SyncDir(staging_dir_));
  // Step 7.
  const std::string step_dir = JoinPath(store_->root(), internal::StepDirName(step_));
  CKPT_RETURN_IF_ERROR(env_->RenameFile(staging_dir_, step_dir));
  renamed_ = true;  // From here the step directory is this transaction's.
  CKPT_RETURN_IF_ERROR(env_->SyncDir(store_->root()));
  // Step 8: the commit point.
  const std::string latest = JoinPath(store_->root(), internal::kLatestName);
  const std::string encoded_latest = formats::EncodeLatest(step_);
  const std::span<const std::byte> parts[] = {AsBytes(encoded_latest)};
  CKPT_RETURN_IF_ERROR(WriteFileViaTmp(env_, latest + ".tmp", latest, parts));
  absl::Status synced = env_->SyncDir(store_->root());
  if (!synced.ok()) {
    // The new LATEST is in place but may not survive a crash: neither committed nor abandoned.
    // Put the previous LATEST back (durably) so that the step is abandoned everywhere; only
    // then may it be removed. When that fails too, the step stays: LATEST may name it, and the
    // next Open's recovery decides from what is on disk.
    const std::optional<uint64_t> previous = store_->latest_step();
    absl::Status restored;
    if (previous.has_value()) {
      restored = WriteFileAtomically(env_, latest, formats::EncodeLatest(*previous));
    } else {
      restored = env_->RemoveFile(latest);
      if (restored.ok()) restored = env_->SyncDir(store_->root());
    }
    if (!restored.ok()) {
      latest_may_name_step_ = true;
      store_->OnLatestUncertain(step_);
    }
    return Annotate(synced, restored.ok()
                                ? "LATEST could not be made durable; the previous LATEST is back"
                                : absl::StrCat("LATEST could not be made durable, nor the "
                                               "previous one put back (",
                                               restored.message(), ")"));
  }
  store_->OnCommitted(step_);
  return absl::OkStatus();
}

}  // namespace ckpt
