// StagedAdamW: AdamW whose FP32 master weights and moments live in host slabs (pinned when a
// GPU is present) and are updated unit by unit, either on all CPU cores with SIMD or streamed
// through a few bounded GPU buffers (DESIGN.md §5).
#ifndef CKPT_OPTIMIZER_STAGED_ADAMW_H_
#define CKPT_OPTIMIZER_STAGED_ADAMW_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "ckpt/formats/dtype.h"
#include "ckpt/optimizer/layout.h"

struct CUstream_st;  // cudaStream_t, named without including CUDA.
struct CUevent_st;   // cudaEvent_t.

namespace ckpt::optimizer {
namespace internal {
class Engine;     // CPU or CUDA; optimizer/engine.h. Not part of the API.
class UnitFence;  // An async save's copy-on-write fence; optimizer/unit_fence.h.
}  // namespace internal

enum class EngineKind { kCpu, kCuda };
// Instruction sets of the CPU engine; kAuto picks the widest the CPU has.
enum class CpuIsa { kAuto, kScalar, kAvx2, kAvx512 };
// How the moments are kept in the slabs. kBF16 (precision-aware mode) rounds each stored moment
// to BF16 (nearest even) after the update, which itself runs in FP32: the CUDA engine streams 16
// bytes per parameter instead of 24, the CPU engine's step moves 22 instead of 30 (FP32
// gradients). Both engines give the same bits. FP32 is the default and the reference.
enum class MomentDType { kF32, kBF16 };
// Bytes of one moment element in the slabs.
constexpr size_t MomentBytes(MomentDType dtype) { return dtype == MomentDType::kF32 ? 4 : 2; }

struct StagedAdamWOptions {
  std::vector<ParamSpec> params;   // Every parameter of the model (global shapes).
  std::vector<ParamGroup> groups;  // Referenced by ParamSpec::group.
  std::vector<Piece> pieces;       // This rank's pieces; their elements lie back to back in
                                   // the slabs and in the flat grad and param buffers of Step.
  EngineKind engine = EngineKind::kCpu;
  // A unit covers at most this many bytes of one FP32 slab and never crosses a param group.
  uint64_t unit_bytes = uint64_t{8} << 20;
  int threads = 0;  // CPU engine: 0 uses every core.
  CpuIsa isa = CpuIsa::kAuto;
  int slot_count = 2;  // CUDA engine: device buffers in flight.
  MomentDType moment_dtype = MomentDType::kF32;
};

// A contiguous run of slab elements updated in one pass; all of one param group.
struct Unit {
  uint64_t offset = 0;  // In elements, into the slabs and the flat buffers.
  uint64_t count = 0;
  uint32_t group = 0;
  // A Muon group's unit is one whole matrix of `rows` x (count / rows), row-major; 0 for the
  // units of elementwise groups (AdamW).
  uint64_t rows = 0;
};

// The caller's CUDA stream for a Step on the CUDA engine: the stream that produced the
// gradients and that reads the parameters afterwards. Made from a stream handle, never from a
// null pointer: the legacy default stream (torch's stream 0) is Legacy(), by name, so that "no
// stream given" cannot pass for "the default stream". What Legacy() means to the CUDA runtime
// is decided in one place, optimizer/cuda/cuda_resources.h.
class CudaStreamView {
 public:
  static CudaStreamView Legacy() { return CudaStreamView(nullptr); }
  // kInvalidArgument for a null handle (use Legacy() for the legacy default stream).
  static absl::StatusOr<CudaStreamView> Of(CUstream_st* stream);
  bool is_legacy() const { return handle_ == nullptr; }
  CUstream_st* handle() const { return handle_; }  // nullptr for Legacy().

