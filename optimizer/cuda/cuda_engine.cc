// The CUDA streamed engine.
//
// Each of `slot_count` slots owns device buffers for one unit's state twice over (the kernel
// reads the "in" copy and writes the "out" copy) and three streams: copy-in (Muon matrices and
// WriteWeights), compute, copy-out. The k-th unit of a Step call runs in slot (first + k) % S,
// `first` the slot after the previous call's last (an overlapped step makes many calls of a
// unit or two):
// 0. once per call, each slot's copy-in and compute streams wait for every slot's last copy-out
//    (d2h_done): a unit may run in another slot than in the previous call (a fenced step passes
//    its units in batches), so this orders its copy-in after its previous copy-out whichever
//    slot ran it.
// 1. compute stream, in its order after the slot's previous kernel (the last reader of the
//    in-buffers): copy master, exp_avg, exp_avg_sq (and max_exp_avg_sq when the slabs hold it)
//    host -> in-buffers.
// 2. compute stream: wait for the slot's previous copy-out to have drained the out-buffers
//    (d2h_done), and (once per step) for the caller's stream (grads_ready: the first gradient
//    read happens after whatever wrote the gradients); run the fused kernel (one launch for up
//    to kMaxSegments runs of the unit), which reads the gradient and writes the model-dtype
//    weights in place in device memory; record kernel_done.
// 3. copy-out stream: wait for kernel_done; copy out-buffers -> host slabs; record d2h_done.
// Slot reuse is gated by stream order and these device events, never by the host. With
// separate in- and out-buffers, unit k+S's copy-in follows unit k's kernel at once while unit
// k's copy-out runs, so both PCIe directions stay busy. Copying in on the compute stream spares
// the events a copy-in stream of its own would need: a unit costs the host 8 runtime calls or
// 9 (an overlapped step queues them from backward's thread, whose calls a host-bound backward
// waits for). A join stream waits for every slot's last kernel and records the
// `done` event the caller's stream must wait on before reading parameters. Step never blocks
// the host (except to read the non-finite count when check_finite asks for it). Device memory
// is 2 x slot_count x unit_bytes x (1 + k x moment bytes / 4), whatever the model size (k = 2,
// or 3 with AMSGrad's max_exp_avg_sq).
//
// A Muon unit (Unit::rows set: one whole matrix) takes the same three steps with its master and
// momentum (the exp_avg slab) only, copied in on the copy-in stream (after kernel_done; the
// master lands while the orthogonalisation runs), and in step 2 the matrix's whole step
// (muon_kernel.h) in the slot's Muon scratch, which is sized for the largest Muon matrix of the
// layout (with the in/out buffers, sized by the largest unit, which such a matrix is):
// MuonScratchBytes(rows, cols) per slot, about 4 x m x n + 4 x m x m bytes (m <= n its sides).
// Its products run on cuBLAS when the process can load it (cublas_gemm.h), on ckpt's own kernel
// otherwise; one handle per slot (its compute stream's), used from the thread that calls Step.
//
// The exp_avg_sq (and max_exp_avg_sq) buffers are sized by the largest AdamW unit only: a Muon
// matrix has none.
//
// Teardown order: Release() synchronises every stream before any buffer, event or stream goes;
// members are declared so that streams are destroyed before the buffers they used.
//
// This file holds the pipeline: Step (steps 0 to 3 per unit, StepUnit for an AdamW unit and
// StepMatrix for a Muon matrix), WriteWeights, Barrier and the non-finite check. The class is
// declared in optimizer/cuda/cuda_engine_impl.h; the slots' resources (Restore, Release,
// Synchronize) and a gated step's per-unit events are in optimizer/cuda/cuda_engine_slots.cc, the
// factory in optimizer/cuda/cuda_engine_factory.cc.
#include "optimizer/cuda/cuda_engine_impl.h"

#include <cstdlib>
#include <string_view>

