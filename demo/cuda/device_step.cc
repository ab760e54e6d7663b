// DeviceStep with CUDA: device buffers and a stream per rank, the copies on that stream. The
// demo is a trainer like any other, so it owns its device memory through the CUDA runtime
// itself (as torch would) and hands StagedAdamW only pointers and a stream.
#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"
#include "ckpt/base/status_macros.h"
#include "demo/device_step.h"

namespace ckpt::demo {
namespace {

absl::Status CudaOk(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();  // Clears a sticky error so later calls report their own.
  const std::string message =
      absl::StrCat(what, ": ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")");
  if (err == cudaErrorMemoryAllocation) return absl::ResourceExhaustedError(message);
  if (err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver) {
    return absl::FailedPreconditionError(message);
  }
  return absl::InternalError(message);
}

class CudaDeviceStep : public DeviceStep {
 public:
  CudaDeviceStep() = default;
  // Owns a stream and two allocations; a copy would free them twice.
  CudaDeviceStep(const CudaDeviceStep&) = delete;
  CudaDeviceStep& operator=(const CudaDeviceStep&) = delete;
  ~CudaDeviceStep() override {
    // The buffers were last used on the stream: drain it before they go.
    if (stream_ != nullptr) cudaStreamSynchronize(stream_);
    if (grads_ != nullptr) cudaFree(grads_);
    if (weights_ != nullptr) cudaFree(weights_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  absl::Status Init(uint64_t elements) {
    CKPT_RETURN_IF_ERROR(
        CudaOk(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "create stream"));
    grad_bytes_ = elements * sizeof(float);
    weight_bytes_ = elements * sizeof(uint16_t);
    CKPT_RETURN_IF_ERROR(CudaOk(cudaMalloc(&grads_, grad_bytes_), "allocate gradients"));
    return CudaOk(cudaMalloc(&weights_, weight_bytes_), "allocate weights");
  }

  absl::StatusOr<optimizer::StepReport> Step(optimizer::StagedAdamW& opt,
                                             std::span<const float> grads,
                                             std::span<uint16_t> weights) override {
    if (grads.size_bytes() > grad_bytes_ || weights.size_bytes() > weight_bytes_)
      return absl::InvalidArgumentError("more elements than the device buffers hold");
    CKPT_RETURN_IF_ERROR(CudaOk(
        cudaMemcpyAsync(grads_, grads.data(), grads.size_bytes(), cudaMemcpyHostToDevice, stream_),
        "copy gradients in"));
    optimizer::StepArgs args;
    args.grads = grads_;
    args.grad_dtype = formats::DType::kF32;
    args.params = weights_;
    args.check_finite = true;
    CKPT_ASSIGN_OR_RETURN(args.stream,
                          optimizer::CudaStreamView::Of(reinterpret_cast<CUstream_st*>(stream_)));
    // The copy out is queued after the step's writes: Step orders stream_ after them.
    CKPT_ASSIGN_OR_RETURN(optimizer::StepReport report, opt.Step(args));
    if (!report.skipped) {
      CKPT_RETURN_IF_ERROR(CudaOk(cudaMemcpyAsync(weights.data(), weights_, weights.size_bytes(),
                                                  cudaMemcpyDeviceToHost, stream_),
                                  "copy weights out"));
    }
    CKPT_RETURN_IF_ERROR(CudaOk(cudaStreamSynchronize(stream_), "synchronize"));
    CKPT_RETURN_IF_ERROR(opt.Synchronize());  // The slabs hold the step: it can be saved.
    return report;
  }

 private:
  cudaStream_t stream_ = nullptr;
  void* grads_ = nullptr;
  void* weights_ = nullptr;
  uint64_t grad_bytes_ = 0, weight_bytes_ = 0;
};

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceStep>> NewDeviceStep(uint64_t elements) {
  auto step = std::make_unique<CudaDeviceStep>();
  CKPT_RETURN_IF_ERROR(step->Init(elements));
  return std::unique_ptr<DeviceStep>(std::move(step));
}

}  // namespace ckpt::demo
