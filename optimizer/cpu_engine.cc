// The CPU engine: units cut into tasks of at most TaskElems(elements, threads) elements, spread
// over a fixed pool of threads, each task one fused pass of the kernel chosen for the CPU at run
// time.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <map>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "ckpt/formats/convert.h"
#include "optimizer/cpu_kernels.h"
#include "optimizer/engine.h"
#include "optimizer/rules/muon/muon.h"
#include "optimizer/thread_pool.h"

namespace ckpt::optimizer {
namespace {

using internal::KernelArgs;

size_t ElementBytes(formats::DType d) { return formats::DTypeSize(d); }

class CpuEngine : public internal::Engine {
 public:
  CpuEngine(int threads, CpuIsa isa) : isa_(isa), pool_(threads) {}

  absl::StatusOr<StepReport> Step(const StepArgs& args, const std::vector<Unit>& units,
                                  const StepPlan& plan, const SlabView& slabs,
                                  uint64_t elements) override {
    // One kernel per model dtype the pieces have, with AMSGrad off and on.
    internal::KernelFn kernels[2][3] = {};
    for (int ams = 0; ams < (slabs.max_exp_avg_sq != nullptr ? 2 : 1); ++ams) {
      for (formats::DType d : slabs.piece_dtypes) {
        internal::KernelFn& k = kernels[ams][KernelIndex(d)];
        if (k == nullptr) {
          k = internal::SelectKernel(isa_, args.grad_dtype, d, slabs.moment_dtype, ams == 1);
        }
        if (k == nullptr) return absl::InvalidArgumentError("unsupported grad or model dtype");
      }
    }
    const uint64_t task_elems = internal::TaskElems(elements, pool_.size());
    const size_t gsize = ElementBytes(args.grad_dtype);
    StepReport report;
    if (args.check_finite) {
      CheckFinite(args, Tasks(args, units, plan, slabs, task_elems, gsize), &report);
      if (report.nonfinite > 0) {
        report.skipped = true;
        return report;
      }
    }
    // Out of place, skipped runs make tasks too: their state is copied across. Parameters kept
    // whole (Muon's matrices) are stepped after the elementwise units.
    std::vector<Unit> elementwise, matrices;
    for (const Unit& u : units) (u.rows == 0 ? elementwise : matrices).push_back(u);
    if (!matrices.empty() && slabs.out_of_place()) {
      // BeginOverlap refuses.
      return absl::InternalError("an out-of-place pass over parameters kept whole");
    }
    const std::vector<Task> tasks =
        Tasks(args, elementwise, plan, slabs, task_elems, gsize, slabs.out_of_place());
    const size_t msize = MomentBytes(slabs.moment_dtype);
    pool_.ParallelFor(tasks.size(), [&](size_t i) {
      const Task& t = tasks[i];
      const bool has_max = slabs.max_exp_avg_sq != nullptr;
      if (t.constants == StepPlan::kSkipped) {
        CopyAcross(slabs, t.offset, t.count, msize, has_max);
        return;
      }
      const StepConstants& c = plan.constants[t.constants];
      // A group without amsgrad leaves max_exp_avg_sq alone (zero, as torch keeps none).
      const bool ams = c.amsgrad && has_max;
      if (!ams && has_max && slabs.out_of_place()) {
        std::memcpy(slabs.max_exp_avg_sq_out + t.offset * msize,
                    slabs.max_exp_avg_sq + t.offset * msize, t.count * msize);
      }
      KernelArgs a{slabs.dest_master() + t.offset,
                   slabs.dest_exp_avg() + t.offset * msize,
                   slabs.dest_exp_avg_sq() + t.offset * msize,
                   ams ? slabs.dest_max_exp_avg_sq() + t.offset * msize : nullptr,
                   t.grads,
                   t.params,
                   t.count,
                   args.grad_scale,
                   c,
                   slabs.master + t.offset,
                   slabs.exp_avg + t.offset * msize,
                   slabs.exp_avg_sq + t.offset * msize,
                   ams ? slabs.max_exp_avg_sq + t.offset * msize : nullptr};
      kernels[ams ? 1 : 0][KernelIndex(t.dtype)](a);
    }, Participants());
    StepMatrices(args, matrices, plan, slabs, gsize);
    return report;
  }

  absl::StatusOr<StepReport> CheckFinite(const StepArgs& args, const std::vector<Unit>& units,
                                         const StepPlan& plan, const SlabView& slabs,
                                         uint64_t elements) override {
    const std::vector<Task> tasks =
        Tasks(args, units, plan, slabs, internal::TaskElems(elements, pool_.size()),
              ElementBytes(args.grad_dtype));
    StepReport report;
    CheckFinite(args, tasks, &report);
    report.skipped = report.nonfinite > 0;
    return report;
  }

  absl::Status WriteWeights(const SlabView& slabs, const std::vector<Unit>& units,
                            const StepArgs& dest,
                            const std::optional<CudaStreamView>& stream) override {
    (void)stream;  // Host memory only.
    uint64_t elements = 0;
    for (const Unit& u : units) elements += u.count;
    StepPlan every;  // Every piece, at constants 0 (not read).
    every.piece_constants.assign(slabs.piece_dtypes.size(), 0);
    const std::vector<Task> tasks =
        Tasks(dest, units, every, slabs, internal::TaskElems(elements, pool_.size()), 0);
    pool_.ParallelFor(tasks.size(), [&](size_t i) {
      const Task& t = tasks[i];
      const size_t psize = ElementBytes(t.dtype);
      formats::Convert(formats::DType::kF32,
                       std::as_bytes(std::span(slabs.master + t.offset, t.count)), t.dtype,
                       std::span(t.params, t.count * psize));
    }, Participants());
    return absl::OkStatus();
  }

