// StagedAdamW's step (ckpt/optimizer/staged_adamw.h): the arguments checked, the plan (each
// stepped piece's constants at its parameter's next step count), the units run through the
// engine (in batches through an async save's fence when one is installed, or gated), the step
// counts advanced; the weights written back from the masters; and the engine's device
// released, restored and synchronised. The engines' own steps are in optimizer/cpu_engine.cc and
// optimizer/cuda/cuda_engine.cc (which opens with the device pipeline's numbered steps); an
// overlapped step's protocol opens optimizer/overlap.cc. Creation is in
// optimizer/staged_adamw_create.cc, the state in optimizer/staged_adamw_state.cc.
#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "ckpt/base/status_macros.h"
#include "ckpt/optimizer/staged_adamw.h"
#include "optimizer/buffer_checks.h"
#include "optimizer/engine.h"
#include "optimizer/rules/update_rule.h"
#include "optimizer/slabs.h"
#include "optimizer/unit_fence.h"

namespace ckpt::optimizer {

using formats::DType;

StepConstants ComputeStepConstants(const ParamGroup& g, uint64_t t) {
  StepConstants c{};
  internal::RuleFor(g.algorithm).SetConstants(g, t, c);
  return c;
}

SlabView StagedAdamW::View() const {
  return SlabView{size_ > 0 ? reinterpret_cast<float*>(slabs_->master.data()) : nullptr,
                  slabs_->exp_avg.data(),
                  slabs_->exp_avg_sq.data(),
                  slabs_->max_exp_avg_sq.data(),
                  options_.moment_dtype,
                  piece_starts_,
                  piece_dtypes_,
                  piece_bytes_,
                  options_.pieces,
                  options_.params,
                  slabs_->aux.valid() ? reinterpret_cast<float*>(slabs_->aux.data()) : nullptr,
                  piece_aux_};
}

absl::Status StagedAdamW::CheckPieceBuffers(std::span<const PieceBuffers> pieces,
                                            std::optional<DType> grad_dtype,
                                            std::span<const uint8_t> stepped,
                                            absl::string_view what) const {
  if (pieces.size() != options_.pieces.size()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", pieces.size(),
                                                   " piece buffers for ",
                                                   options_.pieces.size(), " pieces"));
  }
  for (size_t k = 0; k < pieces.size(); ++k) {
    const PieceBuffers& b = pieces[k];
    const uint32_t param = options_.pieces[k].param;
    if (!stepped.empty() && stepped[param] == 0) {
      continue;  // Not stepped: its buffers are not touched and may be null.
    }
    if (options_.pieces[k].count == 0) continue;  // A parameter of no elements: none either.
    const std::string& name = options_.params[param].name;
    if ((grad_dtype.has_value() && b.grads == nullptr) || b.params == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": null gradient or parameter buffer of piece ", k, " (", name, ")"));
    }
    if ((grad_dtype.has_value() &&
         !internal::Aligned(b.grads, formats::DTypeSize(*grad_dtype))) ||
        !internal::Aligned(b.params, formats::DTypeSize(piece_dtypes_[k]))) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": gradient or parameter buffer of piece ", k, " (", name,
          ") is misaligned for its dtype"));
    }
  }
  return absl::OkStatus();
}

absl::Status StagedAdamW::WriteModelWeights(void* dest, std::optional<CudaStreamView> stream) {
  if (size_ > 0 && (dest == nullptr || !internal::Aligned(dest, widest_))) {
    return absl::InvalidArgumentError("model weights destination is null or misaligned");
  }
  StepArgs where;
  where.params = dest;
  return WriteWeightsTo(where, stream);
}

absl::Status StagedAdamW::WriteModelWeights(std::span<const PieceBuffers> pieces,
                                            std::optional<CudaStreamView> stream) {
  CKPT_RETURN_IF_ERROR(CheckPieceBuffers(pieces, std::nullopt, {}, "write the model weights"));
  StepArgs where;
  where.pieces = pieces;
  return WriteWeightsTo(where, stream);
}

absl::Status StagedAdamW::WriteWeightsTo(const StepArgs& where,
                                         const std::optional<CudaStreamView>& stream) {
  CKPT_RETURN_IF_ERROR(CheckClean("write the model weights"));
  CKPT_RETURN_IF_ERROR(CheckNoOverlap("write the model weights"));
  if (size_ == 0) return absl::OkStatus();
  if (gate_open()) {  // Written after the last step's writes, on the stream or the host.
    if (stream.has_value()) {
      CKPT_RETURN_IF_ERROR(AwaitStep(*stream));
    } else {
      CKPT_RETURN_IF_ERROR(Synchronize());
    }
  }
  if (stream.has_value() && options_.engine == EngineKind::kCpu) {
    return absl::InvalidArgumentError(
        "the CPU engine writes host memory: WriteModelWeights takes no stream there");
  }
  return engine_->WriteWeights(View(), units_, where, stream);
}

