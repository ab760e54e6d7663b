// How the demo trainer drives StagedAdamW's CUDA engine: the engine reads gradients from and
// writes BF16 weights to device memory, on the caller's stream, so one rank's step becomes copy
// gradients in, step, copy weights out. Built with CUDA (demo/cuda/device_step.cc) or without
// (demo/device_step_host_only.cc, where creating one says why it cannot be).
#ifndef CKPT_DEMO_DEVICE_STEP_H_
#define CKPT_DEMO_DEVICE_STEP_H_

#include <cstdint>
#include <memory>
#include <span>

#include "absl/status/statusor.h"
#include "ckpt/optimizer/staged_adamw.h"

namespace ckpt::demo {

// Owns one rank's device gradient and weight buffers and its stream. Not thread-safe.
class DeviceStep {
 public:
  virtual ~DeviceStep() = default;
  // Copies `grads` to the device, steps `opt` (a CUDA-engine optimizer) there, copies the BF16
  // weights back into `weights` and waits until they and the slabs hold the step.
  virtual absl::StatusOr<optimizer::StepReport> Step(optimizer::StagedAdamW& opt,
                                                     std::span<const float> grads,
                                                     std::span<uint16_t> weights) = 0;
};

// Buffers for `elements` elements. kUnimplemented in a build without CUDA; the CUDA error as
// Status otherwise (kFailedPrecondition with no usable device).
absl::StatusOr<std::unique_ptr<DeviceStep>> NewDeviceStep(uint64_t elements);

}  // namespace ckpt::demo

#endif  // CKPT_DEMO_DEVICE_STEP_H_
