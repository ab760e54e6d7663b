// What `ckpt-tool bench muon` measures: a StagedAdamW of one Muon group of `matrices` matrices of
// rows x cols (BF16 weights, FP32 gradients), stepped on the CPU or the CUDA engine, against the
// bounds of the same run: the Newton-Schulz products alone (as many as a step makes, of the same
// shapes: OpenBLAS SGEMMs on the same cores, or the CUDA engine's BF16 tensor-core products on
// the GPU) and the state's bytes at the rate that bounds them (host memory bandwidth from the
// STREAM triad on the CPU; PCIe with both directions busy for the CUDA engine, whose masters and
// momentum cross it each way). Not installed: for ckpt-tool only. Functions never print.
#ifndef CKPT_OPTIMIZER_BENCH_MUON_BENCH_H_
#define CKPT_OPTIMIZER_BENCH_MUON_BENCH_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "ckpt/optimizer/staged_adamw.h"

namespace ckpt::bench {

// A plain value.
struct MuonBenchOptions {
  uint64_t rows = 1024, cols = 4096;  // Each matrix; at least 1 x 1.
  int matrices = 8;                   // At least 1.
  int threads = 0;                    // CPU engine threads; 0: every core.
  int steps = 3;                      // Timed steps after one warm-up; the best is reported.
  optimizer::EngineKind engine = optimizer::EngineKind::kCpu;
};

struct MuonFigures {
  std::string engine;
  std::string blas_core;         // The kernels OpenBLAS chose (openblas_get_corename()), or
                                 // the CUDA engine's products.
  double step_seconds = 0;       // The best step.
  double matrices_per_s = 0;
  double flops_per_matrix = 0;   // The products of ns_steps iterations (2 m n k each).
  double gflops = 0;             // Of the step.
  double gemm_seconds = 0;       // The same products alone, for every matrix (best of 3).
  double gemm_gflops = 0;
  // CPU: read and written per step, 22 bytes per element. CUDA: what crosses PCIe each way, 8
  // bytes per element with FP32 momentum (the master and the momentum).
  double state_bytes = 0;
  double triad_gbps = 0;         // CPU engine.
  double pcie_gbps = 0;          // CUDA engine: the slower direction with both busy.
  double memory_seconds = 0;     // state_bytes at triad_gbps or pcie_gbps.
  double bound_seconds = 0;      // max(gemm_seconds, memory_seconds).
  double ratio = 0;              // bound_seconds / step_seconds (1: at the bound).
};

// kInvalidArgument for options out of range; kUnimplemented for the CUDA engine in a build
// without CUDA, kFailedPrecondition without a device; the optimizer's errors.
absl::StatusOr<MuonFigures> RunMuonBench(const MuonBenchOptions& options);

}  // namespace ckpt::bench

#endif  // CKPT_OPTIMIZER_BENCH_MUON_BENCH_H_
