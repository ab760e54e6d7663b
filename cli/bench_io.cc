// ckpt-tool bench io: saves and loads synthetic state through the real store (ranks as threads)
// and, in the same run and directory, measures the raw O_DIRECT sequential write and read
// bandwidth that bounds them (DESIGN.md §8). Prints both figures, both bounds and the ratios.
// The measuring is ckpt::bench::RunIoBench (libckpt/bench); this file parses, checks and prints.
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "ckpt/bench/store_bench.h"
#include "cli/command.h"
#include "cli/commands.h"
#include "cli/common.h"

namespace ckpt::cli {
namespace {

// One ProgressBar per phase of the benchmark, labelled "save     " etc. (phases are never
// empty); a phase's bar is finished by its first report with done == total, or when the next
// phase begins. Not thread-safe (the benchmark reports on the calling thread).
class PhaseBars {
 public:
  explicit PhaseBars(bool enabled) : enabled_(enabled) {}

  void Update(std::string_view phase, uint64_t done, uint64_t total) {
    if (phase != phase_) {
      bar_.reset();  // Finishes the previous phase's bar first.
      phase_ = std::string(phase);
      bar_.emplace(absl::StrFormat("%-9s", phase_), total, enabled_);
    }
    if (!bar_.has_value()) return;  // This phase's bar is finished already.
    bar_->Update(done);
    if (done >= total) bar_.reset();
  }

 private:
  bool enabled_;
  std::string phase_;
  std::optional<ProgressBar> bar_;
};

}  // namespace

int RunBenchIo(const BenchIoArgs& args) {
  absl::StatusOr<uint64_t> size = ParseByteSize(args.size);
  if (!size.ok()) return ReportError("bench io", size.status());
  const uint64_t bytes = *size / 4 * 4;
  if (bytes == 0)
    return ReportError("bench io", absl::InvalidArgumentError("--size must be at least 4 bytes"));
  // The state, and the buffer it is loaded back into.
  absl::Status fits = CheckFitsInMemory(bytes > UINT64_MAX / 2 ? UINT64_MAX : 2 * bytes,
                                        absl::StrCat("bench io --size ", args.size));
  if (!fits.ok()) return ReportError("bench io", fits);
  Env* env = Env::Default();
  absl::StatusOr<bool> is_dir = env->IsDirectory(args.dir);
  if (!is_dir.ok() || !*is_dir) {
    return ReportError("bench io", absl::NotFoundError(args.dir + ": not a directory"));
  }
  bench::IoBenchOptions options;
  options.env = env;
  options.dir = args.dir;
  options.bytes = bytes;
  options.ranks = args.ranks;
  options.zstd_level = args.zstd_level;
  options.write_threads = args.write_threads;
  options.keep = args.keep;
  absl::StatusOr<bench::IoFigures> fig;
  {
    PhaseBars bars(!args.json);
    options.progress = [&bars](std::string_view phase, uint64_t done, uint64_t total) {
      bars.Update(phase, done, total);
    };
    fig = bench::RunIoBench(options);
  }
  if (!fig.ok()) return ReportError("bench io", fig.status());
  const double save_ratio = fig->save_gbps / fig->write_bound_gbps;
  const double load_ratio = fig->load_gbps / fig->read_bound_gbps;
  const std::string env_name = DefaultEnvFallbackReason().empty() ? "uring" : "posix";
  const std::string codec =
      args.zstd_level.has_value() ? absl::StrCat("zstd-", *args.zstd_level) : "raw";
  if (args.json) {
    PrintJson({{"dir", args.dir},
               {"root", fig->root},
               {"step", fig->step},
               {"kept", args.keep},
               {"size_bytes", bytes},
               {"ranks", args.ranks},
               {"write_threads", args.write_threads},
               {"env", env_name},
               {"codec", codec},
               {"save_gbps", fig->save_gbps},
               {"write_bound_gbps", fig->write_bound_gbps},
               {"save_ratio", save_ratio},
               {"load_gbps", fig->load_gbps},
               {"read_bound_gbps", fig->read_bound_gbps},
               {"load_ratio", load_ratio}});
  } else {
    std::cout << absl::StrFormat(
        "state %s, %d rank(s), %s env, codec %s, %d write thread(s) per rank\n"
        "save  %6.2f GB/s   O_DIRECT write bound %6.2f GB/s   ratio %.2f\n"
        "load  %6.2f GB/s   O_DIRECT read  bound %6.2f GB/s   ratio %.2f\n",
        FormatBytes(bytes), args.ranks, env_name, codec, args.write_threads, fig->save_gbps, fig->write_bound_gbps,
        save_ratio, fig->load_gbps, fig->read_bound_gbps, load_ratio);
    if (args.keep) std::cout << "kept step " << fig->step << " in " << fig->root << "\n";
  }
  return kExitOk;
}

Command AddBenchIoCommand(CLI::App& bench) {
  auto args = std::make_shared<BenchIoArgs>();
  CLI::App* cmd = bench.add_subcommand(
      "io", "Save and load synthetic state; measure O_DIRECT write/read bounds");
  cmd->add_option("--dir", args->dir, "Directory to benchmark in (must exist)")->required();
  cmd->add_option("--size", args->size, "Bytes of state, e.g. 2G")->required();
  cmd->add_option("--ranks", args->ranks, "Ranks, run as threads")->check(WholeNumber(1, 256));
  cmd->add_option("--write-threads", args->write_threads,
                  "Threads that copy, checksum and write the chunks of each rank's save")
      ->check(WholeNumber(1, 64));
  cmd->add_option("--zstd", args->zstd_level, "Compress chunks with zstd at this level")
      ->check(WholeNumber(1, 19));
  cmd->add_flag("--keep", args->keep, "Keep the committed checkpoint for inspection");
  cmd->add_flag("--json", args->json, "Print one JSON object");
  return WhenParsed(cmd, [args] { return RunBenchIo(*args); });
}

}  // namespace ckpt::cli