 private:
  explicit CudaStreamView(CUstream_st* handle) : handle_(handle) {}
  CUstream_st* handle_;
};

// Where one piece's gradients are read and its weights written: its `count` elements back to
// back at each pointer (a parameter's own storage, offset to the piece's first element).
struct PieceBuffers {
  const void* grads = nullptr;
  void* params = nullptr;
};

// What Step receives. Pointers are host memory for the CPU engine and device memory for the
// CUDA engine. Either two flat buffers that hold this rank's elements in slab order (`grads`,
// `params`), or one PieceBuffers per piece (`pieces`, in options().pieces order: the
// parameters' own storage, read and written in place, with no flat copy).
struct StepArgs {
  const void* grads = nullptr;
  formats::DType grad_dtype = formats::DType::kF32;  // kF32, kBF16 or kF16.
  float grad_scale = 1.0f;  // Multiplies every gradient (the trainer's unscale-and-clip factor).
  void* params = nullptr;   // The flat model-weight buffer (weight_bytes()), written with the
                            // updated masters.
  // Check every scaled gradient for NaN/Inf first; if any, skip the step and change nothing.
  bool check_finite = false;
  // CUDA engine (required there; the CPU engine ignores it): the caller's stream. The step
  // starts after the work queued on it so far and, once Step returns, the work queued on it
  // next runs after the step's last write of `params`.
  std::optional<CudaStreamView> stream = std::nullopt;
  // Set (one entry per piece): the step reads and writes there, and `grads` and `params` are
  // ignored.
  std::span<const PieceBuffers> pieces = {};
  // Which parameters have a gradient this step, one byte per parameter of options().params
  // (every rank passes the same): a parameter whose byte is 0 is left exactly as it is (as
  // torch skips a parameter whose .grad is None): its gradients are not read, its weights,
  // masters and moments not written, and its step count does not advance; its pieces' buffers
  // may be null. Empty: every parameter is stepped.
  std::span<const uint8_t> stepped = {};
  // Step (not an overlapped step's Finish), CUDA engine: the step's units run in slab order and
  // the caller's stream is not ordered after their weight writes; each unit records when its
  // weights are written and the gate opens (StepReport::gated): each reader waits with
  // AwaitPieces, or AwaitStep, as after a held gated overlap. The step the next forward hides
  // when the overlapped step cannot speculate (clipping that fires). Ignored (the stream is
  // ordered as usual) by the CPU engine, under an async save's fence, with Muon groups (a
  // Muon matrix records no written event), for a skipped step, and by Overlap::Finish.
  bool gate = false;
};

struct StepReport {
  bool skipped = false;          // Non-finite gradients were found (check_finite only).
  uint64_t nonfinite = 0;        // How many.
  uint64_t first_nonfinite = 0;  // Slab index of the first.
  // CUDA engine: recorded after the last write of `params` (the caller's stream already waits
  // on it; for other streams). Owned by the optimizer, valid until the next Step or Release.
  // Null on the CPU engine, and for a step that wrote nothing (skipped for non-finite
  // gradients): there is nothing to wait for.
  CUevent_st* done = nullptr;
  // An overlapped step (StagedAdamW::Overlap): units updated during backward, and whether that
  // speculation held (was committed) or was redone (or undone, for a skipped step).
  uint64_t speculated_units = 0;
  bool speculation_held = false;
  // A gated overlapped step (OverlapOptions::gate) that held, or a Step with StepArgs::gate:
  // the caller's stream was not ordered after the step's weight writes; each reader waits with
  // AwaitPieces (or all at once with AwaitStep).
  bool gated = false;
};

// How an overlapped step runs (StagedAdamW::BeginOverlap).
struct OverlapOptions {
  // Update released units before Finish (from the state into a spare copy). false: Finish runs
  // Step, and nothing needs a spare copy.
  bool speculate = true;
  // CUDA engine only (ignored by the CPU engine, whose Finish has written every weight when it
  // returns). The step's tail runs behind the next forward instead of before it: Release keeps
  // at most `window` units queued on the device and sends the ready unit of the lowest slab
  // index first (the newest released: backward runs in reverse slab order), so that what is
  // left when backward ends goes out at Finish in slab order, which is forward's for most
  // models; and a Finish that holds does not order the caller's stream after the writes
  // (StepReport::gated): the caller makes each reader of the weights wait for its own pieces
  // with AwaitPieces (a layer of the next forward, just before it runs), or for all with
  // AwaitStep. A reader that waits for neither races with the step's writes.
  bool gate = false;
  uint32_t window = 8;  // Units queued on the device at once during backward (gate only).
};

// Where the optimizer stands with respect to loads (DESIGN.md §5): kClean steps; kLoading is a
// load being applied; kPoisoned is a failed load that could not be rolled back, and refuses
// Step, SetGroup and saves until a complete load succeeds.
enum class Lifecycle { kClean, kLoading, kPoisoned };

struct StepConstants;  // optimizer/engine.h.
struct StepPlan;       // optimizer/engine.h.
struct SlabView;       // optimizer/engine.h.

// One rank's optimizer. Not thread-safe: one Step at a time.
class StagedAdamW {
 public:
  // Validates the layout and allocates the slabs; masters are initialised from
  // `model_weights` (a flat model-weight buffer in host memory: this rank's pieces in slab
  // order, each element in its parameter's dtype; see weight_bytes()), moments to zero.
  // Parameters may mix FP32, BF16 and FP16. A parameter of no elements (torch steps one: its
  // state is its step count) may have one empty piece, [0, +0), whose buffers are never read
  // and may be null. kInvalidArgument for other empty pieces, overlapping pieces, pieces
  // outside their tensor, groups that do not exist, unsupported model dtypes, a weight buffer
  // of the wrong size, an unaligned or null buffer; kUnimplemented / kFailedPrecondition when
  // the CUDA engine is asked for without a toolkit at build time or without a usable device;
  // kResourceExhausted when host or device memory runs out.
  static absl::StatusOr<std::unique_ptr<StagedAdamW>> Create(
      StagedAdamWOptions options, std::span<const std::byte> model_weights);
  ~StagedAdamW();
  StagedAdamW(const StagedAdamW&) = delete;  // Owns slabs and device resources.
  StagedAdamW& operator=(const StagedAdamW&) = delete;

