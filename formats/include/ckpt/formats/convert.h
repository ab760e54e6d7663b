// The one routine that converts tensor elements between the float formats ckpt stores (F32,
// BF16, F16): widening is exact, narrowing rounds to nearest even, NaNs stay quiet NaNs with
// their payload's top bits (float_convert.h is the per-element definition it matches bit for
// bit). Every bulk conversion of the project goes through it: the optimizer's save, load,
// model-only load and export, the HF reader, diff. Pure: no IO, no threads, no allocation.
#ifndef CKPT_FORMATS_CONVERT_H_
#define CKPT_FORMATS_CONVERT_H_

#include <cstddef>
#include <span>

#include "ckpt/formats/dtype.h"

namespace ckpt::formats {

// True for F32, BF16 and F16, the element types Convert serves.
bool IsFloatDType(DType dtype);

// Converts in.size() / DTypeSize(from) elements of `from` at `in` into `to` at `out`. The
// same dtype is a copy. Neither span needs any alignment; they must not overlap.
// REQUIRES: IsFloatDType(from) and IsFloatDType(to); in and out hold the same element count.
// Writing a large F32 output (a widening of at least kStreamingStoreBytes) uses streaming
// stores where the CPU has AVX2: the output of a bulk widening is larger than the caches and
// not read back at once, so ordinary stores would first read every destination line.
void Convert(DType from, std::span<const std::byte> in, DType to, std::span<std::byte> out);

inline constexpr size_t kStreamingStoreBytes = size_t{1} << 20;

}  // namespace ckpt::formats

#endif  // CKPT_FORMATS_CONVERT_H_
