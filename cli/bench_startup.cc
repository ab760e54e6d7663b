// ckpt-tool bench startup: building a StagedAdamW against the host's own first-touch (and, for
// the CUDA engine, pinning) rate of the same bytes, measured in the same run. The measuring is
// ckpt::bench::RunStartupBench (optimizer/bench); this file prints.
#include <iostream>
#include <memory>

#include "absl/strings/str_format.h"
#include "ckpt/bench/startup_bench.h"
#include "cli/command.h"
#include "cli/commands.h"
#include "cli/common.h"

namespace ckpt::cli {

int RunBenchStartup(const BenchStartupArgs& args) {
  const optimizer::EngineKind engine =
      args.engine == "cuda" ? optimizer::EngineKind::kCuda : optimizer::EngineKind::kCpu;
  absl::StatusOr<bench::StartupFigures> f =
      bench::RunStartupBench({.params = args.params, .engine = engine});
  if (!f.ok()) return ReportError("bench startup", f.status());
  if (args.json) {
    PrintJson({{"params", args.params},
               {"engine", args.engine},
               {"slab_bytes", f->slab_bytes},
               {"create_seconds", f->create_seconds},
               {"touch_gbps", f->touch_gbps},
               {"pin_gbps", f->pin_gbps},
               {"bound_seconds", f->bound_seconds},
               {"ratio", f->ratio}});
    return kExitOk;
  }
  std::cout << absl::StrFormat(
      "StagedAdamW of %d parameters, %s engine, slabs %s\n"
      "create %7.2f s (%.2f GB/s of slab)   bound %7.2f s (first touch on every core %.2f GB/s"
      "%s)   ratio %.2f\n",
      args.params, args.engine, FormatBytes(f->slab_bytes), f->create_seconds,
      static_cast<double>(f->slab_bytes) / f->create_seconds / 1e9, f->bound_seconds,
      f->touch_gbps,
      engine == optimizer::EngineKind::kCuda ? absl::StrFormat(", then pinning %.2f GB/s",
                                                               f->pin_gbps)
                                             : "",
      f->ratio);
  return kExitOk;
}

Command AddBenchStartupCommand(CLI::App& bench) {
  auto args = std::make_shared<BenchStartupArgs>();
  CLI::App* cmd = bench.add_subcommand(
      "startup", "Building a StagedAdamW against the host's first-touch and pinning rates");
  cmd->add_option("--params", args->params, "Parameters (BF16 weights)")
      ->required()
      ->check(WholeNumber(1, UINT64_MAX / 16));
  cmd->add_option("--engine", args->engine, "cpu or cuda")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  cmd->add_flag("--json", args->json, "Print one JSON object");
  return WhenParsed(cmd, [args] { return RunBenchStartup(*args); });
}

}  // namespace ckpt::cli