  // One AdamW step over every unit, as torch.optim.AdamW on FP32 parameters:
  //   p *= 1 - lr*wd; m = b1*m + (1-b1)*g; v = b2*v + (1-b2)*g*g;
  //   p -= lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps)
  // and writes round-to-nearest-even model-dtype copies of the masters into args.params.
  // Each parameter's bias correction uses its own step count t (param_steps() + 1), so a
  // parameter that was skipped or added later continues as torch AdamW would with it.
  // kInvalidArgument for a null or misaligned buffer or an unsupported grad dtype, with the
  // state untouched; kFailedPrecondition naming the failed load when poisoned (lifecycle()).
  // Increments the step count of every parameter stepped (StepArgs::stepped), unless the step
  // was skipped for non-finite gradients.
  absl::StatusOr<StepReport> Step(const StepArgs& args);

  // An overlapped step (docs/design/overlap.md): the update of each unit starts as soon as the
  // gradients of its parameters are final, while backward goes on, and the result is bit for bit
  // the result of Step with Finish's arguments. Units are updated speculatively, with the scale
  // BeginOverlap was given, from the current state into a spare copy of the slabs (allocated at
  // the first overlapped step: the state is then held twice in host memory); Finish commits them
  // when its arguments agree (same scale, same constants for their parameters, not skipped) and
  // redoes the step otherwise. Move-only; one open at a time. Destroyed without Finish, it
  // abandons the step: the state is as before, and the weights written meanwhile are rewritten
  // from it.
  class Overlap {
   public:
    Overlap(Overlap&& other) noexcept;
    Overlap& operator=(Overlap&&) = delete;
    ~Overlap();
    // The gradients of these pieces (indices into options().pieces) are final: every unit whose
    // pieces are all released is updated now (CUDA engine: queued after the work on
    // BeginOverlap's stream so far; the host does not wait). `buffers`: one per piece when
    // BeginOverlap was given no buffers (each piece's own gradient and weights, as
    // StepArgs::pieces holds them), none otherwise. A unit is not updated here while an async
    // save's fence is installed, or without speculation (BeginOverlap): Finish does it.
    // kInvalidArgument for a piece out of range or a null or misaligned buffer;
    // kFailedPrecondition for a piece released twice (a second backward before the step:
    // gradient accumulation must release only in its last micro-batch), which abandons the
    // step.
    absl::Status Release(std::span<const uint32_t> pieces,
                         std::span<const PieceBuffers> buffers = {});
    // Blocks until every unit released so far has been updated (queued, for the CUDA engine)
    // or left to Finish by a fence: Finish does not wait for them, it updates what is left
    // itself. For tests and for callers that want speculation done before Finish.
    void Drain();
    // A released gradient changed after its Release (an in-place clip or unscale of the
    // gradients): Finish redoes the step, whatever its arguments.
    void Invalidate();
    // Ends the step with its final arguments (same buffers as BeginOverlap's; grad_scale,
    // check_finite and stepped as Step takes them): the same result and report as
    // Step(args), with speculated_units and speculation_held set. On an error the state is as
    // before the step.
    absl::StatusOr<StepReport> Finish(const StepArgs& args);

