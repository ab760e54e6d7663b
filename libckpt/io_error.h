// The one helper that turns a system error into a Status (STYLE.md §2). Built on
// absl::ErrnoToStatus, which maps ENOSPC and EDQUOT to kResourceExhausted and ENOENT to
// kNotFound. liburing returns -errno: pass -ret, never read errno after a liburing call.
#ifndef CKPT_LIBCKPT_IO_ERROR_H_
#define CKPT_LIBCKPT_IO_ERROR_H_

#include <cstddef>
#include <cstdint>

#include "absl/strings/string_view.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace ckpt::internal {

// `what` names the operation and object, e.g. "write run/step-00000012/rank-00000.data".
inline absl::Status IoError(int errnum, absl::string_view what) {
  return absl::ErrnoToStatus(errnum, what);
}

// What every WritableFile::WriteAt checks before it writes: its alignment, and that the file
// is not also being appended to.
inline absl::Status CheckWriteAt(absl::string_view path, uint64_t offset, const void* data,
                                 size_t size, bool appended) {
  constexpr uint64_t kAlign = 4096;  // WriteAt's contract (ckpt/env.h: kWriteAtAlignment).
  if (appended) {
    return absl::FailedPreconditionError(
        absl::StrCat(path, ": WriteAt on a file written by Append"));
  }
  if (offset % kAlign != 0 || size % kAlign != 0 ||
      reinterpret_cast<uintptr_t>(data) % kAlign != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "write ", path, " at offset ", offset, ": ", size,
        " bytes; WriteAt needs offset, length and address aligned to ", kAlign));
  }
  return absl::OkStatus();
}

}  // namespace ckpt::internal

#endif  // CKPT_LIBCKPT_IO_ERROR_H_
