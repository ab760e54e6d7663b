// Element operations as torch's CPU kernels compute them, shared by the rules whose results
// must match torch's optimizers (rules/muon, rules/adafactor).
#ifndef CKPT_OPTIMIZER_RULES_TORCH_MATH_H_
#define CKPT_OPTIMIZER_RULES_TORCH_MATH_H_

#include <cmath>

namespace ckpt::optimizer::internal {

// torch's lerp: self + w * (end - self) for |w| < 0.5, else end - (end - self) * (1 - w); its
// vectorized CPU kernel fuses each into one FMA.
inline float TorchLerp(float self, float end, float w) {
  return std::fabs(w) < 0.5f ? std::fma(w, end - self, self)
                             : std::fma(w - 1.0f, end - self, end);
}

}  // namespace ckpt::optimizer::internal

#endif  // CKPT_OPTIMIZER_RULES_TORCH_MATH_H_
