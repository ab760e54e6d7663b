// ckpt-tool bench reshard: an offline reshard of synthetic optimizer state against reading plus
// writing it at the disk's O_DIRECT bounds measured in the same run, and the peak memory. The
// measuring is ckpt::bench::RunReshardBench (optimizer/bench); this file prints.
#include <iostream>
#include <memory>

#include "absl/strings/str_format.h"
#include "ckpt/bench/reshard_bench.h"
#include "cli/command.h"
#include "cli/commands.h"
#include "cli/common.h"

namespace ckpt::cli {

int RunBenchReshard(const BenchReshardArgs& args) {
  absl::StatusOr<bool> is_dir = Env::Default()->IsDirectory(args.dir);
  if (!is_dir.ok() || !*is_dir) {
    return ReportError("bench reshard", absl::NotFoundError(args.dir + ": not a directory"));
  }
  absl::StatusOr<bench::ReshardFigures> f = bench::RunReshardBench(
      {.dir = args.dir, .params = args.params, .ranks = args.ranks, .dp = args.dp});
  if (!f.ok()) return ReportError("bench reshard", f.status());
  const double ratio = f->gbps / f->bound_gbps;
  if (args.json) {
    PrintJson({{"params", args.params},
               {"ranks", args.ranks},
               {"dp", args.dp},
               {"state_bytes", f->state_bytes},
               {"seconds", f->seconds},
               {"gbps", f->gbps},
               {"read_bound_gbps", f->read_bound_gbps},
               {"write_bound_gbps", f->write_bound_gbps},
               {"bound_gbps", f->bound_gbps},
               {"ratio", ratio},
               {"peak_rss_bytes", f->peak_rss_bytes}});
    return kExitOk;
  }
  std::cout << absl::StrFormat(
      "reshard %s of optimizer state from %d to %d rank(s) in %.2f s\n"
      "reshard %6.2f GB/s   bound (O_DIRECT read %.2f then write %.2f GB/s) %6.2f GB/s   "
      "ratio %.2f\n"
      "peak RSS %s\n",
      FormatBytes(f->state_bytes), args.ranks, args.dp, f->seconds, f->gbps, f->read_bound_gbps,
      f->write_bound_gbps, f->bound_gbps, ratio, FormatBytes(f->peak_rss_bytes));
  return kExitOk;
}

Command AddBenchReshardCommand(CLI::App& bench) {
  auto args = std::make_shared<BenchReshardArgs>();
  CLI::App* cmd = bench.add_subcommand(
      "reshard", "Offline reshard of optimizer state against its O_DIRECT read + write bound");
  cmd->add_option("--dir", args->dir, "Directory to benchmark in (must exist)")->required();
  cmd->add_option("--params", args->params, "Parameters (14 bytes of state each)")
      ->required()
      ->check(WholeNumber(1, UINT64_MAX / 16));
  cmd->add_option("--ranks", args->ranks, "Ranks that save the source")
      ->check(WholeNumber(1, 256));
  cmd->add_option("--dp", args->dp, "Ranks of the output")->check(WholeNumber(1, 256));
  cmd->add_flag("--json", args->json, "Print one JSON object");
  return WhenParsed(cmd, [args] { return RunBenchReshard(*args); });
}

}  // namespace ckpt::cli
