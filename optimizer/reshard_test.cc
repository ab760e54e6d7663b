// Reshard: a step saved by 2 ranks rewritten for DP 1, 3 and 8 holds every tensor and blob of
// the source, each rank's file laid out exactly as the optimizer's own save at that DP size
// lays it out, and loads there into the same state; a step without an optimizer record
// reshards tensor by tensor; a crash at every mutating call leaves the output root as it was
// (or, past the commit, holding the new step whole); refusals write nothing.
#include "ckpt/optimizer/reshard.h"

#include <algorithm>
#include <cerrno>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "ckpt/base/coding.h"
#include "ckpt/verify.h"
#include "optimizer/checkpointer_test_job.h"
#include "tests/support/fault_injection_env.h"
#include "tests/support/status_matchers.h"

namespace ckpt::optimizer {
namespace {

using formats::DType;
using test_job::ExpectAllOk;
using test_job::Job;
using test_job::kRoot;
using testing::IsOk;
using testing::StatusIs;

constexpr uint64_t kBucket = 700;

class ReshardTest : public ::testing::Test {
 protected:
  ReshardTest() : mem_(NewMemEnv()), fault_(mem_.get()) {}

  ReshardOptions Options(int dp) {
    ReshardOptions o;
    o.dp = dp;
    o.buckets = {.bucket_elems = kBucket, .pad_to = 8};  // As the Job's own buckets.
    o.store.env = &fault_;
    o.store.chunk_bytes = 1000;
    o.buffer_bytes = 3000;  // Pieces stream in several batches.
    return o;
  }
  // Every tensor's bytes and every blob, by name (blobs by rank too).
  static std::map<std::string, std::string> Contents(const CheckpointReader& r,
                                                     bool blobs_of_rank0_only) {
    std::map<std::string, std::string> out;
    for (const formats::TensorInfo& t : r.manifest().tensors) {
      std::string bytes(t.numel() * formats::DTypeSize(t.dtype), '\0');
      EXPECT_THAT(r.ReadRange(t.name, 0, t.numel(), std::as_writable_bytes(std::span(bytes))),
                  IsOk());
      out["tensor " + t.name] = bytes;
    }
    for (const formats::BlobInfo& b : r.manifest().blobs) {
      if (blobs_of_rank0_only && b.rank != 0) continue;
      auto bytes = r.ReadBlob(b.name, b.rank);
      EXPECT_THAT(bytes, IsOk());
      if (b.name != "optimizer.layout") out[absl::StrCat("blob ", b.rank, " ", b.name)] = *bytes;
    }
    return out;
  }
  // Each rank's pieces in file order: (tensor, begin, count).
  static std::vector<std::vector<std::tuple<std::string, uint64_t, uint64_t>>> Layout(
      const CheckpointReader& r) {
    std::vector<std::vector<std::tuple<std::string, uint64_t, uint64_t>>> out(
        r.manifest().world_size);
    for (const formats::PieceInfo& p : r.manifest().pieces) {
      out[p.rank].emplace_back(r.manifest().tensors[p.tensor].name, p.begin, p.count);
    }
    return out;
  }
  // Every file under `dir`, by path, with its bytes.
  std::map<std::string, std::string> Tree(const std::string& dir) {
    std::map<std::string, std::string> out;
    auto children = mem_->GetChildren(dir);
    if (!children.ok()) return out;
    for (const std::string& c : *children) {
      const std::string path = dir + "/" + c;
      auto is_dir = mem_->IsDirectory(path);
      if (is_dir.ok() && *is_dir) {
        out[path + "/"] = "";
        for (auto& [p, b] : Tree(path)) out[p] = b;
      } else {
        auto bytes = ReadFileToString(mem_.get(), path, UINT64_MAX);
        out[path] = bytes.ok() ? *bytes : "?";
      }
    }
    return out;
  }

