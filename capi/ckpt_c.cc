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

namespace {

using ckpt::capi::CallbackCoordinator;
using ckpt::capi::Done;
using ckpt::capi::Fail;
using ckpt::capi::Guard;
using ckpt::capi::Invalid;
using ckpt::formats::DType;
namespace opt = ckpt::optimizer;

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


int ckpt_checkpointer_create(ckpt_optimizer* o, void* weights, size_t weight_bytes,
                             ckpt_store* store, const ckpt_coordinator* coordinator,
                             uint64_t async_staging_bytes, ckpt_checkpointer** out) {
  return Guard("ckpt_checkpointer_create", [&]() -> int {
    if (o == nullptr || store == nullptr || out == nullptr) return Invalid("optimizer, store or out is NULL");
    *out = nullptr;
    if (weight_bytes > 0 && weights == nullptr) return Invalid("weights is NULL");
    const uint64_t want = o->opt->weight_bytes();
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
                                 size_t n, int flags) {
  return Guard("ckpt_checkpointer_load_model", [&]() -> int {
    if ((flags & ~(CKPT_LOAD_MODEL_IGNORE_UNEXPECTED | CKPT_LOAD_MODEL_MASTERS)) != 0) {
      return Invalid(absl::StrCat("load_model: unknown flags ", flags));
    }
    if (c == nullptr || source == nullptr) return Invalid("checkpointer or source is NULL");
    if (n > 0 && (patterns == nullptr || replacements == nullptr)) return Invalid("rename rules are NULL");
    opt::ModelLoadOptions o;
    for (size_t i = 0; i < n; ++i) {
      if (patterns[i] == nullptr || replacements[i] == nullptr) return Invalid(absl::StrCat("rename rule ", i, " is NULL"));
      o.rename.push_back({patterns[i], replacements[i]});
    }
    o.ignore_unexpected = (flags & CKPT_LOAD_MODEL_IGNORE_UNEXPECTED) != 0;
    o.masters = (flags & CKPT_LOAD_MODEL_MASTERS) != 0;
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
