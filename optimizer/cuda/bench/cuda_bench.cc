#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <vector>

#include "ckpt/base/status_macros.h"
#include "ckpt/bench/adamw_bench.h"
#include "ckpt/formats/float_convert.h"
// The CUDA half of ckpt-tool bench adamw and bench async-save (ckpt/bench/adamw_bench.h).
#include "optimizer/cuda/bench/spin_kernel.h"
#include "optimizer/cuda/cublas_gemm.h"
#include "optimizer/cuda/cuda_check.h"
#include "optimizer/cuda/cuda_resources.h"
#include "optimizer/cuda/muon_kernel.h"
#include "optimizer/host_buffer.h"

namespace ckpt::optimizer {
namespace {

using internal::CudaEvent;
using internal::CudaStream;
using internal::DeviceBuffer;
using internal::HostBuffer;

double Seconds(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Copies `bytes` host->device on one stream and device->host on another at the same time,
// in 64 MiB pieces; returns each direction's rate. Best of 3.
absl::Status MeasureDuplex(size_t bytes, double* h2d_gbps, double* d2h_gbps) {
  CKPT_ASSIGN_OR_RETURN(HostBuffer src, HostBuffer::Create(bytes, 0, /*pinned=*/true));
  CKPT_ASSIGN_OR_RETURN(HostBuffer dst, HostBuffer::Create(bytes, 0, /*pinned=*/true));
  CKPT_ASSIGN_OR_RETURN(DeviceBuffer din, DeviceBuffer::Create(bytes));
  CKPT_ASSIGN_OR_RETURN(DeviceBuffer dout, DeviceBuffer::Create(bytes));
  CKPT_ASSIGN_OR_RETURN(CudaStream up, CudaStream::Create());
  CKPT_ASSIGN_OR_RETURN(CudaStream down, CudaStream::Create());
  CKPT_ASSIGN_OR_RETURN(CudaEvent up_start, CudaEvent::Create());
  constexpr size_t kPiece = size_t{64} << 20;
  for (int pass = 0; pass < 3; ++pass) {
    auto start = std::chrono::steady_clock::now();
    for (size_t off = 0; off < bytes; off += kPiece) {
      const size_t n = std::min(kPiece, bytes - off);
      CKPT_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(static_cast<std::byte*>(din.data()) + off,
                                                src.data() + off, n, cudaMemcpyHostToDevice,
                                                up.get()));
      CKPT_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst.data() + off,
                                                static_cast<std::byte*>(dout.data()) + off, n,
                                                cudaMemcpyDeviceToHost, down.get()));
    }
    CKPT_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(up.get()));
    const double up_s = Seconds(start);
    CKPT_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(down.get()));
    const double down_s = Seconds(start);
    *h2d_gbps = std::max(*h2d_gbps, static_cast<double>(bytes) / up_s / 1e9);
    *d2h_gbps = std::max(*d2h_gbps, static_cast<double>(bytes) / down_s / 1e9);
  }
  return absl::OkStatus();
}

}  // namespace

namespace {

class CudaStepBuffers : public DeviceStepBuffers {
 public:
  static absl::StatusOr<std::unique_ptr<DeviceStepBuffers>> Create(uint64_t params, float grad) {
    auto b = std::make_unique<CudaStepBuffers>();
    CKPT_ASSIGN_OR_RETURN(b->grads_, DeviceBuffer::Create(params * 4));
    CKPT_ASSIGN_OR_RETURN(b->weights_, DeviceBuffer::Create(params * 2));
    CKPT_ASSIGN_OR_RETURN(b->stream_, CudaStream::Create());
    const std::vector<float> host(params, grad);
    CKPT_CUDA_RETURN_IF_ERROR(
        cudaMemcpy(b->grads_.data(), host.data(), params * 4, cudaMemcpyHostToDevice));
    return std::unique_ptr<DeviceStepBuffers>(std::move(b));
  }
  StepArgs args() override {
    StepArgs a{grads_.data(), formats::DType::kF32, 1.0f, weights_.data()};
    a.stream = CudaStreamView::Of(reinterpret_cast<CUstream_st*>(stream_.get())).value();
    return a;
  }
  absl::Status Busy(double seconds) override {
    CKPT_CUDA_RETURN_IF_ERROR(
        internal::LaunchSpin(stream_.get(), static_cast<uint64_t>(seconds * 1e9)));
    return absl::OkStatus();
  }
  absl::Status WaitFor(CUevent_st* done) override {
    if (done != nullptr) {
      CKPT_CUDA_RETURN_IF_ERROR(
          cudaStreamWaitEvent(stream_.get(), reinterpret_cast<cudaEvent_t>(done), 0));
    }
    CKPT_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_.get()));
    return absl::OkStatus();
  }

 private:
  DeviceBuffer grads_, weights_;
  CudaStream stream_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceStepBuffers>> NewDeviceStepBuffers(uint64_t params,
                                                                        float grad) {
  return CudaStepBuffers::Create(params, grad);
}

absl::StatusOr<DuplexRates> MeasurePcieDuplex(uint64_t bytes) {
  DuplexRates r;
  CKPT_RETURN_IF_ERROR(MeasureDuplex(bytes, &r.h2d_gbps, &r.d2h_gbps));
  return r;
}

