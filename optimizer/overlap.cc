// The overlapped step (docs/design/overlap.md): units updated while backward goes on, bit for
// bit the plain Step.
//
// 1. Begin: record the speculative arguments (buffers, gradient dtype, stream, scale) and the
//    plan with every piece stepped at its parameter's next step count; per unit, how many of its
//    pieces are unreleased. No state changes. Why: nothing may change before the step is known.
// 2. Release(pieces): mark them released (twice is an undeclared second backward: abandon, as
//    8); a unit whose pieces are all released is ready.
// 3. Speculate the ready units unless a fence is installed or speculation is off: current side
//    -> spare side, with the speculative arguments, weights written. Why the spare side: the
//    current side must stay the state before the step until Finish says the guess held. The
//    CPU engine's update runs on a feeder thread (Release only queues), so that backward's own
//    thread goes on; the CUDA engine only queues device work, from the releasing thread (a
//    second thread's CUDA calls contend with backward's in the driver).
// 4. Finish(args): stop the feeder (units it has not taken are Finish's); plan as Step; the
//    finite check over every stepped gradient when asked. The guess held when not skipped, not
//    invalidated (a released gradient changed in place), the scale is bitwise the same and every
//    speculated piece has the same constants and buffers.
// 5. Held: the other active units current -> spare (through the fence when one is installed);
//    units with nothing stepped copied across on the host; swap the sides; advance the counts.
// 6. Skipped: rewrite the speculated units' weights from the current side (as they were).
// 7. Not held otherwise: order after every speculated write (Barrier), then Step in place on the
//    current side, untouched by speculation, with the final arguments (every weight rewritten).
// 8. Abandoned: as 6, without a report. A batch the engine failed part-way through counts as
//    speculated (some of its units' weights may be written), so that all of them are rewritten.
//
// A gated overlap (OverlapOptions::gate, CUDA engine; docs/design/overlap.md, "The gate"):
// G1. Begin: per-unit events made; the last step's gate, if still open, awaited on the stream.
// G2. Release: each ready unit records its ready event on the stream and waits on the host.
//     Pump (every Release): forget the sent units whose written event has run; if the device
//     has not reached the oldest waiting unit's ready event (the host is ahead), send every
//     waiting unit in release order; else send the lowest slab index first while fewer than
//     `window` are on the device. A sent unit waits for its ready event and records its
//     written event after its kernel. Why: the tail left at Finish is then the units the next
//     forward reads last.
// G3. Finish, held: the rest in slab order, each recording its written event; Barrier; the
//     caller's stream is not ordered after the writes; the written units are gated.
// G4. AwaitPieces orders a stream after the gated units of those pieces, once per unit;
//     AwaitStep after all of them. Step, BeginOverlap, WriteModelWeights, Synchronize and
//     ReleaseDevice close the gate first. Not held (6, 7, 8): no gate opens.
//
// This file holds the overlap's lifecycle (Begin, Release, Finish, the abandon) and the steps
// over its state alone (OverlapState, optimizer/slabs.h); the feeder thread, the gate's pump and
// AwaitPieces/AwaitStep are in optimizer/overlap_feeder.cc.
#include <algorithm>
#include <cstring>
#include <mutex>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "ckpt/base/status_macros.h"
#include "ckpt/optimizer/staged_adamw.h"
#include "optimizer/buffer_checks.h"
#include "optimizer/engine.h"
#include "optimizer/slabs.h"
#include "optimizer/unit_fence.h"