  std::unique_ptr<Env> mem_;
  testing::FaultInjectionEnv fault_;
};

TEST_F(ReshardTest, ToDp1And3And8LaysOutAsTheOptimizerAndLoadsThere) {
  Job saver(mem_.get(), 2, kBucket);
  for (int s = 0; s < 3; ++s) saver.Step(s);
  ExpectAllOk(saver.Save(3));
  const std::string state = saver.Gather();
  const std::unique_ptr<CheckpointReader> source = test_job::OpenStep(mem_.get(), kRoot, 3);
  const auto source_contents = Contents(*source, /*blobs_of_rank0_only=*/true);
  for (int dp : {1, 3, 8}) {
    const std::string dst = absl::StrCat("/dst", dp);
    uint64_t last = 0, total = 0;
    ReshardOptions o = Options(dp);
    o.progress = [&](uint64_t d, uint64_t t) {
      EXPECT_GT(d, last);
      last = d;
      total = t;
    };
    auto report = Reshard(*source, dst, o);
    ASSERT_THAT(report, IsOk()) << dp;
    EXPECT_EQ(report->dp, dp);
    EXPECT_EQ(report->source_world_size, 2u);
    EXPECT_TRUE(report->optimizer_layout);
    EXPECT_EQ(last, total);
    EXPECT_EQ(report->bytes, total);
    auto verified = VerifyStore(mem_.get(), dst, std::nullopt, /*all=*/true);
    ASSERT_THAT(verified, IsOk());
    EXPECT_TRUE(verified->ok()) << dp;
    const std::unique_ptr<CheckpointReader> out = test_job::OpenStep(mem_.get(), dst, 3);
    EXPECT_EQ(out->manifest().world_size, static_cast<uint32_t>(dp));
    // Every tensor equals the source; rank 0's blobs are the source's rank 0 blobs.
    EXPECT_TRUE(Contents(*out, /*blobs_of_rank0_only=*/true) == source_contents) << dp;
    for (int r = 0; r < dp; ++r) {
      auto sched = out->ReadBlob("trainer.sched", r);
      ASSERT_THAT(sched, IsOk()) << "rank " << r;
      EXPECT_EQ(*sched, "at 3");
    }
    // A job at that DP size loads it into the same state, and its own save of that state lays
    // each rank's file out exactly as the reshard did.
    Job loader(mem_.get(), dp, kBucket, testing::ToyModel(), MomentDType::kF32, {}, dst);
    ExpectAllOk(loader.Load(3));
    EXPECT_TRUE(loader.Gather() == state) << dp;
    ExpectAllOk(loader.Save(4));
    const std::unique_ptr<CheckpointReader> own = test_job::OpenStep(mem_.get(), dst, 4);
    EXPECT_EQ(Layout(*out), Layout(*own)) << dp;
  }
}

TEST_F(ReshardTest, AStepWithoutAnOptimizerRecordReshardsTensorByTensor) {
  StoreOptions so;
  so.env = mem_.get();
  auto store = CheckpointStore::Open("/plain", so);
  ASSERT_THAT(store, IsOk());
  auto txn = (*store)->BeginSave(5);
  ASSERT_THAT(txn, IsOk());
  std::vector<float> w(2500);
  for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>(i) * 0.5f;
  const int64_t ids[3] = {7, 8, 9};
  ASSERT_THAT((*txn)->DeclareTensor({"w", DType::kF32, {50, 50}}), IsOk());
  ASSERT_THAT((*txn)->DeclareTensor({"ids", DType::kI64, {3}}), IsOk());
  ASSERT_THAT((*txn)->WritePiece("w", 0, 1000, std::as_bytes(std::span(w).first(1000))), IsOk());
  ASSERT_THAT((*txn)->WritePiece("w", 1000, 1500, std::as_bytes(std::span(w).subspan(1000))),
              IsOk());
  ASSERT_THAT((*txn)->WritePiece("ids", 0, 3, std::as_bytes(std::span(ids))), IsOk());
  const std::string note = "hello";
  ASSERT_THAT((*txn)->WriteBlob("note", std::as_bytes(std::span(note))), IsOk());
  ASSERT_THAT((*txn)->Commit(), IsOk());
  auto source = (*store)->OpenStep(5);
  ASSERT_THAT(source, IsOk());
  auto report = Reshard(**source, "/plain3", Options(3));
  ASSERT_THAT(report, IsOk());
  EXPECT_FALSE(report->optimizer_layout);
  const std::unique_ptr<CheckpointReader> out = test_job::OpenStep(mem_.get(), "/plain3", 5);
  EXPECT_TRUE(Contents(*out, true) == Contents(**source, true));
  EXPECT_EQ(out->manifest().world_size, 3u);
}

TEST_F(ReshardTest, RefusalsWriteNothing) {
  Job saver(mem_.get(), 2, kBucket);
  saver.Step(0);
  ExpectAllOk(saver.Save(3));
  const std::unique_ptr<CheckpointReader> source = test_job::OpenStep(mem_.get(), kRoot, 3);
  ReshardOptions zero = Options(0);
  EXPECT_THAT(Reshard(*source, "/x", zero), StatusIs(absl::StatusCode::kInvalidArgument));
  ReshardOptions no_bucket = Options(2);
  no_bucket.buckets.bucket_elems = 0;
  EXPECT_THAT(Reshard(*source, "/x", no_bucket), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(mem_->IsDirectory("/x"), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(Reshard(*source, kRoot, Options(2)), StatusIs(absl::StatusCode::kInvalidArgument));
  ASSERT_THAT(Reshard(*source, "/y", Options(2)), IsOk());
  const auto before = Tree("/y");
  EXPECT_THAT(Reshard(*source, "/y", Options(3)),
              StatusIs(absl::StatusCode::kFailedPrecondition));  // Step 3 is there already.
  EXPECT_TRUE(Tree("/y") == before);
  // A user's directory is not a store: nothing is written beside its files.
  ASSERT_THAT(mem_->CreateDir("/mine"), IsOk());
  ASSERT_THAT(WriteFileAtomically(mem_.get(), "/mine/notes.txt", "my notes"), IsOk());
  const auto mine = Tree("/mine");
  EXPECT_THAT(Reshard(*source, "/mine", Options(2)),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_TRUE(Tree("/mine") == mine);
}

TEST_F(ReshardTest, ACrashAtEveryMutatingCallLeavesTheOutputAsItWas) {
  Job saver(mem_.get(), 2, kBucket);
  saver.Step(0);
  ExpectAllOk(saver.Save(1));
  saver.Step(1);
  ExpectAllOk(saver.Save(3));
  const std::unique_ptr<CheckpointReader> one = test_job::OpenStep(mem_.get(), kRoot, 1);
  const std::unique_ptr<CheckpointReader> three = test_job::OpenStep(mem_.get(), kRoot, 3);
  ASSERT_THAT(Reshard(*one, "/dst", Options(3)), IsOk());  // The output already holds step 1.
  const auto before = Tree("/dst");
  // A clean run's mutating calls.
  const uint64_t start = fault_.mutating_calls();
  ASSERT_THAT(Reshard(*three, "/dst", Options(3)), IsOk());
  const uint64_t calls = fault_.mutating_calls() - start;
  int old_state = 0, new_state = 0;
  for (uint64_t k = 0; k <= calls; ++k) {
    ASSERT_THAT(RemoveRecursively(mem_.get(), "/dst"), IsOk());
    ASSERT_THAT(mem_->CreateDir("/dst"), IsOk());
    for (const auto& [path, bytes] : before) {  // Parents sort before their children.
      if (path.back() == '/') {
        ASSERT_THAT(mem_->CreateDir(path.substr(0, path.size() - 1)), IsOk());
        continue;
      }
      auto file = mem_->NewWritableFile(path, FileOptions{});
      ASSERT_THAT(file, IsOk());
      ASSERT_THAT((*file)->Append(AsBytes(bytes)), IsOk());
      ASSERT_THAT((*file)->Close(), IsOk());
    }
    fault_.CrashAfter(k);
    const bool ok = Reshard(*three, "/dst", Options(3)).ok();
    EXPECT_EQ(ok, k == calls) << "crash after call " << k;  // The last call completes the run.
    ASSERT_THAT(fault_.DropUnsyncedData(), IsOk());
    // The next primary Open recovers; then the root holds step 1 as it was, or steps 1 and 3.
    StoreOptions so;
    so.env = &fault_;
    {
      auto store = CheckpointStore::Open("/dst", so);
      ASSERT_THAT(store, IsOk()) << "crash after call " << k;
      auto verified = VerifyStore(&fault_, "/dst", std::nullopt, /*all=*/true);
      ASSERT_THAT(verified, IsOk());
      EXPECT_TRUE(verified->ok()) << "crash after call " << k;
      if ((*store)->latest_step() == 1u) {
        ++old_state;
        auto steps = (*store)->ListSteps();
        ASSERT_THAT(steps, IsOk());
        // A crash between the step's rename and LATEST leaves the new step whole but
        // unpublished: recovery keeps it and reports it (docs/design/recovery.md).
        if (*steps == std::vector<uint64_t>{1, 3}) {
          EXPECT_THAT((*store)->recovery().kept, ::testing::Contains("step-00000003"));
          auto reader = (*store)->OpenStep(3);
          ASSERT_THAT(reader, IsOk());
          EXPECT_TRUE(Contents(**reader, true) == Contents(*three, true)) << "crash after " << k;
        } else {
          EXPECT_EQ(*steps, std::vector<uint64_t>{1}) << "crash after call " << k;
        }
        for (const auto& [path, bytes] : before) {
          if (path.find("step-00000001/") == std::string::npos || path.back() == '/') continue;
          auto now = ReadFileToString(mem_.get(), path, UINT64_MAX);
          EXPECT_TRUE(now.ok() && *now == bytes) << path << " changed, crash after call " << k;
        }
      } else {
        ++new_state;
        EXPECT_EQ((*store)->latest_step(), 3u) << "crash after call " << k;
        const std::unique_ptr<CheckpointReader> out = test_job::OpenStep(mem_.get(), "/dst", 3);
        EXPECT_TRUE(Contents(*out, true) == Contents(*three, true)) << "crash after call " << k;
      }
    }
  }
  std::printf("%llu crash points: %d left the output as it was, %d with the new step whole\n",
              static_cast<unsigned long long>(calls + 1), old_state, new_state);
  EXPECT_GT(old_state, 20);
  EXPECT_GT(new_state, 0);
}

// A new output root is built aside and renamed into place: a failure at any mutating call
// leaves nothing at DST and no hidden sibling. An output inside the source's root, and more
// ranks than the threads allowed, are refused before anything is written.
TEST_F(ReshardTest, ANewRootAppearsWholeOrNotAtAll) {
  Job saver(mem_.get(), 2, kBucket);
  saver.Step(0);
  ExpectAllOk(saver.Save(3));
  const std::unique_ptr<CheckpointReader> source = test_job::OpenStep(mem_.get(), kRoot, 3);
  for (const std::string& inside : {absl::StrCat(kRoot, "/", StepDirectoryName(3)),
                                   absl::StrCat(kRoot, "/sub")}) {
    EXPECT_THAT(Reshard(*source, inside, Options(2)),
                StatusIs(absl::StatusCode::kInvalidArgument)) << inside;
  }
  EXPECT_THAT(Reshard(*source, "/big", Options(kMaxReshardRanks + 1)),
              StatusIs(absl::StatusCode::kInvalidArgument));
  auto verified = VerifyStore(mem_.get(), kRoot, std::nullopt, /*all=*/true);
  ASSERT_THAT(verified, IsOk());
  EXPECT_TRUE(verified->ok()) << "a refused reshard wrote into the source";
  const uint64_t start = fault_.mutating_calls();
  ASSERT_THAT(Reshard(*source, "/probe", Options(3)), IsOk());
  const uint64_t calls = fault_.mutating_calls() - start;
  ASSERT_THAT(RemoveRecursively(mem_.get(), "/probe"), IsOk());
  auto before = mem_->GetChildren("/");
  ASSERT_THAT(before, IsOk());
  std::sort(before->begin(), before->end());
  int failed = 0;
  for (uint64_t k = 1; k <= calls; ++k) {
    fault_.FailNth(k, EIO);
    auto r = Reshard(*source, "/new", Options(3));
    fault_.Disarm();
    if (r.ok()) {  // A failure the commit survives (a best-effort removal, the last SyncDir).
      ASSERT_THAT(RemoveRecursively(mem_.get(), "/new"), IsOk());
      continue;
    }
    ++failed;
    auto after = mem_->GetChildren("/");
    ASSERT_THAT(after, IsOk());
    std::sort(after->begin(), after->end());
    EXPECT_EQ(*after, *before) << "failure at call " << k << ": " << r.status();
  }
  EXPECT_GT(failed, 20);
}

}  // namespace
}  // namespace ckpt::optimizer