#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"
#include "ckpt/base/status_macros.h"
#include "ckpt/formats/convert.h"
#include "optimizer/cuda/adamw_kernel.h"
#include "optimizer/cuda/cuda_check.h"
#include "optimizer/cuda/cuda_resources.h"
#include "optimizer/cuda/muon_kernel.h"
#include "optimizer/rules/muon/muon.h"

namespace ckpt::optimizer::internal {
namespace {

KernelType ToKernelType(formats::DType d) {
  return d == formats::DType::kF32    ? KernelType::kF32
         : d == formats::DType::kBF16 ? KernelType::kBF16
                                      : KernelType::kF16;
}

}  // namespace

bool BatchCopiesAllowed() {
  const char* value = std::getenv("CKPT_CUDA_BATCH_COPIES");
  return value == nullptr || std::string_view(value) != "off";
}

absl::StatusOr<StepReport> CudaEngine::Step(const StepArgs& args, const std::vector<Unit>& units,
                                            const StepPlan& plan, const SlabView& slabs,
                                            uint64_t elements) {
  if (slots_.empty())
    return absl::FailedPreconditionError("device released: call RestoreDevice() before Step");
  if (!args.stream.has_value()) {
    return absl::InvalidArgumentError(
        "the CUDA engine needs the caller's stream (StepArgs::stream)");
  }
  cudaStream_t caller = ToCudaStream(*args.stream);
  StepReport report;
  CKPT_CUDA_RETURN_IF_ERROR(cudaEventRecord(grads_ready_.get(), caller));
  if (args.check_finite && elements > 0) {
    CKPT_ASSIGN_OR_RETURN(uint64_t bad, CountNonFinite(args, plan, slabs, elements));
    if (bad > 0) {
      report.skipped = true;
      report.nonfinite = bad;
      return report;
    }
  }
  const size_t gsize = formats::DTypeSize(args.grad_dtype);
  const size_t mbytes = MomentBytes(moments_);
  if (!plan.continues) CKPT_RETURN_IF_ERROR(OrderCopyInsAfterCopyOuts());
  size_t k = 0;  // Units sent to the slots so far.
  if (!plan.unit_ids.empty() && plan.unit_ids.size() != units.size())
    return absl::InternalError("unit_ids not parallel to the units");
  for (size_t i = 0; i < units.size(); ++i) {
    const Unit& u = units[i];
    // A unit whose pieces all have no gradient this step is neither copied nor updated.
    bool active = false;
    ForEachSegment(args, slabs, plan, u.offset, u.count, gsize,
                   [&](uint64_t, uint64_t, const std::byte*, std::byte*, uint32_t c,
                       formats::DType) { active |= c != StepPlan::kSkipped; });
    if (!active) continue;
    Slot& s = slots_[(next_slot_ + k) % slots_.size()];
    if (u.rows != 0) {
      CKPT_RETURN_IF_ERROR(StepMatrix(args, u, plan, slabs, gsize, mbytes, s, k));
    } else {
      CKPT_RETURN_IF_ERROR(StepUnit(args, u, i, plan, slabs, gsize, mbytes, s, k));
    }
    ++k;
  }
  // The next call goes on from the next slot: an overlapped step's calls of one unit each
  // would otherwise all run in slot 0, each waiting for the one before.
  next_slot_ = (next_slot_ + k) % slots_.size();
  if (plan.barrier_later) return report;  // Barrier records `done`.
  // Parameters are ready once every slot's last kernel has run; the slabs once every copy-out
  // has (Synchronize waits for those).
  CKPT_RETURN_IF_ERROR(RecordDoneAfterKernels());
  report.done = reinterpret_cast<CUevent_st*>(done_.get());
  return report;
}

absl::Status CudaEngine::StepUnit(const StepArgs& args, const Unit& u, size_t i,
                                  const StepPlan& plan, const SlabView& slabs, size_t gsize,
                                  size_t mbytes, Slot& s, size_t k) {
  float* master = slabs.master + u.offset;
  std::byte* m = slabs.exp_avg + u.offset * mbytes;
  std::byte* v = slabs.exp_avg_sq + u.offset * mbytes;
  std::byte* x = max_slab_ ? slabs.max_exp_avg_sq + u.offset * mbytes : nullptr;
  // Where the copy-out goes: the same slabs, or the spare side of an out-of-place pass.
  float* master_dest = slabs.dest_master() + u.offset;
  std::byte* m_dest = slabs.dest_exp_avg() + u.offset * mbytes;
  std::byte* v_dest = slabs.dest_exp_avg_sq() + u.offset * mbytes;
  std::byte* x_dest = max_slab_ ? slabs.dest_max_exp_avg_sq() + u.offset * mbytes : nullptr;
  // 1. Copy-in, on the compute stream: after the slot's previous kernel (stream order), the
  // last reader of the in-buffers.
  const size_t copies = max_slab_ ? 4 : 3;
  const size_t sizes[4] = {u.count * 4, u.count * mbytes, u.count * mbytes, u.count * mbytes};
  {
    void* const dsts[4] = {s.master_in.data(), s.m_in.data(), s.v_in.data(), s.x_in.data()};
    const void* const srcs[4] = {master, m, v, x};
    CKPT_CUDA_RETURN_IF_ERROR(CopyRanges(dsts, srcs, sizes, copies, s.compute.get()));
  }
  // 2. Compute.
  CKPT_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(s.compute.get(), s.d2h_done.get(), 0));
  if (plan.wait_unit_ready && !plan.unit_ids.empty()) {  // A gated step's: its Release.
    const uint32_t id = plan.unit_ids[i];
    if (id >= ready_events_.size())
      return absl::InternalError("a ready event that PrepareUnitEvents did not make");
    CKPT_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(s.compute.get(), ready_events_[id].get(), 0));
  } else if (k < slots_.size()) {
    CKPT_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(s.compute.get(), grads_ready_.get(), 0));
  }
  const cudaError_t launched = LaunchUnit(args, u, plan, slabs, gsize, mbytes, s);
  CKPT_CUDA_RETURN_IF_ERROR(launched);
  CKPT_CUDA_RETURN_IF_ERROR(cudaEventRecord(s.kernel_done.get(), s.compute.get()));
  if (!plan.unit_ids.empty()) {  // A gate's: this unit's weights are written.
    const uint32_t id = plan.unit_ids[i];
    if (id >= unit_events_.size())
      return absl::InternalError("a unit event that PrepareUnitEvents did not make");
    CKPT_CUDA_RETURN_IF_ERROR(cudaEventRecord(unit_events_[id].get(), s.compute.get()));
  }
  // 3. Copy-out.
  CKPT_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(s.d2h.get(), s.kernel_done.get(), 0));
  {
    void* const dsts[4] = {master_dest, m_dest, v_dest, x_dest};
    const void* const srcs[4] = {s.master_out.data(), s.m_out.data(), s.v_out.data(),
                                 s.x_out.data()};
    CKPT_CUDA_RETURN_IF_ERROR(CopyRanges(dsts, srcs, sizes, copies, s.d2h.get()));
  }
  CKPT_CUDA_RETURN_IF_ERROR(cudaEventRecord(s.d2h_done.get(), s.d2h.get()));
  return absl::OkStatus();
}

