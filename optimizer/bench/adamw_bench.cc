// bench adamw, CPU engine: times StagedAdamW steps, then measures on the same threads the two
// bounds a step is compared with: host memory bandwidth (triad) over the bytes a step moves per
// parameter, and the step's own streams without its arithmetic. The CUDA half is
// RunCudaStepBenchmark (optimizer/cuda/cuda_bench.cc).
#include "ckpt/bench/adamw_bench.h"

#include <algorithm>
#include <chrono>
#include <memory>
#include <random>
#include <span>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "ckpt/base/status_macros.h"
#include "ckpt/formats/float_convert.h"
#include "optimizer/bench/cpu_bounds.h"
#include "optimizer/host_buffer.h"

namespace ckpt::bench {
namespace {

using Clock = std::chrono::steady_clock;
using optimizer::StagedAdamW;
using optimizer::internal::HostBuffer;

double Seconds(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// The caller's gradient or parameter buffer. Huge: laid out as a trainer's pinned staging
// buffers or our slabs are, `stagger` bytes past a page so the streams do not alias in cache.
absl::StatusOr<HostBuffer> CallerBuffer(CallerPages pages, size_t bytes, size_t stagger) {
  if (pages == CallerPages::kHuge) return HostBuffer::Create(bytes, stagger, /*pinned=*/false);
  return HostBuffer::CreateSmallPages(bytes);
}

// Gradients in [-1, 1] in steps of 1e-3, in `dtype`.
void FillGradients(formats::DType dtype, uint64_t n, std::byte* out) {
  std::mt19937 rng(3);
  for (uint64_t i = 0; i < n; ++i) {
    const float g = static_cast<float>(rng() % 2001) * 1e-3f - 1.0f;
    if (dtype == formats::DType::kF32) {
      reinterpret_cast<float*>(out)[i] = g;
    } else {
      reinterpret_cast<uint16_t*>(out)[i] =
          dtype == formats::DType::kBF16 ? formats::FloatToBf16(g) : formats::FloatToHalf(g);
    }
  }
}

// A StagedAdamW over one BF16 tensor of `options.params` elements in one group, on the CPU.
absl::StatusOr<std::unique_ptr<StagedAdamW>> CreateOptimizer(const CpuStepBenchOptions& options) {
  const uint64_t n = options.params;
  optimizer::StagedAdamWOptions o;
  o.params = {{"w", {n}, formats::DType::kBF16, 0}};
  o.groups = {optimizer::ParamGroup{}};
  o.pieces = {{0, 0, n}};
  o.threads = options.threads;
  o.moment_dtype = options.moments;
  std::vector<uint16_t> weights(n, formats::FloatToBf16(0.5f));
  return StagedAdamW::Create(o, std::as_bytes(std::span(weights)));
}

// The best of `steps` timed steps after one warm-up step (which touches every page), in
// Gparam/s.
absl::StatusOr<double> TimeSteps(StagedAdamW& opt, const optimizer::StepArgs& args, int steps,
                                 uint64_t n) {
  CKPT_RETURN_IF_ERROR(opt.Step(args).status());
  double best = 1e30;
  for (int i = 0; i < steps; ++i) {
    Clock::time_point start = Clock::now();
    CKPT_RETURN_IF_ERROR(opt.Step(args).status());
    best = std::min(best, Seconds(start));
  }
  return static_cast<double>(n) / best / 1e9;
}

}  // namespace

double CpuBytesPerParam(formats::DType grad_dtype, optimizer::MomentDType moments) {
  const double state = moments == optimizer::MomentDType::kF32 ? 12 : 8;
  return state + static_cast<double>(formats::DTypeSize(grad_dtype)) + state + 2;
}

absl::StatusOr<CpuStepBenchmark> RunCpuStepBenchmark(const CpuStepBenchOptions& options) {
  const formats::DType grad_dtype = options.grad_dtype;
  if (options.params < 1 || options.steps < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("bench adamw needs at least one parameter and one step, not ", options.params,
                     " and ", options.steps));
  }
  if (grad_dtype != formats::DType::kF32 && grad_dtype != formats::DType::kBF16 &&
      grad_dtype != formats::DType::kF16) {
    return absl::InvalidArgumentError(absl::StrCat("bench adamw takes F32, BF16 or F16 grads, not ",
                                                   formats::DTypeName(grad_dtype)));
  }
  const uint64_t n = options.params;
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<StagedAdamW> opt, CreateOptimizer(options));
  CKPT_ASSIGN_OR_RETURN(
      HostBuffer grad_buf,
      CallerBuffer(options.caller_pages, n * formats::DTypeSize(grad_dtype), 3 * 4096 + 192));
  CKPT_ASSIGN_OR_RETURN(HostBuffer param_buf,
                        CallerBuffer(options.caller_pages, n * 2, 4 * 4096 + 256));
  FillGradients(grad_dtype, n, grad_buf.data());
  optimizer::StepArgs args{grad_buf.data(), grad_dtype, 1.0f, param_buf.data()};
  args.check_finite = options.check_finite;
  CpuStepBenchmark f;
  CKPT_ASSIGN_OR_RETURN(f.gparams_per_s, TimeSteps(*opt, args, options.steps, n));
  f.engine = opt->engine_name();
  opt.reset();  // Its slabs' memory goes back before the bounds take theirs.
  const int t = options.threads > 0
                    ? options.threads
                    : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  CKPT_ASSIGN_OR_RETURN(f.triad_gbps,
                        optimizer::internal::MeasureTriadGBps(std::max<uint64_t>(n, 32u << 20), t,
                                                              optimizer::CpuIsa::kAuto, 5));
  f.bytes_per_param = CpuBytesPerParam(grad_dtype, options.moments);
  f.bound_gparams_per_s = f.triad_gbps / f.bytes_per_param;
  CKPT_ASSIGN_OR_RETURN(
      f.shaped_bound_gparams_per_s,
      optimizer::internal::MeasureShapedGparams(args.grads, grad_dtype, args.params, n, t,
                                                optimizer::CpuIsa::kAuto, 3, options.moments));
  return f;
}

}  // namespace ckpt::bench
