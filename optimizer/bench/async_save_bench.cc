// `ckpt-tool bench async-save`: Checkpointer::SaveAsync with steps running, on one rank.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "ckpt/base/status_macros.h"
#include "ckpt/bench/adamw_bench.h"
#include "ckpt/bench/ckpt_bench.h"
#include "ckpt/bench/store_bench.h"
#include "ckpt/checkpoint_store.h"
#include "ckpt/formats/float_convert.h"
#include "ckpt/optimizer/checkpointer.h"
#include "optimizer/host_buffer.h"

namespace ckpt::bench {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Best of 3 memcpy passes of `bytes` between two touched huge-page buffers: the rate a step's
// copy of units not yet written can reach.
absl::StatusOr<double> CopyBoundGbps(uint64_t bytes) {
  bytes = std::min<uint64_t>(bytes, uint64_t{1} << 30);
  CKPT_ASSIGN_OR_RETURN(optimizer::internal::HostBuffer src,
                        optimizer::internal::HostBuffer::Create(bytes, 0, /*pinned=*/false));
  CKPT_ASSIGN_OR_RETURN(optimizer::internal::HostBuffer dst,
                        optimizer::internal::HostBuffer::Create(bytes, 0, /*pinned=*/false));
  double best = 0;
  for (int pass = 0; pass < 3; ++pass) {
    const Clock::time_point start = Clock::now();
    std::memcpy(dst.data(), src.data(), bytes);
    best = std::max(best, static_cast<double>(bytes) / SecondsSince(start) / 1e9);
  }
  return best;
}

// The bench's model: one BF16 parameter (0.5 everywhere) under an optimizer of one AdamW
// group, and the arguments of its steps (gradients 0.25, on the device for the CUDA engine).
// Declared in teardown order: the step buffers before the optimizer, the weights last.
struct BenchModel {
  std::vector<uint16_t> weights;
  std::unique_ptr<optimizer::StagedAdamW> opt;
  std::vector<float> grads;
  std::unique_ptr<DeviceStepBuffers> device;
  optimizer::StepArgs args;
};

absl::StatusOr<std::unique_ptr<BenchModel>> NewBenchModel(uint64_t params,
                                                          optimizer::EngineKind engine) {
  auto m = std::make_unique<BenchModel>();
  optimizer::StagedAdamWOptions o;
  o.params = {{"w", {params}, formats::DType::kBF16, 0}};
  o.groups = {optimizer::ParamGroup{}};
  o.pieces = {{0, 0, params}};
  o.engine = engine;
  m->weights.assign(params, formats::FloatToBf16(0.5f));
  CKPT_ASSIGN_OR_RETURN(m->opt,
                        optimizer::StagedAdamW::Create(o, std::as_bytes(std::span(m->weights))));
  if (engine == optimizer::EngineKind::kCuda) {
    CKPT_ASSIGN_OR_RETURN(m->device, NewDeviceStepBuffers(params, 0.25f));
    m->args = m->device->args();
  } else {
    m->grads.assign(params, 0.25f);
    m->args = {m->grads.data(), formats::DType::kF32, 1.0f, m->weights.data()};
  }
  return m;
}

// One step as a trainer sees it: its seconds until its parameters are ready to read.
using StepFn = std::function<absl::StatusOr<double>()>;

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// A step without a save, in ms: the median of `steps` after one that warms up (slabs touched,
// moments non-zero).
absl::StatusOr<double> PlainStepMs(const StepFn& step, int steps) {
  CKPT_RETURN_IF_ERROR(step().status());
  std::vector<double> plain;
  for (int i = 0; i < steps; ++i) {
    CKPT_ASSIGN_OR_RETURN(double s, step());
    plain.push_back(s);
  }
  return Median(std::move(plain)) * 1e3;
}

// The write bound of `bytes` in `dir` again, with the steps running (`step_gap_ms` apart) as
// they will beside the async saves.
absl::StatusOr<double> WriteBoundDuringSteps(const StepFn& step, const std::string& dir,
                                             uint64_t bytes, int step_gap_ms) {
  absl::StatusOr<double> during = absl::UnknownError("not measured");
  std::atomic<bool> written{false};
  std::thread writer([&] {
    during = RawWriteBoundGbps(nullptr, dir, bytes);
    written.store(true);
  });
  absl::Status stepped;
  while (!written.load() && stepped.ok()) {
    stepped = step().status();
    if (step_gap_ms > 0 && !written.load()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(step_gap_ms));
    }
  }
  writer.join();
  CKPT_RETURN_IF_ERROR(stepped);
  return during;
}