// The runs of the unit whose gradients and weights are contiguous and whose constants are the
// same (ForEachSegment), up to kMaxSegments of one weight type per launch; a skipped run's
// state is copied through as is.
cudaError_t CudaEngine::LaunchUnit(const StepArgs& args, const Unit& u, const StepPlan& plan,
                                   const SlabView& slabs, size_t gsize, size_t mbytes, Slot& s) {
  DeviceUnitArgs a{static_cast<const float*>(s.master_in.data()),
                   s.m_in.data(),
                   s.v_in.data(),
                   static_cast<float*>(s.master_out.data()),
                   s.m_out.data(),
                   s.v_out.data(),
                   max_slab_ ? s.x_in.data() : nullptr,
                   max_slab_ ? s.x_out.data() : nullptr,
                   args.grad_scale,
                   0,
                   {}};
  formats::DType batch_dtype = formats::DType::kF32;
  const KernelType moment_type =
      moments_ == MomentDType::kF32 ? KernelType::kF32 : KernelType::kBF16;
  auto launch = [&]() -> cudaError_t {
    if (a.segments == 0) return cudaSuccess;
    const cudaError_t e = LaunchAdamwUnit(a, ToKernelType(args.grad_dtype),
                                          ToKernelType(batch_dtype), moment_type,
                                          s.compute.get());
    a.segments = 0;
    return e;
  };
  cudaError_t launched = cudaSuccess;
  ForEachSegment(
      args, slabs, plan, u.offset, u.count, gsize,
      [&](uint64_t offset, uint64_t count, const std::byte* grads, std::byte* params,
          uint32_t ci, formats::DType model_dtype) {
        if (launched != cudaSuccess) return;
        const uint64_t at = offset - u.offset;
        if (ci == StepPlan::kSkipped) {  // Disjoint from the batched runs: any order.
          launched = CopyThrough(s, at, count, mbytes);
          return;
        }
        if (a.segments == kMaxSegments || (a.segments > 0 && model_dtype != batch_dtype)) {
          launched = launch();
          if (launched != cudaSuccess) return;
        }
        batch_dtype = model_dtype;
        const StepConstants& c = plan.constants[ci];
        a.segment[a.segments++] = DeviceSegment{
            grads, params, at, count,
            KernelConstants{c.beta1, c.beta2, c.eps, c.decay, c.omb1, c.omb2, c.step_size,
                            c.bc2_sqrt, c.amsgrad ? 1 : 0}};
      });
  if (launched == cudaSuccess) launched = launch();
  return launched;
}

