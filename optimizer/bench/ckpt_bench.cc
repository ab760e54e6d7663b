#include "ckpt/bench/ckpt_bench.h"

#include <algorithm>
#include <chrono>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "ckpt/base/status_macros.h"
#include "ckpt/bench/store_bench.h"
#include "ckpt/checkpoint_store.h"
#include "ckpt/formats/float_convert.h"
#include "ckpt/optimizer/checkpointer.h"

namespace ckpt::bench {
namespace {

using Clock = std::chrono::steady_clock;
using optimizer::StagedAdamW;

// One rank of the benchmark job.
struct Rank {
  std::unique_ptr<StagedAdamW> opt;
  std::vector<uint16_t> weights;
  std::vector<float> grads;
  std::unique_ptr<CheckpointStore> store;
  std::unique_ptr<optimizer::Checkpointer> ckpt;
};

// Runs fn(r) on every rank at once and returns the wall time in seconds, or the first error.
absl::StatusOr<double> Timed(int ranks, const std::function<absl::Status(int)>& fn) {
  std::vector<absl::Status> results(static_cast<size_t>(ranks));
  const Clock::time_point start = Clock::now();
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) threads.emplace_back([&, r] { results[r] = fn(r); });
  for (std::thread& t : threads) t.join();
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  for (const absl::Status& s : results) CKPT_RETURN_IF_ERROR(s);
  return seconds;
}

absl::Status StepAll(std::vector<Rank>& job) {
  for (Rank& r : job) {
    CKPT_RETURN_IF_ERROR(
        r.opt->Step({r.grads.data(), formats::DType::kF32, 1.0f, r.weights.data()}).status());
  }
  return absl::OkStatus();
}

// One optimizer, store handle and Checkpointer per rank over `root`, in its construction state
// (what a trainer's new process has before it resumes).
absl::Status MakeJob(const CkptBenchOptions& options, const std::string& root, ThreadGroup& group,
                     std::vector<Rank>& job) {
  const int n = options.ranks;
  job = std::vector<Rank>(static_cast<size_t>(n));
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  for (int r = 0; r < n; ++r) {
    Rank& rank = job[static_cast<size_t>(r)];
    const uint64_t lo = options.params * static_cast<uint64_t>(r) / static_cast<uint64_t>(n);
    const uint64_t hi = options.params * static_cast<uint64_t>(r + 1) / static_cast<uint64_t>(n);
    optimizer::StagedAdamWOptions o;
    const uint64_t t = options.tensors;
    for (uint64_t i = 0; i < t; ++i) {
      const uint64_t a = options.params * i / t, b = options.params * (i + 1) / t;
      o.params.push_back({t == 1 ? std::string("w") : absl::StrCat("w.", i), {b - a},
                          formats::DType::kBF16, 0});
      if (b > lo && a < hi) {
        const uint64_t from = std::max(a, lo);
        o.pieces.push_back({static_cast<uint32_t>(i), from - a, std::min(b, hi) - from});
      }
    }
    o.groups = {optimizer::ParamGroup{}};
    o.threads = std::max(1, cores / n);
    rank.weights.assign(hi - lo, formats::FloatToBf16(0.5f));
    rank.grads.assign(hi - lo, 0.25f);
    CKPT_ASSIGN_OR_RETURN(rank.opt, StagedAdamW::Create(o, std::as_bytes(std::span(rank.weights))));
  }
  CKPT_ASSIGN_OR_RETURN(std::vector<std::unique_ptr<CheckpointStore>> stores,
                        OpenStoresOnThreads(root, StoreOptions{}, group));
  for (int r = 0; r < n; ++r) job[static_cast<size_t>(r)].store = std::move(stores[r]);
  for (int r = 0; r < n; ++r) {
    Rank& rank = job[static_cast<size_t>(r)];
    auto ckpt = optimizer::Checkpointer::Create(rank.opt.get(), rank.store.get(), group.member(r));
    CKPT_RETURN_IF_ERROR(ckpt.status());
    rank.ckpt = *std::move(ckpt);
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<CkptFigures> RunCkptBench(const CkptBenchOptions& options) {
  if (options.params == 0 || options.ranks < 1 || options.tensors < 1 ||
      options.tensors > options.params || options.tensors > UINT32_MAX) {
    return absl::InvalidArgumentError(
        "bench ckpt needs parameters, at least one rank and from one tensor to one per "
        "parameter");
  }
  const int n = options.ranks;
  CkptFigures fig;
  fig.state_bytes = options.params * 14;
  CKPT_ASSIGN_OR_RETURN(fig.write_bound_gbps,
                        RawWriteBoundGbps(nullptr, options.dir, fig.state_bytes));
  const std::string root = JoinPath(options.dir, "ckpt-bench-optimizer");
  RemoveRecursively(Env::Default(), root).IgnoreError();  // Best effort: a previous run's.
  ThreadGroup group(n);
  std::vector<Rank> job;
  CKPT_RETURN_IF_ERROR(MakeJob(options, root, group, job));
  CKPT_RETURN_IF_ERROR(StepAll(job));  // Slabs touched and the moments non-zero.
  auto save = [&](uint64_t step) {
    return Timed(n, [&](int r) { return job[static_cast<size_t>(r)].ckpt->Save(step); });
  };
  auto load = [&](uint64_t step) {
    return Timed(n, [&](int r) { return job[static_cast<size_t>(r)].ckpt->Load(step).status(); });
  };
  // What undo source a load used, from its report (every rank's is the same).
  auto load_reporting = [&](uint64_t step, optimizer::LoadReport* report) {
    return Timed(n, [&](int r) -> absl::Status {
      CKPT_ASSIGN_OR_RETURN(optimizer::LoadReport got, job[static_cast<size_t>(r)].ckpt->Load(step));
      if (r == 0) *report = got;
      return absl::OkStatus();
    });
  };
  const double bytes = static_cast<double>(fig.state_bytes);
  CKPT_ASSIGN_OR_RETURN(const double save_s, save(1));
  fig.save_gbps = bytes / save_s / 1e9;
  CKPT_RETURN_IF_ERROR(save(2).status());  // Step 2 is then the free undo source of loading 1.
  CKPT_ASSIGN_OR_RETURN(const double load_s, load(1));
  fig.load_gbps = bytes / load_s / 1e9;
  CKPT_RETURN_IF_ERROR(StepAll(job));  // The state moves on: the next load must spill.
  optimizer::LoadReport spilled;
  CKPT_ASSIGN_OR_RETURN(const double spill_s, load_reporting(1, &spilled));
  if (!spilled.undo_spilled) return absl::InternalError("the spill load did not spill");
  fig.load_spill_gbps = bytes / spill_s / 1e9;
  const int read_threads = job[0].store->options().read_threads;
  // A new process: fresh optimizers resume from step 1, their undo re-derived, nothing written.
  job.clear();  // Handles let go of the root.
  CKPT_RETURN_IF_ERROR(MakeJob(options, root, group, job));
  optimizer::LoadReport fresh;
  CKPT_ASSIGN_OR_RETURN(const double fresh_s, load_reporting(1, &fresh));
  if (!fresh.undo_derived) return absl::InternalError("the fresh load spilled");
  fig.load_fresh_gbps = bytes / fresh_s / 1e9;
  CKPT_ASSIGN_OR_RETURN(fig.read_bound_gbps,
                        RawReadStepGbps(nullptr, JoinPath(root, StepDirectoryName(1)), read_threads));
  // A spill writes the state, then the load reads it: its bound is the two in sequence.
  fig.spill_bound_gbps = 1.0 / (1.0 / fig.write_bound_gbps + 1.0 / fig.read_bound_gbps);
  job.clear();
  RemoveRecursively(Env::Default(), root).IgnoreError();  // Best effort: bench output.
  return fig;
}

}  // namespace ckpt::bench
