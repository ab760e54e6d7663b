// RunReadPipeline: reads many byte ranges with O_DIRECT into pooled huge-page buffers on a few
// I/O threads and hands each filled buffer to worker threads, so the device always has requests
// in flight while the CPU checksums, decodes or converts what already arrived. Shared by the
// checkpoint reader (chunks) and the HF reader (tensor slices).
#ifndef CKPT_LIBCKPT_READ_PIPELINE_H_
#define CKPT_LIBCKPT_READ_PIPELINE_H_

#include <cstdint>
#include <functional>
#include <span>

#include "absl/status/status.h"
#include "ckpt/env.h"

namespace ckpt::internal {

struct PipelinedRead {
  const RandomAccessFile* file;
  uint64_t offset;  // Multiples of 4 KiB (or ending at the file's end) take the O_DIRECT path.
  uint64_t length;
};

// Reads every range and calls consume(index, bytes) once per range, from up to
// min(io_threads, cores) worker threads (the caller and threads started through `env`, as the
// I/O threads), in no particular order. I/O thread t reads a contiguous
// run of `reads` in order (a sequential stream per thread). At most io_threads + workers buffers
// are out at once; ranges longer than a pool buffer get a buffer of their own. Returns the
// first error of a read or of a consume(); after one, no further consume() starts.
absl::Status RunReadPipeline(
    Env* env, std::span<const PipelinedRead> reads, int io_threads,
    const std::function<absl::Status(size_t, std::span<const std::byte>)>& consume);

}  // namespace ckpt::internal

#endif  // CKPT_LIBCKPT_READ_PIPELINE_H_