// WriteWeights to device memory runs steps 0 to 2 of a Step with the rounding kernel in place
// of the update, and only the masters copied in: the caller's stream then waits for `done`.
absl::Status CudaEngine::WriteWeights(const SlabView& slabs, const std::vector<Unit>& units,
                                      const StepArgs& dest,
                                      const std::optional<CudaStreamView>& stream) {
  StepPlan every;  // Every piece, at constants 0 (not read).
  every.piece_constants.assign(slabs.piece_dtypes.size(), 0);
  if (!stream.has_value()) {
    CKPT_RETURN_IF_ERROR(Synchronize());  // The last step's masters have landed.
    for (const Unit& u : units) {
      ForEachSegment(dest, slabs, every, u.offset, u.count, 0,
                     [&](uint64_t offset, uint64_t count, const std::byte*, std::byte* params,
                         uint32_t, formats::DType dtype) {
                       formats::Convert(
                           formats::DType::kF32,
                           std::as_bytes(std::span(slabs.master + offset, count)), dtype,
                           std::span(params, count * formats::DTypeSize(dtype)));
                     });
    }
    return absl::OkStatus();
  }
  if (slots_.empty()) {
    return absl::FailedPreconditionError(
        "device released: call RestoreDevice() before WriteModelWeights");
  }
  cudaStream_t caller = ToCudaStream(*stream);
  CKPT_CUDA_RETURN_IF_ERROR(cudaEventRecord(grads_ready_.get(), caller));
  CKPT_RETURN_IF_ERROR(OrderCopyInsAfterCopyOuts());
  for (size_t k = 0; k < units.size(); ++k) {
    const Unit& u = units[k];
    Slot& s = slots_[(next_slot_ + k) % slots_.size()];
    CKPT_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(s.h2d.get(), s.kernel_done.get(), 0));
    CKPT_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(s.master_in.data(), slabs.master + u.offset,
                                              u.count * 4, cudaMemcpyHostToDevice, s.h2d.get()));
    CKPT_CUDA_RETURN_IF_ERROR(cudaEventRecord(s.h2d_done.get(), s.h2d.get()));
    CKPT_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(s.compute.get(), s.h2d_done.get(), 0));
    if (k < slots_.size())
      CKPT_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(s.compute.get(), grads_ready_.get(), 0));
    cudaError_t launched = cudaSuccess;
    ForEachSegment(dest, slabs, every, u.offset, u.count, 0,
                   [&](uint64_t offset, uint64_t count, const std::byte*, std::byte* params,
                       uint32_t, formats::DType dtype) {
                     if (launched != cudaSuccess) return;
                     launched = LaunchRoundMasters(
                         static_cast<const float*>(s.master_in.data()) + (offset - u.offset),
                         params, ToKernelType(dtype), count, s.compute.get());
                   });
    CKPT_CUDA_RETURN_IF_ERROR(launched);
    CKPT_CUDA_RETURN_IF_ERROR(cudaEventRecord(s.kernel_done.get(), s.compute.get()));
  }
  next_slot_ = (next_slot_ + units.size()) % slots_.size();
  CKPT_RETURN_IF_ERROR(RecordDoneAfterKernels());
  CKPT_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(caller, done_.get(), 0));
  // The masters copied in above are read until the kernels ran: a later step's copy-out of
  // a unit, in whichever slot a fenced step puts it, waits for that.
  for (Slot& s : slots_)
    CKPT_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(s.d2h.get(), done_.get(), 0));
  return absl::OkStatus();
}

