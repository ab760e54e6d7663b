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
    const ParamSpec& param = params_[i];
    std::vector<ParamState>& states = states_.emplace_back();
    states.push_back({param.name, param.dtype, Slab::kMaster, /*weights=*/true, false,
                      param.shape});
    states.push_back({StateTensorName(kMasterKey, param.name), DType::kF32, Slab::kMaster, false,
                      false, param.shape});
    uint64_t aux = 0;
    for (const StateDecl& d : rule.states()) {
      if (d.only_with_max_slab && !max_exp_avg_sq_) continue;
      if (!StateApplies(d, param.shape)) continue;
      const bool in_aux = d.slab == Slab::kAux;
      states.push_back({StateTensorName(d.key, param.name), in_aux ? DType::kF32 : moment_, d.slab,
                        /*weights=*/false, /*moment=*/!in_aux, StateShape(d, param.shape),
                        aux});
      if (in_aux) aux += StateElements(d, param.shape);
    }
  }
  piece_aux_.reserve(pieces_.size() + 1);
  uint64_t aux = 0;
  for (const Piece& p : pieces_) {
    piece_aux_.push_back(aux);
    aux += AuxElements(*rules_[p.param], params_[p.param].shape);
  }
  piece_aux_.push_back(aux);
}

uint64_t StateLayout::AuxStart(uint64_t slab_offset) const {
  const auto k = static_cast<size_t>(
      std::lower_bound(piece_offset_.begin(), piece_offset_.end() - 1, slab_offset) -
      piece_offset_.begin());
  return piece_aux_[k];
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
    for (const ParamState& s : states_[p]) out.push_back({s.name, s.dtype, s.shape});
  }
  return out;
}

std::vector<std::string> StateTensorNames(const UpdateRule& rule, absl::string_view name,
                                          std::span<const uint64_t> shape, bool max_slab) {
  std::vector<std::string> out = {std::string(name), StateTensorName(kMasterKey, name)};
  for (const StateDecl& d : rule.states()) {
    if ((!d.only_with_max_slab || max_slab) && StateApplies(d, shape)) {
      out.push_back(StateTensorName(d.key, name));
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

absl::StatusOr<Algorithm> RecordAlgorithm(const formats::OptimizerRecordGroup& group,
                                          size_t index, absl::string_view where) {
  if (group.muon.has_value()) return Algorithm::kMuon;
  if (group.algorithm.empty()) return Algorithm::kAdamW;
  absl::StatusOr<const UpdateRule*> rule = FindRuleByKey(group.algorithm);
  if (!rule.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": param group ", index,
                                                   " steps with \"", group.algorithm,
                                                   "\", which this build of ckpt does not know"));
  }
  return (*rule)->algorithm();
}

std::string LayoutRecord(const std::vector<ParamSpec>& params,
                         const std::vector<ParamGroup>& groups,
                         const std::vector<uint64_t>& param_steps, MomentDType moments,
                         int world_size) {
  formats::OptimizerRecord record;
  // The kind: the first group's rule that is not AdamW's (Muon's, Adafactor's), else AdamW's.
  record.kind = formats::kOptimizerKindAdamW;
  for (const ParamGroup& g : groups) {
    if (g.algorithm != Algorithm::kAdamW && record.kind == formats::kOptimizerKindAdamW) {
      record.kind = std::string(RuleFor(g.algorithm).key());
    }
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
    r = {g.lr, g.beta1, g.beta2, g.eps, g.weight_decay, g.step, g.amsgrad, std::nullopt, "", {}};
    if (g.algorithm != Algorithm::kAdamW && g.algorithm != Algorithm::kMuon) {
      r.algorithm = std::string(RuleFor(g.algorithm).key());
    }
    r.hyper.insert(g.hyper.begin(), g.hyper.end());
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