// A first async save of `step_number` with steps running, untimed: it makes the staging pool
// and faults its pages in, once per Checkpointer, as the first of a run's many saves would.
absl::Status WarmAsyncSave(optimizer::Checkpointer& ckpt, uint64_t step_number,
                           const StepFn& step) {
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<optimizer::PendingSave> warm,
                        ckpt.SaveAsync(step_number));
  do {
    CKPT_RETURN_IF_ERROR(step().status());
  } while (!warm->writer_done());
  return warm->Finalize();
}

// Each round's figures, in seconds unless named otherwise.
struct RoundSamples {
  std::vector<double> sync_s, durable_s, durable_ratio, during_ms, writer_s, finalize_s,
      finalized_s;
};

// The figures of the rounds: each sample's median.
void SetMedians(const RoundSamples& r, AsyncSaveFigures& fig) {
  fig.sync_save_s = Median(r.sync_s);
  fig.durable_s = Median(r.durable_s);
  fig.writer_s = Median(r.writer_s);
  fig.finalize_ms = Median(r.finalize_s) * 1e3;
  fig.finalized_s = Median(r.finalized_s);
  fig.durable_ratio = Median(r.durable_ratio);
  fig.step_during_save_ms = Median(r.during_ms);
}

// One async save with steps running; the times from SaveAsync's call.
struct AsyncRound {
  double return_s = 0;     // SaveAsync returned.
  double writer_s = 0;     // Its writer done, seen from a watcher.
  double finalize_s = 0;   // Finalize alone.
  double finalized_s = 0;  // Finalize returned.
  double steps_s = 0;      // The steps that ran meanwhile, in all.
  int steps = 0;
  optimizer::AsyncSaveReport report;
};

absl::StatusOr<AsyncRound> TimeAsyncSave(optimizer::Checkpointer& ckpt, uint64_t step_number,
                                         const StepFn& step, int step_gap_ms) {
  AsyncRound r;
  const Clock::time_point start = Clock::now();
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<optimizer::PendingSave> pending,
                        ckpt.SaveAsync(step_number));
  r.return_s = SecondsSince(start);
  // When the writer finishes, seen from a watcher (the steps only look between steps).
  std::atomic<bool> stop{false};
  std::thread watcher([&] {
    while (!stop.load() && !pending->writer_done()) {
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    r.writer_s = SecondsSince(start);
  });
  absl::Status stepped;
  do {  // At least one step, then as many as the writer leaves room for.
    absl::StatusOr<double> s = step();
    if (!s.ok()) {
      stepped = s.status();
      break;
    }
    r.steps_s += *s;
    ++r.steps;
    if (step_gap_ms > 0 && !pending->writer_done()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(step_gap_ms));
    }
  } while (!pending->writer_done());
  stop.store(true);
  watcher.join();
  CKPT_RETURN_IF_ERROR(stepped);
  const Clock::time_point finalize_start = Clock::now();
  CKPT_RETURN_IF_ERROR(pending->Finalize());
  r.finalize_s = SecondsSince(finalize_start);
  r.finalized_s = SecondsSince(start);
  r.report = pending->report();
  return r;
}

}  // namespace