// One Muon matrix in slot `s` (the `k`-th unit of the call): steps 1 to 3 with the master and
// the momentum only, each moved on its own: the momentum goes in first (the orthogonalisation
// starts from it) and out as soon as it is written; the master goes in behind it (read only by
// the last kernel) and out last. The first matrix's compute then waits for half its bytes, and
// the last one's drain moves half of them.
absl::Status CudaEngine::StepMatrix(const StepArgs& args, const Unit& u, const StepPlan& plan,
                                    const SlabView& slabs, size_t gsize, size_t mbytes, Slot& s,
                                    size_t k) {
  if (!s.muon.valid()) return absl::InternalError("a Muon unit without Muon scratch");
  if (slabs.out_of_place())
    return absl::InternalError("an out-of-place pass over Muon matrices");  // Refused before.
  float* master = slabs.master + u.offset;
  std::byte* momentum = slabs.exp_avg + u.offset * mbytes;
  CKPT_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(s.h2d.get(), s.kernel_done.get(), 0));
  CKPT_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(s.m_in.data(), momentum, u.count * mbytes,
                                            cudaMemcpyHostToDevice, s.h2d.get()));
  CKPT_CUDA_RETURN_IF_ERROR(cudaEventRecord(s.h2d_done.get(), s.h2d.get()));
  CKPT_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(s.master_in.data(), master, u.count * 4,
                                            cudaMemcpyHostToDevice, s.h2d.get()));
  CKPT_CUDA_RETURN_IF_ERROR(cudaEventRecord(s.master_in_done.get(), s.h2d.get()));
  CKPT_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(s.compute.get(), s.h2d_done.get(), 0));
  CKPT_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(s.compute.get(), s.d2h_done.get(), 0));
  if (k < slots_.size())
    CKPT_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(s.compute.get(), grads_ready_.get(), 0));
  // A Muon unit is one piece: one segment.
  cudaError_t launched = cudaSuccess;
  ForEachSegment(
      args, slabs, plan, u.offset, u.count, gsize,
      [&](uint64_t, uint64_t count, const std::byte* grads, std::byte* params, uint32_t ci,
          formats::DType model_dtype) {
        if (launched != cudaSuccess) return;
        if (ci == StepPlan::kSkipped) {  // Not reached: a skipped matrix is an inactive unit.
          launched = cudaErrorInvalidValue;
          return;
        }
        const MuonConstants& c = plan.constants[ci].muon;
        const uint64_t cols = count / u.rows;
        MuonDeviceArgs a{static_cast<const float*>(s.master_in.data()),
                         static_cast<float*>(s.master_out.data()),
                         s.m_in.data(),
                         s.m_out.data(),
                         grads,
                         params,
                         args.grad_scale,
                         u.rows,
                         cols,
                         s.muon.data(),
                         MuonKernelConstants{c.lerp_weight, c.nesterov_weight, c.nesterov ? 1 : 0,
                                             c.decay, -MuonAdjustedLr(c, u.rows, cols), c.a,
                                             c.b, c.c, c.eps, c.ns_steps},
                         s.blas.backend(),
                         s.momentum_done.get(),
                         s.master_in_done.get()};
        launched = LaunchMuonMatrix(
            a, ToKernelType(args.grad_dtype), ToKernelType(model_dtype),
            moments_ == MomentDType::kF32 ? KernelType::kF32 : KernelType::kBF16,
            s.compute.get());
      });
  CKPT_CUDA_RETURN_IF_ERROR(launched);
  CKPT_CUDA_RETURN_IF_ERROR(cudaEventRecord(s.kernel_done.get(), s.compute.get()));
  CKPT_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(s.d2h.get(), s.momentum_done.get(), 0));
  CKPT_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(momentum, s.m_out.data(), u.count * mbytes,
                                            cudaMemcpyDeviceToHost, s.d2h.get()));
  CKPT_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(s.d2h.get(), s.kernel_done.get(), 0));
  CKPT_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(master, s.master_out.data(), u.count * 4,
                                            cudaMemcpyDeviceToHost, s.d2h.get()));
  CKPT_CUDA_RETURN_IF_ERROR(cudaEventRecord(s.d2h_done.get(), s.d2h.get()));
  return absl::OkStatus();
}

