// A small model whose initial weights and gradients depend only on (parameter, flat index,
// step), so every data-parallel layout computes the same bits: the optimizer checkpoint tests
// and the MPI job resume at one DP size what another saved and compare element by element.
#ifndef CKPT_TESTS_SUPPORT_TOY_MODEL_H_
#define CKPT_TESTS_SUPPORT_TOY_MODEL_H_

#include <cstdint>
#include <vector>

#include "ckpt/optimizer/layout.h"

namespace ckpt::testing {

inline std::vector<optimizer::ParamSpec> ToyModel() {
  return {{"embed", {64, 33}, formats::DType::kBF16, 0},
          {"layer.weight", {3001}, formats::DType::kBF16, 0},
          {"layer.bias", {37}, formats::DType::kBF16, 1}};
}
inline std::vector<optimizer::ParamGroup> ToyGroups() {
  return {optimizer::ParamGroup{.lr = 3e-3, .weight_decay = 0.1},
          optimizer::ParamGroup{.lr = 1e-3, .weight_decay = 0}};
}
inline float ToyInitialValue(uint32_t param, uint64_t i) {
  return 0.5f - 0.001f * static_cast<float>((param * 7919 + i * 31) % 1000);
}
inline float ToyGradient(uint32_t param, uint64_t i, int step) {
  return 0.01f * static_cast<float>(static_cast<int>((param * 131 + i * 17 + step * 7) % 41) - 20);
}
// The learning-rate schedule of the toy run: every group at its lr times (step + 1) / 4.
inline optimizer::ParamGroup ToyGroupAt(size_t group, int step) {
  optimizer::ParamGroup g = ToyGroups()[group];
  g.lr *= (step + 1) / 4.0;
  return g;
}

}  // namespace ckpt::testing

#endif  // CKPT_TESTS_SUPPORT_TOY_MODEL_H_