   private:
    friend class StagedAdamW;
    explicit Overlap(StagedAdamW* optimizer) : optimizer_(optimizer) {}
    StagedAdamW* optimizer_;  // nullptr once finished or moved from.
  };
  // Opens an overlapped step. `args`: the buffers of the step (pieces or flat; or none at all,
  // when each piece's come with Release), the gradient dtype, the stream, and the scale to
  // speculate with (the one the step will have unless clipping fires: 1, or the GradScaler's
  // inverse scale); check_finite and stepped are Finish's. The optimizer must outlive the
  // Overlap. `speculate` false updates nothing before Finish (which then runs Step): no spare
  // copy. kFailedPrecondition when not kClean or an overlap is open; kResourceExhausted when the
  // spare copy cannot be allocated; kInvalidArgument as Step.
  absl::StatusOr<Overlap> BeginOverlap(const StepArgs& args, const OverlapOptions& options);
  absl::StatusOr<Overlap> BeginOverlap(const StepArgs& args, bool speculate = true) {
    OverlapOptions options;
    options.speculate = speculate;
    return BeginOverlap(args, options);
  }
  bool overlap_open() const { return overlap_ != nullptr; }
  // After a gated step (StepReport::gated): what is queued next on `stream` runs after the
  // step's writes of these pieces' weights (indices into options().pieces; pieces already
  // awaited cost nothing). The gate closes once every written unit has been awaited. No-op
  // when no gate is open. kInvalidArgument for a piece out of range.
  absl::Status AwaitPieces(std::span<const uint32_t> pieces, CudaStreamView stream);
  // The same for every piece: the gate closes. Step, BeginOverlap and WriteModelWeights on a
  // stream do this first themselves; ReleaseDevice and Synchronize close it (the host waited).
  absl::Status AwaitStep(CudaStreamView stream);
  bool gate_open() const { return gate_left_ > 0; }
  // Host bytes of the spare copy (0 until an overlapped step speculates).
  uint64_t spare_bytes() const;

  // Writes the model weights, which are always the masters rounded to the model dtype (nearest
  // even): size() elements in slab order, as Step writes StepArgs::params. What a trainer calls
  // after a Checkpointer's Load or LoadModel (which change the masters and not the model) and
  // whenever it wants the weights afresh. `stream` unset: `dest` is host memory (the CUDA
  // engine first waits for the last step's copies). Set (CUDA engine only): `dest` is device
  // memory, written by the engine's slots after the work queued on `stream` so far; what is
  // queued on it next runs after the writes (the host does not wait). kInvalidArgument for a
  // null or misaligned `dest` or a stream given to the CPU engine; kFailedPrecondition when
  // the optimizer is not kClean (its masters are a load's or a failed load's) or the device is
  // released.
  absl::Status WriteModelWeights(void* dest, std::optional<CudaStreamView> stream = std::nullopt);
  // The same into each piece's own buffer (`pieces[k].params`, options().pieces order; the
  // parameters' storage, written in place with no flat copy; `grads` are ignored).
  // kInvalidArgument for a wrong count or a null or misaligned buffer, naming the piece.
  absl::Status WriteModelWeights(std::span<const PieceBuffers> pieces,
                                 std::optional<CudaStreamView> stream = std::nullopt);