absl::Status CudaEngine::Barrier() {
  if (slots_.empty()) return absl::OkStatus();
  CKPT_RETURN_IF_ERROR(RecordDoneAfterKernels());
  for (Slot& s : slots_)
    CKPT_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(s.compute.get(), done_.get(), 0));
  return absl::OkStatus();
}

absl::Status CudaEngine::OrderCallerAfterStep(const StepArgs& args) {
  // What the caller queues next (reading the parameters) runs after the step's last write.
  CKPT_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(ToCudaStream(*args.stream), done_.get(), 0));
  return absl::OkStatus();
}

absl::StatusOr<StepReport> CudaEngine::CheckFinite(const StepArgs& args,
                                                   const std::vector<Unit>& units,
                                                   const StepPlan& plan, const SlabView& slabs,
                                                   uint64_t elements) {
  (void)units;  // The count runs over every element at once.
  if (slots_.empty())
    return absl::FailedPreconditionError("device released: call RestoreDevice() before Step");
  if (!args.stream.has_value()) {
    return absl::InvalidArgumentError(
        "the CUDA engine needs the caller's stream (StepArgs::stream)");
  }
  StepReport report;
  if (elements == 0) return report;
  CKPT_CUDA_RETURN_IF_ERROR(cudaEventRecord(grads_ready_.get(), ToCudaStream(*args.stream)));
  CKPT_ASSIGN_OR_RETURN(report.nonfinite, CountNonFinite(args, plan, slabs, elements));
  report.skipped = report.nonfinite > 0;
  return report;
}

