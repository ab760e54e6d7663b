// ckpt-tool bench startup (ckpt/bench/startup_bench.h).
#include "ckpt/bench/startup_bench.h"

#include <sys/mman.h>

#include <chrono>
#include <algorithm>
#include <cstdlib>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "ckpt/base/status_macros.h"
#include "ckpt/formats/float_convert.h"
#include "optimizer/host_buffer.h"

namespace ckpt::bench {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// The host's rates on `bytes` of fresh memory: every core first-touching it, then (pin) the
// driver pinning the touched pages. Freed before returning.
absl::Status MeasureBound(uint64_t bytes, bool pin, StartupFigures* f) {
  constexpr size_t kHugePage = size_t{2} << 20;
  const size_t total = (bytes + kHugePage - 1) / kHugePage * kHugePage;
  void* p = std::aligned_alloc(kHugePage, total);
  if (p == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat("allocate ", total, " bytes for the bound"));
  }
  ::madvise(p, total, MADV_HUGEPAGE);
  Clock::time_point start = Clock::now();
  optimizer::internal::ZeroInParallel(p, total);
  f->touch_gbps = static_cast<double>(total) / Seconds(start) / 1e9;
  absl::Status s;
  if (pin) {
    start = Clock::now();
    s = optimizer::internal::RegisterPinned(p, total);
    if (s.ok()) {
      f->pin_gbps = static_cast<double>(total) / Seconds(start) / 1e9;
      optimizer::internal::UnregisterPinned(p);
    }
  }
  std::free(p);
  return s;
}

}  // namespace

absl::StatusOr<StartupFigures> RunStartupBench(const StartupBenchOptions& options) {
  if (options.params == 0) return absl::InvalidArgumentError("bench startup: no parameters");
  const uint64_t n = options.params;
  StartupFigures f;
  f.slab_bytes = n * 12;
  const bool cuda = options.engine == optimizer::EngineKind::kCuda;
  CKPT_RETURN_IF_ERROR(MeasureBound(f.slab_bytes, cuda, &f));
  f.bound_seconds = static_cast<double>(f.slab_bytes) / (f.touch_gbps * 1e9);
  if (cuda) f.bound_seconds += static_cast<double>(f.slab_bytes) / (f.pin_gbps * 1e9);

  constexpr uint64_t kTensor = uint64_t{1} << 26;
  optimizer::StagedAdamWOptions o;
  o.groups = {optimizer::ParamGroup{}};
  o.engine = options.engine;
  for (uint64_t at = 0, i = 0; at < n; at += kTensor, ++i) {
    const uint64_t count = std::min(kTensor, n - at);
    o.params.push_back({absl::StrCat("layers.", i, ".weight"), {count}, formats::DType::kBF16, 0});
    o.pieces.push_back({static_cast<uint32_t>(i), 0, count});
  }
  // The model's weights, touched before the clock starts (a trainer's already are).
  std::vector<uint16_t> weights(n, formats::FloatToBf16(0.5f));
  Clock::time_point start = Clock::now();
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<optimizer::StagedAdamW> opt,
                        optimizer::StagedAdamW::Create(o, std::as_bytes(std::span(weights))));
  f.create_seconds = Seconds(start);
  f.ratio = f.bound_seconds / f.create_seconds;
  return f;
}

}  // namespace ckpt::bench
