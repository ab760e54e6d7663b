// Checkpointer: the binding of one rank's StagedAdamW state to a CheckpointStore, as
// transactions (DESIGN.md §6). Save writes the state straight from the slabs; Load is
// preflighted, applied, voted on by every rank, and rolled back from an undo source when any
// rank fails, or the optimizer is poisoned when the rollback fails too. The protocol's numbered
// steps are the opening comment of optimizer/checkpointer.cc.
#ifndef CKPT_OPTIMIZER_CHECKPOINTER_H_
#define CKPT_OPTIMIZER_CHECKPOINTER_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "ckpt/checkpoint_store.h"
#include "ckpt/coordinator.h"
#include "ckpt/optimizer/staged_adamw.h"

namespace ckpt::optimizer {
namespace internal {
class StagingPool;  // optimizer/async_save.h.
class ThreadPool;   // optimizer/thread_pool.h.
}  // namespace internal

// Opaque trainer records (scheduler, RNG, data position) saved beside the state, per rank,
// returned untouched by Load.
using Blobs = std::map<std::string, std::string>;

// What a successful Load did.
struct LoadReport {
  uint64_t step = 0;              // The step loaded.
  uint32_t saved_world_size = 0;  // Ranks that saved it (any number loads into any other).
  bool undo_spilled = false;      // The undo source was a spill of the state (not a checkpoint).
  // The state was its construction state (moments zero, every step 0: a freshly built or
  // model-loaded optimizer's), which a rollback re-derives from a copy of the masters kept in
  // memory during the load (size() x 2 bytes for a BF16 model whose masters are all BF16
  // values, x 4 otherwise): nothing was written to disk for the undo.
  bool undo_derived = false;
  // The state already equalled this very step (the one it was last saved as or loaded from,
  // unchanged since, and the step's manifest the same as then): nothing was read into the
  // slabs and no undo source was needed; only the trainer's blobs were read.
  bool unchanged = false;
  // The moments' dtype in the checkpoint (kF32 or kBF16): when it differs from the optimizer's
  // MomentDType they were converted (rounded to BF16, or widened exactly to FP32).
  formats::DType saved_moment_dtype = formats::DType::kF32;
  // LoadNewestIntact: the newer steps passed over, each with why ("step 30: ...").
  std::vector<std::string> skipped;
};

// A rename rule of a model-only load: the first match of `pattern` (RE2 syntax, e.g.
// R"(^decoder\.layers\.(\d+)\.)") in a source tensor's name is replaced by `replacement`, in
// which \1 to \9 stand for the pattern's groups (\0 for the whole match).
struct RenameRule {
  std::string pattern;
  std::string replacement;
};

struct ModelLoadOptions {
  // Applied in order to each source tensor's name, each rule to what the previous ones made
  // (as sed -e ... -e ...). The result must be a parameter's name.
  std::vector<RenameRule> rename = {};
  // Tied weights: a parameter (key) that the source lacks is read from the source tensor named
  // by the value (after renaming), as transformers does for tied embeddings.
  std::map<std::string, std::string> tied = {{"lm_head.weight", "model.embed_tokens.weight"}};
  // Source tensors that no parameter takes are an error (listed) unless this is set; they are
  // then counted in the report and not read.
  bool ignore_unexpected = false;
  // A ckpt source: the step to read (LATEST when nullopt). Must be unset for an HF source.
  std::optional<uint64_t> step = std::nullopt;
  // A ckpt source: each parameter from its FP32 master (optimizer.master.<name>, the name the
  // rename rules see without that prefix) instead of its weights: the precision the optimizer
  // kept, with its moments dropped; what keeps a checkpoint's training across optimizers of
  // another algorithm (AdamW and Muon). kInvalidArgument for an HF source.
  bool masters = false;
};

// What a successful LoadModel did.
struct ModelLoadReport {
  bool hf = false;           // The source was HuggingFace safetensors (else a ckpt step).
  uint64_t step = 0;         // A ckpt source's step.
  uint64_t tensors = 0;      // Parameters loaded (tied ones included).
  std::vector<std::string> tied;  // Parameters read from the tensor they are tied to.
  uint64_t ignored = 0;           // Source tensors no parameter took (ignore_unexpected).
  bool undo_spilled = false;      // The undo source was a spill of the state.
  bool undo_derived = false;      // As LoadReport::undo_derived.
};

struct CheckpointerOptions {
  // Async save: bytes of state (master and moments) that steps may copy aside while the writer
  // has not written them yet. When it is full, a step waits for the writer. Allocated at the
  // first SaveAsync (no more than the state itself) and kept for the next ones; its pages are
  // touched by the first copies.
  uint64_t async_staging_bytes = uint64_t{1} << 30;
};

// What an async save cost the steps that ran during it (PendingSave::report()).
struct AsyncSaveReport {
  uint64_t units = 0;         // Units of the optimizer on this rank.
  uint64_t units_copied = 0;  // Copied aside by a step before the writer reached them.
  uint64_t bytes_copied = 0;
  uint64_t step_waits = 0;    // Times a step waited for the writer (the staging pool was full).
};

class Checkpointer;

// An async save in flight on one rank (Checkpointer::SaveAsync). Must not outlive its
// Checkpointer. Dropping it without Finalize() leaves the save in flight until the Checkpointer
// is destroyed (which abandons it).
class PendingSave {
 public:
  uint64_t step() const { return step_; }
  // Whether this rank's writer has finished (Finalize then only votes and publishes).
  bool writer_done() const;
  // Collective. Waits for this rank's writer, then commits the step on every rank or on none.
  // Like Step, and never at the same time as a Step of the same optimizer (it removes the fence
  // a Step goes through).
  // Returns OK when it is durable and LATEST names it; otherwise the same error on every rank
  // (a writer's ENOSPC or EIO, annotated with its rank) and nothing is published: the previous
  // checkpoint is untouched. kFailedPrecondition when already finalized.
  absl::Status Finalize();
  // What the steps have cost so far (final after Finalize()).
  AsyncSaveReport report() const;

