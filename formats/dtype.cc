#include "ckpt/formats/dtype.h"

#include <array>

#include "absl/strings/str_cat.h"

namespace ckpt::formats {
namespace {

struct DTypeEntry {
  DType dtype;
  absl::string_view name;
  size_t size;
};

constexpr std::array<DTypeEntry, 10> kDTypes = {{
    {DType::kF32, "F32", 4},
    {DType::kBF16, "BF16", 2},
    {DType::kF16, "F16", 2},
    {DType::kF64, "F64", 8},
    {DType::kI64, "I64", 8},
    {DType::kI32, "I32", 4},
    {DType::kI16, "I16", 2},
    {DType::kI8, "I8", 1},
    {DType::kU8, "U8", 1},
    {DType::kBool, "BOOL", 1},
}};

}  // namespace

absl::string_view DTypeName(DType dtype) { return kDTypes[static_cast<size_t>(dtype)].name; }

size_t DTypeSize(DType dtype) { return kDTypes[static_cast<size_t>(dtype)].size; }

absl::StatusOr<DType> ParseDType(absl::string_view name) {
  for (const DTypeEntry& e : kDTypes) {
    if (e.name == name) return e.dtype;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown dtype \"", name, "\""));
}

}  // namespace ckpt::formats
