// The C ABI's calls for what a rule adds beside AdamW's fields (ckpt/ckpt.h, ABI 16): its own
// hyper-parameters by name, and its state shaped unlike its parameter (the aux slab).
#include <optional>
#include <span>

#include "absl/strings/str_cat.h"
#include "capi/capi_internal.h"
#include "ckpt/ckpt.h"
#include "ckpt/optimizer/staged_adamw.h"

namespace {

using ckpt::capi::Done;
using ckpt::capi::Guard;
using ckpt::capi::Invalid;

// sizeof(ckpt_state) as ABI 16 laid it out, frozen: later versions only append fields.
constexpr size_t kStateBytesAbi16 = 80;
static_assert(sizeof(ckpt_state) >= kStateBytesAbi16);

template <typename T>
std::span<const T> Span(const T* data, uint64_t count) {
  return data == nullptr ? std::span<const T>() : std::span<const T>(data, count);
}

}  // namespace

extern "C" {

int ckpt_optimizer_get_hyper(const ckpt_optimizer* o, size_t group, const char* name,
                             double* value, int* present) {
  return Guard("ckpt_optimizer_get_hyper", [&]() -> int {
    if (o == nullptr || name == nullptr || value == nullptr || present == nullptr) {
      return Invalid("optimizer, name, value or present is NULL");
    }
    absl::StatusOr<std::optional<double>> got = o->opt->HyperParameter(group, name);
    if (!got.ok()) return Done(got.status());
    *present = got->has_value() ? 1 : 0;
    *value = got->value_or(0.0);
    return CKPT_OK;
  });
}

int ckpt_optimizer_set_hyper(ckpt_optimizer* o, size_t group, const char* name,
                             const double* value) {
  return Guard("ckpt_optimizer_set_hyper", [&]() -> int {
    if (o == nullptr || name == nullptr) return Invalid("optimizer or name is NULL");
    return Done(o->opt->SetHyperParameter(
        group, name, value == nullptr ? std::nullopt : std::optional<double>(*value)));
  });
}

int ckpt_optimizer_aux_offsets(const ckpt_optimizer* o, uint64_t* out, size_t count) {
  return Guard("ckpt_optimizer_aux_offsets", [&]() -> int {
    if (o == nullptr || out == nullptr) return Invalid("optimizer or out is NULL");
    const size_t pieces = o->opt->options().pieces.size();
    if (count != pieces + 1) {
      return Invalid(absl::StrCat("aux_offsets: room for ", count, " offsets, the optimizer has ",
                                  pieces, " pieces (", pieces + 1, " offsets)"));
    }
    for (size_t k = 0; k <= pieces; ++k) out[k] = o->opt->piece_aux_offset(k);
    return CKPT_OK;
  });
}

int ckpt_optimizer_set_state_with(ckpt_optimizer* o, const ckpt_state* state) {
  return Guard("ckpt_optimizer_set_state_with", [&]() -> int {
    if (o == nullptr || state == nullptr) return Invalid("optimizer or state is NULL");
    // ABI 16's ckpt_state is the smallest there will be; a caller built against a later
    // header may pass a larger one (its fields beyond this ABI's are not read).
    if (state->struct_size < kStateBytesAbi16) {
      return Invalid(absl::StrCat("ckpt_state of ", state->struct_size,
                                  " bytes; ABI 16's has ", kStateBytesAbi16));
    }
    if (state->count > 0 && (state->exp_avg == nullptr || state->exp_avg_sq == nullptr)) {
      return Invalid("exp_avg or exp_avg_sq is NULL");
    }
    if (state->nparams > 0 && state->param_steps == nullptr) return Invalid("param_steps is NULL");
    return Done(o->opt->SetState(
        Span(state->master, state->count), Span(state->exp_avg, state->count),
        Span(state->exp_avg_sq, state->count), Span(state->param_steps, state->nparams),
        Span(state->max_exp_avg_sq, state->count), Span(state->aux, state->aux_count)));
  });
}

}  // extern "C"
