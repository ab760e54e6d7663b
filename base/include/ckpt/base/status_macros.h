// Status propagation helpers used by every module (STYLE.md §2).
#ifndef CKPT_BASE_STATUS_MACROS_H_
#define CKPT_BASE_STATUS_MACROS_H_

#include <utility>
#include "absl/strings/string_view.h"

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace ckpt {

// Returns `status` with `context` prepended to its message; the code is kept. OK stays OK.
inline absl::Status Annotate(const absl::Status& status, absl::string_view context) {
  if (status.ok()) return status;
  return absl::Status(status.code(), absl::StrCat(context, ": ", status.message()));
}

}  // namespace ckpt

#define CKPT_STATUS_CONCAT_INNER_(a, b) a##b
#define CKPT_STATUS_CONCAT_(a, b) CKPT_STATUS_CONCAT_INNER_(a, b)

#define CKPT_RETURN_IF_ERROR_IMPL_(tmp, expr) \
  do {                                        \
    ::absl::Status tmp = (expr);              \
    if (!tmp.ok()) return tmp;                \
  } while (0)

#define CKPT_RETURN_IF_ERROR(expr) \
  CKPT_RETURN_IF_ERROR_IMPL_(CKPT_STATUS_CONCAT_(ckpt_status_, __COUNTER__), expr)

#define CKPT_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                \
  if (!tmp.ok()) return tmp.status();               \
  lhs = std::move(tmp).value()

#define CKPT_ASSIGN_OR_RETURN(lhs, expr) \
  CKPT_ASSIGN_OR_RETURN_IMPL_(CKPT_STATUS_CONCAT_(ckpt_statusor_, __LINE__), lhs, expr)

#endif  // CKPT_BASE_STATUS_MACROS_H_
