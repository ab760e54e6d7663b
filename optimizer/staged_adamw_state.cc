// StagedAdamW's state (ckpt/optimizer/staged_adamw.h): the lifecycle that guards it (a load
// being applied or poisoned, an async save's fence), the read-only and writable views of the
// slabs, the copies out as FP32, SetState, SetMasters and SetGroup. The creation is in
// optimizer/staged_adamw_create.cc, the step in optimizer/staged_adamw.cc; the load that applies
// a checkpoint to this state is the Checkpointer's (optimizer/checkpointer_load.cc).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "ckpt/base/status_macros.h"
#include "ckpt/formats/convert.h"
#include "ckpt/optimizer/staged_adamw.h"
#include "optimizer/engine.h"
#include "optimizer/slabs.h"
#include "optimizer/unit_fence.h"

namespace ckpt::optimizer {

using formats::DType;

absl::Status StagedAdamW::CheckClean(absl::string_view what) const {
  if (lifecycle_ == Lifecycle::kClean) return absl::OkStatus();
  if (lifecycle_ == Lifecycle::kLoading) {
    return absl::FailedPreconditionError(absl::StrCat(what, ": a load is being applied"));
  }
  return absl::FailedPreconditionError(absl::StrCat(
      what, ": the optimizer is poisoned by a failed load that could not be rolled back (",
      poison_reason_, "); a complete load clears it"));
}

StagedAdamW::LoadScope StagedAdamW::BeginLoad() {
  const Lifecycle before = lifecycle_;
  lifecycle_ = Lifecycle::kLoading;
  return LoadScope(this, before);
}

StagedAdamW::LoadScope::LoadScope(LoadScope&& other) noexcept
    : optimizer_(std::exchange(other.optimizer_, nullptr)), before_(other.before_) {}

StagedAdamW::LoadScope::~LoadScope() {
  if (optimizer_ != nullptr) Poison("a load ended without committing or rolling back");
}

void StagedAdamW::LoadScope::RestoreGroups(const std::vector<ParamGroup>& groups,
                                           const std::vector<uint64_t>& param_steps) {
  optimizer_->options_.groups = groups;
  optimizer_->param_steps_ = param_steps;
  optimizer_->SyncGroupSteps();
  ++optimizer_->state_version_;
}

void StagedAdamW::SyncGroupSteps() {
  for (ParamGroup& g : options_.groups) g.step = 0;
  for (size_t i = 0; i < param_steps_.size(); ++i) {
    uint64_t& step = options_.groups[options_.params[i].group].step;
    step = std::max(step, param_steps_[i]);
  }
}

void StagedAdamW::LoadScope::Commit() {
  optimizer_->lifecycle_ = Lifecycle::kClean;
  optimizer_->poison_reason_.clear();
  optimizer_ = nullptr;
}

void StagedAdamW::LoadScope::RolledBack() {
  optimizer_->lifecycle_ = before_;
  optimizer_ = nullptr;
}

void StagedAdamW::LoadScope::Poison(std::string why) {
  optimizer_->lifecycle_ = Lifecycle::kPoisoned;
  optimizer_->poison_reason_ = std::move(why);
  optimizer_ = nullptr;
}

StagedAdamW::FenceScope StagedAdamW::InstallFence(internal::UnitFence* fence) {
  if (overlap_ != nullptr) {
    // The open overlapped step's feeder speculates nothing more (docs/design/overlap.md).
    std::lock_guard<std::mutex> lock(overlap_->mu);
    overlap_->fenced = true;
  }
  fence_ = fence;
  return FenceScope(this);
}

StagedAdamW::FenceScope::FenceScope(FenceScope&& other) noexcept
    : optimizer_(std::exchange(other.optimizer_, nullptr)) {}

StagedAdamW::FenceScope::~FenceScope() {
  if (optimizer_ != nullptr) optimizer_->fence_ = nullptr;
}

absl::Status StagedAdamW::SetGroup(size_t index, const ParamGroup& group) {
  if (index >= options_.groups.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("param group ", index, " does not exist (", options_.groups.size(), ")"));
  }
  CKPT_RETURN_IF_ERROR(CheckClean("set a param group"));
  CKPT_RETURN_IF_ERROR(ValidateHyperParameters(group, index));
  if (group.amsgrad && !has_max_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "param group ", index, ": amsgrad needs the max_exp_avg_sq slab, which this optimizer "
        "does not have: build it with amsgrad set in some group"));
  }
  if (group.algorithm != options_.groups[index].algorithm) {
    return absl::InvalidArgumentError(absl::StrCat(
        "param group ", index, ": its algorithm (its update rule) is fixed when it is added"));
  }
  ++state_version_;
  ParamGroup& g = options_.groups[index];
  const uint64_t step = g.step;
  g = group;
  g.step = step;
  return absl::OkStatus();
}

std::span<const float> StagedAdamW::aux() const {
  return {reinterpret_cast<const float*>(slabs_->aux.data()), piece_aux_.back()};
}

std::span<float> StagedAdamW::mutable_aux() {
  ++state_version_;
  return {reinterpret_cast<float*>(slabs_->aux.data()), piece_aux_.back()};
}