 private:
  friend class Checkpointer;
  PendingSave(Checkpointer* owner, uint64_t step) : owner_(owner), step_(step) {}
  Checkpointer* const owner_;
  const uint64_t step_;
  bool finalized_ = false;
  AsyncSaveReport report_;
};

// One per rank. On-disk layout of a step (tensor names are the parameters' names):
//   <name>                          the model-dtype weights (global shape)
//   optimizer.master.<name>         FP32 masters
//   optimizer.exp_avg.<name>        moments, in the slab dtype (F32, or BF16 in BF16 mode)
//   optimizer.exp_avg_sq.<name>
//   blob optimizer.layout           JSON: parameters, groups (hyper-parameters in double and
//                                   step counters), moment dtype, world size (every rank)
//   blob trainer.<key>              the trainer's blobs
// Not thread-safe; the optimizer, the store and the coordinator must outlive it, and nothing else may step or change the optimizer during Save or Load.
class Checkpointer {
 public:
  // The model weights are not the Checkpointer's: a save writes the masters rounded (what
  // every Step writes), a load changes the masters only, and the trainer then writes its
  // weights with StagedAdamW::WriteModelWeights.
  static absl::StatusOr<std::unique_ptr<Checkpointer>> Create(StagedAdamW* optimizer,
                                                              CheckpointStore* store,
                                                              Coordinator* coordinator,
                                                              CheckpointerOptions options = {});

  // Collective. Saves the state as it is now as `step`: one transaction, committed on every
  // rank or on none. Never changes the state. CUDA engine: waits for the last step's copies.
  // The weights saved are the masters rounded to the model dtype, as SaveAsync's are.
  // kFailedPrecondition when the optimizer is poisoned or `step` is not newer than LATEST;
  // IO errors as the store reports them (the previous checkpoint is untouched).
  absl::Status Save(uint64_t step, const Blobs& blobs = {});

  // Collective. Begins saving the state as it is now as `step` and returns at once; a writer
  // thread writes it while training goes on. Steps may run meanwhile: a unit the writer has not
  // written yet is copied aside before a step changes it (options().async_staging_bytes at
  // most; when that is full the step waits for the writer), so the checkpoint holds exactly the
  // state, hyper-parameters, step counters and blobs at this call. SetGroup may run too (the
  // groups are taken at the call); Save, SaveAsync and Load refuse with kFailedPrecondition
  // until Finalize(). The weights saved are the masters rounded to the model dtype (what every
  // step writes): the trainer's weights are not read.
  // Errors as Save, on every rank.
  absl::StatusOr<std::unique_ptr<PendingSave>> SaveAsync(uint64_t step, const Blobs& blobs = {});

