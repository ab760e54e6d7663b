// What `ckpt-tool bench ckpt` measures: optimizer state saved and loaded through Checkpointer,
// against the disk's bounds measured in the same run (DESIGN.md §8). Not installed: for
// ckpt-tool only. Functions never print.
#ifndef CKPT_OPTIMIZER_BENCH_CKPT_BENCH_H_
#define CKPT_OPTIMIZER_BENCH_CKPT_BENCH_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "ckpt/options.h"
#include "ckpt/optimizer/staged_adamw.h"

namespace ckpt::bench {

// A plain value.
struct CkptBenchOptions {
  std::string dir;      // An existing directory; the store is dir/ckpt-bench-optimizer.
  uint64_t params = 0;  // Parameters in all (BF16 weights, FP32 masters and moments).
  int ranks = 1;        // Data-parallel ranks, run as threads.
  // Parameters ("w.0", "w.1", ...) the elements are split into, about equally (each rank saves
  // its share of the flat order: the pieces of the parameters that cross it).
  uint64_t tensors = 1;
};

// Each figure in GB/s of state (14 bytes per parameter: weights, master, two moments) and the
// bound beside it. A plain value.
struct CkptFigures {
  uint64_t state_bytes = 0;
  double save_gbps = 0;
  double write_bound_gbps = 0;  // Best sequential O_DIRECT write of the same bytes.
  double load_gbps = 0;         // Load whose undo source is a committed step (free).
  double load_spill_gbps = 0;   // Load that first spills the state as its undo source.
  double load_fresh_gbps = 0;   // A new process's resume: fresh optimizers, undo re-derived.
  double read_bound_gbps = 0;   // Raw O_DIRECT read of the loaded step's data files.
  double spill_bound_gbps = 0;  // The write bound then the read bound, in sequence.
};

// Saves step 1 and step 2 through one Checkpointer per rank, loads step 1 (undo source: step 2,
// free), steps once and loads step 1 again (undo source: a spill), then loads step 1 into
// fresh optimizers as a new process would (undo re-derived, nothing written), and measures the
// bounds in the same directory. kInvalidArgument for no parameters or ranks; errors of the optimizer and
// the store as they come. The store is removed afterwards.
absl::StatusOr<CkptFigures> RunCkptBench(const CkptBenchOptions& options);

// What `ckpt-tool bench async-save` measures: one rank's Checkpointer::SaveAsync while steps run,
// against a step without a save, a sync save of the same state, and the bounds (DESIGN.md §8).
struct AsyncSaveBenchOptions {
  std::string dir;      // An existing directory; the store is dir/ckpt-bench-async.
  uint64_t params = 0;  // BF16 weights, FP32 masters and moments.
  optimizer::EngineKind engine = optimizer::EngineKind::kCpu;
  uint64_t staging_bytes = uint64_t{1} << 30;  // CheckpointerOptions::async_staging_bytes.
  int steps = 3;                               // Steps timed without a save (median).
  int rounds = 3;                              // Sync save + async save pairs.
  // Milliseconds between steps during an async save: what a trainer's forward and backward
  // take between optimizer steps (0: steps back to back, the worst case for the writer).
  int step_gap_ms = 0;
  int write_threads = StoreOptions{}.write_threads;  // StoreOptions::write_threads.
};

struct AsyncSaveFigures {
  uint64_t state_bytes = 0;             // 14 bytes per parameter.
  double return_ms = 0;                 // SaveAsync's call until it returned: the longest.
  double step_ms = 0;                   // Median step without a save in flight.
  double step_during_save_ms = 0;       // Per round the mean step while the writer wrote; median.
  int steps_during_save = 0;            // In all rounds.
  // SaveAsync's call until the writer finished (data durable, this rank's part written; a
  // watcher thread polls every 100 us), plus the Finalize that then votes and publishes: when
  // the step is durable had the trainer called Finalize at once; median.
  double durable_s = 0;
  double writer_s = 0;                  // SaveAsync's call until the writer finished; median.
  double finalize_ms = 0;               // Finalize, called after the writer finished; median.
  // SaveAsync's call until Finalize returned, called after the step that was running when the
  // writer finished (as a trainer that finalizes between steps does); median.
  double finalized_s = 0;
  double retention_s = 0;  // Deleting the step before last after each save, untimed above: longest.
  double sync_save_s = 0;               // Checkpointer::Save of the same state; median.
  double durable_ratio = 0;             // Per round durable / sync save; median.
  double write_bound_gbps = 0;          // Best sequential O_DIRECT write of the same bytes.
  // The same write while steps run as during the async saves (back to back, or step_gap_ms
  // apart), with no save in flight: what the disk gives while the steps load memory and PCIe.
  double write_bound_during_steps_gbps = 0;
  double copy_bound_gbps = 0;           // memcpy of the same bytes into touched memory.
  uint64_t units = 0, units_copied = 0, bytes_copied = 0, step_waits = 0;  // Summed over rounds.
};

// Times steps, makes one untimed async save (the staging pool is made and faulted in by a
// Checkpointer's first), then `rounds` times: a sync save, then SaveAsync and steps (back to
// back, or step_gap_ms apart) until the writer is done, then Finalize. kInvalidArgument for no parameters; kUnimplemented /
// kFailedPrecondition for the CUDA engine where it cannot run. The store is removed afterwards.
absl::StatusOr<AsyncSaveFigures> RunAsyncSaveBench(const AsyncSaveBenchOptions& options);

}  // namespace ckpt::bench

#endif  // CKPT_OPTIMIZER_BENCH_CKPT_BENCH_H_
