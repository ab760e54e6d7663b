// ckpt-tool bench overlap (ckpt/bench/overlap_bench.h).
#include "ckpt/bench/overlap_bench.h"

#include <algorithm>
#include <chrono>
#include <memory>
#include <span>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "ckpt/base/status_macros.h"
#include "ckpt/bench/adamw_bench.h"
#include "ckpt/formats/float_convert.h"
#include "optimizer/bench/cpu_bounds.h"
#include "optimizer/host_buffer.h"

namespace ckpt::bench {
namespace {

using Clock = std::chrono::steady_clock;
using optimizer::EngineKind;
using optimizer::StagedAdamW;
using optimizer::StepArgs;
using optimizer::StepReport;

double Seconds(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// The trainer's side of a step: gradients, weights and the synthetic backward's layers.
class Backward {
 public:
  virtual ~Backward() = default;
  virtual StepArgs args() = 0;
  // One layer's backward: `seconds` of work before its gradients are final (queued on the
  // stream for the GPU; slept for the host).
  virtual absl::Status Layer(double seconds) = 0;
  // Waits until everything queued so far, and `done` (a StepReport's), has finished.
  virtual absl::Status Wait(CUevent_st* done) = 0;
};

class HostBackward : public Backward {
 public:
  static absl::StatusOr<std::unique_ptr<Backward>> Create(uint64_t n) {
    auto b = std::make_unique<HostBackward>();
    using optimizer::internal::HostBuffer;
    CKPT_ASSIGN_OR_RETURN(b->grads_, HostBuffer::Create(n * 4, 3 * 4096 + 192, false));
    CKPT_ASSIGN_OR_RETURN(b->params_, HostBuffer::Create(n * 2, 4 * 4096 + 256, false));
    std::span<float> g(reinterpret_cast<float*>(b->grads_.data()), n);
    for (uint64_t i = 0; i < n; ++i) g[i] = static_cast<float>(i % 2001) * 1e-3f - 1.0f;
    return std::unique_ptr<Backward>(std::move(b));
  }
  StepArgs args() override {
    return StepArgs{grads_.data(), formats::DType::kF32, 1.0f, params_.data()};
  }
  absl::Status Layer(double seconds) override {
    std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
    return absl::OkStatus();
  }
  absl::Status Wait(CUevent_st*) override { return absl::OkStatus(); }

 private:
  optimizer::internal::HostBuffer grads_, params_;
};

class DeviceBackward : public Backward {
 public:
  explicit DeviceBackward(std::unique_ptr<DeviceStepBuffers> buffers)
      : buffers_(std::move(buffers)) {}
  StepArgs args() override { return buffers_->args(); }
  absl::Status Layer(double seconds) override { return buffers_->Busy(seconds); }
  absl::Status Wait(CUevent_st* done) override { return buffers_->WaitFor(done); }

 private:
  std::unique_ptr<DeviceStepBuffers> buffers_;
};

absl::Status CheckOptions(const OverlapBenchOptions& o) {
  if (o.params == 0 || o.buckets < 1 || static_cast<uint64_t>(o.buckets) > o.params ||
      o.steps < 1 || !(o.backward_seconds > 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "bench overlap needs parameters >= buckets >= 1, steps >= 1 and a backward > 0 s, not ",
        o.params, " parameters, ", o.buckets, " buckets, ", o.steps, " steps, ",
        o.backward_seconds, " s"));
  }
  return absl::OkStatus();
}

// The bound's rate and bytes: PCIe duplex each way (CUDA), or host memory (CPU).
absl::Status MeasureBound(const OverlapBenchOptions& o, OverlapFigures* f) {
  const bool f32 = o.moments == optimizer::MomentDType::kF32;
  if (o.engine == EngineKind::kCuda) {
    CKPT_ASSIGN_OR_RETURN(DuplexRates r, MeasurePcieDuplex(uint64_t{1} << 30));
    f->bound_gbps = std::min(r.h2d_gbps, r.d2h_gbps);
    f->bytes_per_param = f32 ? 12 : 8;  // Master and moments, each way.
  } else {
    const int t = o.threads > 0 ? o.threads
                                : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    CKPT_ASSIGN_OR_RETURN(f->bound_gbps,
                          optimizer::internal::MeasureTriadGBps(
                              std::max<uint64_t>(o.params, 32u << 20), t,
                              optimizer::CpuIsa::kAuto, 5));
    f->bytes_per_param = CpuBytesPerParam(formats::DType::kF32, o.moments);
  }
  f->step_bound_seconds =
      static_cast<double>(o.params) * f->bytes_per_param / (f->bound_gbps * 1e9);
  return absl::OkStatus();
}

// One BF16 parameter per bucket (equal layers; the last takes the remainder), each one piece on
// this rank, in one AdamW group.
optimizer::StagedAdamWOptions LayerOptions(const OverlapBenchOptions& options) {
  const uint64_t n = options.params;
  const auto buckets = static_cast<uint32_t>(options.buckets);
  optimizer::StagedAdamWOptions o;
  o.groups = {optimizer::ParamGroup{}};
  o.engine = options.engine;
  o.threads = options.threads;
  o.moment_dtype = options.moments;
  if (options.unit_bytes != 0) o.unit_bytes = options.unit_bytes;
  for (uint32_t b = 0; b < buckets; ++b) {
    const uint64_t count = b + 1 < buckets ? n / buckets : n - (n / buckets) * (buckets - 1);
    o.params.push_back({absl::StrCat("layers.", b, ".weight"), {count}, formats::DType::kBF16, 0});
    o.pieces.push_back({b, 0, count});
  }
  return o;
}

// The synthetic backward of `n` parameters for `engine`: on the device for the CUDA engine.
absl::StatusOr<std::unique_ptr<Backward>> NewBackward(EngineKind engine, uint64_t n) {
  if (engine == EngineKind::kCuda) {
    CKPT_ASSIGN_OR_RETURN(std::unique_ptr<DeviceStepBuffers> buffers,
                          NewDeviceStepBuffers(n, 1e-3f));
    return std::make_unique<DeviceBackward>(std::move(buffers));
  }
  return HostBackward::Create(n);
}

}  // namespace

absl::StatusOr<OverlapFigures> RunOverlapBench(const OverlapBenchOptions& options) {
  CKPT_RETURN_IF_ERROR(CheckOptions(options));
  OverlapFigures f;
  CKPT_RETURN_IF_ERROR(MeasureBound(options, &f));

  const uint64_t n = options.params;
  const auto buckets = static_cast<uint32_t>(options.buckets);
  const optimizer::StagedAdamWOptions o = LayerOptions(options);
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<Backward> backward, NewBackward(options.engine, n));
  std::vector<uint16_t> weights(n, formats::FloatToBf16(0.5f));
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<StagedAdamW> opt,
                        StagedAdamW::Create(o, std::as_bytes(std::span(weights))));
  weights = {};
  f.engine = opt->engine_name();
  f.device_bytes = opt->device_bytes();

  const double layer = options.backward_seconds / buckets;
  StepArgs begin = backward->args();
  StepArgs final_args = begin;
  final_args.grad_scale = options.clip_fires ? 0.5f : 1.0f;
  // The backward, last layer first; `release(b)` once layer b's gradients are final.
  auto run_backward = [&](auto&& release) -> absl::Status {
    for (uint32_t b = buckets; b-- > 0;) {
      CKPT_RETURN_IF_ERROR(backward->Layer(layer));
      CKPT_RETURN_IF_ERROR(release(b));
    }
    return absl::OkStatus();
  };
  auto nothing = [](uint32_t) { return absl::OkStatus(); };
  f.backward_seconds = f.plain_seconds = f.overlap_seconds = 1e30;
  for (int i = 0; i <= options.steps; ++i) {  // Step 0 warms up (first touch, the spare side).
    Clock::time_point start = Clock::now();
    CKPT_RETURN_IF_ERROR(run_backward(nothing));
    CKPT_RETURN_IF_ERROR(backward->Wait(nullptr));
    const double alone = Seconds(start);

    start = Clock::now();
    CKPT_RETURN_IF_ERROR(run_backward(nothing));
    CKPT_ASSIGN_OR_RETURN(StepReport plain, opt->Step(final_args));
    CKPT_RETURN_IF_ERROR(backward->Wait(plain.done));
    const double plain_s = Seconds(start);

    start = Clock::now();
    optimizer::OverlapOptions overlap_options;
    overlap_options.gate = options.gate;
    overlap_options.window = options.window;
    CKPT_ASSIGN_OR_RETURN(StagedAdamW::Overlap ov, opt->BeginOverlap(begin, overlap_options));
    double releasing = 0;
    CKPT_RETURN_IF_ERROR(run_backward([&](uint32_t b) {
      const uint32_t piece[] = {b};
      const Clock::time_point at = Clock::now();
      absl::Status released = ov.Release(piece);
      releasing += Seconds(at);
      return released;
    }));
    CKPT_ASSIGN_OR_RETURN(StepReport over, ov.Finish(final_args));
    if (over.gated) CKPT_RETURN_IF_ERROR(opt->AwaitStep(*begin.stream));
    CKPT_RETURN_IF_ERROR(backward->Wait(over.gated ? nullptr : over.done));
    const double overlap_s = Seconds(start);
    if (i == 0) continue;
    f.backward_seconds = std::min(f.backward_seconds, alone);
    f.plain_seconds = std::min(f.plain_seconds, plain_s);
    f.overlap_seconds = std::min(f.overlap_seconds, overlap_s);
    if (i == 1 || releasing < f.release_seconds) f.release_seconds = releasing;
    f.release_calls = static_cast<int>(buckets);
    f.speculated_units = over.speculated_units;
    f.speculation_held = over.speculation_held;
  }
  f.bound_seconds = std::max(f.backward_seconds + f.step_bound_seconds / buckets,
                             f.backward_seconds / buckets + f.step_bound_seconds);
  return f;
}

}  // namespace ckpt::bench
