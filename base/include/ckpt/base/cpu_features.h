// What the CPU this process runs on can do, probed once per call site. The one place that asks
// CPUID, so the HF reader's conversions and the AdamW kernels agree on what F16C means.
#ifndef CKPT_BASE_CPU_FEATURES_H_
#define CKPT_BASE_CPU_FEATURES_H_

#include <cpuid.h>

namespace ckpt {

// F16C from CPUID leaf 1 (ECX bit 29); not every compiler's __builtin_cpu_supports knows it
// (clang 14 rejects "f16c").
inline bool CpuHasF16c() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & (1u << 29)) != 0;
}

// AVX2 with F16C: what every AVX2 code path of ours needs (16-bit float conversions).
inline bool CpuHasAvx2F16c() { return __builtin_cpu_supports("avx2") && CpuHasF16c(); }

// AVX-512 F, BW and VL: what the AVX-512 kernels use.
inline bool CpuHasAvx512() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl");
}

}  // namespace ckpt

#endif  // CKPT_BASE_CPU_FEATURES_H_
