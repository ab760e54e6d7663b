// ckpt-tool reshard ROOT DST --dp R: a committed step rewritten as R ranks' files, laid out as
// the optimizer lays them out for DP size R, through the library's Reshard
// (ckpt/optimizer/reshard.h): one transaction into DST, in bounded memory, with a progress bar
// on a terminal.
#include <iostream>

#include "absl/strings/str_cat.h"
#include "ckpt/checkpoint_store.h"
#include "ckpt/optimizer/reshard.h"
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

}  // namespace ckpt::cli
