// The C ABI's store functions (ckpt/ckpt.h, "Store"): opening a root alone or collectively on
// the ranks of a job, closing it, reading LATEST and its steps, retention and adopt.
#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "capi/capi_internal.h"
#include "ckpt/checkpoint_store.h"
#include "ckpt/ckpt.h"

namespace {

using ckpt::capi::CallbackCoordinator;
using ckpt::capi::Fail;
using ckpt::capi::Guard;
using ckpt::capi::Invalid;

// ckpt_store_options as StoreOptions; kInvalidArgument for a struct too old or a bad value.
absl::StatusOr<ckpt::StoreOptions> ToStoreOptions(const ckpt_store_options& options) {
  if (options.struct_size < sizeof(ckpt_store_options)) {
    return absl::InvalidArgumentError(absl::StrCat("ckpt_store_options.struct_size is ",
                                                   options.struct_size, ", expected at least ",
                                                   sizeof(ckpt_store_options)));
  }
  if (options.write_threads < 0 || options.write_threads > 64) {
    return absl::InvalidArgumentError(absl::StrCat("write_threads ", options.write_threads,
                                                   " is outside 0 (the default) to 64"));
  }
  ckpt::StoreOptions o;
  o.primary = options.primary != 0;
  o.read_only = options.read_only != 0;
  o.retention = {options.keep_last, options.keep_every};
  if (options.write_threads > 0) o.write_threads = options.write_threads;
  return o;
}

}  // namespace

extern "C" {

int ckpt_store_open(const char* root, int primary, int read_only, ckpt_store** out) {
  ckpt_store_options o{};
  o.struct_size = sizeof(o);
  o.primary = primary;
  o.read_only = read_only;
  return ckpt_store_open_with(root, &o, out);
}

int ckpt_store_open_with(const char* root, const ckpt_store_options* options, ckpt_store** out) {
  return Guard("ckpt_store_open_with", [&]() -> int {
    if (root == nullptr || options == nullptr || out == nullptr) {
      return Invalid("root, options or out is NULL");
    }
    *out = nullptr;
    absl::StatusOr<ckpt::StoreOptions> o = ToStoreOptions(*options);
    if (!o.ok()) return Fail(o.status());
    absl::StatusOr<std::unique_ptr<ckpt::CheckpointStore>> s = ckpt::CheckpointStore::Open(root, *o);
    if (!s.ok()) return Fail(s.status());
    *out = new ckpt_store{*std::move(s)};
    return CKPT_OK;
  });
}

int ckpt_store_open_on_ranks(const char* root, const ckpt_store_options* options,
                             const ckpt_coordinator* coordinator, ckpt_store** out) {
  return Guard("ckpt_store_open_on_ranks", [&]() -> int {
    if (root == nullptr || options == nullptr || coordinator == nullptr || out == nullptr) {
      return Invalid("root, options, coordinator or out is NULL");
    }
    *out = nullptr;
    absl::StatusOr<ckpt::StoreOptions> o = ToStoreOptions(*options);
    if (!o.ok()) return Fail(o.status());
    const absl::Status usable = ckpt::capi::CheckCoordinator(*coordinator);
    if (!usable.ok()) return Fail(usable);
    CallbackCoordinator ranks(*coordinator);
    absl::StatusOr<std::unique_ptr<ckpt::CheckpointStore>> s =
        ckpt::OpenStoreOnRanks(root, *o, &ranks);
    if (!s.ok()) return Fail(s.status());
    *out = new ckpt_store{*std::move(s)};
    return CKPT_OK;
  });
}

void ckpt_store_close(ckpt_store* store) { delete store; }

int ckpt_store_latest(const ckpt_store* store, int* has_latest, uint64_t* step) {
  if (store == nullptr || has_latest == nullptr || step == nullptr) return Invalid("NULL argument");
  const std::optional<uint64_t> latest = store->store->latest_step();
  *has_latest = latest.has_value() ? 1 : 0;
  *step = latest.value_or(0);
  return CKPT_OK;
}

int ckpt_store_keep_only(ckpt_store* store, const uint64_t* keep, size_t nkeep, size_t* retired) {
  return Guard("ckpt_store_keep_only", [&]() -> int {
    if (store == nullptr || (nkeep > 0 && keep == nullptr)) return Invalid("NULL argument");
    ckpt::RetentionPolicy policy;
    policy.keep_only = std::vector<uint64_t>(keep, keep + nkeep);
    absl::StatusOr<ckpt::RetentionReport> gone = store->store->ApplyRetention(policy);
    if (!gone.ok()) return Fail(gone.status());
    // Deleted or moved into quarantine/: either way the step left the store.
    if (retired != nullptr) {
      *retired = ckpt::StepsOf(*gone, ckpt::RecoveryAction::Kind::kRemove).size() +
                 ckpt::StepsOf(*gone, ckpt::RecoveryAction::Kind::kQuarantine).size();
    }
    return CKPT_OK;
  });
}

int ckpt_store_steps(const ckpt_store* store, uint64_t* steps, size_t capacity, size_t* count) {
  return Guard("ckpt_store_steps", [&]() -> int {
    if (store == nullptr || count == nullptr || (capacity > 0 && steps == nullptr)) {
      return Invalid("NULL argument");
    }
    absl::StatusOr<std::vector<uint64_t>> listed = store->store->ListSteps();
    if (!listed.ok()) return Fail(listed.status());
    *count = listed->size();
    std::copy_n(listed->begin(), std::min(capacity, listed->size()), steps);
    return CKPT_OK;
  });
}

int ckpt_store_adopt(ckpt_store* store, uint64_t step) {
  return Guard("ckpt_store_adopt", [&]() -> int {
    if (store == nullptr) return Invalid("NULL argument");
    absl::Status s = store->store->Adopt(step);
    return s.ok() ? CKPT_OK : Fail(s);
  });
}

}  // extern "C"
