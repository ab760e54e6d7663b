#include "libckpt/chunk_writer.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "ckpt/base/checksum.h"
#include "ckpt/base/coding.h"
#include "ckpt/env.h"
#include "libckpt/io_error.h"
#include "tests/support/status_matchers.h"

namespace ckpt::internal {
namespace {

using ::ckpt::testing::StatusIs;

uint64_t RoundUp(uint64_t n) {
  return (n + kWriteAtAlignment - 1) / kWriteAtAlignment * kWriteAtAlignment;
}

// A file in memory whose WriteAt can be held at a gate or made to fail at one offset, and
// which counts the writes it saw.
class TestFile : public WritableFile {
 public:
  absl::Status Append(std::span<const std::byte>) override {
    return absl::UnimplementedError("TestFile takes WriteAt only");
  }
  absl::Status WriteAt(uint64_t offset, std::span<const std::byte> data) override {
    std::unique_lock<std::mutex> lock(mu_);
    ++writes_;
    held_cv_.notify_all();
    open_cv_.wait(lock, [&] { return open_; });
    if (offset == fail_at_) return IoError(EIO, "injected write failure");
    if (bytes_.size() < offset + data.size()) bytes_.resize(offset + data.size(), '\0');
    std::memcpy(bytes_.data() + offset, data.data(), data.size());
    return absl::OkStatus();
  }
  absl::Status Sync() override { return absl::OkStatus(); }
  absl::Status Close() override { return absl::OkStatus(); }
  uint64_t size() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return bytes_.size();
  }

  void SetOpen(bool open) {
    std::lock_guard<std::mutex> lock(mu_);
    open_ = open;
    open_cv_.notify_all();
  }
  void FailAt(uint64_t offset) {
    std::lock_guard<std::mutex> lock(mu_);
    fail_at_ = offset;
  }
  void AwaitWrites(int n) {
    std::unique_lock<std::mutex> lock(mu_);
    held_cv_.wait(lock, [&] { return writes_ >= n; });
  }
  int writes() const {
    std::lock_guard<std::mutex> lock(mu_);
    return writes_;
  }
  std::string bytes() const {
    std::lock_guard<std::mutex> lock(mu_);
    return bytes_;
  }

