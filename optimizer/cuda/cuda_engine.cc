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
// MuonScratchBytes(rows, cols) per slot, about 4 x m x n + 4 x m x m bytes (m <= n its sides). Its products run on
// cuBLAS when the process can load it (cublas_gemm.h), on ckpt's own kernel otherwise; one
// handle per slot (its compute stream's), used from the thread that calls Step.
//
// The exp_avg_sq (and max_exp_avg_sq) buffers are sized by the largest AdamW unit only: a Muon
// matrix has none.
//
// Teardown order: Release() synchronises every stream before any buffer, event or stream goes;
// members are declared so that streams are destroyed before the buffers they used.
#include "optimizer/cuda/cuda_engine.h"

#include <cstdlib>
#include <string_view>

#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"
#include "ckpt/base/status_macros.h"
#include "ckpt/formats/convert.h"
#include "optimizer/cuda/adamw_kernel.h"
#include "optimizer/cuda/cublas_gemm.h"
#include "optimizer/cuda/cuda_check.h"
#include "optimizer/cuda/cuda_resources.h"
#include "optimizer/cuda/muon_kernel.h"
#include "optimizer/host_buffer.h"
#include "optimizer/rules/muon/muon.h"

namespace ckpt::optimizer::internal {
namespace {

KernelType ToKernelType(formats::DType d) {
  return d == formats::DType::kF32    ? KernelType::kF32
         : d == formats::DType::kBF16 ? KernelType::kBF16
                                      : KernelType::kF16;
}

// Whether CopyRanges may batch: not with CKPT_CUDA_BATCH_COPIES=off (a driver whose batches
// misbehave, or a measurement of the difference).
bool BatchCopiesAllowed() {
  const char* value = std::getenv("CKPT_CUDA_BATCH_COPIES");
  return value == nullptr || std::string_view(value) != "off";
}

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

  absl::Status Restore() override {
    if (!slots_.empty()) return absl::OkStatus();
    const size_t mbytes = MomentBytes(moments_);
    // Muon's products on cuBLAS when the process can load it (a handle per slot: cuBLAS repeats
    // its results only for one stream per handle), else on ckpt's kernel in every slot.
    std::vector<Slot> slots(static_cast<size_t>(slot_count_));
    bool blas = muon_scratch_own_ > 0;
    for (Slot& s : slots) {
      if (!blas) break;
      std::string why;
      s.blas = CublasGemm::Create(&why);
      blas = s.blas.valid();
    }
    if (!blas) {
      for (Slot& s : slots) s.blas = CublasGemm();
    }
    const uint64_t muon_scratch = blas ? muon_scratch_blas_ : muon_scratch_own_;
    for (Slot& s : slots) {
      CKPT_ASSIGN_OR_RETURN(s.master_in, DeviceBuffer::Create(unit_elems_ * 4));
      CKPT_ASSIGN_OR_RETURN(s.m_in, DeviceBuffer::Create(unit_elems_ * mbytes));
      CKPT_ASSIGN_OR_RETURN(s.v_in, DeviceBuffer::Create(v_elems_ * mbytes));
      CKPT_ASSIGN_OR_RETURN(s.master_out, DeviceBuffer::Create(unit_elems_ * 4));
      CKPT_ASSIGN_OR_RETURN(s.m_out, DeviceBuffer::Create(unit_elems_ * mbytes));
      CKPT_ASSIGN_OR_RETURN(s.v_out, DeviceBuffer::Create(v_elems_ * mbytes));
      if (max_slab_) {
        CKPT_ASSIGN_OR_RETURN(s.x_in, DeviceBuffer::Create(v_elems_ * mbytes));
        CKPT_ASSIGN_OR_RETURN(s.x_out, DeviceBuffer::Create(v_elems_ * mbytes));
      }
      if (muon_scratch > 0) {
        CKPT_ASSIGN_OR_RETURN(s.muon, DeviceBuffer::Create(muon_scratch));
      }
      CKPT_ASSIGN_OR_RETURN(s.h2d, CudaStream::Create());
      CKPT_ASSIGN_OR_RETURN(s.compute, CudaStream::Create());
      CKPT_ASSIGN_OR_RETURN(s.d2h, CudaStream::Create());
      CKPT_ASSIGN_OR_RETURN(s.h2d_done, CudaEvent::Create());
      CKPT_ASSIGN_OR_RETURN(s.kernel_done, CudaEvent::Create());
      CKPT_ASSIGN_OR_RETURN(s.d2h_done, CudaEvent::Create());
      if (muon_scratch > 0) {
        CKPT_ASSIGN_OR_RETURN(s.master_in_done, CudaEvent::Create());
        CKPT_ASSIGN_OR_RETURN(s.momentum_done, CudaEvent::Create());
      }
    }
    CKPT_ASSIGN_OR_RETURN(CudaStream join, CudaStream::Create());
    CKPT_ASSIGN_OR_RETURN(CudaEvent grads_ready, CudaEvent::Create());
    CKPT_ASSIGN_OR_RETURN(CudaEvent done, CudaEvent::Create());
    CKPT_ASSIGN_OR_RETURN(DeviceBuffer counter, DeviceBuffer::Create(sizeof(unsigned long long)));
    slots_ = std::move(slots);
    muon_scratch_ = muon_scratch;
    products_ = muon_scratch == 0 ? "" : blas ? "-muon-cublas" : "-muon-ckpt-wmma";
    join_ = std::move(join);
    grads_ready_ = std::move(grads_ready);
    done_ = std::move(done);
    counter_ = std::move(counter);
    device_bytes_ = static_cast<uint64_t>(slot_count_) * 2 *
                        (unit_elems_ * (4 + mbytes) + v_elems_ * (max_slab_ ? 2 : 1) * mbytes) +
                    static_cast<uint64_t>(slot_count_) * muon_scratch_ +
                    sizeof(unsigned long long);
    return absl::OkStatus();
  }

