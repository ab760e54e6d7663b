// `ckpt-tool bench async-save`: Checkpointer::SaveAsync with steps running, on one rank.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
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

  optimizer::StagedAdamWOptions o;
  o.params = {{"w", {options.params}, formats::DType::kBF16, 0}};
  o.groups = {optimizer::ParamGroup{}};
  o.pieces = {{0, 0, options.params}};
  o.engine = options.engine;
  std::vector<uint16_t> weights(options.params, formats::FloatToBf16(0.5f));
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<optimizer::StagedAdamW> opt,
                        optimizer::StagedAdamW::Create(o, std::as_bytes(std::span(weights))));
  std::vector<float> grads;
  std::unique_ptr<DeviceStepBuffers> device;
  optimizer::StepArgs args;
  if (options.engine == optimizer::EngineKind::kCuda) {
    CKPT_ASSIGN_OR_RETURN(device, NewDeviceStepBuffers(options.params, 0.25f));
    args = device->args();
  } else {
    grads.assign(options.params, 0.25f);
    args = {grads.data(), formats::DType::kF32, 1.0f, weights.data()};
  }
  // One step as a trainer sees it: until its parameters are ready to read.
  auto step = [&]() -> absl::StatusOr<double> {
    const Clock::time_point start = Clock::now();
    CKPT_ASSIGN_OR_RETURN(optimizer::StepReport r, opt->Step(args));
    if (device != nullptr) CKPT_RETURN_IF_ERROR(device->WaitFor(r.done));
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
                        optimizer::Checkpointer::Create(opt.get(), store.get(),
                            &solo, co));

  CKPT_RETURN_IF_ERROR(step().status());  // Warm: slabs touched, moments non-zero.
  std::vector<double> plain;
  for (int i = 0; i < options.steps; ++i) {
    CKPT_ASSIGN_OR_RETURN(double s, step());
    plain.push_back(s);
  }
  std::sort(plain.begin(), plain.end());
  fig.step_ms = plain[plain.size() / 2] * 1e3;

  // The write bound again, with the steps running as they will beside the async saves.
  {
    absl::StatusOr<double> during = absl::UnknownError("not measured");
    std::atomic<bool> written{false};
    std::thread writer([&] {
      during = RawWriteBoundGbps(nullptr, options.dir, fig.state_bytes);
      written.store(true);
    });
    absl::Status stepped;
    while (!written.load() && stepped.ok()) {
      stepped = step().status();
      if (options.step_gap_ms > 0 && !written.load()) {
        std::this_thread::sleep_for(std::chrono::milliseconds(options.step_gap_ms));
      }
    }
    writer.join();
    CKPT_RETURN_IF_ERROR(stepped);
    CKPT_ASSIGN_OR_RETURN(fig.write_bound_during_steps_gbps, during);
  }

  uint64_t next_step = 1;
  // A first async save with steps running, untimed: it makes the staging pool and faults its
  // pages in, once per Checkpointer, as the first of a run's many saves would.
  {
    CKPT_ASSIGN_OR_RETURN(std::unique_ptr<optimizer::PendingSave> warm,
                          ckpt->SaveAsync(next_step++));
    do {
      CKPT_RETURN_IF_ERROR(step().status());
    } while (!warm->writer_done());
    CKPT_RETURN_IF_ERROR(warm->Finalize());
    CKPT_RETURN_IF_ERROR(prune());
  }
  // Rounds of a sync save then an async save with steps running, so that each async save is
  // compared with a sync save of the same moment (a disk's speed drifts from one to the next).
  std::vector<double> sync_s, durable_s, durable_ratio, during_ms, writer_s, finalize_s,
      finalized_s;
  std::unique_ptr<optimizer::PendingSave> pending;
  for (int round = 0; round < options.rounds; ++round) {
    Clock::time_point start = Clock::now();
    CKPT_RETURN_IF_ERROR(ckpt->Save(next_step++));
    sync_s.push_back(SecondsSince(start));
    CKPT_RETURN_IF_ERROR(prune());

    start = Clock::now();
    CKPT_ASSIGN_OR_RETURN(pending, ckpt->SaveAsync(next_step++));
    fig.return_ms = std::max(fig.return_ms, SecondsSince(start) * 1e3);
    // When the writer finishes, seen from a watcher (the steps only look between steps).
    std::atomic<bool> stop{false};
    double writer_done_s = 0;
    std::thread watcher([&] {
      while (!stop.load() && !pending->writer_done()) {
        std::this_thread::sleep_for(std::chrono::microseconds(100));
      }
      writer_done_s = SecondsSince(start);
    });
    double during = 0;
    int steps = 0;
    absl::Status stepped;
    do {  // At least one step, then as many as the writer leaves room for.
      absl::StatusOr<double> s = step();
      if (!s.ok()) {
        stepped = s.status();
        break;
      }
      during += *s;
      ++steps;
      if (options.step_gap_ms > 0 && !pending->writer_done()) {
        std::this_thread::sleep_for(std::chrono::milliseconds(options.step_gap_ms));
      }
    } while (!pending->writer_done());
    stop.store(true);
    watcher.join();
    CKPT_RETURN_IF_ERROR(stepped);
    const Clock::time_point finalize_start = Clock::now();
    CKPT_RETURN_IF_ERROR(pending->Finalize());
    finalize_s.push_back(SecondsSince(finalize_start));
    finalized_s.push_back(SecondsSince(start));
    CKPT_RETURN_IF_ERROR(prune());
    writer_s.push_back(writer_done_s);
    durable_s.push_back(writer_done_s + finalize_s.back());
    durable_ratio.push_back(durable_s.back() / sync_s.back());
    during_ms.push_back(during / steps * 1e3);
    fig.steps_during_save += steps;
    const optimizer::AsyncSaveReport report = pending->report();
    fig.units = report.units;
    fig.units_copied += report.units_copied;
    fig.bytes_copied += report.bytes_copied;
    fig.step_waits += report.step_waits;
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  fig.sync_save_s = median(sync_s);
  fig.durable_s = median(durable_s);
  fig.writer_s = median(writer_s);
  fig.finalize_ms = median(finalize_s) * 1e3;
  fig.finalized_s = median(finalized_s);
  fig.durable_ratio = median(durable_ratio);
  fig.step_during_save_ms = median(during_ms);

  pending.reset();
  ckpt.reset();
  store.reset();                                          // Lets go of the root.
  RemoveRecursively(Env::Default(), root).IgnoreError();  // Best effort: bench output.
  return fig;
}

}  // namespace ckpt::bench
