// ckpt-tool bench adamw: times StagedAdamW steps and prints Gparam/s beside the bound measured
// in the same run (DESIGN.md §8): for the CPU engine, host memory bandwidth from a STREAM-style
// triad on the same threads, divided by the bytes a step moves per parameter (30 with FP32
// gradients: grad, master, two moments read; master and moments written; BF16 copy written; 28
// with 16-bit gradients; 8 fewer with BF16 moments); for the CUDA engine,
// PCIe bandwidth with copies in both directions at once, divided by 12 bytes each way.
// The measuring is ckpt::bench::RunCpuStepBenchmark and RunCudaStepBenchmark
// (optimizer/bench); this file parses, checks and prints.
#include <cstdint>
#include <iostream>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "ckpt/bench/adamw_bench.h"
#include "cli/command.h"
#include "cli/commands.h"
#include "cli/common.h"

namespace ckpt::cli {

int RunBenchAdamw(const BenchAdamwArgs& args) {
  if (args.params == 0)
    return ReportError("bench adamw", absl::InvalidArgumentError("--params must be positive"));
  // Slabs (up to 12 B), gradients (up to 4 B), weights (2 B) and the bound's buffers: 32 B per
  // parameter covers every layout.
  constexpr uint64_t kBytesPerParam = 32;
  absl::Status fits = CheckFitsInMemory(
      args.params > UINT64_MAX / kBytesPerParam ? UINT64_MAX : args.params * kBytesPerParam,
      absl::StrCat("bench adamw --params ", args.params));
  if (!fits.ok()) return ReportError("bench adamw", fits);
  nlohmann::json out = {{"params", args.params}};
  bool any = false;
  if (args.engine == "cpu" || args.engine == "both") {
    bench::CpuStepBenchOptions options;
    options.params = args.params;
    options.threads = args.threads;
    options.steps = args.steps;
    options.grad_dtype = args.grad_dtype == "BF16"  ? formats::DType::kBF16
                         : args.grad_dtype == "F16" ? formats::DType::kF16
                                                    : formats::DType::kF32;
    options.moments =
        args.moments == "BF16" ? optimizer::MomentDType::kBF16 : optimizer::MomentDType::kF32;
    options.caller_pages =
        args.caller_pages == "small" ? bench::CallerPages::kSmall : bench::CallerPages::kHuge;
    options.check_finite = args.check_finite;
    absl::StatusOr<bench::CpuStepBenchmark> f = bench::RunCpuStepBenchmark(options);
    if (!f.ok()) return ReportError("bench adamw: cpu", f.status());
    const double bytes = f->bytes_per_param;
    const double gparams = f->gparams_per_s, bound = f->bound_gparams_per_s;
    const double shaped = f->shaped_bound_gparams_per_s;
    out["cpu"] = {{"engine", f->engine},
                  {"gparams_per_s", gparams},
                  {"triad_gbps", f->triad_gbps},
                  {"bound_gparams_per_s", bound},
                  {"ratio", gparams / bound},
                  {"bytes_per_param", bytes},
                  {"grad_dtype", args.grad_dtype},
                  {"moments", args.moments},
                  {"check_finite", args.check_finite},
                  {"caller_pages", args.caller_pages},
                  {"device_bytes", 0},
                  {"step_shaped_bound_gparams_per_s", shaped},
                  {"step_shaped_ratio", gparams / shaped}};
    if (!args.json) {
      std::cout << absl::StrFormat(
          "cpu  %-16s %s grads%s %6.2f Gparam/s   bound %6.2f Gparam/s (triad %.1f GB/s / %.0f "
          "B/param)   ratio %.2f\n",
          f->engine, args.grad_dtype, args.moments == "BF16" ? ", BF16 moments" : "", gparams,
          bound, f->triad_gbps, bytes, gparams / bound);
      std::cout << absl::StrFormat(
          "     same nine streams without the math: %6.2f Gparam/s   ratio %.2f\n", shaped,
          gparams / shaped);
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

Command AddBenchAdamwCommand(CLI::App& bench) {
  auto args = std::make_shared<BenchAdamwArgs>();
  CLI::App* cmd = bench.add_subcommand(
      "adamw", "StagedAdamW steps per second against host-memory or PCIe bounds");
  cmd->add_option("--params", args->params, "Parameters (elements) on this rank")
      ->required()
      ->check(WholeNumber(1, UINT64_MAX));
  cmd->add_option("--threads", args->threads, "CPU engine threads (0: every core)")
      ->check(WholeNumber(0, 1024));
  cmd->add_option("--engine", args->engine, "cpu, cuda or both")
      ->check(CLI::IsMember({"cpu", "cuda", "both"}));
  cmd->add_option("--grad-dtype", args->grad_dtype, "CPU engine gradients: F32, BF16 or F16")
      ->check(CLI::IsMember({"F32", "BF16", "F16"}));
  cmd->add_option("--caller-pages", args->caller_pages,
                  "CPU engine: gradient/parameter buffers on huge or small pages")
      ->check(CLI::IsMember({"huge", "small"}));
  cmd->add_option("--moments", args->moments,
                  "CPU engine moments in the slabs: F32 (default) or BF16 (precision-aware)")
      ->check(CLI::IsMember({"F32", "BF16"}));
  cmd->add_flag("--check-finite", args->check_finite,
                "CPU engine: every step checks the gradients for NaN/Inf first");
  cmd->add_option("--steps", args->steps, "Timed steps (best is reported)")
      ->check(WholeNumber(1, 1000));
  cmd->add_flag("--json", args->json, "Print one JSON object");
  return WhenParsed(cmd, [args] { return RunBenchAdamw(*args); });
}

}  // namespace ckpt::cli