  // Adds parameters (torch's add_param_group): `params` (global shapes; their `group` indexes
  // the groups there are after the call: the current ones, then `groups`), this rank's
  // `pieces` of them (`param` indexes the parameters after the call: the current ones, then
  // `params`), and their initial weights (`weights`: the new pieces in a flat model-weight
  // buffer of their own). The new parameters start fresh (masters from `weights`, moments zero,
  // step count 0); the state of the others is kept bit for bit, and their slab offsets do not
  // change (the new pieces come last). The slabs grow: the memory of both sizes is held while
  // the state is copied. All or nothing: kInvalidArgument for a name already taken, a layout
  // Create would refuse or a weight buffer of the wrong size; kFailedPrecondition when not
  // kClean or while an async save is in flight; kResourceExhausted when memory runs out; each
  // with the optimizer unchanged. CUDA engine: waits for the last step first.
  absl::Status AddParams(const std::vector<ParamSpec>& params,
                         const std::vector<ParamGroup>& groups, const std::vector<Piece>& pieces,
                         std::span<const std::byte> weights);

  // Replaces group `index`'s hyper-parameters from the next Step on (learning-rate and
  // weight-decay schedules), keeping its step counters (`group.step` is ignored).
  // kInvalidArgument naming the group and the value for an index that does not exist or a
  // hyper-parameter out of range (lr, weight_decay and eps finite and >= 0, betas in [0, 1));
  // kFailedPrecondition for amsgrad on an optimizer without the
  // max_exp_avg_sq slab (has_max_exp_avg_sq(): build it with amsgrad in some group); the group
  // is then unchanged.
  absl::Status SetGroup(size_t index, const ParamGroup& group);

  // A hyper-parameter of group `index` by the name its rule gives it (lr, eps, weight_decay,
  // betas, Adafactor's beta2_decay...): its value, or nullopt for an optional one the group does
  // not set (Adafactor's eps1 = None). kInvalidArgument for a group that does not exist or a
  // name the group's rule does not know.
  absl::StatusOr<std::optional<double>> HyperParameter(size_t index,
                                                        absl::string_view name) const;
  // Sets one of the rule's own hyper-parameters (ParamGroup::hyper; nullopt unsets an optional
  // one) from the next Step on, as SetGroup does, with the same refusals; the group is
  // unchanged on an error.
  absl::Status SetHyperParameter(size_t index, absl::string_view name,
                                 std::optional<double> value);

  Lifecycle lifecycle() const { return lifecycle_; }
  // OK when kClean; otherwise kFailedPrecondition saying why `what` cannot run now.
  absl::Status CheckClean(absl::string_view what) const;
  // OK unless an overlapped step is open (BeginOverlap): kFailedPrecondition naming `what`.
  absl::Status CheckNoOverlap(absl::string_view what) const;

  // A load being applied (DESIGN.md §5): the one way the lifecycle changes. BeginLoad() makes
  // it kLoading (Step, SetGroup and saves refuse meanwhile); the scope ends with exactly one of
  // Commit() (kClean: the state is the loaded checkpoint's; a poison is cleared), RolledBack()
  // (the lifecycle from before: the caller put the state back) or Poison(why) (kPoisoned;
  // every refusal names `why` until a complete load). A scope destroyed without an end
  // poisons the optimizer. Move-only; one at a time (REQUIRES: none open).
  class LoadScope {
   public:
    LoadScope(LoadScope&& other) noexcept;
    LoadScope& operator=(LoadScope&&) = delete;
    ~LoadScope();
    // The groups and each parameter's step count (one per parameter of options().params), as
    // the load (or its rollback) has them; the groups' step fields are recomputed from them.
    void RestoreGroups(const std::vector<ParamGroup>& groups,
                       const std::vector<uint64_t>& param_steps);
    void Commit();
    void RolledBack();
    void Poison(std::string why);

   private:
    friend class StagedAdamW;
    LoadScope(StagedAdamW* optimizer, Lifecycle before) : optimizer_(optimizer), before_(before) {}
    StagedAdamW* optimizer_;  // nullptr once ended or moved from.
    Lifecycle before_;
  };
  LoadScope BeginLoad();

  // An async save's copy-on-write fence (DESIGN.md §6), installed while the scope lives: every
  // Step passes its units in the order the fence lets them go. Move-only; one at a time
  // (REQUIRES: none installed). The fence must outlive the scope.
  class FenceScope {
   public:
    FenceScope(FenceScope&& other) noexcept;
    FenceScope& operator=(FenceScope&&) = delete;
    ~FenceScope();

