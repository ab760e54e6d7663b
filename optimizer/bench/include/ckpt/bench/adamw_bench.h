// What `ckpt-tool bench adamw` measures: StagedAdamW steps in Gparam/s beside the bound measured
// in the same run (DESIGN.md §8). For the CPU engine the bound is host memory bandwidth from a
// STREAM-style triad on the same threads, divided by the bytes a step moves per parameter, and
// the step's own nine streams without its arithmetic; for the CUDA engine, PCIe bandwidth with
// copies in both directions at once, divided by the bytes each way. These measurements need
// the optimizer's internals (slab-like host buffers, the bound kernels), so they live here and
// not in cli/. Not installed: this header is for ckpt-tool only, not part of the public API.
// Functions never print; ckpt-tool prints. Rates are in Gparam/s (1e9 parameters per second)
// and GB/s (1e9 bytes per second).
#ifndef CKPT_OPTIMIZER_BENCH_ADAMW_BENCH_H_
#define CKPT_OPTIMIZER_BENCH_ADAMW_BENCH_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "ckpt/formats/dtype.h"
#include "ckpt/optimizer/staged_adamw.h"

// The CUDA half is declared in ckpt::optimizer and defined by ckpt_optimizer_cuda_bench
// (optimizer/cuda/bench/cuda_bench.cc), or without CUDA by optimizer/bench/
// cuda_bench_unavailable.cc; no library of ckpt's includes this header (the layering check
// keeps "ckpt/bench/..." includes to cli/ and bench/ folders). ckpt::bench names both with
// using-declarations below.
namespace ckpt::optimizer {

// The CUDA engine's step rate against the PCIe duplex bound, as RunCudaStepBenchmark measures
// it (1 GiB each way at once, best of 3, before the steps). A plain value.
struct CudaStepBenchmark {
  std::string engine;        // The engine's name.
  double gparams_per_s = 0;  // Best timed step, the caller's stream synchronized.
  double h2d_gbps = 0;       // Host-to-device rate while device-to-host runs at the same time.
  double d2h_gbps = 0;
  double bytes_per_param = 0;      // Each way: 12 (FP32 moments) or 8 (BF16 moments).
  double bound_gparams_per_s = 0;  // The slower direction's rate / bytes_per_param.
  uint64_t device_bytes = 0;       // Held by the engine.
};

// Runs `steps` timed steps over `params` BF16 parameters with FP32 gradients on the first
// device, in units of `unit_bytes` over `slots` slots. kUnimplemented without CUDA;
// kFailedPrecondition without a device; kResourceExhausted when host or device memory runs out.
// REQUIRES: params > 0, steps > 0, slots > 0, unit_bytes a positive multiple of 4.
absl::StatusOr<CudaStepBenchmark> RunCudaStepBenchmark(uint64_t params, int steps,
                                                       MomentDType moments, uint64_t unit_bytes,
                                                       int slots);

// A CUDA-engine benchmark's caller side: device gradients (FP32, every one `grad`), device BF16
// parameters and the caller's stream. kUnimplemented without CUDA; the CUDA error otherwise.
class DeviceStepBuffers {
 public:
  virtual ~DeviceStepBuffers() = default;
  // Gradients, parameters and stream for StagedAdamW::Step.
  virtual StepArgs args() = 0;
  // Waits for `done` (a StepReport's; the stream already waits on it) and for the stream.
  virtual absl::Status WaitFor(CUevent_st* done) = 0;
  // Queues `seconds` of work on the stream (one thread spinning on the GPU's clock, the SMs
  // left free) and returns at once: a synthetic backward's layer (bench overlap).
  virtual absl::Status Busy(double seconds) = 0;
};
absl::StatusOr<std::unique_ptr<DeviceStepBuffers>> NewDeviceStepBuffers(uint64_t params,
                                                                        float grad);

// PCIe rates with `bytes` going host-to-device and device-to-host at the same time between
// pinned host and device buffers (64 MiB copies, best of 3), in GB/s each way, as
// RunCudaStepBenchmark measures its bound. kUnimplemented without CUDA.
struct DuplexRates {
  double h2d_gbps = 0;
  double d2h_gbps = 0;
};
absl::StatusOr<DuplexRates> MeasurePcieDuplex(uint64_t bytes);

// Seconds the CUDA engine's BF16 products take for one Newton-Schulz orthogonalisation of a
// rows x cols matrix (ns_steps x 3 products on m x n, m <= n), alone on the first device, timed by
// events (best of `repeats`), on what the engine would run them: cuBLAS when it loads, else
// ckpt's kernel (`backend` says which, and why). kUnimplemented without CUDA.
struct GpuProducts {
  double seconds = 0;
  std::string backend;
};
absl::StatusOr<GpuProducts> TimeGpuMuonProducts(uint64_t rows, uint64_t cols, uint32_t ns_steps,
                                                int repeats);

}  // namespace ckpt::optimizer

