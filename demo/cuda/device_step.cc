// DeviceStep with CUDA: device buffers and a stream per rank, the copies on that stream.
#include <cuda_runtime.h>

#include "demo/device_step.h"
#include "libckpt/status_macros.h"
#include "optimizer/cuda/cuda_check.h"
#include "optimizer/cuda/cuda_resources.h"

namespace ckpt::demo {
namespace {

using optimizer::internal::CudaStream;
using optimizer::internal::DeviceBuffer;

class CudaDeviceStep : public DeviceStep {
 public:
  CudaDeviceStep(CudaStream stream, DeviceBuffer grads, DeviceBuffer weights)
      : stream_(std::move(stream)), grads_(std::move(grads)), weights_(std::move(weights)) {}

  absl::StatusOr<optimizer::StepReport> Step(optimizer::StagedAdamW& opt,
                                             std::span<const float> grads,
                                             std::span<uint16_t> weights) override {
    if (grads.size_bytes() > grads_.size() || weights.size_bytes() > weights_.size())
      return absl::InvalidArgumentError("more elements than the device buffers hold");
    CKPT_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(grads_.data(), grads.data(), grads.size_bytes(),
                                              cudaMemcpyHostToDevice, stream_.get()));
    optimizer::StepArgs args;
    args.grads = grads_.data();
    args.grad_dtype = formats::DType::kF32;
    args.params = weights_.data();
    args.check_finite = true;
    args.stream = reinterpret_cast<CUstream_st*>(stream_.get());
    CKPT_ASSIGN_OR_RETURN(optimizer::StepReport report, opt.Step(args));
    if (!report.skipped) {
      CKPT_CUDA_RETURN_IF_ERROR(
          cudaStreamWaitEvent(stream_.get(), reinterpret_cast<cudaEvent_t>(report.done), 0));
      CKPT_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(weights.data(), weights_.data(),
                                                weights.size_bytes(), cudaMemcpyDeviceToHost,
                                                stream_.get()));
    }
    CKPT_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_.get()));
    CKPT_RETURN_IF_ERROR(opt.Synchronize());  // The slabs hold the step: it can be saved.
    return report;
  }

 private:
  // Declared first, destroyed last: the buffers go before the stream they were used on.
  CudaStream stream_;
  DeviceBuffer grads_, weights_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceStep>> NewDeviceStep(uint64_t elements) {
  CKPT_ASSIGN_OR_RETURN(CudaStream stream, CudaStream::Create());
  CKPT_ASSIGN_OR_RETURN(DeviceBuffer grads, DeviceBuffer::Create(elements * sizeof(float)));
  CKPT_ASSIGN_OR_RETURN(DeviceBuffer weights, DeviceBuffer::Create(elements * sizeof(uint16_t)));
  return std::unique_ptr<DeviceStep>(
      new CudaDeviceStep(std::move(stream), std::move(grads), std::move(weights)));
}

}  // namespace ckpt::demo
