// The C ABI's optimizer functions (ckpt/ckpt.h: layout, StagedAdamW): each converts the C
// arguments, checks its handle and sizes, and calls the C++ API under the guard of
// capi/capi_internal.h.
#include <algorithm>
#include <cstring>
#include <optional>
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
using ckpt::formats::DType;
namespace opt = ckpt::optimizer;

absl::StatusOr<DType> ModelDType(int d) {
  switch (d) {
    case CKPT_F32:
      return DType::kF32;
    case CKPT_BF16:
      return DType::kBF16;
    case CKPT_F16:
      return DType::kF16;
    default:
      return absl::InvalidArgumentError(absl::StrCat("dtype ", d, " is not CKPT_F32, CKPT_BF16 or CKPT_F16"));
  }
}

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

// The caller's stream of a C call: NULL is torch's stream 0, the legacy default stream, named
// as such (ckpt_optimizer_step).
opt::CudaStreamView CallerStream(void* stream) {
  return stream == nullptr ? opt::CudaStreamView::Legacy()
                           : *opt::CudaStreamView::Of(static_cast<CUstream_st*>(stream));
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
  p.algorithm = static_cast<opt::Algorithm>(known(g.algorithm, CKPT_ADAFACTOR));
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

int ckpt_optimizer_step(ckpt_optimizer* o, const void* grads, int grad_dtype, float grad_scale,
                        void* params, int check_finite, void* stream, int* skipped) {
  return Guard("ckpt_optimizer_step", [&]() -> int {
    if (o == nullptr) return Invalid("optimizer is NULL");
    absl::StatusOr<DType> gd = ModelDType(grad_dtype);
    if (!gd.ok()) return Fail(gd.status());
    opt::StepArgs args;
    args.grads = grads;
    args.grad_dtype = *gd;
    args.grad_scale = grad_scale;
    args.params = params;
    args.check_finite = check_finite != 0;
    // Step orders the caller's stream after its writes of `params`.
    args.stream = CallerStream(stream);
    absl::StatusOr<opt::StepReport> r = o->opt->Step(args);
    if (!r.ok()) return Fail(r.status());
    if (skipped != nullptr) *skipped = r->skipped ? 1 : 0;
    return CKPT_OK;
  });
}

int ckpt_optimizer_write_weights(ckpt_optimizer* o, void* dest, int on_device, void* stream) {
  return Guard("ckpt_optimizer_write_weights", [&]() -> int {
    if (o == nullptr) return Invalid("optimizer is NULL");
    std::optional<opt::CudaStreamView> view;
    if (on_device != 0) {
      view = CallerStream(stream);
    }
    return Done(o->opt->WriteModelWeights(dest, view));
  });
}

namespace {

// The StepArgs of a step on each piece's own buffers, from the C arguments (a masked step's,
// an overlapped step's finish); `buffers` receives the pointers and must outlive the result.
absl::StatusOr<opt::StepArgs> PieceStepArgs(const void* const* grads, void* const* params,
                                            size_t npieces, const uint8_t* stepped,
                                            size_t nparams, int grad_dtype, float grad_scale,
                                            int check_finite, void* stream,
                                            std::vector<opt::PieceBuffers>* buffers) {
  if (npieces > 0 && (grads == nullptr || params == nullptr))
    return absl::InvalidArgumentError("grads or params is NULL");
  if (nparams > 0 && stepped == nullptr) return absl::InvalidArgumentError("stepped is NULL");
  absl::StatusOr<DType> gd = ModelDType(grad_dtype);
  if (!gd.ok()) return gd.status();
  buffers->resize(npieces);
  for (size_t k = 0; k < npieces; ++k) (*buffers)[k] = {grads[k], params[k]};
  opt::StepArgs args;
  args.grad_dtype = *gd;
  args.grad_scale = grad_scale;
  args.check_finite = check_finite != 0;
  args.pieces = *buffers;
  args.stepped = std::span<const uint8_t>(stepped, nparams);
  args.stream = CallerStream(stream);
  return args;
}

int StepPieces(const char* what, ckpt_optimizer* o, const void* const* grads,
               void* const* params, size_t npieces, const uint8_t* stepped, size_t nparams,
               int grad_dtype, float grad_scale, int check_finite, void* stream, int* skipped,
               int* gated = nullptr) {
  return Guard(what, [&]() -> int {
    if (o == nullptr) return Invalid("optimizer is NULL");
    std::vector<opt::PieceBuffers> buffers;
    absl::StatusOr<opt::StepArgs> args =
        PieceStepArgs(grads, params, npieces, stepped, nparams, grad_dtype, grad_scale,
                      check_finite, stream, &buffers);
    if (!args.ok()) return Fail(args.status());
    if (npieces == 0 && o->opt->size() > 0) return Invalid("no piece buffers");
    args->gate = gated != nullptr;
    absl::StatusOr<opt::StepReport> r = o->opt->Step(*args);
    if (!r.ok()) return Fail(r.status());
    if (skipped != nullptr) *skipped = r->skipped ? 1 : 0;
    if (gated != nullptr) *gated = r->gated ? 1 : 0;
    return CKPT_OK;
  });
}

}  // namespace

int ckpt_optimizer_step_pieces(ckpt_optimizer* o, const void* const* grads, void* const* params,
                               size_t npieces, int grad_dtype, float grad_scale,
                               int check_finite, void* stream, int* skipped) {
  return StepPieces("ckpt_optimizer_step_pieces", o, grads, params, npieces, nullptr, 0,
                    grad_dtype, grad_scale, check_finite, stream, skipped);
}

int ckpt_optimizer_step_masked(ckpt_optimizer* o, const void* const* grads, void* const* params,
                               size_t npieces, const uint8_t* stepped, size_t nparams,
                               int grad_dtype, float grad_scale, int check_finite, void* stream,
                               int* skipped) {
  if (o != nullptr && nparams != o->opt->options().params.size()) {
    return Invalid(absl::StrCat("step_masked: ", nparams, " stepped flags for ",
                                o->opt->options().params.size(), " parameters"));
  }
  return StepPieces("ckpt_optimizer_step_masked", o, grads, params, npieces, stepped, nparams,
                    grad_dtype, grad_scale, check_finite, stream, skipped);
}

int ckpt_optimizer_step_gated(ckpt_optimizer* o, const void* const* grads, void* const* params,
                              size_t npieces, const uint8_t* stepped, size_t nparams,
                              int grad_dtype, float grad_scale, int check_finite, void* stream,
                              int* skipped, int* gated) {
  if (o != nullptr && nparams != o->opt->options().params.size()) {
    return Invalid(absl::StrCat("step_gated: ", nparams, " stepped flags for ",
                                o->opt->options().params.size(), " parameters"));
  }
  int opened = 0;
  const int rc = StepPieces("ckpt_optimizer_step_gated", o, grads, params, npieces, stepped,
                            nparams, grad_dtype, grad_scale, check_finite, stream, skipped,
                            &opened);
  if (gated != nullptr) *gated = opened;
  return rc;
}

struct ckpt_overlap {
  std::optional<opt::StagedAdamW::Overlap> overlap;
};

namespace {

// ckpt_overlap_begin and _begin_gated: an overlapped step opened with `options`.
int BeginOverlap(const char* what, ckpt_optimizer* o, int grad_dtype, float grad_scale,
                 void* stream, const opt::OverlapOptions& options, ckpt_overlap** out) {
  return Guard(what, [&]() -> int {
    if (o == nullptr || out == nullptr) return Invalid("optimizer or out is NULL");
    absl::StatusOr<DType> gd = ModelDType(grad_dtype);
    if (!gd.ok()) return Fail(gd.status());
    opt::StepArgs args;
    args.grad_dtype = *gd;
    args.grad_scale = grad_scale;
    args.stream = CallerStream(stream);
    absl::StatusOr<opt::StagedAdamW::Overlap> ov = o->opt->BeginOverlap(args, options);
    if (!ov.ok()) return Fail(ov.status());
    auto handle = std::make_unique<ckpt_overlap>();
    handle->overlap.emplace(std::move(*ov));
    *out = handle.release();
    return CKPT_OK;
  });
}

}  // namespace

int ckpt_overlap_begin(ckpt_optimizer* o, int grad_dtype, float grad_scale, void* stream,
                       int speculate, ckpt_overlap** out) {
  opt::OverlapOptions options;
  options.speculate = speculate != 0;
  return BeginOverlap("ckpt_overlap_begin", o, grad_dtype, grad_scale, stream, options, out);
}

int ckpt_overlap_begin_gated(ckpt_optimizer* o, int grad_dtype, float grad_scale, void* stream,
                             uint32_t window, ckpt_overlap** out) {
  opt::OverlapOptions options;
  options.gate = true;
  if (window != 0) options.window = window;
  return BeginOverlap("ckpt_overlap_begin_gated", o, grad_dtype, grad_scale, stream, options,
                      out);
}

int ckpt_optimizer_await_pieces(ckpt_optimizer* o, const uint32_t* pieces, size_t n,
                                void* stream) {
  return Guard("ckpt_optimizer_await_pieces", [&]() -> int {
    if (o == nullptr) return Invalid("optimizer is NULL");
    if (n > 0 && pieces == nullptr) return Invalid("pieces is NULL");
    return Done(o->opt->AwaitPieces(std::span<const uint32_t>(pieces, n), CallerStream(stream)));
  });
}

int ckpt_optimizer_gate_open(const ckpt_optimizer* o, int* open) {
  return Guard("ckpt_optimizer_gate_open", [&]() -> int {
    if (o == nullptr || open == nullptr) return Invalid("optimizer or open is NULL");
    *open = o->opt->gate_open() ? 1 : 0;
    return CKPT_OK;
  });
}

int ckpt_optimizer_await_step(ckpt_optimizer* o, void* stream) {
  return Guard("ckpt_optimizer_await_step", [&]() -> int {
    if (o == nullptr) return Invalid("optimizer is NULL");
    return Done(o->opt->AwaitStep(CallerStream(stream)));
  });
}

int ckpt_overlap_release(ckpt_overlap* ov, const uint32_t* pieces, const void* const* grads,
                         void* const* params, size_t n) {
  return Guard("ckpt_overlap_release", [&]() -> int {
    if (ov == nullptr || !ov->overlap.has_value()) return Invalid("overlap is NULL or closed");
    if (n > 0 && (pieces == nullptr || grads == nullptr || params == nullptr))
      return Invalid("pieces, grads or params is NULL");
    std::vector<opt::PieceBuffers> buffers(n);
    for (size_t i = 0; i < n; ++i) buffers[i] = {grads[i], params[i]};
    return Done(ov->overlap->Release(std::span<const uint32_t>(pieces, n), buffers));
  });
}

int ckpt_overlap_drain(ckpt_overlap* ov) {
  if (ov == nullptr || !ov->overlap.has_value()) return Invalid("overlap is NULL or closed");
  ov->overlap->Drain();
  return CKPT_OK;
}

int ckpt_overlap_invalidate(ckpt_overlap* ov) {
  if (ov == nullptr || !ov->overlap.has_value()) return Invalid("overlap is NULL or closed");
  ov->overlap->Invalidate();
  return CKPT_OK;
}

int ckpt_overlap_finish(ckpt_overlap* ov, const void* const* grads, void* const* params,
                        size_t npieces, const uint8_t* stepped, size_t nparams, int grad_dtype,
                        float grad_scale, int check_finite, void* stream, int* skipped,
                        uint64_t* speculated, int* held) {
  return Guard("ckpt_overlap_finish", [&]() -> int {
    if (ov == nullptr || !ov->overlap.has_value()) return Invalid("overlap is NULL or closed");
    std::vector<opt::PieceBuffers> buffers;
    absl::StatusOr<opt::StepArgs> args =
        PieceStepArgs(grads, params, npieces, stepped, nparams, grad_dtype, grad_scale,
                      check_finite, stream, &buffers);
    if (!args.ok()) return Fail(args.status());
    absl::StatusOr<opt::StepReport> r = ov->overlap->Finish(*args);
    ov->overlap.reset();
    if (!r.ok()) return Fail(r.status());
    if (skipped != nullptr) *skipped = r->skipped ? 1 : 0;
    if (speculated != nullptr) *speculated = r->speculated_units;
    if (held != nullptr) *held = r->speculation_held ? 1 : 0;
    return CKPT_OK;
  });
}

void ckpt_overlap_destroy(ckpt_overlap* ov) { delete ov; }

int ckpt_optimizer_write_piece_weights(ckpt_optimizer* o, void* const* params, size_t npieces,
                                       int on_device, void* stream) {
  return Guard("ckpt_optimizer_write_piece_weights", [&]() -> int {
    if (o == nullptr || (npieces > 0 && params == nullptr)) return Invalid("optimizer or params is NULL");
    std::vector<opt::PieceBuffers> buffers(npieces);
    for (size_t k = 0; k < npieces; ++k) buffers[k].params = params[k];
    std::optional<opt::CudaStreamView> view;
    if (on_device != 0) view = CallerStream(stream);
    return Done(o->opt->WriteModelWeights(std::span<const opt::PieceBuffers>(buffers), view));
  });
}

int ckpt_optimizer_param_steps(const ckpt_optimizer* o, uint64_t* out, size_t nparams) {
  if (o == nullptr || (nparams > 0 && out == nullptr)) return Invalid("optimizer or out is NULL");
  const std::vector<uint64_t>& steps = o->opt->param_steps();
  if (nparams != steps.size()) {
    return Invalid(absl::StrCat("param_steps: ", nparams, " asked, the optimizer has ",
                                steps.size(), " parameters"));
  }
  std::copy(steps.begin(), steps.end(), out);
  return CKPT_OK;
}

int ckpt_optimizer_set_masters(ckpt_optimizer* o, uint64_t offset, const float* values,
                               uint64_t count) {
  return Guard("ckpt_optimizer_set_masters", [&]() -> int {
    if (o == nullptr || (count > 0 && values == nullptr)) return Invalid("optimizer or values is NULL");
    return Done(o->opt->SetMasters(offset, std::span<const float>(values, count)));
  });
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

namespace {

absl::StatusOr<opt::StagedAdamW::StateTensor> StateTensorOf(int which) {
  using State = opt::StagedAdamW::StateTensor;
  switch (which) {
    case CKPT_MASTER: return State::kMaster;
    case CKPT_EXP_AVG: return State::kExpAvg;
    case CKPT_EXP_AVG_SQ: return State::kExpAvgSq;
    case CKPT_MAX_EXP_AVG_SQ: return State::kMaxExpAvgSq;
    case CKPT_AUX: return State::kAux;
    default: return absl::InvalidArgumentError(absl::StrCat("state tensor ", which));
  }
}

}  // namespace

int ckpt_optimizer_read_state(ckpt_optimizer* o, int which, float* out, uint64_t count) {
  return Guard("ckpt_optimizer_read_state", [&]() -> int {
    if (o == nullptr || (count > 0 && out == nullptr)) return Invalid("optimizer or out is NULL");
    const uint64_t size = which == CKPT_AUX ? o->opt->aux().size() : o->opt->size();
    if (count != size) {
      return Invalid(absl::StrCat("read_state: ", count, " elements asked, the optimizer has ", size));
    }
    absl::StatusOr<opt::StagedAdamW::StateTensor> tensor = StateTensorOf(which);
    if (!tensor.ok()) return Done(tensor.status());
    return Done(o->opt->CopyStateAsF32(*tensor, std::span<float>(out, count)));
  });
}

int ckpt_optimizer_read_state_range(ckpt_optimizer* o, int which, uint64_t offset, float* out,
                                    uint64_t count) {
  return Guard("ckpt_optimizer_read_state_range", [&]() -> int {
    if (o == nullptr || (count > 0 && out == nullptr)) return Invalid("optimizer or out is NULL");
    absl::StatusOr<opt::StagedAdamW::StateTensor> tensor = StateTensorOf(which);
    if (!tensor.ok()) return Done(tensor.status());
    return Done(o->opt->CopyStateRangeAsF32(*tensor, offset, std::span<float>(out, count)));
  });
}

namespace {

int SetState(ckpt_optimizer* o, const float* master, const float* exp_avg,
             const float* exp_avg_sq, const float* max_exp_avg_sq, uint64_t count,
             std::span<const uint64_t> param_steps) {
  if (o == nullptr) return Invalid("optimizer is NULL");
  if (count > 0 && (exp_avg == nullptr || exp_avg_sq == nullptr)) {
    return Invalid("exp_avg or exp_avg_sq is NULL");
  }
  return Done(o->opt->SetState(
      master == nullptr ? std::span<const float>() : std::span<const float>(master, count),
      std::span<const float>(exp_avg, count), std::span<const float>(exp_avg_sq, count),
      param_steps,
      max_exp_avg_sq == nullptr ? std::span<const float>()
                                : std::span<const float>(max_exp_avg_sq, count)));
}

}  // namespace

int ckpt_optimizer_set_state(ckpt_optimizer* o, const float* master, const float* exp_avg,
                             const float* exp_avg_sq, uint64_t count, const uint64_t* steps,
                             size_t nsteps) {
  return Guard("ckpt_optimizer_set_state", [&]() -> int {
    if (o == nullptr) return Invalid("optimizer is NULL");
    if (nsteps > 0 && steps == nullptr) return Invalid("steps is NULL");
    const size_t groups = o->opt->groups().size();
    if (nsteps != groups) {
      return Invalid(absl::StrCat("set the state: ", nsteps, " step counters for ", groups,
                                  " param groups"));
    }
    // One count per group (ABI 6): each parameter takes its group's.
    std::vector<uint64_t> per_param;
    for (const opt::ParamSpec& p : o->opt->options().params) per_param.push_back(steps[p.group]);
    return SetState(o, master, exp_avg, exp_avg_sq, nullptr, count, per_param);
  });
}

int ckpt_optimizer_set_param_state(ckpt_optimizer* o, const float* master, const float* exp_avg,
                                   const float* exp_avg_sq, const float* max_exp_avg_sq,
                                   uint64_t count, const uint64_t* param_steps, size_t nparams) {
  return Guard("ckpt_optimizer_set_param_state", [&]() -> int {
    if (nparams > 0 && param_steps == nullptr) return Invalid("param_steps is NULL");
    return SetState(o, master, exp_avg, exp_avg_sq, max_exp_avg_sq, count,
                    std::span<const uint64_t>(param_steps, nparams));
  });
}

int ckpt_optimizer_lifecycle(const ckpt_optimizer* o, int* lifecycle) {
  if (o == nullptr || lifecycle == nullptr) return Invalid("optimizer or lifecycle is NULL");
  switch (o->opt->lifecycle()) {
    case opt::Lifecycle::kClean:
      *lifecycle = CKPT_LIFECYCLE_CLEAN;
      break;
    case opt::Lifecycle::kLoading:
      *lifecycle = CKPT_LIFECYCLE_LOADING;
      break;
    case opt::Lifecycle::kPoisoned:
      *lifecycle = CKPT_LIFECYCLE_POISONED;
      break;
  }
  return CKPT_OK;
}
}  // extern "C"
