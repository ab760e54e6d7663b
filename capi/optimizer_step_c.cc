// The C ABI's step functions (ckpt/ckpt.h): the plain, per-piece, masked and gated steps, the
// overlapped step (ckpt_overlap_*: begin, release, drain, invalidate, finish), the gate's awaits
// and the weights written back. Each converts the C arguments, checks its handle and sizes, and
// calls the C++ API under the guard of capi/capi_internal.h; the caller's stream is NULL for the
// legacy default stream. The layout and creation functions are in capi/optimizer_c.cc.
#include <memory>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "capi/capi_internal.h"
#include "ckpt/ckpt.h"
#include "ckpt/optimizer/staged_adamw.h"

namespace {

using ckpt::capi::Done;
using ckpt::capi::Fail;
using ckpt::capi::Guard;
using ckpt::capi::Invalid;
using ckpt::capi::ModelDType;
using ckpt::formats::DType;
namespace opt = ckpt::optimizer;

// The caller's stream of a C call: NULL is torch's stream 0, the legacy default stream, named
// as such (ckpt_optimizer_step).
opt::CudaStreamView CallerStream(void* stream) {
  return stream == nullptr ? opt::CudaStreamView::Legacy()
                           : *opt::CudaStreamView::Of(static_cast<CUstream_st*>(stream));
}

}  // namespace

extern "C" {

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

}  // extern "C"
