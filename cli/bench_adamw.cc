// ckpt-tool bench adamw: times StagedAdamW steps and prints Gparam/s beside the bound measured
// in the same run (DESIGN.md §8): for the CPU engine, host memory bandwidth from a STREAM-style
// triad on the same threads, divided by the bytes a step moves per parameter (30 with FP32
// gradients: grad, master, two moments read; master and moments written; BF16 copy written; 28
// with 16-bit gradients; 8 fewer with BF16 moments); for the CUDA engine,
// PCIe bandwidth with copies in both directions at once, divided by 12 bytes each way.
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "ckpt/formats/float_convert.h"
#include "ckpt/optimizer/staged_adamw.h"
#include "cli/commands.h"
#include "cli/common.h"
#include "optimizer/cpu_bounds.h"
#include "optimizer/host_buffer.h"

namespace ckpt::cli {
namespace {

using Clock = std::chrono::steady_clock;
using optimizer::EngineKind;
using optimizer::StagedAdamW;

// Master, two moments and the gradient read; master, moments and the BF16 copy written.
double CpuBytesPerParam(formats::DType grad, optimizer::MomentDType moments) {
  const double state = moments == optimizer::MomentDType::kF32 ? 12 : 8;
  return state + static_cast<double>(formats::DTypeSize(grad)) + state + 2;
}

double Seconds(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

struct CpuFigures {
  double gparams = 0, bound_gparams = 0, triad_gbps = 0, shaped_gparams = 0;
  std::string engine;
};

absl::StatusOr<CpuFigures> BenchCpu(uint64_t n, int threads, int steps, formats::DType grad_dtype,
                                    optimizer::MomentDType moments, const std::string& caller_pages,
                                    bool check_finite) {
  optimizer::StagedAdamWOptions o;
  o.params = {{"w", {n}, formats::DType::kBF16, 0}};
  o.groups = {optimizer::ParamGroup{}};
  o.pieces = {{0, 0, n}};
  o.threads = threads;
  o.moment_dtype = moments;
  std::vector<uint16_t> weights(n, formats::FloatToBf16(0.5f));
  auto opt = StagedAdamW::Create(o, std::as_bytes(std::span(weights)));
  if (!opt.ok()) return opt.status();
  // The caller's gradient and parameter buffers: by default laid out as a trainer's pinned
  // staging buffers or our slabs are (2 MiB-aligned, MADV_HUGEPAGE, offset from the slabs so the
  // streams do not alias in cache); --caller-pages small gives 4 KiB-page buffers instead.
  const bool huge = caller_pages != "small";
  auto caller_buffer = [&](size_t bytes,
                           size_t stagger) -> absl::StatusOr<optimizer::internal::HostBuffer> {
    if (huge) return optimizer::internal::HostBuffer::Create(bytes, stagger, /*pinned=*/false);
    return optimizer::internal::HostBuffer::CreateSmallPages(bytes);
  };
  const size_t gsize = formats::DTypeSize(grad_dtype);
  absl::StatusOr<optimizer::internal::HostBuffer> grad_buf =
      caller_buffer(n * gsize, 3 * 4096 + 192);
  if (!grad_buf.ok()) return grad_buf.status();
  absl::StatusOr<optimizer::internal::HostBuffer> param_buf = caller_buffer(n * 2, 4 * 4096 + 256);
  if (!param_buf.ok()) return param_buf.status();
  std::mt19937 rng(3);
  for (uint64_t i = 0; i < n; ++i) {
    const float g = static_cast<float>(rng() % 2001) * 1e-3f - 1.0f;
    if (grad_dtype == formats::DType::kF32) {
      reinterpret_cast<float*>(grad_buf->data())[i] = g;
    } else {
      reinterpret_cast<uint16_t*>(grad_buf->data())[i] =
          grad_dtype == formats::DType::kBF16 ? formats::FloatToBf16(g) : formats::FloatToHalf(g);
    }
  }
  const void* g = grad_buf->data();
  void* params = param_buf->data();
  optimizer::StepArgs args{g, grad_dtype, 1.0f, params};
  args.check_finite = check_finite;
  if (auto s = (*opt)->Step(args); !s.ok()) return s.status();  // Warm: pages touched.
  double best = 1e30;
  for (int i = 0; i < steps; ++i) {
    Clock::time_point start = Clock::now();
    if (auto s = (*opt)->Step(args); !s.ok()) return s.status();
    best = std::min(best, Seconds(start));
  }
  CpuFigures f;
  f.engine = (*opt)->engine_name();
  f.gparams = static_cast<double>(n) / best / 1e9;
  opt->reset();  // Its slabs' memory goes back before the bounds take theirs.
  const int t =
      threads > 0 ? threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  absl::StatusOr<double> triad = optimizer::internal::MeasureTriadGBps(
      std::max<uint64_t>(n, 32u << 20), t, optimizer::CpuIsa::kAuto, 5);
  if (!triad.ok()) return triad.status();
  f.triad_gbps = *triad;
  f.bound_gparams = f.triad_gbps / CpuBytesPerParam(grad_dtype, moments);
  absl::StatusOr<double> shaped = optimizer::internal::MeasureShapedGparams(
      g, grad_dtype, params, n, t, optimizer::CpuIsa::kAuto, 3, moments);
  if (!shaped.ok()) return shaped.status();
  f.shaped_gparams = *shaped;
  return f;
}

}  // namespace

int RunBenchAdamw(const BenchAdamwArgs& args) {
  if (args.params == 0)
    return ReportError("bench adamw", absl::InvalidArgumentError("--params must be positive"));
  // Slabs (up to 12 B), gradients (up to 4 B), weights (2 B) and the bound's buffers: 32 B per
  // parameter covers every layout.
  constexpr uint64_t kBytesPerParam = 32;
  absl::Status fits =
      CheckFitsInMemory(args.params > UINT64_MAX / kBytesPerParam ? UINT64_MAX
                                                                  : args.params * kBytesPerParam,
                        absl::StrCat("bench adamw --params ", args.params));
  if (!fits.ok()) return ReportError("bench adamw", fits);
  nlohmann::json out = {{"params", args.params}};
  bool any = false;
  if (args.engine == "cpu" || args.engine == "both") {
    const formats::DType grad_dtype = args.grad_dtype == "BF16"  ? formats::DType::kBF16
                                      : args.grad_dtype == "F16" ? formats::DType::kF16
                                                                 : formats::DType::kF32;
    const optimizer::MomentDType moments =
        args.moments == "BF16" ? optimizer::MomentDType::kBF16 : optimizer::MomentDType::kF32;
    const double bytes = CpuBytesPerParam(grad_dtype, moments);
    absl::StatusOr<CpuFigures> f = BenchCpu(args.params, args.threads, args.steps, grad_dtype,
                                            moments, args.caller_pages, args.check_finite);
    if (!f.ok()) return ReportError("bench adamw: cpu", f.status());
    out["cpu"] = {{"engine", f->engine},
                  {"gparams_per_s", f->gparams},
                  {"triad_gbps", f->triad_gbps},
                  {"bound_gparams_per_s", f->bound_gparams},
                  {"ratio", f->gparams / f->bound_gparams},
                  {"bytes_per_param", bytes},
                  {"grad_dtype", args.grad_dtype},
                  {"moments", args.moments},
                  {"check_finite", args.check_finite},
                  {"caller_pages", args.caller_pages},
                  {"device_bytes", 0},
                  {"step_shaped_bound_gparams_per_s", f->shaped_gparams},
                  {"step_shaped_ratio", f->gparams / f->shaped_gparams}};
    if (!args.json) {
      std::cout << absl::StrFormat(
          "cpu  %-16s %s grads%s %6.2f Gparam/s   bound %6.2f Gparam/s (triad %.1f GB/s / %.0f "
          "B/param)   ratio %.2f\n",
          f->engine, args.grad_dtype, args.moments == "BF16" ? ", BF16 moments" : "", f->gparams,
          f->bound_gparams, f->triad_gbps, bytes, f->gparams / f->bound_gparams);
      std::cout << absl::StrFormat(
          "     same nine streams without the math: %6.2f Gparam/s   ratio %.2f\n",
          f->shaped_gparams, f->gparams / f->shaped_gparams);
    }
    any = true;
  }
  if (args.engine == "cuda" || args.engine == "both") {
    absl::StatusOr<nlohmann::json> cuda = BenchAdamwCuda(args);
    if (!cuda.ok()) {
      if (args.engine == "cuda") return ReportError("bench adamw: cuda", cuda.status());
      out["cuda"] = {{"error", std::string(cuda.status().message())}};
      if (!args.json) std::cout << "cuda unavailable: " << cuda.status().message() << "\n";
    } else {
      out["cuda"] = *cuda;
    }
    any = true;
  }
  if (!any)
    return ReportError("bench adamw",
                       absl::InvalidArgumentError("--engine must be cpu, cuda or both"));
  if (args.json) PrintJson(out);
  return kExitOk;
}

}  // namespace ckpt::cli
