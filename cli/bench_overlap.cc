// ckpt-tool bench overlap: how much of the optimizer step an overlapped step hides behind a
// synthetic backward, against the plain step and the bound of the same run. The measuring is
// ckpt::bench::RunOverlapBench (optimizer/bench); this file prints.
#include <algorithm>
#include <iostream>
#include <memory>

#include "absl/strings/str_format.h"
#include "ckpt/bench/overlap_bench.h"
#include "cli/command.h"
#include "cli/commands.h"
#include "cli/common.h"

namespace ckpt::cli {

int RunBenchOverlap(const BenchOverlapArgs& args) {
  bench::OverlapBenchOptions o;
  o.params = args.params;
  o.buckets = args.buckets;
  o.backward_seconds = args.backward_ms / 1e3;
  o.engine = args.engine == "cuda" ? optimizer::EngineKind::kCuda : optimizer::EngineKind::kCpu;
  o.moments = args.moments == "BF16" ? optimizer::MomentDType::kBF16 : optimizer::MomentDType::kF32;
  o.threads = args.threads;
  o.unit_bytes = args.unit_bytes;
  o.steps = args.steps;
  o.clip_fires = args.clip_fires;
  o.gate = args.gate;
  o.window = args.window;
  absl::StatusOr<bench::OverlapFigures> f = bench::RunOverlapBench(o);
  if (!f.ok()) return ReportError("bench overlap", f.status());
  // The optimizer time a training step still waits for: the step minus its backward.
  const double plain_exposed = f->plain_seconds - f->backward_seconds;
  const double exposed = f->overlap_seconds - f->backward_seconds;
  const double ratio = f->overlap_seconds / f->bound_seconds;
  if (args.json) {
    PrintJson({{"params", args.params},
               {"buckets", args.buckets},
               {"engine", f->engine},
               {"moments", args.moments},
               {"clip_fires", args.clip_fires},
               {"gate", args.gate},
               {"backward_seconds", f->backward_seconds},
               {"plain_seconds", f->plain_seconds},
               {"overlap_seconds", f->overlap_seconds},
               {"plain_exposed_seconds", plain_exposed},
               {"exposed_seconds", exposed},
               {"step_bound_seconds", f->step_bound_seconds},
               {"bound_gbps", f->bound_gbps},
               {"bytes_per_param", f->bytes_per_param},
               {"bound_seconds", f->bound_seconds},
               {"ratio", ratio},
               {"release_seconds", f->release_seconds},
               {"release_calls", f->release_calls},
               {"speculated_units", f->speculated_units},
               {"speculation_held", f->speculation_held},
               {"device_bytes", f->device_bytes}});
    return kExitOk;
  }
  const bool cuda = o.engine == optimizer::EngineKind::kCuda;
  std::cout << absl::StrFormat(
      "StagedAdamW of %d parameters in %d buckets, %s, %s moments%s%s\n"
      "backward alone %8.2f ms\n"
      "plain          %8.2f ms   optimizer exposed %8.2f ms\n"
      "overlapped     %8.2f ms   optimizer exposed %8.2f ms   (%d units during backward, %s)\n"
      "bound          %8.2f ms   the step alone at the bound %.2f ms (%s %.1f GB/s, %.0f B/param"
      "%s)\n"
      "overlapped / bound %.2f   plain / bound %.2f\n"
      "host time in Release %.3f ms per step (%d calls, %.1f us each)\n",
      args.params, args.buckets, f->engine, args.moments,
      args.clip_fires ? ", clipping fires" : "", args.gate ? ", gated" : "",
      f->backward_seconds * 1e3, f->plain_seconds * 1e3,
      plain_exposed * 1e3, f->overlap_seconds * 1e3, exposed * 1e3, f->speculated_units,
      f->speculation_held ? "held" : "redone", f->bound_seconds * 1e3,
      f->step_bound_seconds * 1e3, cuda ? "duplex PCIe, slower direction" : "host memory triad",
      f->bound_gbps, f->bytes_per_param, cuda ? " each way" : "", ratio,
      f->plain_seconds / f->bound_seconds, f->release_seconds * 1e3, f->release_calls,
      f->release_seconds * 1e6 / std::max(1, f->release_calls));
  return kExitOk;
}

Command AddBenchOverlapCommand(CLI::App& bench) {
  auto args = std::make_shared<BenchOverlapArgs>();
  CLI::App* cmd = bench.add_subcommand(
      "overlap",
      "An overlapped step behind a synthetic backward against the plain step and the bound");
  cmd->add_option("--params", args->params, "Parameters (BF16 weights)")
      ->check(WholeNumber(1, UINT64_MAX / 32));
  cmd->add_option("--buckets", args->buckets,
                  "Layers of the backward, each released when done (default 24)")
      ->check(WholeNumber(1, 100000));
  cmd->add_option("--backward-ms", args->backward_ms,
                  "The whole synthetic backward in ms (default 50)")
      ->check(CLI::Range(0.001, 1e6));
  cmd->add_option("--engine", args->engine, "cpu or cuda")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  cmd->add_option("--moments", args->moments, "F32 (default) or BF16")
      ->check(CLI::IsMember({"F32", "BF16"}));
  cmd->add_option("--threads", args->threads, "CPU engine threads (0: every core)")
      ->check(WholeNumber(0, 1024));
  cmd->add_option("--unit-bytes", args->unit_bytes, "The optimizer's unit (0: its default, 8 MiB)")
      ->check(WholeNumber(0, uint64_t{1} << 40));
  cmd->add_option("--steps", args->steps, "Timed steps of each kind (best is reported)")
      ->check(WholeNumber(1, 1000));
  cmd->add_flag("--clip-fires", args->clip_fires,
                "Finish with another scale than the speculation's: the step is redone");
  cmd->add_flag("--gate", args->gate,
                "Gate the overlapped step (CUDA engine): a window of units during "
                "backward, the rest at Finish, then every unit awaited");
  cmd->add_option("--window", args->window,
                  "With --gate: units on the device at once during backward (default 8)")
      ->check(WholeNumber(1, 1 << 20));
  cmd->add_flag("--json", args->json, "Print one JSON object");
  return WhenParsed(cmd, [args] { return RunBenchOverlap(*args); });
}

}  // namespace ckpt::cli
