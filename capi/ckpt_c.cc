// The C ABI (ckpt/ckpt.h) over the C++ API. Every entry point converts the C++ status into a
// code plus a thread-local message, checks its handles and sizes before touching them, and
// catches what the C++ standard library may throw (std::bad_alloc, a thread that cannot be
// started), so that nothing crosses the boundary but a code.
#include "ckpt/ckpt.h"

#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "ckpt/checkpoint_store.h"
#include "ckpt/coordinator.h"
#include "ckpt/optimizer/checkpointer.h"
#include "ckpt/optimizer/layout.h"
#include "ckpt/optimizer/staged_adamw.h"
#include "capi/capi_internal.h"

struct ckpt_optimizer {
  std::unique_ptr<ckpt::optimizer::StagedAdamW> opt;
};

namespace {

using ckpt::capi::CallbackCoordinator;
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

opt::ParamGroup Group(const ckpt_group& g) {
  return {g.lr, g.beta1, g.beta2, g.eps, g.weight_decay, g.step};
}

opt::Blobs MakeBlobs(const char* const* keys, const void* const* values, const size_t* lens,
                     size_t n, absl::Status* status) {
  opt::Blobs out;
  if (n > 0 && (keys == nullptr || values == nullptr || lens == nullptr)) {
    *status = absl::InvalidArgumentError("blobs: keys, values or lens is NULL");
    return out;
  }
  for (size_t i = 0; i < n; ++i) {
    if (keys[i] == nullptr || (lens[i] > 0 && values[i] == nullptr)) {
      *status = absl::InvalidArgumentError(absl::StrCat("blob ", i, ": NULL key or value"));
      return out;
    }
    out[keys[i]] = std::string(static_cast<const char*>(values[i]), lens[i]);
  }
  return out;
}

}  // namespace

struct ckpt_checkpointer {
  std::unique_ptr<CallbackCoordinator> callbacks;
  std::unique_ptr<ckpt::SingleProcessCoordinator> single;
  std::unique_ptr<opt::Checkpointer> ckpt;
  opt::StagedAdamW* opt = nullptr;
  // ckpt_checkpointer_create (ABI 1 to 5): the weight buffer every successful load rewrites
  // from the masters, as those versions promise. Null for ckpt_checkpointer_open (ABI 6), whose
  // caller writes its weights with ckpt_optimizer_write_weights.
  void* weights = nullptr;
};

struct ckpt_pending_save {
  std::unique_ptr<opt::PendingSave> save;
};

struct ckpt_blobs {
  std::vector<std::pair<std::string, std::string>> items;
};

namespace {

// ckpt_checkpointer_create and _open, once their own arguments are checked.
int OpenCheckpointer(ckpt_optimizer* o, ckpt_store* store, const ckpt_coordinator* coordinator,
                     uint64_t async_staging_bytes, ckpt_checkpointer** out) {
  auto c = std::make_unique<ckpt_checkpointer>();
  ckpt::Coordinator* coord = nullptr;
  if (coordinator != nullptr) {
    const absl::Status usable = ckpt::capi::CheckCoordinator(*coordinator);
    if (!usable.ok()) return Fail(usable);
    c->callbacks = std::make_unique<CallbackCoordinator>(*coordinator);
    coord = c->callbacks.get();
  } else {
    c->single = std::make_unique<ckpt::SingleProcessCoordinator>();
    coord = c->single.get();
  }
  opt::CheckpointerOptions co;
  if (async_staging_bytes > 0) co.async_staging_bytes = async_staging_bytes;
  absl::StatusOr<std::unique_ptr<opt::Checkpointer>> made =
      opt::Checkpointer::Create(o->opt.get(), store->store.get(), coord, co);
  if (!made.ok()) return Fail(made.status());
  c->ckpt = *std::move(made);
  c->opt = o->opt.get();
  *out = c.release();
  return CKPT_OK;
}

// After a successful load through a checkpointer of ABI 1 to 5: its weight buffer follows.
absl::Status AfterLoad(ckpt_checkpointer* c) {
  if (c->weights == nullptr) return absl::OkStatus();
  return c->opt->WriteModelWeights(c->weights);
}

}  // namespace