absl::StatusOr<CudaStepBenchmark> RunCudaStepBenchmark(uint64_t params, int steps,
                                                       MomentDType moments, uint64_t unit_bytes,
                                                       int slots) {
  CudaStepBenchmark out;
  CKPT_RETURN_IF_ERROR(MeasureDuplex(size_t{1} << 30, &out.h2d_gbps, &out.d2h_gbps));
  out.bytes_per_param = moments == MomentDType::kF32 ? 12 : 8;
  out.bound_gparams_per_s = std::min(out.h2d_gbps, out.d2h_gbps) / out.bytes_per_param;
  StagedAdamWOptions o;
  o.params = {{"w", {params}, formats::DType::kBF16, 0}};
  o.groups = {ParamGroup{}};
  o.pieces = {{0, 0, params}};
  o.engine = EngineKind::kCuda;
  o.moment_dtype = moments;
  o.unit_bytes = unit_bytes;
  o.slot_count = slots;
  std::vector<uint16_t> weights(params, formats::FloatToBf16(0.5f));
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<StagedAdamW> opt,
                        StagedAdamW::Create(o, std::as_bytes(std::span(weights))));
  CKPT_ASSIGN_OR_RETURN(DeviceBuffer grads, DeviceBuffer::Create(params * 4));
  CKPT_ASSIGN_OR_RETURN(DeviceBuffer weights_dev, DeviceBuffer::Create(params * 2));
  CKPT_CUDA_RETURN_IF_ERROR(cudaMemset(grads.data(), 0, params * 4));
  CKPT_ASSIGN_OR_RETURN(CudaStream caller, CudaStream::Create());
  StepArgs args{grads.data(), formats::DType::kF32, 1.0f, weights_dev.data()};
  CKPT_ASSIGN_OR_RETURN(args.stream,
                        CudaStreamView::Of(reinterpret_cast<CUstream_st*>(caller.get())));
  double best = 1e30;
  for (int i = 0; i <= steps; ++i) {  // Step 0 warms up.
    auto start = std::chrono::steady_clock::now();
    CKPT_RETURN_IF_ERROR(opt->Step(args).status());  // `caller` waits for its writes.
    CKPT_RETURN_IF_ERROR(opt->Synchronize());
    CKPT_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(caller.get()));
    if (i > 0) best = std::min(best, Seconds(start));
  }
  out.engine = opt->engine_name();
  out.gparams_per_s = static_cast<double>(params) / best / 1e9;
  out.device_bytes = opt->device_bytes();
  return out;
}

absl::StatusOr<GpuProducts> TimeGpuMuonProducts(uint64_t rows, uint64_t cols, uint32_t ns_steps,
                                                int repeats) {
  const uint64_t m = std::min(rows, cols), n = std::max(rows, cols);
  if (m >= (uint64_t{1} << 31) || n >= (uint64_t{1} << 31))
    return absl::InvalidArgumentError("bench muon: a matrix side of 2^31 or more");
  bool supported = false;
  CKPT_CUDA_RETURN_IF_ERROR(internal::GpuSupportsMuon(&supported));
  if (!supported) {
    return absl::FailedPreconditionError(
        "bench muon: the CUDA engine's Muon needs compute capability 8.0 or newer");
  }
  std::string why;
  const internal::CublasGemm blas = internal::CublasGemm::Create(&why);
  GpuProducts out;
  out.backend = blas.valid() ? "cuBLAS, loaded at run time" : "ckpt's WMMA kernel: " + why;
  // The step's own scratch, X (its first m x n BF16 elements) filled with 0.01 (0x3c24).
  CKPT_ASSIGN_OR_RETURN(
      DeviceBuffer scratch,
      DeviceBuffer::Create(internal::MuonScratchBytes(rows, cols, !blas.valid())));
  CKPT_ASSIGN_OR_RETURN(CudaStream stream, CudaStream::Create());
  const std::vector<uint16_t> fill(m * n, 0x3c24);
  CKPT_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(scratch.data(), fill.data(), m * n * 2, cudaMemcpyHostToDevice));
  internal::MuonKernelConstants k{};
  k.a = 3.4445f;
  k.b = -4.775f;
  k.c = 2.0315f;
  k.ns_steps = ns_steps;
  // Timing events (CudaEvent's are created without timing), each destroyed on every return.
  auto destroy = [](cudaEvent_t e) {
    if (e != nullptr) cudaEventDestroy(e);
  };
  cudaEvent_t begin = nullptr, end = nullptr;
  CKPT_CUDA_RETURN_IF_ERROR(cudaEventCreate(&begin));
  std::unique_ptr<CUevent_st, decltype(destroy)> own_begin(begin, destroy);
  CKPT_CUDA_RETURN_IF_ERROR(cudaEventCreate(&end));
  std::unique_ptr<CUevent_st, decltype(destroy)> own_end(end, destroy);
  double best = 1e30;
  absl::Status status;
  for (int r = 0; r <= repeats && status.ok(); ++r) {  // Round 0 warms up.
    status.Update(internal::CudaStatus(cudaEventRecord(begin, stream.get()), "record"));
    status.Update(internal::CudaStatus(
        internal::LaunchMuonProducts(scratch.data(), rows, cols, k, blas.backend(), stream.get()),
        "bench muon's products"));
    status.Update(internal::CudaStatus(cudaEventRecord(end, stream.get()), "record"));
    status.Update(internal::CudaStatus(cudaEventSynchronize(end), "synchronize"));
    float ms = 0;
    if (status.ok())
      status.Update(internal::CudaStatus(cudaEventElapsedTime(&ms, begin, end), "elapsed"));
    if (r > 0) best = std::min(best, ms / 1e3);
  }
  CKPT_RETURN_IF_ERROR(status);
  out.seconds = best;
  return out;
}

}  // namespace ckpt::optimizer
