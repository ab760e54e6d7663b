// ckpt-demo-trainer: ckpt's main job end to end on a small model, with no GPU and no framework.
//
//  1. Reads a HuggingFace model (--model, or a small Llama-shaped one it writes first) by element
//     range into each data-parallel rank's StagedAdamW: Megatron-style buckets cut over --ranks
//     ranks, each rank a thread with its own store handle and Checkpointer, coordinated as a job
//     would be.
//  2. Trains toward a fixed target: loss = mean of (w - target)^2 / 2, the gradient computed from
//     the BF16 weights as a backward pass would, plus deterministic noise. The learning rate
//     follows a schedule (linear warmup, then cosine decay to --steps). Prints loss and lr.
//  3. Every --save-every steps saves through the ranks' Checkpointers, one transaction: BF16
//     weights, masters, both moments, hyper-parameters and step counters, straight from the
//     slabs, and the trainer's blobs (the schedule and the data position).
//     Saves are asynchronous (Checkpointer::SaveAsync): the next step runs while the writers
//     write, then the save is finalized; --sync-save saves synchronously instead.
//  4. With --crash-at S the process is killed with SIGKILL while the async save of step S is in
//     flight (with --sync-save: at the commit vote of the save of step S, once the ranks have
//     written their files). Run again with --resume: opening the store recovers it
//     (the unfinished save is removed), the ranks load LATEST (at any --ranks: the checkpoint
//     holds flat index ranges), the schedule comes back from its blob and training continues.
//     The final state must equal, bit for bit, that of a run that never crashed (computed in
//     the same process from the initial model). The last step is always saved, and its weights
//     are exported (optimizer::ExportHf, as `ckpt-tool export-hf` does) as safetensors that
//     transformers loads.
// --engine cuda steps every rank on StagedAdamW's CUDA engine (gradients and weights in device
// memory, state in pinned slabs) instead of the CPU engine; it is probed before anything else.
// --moments BF16 keeps the moments as BF16 in the slabs and in the checkpoint (StagedAdamW's
// precision-aware mode; F32 by default). A resumed run may keep other moments than the saved
// ones: the load converts them (FP32 rounded to BF16, BF16 widened), and then no uninterrupted
// run is its bit-exact reference, so the comparison is skipped (and says so).
// --dump-state FILE writes every rank's whole state at the end of the run (masters, moments as
// the slabs' bytes, weights, every group's step and hyper-parameters; format in demo_model.h),
// so that a resumed run and an uninterrupted one can be compared byte for byte from outside.
// Exit codes: 0 done (and equal), 1 a resumed run that differs, 2 bad usage or any error,
// 3 --engine cuda where CUDA cannot run (a build without CUDA, or no usable device).
#include <signal.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "ckpt/base/status_macros.h"
#include "ckpt/checkpoint_store.h"
#include "ckpt/coordinator.h"
#include "ckpt/env.h"
#include "ckpt/formats/float_convert.h"
#include "ckpt/hf_checkpoint.h"
#include "ckpt/optimizer/export_hf.h"
#include "ckpt/optimizer/layout.h"
#include "ckpt/optimizer/staged_adamw.h"
#include "demo/demo_model.h"