namespace ckpt::optimizer {

namespace {

bool SameConstants(const StepConstants& a, const StepConstants& b) {
  auto bits = [](float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
  };
  return bits(a.beta1) == bits(b.beta1) && bits(a.beta2) == bits(b.beta2) &&
         bits(a.eps) == bits(b.eps) && bits(a.decay) == bits(b.decay) &&
         bits(a.omb1) == bits(b.omb1) && bits(a.omb2) == bits(b.omb2) &&
         bits(a.step_size) == bits(b.step_size) && bits(a.bc2_sqrt) == bits(b.bc2_sqrt) &&
         a.amsgrad == b.amsgrad;
}

bool SameBits(float a, float b) { return std::memcmp(&a, &b, 4) == 0; }

// Step 5's units not speculated, in slab order: those with a stepped piece (first), and those
// with none (second).
std::pair<std::vector<size_t>, std::vector<size_t>> SplitUnspeculated(
    const StepArgs& args, const SlabView& current, const StepPlan& plan,
    const std::vector<Unit>& units, const std::vector<uint8_t>& speculated) {
  std::vector<size_t> rest;
  std::vector<size_t> idle;  // Units with no stepped piece.
  for (size_t u = 0; u < units.size(); ++u) {
    if (speculated[u] != 0) continue;
    bool active = false;
    ForEachSegment(args, current, plan, units[u].offset, units[u].count, 0,
                   [&](uint64_t, uint64_t, const std::byte*, std::byte*, uint32_t c,
                       formats::DType) { active |= c != StepPlan::kSkipped; });
    (active ? rest : idle).push_back(u);
  }
  return {std::move(rest), std::move(idle)};
}

// Step 5: the units `rest` stepped into `into` (the spare side), after the speculated batches of
// this step, in the batches `fence` lets go (all at once in slab order, forward's, without one);
// a gate's units each record their written event. The last batch's `done` (null for none).
absl::StatusOr<CUevent_st*> StepRest(internal::Engine& engine, internal::UnitFence* fence,
                                     const std::vector<Unit>& units,
                                     const std::vector<size_t>& rest, bool gate,
                                     const StepArgs& args, const StepPlan& plan,
                                     const SlabView& into, uint64_t size) {
  StepArgs unchecked = args;
  unchecked.check_finite = false;
  StepPlan rest_plan = plan;
  rest_plan.continues = true;  // After the speculated batches of this step.
  std::vector<bool> done(units.size(), true);
  for (size_t u : rest) done[u] = false;
  std::vector<size_t> ready;
  std::vector<Unit> batch;
  std::vector<uint32_t> ids;  // A gate's: the batch's unit indices.
  CUevent_st* last_done = nullptr;
  for (size_t left = rest.size(); left > 0; left -= ready.size()) {
    ready.clear();
    if (fence != nullptr) {
      fence->Acquire(done, &ready);
    } else {
      ready = rest;  // In slab order: forward's, for a gate.
    }
    batch.clear();
    ids.clear();
    for (size_t i : ready) {
      batch.push_back(units[i]);
      ids.push_back(static_cast<uint32_t>(i));
      done[i] = true;
    }
    if (gate) rest_plan.unit_ids = ids;
    CKPT_ASSIGN_OR_RETURN(StepReport part, engine.Step(unchecked, batch, rest_plan, into, size));
    last_done = part.done;
  }
  return last_done;
}

// Step 5: units with nothing stepped copied from `current` into `into` as they are.
void CopyIdle(const SlabView& current, const SlabView& into, const std::vector<Unit>& units,
              const std::vector<size_t>& idle, size_t mb, bool has_max) {
  for (size_t u : idle) {
    const uint64_t at = units[u].offset, n = units[u].count;
    std::memcpy(into.master_out + at, current.master + at, n * 4);
    std::memcpy(into.exp_avg_out + at * mb, current.exp_avg + at * mb, n * mb);
    std::memcpy(into.exp_avg_sq_out + at * mb, current.exp_avg_sq + at * mb, n * mb);
    if (has_max)
      std::memcpy(into.max_exp_avg_sq_out + at * mb, current.max_exp_avg_sq + at * mb, n * mb);
  }
}

}  // namespace

void StagedAdamW::OverlapState::MapPiecesToUnits(const std::vector<uint64_t>& piece_starts,
                                                 const std::vector<Unit>& units) {
  const size_t pieces = piece_starts.size() - 1;
  piece_units.resize(pieces);
  pending.assign(units.size(), 0);
  // Units and pieces both lie in slab order: walk them together.
  size_t u = 0;
  for (size_t k = 0; k < pieces; ++k) {
    const uint64_t begin = piece_starts[k], end = piece_starts[k + 1];
    if (begin == end) continue;  // A parameter of no elements: no unit waits for it.
    while (u < units.size() && units[u].offset + units[u].count <= begin) ++u;
    for (size_t v = u; v < units.size() && units[v].offset < end; ++v) {
      piece_units[k].push_back(static_cast<uint32_t>(v));
      ++pending[v];
    }
  }
}

absl::Status StagedAdamW::OverlapState::CheckRelease(
    std::span<const uint32_t> pieces, std::span<const PieceBuffers> given,
    const StagedAdamWOptions& options, const std::vector<formats::DType>& piece_dtypes) const {
  const size_t gsize = formats::DTypeSize(args.grad_dtype);
  if (pieces_mode ? given.size() != pieces.size() : !given.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "release: ", given.size(), " buffers for ", pieces.size(), " pieces (",
        pieces_mode ? "one per piece" : "none: the step's buffers are flat", ")"));
  }
  for (size_t i = 0; i < pieces.size(); ++i) {
    const uint32_t k = pieces[i];
    if (k >= released.size()) {
      return absl::InvalidArgumentError(absl::StrCat("release: piece ", k, " does not exist (",
                                                     released.size(), " pieces)"));
    }
    if (pieces_mode && options.pieces[k].count != 0) {  // An empty piece has none.
      const PieceBuffers& b = given[i];
      if (b.grads == nullptr || b.params == nullptr || !internal::Aligned(b.grads, gsize) ||
          !internal::Aligned(b.params, formats::DTypeSize(piece_dtypes[k]))) {
        return absl::InvalidArgumentError(
            absl::StrCat("release: piece ", k, " (\"",
                         options.params[options.pieces[k].param].name,
                         "\"): null or misaligned gradient or parameter buffer"));
      }
    }
  }
  return absl::OkStatus();
}

