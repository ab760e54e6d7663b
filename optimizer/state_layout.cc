#include "optimizer/state_layout.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "ckpt/formats/optimizer_record.h"

namespace ckpt::optimizer::internal {

using formats::DType;

std::string StateTensorName(StateKind kind, absl::string_view param) {
  switch (kind) {
    case StateKind::kWeights:
      return std::string(param);
    case StateKind::kMaster:
      return absl::StrCat("optimizer.master.", param);
    case StateKind::kExpAvg:
      return absl::StrCat("optimizer.exp_avg.", param);
    case StateKind::kExpAvgSq:
      return absl::StrCat("optimizer.exp_avg_sq.", param);
    case StateKind::kMaxExpAvgSq:
      return absl::StrCat("optimizer.max_exp_avg_sq.", param);
    case StateKind::kMomentum:
      return absl::StrCat("optimizer.momentum.", param);
  }
  return std::string(param);  // Unreachable: the switch names every kind.
}

StateLayout::StateLayout(std::vector<ParamSpec> params, std::vector<Piece> pieces, DType moment,
                         bool max_exp_avg_sq, std::vector<bool> muon)
    : params_(std::move(params)),
      pieces_(std::move(pieces)),
      moment_(moment),
      max_exp_avg_sq_(max_exp_avg_sq),
      muon_(std::move(muon)) {
  piece_offset_.reserve(pieces_.size() + 1);
  for (const Piece& p : pieces_) {
    piece_offset_.push_back(size_);
    size_ += p.count;
  }
  piece_offset_.push_back(size_);
  names_.reserve(params_.size());
  for (const ParamSpec& p : params_) {
    std::vector<std::string>& names = names_.emplace_back();
    for (size_t kind = 0; kind < kStateKinds; ++kind) {
      names.push_back(StateTensorName(static_cast<StateKind>(kind), p.name));
    }
  }
}

StateLayout StateLayout::Of(const StagedAdamW& opt) {
  std::vector<bool> muon;
  if (opt.has_muon()) {
    for (const ParamSpec& p : opt.options().params) {
      muon.push_back(opt.groups()[p.group].algorithm == Algorithm::kMuon);
    }
  }
  return StateLayout(opt.options().params, opt.options().pieces,
                     MomentDTypeOf(opt.options().moment_dtype), opt.has_max_exp_avg_sq(),
                     std::move(muon));
}

DType StateLayout::dtype(StateKind kind, uint32_t param) const {
  return kind == StateKind::kWeights ? params_[param].dtype : dtype(kind);
}

DType StateLayout::dtype(StateKind kind) const {
  switch (kind) {
    case StateKind::kWeights:
      return params_.empty() ? DType::kF32 : params_[0].dtype;  // REQUIRES excludes this.
    case StateKind::kMaster:
      return DType::kF32;
    case StateKind::kExpAvg:
    case StateKind::kExpAvgSq:
    case StateKind::kMaxExpAvgSq:
    case StateKind::kMomentum:
      return moment_;
  }
  return DType::kF32;  // Unreachable.
}

std::vector<TensorSpec> StateLayout::Declarations() const {
  std::vector<TensorSpec> out;
  out.reserve(params_.size() * kinds().size());
  for (uint32_t p = 0; p < params_.size(); ++p) {
    for (StateKind kind : kinds(p)) {
      out.push_back({name(p, kind), dtype(kind, p), params_[p].shape});
    }
  }
  return out;
}

std::vector<StateRun> StateLayout::Runs(uint64_t begin, uint64_t count) const {
  std::vector<StateRun> out;
  const uint64_t end = begin + count;
  // The last piece that starts at or before `begin`.
  size_t i = static_cast<size_t>(
      std::upper_bound(piece_offset_.begin(), piece_offset_.end() - 1, begin) -
      piece_offset_.begin());
  i = i == 0 ? 0 : i - 1;
  for (; i < pieces_.size() && piece_offset_[i] < end; ++i) {
    const uint64_t lo = std::max(begin, piece_offset_[i]);
    const uint64_t hi = std::min(end, piece_offset_[i + 1]);
    if (lo >= hi) continue;  // An empty piece, or one that ends at `begin`.
    out.push_back({pieces_[i].param, pieces_[i].begin + (lo - piece_offset_[i]), lo, hi - lo});
  }
  return out;
}

std::string LayoutRecord(const std::vector<ParamSpec>& params,
                         const std::vector<ParamGroup>& groups,
                         const std::vector<uint64_t>& param_steps, MomentDType moments,
                         int world_size) {
  formats::OptimizerRecord record;
  record.kind = formats::kOptimizerKindAdamW;
  for (const ParamGroup& g : groups) {
    if (g.algorithm == Algorithm::kMuon) record.kind = formats::kOptimizerKindMuon;
  }
  record.moment_dtype = MomentDTypeOf(moments);
  record.world_size = static_cast<uint32_t>(world_size);
  bool together = true;  // Every parameter at its group's step count.
  for (size_t i = 0; i < params.size(); ++i) {
    record.params.push_back({params[i].name, params[i].shape, params[i].dtype, params[i].group,
                             std::nullopt});
    together &= param_steps[i] == groups[params[i].group].step;
  }
  if (!together) {
    for (size_t i = 0; i < params.size(); ++i) record.params[i].step = param_steps[i];
  }
  for (const ParamGroup& g : groups) {
    formats::OptimizerRecordGroup& r = record.groups.emplace_back();
    r = {g.lr, g.beta1, g.beta2, g.eps, g.weight_decay, g.step, g.amsgrad, std::nullopt};
    if (g.algorithm == Algorithm::kMuon) {
      const MuonParams& m = g.muon;
      r.muon = formats::OptimizerRecordMuon{
          m.momentum, m.nesterov, m.ns_a, m.ns_b, m.ns_c, m.ns_steps,
          m.adjust_lr == MuonLrAdjust::kOriginal ? formats::kMuonLrOriginal
                                                 : formats::kMuonLrMatchRmsAdamW};
    }
  }
  return formats::EncodeOptimizerRecord(record);
}

std::string ListNames(const std::vector<std::string>& names) {
  constexpr size_t kShown = 10;
  std::vector<std::string> shown(names.begin(),
                                 names.begin() + std::min<size_t>(kShown, names.size()));
  std::string out = absl::StrJoin(shown, ", ");
  if (names.size() > shown.size()) absl::StrAppend(&out, " and ", names.size() - kShown, " more");
  return out;
}

}  // namespace ckpt::optimizer::internal
