// What StagedAdamW's files (optimizer/staged_adamw*.cc, optimizer/overlap.cc) check of the
// buffers and dtypes a caller passes. Not part of the API.
#ifndef CKPT_OPTIMIZER_BUFFER_CHECKS_H_
#define CKPT_OPTIMIZER_BUFFER_CHECKS_H_

#include <cstddef>
#include <cstdint>

#include "ckpt/formats/dtype.h"

namespace ckpt::optimizer::internal {

// The model and gradient dtypes a step reads and writes.
inline bool SupportedFloat(formats::DType d) {
  return d == formats::DType::kF32 || d == formats::DType::kBF16 || d == formats::DType::kF16;
}

inline bool Aligned(const void* p, size_t alignment) {
  return reinterpret_cast<uintptr_t>(p) % alignment == 0;
}

}  // namespace ckpt::optimizer::internal

#endif  // CKPT_OPTIMIZER_BUFFER_CHECKS_H_