  void SetSpareCores(int cores) override { spare_ = cores; }

  std::string name() const override {
    return absl::StrCat("cpu-", internal::IsaName(isa_), "-x", pool_.size());
  }

 private:
  // A run of at most TaskElems elements of one unit that reads its gradients and writes its
  // weights contiguously, with one entry of the step's plan and one model dtype
  // (ForEachSegment); skipped pieces make none (but see Tasks' `with_skipped`).
  struct Task {
    uint64_t offset, count;
    uint32_t constants;  // Index into StepPlan::constants.
    formats::DType dtype;
    const std::byte* grads;
    std::byte* params;
  };

  static size_t KernelIndex(formats::DType d) {
    return d == formats::DType::kF32 ? 0 : d == formats::DType::kBF16 ? 1 : 2;
  }

  // An out-of-place pass's copy of a skipped run: its state as it is, into the destination.
  static void CopyAcross(const SlabView& slabs, uint64_t offset, uint64_t count, size_t msize,
                         bool has_max) {
    std::memcpy(slabs.master_out + offset, slabs.master + offset, count * 4);
    std::memcpy(slabs.exp_avg_out + offset * msize, slabs.exp_avg + offset * msize,
                count * msize);
    std::memcpy(slabs.exp_avg_sq_out + offset * msize, slabs.exp_avg_sq + offset * msize,
                count * msize);
    if (has_max) {
      std::memcpy(slabs.max_exp_avg_sq_out + offset * msize,
                  slabs.max_exp_avg_sq + offset * msize, count * msize);
    }
  }

  // `with_skipped`: skipped runs make tasks too (constants kSkipped, no buffers).
  static std::vector<Task> Tasks(const StepArgs& args, const std::vector<Unit>& units,
                                 const StepPlan& plan, const SlabView& slabs,
                                 uint64_t task_elems, size_t gsize, bool with_skipped = false) {
    std::vector<Task> tasks;
    for (const Unit& u : units) {
      ForEachSegment(
          args, slabs, plan, u.offset, u.count, gsize,
          [&](uint64_t offset, uint64_t count, const std::byte* grads, std::byte* params,
              uint32_t c, formats::DType dtype) {
            if (c == StepPlan::kSkipped) {
              if (with_skipped) tasks.push_back({offset, count, c, dtype, nullptr, nullptr});
              return;
            }
            const size_t psize = ElementBytes(dtype);
            for (uint64_t d = 0; d < count; d += task_elems) {
              tasks.push_back({offset + d, std::min(task_elems, count - d), c, dtype,
                               grads == nullptr ? nullptr : grads + d * gsize,
                               params == nullptr ? nullptr : params + d * psize});
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

  // The units of parameters kept whole (Muon's matrices, Adafactor's tensors), one after
  // another, each by its rule's kernel: the elementwise passes on the pool; Muon's products on
  // OpenBLAS's threads, as many as the step's own (the cores left to an async save's writer
  // stay free).
  void StepMatrices(const StepArgs& args, const std::vector<Unit>& matrices, const StepPlan& plan,
                    const SlabView& slabs, size_t gsize) {
    if (matrices.empty()) return;
    const int before = internal::SetBlasThreads(Participants());
    const size_t msize = MomentBytes(slabs.moment_dtype);
    const internal::ParallelFor parallel = [this](size_t count,
                                                  const std::function<void(size_t)>& fn) {
      pool_.ParallelFor(count, fn, Participants());
    };
    for (const Unit& u : matrices) {
      // A whole parameter's unit is its one piece.
      const std::span<const uint64_t> starts = slabs.piece_starts;
      size_t k = static_cast<size_t>(std::lower_bound(starts.begin(), starts.end() - 1, u.offset) -
                                     starts.begin());
      while (starts[k + 1] == starts[k]) ++k;  // Past empty pieces at the same offset.
      ForEachSegment(args, slabs, plan, u.offset, u.count, gsize,
                     [&](uint64_t offset, uint64_t count, const std::byte* grads, std::byte* params,
                         uint32_t c, formats::DType dtype) {
                       if (c == StepPlan::kSkipped) return;
                       const StepConstants& constants = plan.constants[c];
                       const internal::UpdateRule& rule = *constants.rule;
                       const internal::WholeParamStep w{
                           slabs.master + offset,
                           slabs.exp_avg + offset * msize,
                           slabs.aux == nullptr ? nullptr : slabs.aux + slabs.piece_aux[k],
                           slabs.moment_dtype,
                           grads,
                           args.grad_dtype,
                           args.grad_scale,
                           params,
                           dtype,
                           slabs.params[slabs.pieces[k].param].shape,
                           u.rows,
                           count};
                       rule.StepWholeCpu(w, constants, Scratch(rule), parallel);
                     });
    }
    internal::SetBlasThreads(before);
  }

  // The scratch of `rule`'s kernel, made at its first use.
  internal::CpuScratch* Scratch(const internal::UpdateRule& rule) {
    std::unique_ptr<internal::CpuScratch>& s = scratch_[rule.algorithm()];
    if (s == nullptr) s = rule.NewCpuScratch();
    return s.get();
  }

  // Threads a step runs on: the pool, less the cores it leaves spare (at least one).
  int Participants() const { return std::max(1, pool_.size() - spare_); }

  const CpuIsa isa_;
  internal::ThreadPool pool_;
  std::map<Algorithm, std::unique_ptr<internal::CpuScratch>> scratch_;
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
