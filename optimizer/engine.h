// The seam between StagedAdamW and its update engines (CPU SIMD, CUDA streamed).
#ifndef CKPT_OPTIMIZER_ENGINE_H_
#define CKPT_OPTIMIZER_ENGINE_H_

#include <algorithm>
#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "ckpt/optimizer/staged_adamw.h"
#include "optimizer/rules/muon/muon.h"

namespace ckpt::optimizer {

// Per-group constants of one step, computed once in double and rounded to float, so every
// engine and instruction set applies exactly the same numbers.
struct StepConstants {
  float beta1, beta2, eps;
  float decay;       // 1 - lr * weight_decay
  float omb1, omb2;  // 1 - beta1, 1 - beta2
  float step_size;   // lr / (1 - beta1^t)
  float bc2_sqrt;    // sqrt(1 - beta2^t)
  // AMSGrad: x = max(x, v) (NaN from either side wins, as torch.maximum), and the denominator
  // uses x in place of v. Only where the slabs hold max_exp_avg_sq (SlabView).
  bool amsgrad;
  // A Muon group's (Algorithm::kMuon): its units are whole matrices (Unit::rows), stepped with
  // `muon`; the AdamW constants above are unused.
  bool is_muon = false;
  internal::MuonConstants muon{};
  // The rule that made these constants (UpdateRule::SetConstants), and what a rule that keeps
  // parameters whole computes for its own kernels (StepWholeCpu), which only it reads.
  const internal::UpdateRule* rule = nullptr;
  std::array<double, 8> values{};
};
StepConstants ComputeStepConstants(const ParamGroup& group, uint64_t t);
// OK when every hyper-parameter of `group` is in range; kInvalidArgument naming group `index`,
// the field and its value otherwise.
absl::Status ValidateHyperParameters(const ParamGroup& group, size_t index);

// The slabs as an engine sees them.
struct SlabView {
  float* master;
  std::byte* exp_avg;  // FP32 or BF16 elements, per moment_dtype.
  std::byte* exp_avg_sq;
  std::byte* max_exp_avg_sq;  // AMSGrad's running maximum, in the moments' dtype; null when no
                              // group of the optimizer has ever asked for amsgrad.
  MomentDType moment_dtype;
  // Slab offset of each piece's first element, then the slab size: where StepArgs::pieces'
  // buffers begin and end.
  std::span<const uint64_t> piece_starts;
  // Each piece's model dtype (its parameter's), and the byte offset of its first weight in a
  // flat model-weight buffer (StagedAdamW::weight_bytes()), then that buffer's size.
  std::span<const formats::DType> piece_dtypes;
  std::span<const uint64_t> piece_bytes;
  // The pieces (StagedAdamWOptions::pieces) and parameters, for the kernels of rules that keep
  // parameters whole (a unit's shape).
  std::span<const Piece> pieces;
  std::span<const ParamSpec> params;
  // The aux slab (internal::Slab::kAux: FP32 state shaped unlike its parameter), and each piece's
  // first element in it, then its size; null when no parameter keeps such state. Stepped in
  // place only (a parameter kept whole is never in an out-of-place pass).
  float* aux = nullptr;
  std::span<const uint64_t> piece_aux;
  // Where a Step writes the state: null writes it in place (where it is read, above). Set for an
  // out-of-place pass (an overlapped step writes the spare side, docs/design/overlap.md); every
  // element of the pass's units is then written there, skipped runs and AMSGrad's slab of groups
  // without amsgrad copied across as they are.
  float* master_out = nullptr;
  std::byte* exp_avg_out = nullptr;
  std::byte* exp_avg_sq_out = nullptr;
  std::byte* max_exp_avg_sq_out = nullptr;
  bool out_of_place() const { return master_out != nullptr; }
  float* dest_master() const { return master_out != nullptr ? master_out : master; }
  std::byte* dest_exp_avg() const { return master_out != nullptr ? exp_avg_out : exp_avg; }
  std::byte* dest_exp_avg_sq() const {
    return master_out != nullptr ? exp_avg_sq_out : exp_avg_sq;
  }
  std::byte* dest_max_exp_avg_sq() const {
    return master_out != nullptr ? max_exp_avg_sq_out : max_exp_avg_sq;
  }
};

// What one Step applies to each piece (StagedAdamW::Step plans it): the constants of each
// (group, step count) pair among the parameters being stepped, and per piece the index of its
// entry, or kSkipped for a piece whose parameter has no gradient this step (its gradients are
// not read, its state and weights not written).
struct StepPlan {
  static constexpr uint32_t kSkipped = ~uint32_t{0};
  std::vector<StepConstants> constants;
  std::vector<uint32_t> piece_constants;  // One per piece.
  // A later Step call of one step whose units differ from the earlier calls' (an overlapped
  // step's batches): the CUDA engine's copy-ins need not wait again for the copy-outs before
  // the step, which the first call's already wait for.
  bool continues = false;
  // What reads the parameters after this call is ordered by a later Engine::Barrier, not by
  // this call's StepReport::done (an overlapped step's speculative batches): the CUDA engine
  // then records no `done` for the call (three fewer calls on the caller's thread per batch)
  // and leaves StepReport::done null.
  bool barrier_later = false;
  // Set (parallel to Step's `units`, their indices in the optimizer's units): the CUDA engine
  // also records each unit's own event once its kernel has written the unit's weights, which
  // OrderCallerAfterUnit waits for (a gated overlapped step, docs/design/overlap.md).
  std::span<const uint32_t> unit_ids;
  // With unit_ids: each unit's update waits for the point its Release recorded
  // (Engine::RecordUnitReady), not for the caller's stream as it is at this call (a gated step
  // sends a unit later than it became ready).
  bool wait_unit_ready = false;
};

// Calls fn(offset, count, grads, params, constants, dtype) for each run of slab elements
// [offset, offset + count) of one entry of `plan` (StepPlan::kSkipped included: the caller
// decides what a skipped run costs it) and one model dtype that reads its gradients and writes
// its weights contiguously: at the flat buffers, the range cut where the pieces' entries or
// dtypes change; with StepArgs::pieces, cut at every piece boundary (a skipped piece's pointers
// may be null, and are passed so). The empty piece of a parameter of no elements has no run.
// `gsize` is the gradient element size.
template <typename Fn>
void ForEachSegment(const StepArgs& args, const SlabView& slabs, const StepPlan& plan,
                    uint64_t offset, uint64_t count, size_t gsize, Fn fn) {
  if (count == 0) return;
  const std::span<const uint64_t> starts = slabs.piece_starts;
  size_t k = static_cast<size_t>(std::upper_bound(starts.begin(), starts.end(), offset) -
                                 starts.begin()) -
             1;
  const bool flat = args.pieces.empty();
  for (uint64_t at = offset, end = offset + count; at < end;) {
    if (starts[k + 1] == starts[k]) {  // A parameter of no elements: no run to read or write.
      ++k;
      continue;
    }
    const uint32_t c = plan.piece_constants[k];
    const formats::DType dtype = slabs.piece_dtypes[k];
    const size_t psize = formats::DTypeSize(dtype);
    const size_t first = k;
    uint64_t stop = std::min(end, starts[k + 1]);
    // At flat buffers, neighbours with the same entry and dtype, back to back, are one run.
    while (flat && stop < end && plan.piece_constants[k + 1] == c &&
           slabs.piece_dtypes[k + 1] == dtype &&
           slabs.piece_bytes[k + 1] == slabs.piece_bytes[k] + (starts[k + 1] - starts[k]) * psize) {
      ++k;
      stop = std::min(end, starts[k + 1]);
    }
    const uint64_t n = stop - at;
    const uint64_t within = at - starts[first];
    if (flat) {
      fn(at, n, static_cast<const std::byte*>(args.grads) + at * gsize,
         static_cast<std::byte*>(args.params) + slabs.piece_bytes[first] + within * psize, c,
         dtype);
    } else {
      const PieceBuffers& b = args.pieces[k];
      fn(at, n,
         b.grads == nullptr ? nullptr : static_cast<const std::byte*>(b.grads) + within * gsize,
         b.params == nullptr ? nullptr : static_cast<std::byte*>(b.params) + within * psize, c,
         dtype);
    }
    at = stop;
    ++k;
  }
}

// An update engine: the seam that tests and backends swap (CPU SIMD, CUDA streamed). Owned by
// one StagedAdamW; not thread-safe (one Step at a time, as the optimizer).
namespace internal {
class Engine {
 public:
  virtual ~Engine() = default;
  // Updates every piece of `units` that `plan` does not skip. REQUIRES: args validated.
  virtual absl::StatusOr<StepReport> Step(const StepArgs& args, const std::vector<Unit>& units,
                                          const StepPlan& plan, const SlabView& slabs,
                                          uint64_t elements) = 0;
  // The check_finite pass of Step alone, over `units` (the pieces `plan` does not skip): what
  // a step split into several Step calls (an async save's fence, optimizer/async_save.h) runs
  // once before the first.
  virtual absl::StatusOr<StepReport> CheckFinite(const StepArgs& args,
                                                 const std::vector<Unit>& units,
                                                 const StepPlan& plan,
                                                 const SlabView& slabs, uint64_t elements) = 0;
  // Orders what the caller queues next on args.stream after the writes of the last Step call
  // (once per StagedAdamW::Step, however many calls it took); no-op for the CPU engine.
  virtual absl::Status OrderCallerAfterStep(const StepArgs& args) {
    (void)args;
    return absl::OkStatus();
  }
  // Writes the masters of `units`, each rounded to its piece's model dtype (nearest even), where
  // `dest` says: its flat `params` buffer (StagedAdamW::weight_bytes()) or each piece's
  // `pieces[k].params` (StagedAdamW::WriteModelWeights; REQUIRES: arguments validated; the
  // gradients are not read). `stream` unset: host memory, written once the last Step's copies
  // have landed. Set (CUDA engine): device memory, written after the work queued on the stream
  // so far, and what is queued on it next runs after the writes.
  virtual absl::Status WriteWeights(const SlabView& slabs, const std::vector<Unit>& units,
                                    const StepArgs& dest,
                                    const std::optional<CudaStreamView>& stream) = 0;
  // Orders everything queued next after every update and weight write queued so far, whatever
  // slot ran it (an overlapped step that redoes or restores units it speculated); no-op for the
  // CPU engine.
  virtual absl::Status Barrier() { return absl::OkStatus(); }
  // A gated overlapped step's per-unit events (StepPlan::unit_ids): made for `units` units
  // (once; again after Restore). CUDA engine only: the CPU engine's Step has written the
  // weights when it returns.
  virtual absl::Status PrepareUnitEvents(size_t units) {
    (void)units;
    return absl::OkStatus();
  }
  // Whether the last recorded write of unit `u`'s weights has run (true when none was
  // recorded); the host does not wait.
  virtual absl::StatusOr<bool> UnitWritten(uint32_t u) {
    (void)u;
    return true;
  }
  // A gated step's Release: records on `stream` the point after which unit `u`'s gradients
  // are final, for StepPlan::wait_unit_ready; UnitReady says whether the device has passed it
  // (true when none was recorded). No-op / true for the CPU engine.
  virtual absl::Status RecordUnitReady(uint32_t u, CudaStreamView stream) {
    (void)u;
    (void)stream;
    return absl::OkStatus();
  }
  virtual absl::StatusOr<bool> UnitReady(uint32_t u) {
    (void)u;
    return true;
  }
  // Orders what is queued next on `stream` after the last recorded write of unit `u`'s
  // weights; no-op for the CPU engine.
  virtual absl::Status OrderCallerAfterUnit(uint32_t u, CudaStreamView stream) {
    (void)u;
    (void)stream;
    return absl::OkStatus();
  }
  // True when Step only queues work for the device and returns (CUDA): an overlapped step then
  // calls it from the releasing thread itself, since a second thread making CUDA calls beside
  // backward's contends with it in the driver (measured: backward 38 -> 65 ms at 355M).
  virtual bool queues_only() const { return false; }
  // Cores a step leaves to other work (an async save's writer) from now on; CPU engine only.
  virtual void SetSpareCores(int cores) { (void)cores; }
  virtual absl::Status Release() { return absl::OkStatus(); }
  virtual absl::Status Restore() { return absl::OkStatus(); }
  virtual uint64_t device_bytes() const { return 0; }
  // Waits until every update (slab copy-back included) has landed; no-op for the CPU engine.
  virtual absl::Status Synchronize() { return absl::OkStatus(); }
  virtual std::string name() const = 0;
  // Host memory for slabs: pinned (cudaHostAlloc) for the CUDA engine, aligned otherwise.
  virtual bool wants_pinned_slabs() const { return false; }
};
}  // namespace internal

absl::StatusOr<std::unique_ptr<internal::Engine>> NewCpuEngine(int threads, CpuIsa isa);
// kUnimplemented in a build without CUDA; kFailedPrecondition without a usable device.
// `max_slab`: the slabs hold AMSGrad's max_exp_avg_sq, which the slots stream too.
absl::StatusOr<std::unique_ptr<internal::Engine>> NewCudaEngine(const StagedAdamWOptions& options,
                                                                const std::vector<Unit>& units,
                                                                bool max_slab);

}  // namespace ckpt::optimizer

#endif  // CKPT_OPTIMIZER_ENGINE_H_
