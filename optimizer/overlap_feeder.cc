// The feeder and the gate of an overlapped step (StagedAdamW::Overlap; the protocol's numbered
// steps, 1 to 8 and the gate's G1 to G4, open optimizer/overlap.cc, which holds the overlap's
// lifecycle: Begin, Release, Finish, the abandon).
// - Feed: the feeder thread's loop, which runs the engine over the units Release queued (step 3
//   on an engine that computes on the host); StopFeeder joins it; Drain waits for it.
// - SpeculateNow: step 3 on the releasing thread (an engine that only queues, CUDA).
// - Pump: a gated overlap's ready units sent to the device within its window (G2).
// - AwaitPieces and AwaitStep: a reader's stream ordered after the gated units' writes (G4).
#include <algorithm>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "ckpt/base/status_macros.h"
#include "ckpt/optimizer/staged_adamw.h"
#include "optimizer/engine.h"
#include "optimizer/slabs.h"

namespace ckpt::optimizer {

void StagedAdamW::Feed() {
  OverlapState& st = *overlap_;
  const SlabView view = spare_->Into(View());
  std::vector<uint32_t> ready;
  std::vector<Unit> batch;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(st.mu);
      st.cv.wait(lock, [&] { return st.stop || !st.queue.empty(); });
      if (st.stop) return;  // What is left, Finish does.
      ready.assign(st.queue.begin(), st.queue.end());
      st.queue.clear();
      if (st.fenced) {  // Finish passes them through the fence.
        st.cv.notify_all();
        continue;
      }
      st.busy = true;
    }
    batch.clear();
    for (uint32_t u : ready) batch.push_back(units_[u]);
    absl::Status status;
    {
      std::lock_guard<std::mutex> engine(st.engine_mu);
      st.plan.continues = st.speculated_units > 0;
      status = engine_->Step(st.args, batch, st.plan, view, size_).status();
    }
    std::lock_guard<std::mutex> lock(st.mu);
    st.busy = false;
    st.cv.notify_all();
    // A failed batch may have written some of its units' weights: counted as speculated, so
    // that the abandon (the step is abandoned) rewrites them all from the current side.
    for (uint32_t u : ready) st.speculated[u] = 1;
    st.speculated_units += ready.size();
    if (!status.ok()) {
      if (st.error.ok()) st.error = status;
      return;
    }
  }
}

void StagedAdamW::Overlap::Drain() {
  if (optimizer_ == nullptr) return;
  OverlapState& st = *optimizer_->overlap_;
  if (st.gate) {
    // A failure is kept in st.error, which Finish reports.
    optimizer_->Pump(/*all=*/true).IgnoreError();
    return;
  }
  if (!st.feeder.joinable()) return;
  std::unique_lock<std::mutex> lock(st.mu);
  st.cv.wait(lock, [&] { return (st.queue.empty() && !st.busy) || !st.error.ok(); });
}

absl::Status StagedAdamW::SpeculateNow(const std::vector<uint32_t>& ready) {
  OverlapState& st = *overlap_;
  std::vector<Unit> batch;
  for (uint32_t u : ready) batch.push_back(units_[u]);
  const SlabView view = spare_->Into(View());
  st.plan.continues = st.speculated_units > 0;
  if (st.gate) {  // Each unit waits for its own Release, and records its own written event.
    st.plan.unit_ids = ready;
    st.plan.wait_unit_ready = true;
  }
  absl::Status status = engine_->Step(st.args, batch, st.plan, view, size_).status();
  st.plan.unit_ids = {};
  st.plan.wait_unit_ready = false;
  // A failed batch may have queued some of its units: counted as speculated, so that the
  // abandon rewrites all their weights from the current side.
  for (uint32_t u : ready) st.speculated[u] = 1;
  st.speculated_units += ready.size();
  if (!status.ok()) {
    st.error = status;  // Finish abandons the step.
    return status;
  }
  return absl::OkStatus();
}

