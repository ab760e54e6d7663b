// ckpt-tool bench async-save: how long Checkpointer::SaveAsync takes to return, the steps that
// run while its writer writes against steps without a save, the time until the step is durable
// against a sync save of the same state, and the bounds (O_DIRECT write; memcpy for the units a
// step copies aside). The measuring is ckpt::bench::RunAsyncSaveBench (optimizer/bench).
#include <iostream>
#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "ckpt/bench/ckpt_bench.h"
#include "cli/command.h"
#include "cli/commands.h"
#include "cli/common.h"

namespace ckpt::cli {
namespace {

// What the report derives from the figures.
struct Ratios {
  double step;       // A step during the save against one without.
  double durable;    // Until durable, async against sync (paired per round).
  double sync_gbps;  // The sync save's rate.
  // The async save's rate until durable against what the disk gives beside the same steps.
  double durable_vs_loaded;
};

Ratios RatiosOf(const bench::AsyncSaveFigures& f) {
  Ratios r;
  r.step = f.step_during_save_ms / f.step_ms;
  r.durable = f.durable_ratio;
  r.sync_gbps = static_cast<double>(f.state_bytes) / f.sync_save_s / 1e9;
  r.durable_vs_loaded =
      static_cast<double>(f.state_bytes) / f.durable_s / 1e9 / f.write_bound_during_steps_gbps;
  return r;
}

void PrintJsonReport(const BenchAsyncSaveArgs& args, uint64_t staging,
                     const bench::AsyncSaveFigures& f, const Ratios& r) {
  PrintJson({{"params", args.params},
             {"engine", args.engine},
             {"state_bytes", f.state_bytes},
             {"staging_bytes", staging},
             {"return_ms", f.return_ms},
             {"step_ms", f.step_ms},
             {"step_during_save_ms", f.step_during_save_ms},
             {"steps_during_save", f.steps_during_save},
             {"rounds", args.rounds},
             {"step_gap_ms", args.step_gap_ms},
             {"write_threads", args.write_threads},
             {"step_ratio", r.step},
             {"durable_s", f.durable_s},
             {"writer_s", f.writer_s},
             {"finalize_ms", f.finalize_ms},
             {"finalized_s", f.finalized_s},
             {"retention_s", f.retention_s},
             {"sync_save_s", f.sync_save_s},
             {"durable_ratio", r.durable},
             {"sync_save_gbps", r.sync_gbps},
             {"write_bound_gbps", f.write_bound_gbps},
             {"write_bound_during_steps_gbps", f.write_bound_during_steps_gbps},
             {"durable_vs_bound_during_steps", r.durable_vs_loaded},
             {"copy_bound_gbps", f.copy_bound_gbps},
             {"units", f.units},
             {"units_copied", f.units_copied},
             {"bytes_copied", f.bytes_copied},
             {"step_waits", f.step_waits}});
}

void PrintHumanReport(const BenchAsyncSaveArgs& args, uint64_t staging,
                      const bench::AsyncSaveFigures& f, const Ratios& r) {
  std::cout << absl::StrFormat(
      "optimizer state %s, %s engine, staging pool %s, %d round(s) of a sync then an async save "
      "(medians), steps %s, %d write thread(s)\n"
      "SaveAsync returned in      %8.2f ms (the longest)\n"
      "step without a save        %8.1f ms\n"
      "step during the save       %8.1f ms   (%d step(s) in all)   ratio %.2f\n"
      "until durable (async)      %8.3f s    (writer done %.3f s + Finalize %.1f ms; Finalize "
      "after the step then running returned at %.3f s)\n"
      "sync save                  %8.3f s    (%.2f GB/s; O_DIRECT write bound %.2f GB/s)   "
      "durable/sync, paired per round: %.2f\n"
      "beside the steps           O_DIRECT write bound %.2f GB/s with the same steps running and no "
      "save; the async save until durable reached %.2f of it\n"
      "units copied aside         %llu in all rounds, of %llu per save (%s; memcpy bound %.2f "
      "GB/s), steps waited %llu time(s)\n"
      "retention (the step before last deleted after each save, outside the times above): "
      "%.3f s at most\n",
      FormatBytes(f.state_bytes), args.engine, FormatBytes(staging), args.rounds,
      args.step_gap_ms == 0 ? std::string("back to back")
                            : absl::StrCat(args.step_gap_ms, " ms apart"),
      args.write_threads,
      f.return_ms,
      f.step_ms,
      f.step_during_save_ms, f.steps_during_save, r.step, f.durable_s, f.writer_s,
      f.finalize_ms, f.finalized_s, f.sync_save_s,
      r.sync_gbps, f.write_bound_gbps, r.durable, f.write_bound_during_steps_gbps,
      r.durable_vs_loaded,
      static_cast<unsigned long long>(f.units_copied), static_cast<unsigned long long>(f.units),
      FormatBytes(f.bytes_copied), f.copy_bound_gbps,
      static_cast<unsigned long long>(f.step_waits), f.retention_s);
}

}  // namespace

int RunBenchAsyncSave(const BenchAsyncSaveArgs& args) {
  absl::StatusOr<bool> is_dir = Env::Default()->IsDirectory(args.dir);
  if (!is_dir.ok() || !*is_dir) {
    return ReportError("bench async-save", absl::NotFoundError(args.dir + ": not a directory"));
  }
  absl::StatusOr<uint64_t> staging = ParseByteSize(args.staging);
  if (!staging.ok()) return ReportError("bench async-save --staging", staging.status());
  // Slabs (12 B), weights (2 B), gradients (4 B) per parameter, the copy bound's two buffers
  // (up to 1 GiB each) and the staging pool.
  const uint64_t per_param = 18;
  absl::Status fits = CheckFitsInMemory(
      args.params > (UINT64_MAX - *staging - (uint64_t{2} << 30)) / per_param
          ? UINT64_MAX
          : args.params * per_param + *staging + (uint64_t{2} << 30),
      absl::StrCat("bench async-save --params ", args.params));
  if (!fits.ok()) return ReportError("bench async-save", fits);
  bench::AsyncSaveBenchOptions o;
  o.dir = args.dir;
  o.params = args.params;
  o.engine = args.engine == "cuda" ? optimizer::EngineKind::kCuda : optimizer::EngineKind::kCpu;
  o.staging_bytes = *staging;
  o.steps = args.steps;
  o.rounds = args.rounds;
  o.step_gap_ms = args.step_gap_ms;
  o.write_threads = args.write_threads;
  absl::StatusOr<bench::AsyncSaveFigures> f = bench::RunAsyncSaveBench(o);
  if (!f.ok()) return ReportError("bench async-save", f.status());
  const Ratios r = RatiosOf(*f);
  if (args.json) {
    PrintJsonReport(args, *staging, *f, r);
    return kExitOk;
  }
  PrintHumanReport(args, *staging, *f, r);
  return kExitOk;
}

Command AddBenchAsyncSaveCommand(CLI::App& bench) {
  auto args = std::make_shared<BenchAsyncSaveArgs>();
  CLI::App* cmd = bench.add_subcommand(
      "async-save",
      "Checkpointer::SaveAsync with steps running, against a plain step, a sync save and the "
      "write and copy bounds");
  cmd->add_option("--dir", args->dir, "Directory to benchmark in (must exist)")->required();
  cmd->add_option("--params", args->params, "Parameters (14 bytes of state each)")
      ->required()
      ->check(WholeNumber(1, UINT64_MAX));
  cmd->add_option("--engine", args->engine, "cpu or cuda")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  cmd->add_option("--staging", args->staging,
                  "Staging pool for units a step changes before they are written, e.g. 1G");
  cmd->add_option("--steps", args->steps, "Steps timed without a save (median)")
      ->check(WholeNumber(1, 1000));
  cmd->add_option("--rounds", args->rounds,
                  "Rounds of a sync save then an async save (medians are reported)")
      ->check(WholeNumber(1, 100));
  cmd->add_option("--step-gap-ms", args->step_gap_ms,
                  "Milliseconds between steps during the save, as a trainer's forward and "
                  "backward (default 0: back to back)")
      ->check(WholeNumber(0, 60000));
  cmd->add_option("--write-threads", args->write_threads,
                  "Threads that copy, checksum and write the chunks of a save")
      ->check(WholeNumber(1, 64));
  cmd->add_flag("--json", args->json, "Print one JSON object");
  return WhenParsed(cmd, [args] { return RunBenchAsyncSave(*args); });
}

}  // namespace ckpt::cli
