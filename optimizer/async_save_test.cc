// Checkpointer::SaveAsync: the checkpoint equals the state at the call bit for bit while steps
// run during the save, in both orders (the writer ahead of the steps; the steps ahead of the
// writer, which a closed gate on the store's appends holds back), with a staging pool that
// fills, FP32 and BF16 moments, 1 and 3 ranks; the steps compute exactly what they compute
// without a save. A writer that fails at any call makes Finalize fail on every rank, publishes
// nothing, and leaves the previous checkpoint and the in-memory state as they were.
#include <cerrno>
#include <cstring>
#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <thread>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "ckpt/base/status_macros.h"
#include "ckpt/optimizer/checkpointer.h"
#include "ckpt/verify.h"
#include "optimizer/checkpointer_test_job.h"
#include "tests/support/fault_injection_env.h"
#include "tests/support/status_matchers.h"

namespace ckpt::optimizer {
namespace {

using test_job::ExpectAllOk;
using test_job::Job;
using test_job::kRoot;
using testing::IsOk;
using testing::StatusIs;
using testing::ToyModel;

// Writes to files in a staging directory, but a data file's header (its first append, or its
// write at offset 0), block while the gate is closed. A test closes it before SaveAsync; each
// writer then holds its first units (it is writing them) at the gate.
class GateEnv : public EnvWrapper {
 public:
  explicit GateEnv(Env* target) : EnvWrapper(target) {}
  void Close() {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
  }
  void Open() {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = false;
    opened_.notify_all();
  }
  // Waits until writes to `n` different files (a rank's data file each) are held at the
  // closed gate: a rank's writer threads may hold several.
  void AwaitBlocked(int n) {
    std::unique_lock<std::mutex> lock(mu_);
    blocked_changed_.wait(lock, [&] { return static_cast<int>(blocked_.size()) >= n; });
  }

  absl::StatusOr<std::unique_ptr<WritableFile>> NewWritableFile(
      const std::string& path, const FileOptions& options) override {
    CKPT_ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> file,
                          target()->NewWritableFile(path, options));
    if (path.find("/.staging-") == std::string::npos) return file;
    return std::unique_ptr<WritableFile>(new Gated(this, std::move(file)));
  }

 private:
  class Gated : public WritableFile {
   public:
    Gated(GateEnv* env, std::unique_ptr<WritableFile> inner)
        : env_(env), inner_(std::move(inner)) {}
    absl::Status Append(std::span<const std::byte> data) override {
      if (appends_++ > 0) env_->WaitOpen(this);
      return inner_->Append(data);
    }
    // The store's writer threads write data files so, from offset 0 (the file header) on.
    absl::Status WriteAt(uint64_t offset, std::span<const std::byte> data) override {
      if (offset > 0) env_->WaitOpen(this);
      return inner_->WriteAt(offset, data);
    }
    absl::Status Sync() override { return inner_->Sync(); }
    absl::Status Close() override { return inner_->Close(); }
    uint64_t size() const override { return inner_->size(); }