 private:
  mutable std::mutex mu_;
  std::condition_variable open_cv_, held_cv_;
  bool open_ = true;
  uint64_t fail_at_ = UINT64_MAX;
  int writes_ = 0;
  std::string bytes_;
};

struct Expected {
  std::string file;
  std::vector<uint64_t> checksums;
};

// Queues `count` jobs of assorted sizes (some with owned bodies), laid out back to back, and
// returns what the file and the checksums must be.
Expected QueueJobs(ChunkWriter& writer, const std::vector<std::string>& bodies) {
  Expected e;
  for (size_t i = 0; i < bodies.size(); ++i) {
    ChunkWriter::Job job;
    job.offset = e.file.size();
    job.prefix = "header-" + std::to_string(i);
    job.checksum = i % 5 != 0;
    if (i % 3 == 0) {
      job.owned = bodies[i];
    } else {
      job.borrowed = AsBytes(bodies[i]);
    }
    std::string extent = job.prefix + bodies[i];
    extent.resize(RoundUp(extent.size()), '\0');
    e.checksums.push_back(job.checksum ? Checksum(AsBytes(extent)) : 0);
    e.file += extent;
    absl::StatusOr<uint64_t> n = writer.Submit(std::move(job));
    EXPECT_TRUE(n.ok()) << n.status();
    if (n.ok()) {
      EXPECT_EQ(*n, i);
    }
  }
  return e;
}

std::vector<std::string> Bodies(int count) {
  std::vector<std::string> bodies;
  for (int i = 0; i < count; ++i) {
    std::string b((i * 7919) % 50000 + (i % 4 == 0 ? 300000 : 1), '\0');
    for (size_t k = 0; k < b.size(); ++k) b[k] = static_cast<char>(k * 31 + i);
    bodies.push_back(std::move(b));
  }
  return bodies;
}

TEST(ChunkWriterTest, ManyThreadsLayOutTheFileAndChecksumsAsOneWriterWould) {
  for (int threads : {1, 3, 8}) {
    TestFile file;
    ChunkWriter writer(Env::Default(), &file, threads);
    const std::vector<std::string> bodies = Bodies(40);
    const Expected e = QueueJobs(writer, bodies);
    ASSERT_TRUE(writer.Drain().ok());
    EXPECT_TRUE(file.bytes() == e.file) << threads << " threads";
    for (size_t i = 0; i < e.checksums.size(); ++i) {
      if (e.checksums[i] != 0) {
        EXPECT_EQ(writer.checksum(i), e.checksums[i]) << "job " << i;
      }
    }
  }
}

TEST(ChunkWriterTest, ConsumedComesBeforeWrittenAndFreesTheCallersMemory) {
  TestFile file;
  ChunkWriter writer(Env::Default(), &file, 2);
  file.SetOpen(false);  // Every write is held.
  std::string body(10000, 'q');
  ChunkWriter::Job job;
  job.borrowed = AsBytes(body);
  job.checksum = true;
  ASSERT_TRUE(writer.Submit(std::move(job)).ok());
  // Copied out while its write is held: the caller may change its memory now.
  ASSERT_TRUE(writer.WaitConsumed(1).ok());
  file.AwaitWrites(1);
  body.assign(body.size(), 'X');
  std::atomic<bool> written{false};
  std::thread waiter([&] {
    EXPECT_TRUE(writer.WaitWritten(1).ok());
    written.store(true);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(written.load()) << "WaitWritten returned while the write was held";
  file.SetOpen(true);
  waiter.join();
  EXPECT_EQ(file.bytes().substr(0, 10000), std::string(10000, 'q'));
}

TEST(ChunkWriterTest, AFailedWriteIsEveryWaitsErrorAndTheQueuedJobsAreNeverRead) {
  TestFile file;
  ChunkWriter writer(Env::Default(), &file, 1);
  file.SetOpen(false);
  const std::vector<std::string> bodies = Bodies(3);  // One held by the worker, two queued.
  const Expected e = QueueJobs(writer, bodies);
  file.AwaitWrites(1);
  file.FailAt(0);  // The held write fails (EIO: kUnknown).
  file.SetOpen(true);
  EXPECT_THAT(writer.WaitConsumed(3), StatusIs(absl::StatusCode::kUnknown));
  EXPECT_EQ(file.writes(), 1) << "jobs queued behind the failure were written";
  EXPECT_THAT(writer.WaitWritten(1), StatusIs(absl::StatusCode::kUnknown));
  EXPECT_THAT(writer.Drain(), StatusIs(absl::StatusCode::kUnknown));
  ChunkWriter::Job late;
  late.offset = RoundUp(e.file.size());
  late.prefix = "late";
  EXPECT_THAT(writer.Submit(std::move(late)).status(), StatusIs(absl::StatusCode::kUnknown));
  EXPECT_EQ(file.writes(), 1) << "a write after the error was returned";
}

TEST(ChunkWriterTest, CancelSkipsTheQueueAndReturnsOnlyOnceNothingRuns) {
  TestFile file;
  ChunkWriter writer(Env::Default(), &file, 1);
  file.SetOpen(false);
  const std::vector<std::string> bodies = Bodies(3);  // One held by the worker, two queued.
  QueueJobs(writer, bodies);
  file.AwaitWrites(1);
  std::atomic<bool> cancelled{false};
  std::thread canceller([&] {
    writer.Cancel(absl::AbortedError("the save was abandoned"));
    cancelled.store(true);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(cancelled.load()) << "Cancel returned while a job still ran";
  file.SetOpen(true);
  canceller.join();
  EXPECT_EQ(file.writes(), 1) << "a queued job ran after Cancel";
  EXPECT_THAT(writer.WaitWritten(1), StatusIs(absl::StatusCode::kAborted));
  EXPECT_THAT(writer.Drain(), StatusIs(absl::StatusCode::kAborted));
}

// A batch of 200 small jobs back to back is one WriteAt, each job with its own checksum and its
// own number; a failure of that write names the first and the last of them. A batch whose jobs
// leave a gap is refused before anything is queued.
TEST(ChunkWriterTest, ABatchIsWrittenByOneWriteEachJobWithItsOwnChecksum) {
  for (bool fail : {false, true}) {
    TestFile file;
    ChunkWriter writer(Env::Default(), &file, 3);
    std::vector<std::string> bodies;
    for (int i = 0; i < 200; ++i) {
      std::string b((i * 37) % 6000 + 1, '\0');
      for (size_t k = 0; k < b.size(); ++k) b[k] = static_cast<char>(k * 13 + i);
      bodies.push_back(std::move(b));
    }
    ChunkWriter::Job header;
    header.prefix = "file header";
    ASSERT_TRUE(writer.Submit(std::move(header)).ok());
    std::string expected = std::string("file header");
    expected.resize(RoundUp(expected.size()), '\0');
    std::vector<uint64_t> sums;
    std::vector<ChunkWriter::Job> batch;
    for (size_t i = 0; i < bodies.size(); ++i) {
      ChunkWriter::Job job;
      job.offset = expected.size();
      job.prefix = "chunk-" + std::to_string(i);
      if (i % 3 == 0) {
        job.owned = bodies[i];
      } else {
        job.borrowed = AsBytes(bodies[i]);
      }
      job.checksum = true;
      job.what = "job " + std::to_string(i + 1);
      std::string extent = job.prefix + bodies[i];
      extent.resize(RoundUp(extent.size()), '\0');
      sums.push_back(Checksum(AsBytes(extent)));
      expected += extent;
      batch.push_back(std::move(job));
    }
    std::vector<ChunkWriter::Job> gap(2);
    gap[1].offset = 2 * kWriteAtAlignment;  // gap[0] is one block at 0.
    EXPECT_THAT(writer.SubmitBatch(std::move(gap)).status(),
                StatusIs(absl::StatusCode::kInvalidArgument));
    if (fail) file.FailAt(kWriteAtAlignment);
    absl::StatusOr<uint64_t> first = writer.SubmitBatch(std::move(batch));
    ASSERT_TRUE(first.ok()) << first.status();
    EXPECT_EQ(*first, 1u);
    const absl::Status drained = writer.Drain();
    EXPECT_EQ(file.writes(), 2);
    if (fail) {
      EXPECT_THAT(drained, StatusIs(absl::StatusCode::kUnknown));
      EXPECT_THAT(std::string(drained.message()),
                  ::testing::HasSubstr("job 1 (the first of 200 chunks written together, the "
                                       "last job 200)"));
      continue;
    }
    ASSERT_TRUE(drained.ok()) << drained;
    EXPECT_TRUE(file.bytes() == expected);
    for (size_t i = 0; i < sums.size(); ++i) {
      EXPECT_EQ(writer.checksum(i + 1), sums[i]) << "job " << i + 1;
    }
  }
}

TEST(ChunkWriterTest, DestructionSkipsQueuedJobsAndWaitsForRunningOnes) {
  TestFile file;
  auto writer = std::make_unique<ChunkWriter>(Env::Default(), &file, 1);
  file.SetOpen(false);
  const std::vector<std::string> bodies = Bodies(2);  // One held by the worker, one queued.
  const Expected e = QueueJobs(*writer, bodies);
  file.AwaitWrites(1);
  std::thread opener([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    file.SetOpen(true);
  });
  writer.reset();  // Waits for the held write; never starts the queued one.
  opener.join();
  EXPECT_EQ(file.writes(), 1);
  EXPECT_EQ(file.bytes(), e.file.substr(0, file.bytes().size())) << "the held write is whole";
}

}  // namespace
}  // namespace ckpt::internal