namespace ckpt::demo {
namespace {

using formats::DType;
using optimizer::Piece;
using optimizer::StagedAdamW;

// config.json and generation_config.json are small; a larger one is not a model config.
constexpr uint64_t kMaxConfigBytes = 16 << 20;

// The exit code for --engine cuda on a machine or build without CUDA.
constexpr int kExitNoEngine = 3;

struct Flags {
  std::string out, model, engine = "cpu", dump_state;
  optimizer::MomentDType moments = optimizer::MomentDType::kF32;
  int ranks = 2, steps = 12, save_every = 4, crash_at = 0;
  bool resume = false, sync_save = false;
};

constexpr const char* kUsage =
    "usage: ckpt-demo-trainer --out DIR [--model HF_DIR] [--ranks R] [--steps N] "
    "[--save-every K] [--crash-at S | --resume] [--sync-save] [--engine cpu|cuda] "
    "[--moments F32|BF16] [--dump-state FILE]\n";

absl::StatusOr<Flags> ParseFlags(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--resume") {
      f.resume = true;
      continue;
    }
    if (a == "--sync-save") {
      f.sync_save = true;
      continue;
    }
    if (i + 1 >= argc) return absl::InvalidArgumentError(absl::StrCat(a, " needs a value"));
    const std::string v = argv[++i];
    int* number = a == "--ranks"        ? &f.ranks
                  : a == "--steps"      ? &f.steps
                  : a == "--save-every" ? &f.save_every
                  : a == "--crash-at"   ? &f.crash_at
                                        : nullptr;
    if (a == "--out") {
      f.out = v;
    } else if (a == "--model") {
      f.model = v;
    } else if (a == "--engine") {
      if (v != "cpu" && v != "cuda")
        return absl::InvalidArgumentError(absl::StrCat("--engine is cpu or cuda, not \"", v, "\""));
      f.engine = v;
    } else if (a == "--moments") {
      if (v != "F32" && v != "BF16")
        return absl::InvalidArgumentError(
            absl::StrCat("--moments is F32 or BF16, not \"", v, "\""));
      f.moments = v == "F32" ? optimizer::MomentDType::kF32 : optimizer::MomentDType::kBF16;
    } else if (a == "--dump-state") {
      f.dump_state = v;
    } else if (number == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag ", a));
    } else if (!absl::SimpleAtoi(v, number) || *number < 0) {
      return absl::InvalidArgumentError(absl::StrCat(a, " wants a number, not \"", v, "\""));
    }
  }
  if (f.out.empty()) return absl::InvalidArgumentError("--out is required");
  if (f.ranks < 1 || f.steps < 1 || f.save_every < 1)
    return absl::InvalidArgumentError("--ranks, --steps and --save-every must be positive");
  if (f.crash_at > f.steps) return absl::InvalidArgumentError("--crash-at is past --steps");
  if (f.resume && f.crash_at > 0)
    return absl::InvalidArgumentError("--crash-at and --resume are two separate runs");
  return f;
}

// Runs fn(rank) on one thread per rank and returns the first error.
template <typename Fn>
absl::Status OnEveryRank(int ranks, Fn fn) {
  std::vector<absl::Status> status(ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) threads.emplace_back([&, r] { status[r] = fn(r); });
  for (std::thread& t : threads) t.join();
  for (absl::Status& s : status) CKPT_RETURN_IF_ERROR(s);
  return absl::OkStatus();
}

// Rank r's coordinator: the job's thread-group member, which --crash-at arms on rank 0 to kill
// the process at the commit vote of a save. Checkpointer::Save's collectives, in order: its
// readiness vote, the store's broadcast of the staging directory (BeginSave), the commit vote;
// broadcasts and barriers reach AllGather through Coordinator's defaults, so it is the third
// AllGather after Arm().
class DemoCoordinator : public Coordinator {
 public:
  explicit DemoCoordinator(Coordinator* inner) : inner_(inner) {}
  void ArmKillAtCommitVote(int step) {
    kill_at_ = calls_ + 3;
    step_ = step;
  }
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  absl::StatusOr<std::vector<std::string>> AllGather(absl::string_view mine) override {
    if (++calls_ == kill_at_) {
      std::printf("step %3d  save written, killed at its commit vote (SIGKILL)\n", step_);
      std::fflush(stdout);
      raise(SIGKILL);
    }
    return inner_->AllGather(mine);
  }

 private:
  Coordinator* const inner_;
  uint64_t calls_ = 0, kill_at_ = 0;
  int step_ = 0;
};

// The whole job: one DemoRank per data-parallel rank, each with its store handle (none for a
// job that never saves) and coordinator.
struct Job {
  DemoModel model;
  LrSchedule schedule;
  std::unique_ptr<ThreadGroup> group;
  std::vector<std::unique_ptr<DemoCoordinator>> coordinators;
  std::vector<std::unique_ptr<CheckpointStore>> stores;
  std::vector<std::unique_ptr<DemoRank>> ranks;
};

optimizer::EngineKind Engine(const Flags& f) {
  return f.engine == "cuda" ? optimizer::EngineKind::kCuda : optimizer::EngineKind::kCpu;
}

// Whether --engine cuda can run here at all, asked before anything else so that its answer is
// never confused with another error: a one-element CUDA-engine optimizer and device buffers.
// kUnimplemented in a build without CUDA, kFailedPrecondition without a usable device.
absl::Status ProbeEngine(const Flags& f) {
  if (Engine(f) != optimizer::EngineKind::kCuda) return absl::OkStatus();
  optimizer::StagedAdamWOptions o;
  o.params = {optimizer::ParamSpec{"probe", {1}, DType::kBF16, 0}};
  o.groups = {optimizer::ParamGroup{}};
  o.pieces = {Piece{0, 0, 1}};
  o.engine = optimizer::EngineKind::kCuda;
  const uint16_t weight[1] = {0};
  CKPT_RETURN_IF_ERROR(StagedAdamW::Create(o, std::as_bytes(std::span(weight))).status());
  return NewDeviceStep(1).status();
}

