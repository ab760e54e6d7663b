// ckpt's dtypes are a subset of safetensors' (formats/safetensors.cc holds the one table of
// names and widths); this file only maps between the two.
#include "ckpt/formats/dtype.h"

#include <array>

#include "absl/strings/str_cat.h"
#include "ckpt/formats/safetensors.h"

namespace ckpt::formats {
namespace {

// Indexed by DType.
constexpr std::array<StDType, 10> kAsStDType = {
    StDType::kF32, StDType::kBF16, StDType::kF16, StDType::kF64, StDType::kI64,
    StDType::kI32, StDType::kI16,  StDType::kI8,  StDType::kU8,  StDType::kBool,
};

}  // namespace

StDType ToStDType(DType dtype) { return kAsStDType[static_cast<size_t>(dtype)]; }

absl::StatusOr<DType> FromStDType(StDType dtype) {
  for (size_t i = 0; i < kAsStDType.size(); ++i) {
    if (kAsStDType[i] == dtype) return static_cast<DType>(i);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("safetensors dtype ", StDTypeName(dtype), " has no ckpt dtype"));
}

absl::string_view DTypeName(DType dtype) { return StDTypeName(ToStDType(dtype)); }

size_t DTypeSize(DType dtype) { return StDTypeBits(ToStDType(dtype)) / 8; }

absl::StatusOr<DType> ParseDType(absl::string_view name) {
  absl::StatusOr<StDType> st = ParseStDType(name);
  absl::StatusOr<DType> d = st.ok() ? FromStDType(*st) : st.status();
  if (!d.ok()) return absl::InvalidArgumentError(absl::StrCat("unknown dtype \"", name, "\""));
  return d;
}

}  // namespace ckpt::formats