  // Collective. Loads `step` (LATEST when nullopt) into the optimizer, at any
  // data-parallel layout: pieces are flat index ranges, so another DP size, bucket size or
  // number of saving ranks reads the same. FP32 moments load into BF16 mode rounded (nearest
  // even); BF16 moments widen exactly. The model weights are the masters rounded: on success,
  // write them with StagedAdamW::WriteModelWeights (a load does not touch them).
  // On failure every rank returns the same error and the state is exactly as before the call
  // (masters, moments, hyper-parameters, step counters), or, when the rollback failed
  // too, the optimizer is poisoned (lifecycle() kPoisoned). Preflight failures (missing or extra
  // names, listed; shapes, dtypes, coverage, hyper-parameters, damaged manifest) touch nothing
  // and write nothing. `blobs` receives this rank's trainer blobs (or rank 0's when the
  // checkpoint has fewer ranks); it is unchanged on failure.
  // A load that fails on damage (kDataLoss: a chunk that fails its checksum, a damaged
  // MANIFEST) names the step and says how to go on: LoadNewestIntact, or `ckpt-tool quarantine
  // ROOT STEP`.
  absl::StatusOr<LoadReport> Load(std::optional<uint64_t> step, Blobs* blobs = nullptr);
  // Collective. Load(LATEST), and while that fails on damage (kDataLoss), each older committed
  // step in turn, newest first, each a whole transaction that rolled back: the explicit
  // fallback to the newest step that loads intact (a damaged LATEST file: every step is a
  // candidate). The damaged steps passed over are moved into quarantine/ by rank 0 on a
  // primary, writable handle (so the next save need not be newer than them; LATEST then names
  // the loaded step), and left in place on others; LoadReport::skipped names each and why.
  // Other errors end it at once (kFailedPrecondition when a rollback failed: poisoned);
  // kDataLoss when no step loads (the state is then as before the call).
  absl::StatusOr<LoadReport> LoadNewestIntact(Blobs* blobs = nullptr);

  // Collective. Model-only load (DESIGN.md §6): replaces the model under a running optimizer.
  // `source` is a .safetensors file, a HuggingFace model directory (model.safetensors, or
  // model.safetensors.index.json and its shards), or a ckpt root ("" for this Checkpointer's
  // store), whose step (options.step, LATEST by default) gives its model tensors (not the
  // optimizer.* ones). Sources are read through the store's Env.
  // Every parameter's masters become the source tensor's values (FP32: bit for bit; BF16 and
  // F16: widened exactly), both moments zero and every group's step 0; then write the model
  // weights with StagedAdamW::WriteModelWeights (the masters rounded to the model dtype). Hyper-parameters stay, and so do the
  // trainer's blobs, which this call neither reads nor writes (the scheduler goes on).
  // A transaction like Load: a preflight touches nothing and lists what is wrong (missing and
  // unexpected names, the first 10 of each and their counts; shapes; dtypes other than F32,
  // BF16, F16; a ckpt step that does not cover this rank's elements; an invalid rename rule);
  // then an undo source is fixed, the tensors applied and the ranks vote; on failure every rank
  // returns the same error and the state is as before, or the optimizer is poisoned when the
  // rollback failed too. kFailedPrecondition while an async save is in flight.
  absl::StatusOr<ModelLoadReport> LoadModel(const std::string& source,
                                            const ModelLoadOptions& options = {});

  // Waits for an async save's writer and abandons the save when it was never finalized: a
  // collective abort, so every rank's Checkpointer must be destroyed (each on its own thread
  // or process, as the ranks' other collectives run).
  ~Checkpointer();
  Checkpointer(const Checkpointer&) = delete;  // Tracks one optimizer's undo source.
  Checkpointer& operator=(const Checkpointer&) = delete;

