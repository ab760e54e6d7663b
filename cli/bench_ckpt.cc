// ckpt-tool bench ckpt: optimizer state saved and loaded through Checkpointer (load with the
// free undo source and with the undo spill), each against the O_DIRECT bound measured in the
// same run. The measuring is ckpt::bench::RunCkptBench (optimizer/bench); this file prints.
#include <iostream>
#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "ckpt/bench/ckpt_bench.h"
#include "cli/command.h"
#include "cli/commands.h"
#include "cli/common.h"

namespace ckpt::cli {

int RunBenchCkpt(const BenchCkptArgs& args) {
  absl::StatusOr<bool> is_dir = Env::Default()->IsDirectory(args.dir);
  if (!is_dir.ok() || !*is_dir) {
    return ReportError("bench ckpt", absl::NotFoundError(args.dir + ": not a directory"));
  }
  // Slabs (12 B), weights (2 B) and gradients (4 B) per parameter, and each rank's tables of
  // the tensors (some hundred bytes each, counted as 512).
  const uint64_t tables = args.tensors * static_cast<uint64_t>(args.ranks) * 512;
  absl::Status fits = CheckFitsInMemory(
      args.params > (UINT64_MAX - tables) / 18 ? UINT64_MAX : args.params * 18 + tables,
      absl::StrCat("bench ckpt --params ", args.params, " --tensors ", args.tensors));
  if (!fits.ok()) return ReportError("bench ckpt", fits);
  absl::StatusOr<bench::CkptFigures> f = bench::RunCkptBench({.dir = args.dir,
                                                              .params = args.params,
                                                              .ranks = args.ranks,
                                                              .tensors = args.tensors});
  if (!f.ok()) return ReportError("bench ckpt", f.status());
  const double save_ratio = f->save_gbps / f->write_bound_gbps;
  const double load_ratio = f->load_gbps / f->read_bound_gbps;
  const double spill_ratio = f->load_spill_gbps / f->spill_bound_gbps;
  const double fresh_ratio = f->load_fresh_gbps / f->read_bound_gbps;
  if (args.json) {
    PrintJson({{"params", args.params},
               {"ranks", args.ranks},
               {"tensors", args.tensors},
               {"state_bytes", f->state_bytes},
               {"save_gbps", f->save_gbps},
               {"write_bound_gbps", f->write_bound_gbps},
               {"save_ratio", save_ratio},
               {"load_gbps", f->load_gbps},
               {"load_spill_gbps", f->load_spill_gbps},
               {"read_bound_gbps", f->read_bound_gbps},
               {"load_ratio", load_ratio},
               {"spill_bound_gbps", f->spill_bound_gbps},
               {"load_spill_ratio", spill_ratio},
               {"load_fresh_gbps", f->load_fresh_gbps},
               {"load_fresh_ratio", fresh_ratio}});
    return kExitOk;
  }
  std::cout << absl::StrFormat(
      "optimizer state %s (%d rank(s), %d tensor(s), 14 B/param)\n"
      "save                  %6.2f GB/s   O_DIRECT write bound %6.2f GB/s   ratio %.2f\n"
      "load (undo: a step)   %6.2f GB/s   O_DIRECT read  bound %6.2f GB/s   ratio %.2f\n"
      "load (fresh process)  %6.2f GB/s   O_DIRECT read  bound %6.2f GB/s   ratio %.2f\n"
      "load (undo: a spill)  %6.2f GB/s   write then read    %6.2f GB/s   ratio %.2f\n",
      FormatBytes(f->state_bytes), args.ranks, args.tensors, f->save_gbps, f->write_bound_gbps, save_ratio,
      f->load_gbps, f->read_bound_gbps, load_ratio, f->load_fresh_gbps, f->read_bound_gbps,
      fresh_ratio, f->load_spill_gbps, f->spill_bound_gbps, spill_ratio);
  return kExitOk;
}

Command AddBenchCkptCommand(CLI::App& bench) {
  auto args = std::make_shared<BenchCkptArgs>();
  CLI::App* cmd = bench.add_subcommand(
      "ckpt", "Save and load optimizer state through Checkpointer against O_DIRECT bounds");
  cmd->add_option("--dir", args->dir, "Directory to benchmark in (must exist)")->required();
  cmd->add_option("--params", args->params, "Parameters (14 bytes of state each)")
      ->required()
      ->check(WholeNumber(1, UINT64_MAX));
  cmd->add_option("--ranks", args->ranks, "Ranks, run as threads")->check(WholeNumber(1, 256));
  cmd->add_option("--tensors", args->tensors,
                  "Parameters of about equal size the elements are split into")
      ->check(WholeNumber(1, 1u << 24));
  cmd->add_flag("--json", args->json, "Print one JSON object");
  return WhenParsed(cmd, [args] { return RunBenchCkpt(*args); });
}

}  // namespace ckpt::cli
