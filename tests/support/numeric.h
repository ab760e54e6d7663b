// Numeric comparisons shared by the optimizer tests (CPU engine against a double reference, CUDA
// engine against the CPU engine).
#ifndef CKPT_TESTS_SUPPORT_NUMERIC_H_
#define CKPT_TESTS_SUPPORT_NUMERIC_H_

#include <algorithm>
#include <cmath>
#include <vector>

namespace ckpt::testing {

// Normwise relative error: the largest elementwise error over the largest magnitude. Moments
// cross zero when gradients change sign, so an elementwise ratio there measures cancellation in
// the reference, not the optimizer; FP32 carries about 6e-8 of the vector's scale per operation.
inline double MaxRelError(const std::vector<float>& got, const std::vector<float>& want) {
  double worst = 0, scale = 0;
  for (size_t i = 0; i < got.size() && i < want.size(); ++i) {
    worst = std::max(worst, std::abs(static_cast<double>(got[i]) - want[i]));
    scale = std::max(scale, std::abs(static_cast<double>(want[i])));
  }
  if (got.size() != want.size()) return INFINITY;
  return scale == 0 ? worst : worst / scale;
}

}  // namespace ckpt::testing

#endif  // CKPT_TESTS_SUPPORT_NUMERIC_H_
