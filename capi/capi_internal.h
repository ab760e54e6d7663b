// What the C ABI's translation units share (capi/ckpt_c.cc, capi/optimizer_c.cc,
// capi/optimizer_step_c.cc, capi/optimizer_state_c.cc, capi/rules_c.cc, capi/store_c.cc,
// capi/transaction_c.cc): the status-to-code conversion with its thread-local message, the guard
// that keeps C++ exceptions from crossing the boundary, the model dtype of a C dtype code, the
// Coordinator over a caller's callbacks, and the store and optimizer handles. Not installed.
#ifndef CKPT_CAPI_CAPI_INTERNAL_H_
#define CKPT_CAPI_CAPI_INTERNAL_H_

#include <cstdlib>
#include <exception>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "ckpt/checkpoint_store.h"
#include "ckpt/ckpt.h"
#include "ckpt/coordinator.h"
#include "ckpt/formats/dtype.h"
#include "ckpt/optimizer/staged_adamw.h"

struct ckpt_store {
  std::unique_ptr<ckpt::CheckpointStore> store;
};

struct ckpt_optimizer {
  std::unique_ptr<ckpt::optimizer::StagedAdamW> opt;
};

namespace ckpt::capi {

// The message of this thread's last failed call (ckpt_last_error).
inline thread_local std::string last_error;

inline int Fail(const absl::Status& status) {
  last_error = std::string(status.message());
  return status.ok() ? CKPT_UNKNOWN : static_cast<int>(status.code());
}
inline int Invalid(const std::string& message) { return Fail(absl::InvalidArgumentError(message)); }
inline int Done(const absl::Status& status) {
  if (status.ok()) return CKPT_OK;
  return Fail(status);
}

// The model (or gradient) dtype of a C dtype code (CKPT_F32, CKPT_BF16, CKPT_F16);
// kInvalidArgument for any other.
inline absl::StatusOr<formats::DType> ModelDType(int d) {
  switch (d) {
    case CKPT_F32:
      return formats::DType::kF32;
    case CKPT_BF16:
      return formats::DType::kBF16;
    case CKPT_F16:
      return formats::DType::kF16;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("dtype ", d, " is not CKPT_F32, CKPT_BF16 or CKPT_F16"));
  }
}

// Runs `body`, turning an escaping C++ exception into a code.
template <typename Body>
int Guard(const char* what, Body body) {
  try {
    return body();
  } catch (const std::bad_alloc&) {
    return Fail(absl::ResourceExhaustedError(absl::StrCat(what, ": out of memory")));
  } catch (const std::exception& e) {
    return Fail(absl::InternalError(absl::StrCat(what, ": ", e.what())));
  } catch (...) {
    return Fail(absl::InternalError(absl::StrCat(what, ": unknown C++ exception")));
  }
}

// A Coordinator over the caller's callbacks.
class CallbackCoordinator : public ckpt::Coordinator {
 public:
  explicit CallbackCoordinator(const ckpt_coordinator& c) : c_(c) {}
  int rank() const override { return c_.rank; }
  int size() const override { return c_.size; }
  absl::StatusOr<std::vector<std::string>> AllGather(absl::string_view mine) override {
    void* out = nullptr;
    std::vector<size_t> lens(static_cast<size_t>(c_.size), 0);
    const int rc = c_.all_gather(c_.user, mine.data(), mine.size(), &out, lens.data());
    std::unique_ptr<void, decltype(&std::free)> owned(out, &std::free);
    if (rc != 0) {
      return absl::UnavailableError(absl::StrCat("rank ", c_.rank, ": the coordinator's all_gather failed (", rc, ")"));
    }
    std::vector<std::string> parts;
    size_t at = 0;
    for (size_t r = 0; r < lens.size(); ++r) {
      if (lens[r] > 0 && out == nullptr) return absl::InternalError("all_gather returned no buffer");
      parts.emplace_back(static_cast<const char*>(out) + at, lens[r]);
      at += lens[r];
    }
    return parts;
  }
  absl::Status Barrier() override {
    if (c_.barrier == nullptr) return Coordinator::Barrier();
    const int rc = c_.barrier(c_.user);
    if (rc != 0) {
      return absl::UnavailableError(absl::StrCat("rank ", c_.rank, ": the coordinator's barrier failed (", rc, ")"));
    }
    return absl::OkStatus();
  }

 private:
  const ckpt_coordinator c_;
};

// OK for a coordinator table a Coordinator can run on; kInvalidArgument naming what is wrong.
inline absl::Status CheckCoordinator(const ckpt_coordinator& c) {
  if (c.all_gather == nullptr || c.size < 1 || c.rank < 0 || c.rank >= c.size) {
    return absl::InvalidArgumentError(absl::StrCat("coordinator: rank ", c.rank, " of ", c.size,
                                                   c.all_gather == nullptr ? ", no all_gather"
                                                                           : ""));
  }
  return absl::OkStatus();
}

}  // namespace ckpt::capi

#endif  // CKPT_CAPI_CAPI_INTERNAL_H_
