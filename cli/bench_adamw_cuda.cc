// The CUDA half of `ckpt-tool bench adamw`.
#include <iostream>
#include <string>
#include <utility>

#include "absl/strings/str_format.h"
#include "ckpt/bench/adamw_bench.h"
#include "cli/commands.h"

namespace ckpt::cli {

absl::StatusOr<nlohmann::json> BenchAdamwCuda(const BenchAdamwArgs& args) {
  nlohmann::json out = nlohmann::json::object();
  for (auto [moments, name] : {std::pair{optimizer::MomentDType::kF32, "fp32_moments"},
                               std::pair{optimizer::MomentDType::kBF16, "bf16_moments"}}) {
    absl::StatusOr<bench::CudaStepBenchmark> b =
        bench::RunCudaStepBenchmark(args.params, args.steps, moments, uint64_t{64} << 20, 2);
    if (!b.ok()) return b.status();
    const double ratio = b->gparams_per_s / b->bound_gparams_per_s;
    out[name] = {{"engine", b->engine},
                 {"gparams_per_s", b->gparams_per_s},
                 {"h2d_gbps", b->h2d_gbps},
                 {"d2h_gbps", b->d2h_gbps},
                 {"bytes_per_param_each_way", b->bytes_per_param},
                 {"bound_gparams_per_s", b->bound_gparams_per_s},
                 {"ratio", ratio},
                 {"device_bytes", b->device_bytes}};
    if (!args.json) {
      std::cout << absl::StrFormat(
          "cuda %-16s %6.2f Gparam/s   bound %6.2f Gparam/s (duplex PCIe %.1f up / %.1f down GB/s, "
          "%.0f B/param each way)   ratio %.2f   device memory %.0f MiB (%s)\n",
          b->engine, b->gparams_per_s, b->bound_gparams_per_s, b->h2d_gbps, b->d2h_gbps,
          b->bytes_per_param, ratio, static_cast<double>(b->device_bytes) / (1 << 20), name);
    }
  }
  return out;
}

}  // namespace ckpt::cli
