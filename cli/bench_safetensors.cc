// ckpt-tool bench safetensors: writes a synthetic safetensors file with our writer, then reads
// every tensor into FP32 buffers through HfCheckpointReader and compares the rate (file bytes
// per second) with raw O_DIRECT reads of the same bytes, paired batch by batch in the same run.
// The measuring, and why it is paired, is ckpt::bench::RunSafetensorsBench
// (libckpt/bench/safetensors_bench.cc); this file parses, checks and prints the round with the
// median ratio.
#include <algorithm>
#include <iostream>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "ckpt/bench/store_bench.h"
#include "cli/command.h"
#include "cli/commands.h"
#include "cli/common.h"

namespace ckpt::cli {

int RunBenchSafetensors(const BenchSafetensorsArgs& args) {
  absl::StatusOr<uint64_t> size = ParseByteSize(args.size);
  if (!size.ok()) return ReportError("bench safetensors", size.status());
  absl::StatusOr<formats::StDType> dtype = formats::ParseStDType(args.dtype);
  if (!dtype.ok() || (*dtype != formats::StDType::kBF16 && *dtype != formats::StDType::kF16 &&
                      *dtype != formats::StDType::kF32)) {
    return ReportError("bench safetensors",
                       absl::InvalidArgumentError("--dtype must be BF16, F16 or F32"));
  }
  Env* env = Env::Default();
  const uint64_t esize = formats::StDTypeBits(*dtype) / 8;
  const int tensors = std::max(1, args.tensors);
  if (*size < esize * static_cast<uint64_t>(tensors)) {
    return ReportError("bench safetensors",
                       absl::InvalidArgumentError(absl::StrCat(
                           "--size ", args.size, " is less than one ", args.dtype,
                           " element per tensor (", tensors, " tensors x ", esize, " B)")));
  }
  const uint64_t elems = *size / esize / static_cast<uint64_t>(tensors);
  // The tensors' FP32 copies, plus one tensor's source bytes.
  absl::Status fits = CheckFitsInMemory(elems * static_cast<uint64_t>(tensors) * 4 + elems * esize,
                                        absl::StrCat("bench safetensors --size ", args.size));
  if (!fits.ok()) return ReportError("bench safetensors", fits);
  bench::SafetensorsBenchOptions options;
  options.env = env;
  options.dir = args.dir;
  options.dtype = *dtype;
  options.tensors = tensors;
  options.elems_per_tensor = elems;
  options.rounds = std::max(1, args.rounds);
  options.threads = args.threads;
  absl::StatusOr<bench::SafetensorsFigures> figures = bench::RunSafetensorsBench(options);
  if (!figures.ok()) return ReportError("bench safetensors", figures.status());
  const std::vector<bench::SafetensorsRound>& rounds = figures->rounds;
  const bench::SafetensorsRound& median = figures->median();
  const double gbps = median.read_gbps, bound = median.bound_gbps;
  const uint64_t file_bytes = median.file_bytes;
  nlohmann::json all = nlohmann::json::array();
  for (const bench::SafetensorsRound& r : rounds)
    all.push_back({{"read_to_f32_gbps", r.read_gbps},
                   {"read_bound_gbps", r.bound_gbps},
                   {"ratio", r.ratio()}});
  if (args.json) {
    PrintJson({{"file_bytes", file_bytes},
               {"dtype", args.dtype},
               {"tensors", tensors},
               {"read_to_f32_gbps", gbps},
               {"read_bound_gbps", bound},
               {"ratio", gbps / bound},
               {"rounds", all},
               {"threads", args.threads},
               {"batches", bench::kSafetensorsBatches},
               {"f32_output_bytes", elems * 4 * static_cast<uint64_t>(tensors)}});
  } else {
    std::cout << absl::StrFormat(
        "safetensors %s, %d %s tensors -> FP32, %d reader threads, median of %d rounds "
        "(ratios %.2f..%.2f)\n"
        "read  %6.2f GB/s (file bytes)   O_DIRECT read bound %6.2f GB/s (paired, %d batches)   "
        "ratio %.2f\n",
        FormatBytes(file_bytes), tensors, args.dtype, args.threads, static_cast<int>(rounds.size()),
        rounds.front().ratio(), rounds.back().ratio(), gbps, bound, bench::kSafetensorsBatches,
        gbps / bound);
  }
  return kExitOk;
}

Command AddBenchSafetensorsCommand(CLI::App& bench) {
  auto args = std::make_shared<BenchSafetensorsArgs>();
  CLI::App* cmd = bench.add_subcommand(
      "safetensors",
      "Read every tensor of a safetensors file into FP32; measure the O_DIRECT read bound");
  cmd->add_option("--dir", args->dir, "Directory to benchmark in (must exist)")->required();
  cmd->add_option("--size", args->size, "File size, e.g. 2G")->required();
  cmd->add_option("--dtype", args->dtype, "BF16, F16 or F32");
  cmd->add_option("--tensors", args->tensors, "Number of tensors")->check(WholeNumber(1, 100000));
  cmd->add_option("--threads", args->threads, "Reader threads")->check(WholeNumber(1, 256));
  cmd->add_option("--rounds", args->rounds,
                  "Rounds of (bound, write, read); the median is reported")
      ->check(WholeNumber(1, 100));
  cmd->add_flag("--json", args->json, "Print one JSON object");
  return WhenParsed(cmd, [args] { return RunBenchSafetensors(*args); });
}

}  // namespace ckpt::cli
