// The CUDA streamed engine's class, shared by its files (built only with CUDA; not part of the
// API): optimizer/cuda/cuda_engine.cc opens with the pipeline's numbered steps and holds the step
// (Step, StepMatrix, WriteWeights, Barrier and the checks), optimizer/cuda/cuda_engine_slots.cc
// the slots' device resources (Restore, Release, Synchronize) and the per-unit events of a gated
// step, optimizer/cuda/cuda_engine_factory.cc the factory (NewCudaEngineImpl) and the pinning of
// host memory.
#ifndef CKPT_OPTIMIZER_CUDA_CUDA_ENGINE_IMPL_H_
#define CKPT_OPTIMIZER_CUDA_CUDA_ENGINE_IMPL_H_

#include <cuda_runtime.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "optimizer/cuda/cublas_gemm.h"
#include "optimizer/cuda/cuda_resources.h"
#include "optimizer/engine.h"

namespace ckpt::optimizer::internal {

// One slot of the pipeline: device buffers for one unit's state twice over (the kernel reads
// the "in" copy and writes the "out" copy), its streams and its events.
struct Slot {
  DeviceBuffer master_in, m_in, v_in, master_out, m_out, v_out;
  DeviceBuffer x_in, x_out;  // max_exp_avg_sq; empty without it.
  DeviceBuffer muon;         // The orthogonalisation's scratch; empty without Muon groups.
  CublasGemm blas;           // Its products' cuBLAS handle; empty: ckpt's kernel.
  CudaStream h2d, compute, d2h;
  CudaEvent h2d_done, kernel_done, d2h_done;
  // A Muon matrix's: its master copied in, its momentum written (StepMatrix).
  CudaEvent master_in_done, momentum_done;
};

// Whether CudaEngine::CopyRanges may batch: not with CKPT_CUDA_BATCH_COPIES=off (a driver whose
// batches misbehave, or a measurement of the difference).
bool BatchCopiesAllowed();

// The engine of optimizer/cuda/cuda_engine.cc's protocol. It owns its slots, streams, events
// and device buffers; the slabs are the optimizer's. Not thread-safe: the optimizer calls it
// from one thread at a time.
class CudaEngine : public internal::Engine {
 public:
  CudaEngine(int slots, uint64_t unit_elems, uint64_t second_moment_elems, MomentDType moments,
             bool max_slab, uint64_t muon_scratch, uint64_t muon_scratch_blas)
      : slot_count_(slots),
        unit_elems_(unit_elems),
        v_elems_(second_moment_elems),
        moments_(moments),
        max_slab_(max_slab),
        muon_scratch_own_(muon_scratch),
        muon_scratch_blas_(muon_scratch_blas) {}
  ~CudaEngine() override { Release().IgnoreError(); }  // Destructors never report.

  // The slots' resources (optimizer/cuda/cuda_engine_slots.cc).
  absl::Status Restore() override;
  absl::Status Release() override;
  absl::Status Synchronize() override;
  uint64_t device_bytes() const override { return device_bytes_; }
  // "cuda-2slots", and where Muon's products run when it has Muon groups ("-muon-cublas" or
  // "-muon-ckpt-wmma").
  std::string name() const override;
  bool wants_pinned_slabs() const override { return true; }
  bool queues_only() const override { return true; }

  // The pipeline (optimizer/cuda/cuda_engine.cc).
  absl::StatusOr<StepReport> Step(const StepArgs& args, const std::vector<Unit>& units,
                                  const StepPlan& plan, const SlabView& slabs,
                                  uint64_t elements) override;
  absl::Status WriteWeights(const SlabView& slabs, const std::vector<Unit>& units,
                            const StepArgs& dest,
                            const std::optional<CudaStreamView>& stream) override;
  absl::Status Barrier() override;
  absl::Status OrderCallerAfterStep(const StepArgs& args) override;
  absl::StatusOr<StepReport> CheckFinite(const StepArgs& args, const std::vector<Unit>& units,
                                         const StepPlan& plan, const SlabView& slabs,
                                         uint64_t elements) override;

