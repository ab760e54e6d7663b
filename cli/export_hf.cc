// ckpt-tool export-hf ROOT OUT: a committed step's model as HuggingFace safetensors, through
// the library's ExportHf (ckpt/optimizer/export_hf.h), in bounded memory, with a progress bar on
// a terminal.
#include <iostream>
#include <memory>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "ckpt/checkpoint_store.h"
#include "ckpt/optimizer/export_hf.h"
#include "cli/command.h"
#include "cli/commands.h"
#include "cli/common.h"

namespace ckpt::cli {

int RunExportHf(const ExportHfArgs& args) {
  optimizer::ExportHfOptions options;
  if (!args.dtype.empty()) {
    absl::StatusOr<formats::DType> dtype = formats::ParseDType(absl::AsciiStrToUpper(args.dtype));
    if (!dtype.ok() || (*dtype != formats::DType::kF32 && *dtype != formats::DType::kBF16 &&
                        *dtype != formats::DType::kF16)) {
      return ReportError("export-hf", absl::InvalidArgumentError(absl::StrCat(
                                          "--dtype ", Printable(args.dtype),
                                          ": expected BF16, F16 or F32")));
    }
    options.dtype = *dtype;
  }
  if (args.from == "masters") {
    options.from = optimizer::ExportFrom::kMasters;
  } else if (args.from != "weights") {
    return ReportError("export-hf",
                       absl::InvalidArgumentError(absl::StrCat(
                           "--from ", Printable(args.from), ": expected weights or masters")));
  }
  absl::StatusOr<uint64_t> shard = ParseByteSize(args.max_shard_size);
  if (!shard.ok()) return ReportError("export-hf --max-shard-size", shard.status());
  options.max_shard_bytes = *shard;
  options.config = args.config;
  OpenedStep opened;
  if (int code = OpenStepOrReport("export-hf", args.root, args.step, &opened); code != kExitOk) {
    return code;
  }
  const CheckpointReader& reader = *opened.reader;
  ProgressBar bar("export", 0, !args.json);
  options.progress = [&](uint64_t done, uint64_t total) {
    bar.SetTotal(total);
    bar.Update(done);
  };
  absl::StatusOr<optimizer::ExportHfReport> report =
      optimizer::ExportHf(reader, args.out, options);
  bar.Finish();
  if (!report.ok()) {
    ReportError("export-hf", report.status());
    return absl::IsDataLoss(report.status()) ? kExitDamage : kExitUsage;
  }
  const uint64_t step = reader.step();
  if (args.json) {
    PrintJson({{"root", args.root},
               {"step", step},
               {"out", args.out},
               {"from", args.from},
               {"tensors", report->tensors},
               {"bytes", report->bytes},
               {"sharded", report->sharded},
               {"config", !args.config.empty()}});
  } else {
    std::cout << "exported step " << step << " of " << Printable(args.root) << " ("
              << report->tensors << " tensors, " << FormatBytes(report->bytes) << ", " << args.from
              << ") to " << Printable(args.out)
              << (report->sharded ? " as shards with model.safetensors.index.json"
                                  : " as model.safetensors")
              << (args.config.empty() ? "" : ", with config.json") << "\n";
  }
  return kExitOk;
}

Command AddExportHfCommand(CLI::App& app) {
  struct Parsed {
    ExportHfArgs args;
    uint64_t step = 0;  // Into args.step when given.
  };
  auto parsed = std::make_shared<Parsed>();
  ExportHfArgs& args = parsed->args;
  CLI::App* cmd = app.add_subcommand(
      "export-hf", "Write a committed step's model as HuggingFace safetensors (bounded memory)");
  cmd->add_option("root", args.root, "Checkpoint root")->required();
  cmd->add_option("out", args.out, "Output directory (created if absent)")->required();
  CLI::Option* step_opt =
      cmd->add_option("--step", parsed->step, "Step to export (default: LATEST)")
          ->check(WholeNumber(0, UINT64_MAX));
  cmd->add_option("--dtype", args.dtype, "BF16, F16 or F32 (default: each tensor's own dtype)");
  cmd->add_option("--from", args.from,
                  "weights (the model-dtype weights) or masters (the FP32 masters)");
  cmd->add_option("--max-shard-size", args.max_shard_size,
                  "Shard the output at this many bytes (default 5G)");
  cmd->add_option("--config", args.config, "config.json to copy beside the weights");
  cmd->add_flag("--json", args.json, "Print one JSON object");
  return WhenParsed(cmd, [parsed, step_opt] {
    if (step_opt->count() > 0) parsed->args.step = parsed->step;
    return RunExportHf(parsed->args);
  });
}

}  // namespace ckpt::cli