uint64_t StagedAdamW::AuxStart(uint64_t slab_offset) const {
  const auto k = static_cast<size_t>(
      std::lower_bound(piece_starts_.begin(), piece_starts_.end() - 1, slab_offset) -
      piece_starts_.begin());
  return piece_aux_[k];
}

absl::Status StagedAdamW::CopyStateAsF32(StateTensor which, std::span<float> out) {
  const uint64_t size = which == StateTensor::kAux ? piece_aux_.back() : size_;
  if (out.size() != size) {
    return absl::InvalidArgumentError(
        absl::StrCat("state copy: ", out.size(), " elements asked, the optimizer has ", size));
  }
  return CopyStateRangeAsF32(which, 0, out);
}

absl::Status StagedAdamW::CopyStateRangeAsF32(StateTensor which, uint64_t offset,
                                              std::span<float> out) {
  if (which == StateTensor::kAux) {
    const uint64_t aux_size = piece_aux_.back();
    if (offset > aux_size || out.size() > aux_size - offset) {
      return absl::OutOfRangeError(absl::StrCat("state copy: aux elements [", offset, ", +",
                                                out.size(), ") lie past the optimizer's ",
                                                aux_size));
    }
    CKPT_RETURN_IF_ERROR(Synchronize());
    std::memcpy(out.data(), aux().data() + offset, out.size() * 4);
    return absl::OkStatus();
  }
  if (offset > size_ || out.size() > size_ - offset) {
    return absl::OutOfRangeError(absl::StrCat("state copy: elements [", offset, ", +",
                                              out.size(), ") lie past the optimizer's ", size_));
  }
  if (which == StateTensor::kMaxExpAvgSq && !has_max_) {
    return absl::InvalidArgumentError(
        "state copy: this optimizer keeps no max_exp_avg_sq (no group uses amsgrad)");
  }
  CKPT_RETURN_IF_ERROR(Synchronize());
  if (which == StateTensor::kMaster) {
    std::memcpy(out.data(), master().data() + offset, out.size() * 4);
    return absl::OkStatus();
  }
  const std::span<const std::byte> bytes = which == StateTensor::kExpAvg    ? exp_avg_bytes()
                                           : which == StateTensor::kExpAvgSq ? exp_avg_sq_bytes()
                                                                             : max_exp_avg_sq_bytes();
  const size_t esize = moment_bytes();
  const std::span<const std::byte> range = bytes.subspan(offset * esize, out.size() * esize);
  if (esize == 4) {
    std::memcpy(out.data(), range.data(), range.size());
    return absl::OkStatus();
  }
  formats::Convert(DType::kBF16, range, DType::kF32, std::as_writable_bytes(out));
  return absl::OkStatus();
}

absl::Status StagedAdamW::SetState(std::span<const float> master, std::span<const float> exp_avg,
                                   std::span<const float> exp_avg_sq,
                                   std::span<const uint64_t> param_steps,
                                   std::span<const float> max_exp_avg_sq,
                                   std::span<const float> aux_state) {
  CKPT_RETURN_IF_ERROR(CheckClean("set the state"));
  CKPT_RETURN_IF_ERROR(CheckNoOverlap("set the state"));
  if (fence_ != nullptr) {
    return absl::FailedPreconditionError(
        "set the state: an async save is in flight (its writer reads the slabs); finalize it "
        "first");
  }
  if ((!master.empty() && master.size() != size_) || exp_avg.size() != size_ ||
      exp_avg_sq.size() != size_ ||
      (!max_exp_avg_sq.empty() && max_exp_avg_sq.size() != size_)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "set the state: the optimizer has ", size_, " elements; given master ", master.size(),
        ", exp_avg ", exp_avg.size(), ", exp_avg_sq ", exp_avg_sq.size(), ", max_exp_avg_sq ",
        max_exp_avg_sq.size()));
  }
  if (!max_exp_avg_sq.empty() && !has_max_) {
    return absl::InvalidArgumentError(
        "set the state: max_exp_avg_sq given, but no group of this optimizer uses amsgrad");
  }
  if (!aux_state.empty() && aux_state.size() != piece_aux_.back()) {
    return absl::InvalidArgumentError(absl::StrCat("set the state: the optimizer keeps ",
                                                   piece_aux_.back(), " aux elements; given ",
                                                   aux_state.size()));
  }
  if (param_steps.size() != options_.params.size()) {
    return absl::InvalidArgumentError(absl::StrCat("set the state: ", param_steps.size(),
                                                   " step counts for ",
                                                   options_.params.size(), " parameters"));
  }
  const std::pair<const char*, std::span<const float>> named[] = {
      {"master", master},
      {"exp_avg", exp_avg},
      {"exp_avg_sq", exp_avg_sq},
      {"max_exp_avg_sq", max_exp_avg_sq},
      {"aux", aux_state}};
  for (const auto& [name, values] : named) {
    for (size_t i = 0; i < values.size(); ++i) {
      if (!std::isfinite(values[i])) {
        return absl::InvalidArgumentError(absl::StrCat("set the state: ", name, " element ", i,
                                                       " is ", values[i]));
      }
    }
  }
  CKPT_RETURN_IF_ERROR(Synchronize());
  if (!master.empty()) std::memcpy(mutable_master().data(), master.data(), size_ * 4);
  const std::pair<std::span<const float>, std::span<std::byte>> moments[] = {
      {exp_avg, mutable_exp_avg_bytes()}, {exp_avg_sq, mutable_exp_avg_sq_bytes()}};
  for (const auto& [from, to] : moments) {
    formats::Convert(DType::kF32, std::as_bytes(from),
                     moment_bytes() == 4 ? DType::kF32 : DType::kBF16, to);
  }
  if (has_max_) {
    const std::span<std::byte> to = mutable_max_exp_avg_sq_bytes();
    if (max_exp_avg_sq.empty()) {
      std::memset(to.data(), 0, to.size());
    } else {
      formats::Convert(DType::kF32, std::as_bytes(max_exp_avg_sq),
                       moment_bytes() == 4 ? DType::kF32 : DType::kBF16, to);
    }
  }
  if (!aux().empty()) {
    const std::span<float> to = mutable_aux();
    if (aux_state.empty()) {
      std::memset(to.data(), 0, to.size_bytes());
    } else {
      std::memcpy(to.data(), aux_state.data(), to.size_bytes());
    }
  }
  param_steps_.assign(param_steps.begin(), param_steps.end());
  SyncGroupSteps();
  ++state_version_;
  return absl::OkStatus();
}

