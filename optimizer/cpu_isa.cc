// The CPU engine's choices that are not kernels: which instruction set runs (resolved once from
// the CPU's features) and how a step's elements are cut into tasks for the threads.
#include <algorithm>

#include "ckpt/base/cpu_features.h"
#include "optimizer/cpu_kernels.h"

namespace ckpt::optimizer::internal {

bool CpuSupports(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAuto:
    case CpuIsa::kScalar:
      return true;
    case CpuIsa::kAvx2:
      return CpuHasAvx2F16c();
    case CpuIsa::kAvx512:
      return CpuHasAvx512();
  }
  return false;
}

CpuIsa ResolveIsa(CpuIsa isa) {
  if (isa != CpuIsa::kAuto) return isa;
  if (CpuSupports(CpuIsa::kAvx512)) return CpuIsa::kAvx512;
  if (CpuSupports(CpuIsa::kAvx2)) return CpuIsa::kAvx2;
  return CpuIsa::kScalar;
}

const char* IsaName(CpuIsa isa) {
  switch (ResolveIsa(isa)) {
    case CpuIsa::kAvx512:
      return "avx512";
    case CpuIsa::kAvx2:
      return "avx2";
    default:
      return "scalar";
  }
}

uint64_t TaskElems(uint64_t total, int threads) {
  constexpr uint64_t kMin = 1 << 12, kMax = 1 << 18;
  const uint64_t per = total / (8 * static_cast<uint64_t>(std::max(threads, 1)));
  return std::clamp(per / 64 * 64, kMin, kMax);
}

}  // namespace ckpt::optimizer::internal
