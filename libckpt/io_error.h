// The one helper that turns a system error into a Status (STYLE.md §2). Built on
// absl::ErrnoToStatus, which maps ENOSPC and EDQUOT to kResourceExhausted and ENOENT to
// kNotFound. liburing returns -errno: pass -ret, never read errno after a liburing call.
#ifndef CKPT_LIBCKPT_IO_ERROR_H_
#define CKPT_LIBCKPT_IO_ERROR_H_

#include "absl/strings/string_view.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace ckpt::internal {

// `what` names the operation and object, e.g. "write run/step-00000012/rank-00000.data".
inline absl::Status IoError(int errnum, absl::string_view what) {
  return absl::ErrnoToStatus(errnum, what);
}

}  // namespace ckpt::internal

#endif  // CKPT_LIBCKPT_IO_ERROR_H_
