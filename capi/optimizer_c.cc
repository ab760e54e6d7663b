// The C ABI's optimizer functions for the layout and the optimizer's creation (ckpt/ckpt.h):
// the pieces of each rank, create, add_params, destroy, the size and the param groups. Each
// converts the C arguments, checks its handle and sizes, and calls the C++ API under the guard of
// capi/capi_internal.h. The step and overlapped-step functions are in capi/optimizer_step_c.cc,
// the state's in capi/optimizer_state_c.cc.
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "capi/capi_internal.h"
#include "ckpt/ckpt.h"
#include "ckpt/optimizer/layout.h"
#include "ckpt/optimizer/staged_adamw.h"

namespace {

using ckpt::capi::Done;
using ckpt::capi::Fail;
using ckpt::capi::Guard;
using ckpt::capi::Invalid;
using ckpt::capi::ModelDType;
using ckpt::formats::DType;
namespace opt = ckpt::optimizer;

absl::StatusOr<std::vector<opt::ParamSpec>> Params(const ckpt_param* params, size_t n) {
  if (n > 0 && params == nullptr) return absl::InvalidArgumentError("params is NULL");
  std::vector<opt::ParamSpec> out;
  for (size_t i = 0; i < n; ++i) {
    const ckpt_param& p = params[i];
    if (p.name == nullptr) return absl::InvalidArgumentError(absl::StrCat("param ", i, " has no name"));
    if (p.ndim > 0 && p.shape == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("param \"", p.name, "\" has no shape"));
    }
    if (p.ndim > 64) return absl::InvalidArgumentError(absl::StrCat("param \"", p.name, "\": ndim ", p.ndim));
    absl::StatusOr<DType> dtype = ModelDType(p.dtype);
    if (!dtype.ok()) return dtype.status();
    out.push_back({p.name, std::vector<uint64_t>(p.shape, p.shape + p.ndim), *dtype, p.group});
  }
  return out;
}

// An unknown algorithm or lr rule becomes 255, which the optimizer's validation names.
opt::ParamGroup Group(const ckpt_group& g) {
  opt::ParamGroup p;
  p.lr = g.lr;
  p.beta1 = g.beta1;
  p.beta2 = g.beta2;
  p.eps = g.eps;
  p.weight_decay = g.weight_decay;
  p.step = g.step;
  p.amsgrad = g.amsgrad != 0;
  auto known = [](int v, int last) { return v >= 0 && v <= last ? v : 255; };
  p.algorithm =
      static_cast<opt::Algorithm>(known(g.algorithm, static_cast<int>(opt::kLastAlgorithm)));
  p.muon.momentum = g.momentum;
  p.muon.nesterov = g.nesterov != 0;
  p.muon.ns_a = g.ns_a;
  p.muon.ns_b = g.ns_b;
  p.muon.ns_c = g.ns_c;
  p.muon.ns_steps = g.ns_steps;
  p.muon.adjust_lr =
      static_cast<opt::MuonLrAdjust>(known(g.adjust_lr, CKPT_MUON_LR_MATCH_RMS_ADAMW));
  return p;
}

ckpt_group CGroup(const opt::ParamGroup& g) {
  ckpt_group c{};
  c.lr = g.lr;
  c.beta1 = g.beta1;
  c.beta2 = g.beta2;
  c.eps = g.eps;
  c.weight_decay = g.weight_decay;
  c.step = g.step;
  c.amsgrad = g.amsgrad ? 1 : 0;
  c.algorithm = static_cast<int>(g.algorithm);
  c.momentum = g.muon.momentum;
  c.nesterov = g.muon.nesterov ? 1 : 0;
  c.ns_a = g.muon.ns_a;
  c.ns_b = g.muon.ns_b;
  c.ns_c = g.muon.ns_c;
  c.ns_steps = g.muon.ns_steps;
  c.adjust_lr = static_cast<int>(g.muon.adjust_lr);
  return c;
}

}  // namespace

