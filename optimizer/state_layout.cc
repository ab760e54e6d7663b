#include "optimizer/state_layout.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "ckpt/formats/optimizer_record.h"

namespace ckpt::optimizer::internal {

using formats::DType;

std::string StateTensorName(absl::string_view key, absl::string_view param) {
  return absl::StrCat(kOptimizerPrefix, key, ".", param);
}

StateLayout::StateLayout(std::vector<ParamSpec> params, std::vector<Piece> pieces, DType moment,
                         bool max_exp_avg_sq, std::vector<Algorithm> algorithms)
    : params_(std::move(params)),
      pieces_(std::move(pieces)),
      moment_(moment),
      max_exp_avg_sq_(max_exp_avg_sq) {
  piece_offset_.reserve(pieces_.size() + 1);
  for (const Piece& p : pieces_) {
    piece_offset_.push_back(size_);
    size_ += p.count;
  }
  piece_offset_.push_back(size_);
  rules_.reserve(params_.size());
  states_.reserve(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    const UpdateRule& rule = RuleFor(algorithms.empty() ? Algorithm::kAdamW : algorithms[i]);
    rules_.push_back(&rule);
    std::vector<ParamState>& states = states_.emplace_back();
    states.push_back({params_[i].name, params_[i].dtype, Slab::kMaster, /*weights=*/true});
    states.push_back({StateTensorName(kMasterKey, params_[i].name), DType::kF32, Slab::kMaster});
    for (const StateDecl& d : rule.states()) {
      if (d.only_with_max_slab && !max_exp_avg_sq_) continue;
      states.push_back({StateTensorName(d.key, params_[i].name), moment_, d.slab,
                        /*weights=*/false, /*moment=*/true});
    }
  }
}

StateLayout StateLayout::Of(const StagedAdamW& opt) {
  std::vector<Algorithm> algorithms;
  algorithms.reserve(opt.options().params.size());
  for (const ParamSpec& p : opt.options().params) {
    algorithms.push_back(opt.groups()[p.group].algorithm);
  }
  return StateLayout(opt.options().params, opt.options().pieces,
                     MomentDTypeOf(opt.options().moment_dtype), opt.has_max_exp_avg_sq(),
                     std::move(algorithms));
}

std::vector<TensorSpec> StateLayout::Declarations() const {
  std::vector<TensorSpec> out;
  out.reserve(params_.size() * 5);
  for (uint32_t p = 0; p < params_.size(); ++p) {
    for (const ParamState& s : states_[p]) out.push_back({s.name, s.dtype, params_[p].shape});
  }
  return out;
}

std::vector<std::string> StateTensorNames(const UpdateRule& rule, absl::string_view name,
                                          bool max_slab) {
  std::vector<std::string> out = {std::string(name), StateTensorName(kMasterKey, name)};
  for (const StateDecl& d : rule.states()) {
    if (!d.only_with_max_slab || max_slab) out.push_back(StateTensorName(d.key, name));
  }
  return out;
}

Algorithm RecordAlgorithm(const formats::OptimizerRecordGroup& group) {
  return group.muon.has_value() ? Algorithm::kMuon : Algorithm::kAdamW;
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