 private:
  struct Undo;
  struct InFlight;
  friend class PendingSave;
  Checkpointer(StagedAdamW* optimizer, CheckpointStore* store, Coordinator* coordinator,
               CheckpointerOptions options);
  absl::Status NoSaveInFlight(absl::string_view what) const;
  // Save's steps 1 and 2 (SaveAsync's A1): refusals voted on, then the store's transaction.
  absl::StatusOr<std::unique_ptr<SaveTransaction>> BeginSave(uint64_t step,
                                                             absl::string_view what);
  absl::Status FinalizeAsync(PendingSave& handle);
  absl::Status Preflight(const CheckpointReader& reader) const;
  // LoadNewestIntact's end: the damaged steps passed over go into quarantine/ (rank 0, a
  // primary writable handle); `skipped` says where each went.
  void SetAsideSkipped(const std::vector<uint64_t>& steps, std::vector<std::string>& skipped);
  // Load without the how-to-go-on annotation (Load and LoadNewestIntact share it).
  absl::StatusOr<LoadReport> LoadStep(std::optional<uint64_t> step, Blobs* blobs);
  // Load's steps 2 to 5 once the preflight has been voted: fixes the undo source (never
  // `exclude`, the step being read), runs `apply` under kLoading, votes, and restores or
  // poisons on failure. `what` names the load in a poison reason.
  // With `unchanged`, `apply` writes nothing to the state (the state equals the step read), so
  // the state itself is the undo source: nothing is spilled and a rollback restores nothing.
  absl::Status Transact(std::optional<uint64_t> exclude,
                        const std::function<absl::Status(StagedAdamW::LoadScope&)>& apply,
                        absl::string_view what, bool* undo_spilled, bool* undo_derived,
                        bool unchanged = false);
  // Rank 0 reads `root`'s LATEST afresh and broadcasts it, so every rank reads the same step.
  absl::StatusOr<uint64_t> AgreeOnLatest(Env* env, const std::string& root);
  absl::Status Apply(const CheckpointReader& reader, Blobs* blobs, StagedAdamW::LoadScope& scope);
  // This rank's trainer blobs of the step `reader` reads (rank 0's when it was saved by fewer).
  absl::Status ReadTrainerBlobs(const CheckpointReader& reader, Blobs* blobs) const;
  absl::StatusOr<std::unique_ptr<Undo>> FixUndoSource(std::optional<uint64_t> exclude,
                                                      bool unchanged);
  // The state equals committed `step` as of state_version() `version`: remembers both, and the
  // step's manifest identity (from `reader`, or by opening the step when null; none when it
  // cannot be opened, which only costs the next reload of it its shortcut).
  void MarkClean(uint64_t step, uint64_t version, const CheckpointReader* reader);
  void RemoveSpill(Undo& undo);
  absl::Status RestoreFrom(Undo& undo, StagedAdamW::LoadScope& scope);
  // When the state is what a rollback can re-derive without disk (every group's step 0 and
  // both moments zero, as a freshly built or model-loaded optimizer's are): the masters in the
  // model dtype (size() elements) when each is a value of it, else in FP32 (exact whatever the
  // parameters' dtypes or the masters' values). `*dtype` is the copy's. Null otherwise, or
  // when that copy cannot be allocated or would not fit (beside the moments a load of a fresh
  // state touches) in the memory the store's Env says is available: then `*why_not` says so.
  std::unique_ptr<std::byte[]> CopyIfDerivable(formats::DType* dtype, std::string* why_not);
  // The Checkpointer's workers: the optimizer's `threads` (0: every core), made at first use.
  internal::ThreadPool& Pool();
  absl::Status SaveInto(SaveTransaction& txn, const Blobs& blobs, uint64_t chunk_bytes);
  absl::Status Vote(const absl::Status& mine);

  StagedAdamW* const optimizer_;
  CheckpointStore* const store_;
  Coordinator* const coordinator_;
  const CheckpointerOptions options_;
  std::unique_ptr<InFlight> in_flight_;  // The async save being written, if any.
  // Made by the first SaveAsync, kept for the next ones (async_staging_bytes at most).
  std::unique_ptr<internal::StagingPool> staging_;
  // What the async save's copies and the derivability scan run on (Pool()). Destroyed before
  // in_flight_, which is harmless: ~Checkpointer ends the save first, and only a Step (never
  // running then) copies on it.
  std::unique_ptr<internal::ThreadPool> pool_;
  // The step the state last equalled (saved or loaded), and the optimizer's state_version()
  // right then: while they still match, that step is a free undo source.
  std::optional<uint64_t> clean_step_;
  uint64_t clean_version_ = 0;
  // A checksum of clean_step_'s manifest as it was then (every chunk's checksum, every piece):
  // a reload of clean_step_ reads nothing only while the step on disk still has it, so a step
  // replaced since (quarantined, then saved again by another handle) is read afresh.
  std::optional<uint64_t> clean_identity_;
};

}  // namespace ckpt::optimizer

#endif  // CKPT_OPTIMIZER_CHECKPOINTER_H_