extern "C" {

int ckpt_abi_version(void) { return CKPT_ABI_VERSION; }

const char* ckpt_last_error(void) { return ckpt::capi::last_error.c_str(); }

void* ckpt_alloc(size_t bytes) { return std::malloc(bytes == 0 ? 1 : bytes); }

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
    // The C ABI's NULL is torch's stream 0: the legacy default stream, named as such. Step
    // orders the stream after its writes of `params`.
    args.stream = stream == nullptr ? opt::CudaStreamView::Legacy()
                                    : *opt::CudaStreamView::Of(static_cast<CUstream_st*>(stream));
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
      // NULL is torch's stream 0, the legacy default stream, as in ckpt_optimizer_step.
      view = stream == nullptr ? opt::CudaStreamView::Legacy()
                               : *opt::CudaStreamView::Of(static_cast<CUstream_st*>(stream));
    }
    return Done(o->opt->WriteModelWeights(dest, view));
  });
}

int ckpt_optimizer_step_pieces(ckpt_optimizer* o, const void* const* grads, void* const* params,
                               size_t npieces, int grad_dtype, float grad_scale,
                               int check_finite, void* stream, int* skipped) {
  return Guard("ckpt_optimizer_step_pieces", [&]() -> int {
    if (o == nullptr) return Invalid("optimizer is NULL");
    if (npieces > 0 && (grads == nullptr || params == nullptr)) {
      return Invalid("grads or params is NULL");
    }
    absl::StatusOr<DType> gd = ModelDType(grad_dtype);
    if (!gd.ok()) return Fail(gd.status());
    std::vector<opt::PieceBuffers> buffers(npieces);
    for (size_t k = 0; k < npieces; ++k) buffers[k] = {grads[k], params[k]};
    opt::StepArgs args;
    args.grad_dtype = *gd;
    args.grad_scale = grad_scale;
    args.check_finite = check_finite != 0;
    args.pieces = buffers;
    if (npieces == 0 && o->opt->size() > 0) return Invalid("no piece buffers");
    // NULL is torch's stream 0, the legacy default stream, as in ckpt_optimizer_step.
    args.stream = stream == nullptr ? opt::CudaStreamView::Legacy()
                                    : *opt::CudaStreamView::Of(static_cast<CUstream_st*>(stream));
    absl::StatusOr<opt::StepReport> r = o->opt->Step(args);
    if (!r.ok()) return Fail(r.status());
    if (skipped != nullptr) *skipped = r->skipped ? 1 : 0;
    return CKPT_OK;
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
  *out = {g.lr, g.beta1, g.beta2, g.eps, g.weight_decay, g.step};
  return CKPT_OK;
}

int ckpt_optimizer_set_group(ckpt_optimizer* o, size_t index, const ckpt_group* group) {
  if (o == nullptr || group == nullptr) return Invalid("optimizer or group is NULL");
  return Guard("ckpt_optimizer_set_group", [&]() -> int { return Done(o->opt->SetGroup(index, Group(*group))); });
}

int ckpt_optimizer_read_state(ckpt_optimizer* o, int which, float* out, uint64_t count) {
  return Guard("ckpt_optimizer_read_state", [&]() -> int {
    if (o == nullptr || (count > 0 && out == nullptr)) return Invalid("optimizer or out is NULL");
    if (count != o->opt->size()) {
      return Invalid(absl::StrCat("read_state: ", count, " elements asked, the optimizer has ", o->opt->size()));
    }
    using State = opt::StagedAdamW::StateTensor;
    State tensor;
    switch (which) {
      case CKPT_MASTER: tensor = State::kMaster; break;
      case CKPT_EXP_AVG: tensor = State::kExpAvg; break;
      case CKPT_EXP_AVG_SQ: tensor = State::kExpAvgSq; break;
      default: return Invalid(absl::StrCat("state tensor ", which));
    }
    return Done(o->opt->CopyStateAsF32(tensor, std::span<float>(out, count)));
  });
}

int ckpt_optimizer_set_state(ckpt_optimizer* o, const float* master, const float* exp_avg,
                             const float* exp_avg_sq, uint64_t count, const uint64_t* steps,
                             size_t nsteps) {
  return Guard("ckpt_optimizer_set_state", [&]() -> int {
    if (o == nullptr) return Invalid("optimizer is NULL");
    if (count > 0 && (exp_avg == nullptr || exp_avg_sq == nullptr)) {
      return Invalid("exp_avg or exp_avg_sq is NULL");
    }
    if (nsteps > 0 && steps == nullptr) return Invalid("steps is NULL");
    return Done(o->opt->SetState(
        master == nullptr ? std::span<const float>() : std::span<const float>(master, count),
        std::span<const float>(exp_avg, count), std::span<const float>(exp_avg_sq, count),
        std::span<const uint64_t>(steps, nsteps)));
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

int ckpt_checkpointer_create(ckpt_optimizer* o, void* weights, size_t weight_bytes,
                             ckpt_store* store, const ckpt_coordinator* coordinator,
                             uint64_t async_staging_bytes, ckpt_checkpointer** out) {
  return Guard("ckpt_checkpointer_create", [&]() -> int {
    if (o == nullptr || store == nullptr || out == nullptr) return Invalid("optimizer, store or out is NULL");
    *out = nullptr;
    if (weight_bytes > 0 && weights == nullptr) return Invalid("weights is NULL");
    const uint64_t want = o->opt->size() * ckpt::formats::DTypeSize(o->opt->model_dtype());
    if (weight_bytes != want) {
      return Invalid(absl::StrCat("weight buffer has ", weight_bytes,
                                  " bytes, the optimizer's elements need ", want));
    }
    const int made = OpenCheckpointer(o, store, coordinator, async_staging_bytes, out);
    if (made == CKPT_OK && want > 0) (*out)->weights = weights;
    return made;
  });
}

int ckpt_checkpointer_open(ckpt_optimizer* o, ckpt_store* store,
                           const ckpt_coordinator* coordinator, uint64_t async_staging_bytes,
                           ckpt_checkpointer** out) {
  return Guard("ckpt_checkpointer_open", [&]() -> int {
    if (o == nullptr || store == nullptr || out == nullptr) return Invalid("optimizer, store or out is NULL");
    *out = nullptr;
    return OpenCheckpointer(o, store, coordinator, async_staging_bytes, out);
  });
}

void ckpt_checkpointer_destroy(ckpt_checkpointer* c) { delete c; }

int ckpt_checkpointer_save(ckpt_checkpointer* c, uint64_t step, const char* const* keys,
                           const void* const* values, const size_t* lens, size_t n) {
  return Guard("ckpt_checkpointer_save", [&]() -> int {
    if (c == nullptr) return Invalid("checkpointer is NULL");
    absl::Status status;
    opt::Blobs blobs = MakeBlobs(keys, values, lens, n, &status);
    if (!status.ok()) return Fail(status);
    return Done(c->ckpt->Save(step, blobs));
  });
}

int ckpt_checkpointer_save_async(ckpt_checkpointer* c, uint64_t step, const char* const* keys,
                                 const void* const* values, const size_t* lens, size_t n,
                                 ckpt_pending_save** out) {
  return Guard("ckpt_checkpointer_save_async", [&]() -> int {
    if (c == nullptr || out == nullptr) return Invalid("checkpointer or out is NULL");
    *out = nullptr;
    absl::Status status;
    opt::Blobs blobs = MakeBlobs(keys, values, lens, n, &status);
    if (!status.ok()) return Fail(status);
    absl::StatusOr<std::unique_ptr<opt::PendingSave>> p = c->ckpt->SaveAsync(step, blobs);
    if (!p.ok()) return Fail(p.status());
    *out = new ckpt_pending_save{*std::move(p)};
    return CKPT_OK;
  });
}

int ckpt_pending_save_finalize(ckpt_pending_save* s) {
  if (s == nullptr) return Invalid("pending save is NULL");
  return Guard("ckpt_pending_save_finalize", [&]() -> int { return Done(s->save->Finalize()); });
}

int ckpt_pending_save_writer_done(const ckpt_pending_save* s, int* done) {
  if (s == nullptr || done == nullptr) return Invalid("pending save or done is NULL");
  *done = s->save->writer_done() ? 1 : 0;
  return CKPT_OK;
}

void ckpt_pending_save_destroy(ckpt_pending_save* s) { delete s; }

int ckpt_checkpointer_load(ckpt_checkpointer* c, int has_step, uint64_t step, ckpt_blobs** blobs,
                           uint64_t* loaded_step) {
  return Guard("ckpt_checkpointer_load", [&]() -> int {
    if (c == nullptr) return Invalid("checkpointer is NULL");
    if (blobs != nullptr) *blobs = nullptr;
    opt::Blobs got;
    absl::StatusOr<opt::LoadReport> r =
        c->ckpt->Load(has_step ? std::optional<uint64_t>(step) : std::nullopt, &got);
    if (!r.ok()) return Fail(r.status());
    if (absl::Status w = AfterLoad(c); !w.ok()) return Fail(w);
    if (loaded_step != nullptr) *loaded_step = r->step;
    if (blobs != nullptr) {
      auto b = std::make_unique<ckpt_blobs>();
      for (auto& [k, v] : got) b->items.emplace_back(k, std::move(v));
      *blobs = b.release();
    }
    return CKPT_OK;
  });
}

int ckpt_checkpointer_load_newest_intact(ckpt_checkpointer* c, ckpt_blobs** blobs,
                                         uint64_t* loaded_step, uint64_t* skipped) {
  return Guard("ckpt_checkpointer_load_newest_intact", [&]() -> int {
    if (c == nullptr) return Invalid("checkpointer is NULL");
    if (blobs != nullptr) *blobs = nullptr;
    opt::Blobs got;
    absl::StatusOr<opt::LoadReport> r = c->ckpt->LoadNewestIntact(&got);
    if (!r.ok()) return Fail(r.status());
    if (absl::Status w = AfterLoad(c); !w.ok()) return Fail(w);
    if (loaded_step != nullptr) *loaded_step = r->step;
    if (skipped != nullptr) *skipped = r->skipped.size();
    if (blobs != nullptr) {
      auto b = std::make_unique<ckpt_blobs>();
      for (auto& [k, v] : got) b->items.emplace_back(k, std::move(v));
      *blobs = b.release();
    }
    return CKPT_OK;
  });
}

int ckpt_checkpointer_load_model(ckpt_checkpointer* c, const char* source,
                                 const char* const* patterns, const char* const* replacements,
                                 size_t n, int ignore_unexpected) {
  return Guard("ckpt_checkpointer_load_model", [&]() -> int {
    if (c == nullptr || source == nullptr) return Invalid("checkpointer or source is NULL");
    if (n > 0 && (patterns == nullptr || replacements == nullptr)) return Invalid("rename rules are NULL");
    opt::ModelLoadOptions o;
    for (size_t i = 0; i < n; ++i) {
      if (patterns[i] == nullptr || replacements[i] == nullptr) return Invalid(absl::StrCat("rename rule ", i, " is NULL"));
      o.rename.push_back({patterns[i], replacements[i]});
    }
    o.ignore_unexpected = ignore_unexpected != 0;
    absl::Status loaded = c->ckpt->LoadModel(source, o).status();
    if (loaded.ok()) loaded = AfterLoad(c);
    return Done(loaded);
  });
}

int ckpt_blobs_count(const ckpt_blobs* b, size_t* count) {
  if (b == nullptr || count == nullptr) return Invalid("blobs or count is NULL");
  *count = b->items.size();
  return CKPT_OK;
}

int ckpt_blobs_get(const ckpt_blobs* b, size_t i, const char** key, const void** value, size_t* len) {
  if (b == nullptr || key == nullptr || value == nullptr || len == nullptr) return Invalid("NULL argument");
  if (i >= b->items.size()) return Invalid(absl::StrCat("blob ", i, " of ", b->items.size()));
  *key = b->items[i].first.c_str();
  *value = b->items[i].second.data();
  *len = b->items[i].second.size();
  return CKPT_OK;
}

void ckpt_blobs_free(ckpt_blobs* b) { delete b; }

}  // extern "C"
