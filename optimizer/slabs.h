// StagedAdamW's slabs (one side of the state in host memory) and its open overlapped step
// (optimizer/overlap.cc, optimizer/overlap_feeder.cc). Not part of the API.
#ifndef CKPT_OPTIMIZER_SLABS_H_
#define CKPT_OPTIMIZER_SLABS_H_

#include "ckpt/optimizer/staged_adamw.h"
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#include "optimizer/engine.h"
#include "optimizer/host_buffer.h"

namespace ckpt::optimizer {

struct StagedAdamW::Slabs {
  // `elements` of each state tensor (the moments `moment_bytes` each, max_exp_avg_sq only with
  // `max`) and `aux_elements` of aux (none when 0), each staggered (internal::kSlabStagger) and
  // pinned with `pinned`; kResourceExhausted when memory runs out (internal::HostBuffer).
  static absl::StatusOr<std::unique_ptr<Slabs>> Allocate(uint64_t elements, size_t moment_bytes,
                                                         bool max, uint64_t aux_elements,
                                                         bool pinned);
  // `view` with these slabs as where a Step writes: an out-of-place pass (the spare side of an
  // overlapped step, SlabView::master_out).
  SlabView Into(SlabView view) const {
    view.master_out = reinterpret_cast<float*>(master.data());
    view.exp_avg_out = exp_avg.data();
    view.exp_avg_sq_out = exp_avg_sq.data();
    view.max_exp_avg_sq_out = max_exp_avg_sq.data();
    return view;
  }
  internal::HostBuffer master, exp_avg, exp_avg_sq;
  internal::HostBuffer max_exp_avg_sq;  // Allocated only with has_max_exp_avg_sq().
  internal::HostBuffer aux;             // FP32; allocated only when some rule keeps aux state.
};

struct StagedAdamW::OverlapState {
  StepArgs args;                     // Begin's, with `pieces` pointing at `buffers`.
  bool pieces_mode = false;          // Buffers come with Release, one per piece.
  std::vector<PieceBuffers> buffers;  // Per piece (pieces mode), null until released.
  bool speculate = true;
  StepPlan plan;                            // Every piece stepped at its next step count.
  std::vector<std::vector<uint32_t>> piece_units;  // Per piece, the units it lies in.
  std::vector<uint32_t> pending;            // Per unit: pieces not yet released.
  std::vector<uint8_t> released;            // Per piece.
  std::vector<uint8_t> speculated;          // Per unit.
  uint64_t speculated_units = 0;            // Written by the feeder; read after it joined.
  bool invalidated = false;  // Overlap::Invalidate: the speculation cannot hold.
  // A gated overlap (OverlapOptions::gate, CUDA engine): ready units wait in `waiting` (in the
  // order they became ready) until fewer than `window` are queued on the device (`in_flight`,
  // in the order sent); see StagedAdamW::Pump.
  bool gate = false;
  uint32_t window = 1;
  std::vector<uint32_t> waiting;
  std::deque<uint32_t> in_flight;

  // The feeder (optimizer/overlap_feeder.cc): a thread that runs the engine over the ready
  // units, so that Release (called from backward) only queues them. Finish and abandon stop and
  // join it.
  std::mutex mu;
  std::condition_variable cv;
  std::deque<uint32_t> queue;  // Ready units not yet speculated (mu).
  bool stop = false;           // (mu)
  bool busy = false;           // The feeder is running a batch (mu).
  bool fenced = false;         // An async save's fence is installed: no more speculation (mu).
  absl::Status error;          // The feeder's first failure (mu).
  std::mutex engine_mu;        // Held by whoever calls the engine while the feeder lives.
  std::thread feeder;

  // The protocol's steps over this state alone (optimizer/overlap.cc).
  // Step 1: `piece_units` and `pending`, from where each piece starts (`piece_starts`, then the
  // slab size) and the units, both in slab order.
  void MapPiecesToUnits(const std::vector<uint64_t>& piece_starts, const std::vector<Unit>& units);
  // Step 2's checks: OK when `pieces` exist and `buffers` has one entry per piece in pieces mode
  // (non-null, aligned for the gradient dtype and `piece_dtypes`) and none otherwise;
  // kInvalidArgument naming the piece otherwise.
  absl::Status CheckRelease(std::span<const uint32_t> pieces,
                            std::span<const PieceBuffers> buffers,
                            const StagedAdamWOptions& options,
                            const std::vector<formats::DType>& piece_dtypes) const;
  // Step 4: whether the guess held for Finish's arguments and plan.
  bool Held(const StepArgs& finish_args, const StepPlan& finish_plan) const;
  // Step 7: the parts of speculated units that lie in pieces `finish_plan` does not step.
  std::vector<Unit> SpeculatedUnstepped(const StepPlan& finish_plan,
                                        const std::vector<uint64_t>& piece_starts,
                                        const std::vector<Unit>& units) const;
};

}  // namespace ckpt::optimizer

#endif  // CKPT_OPTIMIZER_SLABS_H_
