// ckpt-tool bench muon: Muon steps on the CPU or CUDA engine against the Newton-Schulz products
// alone and the state's bytes at host memory bandwidth (CPU) or PCIe (CUDA), measured in the
// same run. The measuring is
// ckpt::bench::RunMuonBench (optimizer/bench); this file prints.
#include <iostream>
#include <memory>

#include "absl/strings/str_format.h"
#include "ckpt/bench/muon_bench.h"
#include "cli/command.h"
#include "cli/commands.h"
#include "cli/common.h"

namespace ckpt::cli {

int RunBenchMuon(const BenchMuonArgs& args) {
  bench::MuonBenchOptions o;
  o.rows = args.rows;
  o.cols = args.cols;
  o.matrices = args.matrices;
  o.threads = args.threads;
  o.steps = args.steps;
  o.engine = args.engine == "cuda" ? optimizer::EngineKind::kCuda : optimizer::EngineKind::kCpu;
  absl::StatusOr<bench::MuonFigures> f = bench::RunMuonBench(o);
  if (!f.ok()) return ReportError("bench muon", f.status());
  if (args.json) {
    PrintJson({{"rows", args.rows},
               {"cols", args.cols},
               {"matrices", args.matrices},
               {"engine", f->engine},
               {"blas_core", f->blas_core},
               {"step_seconds", f->step_seconds},
               {"matrices_per_s", f->matrices_per_s},
               {"flops_per_matrix", f->flops_per_matrix},
               {"gflops", f->gflops},
               {"gemm_seconds", f->gemm_seconds},
               {"gemm_gflops", f->gemm_gflops},
               {"state_bytes", f->state_bytes},
               {"triad_gbps", f->triad_gbps},
               {"pcie_gbps", f->pcie_gbps},
               {"memory_seconds", f->memory_seconds},
               {"bound_seconds", f->bound_seconds},
               {"ratio", f->ratio}});
    return kExitOk;
  }
  const bool cuda = args.engine == "cuda";
  std::cout << absl::StrFormat(
      "Muon step of %d matrices of %d x %d, %s\n"
      "step       %9.2f ms   %8.1f matrices/s   %8.1f GFLOP/s   %6.2f GB/s of state\n",
      args.matrices, args.rows, args.cols, f->engine, f->step_seconds * 1e3, f->matrices_per_s,
      f->gflops, f->state_bytes / f->step_seconds / 1e9);
  if (cuda) {
    std::cout << absl::StrFormat(
        "products   %9.2f ms   the Newton-Schulz products alone on the GPU (%s, %.1f GFLOP/s)\n"
        "pcie       %9.2f ms   8 B/element each way at %.1f GB/s (both directions busy)\n",
        f->gemm_seconds * 1e3, f->blas_core, f->gemm_gflops, f->memory_seconds * 1e3,
        f->pcie_gbps);
  } else {
    std::cout << absl::StrFormat(
        "products   %9.2f ms   the Newton-Schulz SGEMMs alone (OpenBLAS %s kernels, %.1f GFLOP/s)\n"
        "memory     %9.2f ms   22 B/element at the triad's %.1f GB/s\n",
        f->gemm_seconds * 1e3, f->blas_core, f->gemm_gflops, f->memory_seconds * 1e3,
        f->triad_gbps);
  }
  std::cout << absl::StrFormat("bound      %9.2f ms   ratio bound / step %.2f\n",
                               f->bound_seconds * 1e3, f->ratio);
  return kExitOk;
}

Command AddBenchMuonCommand(CLI::App& bench) {
  auto args = std::make_shared<BenchMuonArgs>();
  CLI::App* cmd = bench.add_subcommand(
      "muon", "Muon steps against the Newton-Schulz products alone and host memory bandwidth");
  cmd->add_option("--rows", args->rows, "Rows of each matrix (default 1024)")
      ->check(WholeNumber(1, 1 << 20));
  cmd->add_option("--cols", args->cols, "Columns of each matrix (default 4096)")
      ->check(WholeNumber(1, 1 << 20));
  cmd->add_option("--matrices", args->matrices, "Matrices in the group (default 8)")
      ->check(WholeNumber(1, 100000));
  cmd->add_option("--threads", args->threads, "CPU engine threads (0: every core)")
      ->check(WholeNumber(0, 1024));
  cmd->add_option("--steps", args->steps, "Timed steps (best is reported)")
      ->check(WholeNumber(1, 1000));
  cmd->add_option("--engine", args->engine, "cpu or cuda (default cpu)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  cmd->add_flag("--json", args->json, "Print one JSON object");
  return WhenParsed(cmd, [args] { return RunBenchMuon(*args); });
}

}  // namespace ckpt::cli
