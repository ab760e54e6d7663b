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
    const size_t gsize = ElementBytes(args.grad_dtype), psize = ElementBytes(model_dtype);
    const std::vector<Task> tasks =
        Tasks(args, units, slabs, internal::TaskElems(elements, pool_.size()), gsize, psize);
    StepReport report;
    if (args.check_finite) {
      CheckFinite(args, tasks, &report);
      if (report.nonfinite > 0) {
        report.skipped = true;
        return report;
      }
    }
    const size_t msize = MomentBytes(slabs.moment_dtype);
    pool_.ParallelFor(tasks.size(), [&](size_t i) {
      const Task& t = tasks[i];
      KernelArgs a{slabs.master + t.offset,
                   slabs.exp_avg + t.offset * msize,
                   slabs.exp_avg_sq + t.offset * msize,
                   t.grads,
                   t.params,
                   t.count,
                   args.grad_scale,
                   constants[t.group]};
      kernel(a);
    }, Participants());
    return report;
  }

  absl::StatusOr<StepReport> CheckFinite(const StepArgs& args, const std::vector<Unit>& units,
                                         const SlabView& slabs, uint64_t elements) override {
    const std::vector<Task> tasks =
        Tasks(args, units, slabs, internal::TaskElems(elements, pool_.size()),
              ElementBytes(args.grad_dtype), 0);
    StepReport report;
    CheckFinite(args, tasks, &report);
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
  // A run of at most TaskElems elements of one unit that reads its gradients and writes its
  // weights contiguously (a unit cut at the pieces' boundaries, with StepArgs::pieces).
  struct Task {
    uint64_t offset, count;
    uint32_t group;
    const std::byte* grads;
    std::byte* params;
  };

  static std::vector<Task> Tasks(const StepArgs& args, const std::vector<Unit>& units,
                                 const SlabView& slabs, uint64_t task_elems, size_t gsize,
                                 size_t psize) {
    std::vector<Task> tasks;
    for (const Unit& u : units) {
      ForEachSegment(
          args, slabs.piece_starts, u.offset, u.count, gsize, psize,
          [&](uint64_t offset, uint64_t count, const std::byte* grads, std::byte* params) {
            for (uint64_t d = 0; d < count; d += task_elems) {
              tasks.push_back({offset + d, std::min(task_elems, count - d), u.group,
                               grads + d * gsize, params + d * psize});
            }
          });
    }
    return tasks;
  }

  void CheckFinite(const StepArgs& args, const std::vector<Task>& tasks, StepReport* report) {
    internal::NonFiniteFn check = internal::SelectNonFiniteKernel(isa_, args.grad_dtype);
    std::mutex mu;
    pool_.ParallelFor(tasks.size(), [&](size_t i) {
      const uint64_t offset = tasks[i].offset, count = tasks[i].count;
      const internal::NonFinite bad = check(tasks[i].grads, count, args.grad_scale);
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