bool StagedAdamW::OverlapState::Held(const StepArgs& finish_args,
                                     const StepPlan& finish_plan) const {
  bool held = speculated_units > 0 && !invalidated &&
              SameBits(finish_args.grad_scale, args.grad_scale) &&
              finish_args.grad_dtype == args.grad_dtype;
  // The same buffers: per piece, or the same flat pair.
  const bool by_piece = !buffers.empty();
  if (held && by_piece == finish_args.pieces.empty()) held = false;
  if (held && !by_piece &&
      (finish_args.grads != args.grads || finish_args.params != args.params))
    held = false;
  for (size_t k = 0; held && k < piece_units.size(); ++k) {
    bool in_speculated = false;
    for (uint32_t u : piece_units[k]) in_speculated |= speculated[u] != 0;
    if (!in_speculated) continue;
    const uint32_t c = finish_plan.piece_constants[k];
    held = c != StepPlan::kSkipped &&
           SameConstants(finish_plan.constants[c], plan.constants[plan.piece_constants[k]]);
    if (held && !finish_args.pieces.empty()) {
      held = finish_args.pieces[k].grads == buffers[k].grads &&
             finish_args.pieces[k].params == buffers[k].params;
    }
  }
  return held;
}

std::vector<Unit> StagedAdamW::OverlapState::SpeculatedUnstepped(
    const StepPlan& finish_plan, const std::vector<uint64_t>& piece_starts,
    const std::vector<Unit>& units) const {
  std::vector<Unit> unstepped;
  for (size_t k = 0; k < piece_units.size(); ++k) {
    if (finish_plan.piece_constants[k] != StepPlan::kSkipped) continue;
    for (uint32_t u : piece_units[k]) {
      if (speculated[u] == 0) continue;
      const uint64_t begin = std::max(piece_starts[k], units[u].offset);
      const uint64_t end = std::min(piece_starts[k + 1], units[u].offset + units[u].count);
      unstepped.push_back(Unit{begin, end - begin, units[u].group});
    }
  }
  return unstepped;
}

