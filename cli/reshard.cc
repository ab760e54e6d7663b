// ckpt-tool reshard ROOT DST --dp R: a committed step rewritten as R ranks' files, laid out as
// the optimizer lays them out for DP size R, through the library's Reshard
// (ckpt/optimizer/reshard.h): one transaction into DST, in bounded memory, with a progress bar
// on a terminal.
#include <iostream>
#include <memory>

#include "absl/strings/str_cat.h"
#include "ckpt/checkpoint_store.h"
#include "ckpt/optimizer/reshard.h"
#include "cli/command.h"
#include "cli/commands.h"
#include "cli/common.h"

namespace ckpt::cli {

int RunReshard(const ReshardArgs& args) {
  OpenedStep opened;
  if (int code = OpenStepOrReport("reshard", args.root, args.step, &opened); code != kExitOk) {
    return code;
  }
  const CheckpointReader& reader = *opened.reader;
  optimizer::ReshardOptions options;
  options.dp = args.dp;
  options.buckets.bucket_elems = args.bucket_elems;
  if (args.zstd_level.has_value()) {
    options.store.codec = formats::Codec::kZstd;
    options.store.zstd_level = *args.zstd_level;
  }
  ProgressBar bar("reshard", 0, !args.json);
  options.progress = [&](uint64_t done, uint64_t total) {
    bar.SetTotal(total);
    bar.Update(done);
  };
  absl::StatusOr<optimizer::ReshardReport> report =
      optimizer::Reshard(reader, args.dst, options);
  bar.Finish();
  if (!report.ok()) {
    ReportError("reshard", report.status());
    return absl::IsDataLoss(report.status()) ? kExitDamage : kExitUsage;
  }
  if (args.json) {
    PrintJson({{"root", args.root},
               {"dst", args.dst},
               {"step", report->step},
               {"from_ranks", report->source_world_size},
               {"dp", report->dp},
               {"tensors", report->tensors},
               {"bytes", report->bytes},
               {"optimizer", report->optimizer_layout}});
  } else {
    std::cout << "resharded step " << report->step << " of " << Printable(args.root) << " from "
              << report->source_world_size << " to " << report->dp << " rank(s) into "
              << Printable(args.dst) << " (" << report->tensors << " tensors, "
              << FormatBytes(report->bytes)
              << (report->optimizer_layout ? ", optimizer layout" : ", one parameter per tensor")
              << ")\n";
  }
  return kExitOk;
}

Command AddReshardCommand(CLI::App& app) {
  struct Parsed {
    ReshardArgs args;
    uint64_t step = 0;  // Into args.step when given.
    int zstd = 0;       // Into args.zstd_level when given.
  };
  auto parsed = std::make_shared<Parsed>();
  ReshardArgs& args = parsed->args;
  CLI::App* cmd = app.add_subcommand(
      "reshard", "Rewrite a committed step for another data-parallel size, as a transaction into "
                 "DST (bounded memory)");
  cmd->add_option("root", args.root, "Checkpoint root")->required();
  cmd->add_option("dst", args.dst, "Output checkpoint root (created if absent)")->required();
  cmd->add_option("--dp", args.dp, "Ranks of the output (1 to 1024)")
      ->required()
      ->check(WholeNumber(1, 1024));
  cmd->add_option("--bucket-elems", args.bucket_elems,
                  "The next job's bucket size in elements (default 40000000)")
      ->check(WholeNumber(1, UINT64_MAX));
  CLI::Option* step_opt =
      cmd->add_option("--step", parsed->step, "Step to reshard (default: LATEST)")
          ->check(WholeNumber(0, UINT64_MAX));
  CLI::Option* zstd_opt =
      cmd->add_option("--zstd", parsed->zstd, "Compress chunks with zstd at LEVEL (1 to 22)")
          ->check(WholeNumber(1, 22));
  cmd->add_flag("--json", args.json, "Print one JSON object");
  return WhenParsed(cmd, [parsed, step_opt, zstd_opt] {
    if (step_opt->count() > 0) parsed->args.step = parsed->step;
    if (zstd_opt->count() > 0) parsed->args.zstd_level = parsed->zstd;
    return RunReshard(parsed->args);
  });
}

}  // namespace ckpt::cli