// Every rank's store handle on `root`, each opened on its rank's thread (OpenStoreOnRanks: rank
// 0's is the primary, which recovers the root before the others open theirs).
absl::StatusOr<std::vector<std::unique_ptr<CheckpointStore>>> OpenStores(const std::string& root,
                                                                         ThreadGroup& group) {
  std::vector<std::unique_ptr<CheckpointStore>> stores(static_cast<size_t>(group.size()));
  CKPT_RETURN_IF_ERROR(OnEveryRank(group.size(), [&](int r) -> absl::Status {
    CKPT_ASSIGN_OR_RETURN(stores[r], OpenStoreOnRanks(root, StoreOptions{}, group.member(r)));
    return absl::OkStatus();
  }));
  for (const std::string& removed : stores[0]->recovery().removed) {
    std::printf("recovery removed %s\n", removed.c_str());
  }
  return stores;
}

// A job on the model at `init_model`, every rank's weights read from it (or zero, for a job
// about to load a checkpoint); with a `root`, every rank saves to and loads from the store there.
absl::StatusOr<Job> NewJob(const std::string& init_model, const Flags& f, bool read_weights,
                           const std::string& root) {
  const int ranks = f.ranks;
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<HfCheckpointReader> hf,
                        HfCheckpointReader::Open(init_model));
  Job job;
  CKPT_ASSIGN_OR_RETURN(job.model, DemoModel::FromHf(*hf, ranks, Engine(f), f.moments));
  job.schedule.total = f.steps;
  job.schedule.warmup = std::max(1, f.steps / 6);
  job.group = std::make_unique<ThreadGroup>(ranks);
  if (!root.empty()) {
    CKPT_ASSIGN_OR_RETURN(job.stores, OpenStores(root, *job.group));
  }
  for (int r = 0; r < ranks; ++r) {
    job.coordinators.push_back(std::make_unique<DemoCoordinator>(job.group->member(r)));
    std::vector<uint16_t> w(job.model.elements_of(r));
    if (read_weights) {
      CKPT_ASSIGN_OR_RETURN(w, job.model.ReadHfWeights(*hf, r));
    }
    CheckpointStore* store = root.empty() ? nullptr : job.stores[r].get();
    absl::StatusOr<std::unique_ptr<DemoRank>> rank =
        DemoRank::Create(job.model, r, std::move(w), store, job.coordinators[r].get());
    if (!rank.ok()) return rank.status();
    job.ranks.push_back(*std::move(rank));
  }
  return job;
}

// Steps from `first` to `last` inclusive; saves every `save_every` steps when the job has
// stores, asynchronously unless --sync-save (the next step runs during the save, which is then
// finalized); at `crash_at` the process is killed during the save.
absl::Status Train(Job& job, int first, int last, const Flags& f, bool verbose) {
  const int n = static_cast<int>(job.ranks.size());
  std::vector<std::unique_ptr<optimizer::PendingSave>> pending;  // Per rank, while in flight.
  auto finalize = [&](int during) -> absl::Status {
    if (pending.empty()) return absl::OkStatus();
    const uint64_t saved = pending[0]->step();
    CKPT_RETURN_IF_ERROR(OnEveryRank(n, [&](int r) { return pending[r]->Finalize(); }));
    pending.clear();
    if (verbose && during > 0) {
      std::printf("step %3llu  async save committed (step %d ran while it was written)\n",
                  static_cast<unsigned long long>(saved), during);
    } else if (verbose) {
      std::printf("step %3llu  async save committed\n", static_cast<unsigned long long>(saved));
    }
    return absl::OkStatus();
  };
  for (int step = first; step <= last; ++step) {
    const double lr = job.schedule.At(step);
    std::vector<double> loss(n);
    CKPT_RETURN_IF_ERROR(OnEveryRank(n, [&](int r) -> absl::Status {
      CKPT_ASSIGN_OR_RETURN(loss[r], job.ranks[r]->Step(job.model, step, lr));
      return absl::OkStatus();
    }));
    double total = 0;
    for (double l : loss) total += l;
    if (verbose)
      std::printf("step %3d  loss %.6e  lr %.3e\n", step, total / job.model.elements(), lr);
    CKPT_RETURN_IF_ERROR(finalize(step));
    const bool crash = step == f.crash_at;
    // The last step is always saved: the export reads it.
    if (job.stores.empty() || (step % f.save_every != 0 && !crash && step != last)) continue;
    const optimizer::Blobs blobs = {{kScheduleBlob, job.schedule.Encode()},
                                    {kPositionBlob, absl::StrCat("next_step ", step + 1)}};
    const std::string what = absl::StrFormat(
        "weights, masters, %s moments, hyper-parameters and steps of %llu parameters from %d "
        "ranks; lr schedule; next_step %d",
        f.moments == optimizer::MomentDType::kF32 ? "F32" : "BF16",
        static_cast<unsigned long long>(job.model.elements()), n, step + 1);
    if (f.sync_save) {
      if (crash) job.coordinators[0]->ArmKillAtCommitVote(step);
      CKPT_RETURN_IF_ERROR(OnEveryRank(
          n, [&](int r) { return job.ranks[r]->Save(static_cast<uint64_t>(step), blobs); }));
      if (verbose) std::printf("step %3d  saved: %s\n", step, what.c_str());
      continue;
    }
    pending.resize(n);
    CKPT_RETURN_IF_ERROR(OnEveryRank(n, [&](int r) -> absl::Status {
      CKPT_ASSIGN_OR_RETURN(pending[r], job.ranks[r]->SaveAsync(static_cast<uint64_t>(step), blobs));
      return absl::OkStatus();
    }));
    if (verbose) std::printf("step %3d  async save begun: %s\n", step, what.c_str());
    if (crash) {
      std::printf("step %3d  killed while its async save was in flight (SIGKILL)\n", step);
      std::fflush(stdout);
      raise(SIGKILL);
    }
  }
  return finalize(0);
}