  absl::Status Release() override {
    absl::Status status;
    // Drain before anything is freed: buffers in flight belong to their streams.
    for (Slot& s : slots_) {
      for (const CudaStream* st : {&s.h2d, &s.compute, &s.d2h}) {
        if (st->valid())
          status.Update(CudaStatus(cudaStreamSynchronize(st->get()), "synchronize slot stream"));
      }
    }
    if (join_.valid())
      status.Update(CudaStatus(cudaStreamSynchronize(join_.get()), "synchronize join stream"));
    slots_.clear();
    unit_events_.clear();
    ready_events_.clear();
    next_slot_ = 0;
    join_ = CudaStream();
    grads_ready_ = CudaEvent();
    done_ = CudaEvent();
    counter_ = DeviceBuffer();
    device_bytes_ = 0;
    return status;
  }

  uint64_t device_bytes() const override { return device_bytes_; }
  // "cuda-2slots", and where Muon's products run when it has Muon groups ("-muon-cublas" or
  // "-muon-ckpt-wmma").
  std::string name() const override {
    return absl::StrCat("cuda-", slot_count_, "slots", products_);
  }
  bool wants_pinned_slabs() const override { return true; }

  absl::StatusOr<StepReport> Step(const StepArgs& args, const std::vector<Unit>& units,
                                  const StepPlan& plan, const SlabView& slabs,
                                  uint64_t elements) override {
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
        ++k;
        continue;
      }
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
        CKPT_CUDA_RETURN_IF_ERROR(
            cudaStreamWaitEvent(s.compute.get(), ready_events_[id].get(), 0));
      } else if (k < slots_.size()) {
        CKPT_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(s.compute.get(), grads_ready_.get(), 0));
      }
      // The runs of the unit whose gradients and weights are contiguous and whose constants are
      // the same (ForEachSegment), up to kMaxSegments of one weight type per launch; a skipped
      // run's state is copied through as is.
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

  // WriteWeights to device memory runs steps 0 to 2 of a Step with the rounding kernel in place
  // of the update, and only the masters copied in: the caller's stream then waits for `done`.
  absl::Status WriteWeights(const SlabView& slabs, const std::vector<Unit>& units,
                            const StepArgs& dest,
                            const std::optional<CudaStreamView>& stream) override {
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

  bool queues_only() const override { return true; }

  absl::Status PrepareUnitEvents(size_t units) override {
    if (unit_events_.size() == units) return absl::OkStatus();
    std::vector<CudaEvent> written, ready;
    written.reserve(units);
    ready.reserve(units);
    for (size_t i = 0; i < units; ++i) {
      CKPT_ASSIGN_OR_RETURN(CudaEvent w, CudaEvent::Create());
      CKPT_ASSIGN_OR_RETURN(CudaEvent r, CudaEvent::Create());
      written.push_back(std::move(w));
      ready.push_back(std::move(r));
    }
    unit_events_ = std::move(written);
    ready_events_ = std::move(ready);
    return absl::OkStatus();
  }

  absl::Status RecordUnitReady(uint32_t u, CudaStreamView stream) override {
    if (u >= ready_events_.size())
      return absl::InternalError("a ready event that PrepareUnitEvents did not make");
    CKPT_CUDA_RETURN_IF_ERROR(cudaEventRecord(ready_events_[u].get(), ToCudaStream(stream)));
    return absl::OkStatus();
  }

  absl::StatusOr<bool> UnitReady(uint32_t u) override { return Query(ready_events_, u); }

  absl::StatusOr<bool> UnitWritten(uint32_t u) override { return Query(unit_events_, u); }

  // Whether events[u]'s last record has run (true when it has none).
  static absl::StatusOr<bool> Query(const std::vector<CudaEvent>& events, uint32_t u) {
    if (u >= events.size()) return true;
    const cudaError_t e = cudaEventQuery(events[u].get());
    if (e == cudaErrorNotReady) {
      // Not an error, but the runtime keeps it as the last one: cleared, or the next caller of
      // cudaGetLastError (torch's launch checks) would take it for theirs.
      cudaGetLastError();
      return false;
    }
    CKPT_CUDA_RETURN_IF_ERROR(e);
    return true;
  }

  absl::Status OrderCallerAfterUnit(uint32_t u, CudaStreamView stream) override {
    if (u >= unit_events_.size()) return absl::OkStatus();  // Never recorded.
    CKPT_CUDA_RETURN_IF_ERROR(
        cudaStreamWaitEvent(ToCudaStream(stream), unit_events_[u].get(), 0));
    return absl::OkStatus();
  }

  // One Muon matrix in slot `s` (the `k`-th unit of the call): steps 1 to 3 with the master and
  // the momentum only, each moved on its own: the momentum goes in first (the orthogonalisation
  // starts from it) and out as soon as it is written; the master goes in behind it (read only by
  // the last kernel) and out last. The first matrix's compute then waits for half its bytes, and
  // the last one's drain moves half of them.
  absl::Status StepMatrix(const StepArgs& args, const Unit& u, const StepPlan& plan,
                          const SlabView& slabs, size_t gsize, size_t mbytes, Slot& s, size_t k) {
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

  absl::Status Barrier() override {
    if (slots_.empty()) return absl::OkStatus();
    CKPT_RETURN_IF_ERROR(RecordDoneAfterKernels());
    for (Slot& s : slots_)
      CKPT_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(s.compute.get(), done_.get(), 0));
    return absl::OkStatus();
  }

  absl::Status OrderCallerAfterStep(const StepArgs& args) override {
    // What the caller queues next (reading the parameters) runs after the step's last write.
    CKPT_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(ToCudaStream(*args.stream), done_.get(), 0));
    return absl::OkStatus();
  }

  absl::StatusOr<StepReport> CheckFinite(const StepArgs& args, const std::vector<Unit>& units,
                                         const StepPlan& plan, const SlabView& slabs,
                                         uint64_t elements) override {
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

  absl::Status Synchronize() override {
    for (Slot& s : slots_) CKPT_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s.d2h.get()));
    if (join_.valid()) CKPT_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(join_.get()));
    return absl::OkStatus();
  }

 private:
  // Copies `n` ranges in stream order on `stream`: in one call where the runtime batches copies
  // (cudaMemcpyBatchAsync, CUDA 13's signature), else one cudaMemcpyAsync each. A unit's state
  // is three or four ranges each way, and an overlapped step queues its units from backward's
  // own thread: one call instead of n is host time backward gets back. Batches stop at the
  // runtime's first refusal (an older driver), and with CKPT_CUDA_BATCH_COPIES=off.
  cudaError_t CopyRanges(void* const* dsts, const void* const* srcs, const size_t* sizes,
                         size_t n, cudaStream_t stream) {
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
  absl::Status OrderCopyInsAfterCopyOuts() {
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
  absl::Status RecordDoneAfterKernels() {
    for (Slot& s : slots_)
      CKPT_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(join_.get(), s.kernel_done.get(), 0));
    CKPT_CUDA_RETURN_IF_ERROR(cudaEventRecord(done_.get(), join_.get()));
    return absl::OkStatus();
  }

  // A skipped run of a unit in slot `s`: its state leaves as it came, in-buffers to out-buffers
  // on the compute stream.
  cudaError_t CopyThrough(Slot& s, uint64_t at, uint64_t count, size_t mbytes) {
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

  absl::StatusOr<uint64_t> CountNonFinite(const StepArgs& args, const StepPlan& plan,
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

}  // namespace

absl::StatusOr<std::unique_ptr<internal::Engine>> NewCudaEngineImpl(
    const StagedAdamWOptions& options, const std::vector<Unit>& units, bool max_slab) {
  int devices = 0;
  absl::Status counted = CudaStatus(cudaGetDeviceCount(&devices), "no usable CUDA device");
  if (!counted.ok()) return absl::FailedPreconditionError(counted.message());
  if (devices == 0) return absl::FailedPreconditionError("no CUDA device visible");
  if (options.slot_count < 1) return absl::InvalidArgumentError("slot_count must be at least 1");
  // Device buffers are sized by the units the layout actually cut, so they can never be
  // smaller than a unit whatever rule cut them.
  uint64_t unit_elems = 1;
  uint64_t muon_scratch = 0;  // Sized for the largest Muon matrix, on ckpt's kernel or cuBLAS.
  uint64_t muon_scratch_blas = 0;
  uint64_t adamw_elems = 1;   // Muon keeps no second moments: those buffers fit AdamW's units.
  for (const Unit& u : units) {
    unit_elems = std::max(unit_elems, u.count);
    if (u.rows == 0) adamw_elems = std::max(adamw_elems, u.count);
    if (u.rows != 0) {
      const uint64_t cols = u.count / u.rows;
      if (u.rows >= (uint64_t{1} << 31) || cols >= (uint64_t{1} << 31)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "a Muon matrix of ", u.rows, " x ", cols,
            " is too large for the CUDA engine's products (each side below 2^31)"));
      }
      muon_scratch = std::max<uint64_t>(muon_scratch, MuonScratchBytes(u.rows, cols, true));
      muon_scratch_blas = std::max<uint64_t>(muon_scratch_blas, MuonScratchBytes(u.rows, cols, false));
    }
  }
  if (muon_scratch > 0) {
    bool supported = false;
    CKPT_CUDA_RETURN_IF_ERROR(GpuSupportsMuon(&supported));
    if (!supported) {
      return absl::FailedPreconditionError(
          "the CUDA engine's Muon needs BF16 tensor cores (compute capability 8.0 or newer), "
          "which this GPU lacks: step Muon groups on the CPU engine");
    }
  }
  auto engine = std::make_unique<CudaEngine>(options.slot_count, unit_elems, adamw_elems,
                                             options.moment_dtype, max_slab, muon_scratch,
                                             muon_scratch_blas);
  CKPT_RETURN_IF_ERROR(engine->Restore());
  return std::unique_ptr<internal::Engine>(std::move(engine));
}

absl::Status RegisterPinned(void* base, size_t bytes) {
  CKPT_CUDA_RETURN_IF_ERROR(cudaHostRegister(base, bytes, cudaHostRegisterPortable));
  return absl::OkStatus();
}

void UnregisterPinned(void* base) { cudaHostUnregister(base); }

}  // namespace ckpt::optimizer::internal