absl::Status StagedAdamW::CheckNoOverlap(absl::string_view what) const {
  if (overlap_ == nullptr) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "cannot ", what, " while an overlapped step is open (finish it with Overlap::Finish)"));
}

uint64_t StagedAdamW::spare_bytes() const {
  if (spare_ == nullptr) return 0;
  return spare_->master.size() + spare_->exp_avg.size() + spare_->exp_avg_sq.size() +
         spare_->max_exp_avg_sq.size();
}

absl::StatusOr<StagedAdamW::Overlap> StagedAdamW::BeginOverlap(const StepArgs& args,
                                                             const OverlapOptions& options) {
  CKPT_RETURN_IF_ERROR(CheckClean("step"));
  CKPT_RETURN_IF_ERROR(CheckNoOverlap("begin an overlapped step"));
  // The last step's gate: whatever this step queues on the stream comes after its writes.
  if (gate_open() && args.stream.has_value()) CKPT_RETURN_IF_ERROR(AwaitStep(*args.stream));
  const bool speculate = options.speculate;
  if (has_whole_params()) {
    return absl::UnimplementedError(
        "an overlapped step of an optimizer with Muon or Adafactor groups (parameters kept "
        "whole) is not built yet: step plainly");
  }
  auto state = std::make_unique<OverlapState>();
  state->args = args;
  state->args.check_finite = false;
  state->args.stepped = {};
  state->pieces_mode = args.pieces.empty() && args.grads == nullptr && args.params == nullptr;
  if (state->pieces_mode) {
    state->buffers.assign(options_.pieces.size(), PieceBuffers{});
    // Validated as a flat step would be, with stand-in buffers; the pieces' come with Release.
    StepArgs check = state->args;
    alignas(16) static const std::byte kStandIn[16] = {};
    check.grads = kStandIn;
    check.params = const_cast<std::byte*>(kStandIn);
    CKPT_RETURN_IF_ERROR(ValidateStepArgs(check));
  } else {
    if (!args.pieces.empty()) {
      state->buffers.assign(args.pieces.begin(), args.pieces.end());
      state->args.pieces = state->buffers;
    }
    CKPT_RETURN_IF_ERROR(ValidateStepArgs(state->args));
  }
  if (engine_->wants_pinned_slabs() && !args.stream.has_value()) {
    return absl::InvalidArgumentError(
        "the CUDA engine needs the caller's stream (StepArgs::stream)");
  }
  state->speculate = speculate && size_ > 0;
  state->gate = options.gate && state->speculate && engine_->queues_only();
  state->window = std::max<uint32_t>(1, options.window);
  if (state->gate) CKPT_RETURN_IF_ERROR(engine_->PrepareUnitEvents(units_.size()));
  if (state->speculate && spare_ == nullptr) {
    // The spare side: the slabs' sizes, pinned like them (no aux slab: only parameters kept
    // whole, refused above, keep aux state).
    CKPT_ASSIGN_OR_RETURN(spare_, Slabs::Allocate(size_, moment_bytes(), has_max_, 0,
                                                  engine_->wants_pinned_slabs()));
  }
  state->plan = PlanStep(state->args);
  state->plan.barrier_later = true;  // Finish's or the abandon's Barrier orders the readers.
  state->released.assign(options_.pieces.size(), 0);
  state->speculated.assign(units_.size(), 0);
  state->MapPiecesToUnits(piece_starts_, units_);
  if (state->pieces_mode) state->args.pieces = state->buffers;
  state->fenced = fence_ != nullptr;
  overlap_ = std::move(state);
  if (overlap_->speculate && !engine_->queues_only())
    overlap_->feeder = std::thread([this] { Feed(); });
  return Overlap(this);
}

StagedAdamW::Overlap::Overlap(Overlap&& other) noexcept
    : optimizer_(std::exchange(other.optimizer_, nullptr)) {}

StagedAdamW::Overlap::~Overlap() {
  if (optimizer_ != nullptr) optimizer_->AbandonOverlap().IgnoreError();  // Step 8.
}

