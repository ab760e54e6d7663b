#include "ckpt/checkpoint_store.h"

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <condition_variable>
#include <map>
#include <mutex>
#include <thread>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "ckpt/base/coding.h"
#include "ckpt/base/status_macros.h"
#include "ckpt/verify.h"
#include "libckpt/filename.h"
#include "tests/support/fault_injection_env.h"
#include "tests/support/thread_counting_env.h"
#include "tests/support/status_matchers.h"
#include "tests/support/synthetic_state.h"
#include "tests/support/tensor_gen.h"

namespace ckpt {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using testing::IsOk;
using testing::StatusIs;

constexpr char kRoot[] = "/store";

class StoreTest : public ::testing::Test {
 protected:
  StoreTest() : env_(NewMemEnv()) {
    options_.env = env_.get();
    options_.chunk_bytes = 1000;  // Small chunks: pieces span several.
  }
  std::unique_ptr<CheckpointStore> Open(bool primary = true) {
    StoreOptions o = options_;
    o.primary = primary;
    auto store = CheckpointStore::Open(kRoot, o);
    EXPECT_THAT(store, IsOk());
    return store.ok() ? std::move(store).value() : nullptr;
  }
  // Runs fn(rank, coordinator, store) on `ranks` threads; returns each rank's status.
  std::vector<absl::Status> RunRanks(
      int ranks, const std::function<absl::Status(int, Coordinator*, CheckpointStore*)>& fn) {
    std::vector<std::unique_ptr<CheckpointStore>> stores;
    for (int r = 0; r < ranks; ++r) stores.push_back(Open(r == 0));
    ThreadGroup group(ranks);
    std::vector<absl::Status> out(static_cast<size_t>(ranks));
    std::vector<std::thread> threads;
    for (int r = 0; r < ranks; ++r) {
      threads.emplace_back([&, r] { out[r] = fn(r, group.member(r), stores[r].get()); });
    }
    for (auto& t : threads) t.join();
    return out;
  }
  std::unique_ptr<Env> env_;
  StoreOptions options_;
};

TEST_F(StoreTest, RangeReadsCrossRankBoundariesAndChunks) {
  const uint64_t n = 10007;
  std::vector<float> w = testing::RandomFloats(n, 1);
  auto results = RunRanks(3, [&](int r, Coordinator* c, CheckpointStore* s) -> absl::Status {
    CKPT_ASSIGN_OR_RETURN(auto txn, s->BeginSave(5, c));
    CKPT_RETURN_IF_ERROR(txn->DeclareTensor({"w", formats::DType::kF32, {n}}));
    uint64_t lo = n * r / 3, hi = n * (r + 1) / 3;
    CKPT_RETURN_IF_ERROR(
        txn->WritePiece("w", lo, hi - lo, std::as_bytes(std::span(w).subspan(lo, hi - lo))));
    return txn->Commit();
  });
  for (const auto& s : results) CKPT_ASSERT_OK(s);
  auto store = Open();
  EXPECT_EQ(store->latest_step(), std::optional<uint64_t>(5));
  auto reader = store->OpenLatest();
  CKPT_ASSERT_OK(reader);
  EXPECT_EQ((*reader)->manifest().world_size, 3u);
  for (auto [begin, count] : std::vector<std::pair<uint64_t, uint64_t>>{
           {0, n}, {3330, 20}, {6669, 1}, {249, 751}, {n - 1, 1}}) {
    std::vector<float> out(count);
    CKPT_ASSERT_OK((*reader)->ReadRange("w", begin, count, std::as_writable_bytes(std::span(out))));
    EXPECT_TRUE(std::equal(out.begin(), out.end(), w.begin() + begin)) << begin << "+" << count;
  }
}

// A step of many tensors, each cut into pieces that ranks wrote out of order, some with a piece
// nobody wrote: every lookup (a tensor by name, the pieces of a range, coverage) answers as the
// pieces say, for ranges read one at a time and all at once.
TEST_F(StoreTest, ManyTensorsOfPiecesOutOfOrderReadAndCoverAsTheirPiecesSay) {
  constexpr int kRanks = 3, kTensors = 120, kPieces = 7;
  auto size_of = [](int t) { return static_cast<uint64_t>(50 + 37 * t); };
  auto cut = [&](int t, int k) { return size_of(t) * static_cast<uint64_t>(k) / kPieces; };
  auto has_gap = [](int t) { return t % 10 == 0; };  // Piece 3 of these is never written.
  std::vector<std::vector<float>> w;
  for (int t = 0; t < kTensors; ++t) w.push_back(testing::RandomFloats(size_of(t), t + 1));
  auto results = RunRanks(kRanks, [&](int r, Coordinator* c, CheckpointStore* s) -> absl::Status {
    CKPT_ASSIGN_OR_RETURN(auto txn, s->BeginSave(3, c));
    for (int t = kTensors - 1; t >= 0; --t) {
      CKPT_RETURN_IF_ERROR(
          txn->DeclareTensor({absl::StrCat("t", t), formats::DType::kF32, {size_of(t)}}));
    }
    for (int k = kPieces - 1; k >= 0; --k) {  // Later pieces first: the manifest is unordered.
      for (int t = 0; t < kTensors; ++t) {
        if (k % kRanks != r || (has_gap(t) && k == 3)) continue;
        const uint64_t lo = cut(t, k), hi = cut(t, k + 1);
        CKPT_RETURN_IF_ERROR(txn->WritePiece(
            absl::StrCat("t", t), lo, hi - lo,
            std::as_bytes(std::span(w[static_cast<size_t>(t)]).subspan(lo, hi - lo))));
      }
    }
    return txn->Commit();
  });
  for (const auto& s : results) CKPT_ASSERT_OK(s);
  auto reader = Open()->OpenLatest();
  CKPT_ASSERT_OK(reader);
  const CheckpointReader& rd = **reader;
  EXPECT_THAT(rd.FindTensor("t120"), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_FALSE(rd.Covers("t120", 0, 1));
  std::vector<CheckpointReader::RangeRead> ranges;
  std::vector<std::vector<float>> outs(kTensors);
  for (int t = 0; t < kTensors; ++t) {
    const std::string name = absl::StrCat("t", t);
    const uint64_t n = size_of(t), gap_lo = cut(t, 3), gap_hi = cut(t, 4);
    auto info = rd.FindTensor(name);
    CKPT_ASSERT_OK(info);
    EXPECT_EQ((*info)->name, name);
    EXPECT_EQ((*info)->numel(), n);
    EXPECT_EQ(rd.Covers(name, 0, n), !has_gap(t)) << name;
    EXPECT_TRUE(rd.Covers(name, 0, gap_lo)) << name;
    EXPECT_TRUE(rd.Covers(name, gap_hi, n - gap_hi)) << name;
    EXPECT_EQ(rd.Covers(name, gap_lo - 1, 2), !has_gap(t)) << name;
    EXPECT_EQ(rd.Covers(name, gap_lo, 1), !has_gap(t)) << name;  // Starting in the hole.
    EXPECT_EQ(rd.Covers(name, gap_hi - 1, 1), !has_gap(t)) << name;
    EXPECT_TRUE(rd.Covers(name, cut(t, 5) + 1, 1)) << name;  // Inside a later piece.
    EXPECT_TRUE(rd.Covers(name, n, 0)) << name;
    EXPECT_FALSE(rd.Covers(name, n - 1, 2)) << name;  // Past the end.
    EXPECT_FALSE(rd.Covers(name, 1, UINT64_MAX)) << name;  // Its end would wrap.
    // One range crossing every written piece boundary but the gap, read in one pipeline.
    const uint64_t begin = has_gap(t) ? gap_hi : 1;
    outs[static_cast<size_t>(t)].resize(n - begin - 1);
    ranges.push_back({name, begin, n - begin - 1,
                      std::as_writable_bytes(std::span(outs[static_cast<size_t>(t)]))});
    if (has_gap(t)) {
      std::vector<float> out(gap_hi - gap_lo + 2);
      EXPECT_THAT(
          rd.ReadRange(name, gap_lo - 1, out.size(), std::as_writable_bytes(std::span(out))),
          testing::StatusIsWith(absl::StatusCode::kNotFound,
                                absl::StrCat("no piece holds element ", gap_lo, " of \"", name)));
    }
  }
  CKPT_ASSERT_OK(rd.ReadRanges(ranges));
  for (int t = 0; t < kTensors; ++t) {
    const auto& out = outs[static_cast<size_t>(t)];
    const uint64_t begin = has_gap(t) ? cut(t, 4) : 1;
    EXPECT_TRUE(std::equal(out.begin(), out.end(), w[static_cast<size_t>(t)].begin() +
                                                       static_cast<ptrdiff_t>(begin)))
        << "t" << t;
  }
}

// Every thread of a save, a read and retention starts through the store's Env, and each part
// starts no more than its option says: write_threads writers per save, read_threads I/O
// threads and at most as many workers per read, one remover per store.
TEST_F(StoreTest, EachPartStartsTheThreadsItsOptionSaysThroughTheEnv) {
  testing::ThreadCountingEnv counting(env_.get());
  options_.env = &counting;
  options_.write_threads = 3;
  options_.read_threads = 2;
  options_.retention.keep_last = 1;
  options_.chunk_bytes = 1 << 20;
  // 5 chunks of 1 MiB, a read each (reads merge only chunks of at most 256 KiB): at least as
  // many as the reader threads asked for.
  const uint64_t n = 5 * (1 << 20) / 4;
  std::vector<float> w(n, 0.5f);
  auto store = Open();
  for (uint64_t step : {1, 2}) {
    counting.Reset();
    auto txn = store->BeginSave(step);
    CKPT_ASSERT_OK(txn);
    CKPT_ASSERT_OK((*txn)->DeclareTensor({"w", formats::DType::kF32, {n}}));
    CKPT_ASSERT_OK((*txn)->WritePiece("w", 0, n, testing::Bytes(w)));
    CKPT_ASSERT_OK((*txn)->Commit());
    store->WaitForRemovals();
    // The second commit retires step 1: the remover is started then, once.
    EXPECT_EQ(counting.started(), step == 1 ? 3 : 4) << "step " << step;
  }
  counting.Reset();
  auto reader = store->OpenLatest();
  CKPT_ASSERT_OK(reader);
  std::vector<float> out(n);
  CKPT_ASSERT_OK((*reader)->ReadRange("w", 0, n, std::as_writable_bytes(std::span(out))));
  EXPECT_EQ(out, w);
  const int workers = std::min(2, static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  EXPECT_EQ(counting.started(), 2 + workers - 1);
}

TEST_F(StoreTest, ZstdChunksRoundTripAndStaySmaller) {
  options_.codec = formats::Codec::kZstd;
  std::vector<float> w(50000, 1.5f);
  auto store = Open();
  auto txn = store->BeginSave(1);
  CKPT_ASSERT_OK(txn);
  CKPT_ASSERT_OK((*txn)->DeclareTensor({"w", formats::DType::kF32, {50000}}));
  CKPT_ASSERT_OK((*txn)->WritePiece("w", 0, 50000, testing::Bytes(w)));
  CKPT_ASSERT_OK((*txn)->Commit());
  auto reader = store->OpenLatest();
  CKPT_ASSERT_OK(reader);
  uint64_t stored = 0;
  for (const auto& c : (*reader)->manifest().files[0].chunks) {
    EXPECT_EQ(c.codec, formats::Codec::kZstd);
    stored += c.stored_bytes;
  }
  EXPECT_LT(stored, 50000u * 4 / 10);
  std::vector<float> out(50000);
  CKPT_ASSERT_OK((*reader)->ReadRange("w", 0, 50000, std::as_writable_bytes(std::span(out))));
  EXPECT_EQ(out, w);
}

TEST_F(StoreTest, EveryWriterThreadCountWritesTheSameBytes) {
  // The writer threads build and write chunks in any order; the files must not show it. Raw
  // and zstd chunks (some of which stay raw), pieces, a blob, 2 ranks.
  for (formats::Codec codec : {formats::Codec::kRaw, formats::Codec::kZstd}) {
    std::map<std::string, std::string> first;
    for (int threads : {1, 2, 7}) {
      const std::string root = absl::StrCat("/threads-", static_cast<int>(codec), "-", threads);
      StoreOptions o = options_;
      o.codec = codec;
      o.write_threads = threads;
      CKPT_ASSERT_OK(testing::SaveSyntheticStep(root, o, 2, 3));
      std::map<std::string, std::string> files;
      const std::string step = JoinPath(root, internal::StepDirName(3));
      auto names = env_->GetChildren(step);
      CKPT_ASSERT_OK(names);
      for (const std::string& name : *names) {
        auto bytes = ReadFileToString(env_.get(), JoinPath(step, name), uint64_t{1} << 30);
        CKPT_ASSERT_OK(bytes);
        files[name] = *std::move(bytes);
      }
      EXPECT_EQ(files.size(), 3u);  // Two data files and the MANIFEST.
      if (first.empty()) {
        first = files;
      } else {
        EXPECT_TRUE(files == first) << threads << " writer threads wrote other bytes";
      }
      auto report = VerifyStore(env_.get(), root, std::nullopt, /*all=*/true);
      CKPT_ASSERT_OK(report);
      EXPECT_TRUE(report->ok()) << root;
    }
  }
}

TEST_F(StoreTest, AFailedChunkWriteNamesItsOwnTensorAndOffset) {
  // The writer threads report an error wherever the caller happens to be; the message must
  // name the chunk that failed, not the piece being queued then. One thread: the file header
  // is the first write, "a" the second (a chunk of 400 KB, too large to be gathered with b's:
  // ManySmallChunksAreWrittenInFewWrites names a batch's chunks).
  testing::FaultInjectionEnv fault(env_.get());
  options_.env = &fault;
  options_.write_threads = 1;
  options_.chunk_bytes = 1 << 20;
  auto store = Open();
  auto txn = store->BeginSave(1);
  CKPT_ASSERT_OK(txn);
  const uint64_t n = 100000;
  std::vector<float> w(n, 1.0f);
  CKPT_ASSERT_OK((*txn)->DeclareTensor({"a", formats::DType::kF32, {n}}));
  CKPT_ASSERT_OK((*txn)->DeclareTensor({"b", formats::DType::kF32, {n}}));
  fault.FailNth(2, EIO, testing::FaultInjectionEnv::Op::kAppend);
  // Whichever call sees the failure (a's own, b's, or the commit) reports a's chunk.
  std::vector<absl::Status> seen = {(*txn)->WritePiece("a", 0, n, testing::Bytes(w)),
                                    (*txn)->WritePiece("b", 0, n, testing::Bytes(w)),
                                    (*txn)->Commit()};
  EXPECT_THAT(seen.back(), StatusIs(absl::StatusCode::kUnknown));
  for (const absl::Status& s : seen) {
    if (s.ok()) continue;
    EXPECT_THAT(std::string(s.message()), HasSubstr("tensor a: "));
    EXPECT_THAT(std::string(s.message()), HasSubstr("at offset 4096"));
    EXPECT_THAT(std::string(s.message()), ::testing::Not(HasSubstr("tensor b")));
  }
}

// Small pieces are gathered without waiting for the writer; a write that failed meanwhile must
// fail the next piece (naming the chunk that failed), not the flush of a batch 4 MiB later. One
// thread: the header is the first write, "big" (400 KB, queued alone) the second, which fails.
// Before the failure lands, small pieces succeed; the writer has seconds to land it, far less
// than the 1024 pieces of 4 KiB that would fill a batch and report it anyway.
TEST_F(StoreTest, AWriteThatFailedFailsTheNextSmallPiece) {
  testing::FaultInjectionEnv fault(env_.get());
  options_.env = &fault;
  options_.write_threads = 1;
  options_.chunk_bytes = 1 << 20;
  auto store = Open();
  auto txn = store->BeginSave(1);
  CKPT_ASSERT_OK(txn);
  std::vector<float> big(100000, 1.0f), small(100, 2.0f);
  CKPT_ASSERT_OK((*txn)->DeclareTensor({"big", formats::DType::kF32, {big.size()}}));
  fault.FailNth(2, EIO, testing::FaultInjectionEnv::Op::kAppend);
  // Queued, not waited for: the failure lands while the small pieces are being written.
  absl::Status failed = (*txn)->stream().Queue("big", 0, big.size(), testing::Bytes(big)).status();
  size_t pieces = 0;
  for (; pieces < 1000 && failed.ok(); ++pieces) {
    const std::string name = absl::StrCat("s", pieces);
    CKPT_ASSERT_OK((*txn)->DeclareTensor({name, formats::DType::kF32, {small.size()}}));
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    failed = (*txn)->WritePiece(name, 0, small.size(), testing::Bytes(small));
  }
  EXPECT_LT(pieces, 1000u) << "no small piece reported the failed write";
  EXPECT_THAT(failed, StatusIs(absl::StatusCode::kUnknown));
  EXPECT_THAT(std::string(failed.message()), HasSubstr("save step 1 tensor big"));
  EXPECT_THAT((*txn)->Commit(), StatusIs(absl::StatusCode::kUnknown));
  EXPECT_EQ(store->latest_step(), std::nullopt);
}

// 3000 tensors of 100 floats: their chunks (one 4 KiB extent each) reach the data file in
// writes of up to 4 MiB, not one write each, whether queued without a wait between them (step 1)
// or written by WritePiece from one buffer the caller refills at once (step 2: small chunks are
// copied as they are gathered). Where the batches end depends on the calls only: both saves make
// the same number of calls. A failed write of a batch (step 3) names its first and last chunk.
TEST_F(StoreTest, ManySmallChunksAreWrittenInFewWrites) {
  testing::FaultInjectionEnv fault(env_.get());
  options_.env = &fault;
  auto store = Open();
  constexpr size_t kTensors = 3000;
  auto value = [](uint64_t step, size_t t, size_t i) {
    return static_cast<float>(step * 1e6 + t * 100 + i);
  };
  std::vector<std::vector<float>> queued(kTensors, std::vector<float>(100));
  uint64_t calls[2] = {0, 0};
  for (uint64_t step : {1, 2}) {
    const uint64_t before = fault.mutating_calls();
    auto txn = store->BeginSave(step);
    CKPT_ASSERT_OK(txn);
    std::vector<float> reused(100);
    for (size_t t = 0; t < kTensors; ++t) {
      const std::string name = absl::StrCat("t", t);
      CKPT_ASSERT_OK((*txn)->DeclareTensor({name, formats::DType::kF32, {100}}));
      if (step == 1) {
        for (size_t i = 0; i < 100; ++i) queued[t][i] = value(step, t, i);
        CKPT_ASSERT_OK((*txn)->stream().Queue(name, 0, 100, testing::Bytes(queued[t])).status());
      } else {
        for (size_t i = 0; i < 100; ++i) reused[i] = value(step, t, i);
        CKPT_ASSERT_OK((*txn)->WritePiece(name, 0, 100, testing::Bytes(reused)));
      }
    }
    CKPT_ASSERT_OK((*txn)->Commit());
    calls[step - 1] = fault.mutating_calls() - before;
    auto reader = store->OpenLatest();
    CKPT_ASSERT_OK(reader);
    std::vector<float> out(100);
    for (size_t t = 0; t < kTensors; ++t) {
      CKPT_ASSERT_OK((*reader)->ReadRange(absl::StrCat("t", t), 0, 100,
                                          std::as_writable_bytes(std::span(out))));
      for (size_t i = 0; i < 100; ++i) ASSERT_EQ(out[i], value(step, t, i)) << t;
    }
  }
  // 12 MiB of chunks in writes of 4 MiB; the header, the part, MANIFEST, LATEST, their syncs,
  // renames and removals make the rest.
  EXPECT_LT(calls[0], 40u);
  EXPECT_EQ(calls[0], calls[1]);
  // One writer thread: the file header is the first write, the first batch the second.
  options_.write_threads = 1;
  store.reset();
  store = Open();
  auto txn = store->BeginSave(3);
  CKPT_ASSERT_OK(txn);
  fault.FailNth(2, EIO, testing::FaultInjectionEnv::Op::kAppend);
  absl::Status failed;
  for (size_t t = 0; t < kTensors && failed.ok(); ++t) {
    const std::string name = absl::StrCat("t", t);
    CKPT_ASSERT_OK((*txn)->DeclareTensor({name, formats::DType::kF32, {100}}));
    failed = (*txn)->WritePiece(name, 0, 100, testing::Bytes(queued[t]));
  }
  if (failed.ok()) failed = (*txn)->Commit();
  EXPECT_THAT(failed, StatusIs(absl::StatusCode::kUnknown));
  EXPECT_THAT(std::string(failed.message()),
              HasSubstr("save step 3 tensor t0 (the first of 1024 chunks written together, the "
                        "last save step 3 tensor t1023)"));
  EXPECT_EQ(store->latest_step(), 2u);
}

// A name must be UTF-8 (a manifest is JSON): other bytes are refused when declared, not
// written as something else, and the error shows them escaped (its message stays UTF-8).
TEST_F(StoreTest, NamesThatAreNoUtf8AreRefusedWithTheBytesEscaped) {
  auto store = Open();
  auto txn = store->BeginSave(1);
  CKPT_ASSERT_OK(txn);
  absl::Status refused = (*txn)->DeclareTensor({"bad\xff", formats::DType::kF32, {1}});
  EXPECT_THAT(refused, StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(std::string(refused.message()), HasSubstr("invalid tensor name \"bad\\xff\""));
  refused = (*txn)->WriteBlob("caf\xe9", AsBytes("x"));
  EXPECT_THAT(std::string(refused.message()), HasSubstr("invalid blob name \"caf\\xe9\""));
  CKPT_ASSERT_OK((*txn)->DeclareTensor({"caf\xc3\xa9", formats::DType::kF32, {1}}));
}

TEST_F(StoreTest, AbortAndDestructionWithoutCommitLeaveNoTrace) {
  auto store = Open();
  {
    auto txn = store->BeginSave(1);
    CKPT_ASSERT_OK(txn);
    CKPT_ASSERT_OK((*txn)->WriteBlob("x", AsBytes("payload")));
    CKPT_ASSERT_OK((*txn)->Abort());
  }
  { CKPT_ASSERT_OK(store->BeginSave(2)); }  // Destroyed at once.
  EXPECT_THAT(*env_->GetChildren(kRoot), ElementsAre("LOCK"));
  EXPECT_EQ(store->latest_step(), std::nullopt);
  EXPECT_THAT(store->OpenLatest(), StatusIs(absl::StatusCode::kNotFound));
}

TEST_F(StoreTest, StepMustBeNewerThanLatestOnEveryRank) {
  CKPT_ASSERT_OK(testing::SaveSyntheticStep(kRoot, options_, 2, 10));
  auto results = RunRanks(
      2, [&](int, Coordinator* c, CheckpointStore* s) { return s->BeginSave(10, c).status(); });
  for (const auto& s : results) EXPECT_THAT(s, StatusIs(absl::StatusCode::kFailedPrecondition));
}

TEST_F(StoreTest, SecondPrimaryHandleIsRefused) {
  auto first = Open();
  EXPECT_THAT(CheckpointStore::Open(kRoot, options_),
              StatusIs(absl::StatusCode::kFailedPrecondition));
}

TEST_F(StoreTest, ConflictingDeclarationsAbortOnEveryRank) {
  auto results = RunRanks(2, [&](int r, Coordinator* c, CheckpointStore* s) -> absl::Status {
    CKPT_ASSIGN_OR_RETURN(auto txn, s->BeginSave(1, c));
    CKPT_RETURN_IF_ERROR(txn->DeclareTensor({"w", formats::DType::kF32, {r == 0 ? 8u : 9u}}));
    return txn->Commit();
  });
  for (const auto& s : results) {
    EXPECT_THAT(s, StatusIs(absl::StatusCode::kInvalidArgument));
    EXPECT_THAT(std::string(s.message()), HasSubstr("\"w\""));
  }
  EXPECT_EQ(Open()->latest_step(), std::nullopt);
}

TEST_F(StoreTest, OverlappingPiecesAcrossRanksAbort) {
  std::vector<float> w(10, 1.0f);
  auto results = RunRanks(2, [&](int, Coordinator* c, CheckpointStore* s) -> absl::Status {
    CKPT_ASSIGN_OR_RETURN(auto txn, s->BeginSave(1, c));
    CKPT_RETURN_IF_ERROR(txn->DeclareTensor({"w", formats::DType::kF32, {10}}));
    CKPT_RETURN_IF_ERROR(txn->WritePiece("w", 0, 10, testing::Bytes(w)));  // Both ranks: all of it.
    return txn->Commit();
  });
  for (const auto& s : results) EXPECT_THAT(s, StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST_F(StoreTest, IoFailureOnOneRankAbortsEveryRank) {
  testing::FaultInjectionEnv fault(env_.get());
  options_.env = &fault;
  fault.FailNth(2, ENOSPC, testing::FaultInjectionEnv::Op::kSync);     // One rank's data file sync.
  absl::Status s = testing::SaveSyntheticStep(kRoot, options_, 2, 1);  // Checks ranks agree.
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kResourceExhausted));
  EXPECT_THAT(std::string(s.message()), HasSubstr("voted no"));
  options_.env = env_.get();
  EXPECT_EQ(Open()->latest_step(), std::nullopt);
}

// One rank's whole save of `step`: a small tensor, committed.
absl::Status SaveOne(CheckpointStore& store, uint64_t step) {
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<SaveTransaction> txn, store.BeginSave(step));
  CKPT_RETURN_IF_ERROR(txn->DeclareTensor({"t", formats::DType::kF32, {4}}));
  const float v[4] = {1, 2, 3, static_cast<float>(step)};
  CKPT_RETURN_IF_ERROR(txn->WritePiece("t", 0, 4, std::as_bytes(std::span(v))));
  return txn->Commit();
}

// The commit's SyncDir calls: the staging directory (step 6), the root after the rename
// (step 7), the root after LATEST's rename (step 8), then the restore's.
constexpr uint64_t kLatestSyncDir = 3;

// A failed SyncDir after the new LATEST is renamed into place: neither committed nor abandoned
// until the previous LATEST is back, durably; then the step is abandoned and removed.
TEST_F(StoreTest, AFailedSyncOfTheNewLatestPutsThePreviousOneBack) {
  testing::FaultInjectionEnv fault(env_.get());
  options_.env = &fault;
  auto store = Open();
  ASSERT_THAT(SaveOne(*store, 1), IsOk());
  fault.FailNth(kLatestSyncDir, EIO, testing::FaultInjectionEnv::Op::kSyncDir);
  absl::Status s = SaveOne(*store, 2);
  EXPECT_THAT(std::string(s.message()), HasSubstr("the previous LATEST is back")) << s;
  EXPECT_EQ(store->latest_step(), 1u);
  auto on_disk = ReadLatest(&fault, kRoot);
  ASSERT_THAT(on_disk, IsOk());
  EXPECT_EQ(*on_disk, 1u);
  EXPECT_FALSE(fault.IsDirectory(absl::StrCat(kRoot, "/", StepDirectoryName(2))).ok());
  EXPECT_THAT(SaveOne(*store, 2), IsOk());  // Nothing is left in the way.
}

// When the previous LATEST cannot be put back either, LATEST may name the new step: it stays,
// this handle refuses further saves (a retry must not remove it), and a reopened store's
// recovery decides.
TEST_F(StoreTest, WhenThePreviousLatestCannotBePutBackTheStepStaysAndSavesAreRefused) {
  testing::FaultInjectionEnv fault(env_.get());
  options_.env = &fault;
  auto store = Open();
  ASSERT_THAT(SaveOne(*store, 1), IsOk());
  fault.FailNth(kLatestSyncDir, EIO, testing::FaultInjectionEnv::Op::kSyncDir);
  fault.FailNth(kLatestSyncDir + 1, EIO, testing::FaultInjectionEnv::Op::kSyncDir);
  absl::Status s = SaveOne(*store, 2);
  EXPECT_THAT(std::string(s.message()), HasSubstr("nor the previous one put back")) << s;
  EXPECT_THAT(fault.IsDirectory(absl::StrCat(kRoot, "/", StepDirectoryName(2))), IsOk());
  absl::Status again = SaveOne(*store, 2);
  EXPECT_THAT(again, StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(std::string(again.message()), HasSubstr("reopen the store"));
  EXPECT_THAT(fault.IsDirectory(absl::StrCat(kRoot, "/", StepDirectoryName(2))), IsOk());
  store.reset();
  auto reopened = Open();
  ASSERT_NE(reopened, nullptr);
  ASSERT_TRUE(reopened->latest_step().has_value());
  auto reader = reopened->OpenLatest();
  EXPECT_THAT(reader, IsOk()) << "LATEST names a step that is gone";
}

TEST_F(StoreTest, BadArgumentsAreRefusedAndTheTransactionStaysUsable) {
  auto store = Open();
  auto txn = store->BeginSave(1);
  CKPT_ASSERT_OK(txn);
  std::vector<float> w(4);
  EXPECT_THAT((*txn)->DeclareTensor({"a/b", formats::DType::kF32, {4}}),
              StatusIs(absl::StatusCode::kInvalidArgument));
  CKPT_ASSERT_OK((*txn)->DeclareTensor({"w", formats::DType::kF32, {4}}));
  EXPECT_THAT((*txn)->DeclareTensor({"w", formats::DType::kF32, {4}}),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT((*txn)->WritePiece("v", 0, 4, testing::Bytes(w)),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT((*txn)->WritePiece("w", 2, 4, testing::Bytes(w)),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT((*txn)->WritePiece("w", 0, 3, testing::Bytes(w)),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT((*txn)->WritePiece("w", 0, 0, {}), StatusIs(absl::StatusCode::kInvalidArgument));
  CKPT_ASSERT_OK((*txn)->WritePiece("w", 0, 2, std::as_bytes(std::span(w).first(2))));
  EXPECT_THAT((*txn)->WritePiece("w", 1, 2, std::as_bytes(std::span(w).first(2))),
              StatusIs(absl::StatusCode::kInvalidArgument));
  CKPT_ASSERT_OK((*txn)->Commit());
  EXPECT_THAT((*txn)->Commit(), StatusIs(absl::StatusCode::kFailedPrecondition));
  auto reader = store->OpenLatest();
  CKPT_ASSERT_OK(reader);
  std::vector<float> out(4);
  EXPECT_THAT((*reader)->ReadRange("w", 0, 4, std::as_writable_bytes(std::span(out))),
              StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT((*reader)->ReadRange("nope", 0, 1, std::as_writable_bytes(std::span(out).first(1))),
              StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT((*reader)->ReadRange("w", 0, 2, std::as_writable_bytes(std::span(out))),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT((*reader)->ReadRange("w", 3, 2, std::as_writable_bytes(std::span(out).first(2))),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT((*reader)->ReadBlob("nope"), StatusIs(absl::StatusCode::kNotFound));
}

TEST_F(StoreTest, DamagedLatestFallsBackAndQuarantinesNewerStepsWithoutDeletingThem) {
  for (uint64_t step : {1, 2, 3})
    CKPT_ASSERT_OK(testing::SaveSyntheticStep(kRoot, options_, 1, step));
  // Break step 3's MANIFEST and LATEST: recovery must pick step 2 and rewrite LATEST.
  auto manifest = ReadFileToString(env_.get(), "/store/step-00000003/MANIFEST", UINT64_MAX);
  CKPT_ASSERT_OK(manifest);
  (*manifest)[50] ^= 1;
  CKPT_ASSERT_OK(WriteFileAtomically(env_.get(), "/store/step-00000003/MANIFEST", *manifest));
  CKPT_ASSERT_OK(WriteFileAtomically(env_.get(), "/store/LATEST", "garbage"));
  auto store = Open();
  EXPECT_TRUE(store->recovery().latest_repaired);
  EXPECT_EQ(store->latest_step(), std::optional<uint64_t>(2));
  // Step 3 is newer than the new LATEST, but proven damaged, not proven unpublished: it is
  // moved aside whole, never deleted.
  EXPECT_THAT(store->recovery().removed, ElementsAre());
  ASSERT_EQ(store->recovery().quarantined.size(), 1u);
  auto quarantined = store->ListQuarantine();
  CKPT_ASSERT_OK(quarantined);
  ASSERT_EQ(quarantined->size(), 1u);
  auto kept = ReadFileToString(env_.get(), "/store/quarantine/" + (*quarantined)[0] + "/MANIFEST",
                               UINT64_MAX);
  CKPT_ASSERT_OK(kept);
  EXPECT_EQ(*kept, *manifest);
  store.reset();
  auto state = testing::CheckStoreConsistent(kRoot, options_);
  CKPT_ASSERT_OK(state);
  EXPECT_EQ(*state, std::optional<uint64_t>(2));
}

TEST_F(StoreTest, RetentionKeepsLastKEveryNthAndLatest) {
  for (uint64_t step = 1; step <= 7; ++step)
    CKPT_ASSERT_OK(testing::SaveSyntheticStep(kRoot, options_, 1, step));
  auto store = Open();
  auto dry = store->ApplyRetention({.keep_last = 2, .keep_every = 3}, /*dry_run=*/true);
  CKPT_ASSERT_OK(dry);
  EXPECT_THAT(StepsOf(*dry, RecoveryAction::Kind::kRemove), ElementsAre(1, 2, 4, 5));
  EXPECT_THAT(*store->ListSteps(), ElementsAre(1, 2, 3, 4, 5, 6, 7));
  CKPT_ASSERT_OK(store->ApplyRetention({.keep_last = 2, .keep_every = 3}));
  EXPECT_THAT(*store->ListSteps(), ElementsAre(3, 6, 7));
}

TEST_F(StoreTest, RetentionKeepOnlyKeepsExactlyTheNamedStepsAndLatest) {
  for (uint64_t step = 1; step <= 6; ++step)
    CKPT_ASSERT_OK(testing::SaveSyntheticStep(kRoot, options_, 1, step));
  auto store = Open();
  RetentionPolicy policy{.keep_last = 1, .keep_every = 1, .keep_only = std::vector<uint64_t>{2, 4, 9}};
  auto dry = store->ApplyRetention(policy, /*dry_run=*/true);
  CKPT_ASSERT_OK(dry);
  EXPECT_THAT(StepsOf(*dry, RecoveryAction::Kind::kRemove), ElementsAre(1, 3, 5))
      << "keep_only overrides keep_last and keep_every";
  CKPT_ASSERT_OK(store->ApplyRetention(policy));
  EXPECT_THAT(*store->ListSteps(), ElementsAre(2, 4, 6)) << "LATEST always stays";
  CKPT_ASSERT_OK(store->ApplyRetention({.keep_only = std::vector<uint64_t>{}}));
  EXPECT_THAT(*store->ListSteps(), ElementsAre(6));
}

TEST_F(StoreTest, RetentionRunsAfterEachCommitWhenConfigured) {
  options_.retention = {.keep_last = 2};
  for (uint64_t step = 1; step <= 4; ++step)
    CKPT_ASSERT_OK(testing::SaveSyntheticStep(kRoot, options_, 2, step));
  EXPECT_THAT(*Open()->ListSteps(), ElementsAre(3, 4));
}

// Removals of files in retired steps (.deleting-*) block while the gate is closed.
class RemoveGateEnv : public EnvWrapper {
 public:
  explicit RemoveGateEnv(Env* target) : EnvWrapper(target) {}
  void SetOpen(bool open) {
    std::lock_guard<std::mutex> lock(mu_);
    open_ = open;
    cv_.notify_all();
  }
  void AwaitHeld() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return held_ > 0; });
  }
  absl::Status RemoveFile(const std::string& path) override {
    if (path.find("/.deleting-") != std::string::npos) {
      std::unique_lock<std::mutex> lock(mu_);
      ++held_;
      cv_.notify_all();
      cv_.wait(lock, [&] { return open_; });
      --held_;
    }
    return target()->RemoveFile(path);
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = true;
  int held_ = 0;
};

TEST_F(StoreTest, ACommitRetiresOldStepsAndLeavesTheirRemovalToTheBackground) {
  RemoveGateEnv gate(env_.get());
  options_.env = &gate;
  options_.retention = {.keep_last = 1};
  auto store = Open();
  auto save = [&](uint64_t step) {
    auto txn = store->BeginSave(step);
    CKPT_ASSERT_OK(txn);
    std::vector<float> w(3000, static_cast<float>(step));
    CKPT_ASSERT_OK((*txn)->DeclareTensor({"w", formats::DType::kF32, {3000}}));
    CKPT_ASSERT_OK((*txn)->WritePiece("w", 0, 3000, testing::Bytes(w)));
    CKPT_ASSERT_OK((*txn)->Commit());
  };
  save(1);
  gate.SetOpen(false);
  // Committing step 2 retires step 1: renamed away at once; its files stay until the gate opens.
  save(2);
  gate.AwaitHeld();
  EXPECT_THAT(*store->ListSteps(), ElementsAre(2));
  auto entries = env_->GetChildren(kRoot);
  CKPT_ASSERT_OK(entries);
  EXPECT_TRUE(std::any_of(entries->begin(), entries->end(), [](const std::string& e) {
    return absl::StartsWith(e, ".deleting-");
  })) << "the retired step is not waiting for removal";
  // The next save does not wait either.
  save(3);
  gate.SetOpen(true);
  store->WaitForRemovals();
  entries = env_->GetChildren(kRoot);
  CKPT_ASSERT_OK(entries);
  for (const std::string& e : *entries) EXPECT_FALSE(absl::StartsWith(e, ".deleting-")) << e;
  EXPECT_THAT(*store->ListSteps(), ElementsAre(3));
  auto report = VerifyStore(env_.get(), kRoot, std::nullopt, /*all=*/true);
  CKPT_ASSERT_OK(report);
  EXPECT_TRUE(report->ok());
}

TEST(ThreadGroupTest, AllGatherDeliversEveryRoundInOrder) {
  ThreadGroup group(4);
  std::vector<std::thread> threads;
  std::vector<int> failures(4, 0);
  for (int r = 0; r < 4; ++r) {
    threads.emplace_back([&, r] {
      for (int round = 0; round < 200; ++round) {
        auto all = group.member(r)->AllGather(std::to_string(round * 10 + r));
        for (int k = 0; k < 4; ++k) {
          if (!all.ok() || (*all)[k] != std::to_string(round * 10 + k)) ++failures[r];
        }
        auto b = group.member(r)->Broadcast(r == 2 ? "from2" : "", 2);
        if (!b.ok() || *b != "from2") ++failures[r];
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_THAT(failures, ElementsAre(0, 0, 0, 0));
}

}  // namespace
}  // namespace ckpt