absl::Status StagedAdamW::SetMasters(uint64_t offset, std::span<const float> values) {
  CKPT_RETURN_IF_ERROR(CheckClean("set masters"));
  CKPT_RETURN_IF_ERROR(CheckNoOverlap("set masters"));
  if (offset > size_ || values.size() > size_ - offset) {
    return absl::InvalidArgumentError(absl::StrCat("set masters: elements [", offset, ", +",
                                                   values.size(), ") are outside the ", size_,
                                                   " this optimizer holds"));
  }
  for (size_t i = 0; i < values.size(); ++i) {
    if (!std::isfinite(values[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat("set masters: slab element ", offset + i, " would be ", values[i]));
    }
  }
  if (values.empty()) return absl::OkStatus();
  CKPT_RETURN_IF_ERROR(Synchronize());
  if (fence_ != nullptr) {
    // The save must keep the masters from before: wait until the fence has let every unit
    // that holds one of the elements go (written, or copied aside).
    std::vector<bool> done(units_.size(), true);
    size_t left = 0;
    for (size_t u = 0; u < units_.size(); ++u) {
      if (units_[u].offset < offset + values.size() &&
          offset < units_[u].offset + units_[u].count) {
        done[u] = false;
        ++left;
      }
    }
    std::vector<size_t> ready;
    while (left > 0) {
      ready.clear();
      fence_->Acquire(done, &ready);
      for (size_t u : ready) done[u] = true;
      left -= ready.size();
    }
  }
  std::memcpy(mutable_master().data() + offset, values.data(), values.size() * 4);
  return absl::OkStatus();
}

std::span<const float> StagedAdamW::master() const {
  return {reinterpret_cast<const float*>(slabs_->master.data()), size_};
}
std::span<const float> StagedAdamW::exp_avg() const {
  if (options_.moment_dtype != MomentDType::kF32) return {};
  return {reinterpret_cast<const float*>(slabs_->exp_avg.data()), size_};
}
std::span<const float> StagedAdamW::exp_avg_sq() const {
  if (options_.moment_dtype != MomentDType::kF32) return {};
  return {reinterpret_cast<const float*>(slabs_->exp_avg_sq.data()), size_};
}
std::span<const std::byte> StagedAdamW::exp_avg_bytes() const {
  return {slabs_->exp_avg.data(), size_ * moment_bytes()};
}
std::span<const std::byte> StagedAdamW::exp_avg_sq_bytes() const {
  return {slabs_->exp_avg_sq.data(), size_ * moment_bytes()};
}
std::span<const std::byte> StagedAdamW::max_exp_avg_sq_bytes() const {
  if (!has_max_) return {};
  return {slabs_->max_exp_avg_sq.data(), size_ * moment_bytes()};
}
std::span<float> StagedAdamW::mutable_master() {
  ++state_version_;
  return {reinterpret_cast<float*>(slabs_->master.data()), size_};
}
std::span<std::byte> StagedAdamW::mutable_exp_avg_bytes() {
  ++state_version_;
  moments_untouched_ = false;
  return {slabs_->exp_avg.data(), size_ * moment_bytes()};
}
std::span<std::byte> StagedAdamW::mutable_exp_avg_sq_bytes() {
  ++state_version_;
  moments_untouched_ = false;
  return {slabs_->exp_avg_sq.data(), size_ * moment_bytes()};
}

std::span<std::byte> StagedAdamW::mutable_max_exp_avg_sq_bytes() {
  if (!has_max_) return {};
  ++state_version_;
  moments_untouched_ = false;
  return {slabs_->max_exp_avg_sq.data(), size_ * moment_bytes()};
}

}  // namespace ckpt::optimizer
