// The CUDA engine's slots (optimizer/cuda/cuda_engine_impl.h; the pipeline that uses them, with
// its numbered steps, is optimizer/cuda/cuda_engine.cc): Restore makes each slot's device
// buffers, streams and events (and cuBLAS handles for Muon's products), Release drains every
// stream before any of them goes, Synchronize waits for every copy-out; and the per-unit events
// of a gated step (its readers wait for a unit's written event, its kernels for its ready event).
#include <string>
#include <utility>
#include <vector>

#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"
#include "ckpt/base/status_macros.h"
#include "optimizer/cuda/cublas_gemm.h"
#include "optimizer/cuda/cuda_check.h"
#include "optimizer/cuda/cuda_engine_impl.h"
#include "optimizer/cuda/cuda_resources.h"

namespace ckpt::optimizer::internal {

absl::Status CudaEngine::Restore() {
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

absl::Status CudaEngine::Release() {
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

std::string CudaEngine::name() const {
  return absl::StrCat("cuda-", slot_count_, "slots", products_);
}

absl::Status CudaEngine::Synchronize() {
  for (Slot& s : slots_) CKPT_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s.d2h.get()));
  if (join_.valid()) CKPT_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(join_.get()));
  return absl::OkStatus();
}

absl::Status CudaEngine::PrepareUnitEvents(size_t units) {
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

absl::Status CudaEngine::RecordUnitReady(uint32_t u, CudaStreamView stream) {
  if (u >= ready_events_.size())
    return absl::InternalError("a ready event that PrepareUnitEvents did not make");
  CKPT_CUDA_RETURN_IF_ERROR(cudaEventRecord(ready_events_[u].get(), ToCudaStream(stream)));
  return absl::OkStatus();
}

absl::StatusOr<bool> CudaEngine::Query(const std::vector<CudaEvent>& events, uint32_t u) {
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

absl::Status CudaEngine::OrderCallerAfterUnit(uint32_t u, CudaStreamView stream) {
  if (u >= unit_events_.size()) return absl::OkStatus();  // Never recorded.
  CKPT_CUDA_RETURN_IF_ERROR(
      cudaStreamWaitEvent(ToCudaStream(stream), unit_events_[u].get(), 0));
  return absl::OkStatus();
}

}  // namespace ckpt::optimizer::internal
