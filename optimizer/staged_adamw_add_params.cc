// StagedAdamW::AddParams (ckpt/optimizer/staged_adamw.h): parameters added to a live optimizer,
// as torch's add_param_group. A grown optimizer is created beside this one (every check of
// optimizer/staged_adamw_create.cc applies), the current state is copied bit for bit into the
// prefix of its slabs, and this optimizer then takes its layout, slabs and engine.
#include <algorithm>
#include <cstring>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "ckpt/base/status_macros.h"
#include "ckpt/optimizer/staged_adamw.h"
#include "optimizer/engine.h"
#include "optimizer/slabs.h"

namespace ckpt::optimizer {
namespace {

// OK when no parameter of `added` is named as one of `params` or as another of `added`.
absl::Status CheckNewNames(const std::vector<ParamSpec>& params,
                           const std::vector<ParamSpec>& added) {
  std::set<std::string> taken;
  for (const ParamSpec& p : params) taken.insert(p.name);
  for (const ParamSpec& p : added) {
    if (!taken.insert(p.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("add parameters: \"", p.name, "\" is already a parameter"));
    }
  }
  return absl::OkStatus();
}

// OK when each new piece names one of `params` (the grown list) and `weight_bytes` is the size
// of the new pieces' own flat buffer: each at a multiple of its element size.
absl::Status CheckNewWeights(const std::vector<ParamSpec>& params,
                             const std::vector<Piece>& pieces, size_t weight_bytes) {
  uint64_t need = 0;
  for (const Piece& p : pieces) {
    if (p.param >= params.size()) {
      return absl::InvalidArgumentError(absl::StrCat("add parameters: a piece names param ",
                                                     p.param, " of ", params.size()));
    }
    const size_t psize = formats::DTypeSize(params[p.param].dtype);
    need = (need + psize - 1) / psize * psize + p.count * psize;
  }
  if (weight_bytes != need) {
    return absl::InvalidArgumentError(absl::StrCat("add parameters: the new weights hold ",
                                                   weight_bytes, " bytes, the new pieces need ",
                                                   need));
  }
  return absl::OkStatus();
}

// Appends the new pieces' weights (`weights`, their own flat buffer) to the flat buffer `all`,
// each at a multiple of its element size. REQUIRES: CheckNewWeights passed.
void AppendNewWeights(const std::vector<ParamSpec>& params, const std::vector<Piece>& pieces,
                      std::span<const std::byte> weights, std::vector<std::byte>& all) {
  uint64_t from = 0;
  for (const Piece& p : pieces) {
    const size_t psize = formats::DTypeSize(params[p.param].dtype);
    from = (from + psize - 1) / psize * psize;
    all.resize((all.size() + psize - 1) / psize * psize);
    all.insert(all.end(), weights.begin() + static_cast<ptrdiff_t>(from),
               weights.begin() + static_cast<ptrdiff_t>(from + p.count * psize));
    from += p.count * psize;
  }
}

}  // namespace

absl::Status StagedAdamW::AddParams(const std::vector<ParamSpec>& params,
                                    const std::vector<ParamGroup>& groups,
                                    const std::vector<Piece>& pieces,
                                    std::span<const std::byte> weights) {
  CKPT_RETURN_IF_ERROR(CheckClean("add parameters"));
  CKPT_RETURN_IF_ERROR(CheckNoOverlap("add parameters"));
  if (fence_ != nullptr) {
    return absl::FailedPreconditionError(
        "add parameters: an async save is in flight (its writer reads the slabs); finalize it "
        "first");
  }
  CKPT_RETURN_IF_ERROR(CheckNewNames(options_.params, params));
  StagedAdamWOptions grown = options_;
  grown.params.insert(grown.params.end(), params.begin(), params.end());
  grown.groups.insert(grown.groups.end(), groups.begin(), groups.end());
  for (size_t g = options_.groups.size(); g < grown.groups.size(); ++g) grown.groups[g].step = 0;
  grown.pieces.insert(grown.pieces.end(), pieces.begin(), pieces.end());
  CKPT_RETURN_IF_ERROR(CheckNewWeights(grown.params, pieces, weights.size()));
  // The grown flat weight buffer: the current pieces as they are (their offsets do not move),
  // then the new ones.
  CKPT_RETURN_IF_ERROR(Synchronize());
  std::vector<std::byte> all(weight_bytes());
  if (size_ > 0) {
    // The current weights are the masters rounded; they only seed masters overwritten below.
    StepArgs where;
    where.params = all.data();
    CKPT_RETURN_IF_ERROR(engine_->WriteWeights(View(), units_, where, std::nullopt));
  }
  AppendNewWeights(grown.params, pieces, weights, all);
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<StagedAdamW> next, CreateWith(std::move(grown), all, has_max_));
  // The current state, bit for bit, into the prefix of the grown slabs.
  std::memcpy(next->mutable_master().data(), master().data(), size_ * 4);
  if (!moments_untouched_) {
    std::memcpy(next->mutable_exp_avg_bytes().data(), exp_avg_bytes().data(),
                size_ * moment_bytes());
    std::memcpy(next->mutable_exp_avg_sq_bytes().data(), exp_avg_sq_bytes().data(),
                size_ * moment_bytes());
    if (has_max_) {
      std::memcpy(next->mutable_max_exp_avg_sq_bytes().data(), max_exp_avg_sq_bytes().data(),
                  size_ * moment_bytes());
    }
  }
  // The aux state of the current pieces, which come first in the grown aux slab too.
  if (!aux().empty()) std::memcpy(next->mutable_aux().data(), aux().data(), aux().size_bytes());
  // The current counts; the new parameters start at 0 (Create gave them their group's).
  std::fill(next->param_steps_.begin(), next->param_steps_.end(), 0);
  std::copy(param_steps_.begin(), param_steps_.end(), next->param_steps_.begin());
  for (size_t g = 0; g < options_.groups.size(); ++g) next->options_.groups[g] = options_.groups[g];
  next->SyncGroupSteps();
  // Take the grown layout; the old slabs and engine go (the engine drained first).
  CKPT_RETURN_IF_ERROR(engine_->Synchronize());
  engine_ = std::move(next->engine_);
  slabs_ = std::move(next->slabs_);
  spare_.reset();  // The next overlapped step allocates one of the grown size.
  options_ = std::move(next->options_);
  size_ = next->size_;
  units_ = std::move(next->units_);
  piece_starts_ = std::move(next->piece_starts_);
  piece_dtypes_ = std::move(next->piece_dtypes_);
  piece_bytes_ = std::move(next->piece_bytes_);
  piece_aux_ = std::move(next->piece_aux_);
  mixed_dtypes_ = next->mixed_dtypes_;
  has_max_ = next->has_max_;
  widest_ = next->widest_;
  param_steps_ = std::move(next->param_steps_);
  ++state_version_;
  return absl::OkStatus();
}

}  // namespace ckpt::optimizer
