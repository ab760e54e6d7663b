// What `ckpt-tool bench overlap` measures: how much of the optimizer step an overlapped step
// (StagedAdamW::BeginOverlap, docs/design/overlap.md) hides behind a synthetic backward that
// finishes its gradients bucket by bucket, against the bound of the same run. The backward is
// `buckets` equal layers of backward_seconds in all, released last layer first as autograd
// does: on the CUDA engine each layer is a kernel that keeps the caller's stream busy (the SMs
// left free), on the CPU engine a sleep of the calling thread (a GPU computing while the host
// waits). Not installed: for ckpt-tool only. Functions never print.
#ifndef CKPT_OPTIMIZER_BENCH_OVERLAP_BENCH_H_
#define CKPT_OPTIMIZER_BENCH_OVERLAP_BENCH_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "ckpt/optimizer/staged_adamw.h"

namespace ckpt::bench {

// A plain value.
struct OverlapBenchOptions {
  uint64_t params = 0;  // BF16 weights with FP32 gradients, cut into `buckets` parameters.
  int buckets = 24;     // Layers of the synthetic backward; at least 1, at most params.
  double backward_seconds = 0.05;  // The whole synthetic backward; > 0.
  optimizer::EngineKind engine = optimizer::EngineKind::kCpu;
  optimizer::MomentDType moments = optimizer::MomentDType::kF32;
  int threads = 0;  // CPU engine threads; 0: every core.
  uint64_t unit_bytes = 0;  // StagedAdamWOptions::unit_bytes; 0: its default.
  int steps = 3;    // Timed steps of each kind after one warm-up each; the best is reported.
  // Finish scales the gradients by 0.5 where BeginOverlap speculated with 1, as clipping that
  // fires does: the speculation is redone (the worst case).
  bool clip_fires = false;
  // The overlapped step is gated (OverlapOptions::gate, CUDA engine): its window during the
  // backward, its tail sent at Finish; the step ends when the stream has awaited every unit
  // (AwaitStep), as if the next forward's first layer read every parameter.
  bool gate = false;
  uint32_t window = 8;  // OverlapOptions::window.
};

// Seconds, each the best of `steps`. A plain value.
struct OverlapFigures {
  std::string engine;           // The engine's name.
  double backward_seconds = 0;  // The synthetic backward alone, measured.
  double plain_seconds = 0;     // The backward, then Step.
  double overlap_seconds = 0;   // BeginOverlap, the backward releasing each layer, Finish.
  // The step alone at its bound: the state's bytes over the slower direction of PCIe with both
  // busy (CUDA engine), or over host memory bandwidth from the STREAM triad (CPU engine).
  double step_bound_seconds = 0;
  double bound_gbps = 0;       // That rate (GB/s).
  double bytes_per_param = 0;  // The bytes it divides: each way (CUDA) or in all (CPU).
  // The least an overlapped step can take: the last layer's update cannot start before the
  // backward ends, nor the first before its layer: max(backward + step_bound / buckets,
  // backward / buckets + step_bound), with the backward as measured.
  double bound_seconds = 0;
  // Host time the backward's thread spent inside Overlap::Release in the overlapped step with
  // the least of it, and its Release calls: the cost a host-bound backward pays for queueing
  // the units (CUDA: the runtime calls per unit).
  double release_seconds = 0;
  int release_calls = 0;
  uint64_t speculated_units = 0;  // Of the last timed overlapped step.
  bool speculation_held = false;
  uint64_t device_bytes = 0;  // GPU memory the engine holds.
};

// Measures the bound (its memory freed first), then times the three kinds of step alternately.
// kInvalidArgument for options out of range; kUnimplemented for the CUDA engine without CUDA;
// the optimizer's and the device's errors.
absl::StatusOr<OverlapFigures> RunOverlapBench(const OverlapBenchOptions& options);

}  // namespace ckpt::bench

#endif  // CKPT_OPTIMIZER_BENCH_OVERLAP_BENCH_H_