absl::Status StagedAdamW::Overlap::Release(std::span<const uint32_t> pieces,
                                           std::span<const PieceBuffers> buffers) {
  if (optimizer_ == nullptr)
    return absl::FailedPreconditionError("release: the overlapped step is closed");
  StagedAdamW& opt = *optimizer_;
  OverlapState& st = *opt.overlap_;
  CKPT_RETURN_IF_ERROR(st.CheckRelease(pieces, buffers, opt.options_, opt.piece_dtypes_));
  // Step 2.
  for (size_t i = 0; i < pieces.size(); ++i) {
    const uint32_t k = pieces[i];
    if (st.released[k] != 0) {
      const std::string name = opt.options_.params[opt.options_.pieces[k].param].name;
      absl::Status undone = opt.AbandonOverlap();
      optimizer_ = nullptr;
      CKPT_RETURN_IF_ERROR(undone);
      return absl::FailedPreconditionError(absl::StrCat(
          "the gradient of \"", name,
          "\" was released twice in one step: a second backward before the step (with gradient "
          "accumulation, release only in the last micro-batch); the step is abandoned and the "
          "weights are the masters again"));
    }
    st.released[k] = 1;
    if (st.pieces_mode) st.buffers[k] = buffers[i];
  }
  // Step 3: the units now ready go to the feeder (buffers written above happen before its
  // reads: the queue's mutex orders them).
  std::vector<uint32_t> ready;
  for (uint32_t k : pieces) {
    for (uint32_t u : st.piece_units[k]) {
      if (--st.pending[u] == 0) ready.push_back(u);
    }
  }
  if (!st.speculate) return absl::OkStatus();
  if (!st.feeder.joinable()) {
    // An engine that only queues (CUDA): queued from here, after the work on the caller's
    // stream so far. An async save's fence: left to Finish.
    if (opt.fence_ != nullptr) return absl::OkStatus();
    if (st.gate) {  // Every Release refills the window, whether or not a unit became ready.
      for (uint32_t u : ready) {
        // Where on the stream its gradients are final: it may go to the device later.
        absl::Status recorded = opt.engine_->RecordUnitReady(u, *st.args.stream);
        if (!recorded.ok()) {
          st.error = recorded;  // Finish abandons the step.
          return recorded;
        }
        st.waiting.push_back(u);
      }
      return opt.Pump(/*all=*/false);
    }
    if (ready.empty()) return absl::OkStatus();
    return opt.SpeculateNow(ready);
  }
  if (ready.empty()) return absl::OkStatus();
  absl::Status failed;
  {
    std::lock_guard<std::mutex> lock(st.mu);
    failed = st.error;
    if (!st.fenced) st.queue.insert(st.queue.end(), ready.begin(), ready.end());
  }
  st.cv.notify_all();  // Drain waits on it too.
  return failed;  // A failure of the feeder's, as soon as it is known.
}

absl::Status StagedAdamW::AbandonOverlap() {
  if (overlap_ == nullptr) return absl::OkStatus();
  StopFeeder();
  std::unique_ptr<OverlapState> st = std::move(overlap_);
  if (st->speculated_units == 0) return absl::OkStatus();
  // Steps 6 and 8: what the speculated units wrote into the weights goes back to the masters
  // rounded, after every speculated write.
  std::vector<Unit> units;
  for (size_t u = 0; u < units_.size(); ++u) {
    if (st->speculated[u] != 0) units.push_back(units_[u]);
  }
  CKPT_RETURN_IF_ERROR(engine_->Barrier());
  return engine_->WriteWeights(View(), units, st->args, st->args.stream);
}

void StagedAdamW::Overlap::Invalidate() {
  if (optimizer_ != nullptr) optimizer_->overlap_->invalidated = true;
}

absl::StatusOr<StepReport> StagedAdamW::Overlap::Finish(const StepArgs& args) {
  if (optimizer_ == nullptr)
    return absl::FailedPreconditionError("finish: the overlapped step is closed");
  StagedAdamW* opt = std::exchange(optimizer_, nullptr);
  absl::StatusOr<StepReport> report = opt->FinishOverlap(args);
  if (!report.ok() && opt->overlap_ != nullptr) {
    // Failed before anything was committed: as if abandoned (step 8).
    opt->AbandonOverlap().IgnoreError();
  }
  return report;
}