absl::Status StagedAdamW::ValidateStepArgs(const StepArgs& args) {
  if (!internal::SupportedFloat(args.grad_dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat("unsupported gradient dtype ", formats::DTypeName(args.grad_dtype)));
  }
  if (!args.stepped.empty() && args.stepped.size() != options_.params.size()) {
    return absl::InvalidArgumentError(absl::StrCat("step: ", args.stepped.size(),
                                                   " stepped flags for ",
                                                   options_.params.size(), " parameters"));
  }
  if (!args.pieces.empty()) {
    CKPT_RETURN_IF_ERROR(CheckPieceBuffers(args.pieces, args.grad_dtype, args.stepped, "step"));
  } else if (size_ > 0) {
    if (args.grads == nullptr || args.params == nullptr)
      return absl::InvalidArgumentError("null gradient or parameter buffer");
    if (!internal::Aligned(args.grads, formats::DTypeSize(args.grad_dtype)) ||
        !internal::Aligned(args.params, widest_)) {
      return absl::InvalidArgumentError("gradient or parameter buffer is misaligned for its dtype");
    }
  }
  if (!std::isfinite(args.grad_scale))
    return absl::InvalidArgumentError("gradient scale is not finite");
  return absl::OkStatus();
}

StepPlan StagedAdamW::PlanStep(const StepArgs& args) const {
  // Per piece, the constants of its parameter's group at the parameter's own next step, each
  // distinct (group, step) pair computed once.
  StepPlan plan;
  std::map<std::pair<uint32_t, uint64_t>, uint32_t> index;
  plan.piece_constants.reserve(options_.pieces.size());
  for (const Piece& piece : options_.pieces) {
    if (!args.stepped.empty() && args.stepped[piece.param] == 0) {
      plan.piece_constants.push_back(StepPlan::kSkipped);
      continue;
    }
    const uint32_t group = options_.params[piece.param].group;
    const uint64_t t = param_steps_[piece.param] + 1;
    auto [it, added] = index.try_emplace({group, t}, static_cast<uint32_t>(plan.constants.size()));
    if (added) plan.constants.push_back(ComputeStepConstants(options_.groups[group], t));
    plan.piece_constants.push_back(it->second);
  }
  return plan;
}

void StagedAdamW::AdvanceSteps(const StepArgs& args) {
  for (uint32_t i = 0; i < param_steps_.size(); ++i) {
    if (args.stepped.empty() || args.stepped[i] != 0) ++param_steps_[i];
  }
  SyncGroupSteps();
}

absl::StatusOr<StepReport> StagedAdamW::Step(const StepArgs& args) {
  CKPT_RETURN_IF_ERROR(CheckClean("step"));
  CKPT_RETURN_IF_ERROR(CheckNoOverlap("step"));
  CKPT_RETURN_IF_ERROR(ValidateStepArgs(args));
  // The last step's gate: this step's writes, and what the stream queues after them, come
  // after the last step's writes.
  if (gate_open() && args.stream.has_value()) CKPT_RETURN_IF_ERROR(AwaitStep(*args.stream));
  ++state_version_;
  moments_untouched_ = false;
  const StepPlan plan = PlanStep(args);
  CKPT_ASSIGN_OR_RETURN(StepReport report, StepUnits(args, plan));
  if (!report.skipped) AdvanceSteps(args);
  return report;
}

