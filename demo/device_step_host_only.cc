// DeviceStep in a build without CUDA: there is no device to step on.
#include "absl/strings/str_cat.h"
#include "demo/device_step.h"

namespace ckpt::demo {

absl::StatusOr<std::unique_ptr<DeviceStep>> NewDeviceStep(uint64_t elements) {
  return absl::UnimplementedError(
      absl::StrCat("--engine cuda: this build has no CUDA (CKPT_CUDA=OFF or no toolkit); ",
                   elements, " elements would have been stepped on the GPU"));
}

}  // namespace ckpt::demo