extern "C" {

int ckpt_rank_pieces(const ckpt_param* params, size_t nparams, uint64_t bucket_elems, int dp,
                     int rank, ckpt_piece* out, size_t capacity, size_t* count) {
  return Guard("ckpt_rank_pieces", [&]() -> int {
    if (count == nullptr || (capacity > 0 && out == nullptr)) return Invalid("out or count is NULL");
    if (dp < 1 || rank < 0 || rank >= dp) return Invalid(absl::StrCat("rank ", rank, " of ", dp));
    absl::StatusOr<std::vector<opt::ParamSpec>> specs = Params(params, nparams);
    if (!specs.ok()) return Fail(specs.status());
    opt::BucketOptions b;
    if (bucket_elems > 0) b.bucket_elems = bucket_elems;
    absl::StatusOr<std::vector<opt::Bucket>> buckets = opt::BuildBuckets(*specs, b, dp);
    if (!buckets.ok()) return Fail(buckets.status());
    const std::vector<opt::Piece> mine = opt::RankPieces(*buckets, dp)[rank];
    *count = mine.size();
    for (size_t i = 0; i < mine.size() && i < capacity; ++i) {
      out[i] = {mine[i].param, mine[i].begin, mine[i].count};
    }
    return CKPT_OK;
  });
}

int ckpt_rank_pieces_keeping_whole(const ckpt_param* params, size_t nparams,
                                   const uint8_t* whole, uint64_t bucket_elems, int dp, int rank,
                                   ckpt_piece* out, size_t capacity, size_t* count) {
  return Guard("ckpt_rank_pieces_keeping_whole", [&]() -> int {
    if (count == nullptr || (capacity > 0 && out == nullptr)) return Invalid("out or count is NULL");
    if (nparams > 0 && whole == nullptr) return Invalid("whole is NULL");
    if (dp < 1 || rank < 0 || rank >= dp) return Invalid(absl::StrCat("rank ", rank, " of ", dp));
    absl::StatusOr<std::vector<opt::ParamSpec>> specs = Params(params, nparams);
    if (!specs.ok()) return Fail(specs.status());
    opt::BucketOptions b;
    if (bucket_elems > 0) b.bucket_elems = bucket_elems;
    std::vector<bool> flags(whole, whole + nparams);
    absl::StatusOr<std::vector<std::vector<opt::Piece>>> ranks =
        opt::RankPiecesKeepingWhole(*specs, flags, b, dp);
    if (!ranks.ok()) return Fail(ranks.status());
    const std::vector<opt::Piece>& mine = (*ranks)[rank];
    *count = mine.size();
    for (size_t i = 0; i < mine.size() && i < capacity; ++i) {
      out[i] = {mine[i].param, mine[i].begin, mine[i].count};
    }
    return CKPT_OK;
  });
}

int ckpt_optimizer_create(const ckpt_param* params, size_t nparams, const ckpt_group* groups,
                          size_t ngroups, const ckpt_piece* pieces, size_t npieces,
                          const ckpt_optimizer_options* options, const void* weights,
                          size_t weight_bytes, ckpt_optimizer** out) {
  return Guard("ckpt_optimizer_create", [&]() -> int {
    if (out == nullptr) return Invalid("out is NULL");
    *out = nullptr;
    if (ngroups > 0 && groups == nullptr) return Invalid("groups is NULL");
    if (npieces > 0 && pieces == nullptr) return Invalid("pieces is NULL");
    if (weight_bytes > 0 && weights == nullptr) return Invalid("weights is NULL");
    opt::StagedAdamWOptions o;
    absl::StatusOr<std::vector<opt::ParamSpec>> specs = Params(params, nparams);
    if (!specs.ok()) return Fail(specs.status());
    o.params = *std::move(specs);
    for (size_t i = 0; i < ngroups; ++i) o.groups.push_back(Group(groups[i]));
    for (size_t i = 0; i < npieces; ++i) {
      o.pieces.push_back({pieces[i].param, pieces[i].begin, pieces[i].count});
    }
    if (options != nullptr) {
      if (options->engine != CKPT_ENGINE_CPU && options->engine != CKPT_ENGINE_CUDA) {
        return Invalid(absl::StrCat("engine ", options->engine));
      }
      if (options->moment_dtype != CKPT_MOMENTS_F32 && options->moment_dtype != CKPT_MOMENTS_BF16) {
        return Invalid(absl::StrCat("moment dtype ", options->moment_dtype));
      }
      o.engine = options->engine == CKPT_ENGINE_CUDA ? opt::EngineKind::kCuda : opt::EngineKind::kCpu;
      if (options->unit_bytes > 0) o.unit_bytes = options->unit_bytes;
      o.threads = options->threads;
      if (options->slot_count > 0) o.slot_count = options->slot_count;
      o.moment_dtype = options->moment_dtype == CKPT_MOMENTS_BF16 ? opt::MomentDType::kBF16
                                                                   : opt::MomentDType::kF32;
    }
    absl::StatusOr<std::unique_ptr<opt::StagedAdamW>> made = opt::StagedAdamW::Create(
        o, std::span<const std::byte>(static_cast<const std::byte*>(weights), weight_bytes));
    if (!made.ok()) return Fail(made.status());
    *out = new ckpt_optimizer{*std::move(made)};
    return CKPT_OK;
  });
}

int ckpt_optimizer_add_params(ckpt_optimizer* o, const ckpt_param* params, size_t nparams,
                              const ckpt_group* groups, size_t ngroups, const ckpt_piece* pieces,
                              size_t npieces, const void* weights, size_t weight_bytes) {
  return Guard("ckpt_optimizer_add_params", [&]() -> int {
    if (o == nullptr) return Invalid("optimizer is NULL");
    if (ngroups > 0 && groups == nullptr) return Invalid("groups is NULL");
    if (npieces > 0 && pieces == nullptr) return Invalid("pieces is NULL");
    if (weight_bytes > 0 && weights == nullptr) return Invalid("weights is NULL");
    absl::StatusOr<std::vector<opt::ParamSpec>> specs = Params(params, nparams);
    if (!specs.ok()) return Fail(specs.status());
    std::vector<opt::ParamGroup> added_groups;
    for (size_t i = 0; i < ngroups; ++i) added_groups.push_back(Group(groups[i]));
    std::vector<opt::Piece> added_pieces;
    for (size_t i = 0; i < npieces; ++i) {
      added_pieces.push_back({pieces[i].param, pieces[i].begin, pieces[i].count});
    }
    return Done(o->opt->AddParams(
        *specs, added_groups, added_pieces,
        std::span<const std::byte>(static_cast<const std::byte*>(weights), weight_bytes)));
  });
}

void ckpt_optimizer_destroy(ckpt_optimizer* o) { delete o; }

int ckpt_optimizer_size(const ckpt_optimizer* o, uint64_t* elements) {
  if (o == nullptr || elements == nullptr) return Invalid("optimizer or elements is NULL");
  *elements = o->opt->size();
  return CKPT_OK;
}

int ckpt_optimizer_num_groups(const ckpt_optimizer* o, size_t* count) {
  if (o == nullptr || count == nullptr) return Invalid("optimizer or count is NULL");
  *count = o->opt->groups().size();
  return CKPT_OK;
}

int ckpt_optimizer_get_group(const ckpt_optimizer* o, size_t index, ckpt_group* out) {
  if (o == nullptr || out == nullptr) return Invalid("optimizer or out is NULL");
  if (index >= o->opt->groups().size()) {
    return Invalid(absl::StrCat("param group ", index, " does not exist (", o->opt->groups().size(), ")"));
  }
  const opt::ParamGroup& g = o->opt->groups()[index];
  *out = CGroup(g);
  return CKPT_OK;
}

int ckpt_optimizer_set_group(ckpt_optimizer* o, size_t index, const ckpt_group* group) {
  if (o == nullptr || group == nullptr) return Invalid("optimizer or group is NULL");
  return Guard("ckpt_optimizer_set_group", [&]() -> int {
    opt::ParamGroup g = Group(*group);
    // A rule's own hyper-parameters are not fields of ckpt_group: they stay as they are.
    if (index < o->opt->groups().size()) g.hyper = o->opt->groups()[index].hyper;
    return Done(o->opt->SetGroup(index, g));
  });
}

}  // extern "C"