  // A gated step's per-unit events (optimizer/cuda/cuda_engine_slots.cc).
  absl::Status PrepareUnitEvents(size_t units) override;
  absl::Status RecordUnitReady(uint32_t u, CudaStreamView stream) override;
  absl::StatusOr<bool> UnitReady(uint32_t u) override { return Query(ready_events_, u); }
  absl::StatusOr<bool> UnitWritten(uint32_t u) override { return Query(unit_events_, u); }
  absl::Status OrderCallerAfterUnit(uint32_t u, CudaStreamView stream) override;

 private:
  // Whether events[u]'s last record has run (true when it has none).
  static absl::StatusOr<bool> Query(const std::vector<CudaEvent>& events, uint32_t u);

  // One AdamW unit in slot `s` (the `k`-th unit of the call, the `i`-th of its units): steps 1
  // to 3 of the protocol.
  absl::Status StepUnit(const StepArgs& args, const Unit& u, size_t i, const StepPlan& plan,
                        const SlabView& slabs, size_t gsize, size_t mbytes, Slot& s, size_t k);
  // Step 2's kernels of one AdamW unit in slot `s`, on its compute stream.
  cudaError_t LaunchUnit(const StepArgs& args, const Unit& u, const StepPlan& plan,
                         const SlabView& slabs, size_t gsize, size_t mbytes, Slot& s);
  // One Muon matrix in slot `s` (the `k`-th unit of the call).
  absl::Status StepMatrix(const StepArgs& args, const Unit& u, const StepPlan& plan,
                          const SlabView& slabs, size_t gsize, size_t mbytes, Slot& s, size_t k);
  // Copies `n` ranges in stream order on `stream`, batched where the runtime can.
  cudaError_t CopyRanges(void* const* dsts, const void* const* srcs, const size_t* sizes,
                         size_t n, cudaStream_t stream);
  // Every slot's copy-in after every slot's last copy-out (step 0).
  absl::Status OrderCopyInsAfterCopyOuts();
  // `done` once every slot's last kernel has run (its writes of the parameters).
  absl::Status RecordDoneAfterKernels();
  // A skipped run of a unit in slot `s`: its state leaves as it came.
  cudaError_t CopyThrough(Slot& s, uint64_t at, uint64_t count, size_t mbytes);
  absl::StatusOr<uint64_t> CountNonFinite(const StepArgs& args, const StepPlan& plan,
                                          const SlabView& slabs, uint64_t elements);

  const int slot_count_;
  const uint64_t unit_elems_;  // The largest unit: master and exp_avg (Muon's momentum) buffers.
  const uint64_t v_elems_;     // The largest AdamW unit: exp_avg_sq (and max_exp_avg_sq) buffers.
  const MomentDType moments_;
  const bool max_slab_;
  // Muon's scratch per slot for its products on ckpt's kernel and on cuBLAS; 0 without Muon.
  const uint64_t muon_scratch_own_, muon_scratch_blas_;
  uint64_t muon_scratch_ = 0;  // What Restore allocated per slot.
  std::string products_;       // Where Muon's products run, for name(): "-muon-cublas".
  uint64_t device_bytes_ = 0;
  bool batch_copies_ = BatchCopiesAllowed();  // CopyRanges.
  size_t next_slot_ = 0;  // Where the next call's first unit runs.
  DeviceBuffer counter_;
  CudaEvent grads_ready_, done_;
  CudaStream join_;
  std::vector<Slot> slots_;
  // Per unit, when a gated overlapped step asked for them: its weights written, and its
  // gradients final (its Release).
  std::vector<CudaEvent> unit_events_, ready_events_;
};

}  // namespace ckpt::optimizer::internal

#endif  // CKPT_OPTIMIZER_CUDA_CUDA_ENGINE_IMPL_H_