   private:
    friend class StagedAdamW;
    explicit FenceScope(StagedAdamW* optimizer) : optimizer_(optimizer) {}
    StagedAdamW* optimizer_;  // nullptr once moved from.
  };
  FenceScope InstallFence(internal::UnitFence* fence);
  // Why the optimizer is poisoned (the failed load), or empty.
  const std::string& poison_reason() const { return poison_reason_; }
  // Bumped by everything that may change the state (Step, SetGroup, mutable_* views): a
  // Checkpointer compares it to tell whether the state still equals what it last saved or
  // loaded, which makes that checkpoint a free undo source for the next load.
  uint64_t state_version() const { return state_version_; }
  // True while neither moment has been written since Create (no Step, no mutable moment view):
  // both are then zero without being read (untouched slab pages stay unmapped).
  bool moments_untouched() const { return moments_untouched_; }

  // CUDA engine: drains and frees every slot, stream and event; the slabs stay. Restore makes
  // fresh ones; the next Step is identical to one without a release in between.
  absl::Status ReleaseDevice();
  absl::Status RestoreDevice();
  // CUDA engine: blocks the host until every update of the last Step has reached the slabs.
  // Call before reading master(), exp_avg() or exp_avg_sq() on the host.
  absl::Status Synchronize();
  // Device memory held by the engine now (0 for the CPU engine or after ReleaseDevice).
  uint64_t device_bytes() const;