absl::StatusOr<StepReport> StagedAdamW::FinishOverlap(const StepArgs& args) {
  CKPT_RETURN_IF_ERROR(CheckClean("step"));
  CKPT_RETURN_IF_ERROR(ValidateStepArgs(args));
  StopFeeder();  // Units it has not taken yet are this function's.
  OverlapState& st = *overlap_;
  if (!st.error.ok()) return st.error;  // Abandoned by Finish.
  ++state_version_;
  moments_untouched_ = false;
  // Step 4.
  const StepPlan plan = PlanStep(args);
  const SlabView current = View();
  StepReport report;
  report.speculated_units = st.speculated_units;
  if (args.check_finite) {
    CKPT_ASSIGN_OR_RETURN(StepReport checked,
                          engine_->CheckFinite(args, units_, plan, current, size_));
    if (checked.skipped) {
      // Step 6; and Finish's stream (if not Begin's) after the weights put back.
      CKPT_RETURN_IF_ERROR(AbandonOverlap());
      CKPT_RETURN_IF_ERROR(engine_->OrderCallerAfterStep(args));
      checked.speculated_units = report.speculated_units;
      return checked;
    }
  }
  if (!st.Held(args, plan)) {
    // Step 7 (or a step with nothing speculated): Step in place on the untouched current side.
    if (st.speculated_units > 0) {
      CKPT_RETURN_IF_ERROR(engine_->Barrier());
      // The step rewrites every stepped piece's weights; those of speculated pieces it does not
      // step go back to the masters rounded.
      const std::vector<Unit> unstepped = st.SpeculatedUnstepped(plan, piece_starts_, units_);
      if (!unstepped.empty()) {
        CKPT_RETURN_IF_ERROR(engine_->WriteWeights(current, unstepped, st.args, st.args.stream));
      }
    }
    overlap_.reset();
    StepArgs unchecked = args;
    unchecked.check_finite = false;  // Checked above.
    unchecked.gate = false;  // Step's, not Finish's: a redo orders the stream as a held step.
    CKPT_ASSIGN_OR_RETURN(StepReport stepped, StepUnits(unchecked, plan));
    AdvanceSteps(args);
    stepped.speculated_units = report.speculated_units;
    return stepped;
  }
  // Step 5: the other units into the spare side; units with nothing stepped copied across.
  const SlabView into = spare_->Into(current);
  const auto [rest, idle] = SplitUnspeculated(args, current, plan, units_, st.speculated);
  CKPT_ASSIGN_OR_RETURN(report.done, StepRest(*engine_, fence_, units_, rest, st.gate, args, plan,
                                              into, size_));
  if (!idle.empty()) {
    // Nothing of these is queued anywhere in this step; earlier steps' copies may still read
    // or write either side.
    CKPT_RETURN_IF_ERROR(engine_->Synchronize());
    CopyIdle(current, into, units_, idle, moment_bytes(), has_max_);
  }
  CKPT_RETURN_IF_ERROR(engine_->Barrier());
  if (st.gate) {
    // Step 5 of a gate: every unit written now awaits its readers (AwaitPieces).
    gate_units_.assign(units_.size(), 0);
    for (size_t u = 0; u < units_.size(); ++u) gate_units_[u] = st.speculated[u];
    for (size_t u : rest) gate_units_[u] = 1;
    gate_left_ = static_cast<uint64_t>(std::count(gate_units_.begin(), gate_units_.end(), 1));
    report.gated = gate_left_ > 0;
  } else {
    CKPT_RETURN_IF_ERROR(engine_->OrderCallerAfterStep(args));
  }
  // The sides swap: the spare side is this step's state.
  std::swap(slabs_, spare_);
  overlap_.reset();
  AdvanceSteps(args);
  report.speculation_held = true;
  return report;
}

}  // namespace ckpt::optimizer