absl::Status StagedAdamW::Pump(bool all) {
  OverlapState& st = *overlap_;
  if (!st.error.ok()) return st.error;
  while (!st.in_flight.empty()) {
    absl::StatusOr<bool> written = engine_->UnitWritten(st.in_flight.front());
    if (!written.ok()) {
      st.error = written.status();  // Finish abandons the step.
      return st.error;
    }
    if (!*written) break;
    st.in_flight.pop_front();
  }
  if (st.waiting.empty()) return absl::OkStatus();
  // Holding a unit back pays only where a later Pump comes while the device can still use it:
  // where the device keeps pace with the releases. Where it has not even reached the oldest
  // waiting unit's Release, the host is ahead of it (a later Pump may come only at Finish):
  // every waiting unit goes now, in the order they became ready, as an ungated step sends them.
  absl::StatusOr<bool> caught_up = engine_->UnitReady(st.waiting.front());
  if (!caught_up.ok()) {
    st.error = caught_up.status();
    return st.error;
  }
  std::vector<uint32_t> batch;
  if (!*caught_up) {
    batch.swap(st.waiting);
  } else {
    while (!st.waiting.empty() && (all || st.in_flight.size() + batch.size() < st.window)) {
      // The lowest slab index: the next forward needs it first.
      auto lowest = std::min_element(st.waiting.begin(), st.waiting.end());
      batch.push_back(*lowest);
      st.waiting.erase(lowest);
    }
  }
  if (batch.empty()) return absl::OkStatus();
  CKPT_RETURN_IF_ERROR(SpeculateNow(batch));
  st.in_flight.insert(st.in_flight.end(), batch.begin(), batch.end());
  return absl::OkStatus();
}

void StagedAdamW::StopFeeder() {
  OverlapState& st = *overlap_;
  if (!st.feeder.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(st.mu);
    st.stop = true;
  }
  st.cv.notify_all();
  st.feeder.join();
}

absl::Status StagedAdamW::AwaitPieces(std::span<const uint32_t> pieces, CudaStreamView stream) {
  for (uint32_t k : pieces) {
    if (k >= options_.pieces.size()) {
      return absl::InvalidArgumentError(absl::StrCat("await: piece ", k, " does not exist (",
                                                     options_.pieces.size(), " pieces)"));
    }
  }
  if (gate_left_ == 0) return absl::OkStatus();
  for (uint32_t k : pieces) {
    const uint64_t begin = piece_starts_[k], end = piece_starts_[k + 1];
    if (begin == end) continue;  // A parameter of no elements: no unit writes it.
    // The first unit that ends after the piece begins; units lie in slab order.
    auto u = std::partition_point(units_.begin(), units_.end(), [&](const Unit& unit) {
      return unit.offset + unit.count <= begin;
    });
    for (; u != units_.end() && u->offset < end; ++u) {
      const size_t i = static_cast<size_t>(u - units_.begin());
      if (gate_units_[i] == 0) continue;
      CKPT_RETURN_IF_ERROR(engine_->OrderCallerAfterUnit(static_cast<uint32_t>(i), stream));
      gate_units_[i] = 0;
      if (--gate_left_ == 0) {
        gate_units_.clear();
        return absl::OkStatus();
      }
    }
  }
  return absl::OkStatus();
}

absl::Status StagedAdamW::AwaitStep(CudaStreamView stream) {
  if (gate_left_ == 0) return absl::OkStatus();
  StepArgs args;
  args.stream = stream;
  // `done`: recorded by Finish's Barrier after every slot's last kernel, and by nothing since
  // (what records it again awaits the gate first).
  CKPT_RETURN_IF_ERROR(engine_->OrderCallerAfterStep(args));
  gate_left_ = 0;
  gate_units_.clear();
  return absl::OkStatus();
}

}  // namespace ckpt::optimizer