  uint64_t size() const { return size_; }  // Elements on this rank.
  const std::vector<Unit>& units() const { return units_; }
  // The param groups; each one's `step` is the largest step count of its parameters.
  const std::vector<ParamGroup>& groups() const { return options_.groups; }
  // Each parameter's step count (how many steps updated it), one per options().params.
  const std::vector<uint64_t>& param_steps() const { return param_steps_; }
  const StagedAdamWOptions& options() const { return options_; }
  // The first parameter's dtype: every parameter's unless mixed_dtypes().
  formats::DType model_dtype() const { return model_dtype_; }
  bool mixed_dtypes() const { return mixed_dtypes_; }
  // The flat model-weight buffer of Create, WriteModelWeights and StepArgs::params: this rank's
  // pieces in slab order, each element in its parameter's dtype, each piece starting at a
  // multiple of its element size (so with one dtype: size() elements of it, back to back).
  // Its size in bytes, and the alignment it needs (the widest element).
  uint64_t weight_bytes() const { return piece_bytes_.back(); }
  size_t weight_alignment() const { return widest_; }
  // Piece k's dtype and the byte offset of its first weight in the flat buffer.
  formats::DType piece_dtype(size_t k) const { return piece_dtypes_[k]; }
  uint64_t piece_weight_offset(size_t k) const { return piece_bytes_[k]; }
  // True when the slabs hold AMSGrad's max_exp_avg_sq: some group asked for amsgrad at Create
  // or AddParams. Its elements are zero for parameters whose group does not use it; every
  // parameter's is saved in checkpoints (optimizer.max_exp_avg_sq.<name>).
  bool has_max_exp_avg_sq() const { return has_max_; }
  // Some param group's rule keeps each parameter whole on one rank (Muon, Adafactor): an
  // overlapped step and a gated step are not built for those yet.
  bool has_whole_params() const;
  // Read-only views of the slabs, in slab order. exp_avg() and exp_avg_sq() view FP32 moments
  // and are empty in MomentDType::kBF16; the *_bytes() views hold size() * moment_bytes()
  // bytes in either mode (max_exp_avg_sq_bytes(): none without has_max_exp_avg_sq()). CUDA
  // engine: call Synchronize() first.
  std::span<const float> master() const;
  std::span<const float> exp_avg() const;
  std::span<const float> exp_avg_sq() const;
  std::span<const std::byte> exp_avg_bytes() const;
  std::span<const std::byte> exp_avg_sq_bytes() const;
  std::span<const std::byte> max_exp_avg_sq_bytes() const;
  // Copies one of the state tensors (kMaster, kExpAvg, kExpAvgSq, kMaxExpAvgSq) into `out`,
  // size() FP32 values, widening BF16 moments exactly; synchronizes the CUDA engine first.
  // kInvalidArgument when `out` holds another count, or for kMaxExpAvgSq without
  // has_max_exp_avg_sq().
  // kAux copies aux slab elements (aux()), by their aux offsets, as they are (FP32).
  enum class StateTensor { kMaster, kExpAvg, kExpAvgSq, kMaxExpAvgSq, kAux };
  absl::Status CopyStateAsF32(StateTensor which, std::span<float> out);
  // The same for slab elements [offset, offset + out.size()) only (one parameter's state
  // costs its own elements, not the whole state's); kOutOfRange past size().
  absl::Status CopyStateRangeAsF32(StateTensor which, uint64_t offset, std::span<float> out);
  // Replaces the whole state at once, as a load does (torch's load_state_dict): `master` (or
  // the masters as they are, when empty), both moments as FP32 (rounded to BF16, nearest even,
  // in MomentDType::kBF16), size() elements each in slab order, and every parameter's step
  // count (`param_steps`, one per options().params), and AMSGrad's `max_exp_avg_sq` (FP32 like
  // the moments; empty: zero; REQUIRES has_max_exp_avg_sq() otherwise). All or nothing:
  // kInvalidArgument for a
  // size or count that does not match, or a non-finite value (naming the tensor and the slab
  // index), and kFailedPrecondition when the optimizer is not kClean or an async save is in
  // flight (its writer reads the slabs), each with the state untouched. CUDA engine: waits for
  // the last step first.
  // `aux_state`: the aux slab's elements (aux(); empty: zero).
  absl::Status SetState(std::span<const float> master, std::span<const float> exp_avg,
                        std::span<const float> exp_avg_sq,
                        std::span<const uint64_t> param_steps,
                        std::span<const float> max_exp_avg_sq = {},
                        std::span<const float> aux_state = {});
  // Replaces the masters of slab elements [offset, offset + values.size()) (a parameter the
  // trainer changed in place: its value becomes the master, and the next Step continues from
  // it, as torch AdamW would from the edited parameter). Moments and step counts are kept. An
  // async save in flight is not disturbed: the elements' units first pass its copy-on-write
  // fence, so the save holds the masters from before. kInvalidArgument for a range outside the
  // slabs or a non-finite value (naming the slab index), kFailedPrecondition when not kClean,
  // each with the masters untouched. CUDA engine: waits for the last step first.
  absl::Status SetMasters(uint64_t offset, std::span<const float> values);
  // The aux slab: FP32 state shaped unlike its parameter (Adafactor's row and column factors,
  // its variance of vectors), each piece of a parameter kept whole at piece_aux_offset(k), its
  // states back to back in the order its rule declares them; empty when no rule keeps such
  // state. CUDA engine: call Synchronize() first. The mutable view bumps state_version().
  std::span<const float> aux() const;
  std::span<float> mutable_aux();
  uint64_t piece_aux_offset(size_t k) const { return piece_aux_[k]; }
  // Where the aux state of the piece that starts at slab element `slab_offset` begins (of the
  // first piece starting at or after it).
  uint64_t AuxStart(uint64_t slab_offset) const;
  // Bytes per moment element in the slabs: MomentBytes(options().moment_dtype), 4 or 2.
  size_t moment_bytes() const { return MomentBytes(options_.moment_dtype); }
  // Writable views of the same memory, for loading a checkpoint into the slabs. The next Step
  // starts from what was written. Each call bumps state_version(), so keep a view only for the
  // write it was obtained for. REQUIRES: no Step in flight (CUDA engine: Synchronize()
  // returned since the last Step).
  std::span<float> mutable_master();
  std::span<std::byte> mutable_exp_avg_bytes();
  std::span<std::byte> mutable_exp_avg_sq_bytes();
  std::span<std::byte> mutable_max_exp_avg_sq_bytes();  // Empty without has_max_exp_avg_sq().
  // Which instruction set the CPU engine runs ("scalar", "avx2", "avx512").
  std::string engine_name() const;