absl::StatusOr<AsyncSaveFigures> RunAsyncSaveBench(const AsyncSaveBenchOptions& options) {
  if (options.params == 0 || options.steps < 1 || options.rounds < 1) {
    return absl::InvalidArgumentError("bench async-save needs parameters and steps");
  }
  AsyncSaveFigures fig;
  fig.state_bytes = options.params * 14;
  CKPT_ASSIGN_OR_RETURN(fig.write_bound_gbps,
                        RawWriteBoundGbps(nullptr, options.dir, fig.state_bytes));
  CKPT_ASSIGN_OR_RETURN(fig.copy_bound_gbps, CopyBoundGbps(options.params * 12));

  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<BenchModel> model,
                        NewBenchModel(options.params, options.engine));
  optimizer::StagedAdamW* const opt = model->opt.get();
  const StepFn step = [&]() -> absl::StatusOr<double> {
    const Clock::time_point start = Clock::now();
    CKPT_ASSIGN_OR_RETURN(optimizer::StepReport r, opt->Step(model->args));
    if (model->device != nullptr) CKPT_RETURN_IF_ERROR(model->device->WaitFor(r.done));
    return SecondsSince(start);
  };

  const std::string root = JoinPath(options.dir, "ckpt-bench-async");
  RemoveRecursively(Env::Default(), root).IgnoreError();  // Best effort: a previous run's.
  StoreOptions so;
  so.write_threads = options.write_threads;
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointStore> store, CheckpointStore::Open(root, so));
  // Rounds of 4 GiB saves must not fill the disk: the old steps are deleted between the timed
  // parts (the store's own retention would delete inside whichever commit triggered it, sync or
  // async, and time the filesystem's deletion of gigabytes as part of that save).
  const RetentionPolicy keep{.keep_last = 2};
  auto prune = [&]() -> absl::Status {
    const Clock::time_point start = Clock::now();
    CKPT_RETURN_IF_ERROR(store->ApplyRetention(keep).status());
    fig.retention_s = std::max(fig.retention_s, SecondsSince(start));
    return absl::OkStatus();
  };
  SingleProcessCoordinator solo;
  optimizer::CheckpointerOptions co;
  co.async_staging_bytes = options.staging_bytes;
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<optimizer::Checkpointer> ckpt,
                        optimizer::Checkpointer::Create(opt, store.get(), &solo, co));

  CKPT_ASSIGN_OR_RETURN(fig.step_ms, PlainStepMs(step, options.steps));
  CKPT_ASSIGN_OR_RETURN(fig.write_bound_during_steps_gbps,
                        WriteBoundDuringSteps(step, options.dir, fig.state_bytes,
                                              options.step_gap_ms));
  uint64_t next_step = 1;
  CKPT_RETURN_IF_ERROR(WarmAsyncSave(*ckpt, next_step++, step));
  CKPT_RETURN_IF_ERROR(prune());
  // Rounds of a sync save then an async save with steps running, so that each async save is
  // compared with a sync save of the same moment (a disk's speed drifts from one to the next).
  RoundSamples samples;
  auto& [sync_s, durable_s, durable_ratio, during_ms, writer_s, finalize_s, finalized_s] = samples;
  for (int round = 0; round < options.rounds; ++round) {
    const Clock::time_point start = Clock::now();
    CKPT_RETURN_IF_ERROR(ckpt->Save(next_step++));
    sync_s.push_back(SecondsSince(start));
    CKPT_RETURN_IF_ERROR(prune());
    CKPT_ASSIGN_OR_RETURN(const AsyncRound r,
                          TimeAsyncSave(*ckpt, next_step++, step, options.step_gap_ms));
    fig.return_ms = std::max(fig.return_ms, r.return_s * 1e3);
    finalize_s.push_back(r.finalize_s);
    finalized_s.push_back(r.finalized_s);
    CKPT_RETURN_IF_ERROR(prune());
    writer_s.push_back(r.writer_s);
    durable_s.push_back(r.writer_s + r.finalize_s);
    durable_ratio.push_back(durable_s.back() / sync_s.back());
    during_ms.push_back(r.steps_s / r.steps * 1e3);
    fig.steps_during_save += r.steps;
    fig.units = r.report.units;
    fig.units_copied += r.report.units_copied;
    fig.bytes_copied += r.report.bytes_copied;
    fig.step_waits += r.report.step_waits;
  }
  SetMedians(samples, fig);

  ckpt.reset();
  store.reset();                                          // Lets go of the root.
  RemoveRecursively(Env::Default(), root).IgnoreError();  // Best effort: bench output.
  return fig;
}

}  // namespace ckpt::bench