namespace ckpt::bench {

using optimizer::CudaStepBenchmark;
using optimizer::DeviceStepBuffers;
using optimizer::DuplexRates;
using optimizer::GpuProducts;
using optimizer::MeasurePcieDuplex;
using optimizer::NewDeviceStepBuffers;
using optimizer::RunCudaStepBenchmark;
using optimizer::TimeGpuMuonProducts;

// Where the caller's gradient and parameter buffers come from in the CPU benchmark.
enum class CallerPages {
  // Laid out as a trainer's pinned staging buffers or our slabs are: 2 MiB-aligned,
  // MADV_HUGEPAGE, offset from the slabs so that the streams do not alias in cache.
  kHuge,
  // Page-aligned 4 KiB pages, what a plain allocator gives.
  kSmall,
};

// What RunCpuStepBenchmark measures: one rank's parameters, all in one tensor of one group. A
// plain value.
struct CpuStepBenchOptions {
  uint64_t params = 0;  // BF16 parameters; at least 1.
  int threads = 0;      // Engine and bound threads; 0: every core.
  int steps = 5;        // Timed steps after one warm-up step; the best is reported. At least 1.
  formats::DType grad_dtype = formats::DType::kF32;  // F32, BF16 or F16.
  optimizer::MomentDType moments = optimizer::MomentDType::kF32;
  CallerPages caller_pages = CallerPages::kHuge;
  bool check_finite = false;  // Steps check the gradients for NaN/Inf first.
};

// The CPU engine's step rate and the bounds measured right after it on the same threads. A
// plain value.
struct CpuStepBenchmark {
  std::string engine;              // The engine's name (which instruction set it chose).
  double gparams_per_s = 0;        // Best timed step.
  double triad_gbps = 0;           // Host memory bandwidth (STREAM triad, bytes that really move).
  double bytes_per_param = 0;      // See CpuBytesPerParam.
  double bound_gparams_per_s = 0;  // triad_gbps / bytes_per_param.
  double shaped_bound_gparams_per_s = 0;  // The step's streams without the math.
};

// Bytes a CPU step moves per parameter: master, both moments and the gradient read; master,
// moments and the BF16 copy written. 30 with FP32 gradients and FP32 moments, 28 with 16-bit
// gradients, 8 fewer with BF16 moments.
double CpuBytesPerParam(formats::DType grad_dtype, optimizer::MomentDType moments);

// Creates a StagedAdamW over `options.params` parameters with the CPU engine, times
// `options.steps` steps on synthetic gradients, then frees its slabs and measures the triad and
// step-shaped bounds. Returns kInvalidArgument for fewer than one parameter or step or an
// unsupported gradient dtype; kResourceExhausted when memory runs out; any error of
// StagedAdamW::Create or Step.
absl::StatusOr<CpuStepBenchmark> RunCpuStepBenchmark(const CpuStepBenchOptions& options);

}  // namespace ckpt::bench

#endif  // CKPT_OPTIMIZER_BENCH_ADAMW_BENCH_H_
