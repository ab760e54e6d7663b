// The CPU engine: units cut into tasks of at most TaskElems(elements, threads) elements, spread
// over a fixed pool of threads, each task one fused pass of the kernel chosen for the CPU at run
// time.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "ckpt/formats/convert.h"
#include "optimizer/cpu_kernels.h"
#include "optimizer/engine.h"
#include "optimizer/thread_pool.h"

namespace ckpt::optimizer {
namespace {

using internal::KernelArgs;

size_t ElementBytes(formats::DType d) { return formats::DTypeSize(d); }

class CpuEngine : public internal::Engine {
 public:
  CpuEngine(int threads, CpuIsa isa) : isa_(isa), pool_(threads) {}

  absl::StatusOr<StepReport> Step(const StepArgs& args, const std::vector<Unit>& units,
                                  const std::vector<StepConstants>& constants,
                                  const SlabView& slabs, formats::DType model_dtype,
                                  uint64_t elements) override {
    internal::KernelFn kernel =
        internal::SelectKernel(isa_, args.grad_dtype, model_dtype, slabs.moment_dtype);
    if (kernel == nullptr) return absl::InvalidArgumentError("unsupported grad or model dtype");
    struct Task {
      uint64_t offset, count;
      uint32_t group;
    };
    const uint64_t task_elems = internal::TaskElems(elements, pool_.size());
    std::vector<Task> tasks;
    for (const Unit& u : units) {
      for (uint64_t d = 0; d < u.count; d += task_elems)
        tasks.push_back({u.offset + d, std::min(task_elems, u.count - d), u.group});
    }
    StepReport report;
    if (args.check_finite) {
      CheckFinite(
          args, tasks.size(), [&](size_t i) { return std::pair(tasks[i].offset, tasks[i].count); },
          &report);
      if (report.nonfinite > 0) {
        report.skipped = true;
        return report;
      }
    }
    const size_t gsize = ElementBytes(args.grad_dtype), psize = ElementBytes(model_dtype);
    const size_t msize = MomentBytes(slabs.moment_dtype);
    pool_.ParallelFor(tasks.size(), [&](size_t i) {
      const Task& t = tasks[i];
      KernelArgs a{slabs.master + t.offset,
                   slabs.exp_avg + t.offset * msize,
                   slabs.exp_avg_sq + t.offset * msize,
                   static_cast<const std::byte*>(args.grads) + t.offset * gsize,
                   static_cast<std::byte*>(args.params) + t.offset * psize,
                   t.count,
                   args.grad_scale,
                   constants[t.group]};
      kernel(a);
    }, Participants());
    return report;
  }

  absl::StatusOr<StepReport> CheckFinite(const StepArgs& args, const std::vector<Unit>& units,
                                         uint64_t elements) override {
    const uint64_t task_elems = internal::TaskElems(elements, pool_.size());
    std::vector<std::pair<uint64_t, uint64_t>> tasks;
    for (const Unit& u : units) {
      for (uint64_t d = 0; d < u.count; d += task_elems)
        tasks.emplace_back(u.offset + d, std::min(task_elems, u.count - d));
    }
    StepReport report;
    CheckFinite(args, tasks.size(), [&](size_t i) { return tasks[i]; }, &report);
    report.skipped = report.nonfinite > 0;
    return report;
  }

  absl::Status WriteWeights(const float* master, const std::vector<Unit>& units,
                            formats::DType model_dtype, void* dest,
                            const std::optional<CudaStreamView>& stream) override {
    (void)stream;  // Host memory only.
    uint64_t elements = 0;
    for (const Unit& u : units) elements += u.count;
    const uint64_t task_elems = internal::TaskElems(elements, pool_.size());
    const uint64_t tasks = (elements + task_elems - 1) / task_elems;
    const size_t psize = ElementBytes(model_dtype);
    pool_.ParallelFor(tasks, [&](size_t i) {
      const uint64_t at = i * task_elems, n = std::min(task_elems, elements - at);
      formats::Convert(formats::DType::kF32, std::as_bytes(std::span(master + at, n)),
                       model_dtype,
                       std::span(static_cast<std::byte*>(dest) + at * psize, n * psize));
    }, Participants());
    return absl::OkStatus();
  }

  void SetSpareCores(int cores) override { spare_ = cores; }

  std::string name() const override {
    return absl::StrCat("cpu-", internal::IsaName(isa_), "-x", pool_.size());
  }

 private:
  template <typename Range>
  void CheckFinite(const StepArgs& args, size_t tasks, Range range, StepReport* report) {
    internal::NonFiniteFn check = internal::SelectNonFiniteKernel(isa_, args.grad_dtype);
    const size_t gsize = ElementBytes(args.grad_dtype);
    std::mutex mu;
    pool_.ParallelFor(tasks, [&](size_t i) {
      auto [offset, count] = range(i);
      const internal::NonFinite bad =
          check(static_cast<const std::byte*>(args.grads) + offset * gsize, count, args.grad_scale);
      if (bad.count > 0) {
        std::lock_guard<std::mutex> lock(mu);
        report->first_nonfinite = report->nonfinite == 0
                                      ? offset + bad.first
                                      : std::min(report->first_nonfinite, offset + bad.first);
        report->nonfinite += bad.count;
      }
    });
  }

  // Threads a step runs on: the pool, less the cores it leaves spare (at least one).
  int Participants() const { return std::max(1, pool_.size() - spare_); }

  const CpuIsa isa_;
  internal::ThreadPool pool_;
  int spare_ = 0;
};

}  // namespace

absl::StatusOr<std::unique_ptr<internal::Engine>> NewCpuEngine(int threads, CpuIsa isa) {
  if (!internal::CpuSupports(isa)) {
    return absl::FailedPreconditionError(
        absl::StrCat("this CPU cannot run the ", internal::IsaName(isa), " engine"));
  }
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return std::unique_ptr<internal::Engine>(new CpuEngine(threads, internal::ResolveIsa(isa)));
}

}  // namespace ckpt::optimizer