// Copies `n` ranges in stream order on `stream`: in one call where the runtime batches copies
// (cudaMemcpyBatchAsync, CUDA 13's signature), else one cudaMemcpyAsync each. A unit's state
// is three or four ranges each way, and an overlapped step queues its units from backward's
// own thread: one call instead of n is host time backward gets back. Batches stop at the
// runtime's first refusal (an older driver), and with CKPT_CUDA_BATCH_COPIES=off.
cudaError_t CudaEngine::CopyRanges(void* const* dsts, const void* const* srcs,
                                   const size_t* sizes, size_t n, cudaStream_t stream) {
#if CUDART_VERSION >= 13000
  if (batch_copies_) {
    cudaMemcpyAttributes attributes{};
    attributes.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    size_t first = 0;  // The attributes apply from the first copy on.
    cudaError_t e = cudaMemcpyBatchAsync(dsts, srcs, sizes, n, &attributes, &first, 1, stream);
    if (e != cudaErrorNotSupported && e != cudaErrorInvalidValue) return e;
    cudaGetLastError();  // Cleared: the copies go one by one from now on.
    batch_copies_ = false;
  }
#endif
  for (size_t i = 0; i < n; ++i) {
    cudaError_t e = cudaMemcpyAsync(dsts[i], srcs[i], sizes[i], cudaMemcpyDefault, stream);
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

// A unit's copy-in must see the previous call's copy-out of the same unit. That ran in the
// same slot when every step passes every unit in order, but a step an async save fences
// (StagedAdamW::StepUnits) passes its units in batches, so a unit may change slots between
// calls: every slot's copy-in waits for every slot's last copy-out, once per call.
absl::Status CudaEngine::OrderCopyInsAfterCopyOuts() {
  for (Slot& s : slots_) {
    for (Slot& previous : slots_) {
      // Copy-ins run on both: a Muon matrix's and WriteWeights' on h2d, an AdamW unit's on
      // compute.
      CKPT_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(s.h2d.get(), previous.d2h_done.get(), 0));
      CKPT_CUDA_RETURN_IF_ERROR(
          cudaStreamWaitEvent(s.compute.get(), previous.d2h_done.get(), 0));
    }
  }
  return absl::OkStatus();
}

// `done` once every slot's last kernel has run (its writes of the parameters).
absl::Status CudaEngine::RecordDoneAfterKernels() {
  for (Slot& s : slots_)
    CKPT_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(join_.get(), s.kernel_done.get(), 0));
  CKPT_CUDA_RETURN_IF_ERROR(cudaEventRecord(done_.get(), join_.get()));
  return absl::OkStatus();
}

// A skipped run of a unit in slot `s`: its state leaves as it came, in-buffers to out-buffers
// on the compute stream.
cudaError_t CudaEngine::CopyThrough(Slot& s, uint64_t at, uint64_t count, size_t mbytes) {
  const std::pair<const DeviceBuffer*, const DeviceBuffer*> bufs[] = {
      {&s.master_in, &s.master_out},
      {&s.m_in, &s.m_out},
      {&s.v_in, &s.v_out},
      {&s.x_in, &s.x_out}};
  for (const auto& [in, out] : bufs) {
    if (in->data() == nullptr) continue;  // No max_exp_avg_sq.
    const size_t size = in == &s.master_in ? 4 : mbytes;
    cudaError_t e = cudaMemcpyAsync(static_cast<std::byte*>(out->data()) + at * size,
                                    static_cast<const std::byte*>(in->data()) + at * size,
                                    count * size, cudaMemcpyDeviceToDevice, s.compute.get());
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

absl::StatusOr<uint64_t> CudaEngine::CountNonFinite(const StepArgs& args, const StepPlan& plan,
                                                    const SlabView& slabs, uint64_t elements) {
  cudaStream_t s = join_.get();
  auto* count = static_cast<unsigned long long*>(counter_.data());
  CKPT_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(s, grads_ready_.get(), 0));
  CKPT_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(count, 0, sizeof(*count), s));
  cudaError_t launched = cudaSuccess;
  ForEachSegment(args, slabs, plan, 0, elements, formats::DTypeSize(args.grad_dtype),
                 [&](uint64_t, uint64_t n, const std::byte* grads, std::byte*, uint32_t c,
                     formats::DType) {
                   if (launched == cudaSuccess && c != StepPlan::kSkipped) {
                     launched = LaunchCountNonFinite(grads, ToKernelType(args.grad_dtype), n,
                                                     args.grad_scale, count, s);
                   }
                 });
  CKPT_CUDA_RETURN_IF_ERROR(launched);
  unsigned long long host = 0;
  CKPT_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(&host, count, sizeof(host), cudaMemcpyDeviceToHost, s));
  CKPT_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));  // The skip decision needs the count.
  return static_cast<uint64_t>(host);
}

}  // namespace ckpt::optimizer::internal
