// What `ckpt-tool bench io` and `ckpt-tool bench safetensors` measure, with the bound each
// figure is compared with (DESIGN.md §8), measured in the same run on the same disk. These
// measurements need libckpt's internals (huge-page O_DIRECT buffers, the readers' pooled bounce
// buffers), so they live here, beside them, and not in cli/. Not installed: this header is for
// ckpt-tool only, not part of the public API. Functions never print; ckpt-tool prints.
#ifndef CKPT_LIBCKPT_BENCH_STORE_BENCH_H_
#define CKPT_LIBCKPT_BENCH_STORE_BENCH_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "ckpt/checkpoint_store.h"
#include "ckpt/coordinator.h"
#include "ckpt/env.h"
#include "ckpt/formats/safetensors.h"
#include "ckpt/options.h"

namespace ckpt::bench {

// Progress of a benchmark, always called on the thread that called the benchmark: `phase`
// names the step under way ("raw x1", "raw x4", "save", "load"), `done` of `total` units (bytes;
// batches for "load"). The last call of a phase that succeeds has done == total.
using PhaseProgress = std::function<void(std::string_view phase, uint64_t done, uint64_t total)>;

// What RunIoBench measures, and where. A plain value; the caller keeps `env` alive for the
// call, and `progress` is called only during it.
struct IoBenchOptions {
  Env* env = nullptr;  // Null: Env::Default().
  // An existing directory: the scratch files of the raw bound and the store (dir/ckpt-bench)
  // go there.
  std::string dir;
  uint64_t bytes = 0;  // Bytes of FP32 state; a positive multiple of 4.
  int ranks = 1;       // Ranks, run as threads of this process, each saving and loading a range.
  std::optional<int> zstd_level;  // Compress chunks with zstd at this level; raw without.
  int write_threads = StoreOptions{}.write_threads;  // StoreOptions::write_threads.
  bool keep = false;              // Keep the committed step; otherwise the store is removed.
  PhaseProgress progress;         // Optional.
};

// What RunIoBench measured: each figure and the bound it is compared with, in GB/s (1e9 bytes
// per second: of state, except the read bound, which counts the data files' bytes); the caller
// divides for the ratios. A plain value.
struct IoFigures {
  std::string root;   // The store: dir/ckpt-bench.
  uint64_t step = 0;  // The step saved (one past the root's latest).
  double save_gbps = 0;
  // The best sequential O_DIRECT write of `bytes` through the Env, with one stream and with
  // four concurrent ones, so a parallel store is never compared with a serial bound.
  double write_bound_gbps = 0;
  double load_gbps = 0;
  // Paired with the load: the step's data files read raw (RawReadOnGrid) in batches, each next
  // to the load of the matching part of every rank's range. Same bytes, same moment.
  double read_bound_gbps = 0;
};

// Measures the raw write bound in `options.dir`, then saves synthetic state shaped like trained
// weights through CheckpointStore (ranks as threads, one ThreadGroup), loads it back range by
// range, checks that every byte came back, and pairs the load with raw reads of the same files.
// Buffers are laid out as the optimizer's slabs are (2 MiB-aligned, MADV_HUGEPAGE). Returns
// kInvalidArgument for a size that is zero or not a multiple of 4, or fewer than one rank;
// errors of the raw bound annotated "raw bound"; kResourceExhausted when memory (twice `bytes`)
// or the disk runs out; kDataLoss when the loaded state differs from the saved one; any error
// of the store. On failure the store is left in place for inspection; the raw bound's scratch
// files are removed in any case (and by a later run, after a crash).
absl::StatusOr<IoFigures> RunIoBench(const IoBenchOptions& options);

// The bounds of `bench ckpt`: the best sequential O_DIRECT write of `bytes` into the existing
// directory `dir` (one and four streams; scratch files removed), and a raw O_DIRECT read of every
// data file of the step directory `step_dir` at once (`threads` per file, on the readers' grid
// and buffers), both in GB/s (1e9 bytes per second; the read counts the files' bytes). IO errors
// as they come.
absl::StatusOr<double> RawWriteBoundGbps(Env* env, const std::string& dir, uint64_t bytes);
absl::StatusOr<double> RawReadStepGbps(Env* env, const std::string& step_dir, int threads);

// The number of batches each round of RunSafetensorsBench reads (fewer when there are fewer
// tensors).
inline constexpr int kSafetensorsBatches = 8;

// What RunSafetensorsBench measures, and where. A plain value; the caller keeps `env` alive for
// the call.
struct SafetensorsBenchOptions {
  Env* env = nullptr;  // Null: Env::Default().
  // An existing directory: each round writes dir/ckpt-bench-safetensors and removes it.
  std::string dir;
  formats::StDType dtype = formats::StDType::kBF16;  // BF16, F16 or F32.
  int tensors = 64;                                  // At least 1.
  uint64_t elems_per_tensor = 0;                     // At least 1.
  int rounds = 3;                                    // At least 1.
  int threads = 8;                                   // Reader threads, at least 1.
};

// One round of RunSafetensorsBench: a fresh file written, then read through the reader and raw,
// batch by batch. A plain value.
struct SafetensorsRound {
  double read_gbps = 0;   // File bytes per second, read into FP32 through HfCheckpointReader.
  double bound_gbps = 0;  // The same byte ranges read raw with O_DIRECT, paired batch by batch.
  uint64_t file_bytes = 0;
  double ratio() const { return read_gbps / bound_gbps; }
};

// Every round of RunSafetensorsBench, the worst first; a benchmark reports the median round
// and the spread of the ratios. A plain value.
struct SafetensorsFigures {
  std::vector<SafetensorsRound> rounds;  // Sorted by ratio, lowest first; never empty.
  const SafetensorsRound& median() const { return rounds[rounds.size() / 2]; }
};

// Writes a synthetic safetensors file with WriteHfCheckpoint, then reads every tensor into FP32
// through HfCheckpointReader in kSafetensorsBatches batches of about equal bytes, each paired
// with a raw O_DIRECT read of the same bytes (the first of the pair alternating by batch and
// round); repeats for `rounds` rounds. Returns kInvalidArgument for an unsupported dtype or a
// count below its minimum; kResourceExhausted when memory or the disk runs out; any error of
// the writer or the reader. The scratch directory is removed (best effort) after every round,
// failed or not.
absl::StatusOr<SafetensorsFigures> RunSafetensorsBench(const SafetensorsBenchOptions& options);

// The raw side of a paired read bound: reads [lo, hi) of `file` (4 KiB-aligned) with O_DIRECT
// in requests cut on the file's absolute 8 MiB grid, as our readers cut them, with `threads`
// threads, each a contiguous run of requests, into the readers' own pooled bounce buffers (on a
// VM the host's DMA speed depends on the memory read into, up to 2-3x, so separate buffers
// would compare memory blocks, not readers). Returns the first read error, or
// kResourceExhausted when no bounce buffer can be had. REQUIRES: lo <= hi <= file.size().
absl::Status RawReadOnGrid(const RandomAccessFile& file, uint64_t lo, uint64_t hi, int threads);

// The handles of a job of `group.size()` ranks on `root`, indexed by rank, each opened on a
// thread of its own with OpenStoreOnRanks (rank 0's is the primary), as a job's ranks open
// theirs. Errors as OpenStoreOnRanks.
absl::StatusOr<std::vector<std::unique_ptr<CheckpointStore>>> OpenStoresOnThreads(
    const std::string& root, const StoreOptions& options, ThreadGroup& group);

}  // namespace ckpt::bench

#endif  // CKPT_LIBCKPT_BENCH_STORE_BENCH_H_
