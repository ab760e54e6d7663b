// Element types of tensors stored by ckpt. Names are the safetensors spellings.
#ifndef CKPT_FORMATS_DTYPE_H_
#define CKPT_FORMATS_DTYPE_H_

#include <cstddef>
#include <cstdint>
#include "absl/strings/string_view.h"

#include "absl/status/statusor.h"

namespace ckpt::formats {

enum class DType : uint8_t { kF32, kBF16, kF16, kF64, kI64, kI32, kI16, kI8, kU8, kBool };

// "F32", "BF16", ...
absl::string_view DTypeName(DType dtype);
// kInvalidArgument for a name that is not one of ours.
absl::StatusOr<DType> ParseDType(absl::string_view name);
// Bytes per element.
size_t DTypeSize(DType dtype);

// The same element type in safetensors' terms (every DType is one), and back: kInvalidArgument
// for a safetensors dtype ckpt does not store (F8_*, F4, U16, ...).
enum class StDType : uint8_t;
StDType ToStDType(DType dtype);
absl::StatusOr<DType> FromStDType(StDType dtype);

}  // namespace ckpt::formats

#endif  // CKPT_FORMATS_DTYPE_H_
