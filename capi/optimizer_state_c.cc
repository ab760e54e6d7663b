// The C ABI's optimizer state functions (ckpt/ckpt.h): the step counts, the masters set in
// place, the state read as FP32 (whole or a range), the whole state replaced, and the
// lifecycle. Each converts the C arguments, checks its handle and sizes, and calls the C++ API
// under the guard of capi/capi_internal.h. A rule's own state and hyper-parameters are in
// capi/rules_c.cc.
#include <algorithm>
#include <span>
#include <vector>

#include "absl/strings/str_cat.h"
#include "capi/capi_internal.h"
#include "ckpt/ckpt.h"
#include "ckpt/optimizer/staged_adamw.h"

namespace {

using ckpt::capi::Done;
using ckpt::capi::Guard;
using ckpt::capi::Invalid;
namespace opt = ckpt::optimizer;

}  // namespace

extern "C" {

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