 private:
  struct Slabs;
  friend class StagedAdamWPeer;  // Tests: wraps the engine to inject its failures.
  StagedAdamW();
  // Create, with the max_exp_avg_sq slab also when no group asks for amsgrad (`keep_max`: an
  // AddParams keeps the slab it had).
  static absl::StatusOr<std::unique_ptr<StagedAdamW>> CreateWith(
      StagedAdamWOptions options, std::span<const std::byte> model_weights, bool keep_max);
  StagedAdamWOptions options_;
  formats::DType model_dtype_ = formats::DType::kBF16;
  uint64_t size_ = 0;
  std::vector<Unit> units_;
  // Slab offset of each piece's first element, and size_ last (SlabView::piece_starts); each
  // piece's dtype, and its byte offset in the flat model-weight buffer, then its size.
  std::vector<uint64_t> piece_starts_;
  std::vector<formats::DType> piece_dtypes_;
  std::vector<uint64_t> piece_bytes_;
  // Each piece's first element in the aux slab (FP32 state shaped unlike its parameter, such
  // as Adafactor's factors), then the aux slab's size in elements.
  std::vector<uint64_t> piece_aux_;
  bool mixed_dtypes_ = false;
  bool has_max_ = false;  // The slabs hold max_exp_avg_sq.
  size_t widest_ = 1;
  SlabView View() const;
  // OK when `pieces` has one entry per piece, non-null and aligned for its dtypes (gradients
  // only when `grad_dtype` is set), but those of parameters `stepped` says are not stepped.
  absl::Status CheckPieceBuffers(std::span<const PieceBuffers> pieces,
                                 std::optional<formats::DType> grad_dtype,
                                 std::span<const uint8_t> stepped, absl::string_view what) const;
  absl::Status WriteWeightsTo(const StepArgs& where, const std::optional<CudaStreamView>& stream);
  // Step's checks of `args`, and its plan (each stepped piece's constants at its parameter's
  // next step count).
  absl::Status ValidateStepArgs(const StepArgs& args);
  StepPlan PlanStep(const StepArgs& args) const;
  // After a step that was not skipped: the step counts of the parameters `args` stepped.
  void AdvanceSteps(const StepArgs& args);
  // The open overlap's end without commit: the weights its speculated units wrote are
  // rewritten from the current side; the overlap is closed.
  absl::Status AbandonOverlap();
  // The feeder thread's loop, and stopping it (joined; what it has not taken stays queued).
  void Feed();
  void StopFeeder();
  // Step 3 on the releasing thread (an engine that only queues).
  absl::Status SpeculateNow(const std::vector<uint32_t>& ready);
  absl::StatusOr<StepReport> FinishOverlap(const StepArgs& args);

  std::unique_ptr<Slabs> slabs_;
  // The other side of the slabs, which an overlapped step writes and then swaps with slabs_
  // (docs/design/overlap.md); null until the first speculating overlap.
  std::unique_ptr<Slabs> spare_;
  struct OverlapState;
  std::unique_ptr<OverlapState> overlap_;  // The open overlapped step, if any.
  // A gated step's units whose weight writes no reader has awaited yet (AwaitPieces), and how
  // many; 0: no gate open.
  std::vector<uint8_t> gate_units_;
  uint64_t gate_left_ = 0;
  // Sends ready units of a gated overlap to the engine while fewer than its window are queued
  // (all of them when `all`).
  absl::Status Pump(bool all);
  std::unique_ptr<internal::Engine> engine_;  // After the slabs: destroyed (drained) first.

  // Runs the engine over every unit, in the order `fence_` lets them go when one is installed.
  absl::StatusOr<StepReport> StepUnits(const StepArgs& args, const StepPlan& plan);
  absl::StatusOr<StepReport> StepGated(const StepArgs& args, const StepPlan& plan);
  // Each group's step: the largest step count of its parameters.
  void SyncGroupSteps();
  std::vector<uint64_t> param_steps_;  // One per options_.params.
  Lifecycle lifecycle_ = Lifecycle::kClean;
  internal::UnitFence* fence_ = nullptr;  // Installed by an async save while it writes.
  std::string poison_reason_;
  uint64_t state_version_ = 0;
  bool moments_untouched_ = true;
};

}  // namespace ckpt::optimizer

#endif  // CKPT_OPTIMIZER_STAGED_ADAMW_H_
