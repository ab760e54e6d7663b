// ckpt-tool bench muon (ckpt/bench/muon_bench.h).
#include "ckpt/bench/muon_bench.h"

#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <span>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "ckpt/base/status_macros.h"
#include "ckpt/formats/float_convert.h"
#include "ckpt/bench/adamw_bench.h"
#include "optimizer/bench/cpu_bounds.h"

namespace ckpt::bench {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// The products of one orthogonalisation of a rows x cols matrix, timed alone: X X^T, then
// b G + c G G, then a X + H X, ns_steps times, on m x n with m <= n (as optimizer/muon.cc).
double TimeProducts(uint64_t rows, uint64_t cols, uint32_t ns_steps) {
  const auto m = static_cast<int>(std::min(rows, cols)), n = static_cast<int>(std::max(rows, cols));
  std::vector<float> x(static_cast<size_t>(m) * n, 0.01f), y(x.size()),
      g(static_cast<size_t>(m) * m), h(g.size());
  const Clock::time_point start = Clock::now();
  for (uint32_t s = 0; s < ns_steps; ++s) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, m, n, 1.0f, x.data(), n, x.data(), n,
                0.0f, g.data(), m);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, m, m, 2.0f, g.data(), m, g.data(),
                m, -4.7f, h.data(), m);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, n, m, 1.0f, h.data(), m, x.data(),
                n, 3.4f, y.data(), n);
  }
  return Seconds(start);
}

// The bench's one group: Muon at lr 0.02 and eps 1e-7.
optimizer::ParamGroup MuonGroup() {
  optimizer::ParamGroup g;
  g.algorithm = optimizer::Algorithm::kMuon;
  g.lr = 0.02;
  g.eps = 1e-7;
  return g;
}

// `o.matrices` BF16 matrices of o.rows x o.cols in group `g`, each one piece on this rank.
optimizer::StagedAdamWOptions MuonOptions(const MuonBenchOptions& o,
                                          const optimizer::ParamGroup& g) {
  const uint64_t per = o.rows * o.cols;
  optimizer::StagedAdamWOptions opts;
  opts.groups = {g};
  opts.threads = o.threads;
  opts.engine = o.engine;
  for (int i = 0; i < o.matrices; ++i) {
    opts.params.push_back({absl::StrCat("layers.", i, ".weight"), {o.rows, o.cols},
                           formats::DType::kBF16, 0});
    opts.pieces.push_back({static_cast<uint32_t>(i), 0, per});
  }
  return opts;
}

}  // namespace

absl::StatusOr<MuonFigures> RunMuonBench(const MuonBenchOptions& o) {
  if (o.rows == 0 || o.cols == 0 || o.matrices < 1 || o.steps < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "bench muon needs matrices of at least 1 x 1, at least one matrix and one step, not ",
        o.matrices, " of ", o.rows, " x ", o.cols, " and ", o.steps, " steps"));
  }
  const uint64_t per = o.rows * o.cols, n = per * static_cast<uint64_t>(o.matrices);
  const optimizer::ParamGroup g = MuonGroup();
  const optimizer::StagedAdamWOptions opts = MuonOptions(o, g);
  const bool cuda = o.engine == optimizer::EngineKind::kCuda;
  std::vector<uint16_t> weights(n, formats::FloatToBf16(0.02f));
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<optimizer::StagedAdamW> opt,
                        optimizer::StagedAdamW::Create(opts, std::as_bytes(std::span(weights))));
  std::vector<float> grads(cuda ? 0 : n);
  for (uint64_t i = 0; i < grads.size(); ++i) grads[i] = static_cast<float>(i % 2001) * 1e-3f - 1.0f;
  optimizer::StepArgs args{grads.data(), formats::DType::kF32, 1.0f, weights.data()};
  std::unique_ptr<optimizer::DeviceStepBuffers> device;  // The CUDA engine's caller side.
  if (cuda) {
    CKPT_ASSIGN_OR_RETURN(device, optimizer::NewDeviceStepBuffers(n, 0.01f));
    args = device->args();
  }
  MuonFigures f;
  f.engine = opt->engine_name();
  if (!cuda) f.blas_core = openblas_get_corename();
  f.step_seconds = 1e30;
  for (int i = 0; i <= o.steps; ++i) {  // Step 0 warms up.
    const Clock::time_point start = Clock::now();
    CKPT_ASSIGN_OR_RETURN(optimizer::StepReport r, opt->Step(args));
    if (cuda) {  // The weights written and the state back in the slabs.
      CKPT_RETURN_IF_ERROR(device->WaitFor(r.done));
      CKPT_RETURN_IF_ERROR(opt->Synchronize());
    }
    if (i > 0) f.step_seconds = std::min(f.step_seconds, Seconds(start));
  }
  opt.reset();
  const double m = static_cast<double>(std::min(o.rows, o.cols));
  const double k = static_cast<double>(std::max(o.rows, o.cols));
  f.flops_per_matrix = g.muon.ns_steps * (2 * m * m * k + 2 * m * m * m + 2 * m * m * k);
  f.matrices_per_s = o.matrices / f.step_seconds;
  f.gflops = f.flops_per_matrix * o.matrices / f.step_seconds / 1e9;
  double best = 1e30;
  if (cuda) {
    CKPT_ASSIGN_OR_RETURN(GpuProducts products,
                          TimeGpuMuonProducts(o.rows, o.cols, g.muon.ns_steps, 3));
    best = products.seconds;
    f.blas_core = products.backend;
  } else {
    for (int pass = 0; pass < 3; ++pass)
      best = std::min(best, TimeProducts(o.rows, o.cols, g.muon.ns_steps));
  }
  f.gemm_seconds = best * o.matrices;
  f.gemm_gflops = f.flops_per_matrix / best / 1e9;
  if (cuda) {
    // The master and the momentum, 4 bytes each, cross PCIe each way.
    f.state_bytes = 8.0 * static_cast<double>(n);
    CKPT_ASSIGN_OR_RETURN(DuplexRates pcie, MeasurePcieDuplex(uint64_t{1} << 30));
    f.pcie_gbps = std::min(pcie.h2d_gbps, pcie.d2h_gbps);
    f.memory_seconds = f.state_bytes / (f.pcie_gbps * 1e9);
    f.bound_seconds = std::max(f.gemm_seconds, f.memory_seconds);
    f.ratio = f.bound_seconds / f.step_seconds;
    return f;
  }
  // Master and momentum read and written (16), the gradient read (4), the weights written (2).
  f.state_bytes = 22.0 * static_cast<double>(n);
  const int threads = o.threads > 0 ? o.threads
                                    : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  CKPT_ASSIGN_OR_RETURN(f.triad_gbps, optimizer::internal::MeasureTriadGBps(
                                          std::max<uint64_t>(n, 32u << 20), threads,
                                          optimizer::CpuIsa::kAuto, 3));
  f.memory_seconds = f.state_bytes / (f.triad_gbps * 1e9);
  f.bound_seconds = std::max(f.gemm_seconds, f.memory_seconds);
  f.ratio = f.bound_seconds / f.step_seconds;
  return f;
}

}  // namespace ckpt::bench