// Loads LATEST into every rank of `job` and the schedule from its blob; returns the step to
// continue with. Sets *converted when the checkpoint's moments had another dtype.
absl::StatusOr<int> Resume(Job& job, const Flags& f, bool* converted) {
  const int n = static_cast<int>(job.ranks.size());
  std::vector<optimizer::Blobs> blobs(n);
  std::vector<optimizer::LoadReport> reports(n);
  CKPT_RETURN_IF_ERROR(OnEveryRank(n, [&](int r) -> absl::Status {
    CKPT_ASSIGN_OR_RETURN(reports[r], job.ranks[r]->Load(&blobs[r]));
    return absl::OkStatus();
  }));
  const optimizer::LoadReport& report = reports[0];
  for (const char* key : {kScheduleBlob, kPositionBlob}) {
    if (!blobs[0].count(key))
      return absl::DataLossError(absl::StrCat("step ", report.step, " has no blob ", key));
  }
  CKPT_ASSIGN_OR_RETURN(job.schedule, LrSchedule::Decode(blobs[0][kScheduleBlob]));
  int next = 0;
  if (!absl::SimpleAtoi(absl::StripPrefix(blobs[0][kPositionBlob], "next_step "), &next) ||
      next != static_cast<int>(report.step) + 1) {
    return absl::DataLossError(absl::StrCat("step ", report.step, ": blob ", kPositionBlob,
                                            " holds \"", blobs[0][kPositionBlob], "\""));
  }
  const DType want = f.moments == optimizer::MomentDType::kF32 ? DType::kF32 : DType::kBF16;
  *converted = report.saved_moment_dtype != want;
  std::printf("resumed from step %llu (LATEST): saved by %u ranks, loaded on %d; %s moments%s; "
              "lr schedule from the checkpoint: %s; next_step %d\n",
              static_cast<unsigned long long>(report.step), report.saved_world_size, n,
              std::string(formats::DTypeName(report.saved_moment_dtype)).c_str(),
              *converted ? absl::StrCat(" converted to ", formats::DTypeName(want)).c_str() : "",
              job.schedule.Describe().c_str(), next);
  return next;
}

