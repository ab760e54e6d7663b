// One owner per CUDA resource (STYLE.md §5): CudaStream, CudaEvent, DeviceBuffer. Move-only;
// acquired by static factories returning StatusOr; destructors release quietly (and ignore
// cudaErrorCudartUnloading at process exit).
#ifndef CKPT_OPTIMIZER_CUDA_CUDA_RESOURCES_H_
#define CKPT_OPTIMIZER_CUDA_CUDA_RESOURCES_H_

#include <cuda_runtime.h>

#include <cstddef>
#include <utility>

#include "absl/status/statusor.h"
#include "ckpt/optimizer/staged_adamw.h"
#include "optimizer/cuda/cuda_check.h"

namespace ckpt::optimizer::internal {

// The runtime's stream for a CudaStreamView. The one place that says what the legacy default
// stream is: cudaStreamLegacy by name, never handle 0 (which a per-thread-default build would
// read as its own thread's stream).
inline cudaStream_t ToCudaStream(const CudaStreamView& view) {
  return view.is_legacy() ? cudaStreamLegacy : reinterpret_cast<cudaStream_t>(view.handle());
}

class CudaStream {
 public:
  CudaStream() = default;
  static absl::StatusOr<CudaStream> Create() {
    CudaStream s;
    CKPT_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&s.stream_, cudaStreamNonBlocking));
    return s;
  }
  ~CudaStream() { Reset(); }
  CudaStream(const CudaStream&) = delete;  // Would destroy the stream twice.
  CudaStream& operator=(const CudaStream&) = delete;
  CudaStream(CudaStream&& o) noexcept : stream_(std::exchange(o.stream_, nullptr)) {}
  // Releases the stream this one owned, then takes `o`'s; `o` owns nothing afterwards.
  CudaStream& operator=(CudaStream&& o) noexcept {
    if (this != &o) {
      Reset();
      stream_ = std::exchange(o.stream_, nullptr);
    }
    return *this;
  }
  bool valid() const { return stream_ != nullptr; }
  cudaStream_t get() const { return stream_; }

 private:
  void Reset() noexcept {
    // Destructors never report; cudaErrorCudartUnloading at exit is ignored with the rest.
    if (stream_ != nullptr) cudaStreamDestroy(std::exchange(stream_, nullptr));
  }
  cudaStream_t stream_ = nullptr;
};

class CudaEvent {
 public:
  CudaEvent() = default;
  static absl::StatusOr<CudaEvent> Create() {
    CudaEvent e;
    CKPT_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&e.event_, cudaEventDisableTiming));
    return e;
  }
  ~CudaEvent() { Reset(); }
  CudaEvent(const CudaEvent&) = delete;  // Would destroy the event twice.
  CudaEvent& operator=(const CudaEvent&) = delete;
  CudaEvent(CudaEvent&& o) noexcept : event_(std::exchange(o.event_, nullptr)) {}
  // Releases the event this one owned, then takes `o`'s; `o` owns nothing afterwards.
  CudaEvent& operator=(CudaEvent&& o) noexcept {
    if (this != &o) {
      Reset();
      event_ = std::exchange(o.event_, nullptr);
    }
    return *this;
  }
  bool valid() const { return event_ != nullptr; }
  cudaEvent_t get() const { return event_; }

 private:
  void Reset() noexcept {
    if (event_ != nullptr) cudaEventDestroy(std::exchange(event_, nullptr));
  }
  cudaEvent_t event_ = nullptr;
};

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  static absl::StatusOr<DeviceBuffer> Create(size_t bytes) {
    DeviceBuffer b;
    CKPT_CUDA_RETURN_IF_ERROR(cudaMalloc(&b.data_, bytes == 0 ? 1 : bytes));
    b.size_ = bytes;
    return b;
  }
  ~DeviceBuffer() { Reset(); }
  DeviceBuffer(const DeviceBuffer&) = delete;  // A copy could not name its stream (RMM's rule).
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  // Frees the memory this one owned, then takes `o`'s; `o` owns nothing afterwards.
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      Reset();
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  bool valid() const { return data_ != nullptr; }
  void* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  void Reset() noexcept {
    if (data_ != nullptr) cudaFree(std::exchange(data_, nullptr));
    size_ = 0;
  }
  void* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace ckpt::optimizer::internal

#endif  // CKPT_OPTIMIZER_CUDA_CUDA_RESOURCES_H_
