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

// The macro of 1 or 2 (CKPT_RETURN_IF_ERROR), 2 or 3 (CKPT_ASSIGN_OR_RETURN) arguments.
#define CKPT_STATUS_PICK_(_1, _2, _3, name, ...) name

#define CKPT_RETURN_IF_ERROR_IMPL_(tmp, expr) \
  do {                                        \
    ::absl::Status tmp = (expr);              \
    if (!tmp.ok()) return tmp;                \
  } while (0)

// With a context, as TensorStore's two-argument form: the error returned says where it passed
// (Annotate: "<context>: <message>", the code kept). `context` is evaluated only on an error.
#define CKPT_RETURN_IF_ERROR_ANNOTATED_IMPL_(tmp, expr, context) \
  do {                                                            \
    ::absl::Status tmp = (expr);                                  \
    if (!tmp.ok()) return ::ckpt::Annotate(tmp, (context));       \
  } while (0)

#define CKPT_RETURN_IF_ERROR_1_(expr) \
  CKPT_RETURN_IF_ERROR_IMPL_(CKPT_STATUS_CONCAT_(ckpt_status_, __COUNTER__), expr)
#define CKPT_RETURN_IF_ERROR_2_(expr, context)                                            \
  CKPT_RETURN_IF_ERROR_ANNOTATED_IMPL_(CKPT_STATUS_CONCAT_(ckpt_status_, __COUNTER__), expr, \
                                       context)

// CKPT_RETURN_IF_ERROR(expr) or CKPT_RETURN_IF_ERROR(expr, context).
#define CKPT_RETURN_IF_ERROR(...)                                                         \
  CKPT_STATUS_PICK_(__VA_ARGS__, unused, CKPT_RETURN_IF_ERROR_2_, CKPT_RETURN_IF_ERROR_1_) \
  (__VA_ARGS__)

#define CKPT_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                \
  if (!tmp.ok()) return tmp.status();               \
  lhs = std::move(tmp).value()

#define CKPT_ASSIGN_OR_RETURN_ANNOTATED_IMPL_(tmp, lhs, expr, context)  \
  auto tmp = (expr);                                                    \
  if (!tmp.ok()) return ::ckpt::Annotate(tmp.status(), (context));      \
  lhs = std::move(tmp).value()

#define CKPT_ASSIGN_OR_RETURN_2_(lhs, expr) \
  CKPT_ASSIGN_OR_RETURN_IMPL_(CKPT_STATUS_CONCAT_(ckpt_statusor_, __LINE__), lhs, expr)
#define CKPT_ASSIGN_OR_RETURN_3_(lhs, expr, context)                                           \
  CKPT_ASSIGN_OR_RETURN_ANNOTATED_IMPL_(CKPT_STATUS_CONCAT_(ckpt_statusor_, __LINE__), lhs, expr, \
                                        context)

// CKPT_ASSIGN_OR_RETURN(lhs, expr) or CKPT_ASSIGN_OR_RETURN(lhs, expr, context).
#define CKPT_ASSIGN_OR_RETURN(...)                                                          \
  CKPT_STATUS_PICK_(__VA_ARGS__, CKPT_ASSIGN_OR_RETURN_3_, CKPT_ASSIGN_OR_RETURN_2_, unused) \
  (__VA_ARGS__)

#endif  // CKPT_BASE_STATUS_MACROS_H_
