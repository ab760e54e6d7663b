// The io_uring WritableFile of UringEnv (libckpt/uring/uring_writable_file.cc).
#ifndef CKPT_LIBCKPT_URING_URING_WRITABLE_FILE_H_
#define CKPT_LIBCKPT_URING_URING_WRITABLE_FILE_H_

#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "ckpt/env.h"
#include "libckpt/posix/scoped_fd.h"
#include "libckpt/uring/uring_ring.h"

namespace ckpt::internal {

// A file written through its own ring, with write buffers of `buffer_bytes` (4 KiB multiples
// under O_DIRECT). `fd` is the file just created; `direct` whether it has O_DIRECT. Errors of
// making the ring as UringRing::Create.
absl::StatusOr<std::unique_ptr<WritableFile>> NewUringWritableFile(std::string path, ScopedFd fd,
                                                                   bool direct,
                                                                   size_t buffer_bytes);

}  // namespace ckpt::internal

#endif  // CKPT_LIBCKPT_URING_URING_WRITABLE_FILE_H_