absl::StatusOr<StepReport> StagedAdamW::StepUnits(const StepArgs& args, const StepPlan& plan) {
  const SlabView view = View();
  // A Muon matrix records no written event: a gate could not order its readers.
  if (args.gate && fence_ == nullptr && !units_.empty() && engine_->queues_only() &&
      !has_whole_params()) {
    return StepGated(args, plan);
  }
  if (fence_ == nullptr || units_.empty()) {
    CKPT_ASSIGN_OR_RETURN(StepReport report,
                          engine_->Step(args, units_, plan, view, size_));
    if (!report.skipped) CKPT_RETURN_IF_ERROR(engine_->OrderCallerAfterStep(args));
    return report;
  }
  // An async save is writing: the whole step is checked first (a skipped step changes
  // nothing), then the units go through the engine in batches, each once the fence lets it go.
  StepReport report;
  if (args.check_finite) {
    CKPT_ASSIGN_OR_RETURN(report, engine_->CheckFinite(args, units_, plan, view, size_));
    if (report.skipped) return report;
  }
  StepArgs unchecked = args;
  unchecked.check_finite = false;
  // The writer needs a core of its own while the step runs beside it.
  engine_->SetSpareCores(1);
  absl::Cleanup all_cores = [&] { engine_->SetSpareCores(0); };
  // Units the step leaves alone (every piece skipped) need not pass the fence: the writer
  // takes them as they are, with no copy and no wait.
  std::vector<bool> done(units_.size(), false);
  size_t left = units_.size();
  for (size_t u = 0; u < units_.size(); ++u) {
    bool active = false;
    ForEachSegment(args, view, plan, units_[u].offset, units_[u].count, 0,
                   [&](uint64_t, uint64_t, const std::byte*, std::byte*, uint32_t c, DType) {
                     active |= c != StepPlan::kSkipped;
                   });
    if (!active) {
      done[u] = true;
      --left;
    }
  }
  std::vector<size_t> ready;
  std::vector<Unit> batch;
  for (; left > 0; left -= ready.size()) {
    ready.clear();
    fence_->Acquire(done, &ready);
    batch.clear();
    for (size_t i : ready) {
      batch.push_back(units_[i]);
      done[i] = true;
    }
    CKPT_ASSIGN_OR_RETURN(StepReport part,
                          engine_->Step(unchecked, batch, plan, view, size_));
    report.done = part.done;
  }
  // Once, after the last batch: the batches' kernels overlap across slots as in a plain step.
  CKPT_RETURN_IF_ERROR(engine_->OrderCallerAfterStep(args));
  return report;
}

// StepArgs::gate: every unit in slab order, each recording its written event; the units that
// step await their readers (AwaitPieces) instead of the caller's stream waiting for them all.
absl::StatusOr<StepReport> StagedAdamW::StepGated(const StepArgs& args, const StepPlan& plan) {
  const SlabView view = View();
  CKPT_RETURN_IF_ERROR(engine_->PrepareUnitEvents(units_.size()));
  std::vector<uint32_t> ids(units_.size());
  for (size_t u = 0; u < units_.size(); ++u) ids[u] = static_cast<uint32_t>(u);
  StepPlan gated = plan;
  gated.unit_ids = ids;
  CKPT_ASSIGN_OR_RETURN(StepReport report, engine_->Step(args, units_, gated, view, size_));
  if (report.skipped) return report;
  gate_units_.assign(units_.size(), 0);
  for (size_t u = 0; u < units_.size(); ++u) {
    ForEachSegment(args, view, plan, units_[u].offset, units_[u].count, 0,
                   [&](uint64_t, uint64_t, const std::byte*, std::byte*, uint32_t c, DType) {
                     if (c != StepPlan::kSkipped) gate_units_[u] = 1;
                   });
  }
  gate_left_ = static_cast<uint64_t>(std::count(gate_units_.begin(), gate_units_.end(), 1));
  if (gate_left_ == 0) gate_units_.clear();
  report.gated = gate_left_ > 0;
  return report;
}

absl::Status StagedAdamW::ReleaseDevice() {
  CKPT_RETURN_IF_ERROR(CheckNoOverlap("release the device"));
  CKPT_RETURN_IF_ERROR(engine_->Release());  // Synchronizes: every write has run.
  gate_left_ = 0;
  gate_units_.clear();
  return absl::OkStatus();
}
absl::Status StagedAdamW::RestoreDevice() { return engine_->Restore(); }
absl::Status StagedAdamW::Synchronize() {
  if (overlap_ != nullptr) {  // The feeder may be in the engine.
    std::lock_guard<std::mutex> lock(overlap_->engine_mu);
    return engine_->Synchronize();
  }
  CKPT_RETURN_IF_ERROR(engine_->Synchronize());
  gate_left_ = 0;  // The host has waited for every write: no reader can race them now.
  gate_units_.clear();
  return absl::OkStatus();
}

absl::StatusOr<CudaStreamView> CudaStreamView::Of(CUstream_st* stream) {
  if (stream == nullptr) {
    return absl::InvalidArgumentError(
        "a null CUDA stream handle: name the legacy default stream with CudaStreamView::Legacy()");
  }
  return CudaStreamView(stream);
}

uint64_t StagedAdamW::device_bytes() const { return engine_->device_bytes(); }
std::string StagedAdamW::engine_name() const { return engine_->name(); }

}  // namespace ckpt::optimizer