   private:
    GateEnv* env_;
    std::unique_ptr<WritableFile> inner_;
    uint64_t appends_ = 0;
  };
  void WaitOpen(const WritableFile* file) {
    std::unique_lock<std::mutex> lock(mu_);
    if (!closed_) return;
    ++blocked_[file];
    blocked_changed_.notify_all();
    opened_.wait(lock, [&] { return !closed_; });
    if (--blocked_[file] == 0) blocked_.erase(file);
  }
  std::mutex mu_;
  std::condition_variable opened_, blocked_changed_;
  bool closed_ = false;
  std::map<const WritableFile*, int> blocked_;  // Writes held at the gate, per file.
};

enum class Order { kWriterAhead, kStepsAhead, kPoolFills };

struct Case {
  int dp;
  MomentDType moments;
  Order order;
};

std::string Name(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return absl::StrCat("Dp", c.dp, c.moments == MomentDType::kF32 ? "F32" : "Bf16",
                      c.order == Order::kWriterAhead  ? "WriterAhead"
                      : c.order == Order::kStepsAhead ? "StepsAhead"
                                                      : "PoolFills");
}

class AsyncSaveTest : public ::testing::TestWithParam<Case> {
 protected:
  AsyncSaveTest() : mem_(NewMemEnv()), gate_(mem_.get()) {}
  std::unique_ptr<Env> mem_;
  GateEnv gate_;
};

TEST_P(AsyncSaveTest, CheckpointEqualsTheStateAtTheCallWhileStepsRun) {
  const Case c = GetParam();
  // A toy rank holds a few thousand elements in units of 256 (Job's unit_bytes): three units'
  // worth of staging makes the steps wait for the writer.
  const uint64_t unit_state = 256 * (4 + 2 * MomentBytes(c.moments));
  CheckpointerOptions options;
  options.async_staging_bytes = c.order == Order::kPoolFills ? 3 * unit_state : uint64_t{1} << 30;
  std::string at_call, after_steps;
  {
    Job job(&gate_, c.dp, 300, ToyModel(), c.moments, options);
    job.Step(0);
    job.Step(1);
    at_call = job.Gather();
    if (c.order != Order::kWriterAhead) gate_.Close();
    std::vector<std::unique_ptr<PendingSave>> handles = job.SaveAsync(2);
    for (const auto& h : handles) ASSERT_NE(h, nullptr);
    if (c.order == Order::kWriterAhead) {
      for (const auto& h : handles) {
        while (!h->writer_done()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      job.Step(2);
      job.Step(3);
    } else {
      // Every writer holds its first units at the gate. Rank 0's step (Job::Step goes rank by
      // rank) copies what it can (all but those units, or what the pool holds), then waits for
      // its writer; only then does the gate open.
      gate_.AwaitBlocked(c.dp);
      std::thread steps([&] {
        job.Step(2);
        job.Step(3);
      });
      while (handles[0]->report().step_waits == 0) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      gate_.Open();
      steps.join();
    }
    after_steps = job.Gather();
    ExpectAllOk(job.Finalize(handles));
    EXPECT_EQ(job.Gather(), after_steps) << "Finalize changed the state";

    // Rank 0 steps first (Job::Step goes rank by rank), all of it while the gate is closed.
    const AsyncSaveReport& rank0 = handles[0]->report();
    uint64_t copied = 0, waits = 0;
    for (const auto& h : handles) {
      copied += h->report().units_copied;
      waits += h->report().step_waits;
    }
    switch (c.order) {
      case Order::kWriterAhead:
        EXPECT_EQ(copied, 0u);
        EXPECT_EQ(waits, 0u);
        break;
      case Order::kStepsAhead:
        // All but the units its writer held: the one it writes, and the next if it had queued
        // it by then (it queues one ahead).
        EXPECT_GE(rank0.units_copied, rank0.units - 2) << "all but the units its writer held";
        EXPECT_LE(rank0.units_copied, rank0.units - 1) << "all but the units its writer held";
        EXPECT_GT(rank0.step_waits, 0u);
        break;
      case Order::kPoolFills:
        EXPECT_GT(rank0.units_copied, 0u);
        EXPECT_LT(rank0.units_copied, rank0.units - 1) << "the pool never filled";
        EXPECT_GT(rank0.step_waits, 0u);
        break;
    }
  }  // Releases the store's LOCK.

  // The steps computed what they compute without a save in flight.
  {
    std::unique_ptr<Env> other = NewMemEnv();
    Job reference(other.get(), c.dp, 300, ToyModel(), c.moments);
    for (int s = 0; s < 4; ++s) reference.Step(s);
    EXPECT_EQ(reference.Gather(), after_steps) << "a fenced step computed something else";
  }
  // The checkpoint holds the state at the call, bit for bit, at another DP size too.
  for (int dp : {c.dp, 2}) {
    Job loaded(&gate_, dp, 500, ToyModel(), c.moments);
    std::vector<Blobs> blobs(dp);
    ExpectAllOk(loaded.OnEveryRank(
        [&](int r) -> absl::Status {
          CKPT_RETURN_IF_ERROR(loaded.rank(r).ckpt->Load(2, &blobs[r]).status());
          return loaded.WriteWeights(r);
        }));
    EXPECT_EQ(loaded.Gather(), at_call) << "loaded at DP " << dp;
    EXPECT_EQ(blobs[0].at("sched"), "at 2");
  }
  auto report = VerifyStore(&gate_, kRoot, std::nullopt, /*all=*/true);
  ASSERT_THAT(report, IsOk());
  EXPECT_TRUE(report->ok());
}

INSTANTIATE_TEST_SUITE_P(
    Orders, AsyncSaveTest,
    ::testing::Values(Case{1, MomentDType::kF32, Order::kWriterAhead},
                      Case{1, MomentDType::kF32, Order::kStepsAhead},
                      Case{1, MomentDType::kF32, Order::kPoolFills},
                      Case{3, MomentDType::kF32, Order::kWriterAhead},
                      Case{3, MomentDType::kF32, Order::kStepsAhead},
                      Case{3, MomentDType::kF32, Order::kPoolFills},
                      Case{1, MomentDType::kBF16, Order::kStepsAhead},
                      Case{1, MomentDType::kBF16, Order::kPoolFills},
                      Case{3, MomentDType::kBF16, Order::kPoolFills},
                      Case{3, MomentDType::kBF16, Order::kWriterAhead}),
    Name);

// SetMasters (a trainer's in-place edit of its parameters) while the writer is held: the edit
// passes the copy-on-write fence like a step, so the checkpoint holds the masters at the call.
TEST(AsyncSaveRulesTest, SetMastersDuringASaveLeavesTheCheckpointAtTheCall) {
  std::unique_ptr<Env> mem = NewMemEnv();
  GateEnv gate(mem.get());
  std::string at_call;
  {
    Job job(&gate, 1, 300);
    job.Step(0);
    at_call = job.Gather();
    gate.Close();
    std::vector<std::unique_ptr<PendingSave>> handles = job.SaveAsync(1);
    ASSERT_NE(handles[0], nullptr);
    gate.AwaitBlocked(1);
    StagedAdamW& opt = *job.rank(0).opt;
    std::vector<float> doubled(opt.master().begin(), opt.master().end());
    for (float& x : doubled) x *= 2;
    // Copies aside all but the units the writer holds, then waits for those.
    absl::Status set;
    std::thread edit([&] { set = opt.SetMasters(0, doubled); });
    while (handles[0]->report().step_waits == 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    gate.Open();
    edit.join();
    ASSERT_THAT(set, IsOk());
    EXPECT_EQ(opt.master()[opt.size() - 1], doubled.back());
    ExpectAllOk(job.Finalize(handles));
    EXPECT_GT(handles[0]->report().units_copied, 0u);
  }
  Job loaded(&gate, 1, 300);
  ExpectAllOk(loaded.OnEveryRank([&](int r) -> absl::Status {
    CKPT_RETURN_IF_ERROR(loaded.rank(r).ckpt->Load(1).status());
    return loaded.WriteWeights(r);
  }));
  EXPECT_EQ(loaded.Gather(), at_call);
}

// A step that skips parameters (no gradient) leaves their units to the writer: only units
// holding a stepped parameter are copied aside, and the checkpoint holds the state at the call.
TEST(AsyncSaveRulesTest, UnitsOfSkippedParametersAreNotCopiedAside) {
  std::unique_ptr<Env> mem = NewMemEnv();
  GateEnv gate(mem.get());
  std::string at_call;
  {
    Job job(&gate, 1, 300);
    job.Step(0);
    at_call = job.Gather();
    StagedAdamW& opt = *job.rank(0).opt;
    std::vector<uint8_t> only_first(opt.options().params.size(), 0);
    only_first[0] = 1;
    // The units that hold elements of parameter 0.
    uint64_t holding = 0;
    for (const Unit& u : opt.units()) {
      uint64_t at = 0;
      bool holds = false;
      for (const Piece& p : opt.options().pieces) {
        holds |= p.param == 0 && at < u.offset + u.count && u.offset < at + p.count;
        at += p.count;
      }
      holding += holds ? 1 : 0;
    }
    ASSERT_LT(holding, opt.units().size());
    gate.Close();
    std::vector<std::unique_ptr<PendingSave>> handles = job.SaveAsync(1);
    ASSERT_NE(handles[0], nullptr);
    gate.AwaitBlocked(1);
    std::thread step([&] { job.Step(1, only_first); });
    // The step may wait for a unit the writer holds; the gate opens once it has tried.
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    gate.Open();
    step.join();
    ExpectAllOk(job.Finalize(handles));
    EXPECT_LE(handles[0]->report().units_copied, holding);
  }
  Job loaded(&gate, 1, 300);
  ExpectAllOk(loaded.OnEveryRank([&](int r) -> absl::Status {
    CKPT_RETURN_IF_ERROR(loaded.rank(r).ckpt->Load(1).status());
    return loaded.WriteWeights(r);
  }));
  EXPECT_EQ(loaded.Gather(), at_call);
}

// While a save is in flight the other transactions refuse and say why; SetGroup works (the
// groups were taken at the call); a second Finalize refuses.
TEST(AsyncSaveRulesTest, OtherTransactionsRefuseWhileASaveIsInFlight) {
  std::unique_ptr<Env> mem = NewMemEnv();
  Job job(mem.get(), 2, 300);
  job.Step(0);
  ExpectAllOk(job.Save(1));
  std::vector<std::unique_ptr<PendingSave>> handles = job.SaveAsync(2);
  for (int r = 0; r < 2; ++r) {
    Checkpointer& ck = *job.rank(r).ckpt;
    absl::Status refused = ck.Save(3);
    EXPECT_THAT(refused, StatusIs(absl::StatusCode::kFailedPrecondition));
    EXPECT_THAT(std::string(refused.message()), ::testing::HasSubstr("step 2 is in flight"));
    EXPECT_THAT(ck.SaveAsync(3).status(), StatusIs(absl::StatusCode::kFailedPrecondition));
    EXPECT_THAT(ck.Load(1).status(), StatusIs(absl::StatusCode::kFailedPrecondition));
  }
  job.Step(1);  // SetGroup and Step both run.
  ExpectAllOk(job.Finalize(handles));
  for (int r = 0; r < 2; ++r) {
    EXPECT_THAT(handles[r]->Finalize(), StatusIs(absl::StatusCode::kFailedPrecondition));
  }
  ExpectAllOk(job.Save(3));
}

// Three units' worth of staging for the toy model (Job's units of 256 elements, FP32 moments):
// the steps run out of room and wait for the writer.
constexpr uint64_t kSmallPool = 3 * 256 * 12;

// The state of a fresh toy job after steps 0, 1 and 2, computed without any save.
std::string ReferenceAfterThreeSteps(int dp) {
  std::unique_ptr<Env> other = NewMemEnv();
  Job reference(other.get(), dp, 300);
  for (int s = 0; s < 3; ++s) reference.Step(s);
  return reference.Gather();
}

// A failure (ENOSPC or EIO) at every mutating call from SaveAsync to the end of the commit, in
// turn, with a pool small enough that the steps wait for the writers: Finalize fails on every
// rank with the same error naming the errno, LATEST stays, the previous step verifies, the state
// is what the steps make without a save, and the next save of the same step succeeds.
TEST(AsyncSaveFaultTest, AWriterFailureAtEveryCallFailsFinalizeOnEveryRank) {
  std::unique_ptr<Env> mem = NewMemEnv();
  testing::FaultInjectionEnv env(mem.get());
  const std::string reference = ReferenceAfterThreeSteps(2);
  {
    Job job(&env, 2, 300);
    job.Step(0);
    ExpectAllOk(job.Save(1));
  }
  int failures = 0;
  bool fired_last = true;
  for (uint64_t k = 1; fired_last; ++k) {
    const int errnum = k % 2 == 0 ? ENOSPC : EIO;
    Job job(&env, 2, 300, ToyModel(), MomentDType::kF32, {.async_staging_bytes = kSmallPool});
    auto latest = ReadLatest(&env, kRoot);
    ASSERT_THAT(latest, IsOk());
    const uint64_t previous = **latest, step = previous + 1;
    job.Step(0);
    job.Step(1);
    // Counted from here: SaveAsync's own calls (the staging directory, the data file's
    // header), then the writers' (two ranks at once, so their calls interleave differently
    // from one run to the next; the sweep still reaches every call), then the commit's.
    env.FailNth(k, errnum);
    const uint64_t calls_before = env.mutating_calls();
    std::vector<absl::Status> begun;
    std::vector<std::unique_ptr<PendingSave>> handles = job.SaveAsync(step, &begun);
    job.Step(2);
    std::vector<absl::Status> st = begun[0].ok() ? job.Finalize(handles) : begun;
    fired_last = env.mutating_calls() - calls_before >= k;
    env.Disarm();
    EXPECT_EQ(job.Gather(), reference) << "call " << k;
    if (begun[0].ok()) ExpectAllOk(begun);
    if (st[0].ok()) {
      ExpectAllOk(st);
      EXPECT_FALSE(fired_last) << "call " << k << " failed and nothing noticed";
      break;
    }
    ++failures;
    for (const absl::Status& s : st) {
      EXPECT_EQ(s.code(), st[0].code()) << "ranks disagree at call " << k;
      EXPECT_EQ(s.message(), st[0].message()) << "ranks disagree at call " << k;
    }
    EXPECT_THAT(std::string(st[0].message()), ::testing::HasSubstr(std::strerror(errnum)))
        << "call " << k;
    if (errnum == ENOSPC && absl::StrContains(st[0].message(), "append")) {
      EXPECT_EQ(st[0].code(), absl::StatusCode::kResourceExhausted) << st[0];
    }
    latest = ReadLatest(&env, kRoot);
    ASSERT_THAT(latest, IsOk());
    EXPECT_EQ(**latest, previous) << "a failed save published its step, call " << k;
    auto verified = VerifyStore(&env, kRoot, previous, /*all=*/false);
    ASSERT_THAT(verified, IsOk());
    EXPECT_TRUE(verified->ok()) << "call " << k;
    // The next save of the same step goes through.
    handles = job.SaveAsync(step);
    ExpectAllOk(job.Finalize(handles));
    ASSERT_LT(k, 3000u);
  }
  std::printf("%d injected failures failed the async save\n", failures);
  EXPECT_GT(failures, 20);
}

// A writer that fails while a step waits for it (the pool holds nothing) frees the step at
// once; Finalize then fails on every rank with the writer's error.
TEST(AsyncSaveFaultTest, AWriterFailureFreesAStepThatWaitsForIt) {
  std::unique_ptr<Env> mem = NewMemEnv();
  testing::FaultInjectionEnv fault(mem.get());
  GateEnv gate(&fault);
  const std::string reference = ReferenceAfterThreeSteps(2);
  Job job(&gate, 2, 300, ToyModel(), MomentDType::kF32, {.async_staging_bytes = 0});
  job.Step(0);
  job.Step(1);
  gate.Close();
  std::vector<std::unique_ptr<PendingSave>> handles = job.SaveAsync(2);
  gate.AwaitBlocked(2);
  std::thread step([&] { job.Step(2); });
  while (handles[0]->report().step_waits == 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  fault.FailNth(1, EIO, testing::FaultInjectionEnv::Op::kAppend);  // A held append.
  gate.Open();
  step.join();
  std::vector<absl::Status> st = job.Finalize(handles);
  for (const absl::Status& s : st) {
    EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("injected failure")) << s;
  }
  EXPECT_EQ(job.Gather(), reference);
  auto latest = ReadLatest(&gate, kRoot);
  ASSERT_THAT(latest, IsOk());
  EXPECT_FALSE(latest->has_value()) << "a failed save published its step";
}

// Ranks that own no element take part in an async save; the step loads at another DP size.
TEST(AsyncSaveRulesTest, RanksOwningNothingSaveAsynchronously) {
  std::unique_ptr<Env> mem = NewMemEnv();
  const std::vector<ParamSpec> tiny = {{"a", {3}, formats::DType::kBF16, 0},
                                       {"b", {2}, formats::DType::kBF16, 1}};
  std::string at_call;
  {
    Job job(mem.get(), 7, 5, tiny);
    job.Step(0);
    at_call = job.Gather();
    std::vector<std::unique_ptr<PendingSave>> handles = job.SaveAsync(1);
    job.Step(1);
    ExpectAllOk(job.Finalize(handles));
  }
  Job loaded(mem.get(), 2, 5, tiny);
  ExpectAllOk(loaded.Load(1));
  EXPECT_EQ(loaded.Gather(), at_call);
}

// A Checkpointer destroyed with a save in flight abandons it: nothing is published, and the
// next Open removes its staging directory.
TEST(AsyncSaveRulesTest, DestructionWithoutFinalizeAbandonsTheSave) {
  std::unique_ptr<Env> mem = NewMemEnv();
  {
    Job job(mem.get(), 1, 300);
    job.Step(0);
    ExpectAllOk(job.Save(1));
    std::vector<std::unique_ptr<PendingSave>> handles = job.SaveAsync(2);
    job.Step(1);
    handles.clear();  // Dropping the handles leaves the save in flight...
  }                   // ...until the Checkpointer goes.
  auto latest = ReadLatest(mem.get(), kRoot);
  ASSERT_THAT(latest, IsOk());
  EXPECT_EQ(**latest, 1u);
  Job reopened(mem.get(), 1, 300);
  auto names = mem->GetChildren(kRoot);
  ASSERT_THAT(names, IsOk());
  EXPECT_THAT(*names, ::testing::Not(::testing::Contains(::testing::StartsWith(".staging"))));
  EXPECT_THAT(*names, ::testing::Not(::testing::Contains(StepDirectoryName(2))));
}

}  // namespace
}  // namespace ckpt::optimizer
