// The subcommands of ckpt-tool. Each Run* returns the process exit code (see common.h).
#ifndef CKPT_CLI_COMMANDS_H_
#define CKPT_CLI_COMMANDS_H_

#include <cstdint>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "absl/status/statusor.h"
#include "ckpt/options.h"

namespace ckpt::cli {

struct InspectArgs {
  std::string root;
  std::optional<uint64_t> step;
  bool json = false;
};
int RunInspect(const InspectArgs& args);

struct VerifyArgs {
  std::string root;
  std::optional<uint64_t> step;
  bool all = false;
  bool json = false;
};
int RunVerify(const VerifyArgs& args);

struct GcArgs {
  std::string root;
  uint64_t keep_last = 0;
  uint64_t keep_every = 0;
  bool dry_run = false;
  bool purge_quarantine = false;
  bool json = false;
};
int RunGc(const GcArgs& args);

struct AdoptArgs {
  std::string root;
  uint64_t step = 0;
};
int RunAdopt(const AdoptArgs& args);

struct QuarantineArgs {
  std::string root;
  std::optional<uint64_t> step;
  bool all = false;
};
int RunQuarantine(const QuarantineArgs& args);

struct BenchIoArgs {
  std::string dir;
  std::string size = "256M";
  int ranks = 1;
  std::optional<int> zstd_level;
  int write_threads = StoreOptions{}.write_threads;
  bool keep = false;
  bool json = false;
};
int RunBenchIo(const BenchIoArgs& args);

struct BenchSafetensorsArgs {
  std::string dir;
  std::string size = "256M";
  std::string dtype = "BF16";
  int tensors = 64;
  int rounds = 3;
  int threads = 8;  // Reader threads.
  bool json = false;
};
int RunBenchSafetensors(const BenchSafetensorsArgs& args);

struct HfReshardArgs {
  std::string src;
  std::string dst;
  std::string max_shard_size;  // Empty: one model.safetensors.
  bool json = false;
};
int RunHfReshard(const HfReshardArgs& args);

struct BenchCkptArgs {
  std::string dir;
  uint64_t params = 0;
  int ranks = 1;
  uint64_t tensors = 1;
  bool json = false;
};
int RunBenchCkpt(const BenchCkptArgs& args);

struct BenchAsyncSaveArgs {
  std::string dir;
  uint64_t params = 0;
  std::string engine = "cpu";  // cpu or cuda.
  std::string staging = "1G";  // The async save's staging pool.
  int steps = 3;
  int rounds = 3;
  int step_gap_ms = 0;  // Between steps during the save (a trainer's forward and backward).
  int write_threads = StoreOptions{}.write_threads;
  bool json = false;
};
int RunBenchAsyncSave(const BenchAsyncSaveArgs& args);

struct DiffArgs {
  std::string a, b;
  std::optional<uint64_t> step, step_b;  // Of a ckpt root; LATEST when absent.
  double atol = 0;
  bool json = false;
};
int RunDiff(const DiffArgs& args);

struct ExportHfArgs {
  std::string root;
  std::string out;
  std::optional<uint64_t> step;  // LATEST when absent.
  std::string dtype;             // BF16, F16 or F32; empty keeps each tensor's dtype.
  std::string from = "weights";  // weights or masters.
  std::string max_shard_size = "5G";
  std::string config;  // A config.json to copy beside the weights.
  bool json = false;
};
int RunExportHf(const ExportHfArgs& args);

struct BenchStartupArgs {
  uint64_t params = 0;
  std::string engine = "cpu";  // cpu or cuda.
  bool json = false;
};
int RunBenchStartup(const BenchStartupArgs& args);

struct BenchReshardArgs {
  std::string dir;
  uint64_t params = 0;
  int ranks = 2;
  int dp = 3;
  bool json = false;
};
int RunBenchReshard(const BenchReshardArgs& args);

struct ReshardArgs {
  std::string root;
  std::string dst;
  int dp = 0;
  uint64_t bucket_elems = 40'000'000;
  std::optional<uint64_t> step;  // LATEST when absent.
  std::optional<int> zstd_level;
  bool json = false;
};
int RunReshard(const ReshardArgs& args);

struct BenchAdamwArgs {
  uint64_t params = 1 << 26;
  int threads = 0;                    // 0: every core.
  std::string engine = "cpu";         // cpu, cuda or both.
  std::string grad_dtype = "F32";     // CPU engine: F32, BF16 or F16 gradients.
  std::string caller_pages = "huge";  // CPU engine: gradient and parameter buffers' pages.
  std::string moments = "F32";        // CPU engine: moment dtype in the slabs, F32 or BF16.
  bool check_finite = false;          // CPU engine: steps check the gradients for NaN/Inf first.
  int steps = 5;
  bool json = false;
};
int RunBenchAdamw(const BenchAdamwArgs& args);

struct BenchOverlapArgs {
  uint64_t params = 1 << 26;
  int buckets = 24;
  double backward_ms = 50;
  std::string engine = "cpu";   // cpu or cuda.
  std::string moments = "F32";  // F32 or BF16.
  int threads = 0;              // CPU engine; 0: every core.
  uint64_t unit_bytes = 0;      // 0: the optimizer's default.
  int steps = 3;
  bool clip_fires = false;
  bool gate = false;
  uint32_t window = 8;
  bool json = false;
};
int RunBenchOverlap(const BenchOverlapArgs& args);

struct BenchMuonArgs {
  uint64_t rows = 1024, cols = 4096;
  int matrices = 8;
  int threads = 0;
  int steps = 3;
  std::string engine = "cpu";
  bool json = false;
};
int RunBenchMuon(const BenchMuonArgs& args);
// The CUDA half of bench adamw (bench_adamw_cuda.cc): kUnimplemented or kFailedPrecondition
// when no engine can be made.
absl::StatusOr<nlohmann::json> BenchAdamwCuda(const BenchAdamwArgs& args);

}  // namespace ckpt::cli

#endif  // CKPT_CLI_COMMANDS_H_