absl::Status Run(const Flags& f, bool* equal) {
  const std::string init_model = f.model.empty() ? f.out + "/init-model" : f.model;
  const std::string root = f.out + "/store";
  if (!f.resume) {
    Env* env = Env::Default();
    absl::StatusOr<bool> exists = env->IsDirectory(f.out);
    if (!exists.ok() || !*exists) CKPT_RETURN_IF_ERROR(env->CreateDir(f.out));
    if (f.model.empty()) CKPT_RETURN_IF_ERROR(WriteSmallModel(init_model));
  }
  CKPT_ASSIGN_OR_RETURN(Job job, NewJob(init_model, f, /*read_weights=*/!f.resume, root));
  int first = 1;
  bool converted = false;
  if (f.resume) {
    CKPT_ASSIGN_OR_RETURN(first, Resume(job, f, &converted));
  } else {
    std::printf("model %s: %zu tensors, %llu parameters over %d ranks, %s engine, %s moments\n",
                init_model.c_str(), job.model.params().size(),
                static_cast<unsigned long long>(job.model.elements()), f.ranks, f.engine.c_str(),
                f.moments == optimizer::MomentDType::kF32 ? "F32" : "BF16");
    std::printf("lr schedule: %s\n", job.schedule.Describe().c_str());
  }
  CKPT_RETURN_IF_ERROR(Train(job, first, f.steps, f, /*verbose=*/true));
  if (f.resume && converted) {
    std::printf("the moments were converted on load: no uninterrupted run is a bit-exact "
                "reference, not compared\n");
  } else if (f.resume) {
    // The same job without a crash, from the initial model, never saved.
    CKPT_ASSIGN_OR_RETURN(Job reference, NewJob(init_model, f, /*read_weights=*/true, ""));
    reference.schedule = job.schedule;
    CKPT_RETURN_IF_ERROR(Train(reference, 1, f.steps, f, /*verbose=*/false));
    *equal = true;
    for (int r = 0; r < f.ranks; ++r)
      *equal = *equal && job.ranks[r]->SameState(*reference.ranks[r]);
    std::printf("resumed run %s an uninterrupted one bit for bit (weights, masters, moments, "
                "hyper-parameters, steps)\n",
                *equal ? "equals" : "DIFFERS FROM");
  }
  if (!f.dump_state.empty()) {
    CKPT_RETURN_IF_ERROR(WriteFileAtomically(Env::Default(), f.dump_state, DumpState(job.ranks)));
    std::printf("state dumped to %s\n", f.dump_state.c_str());
  }
  const std::string final_model = f.out + "/final-model";
  // The last step's checkpoint, exported by the library function behind ckpt-tool export-hf;
  // with the model's config beside the weights, transformers' from_pretrained loads the result.
  // Exported beside final-model first: a resume of a run that already exported replaces its
  // own earlier export only once the new one is whole (two renames; a crash between leaves
  // both whole under hidden names, and no half export under final-model).
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> last, job.stores[0]->OpenLatest());
  optimizer::ExportHfOptions export_options;
  if (ReadFileToString(Env::Default(), init_model + "/config.json", kMaxConfigBytes).ok()) {
    export_options.config = init_model + "/config.json";
  }
  const std::string fresh = absl::StrCat(f.out, "/.final-model-new-", getpid());
  const std::string replaced = absl::StrCat(f.out, "/.final-model-replaced-", getpid());
  CKPT_RETURN_IF_ERROR(optimizer::ExportHf(*last, fresh, export_options).status());
  absl::StatusOr<std::string> generation =
      ReadFileToString(Env::Default(), init_model + "/generation_config.json", kMaxConfigBytes);
  if (generation.ok()) {
    CKPT_RETURN_IF_ERROR(
        WriteFileAtomically(Env::Default(), fresh + "/generation_config.json", *generation));
  }
  Env* env = Env::Default();
  const bool had_export = env->IsDirectory(final_model).ok();
  if (had_export) CKPT_RETURN_IF_ERROR(env->RenameFile(final_model, replaced));
  CKPT_RETURN_IF_ERROR(env->RenameFile(fresh, final_model));
  CKPT_RETURN_IF_ERROR(env->SyncDir(f.out));
  if (had_export) CKPT_RETURN_IF_ERROR(RemoveRecursively(env, replaced));
  std::printf("exported step %llu to %s\n", static_cast<unsigned long long>(last->step()),
              final_model.c_str());
  return absl::OkStatus();
}

}  // namespace
}  // namespace ckpt::demo

int main(int argc, char** argv) {
  absl::StatusOr<ckpt::demo::Flags> flags = ckpt::demo::ParseFlags(argc, argv);
  if (!flags.ok()) {
    std::fprintf(stderr, "ckpt-demo-trainer: %s\n%s", std::string(flags.status().message()).c_str(),
                 ckpt::demo::kUsage);
    return 2;
  }
  absl::Status engine = ckpt::demo::ProbeEngine(*flags);
  if (absl::IsUnimplemented(engine) || absl::IsFailedPrecondition(engine)) {
    std::fprintf(stderr, "ckpt-demo-trainer: --engine %s cannot run here: %s\n",
                 flags->engine.c_str(), engine.ToString().c_str());
    return ckpt::demo::kExitNoEngine;
  }
  if (!engine.ok()) {
    std::fprintf(stderr, "ckpt-demo-trainer: %s\n", engine.ToString().c_str());
    return 2;
  }
  bool equal = true;
  absl::Status s = ckpt::demo::Run(*flags, &equal);
  if (!s.ok()) {
    std::fprintf(stderr, "ckpt-demo-trainer: %s\n", s.ToString().c_str());
    return 2;
  }
  return equal ? 0 : 1;
}
