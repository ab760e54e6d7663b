// The seam between StagedAdamW and its update engines (CPU SIMD, CUDA streamed).
#ifndef CKPT_OPTIMIZER_ENGINE_H_
#define CKPT_OPTIMIZER_ENGINE_H_

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "ckpt/optimizer/staged_adamw.h"

namespace ckpt::optimizer {

// Per-group constants of one step, computed once in double and rounded to float, so every
// engine and instruction set applies exactly the same numbers.
struct StepConstants {
  float beta1, beta2, eps;
  float decay;       // 1 - lr * weight_decay
  float omb1, omb2;  // 1 - beta1, 1 - beta2
  float step_size;   // lr / (1 - beta1^t)
  float bc2_sqrt;    // sqrt(1 - beta2^t)
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
  MomentDType moment_dtype;
  // Slab offset of each piece's first element, then the slab size: where StepArgs::pieces'
  // buffers begin and end.
  std::span<const uint64_t> piece_starts;
};

// Calls fn(offset, count, grads, params) for each run of slab elements [offset, offset + count)
// that reads its gradients and writes its weights contiguously: the whole range at the flat
// buffers, or, with StepArgs::pieces, the range cut at the pieces' boundaries. `gsize` and
// `psize` are the gradient and model element sizes.
template <typename Fn>
void ForEachSegment(const StepArgs& args, std::span<const uint64_t> piece_starts, uint64_t offset,
                    uint64_t count, size_t gsize, size_t psize, Fn fn) {
  if (args.pieces.empty()) {
    fn(offset, count, static_cast<const std::byte*>(args.grads) + offset * gsize,
       static_cast<std::byte*>(args.params) + offset * psize);
    return;
  }
  size_t k = static_cast<size_t>(
      std::upper_bound(piece_starts.begin(), piece_starts.end(), offset) - piece_starts.begin()) -
             1;
  for (uint64_t at = offset, end = offset + count; at < end; ++k) {
    const uint64_t n = std::min(end, piece_starts[k + 1]) - at;
    const uint64_t within = at - piece_starts[k];
    fn(at, n, static_cast<const std::byte*>(args.pieces[k].grads) + within * gsize,
       static_cast<std::byte*>(args.pieces[k].params) + within * psize);
    at += n;
  }
}

// An update engine: the seam that tests and backends swap (CPU SIMD, CUDA streamed). Owned by
// one StagedAdamW; not thread-safe (one Step at a time, as the optimizer).
namespace internal {
class Engine {
 public:
  virtual ~Engine() = default;
  // Updates every unit; `constants` is indexed by group. REQUIRES: args validated.
  virtual absl::StatusOr<StepReport> Step(const StepArgs& args, const std::vector<Unit>& units,
                                          const std::vector<StepConstants>& constants,
                                          const SlabView& slabs, formats::DType model_dtype,
                                          uint64_t elements) = 0;
  // The check_finite pass of Step alone, over `units`: what a step split into several Step
  // calls (an async save's fence, optimizer/async_save.h) runs once before the first.
  virtual absl::StatusOr<StepReport> CheckFinite(const StepArgs& args,
                                                 const std::vector<Unit>& units,
                                                 const SlabView& slabs, uint64_t elements) = 0;
  // Orders what the caller queues next on args.stream after the writes of the last Step call
  // (once per StagedAdamW::Step, however many calls it took); no-op for the CPU engine.
  virtual absl::Status OrderCallerAfterStep(const StepArgs& args) {
    (void)args;
    return absl::OkStatus();
  }
  // Writes `elements` masters rounded to `model_dtype` (nearest even) into `dest`, in slab
  // order (StagedAdamW::WriteModelWeights; REQUIRES: arguments validated). `stream` unset:
  // `dest` is host memory, written once the last Step's copies have landed. Set (CUDA engine):
  // `dest` is device memory, written after the work queued on the stream so far, and what is
  // queued on it next runs after the writes.
  virtual absl::Status WriteWeights(const float* master, const std::vector<Unit>& units,
                                    formats::DType model_dtype, void* dest,
                                    const std::optional<CudaStreamView>& stream) = 0;
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
absl::StatusOr<std::unique_ptr<internal::Engine>> NewCudaEngine(const StagedAdamWOptions& options,
                                                                const std::vector<Unit>& units);

}  // namespace ckpt::optimizer

#endif  // CKPT_OPTIMIZER_ENGINE_H_
