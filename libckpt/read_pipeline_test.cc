#include "libckpt/read_pipeline.h"

#include <atomic>
#include <cstring>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "libckpt/bounce_pool.h"
#include "tests/support/status_matchers.h"
#include "tests/support/thread_counting_env.h"

namespace ckpt::internal {
namespace {

using ::testing::HasSubstr;
using testing::StatusIs;

// An in-memory file whose byte i is (i * 7 + i / 4096) mod 251; reads at `fail_at` fail.
class PatternFile : public RandomAccessFile {
 public:
  explicit PatternFile(uint64_t size, uint64_t fail_at = ~uint64_t{0})
      : size_(size), fail_at_(fail_at) {}
  static std::byte At(uint64_t i) { return static_cast<std::byte>((i * 7 + i / 4096) % 251); }
  absl::Status Read(uint64_t offset, std::span<std::byte> out) const override {
    if (offset == fail_at_) return absl::DataLossError(absl::StrCat("injected at ", offset));
    if (offset + out.size() > size_) return absl::DataLossError("past the end");
    for (size_t i = 0; i < out.size(); ++i) out[i] = At(offset + i);
    return absl::OkStatus();
  }
  uint64_t size() const override { return size_; }

 private:
  uint64_t size_, fail_at_;
};

std::vector<PipelinedRead> Ranges(const RandomAccessFile* f, int n, uint64_t len) {
  std::vector<PipelinedRead> r;
  for (int i = 0; i < n; ++i) r.push_back({f, static_cast<uint64_t>(i) * len, len});
  return r;
}

class ReadPipelineTest : public ::testing::TestWithParam<int> {};

TEST_P(ReadPipelineTest, EveryRangeIsConsumedOnceWithItsOwnBytes) {
  const uint64_t big = BouncePool::ReadBuffers().buffer_bytes() + 12345;  // Own buffer.
  PatternFile f(64 * 65536 + big);
  std::vector<PipelinedRead> reads = Ranges(&f, 64, 65536);
  reads.push_back({&f, 64 * 65536, big});
  reads.push_back({&f, 5, 0});  // Empty.
  std::mutex mu;
  std::multiset<size_t> seen;
  std::atomic<int> bad{0};
  CKPT_ASSERT_OK(RunReadPipeline(Env::Default(), reads, GetParam(), [&](size_t i, std::span<const std::byte> b) {
    if (b.size() != reads[i].length) ++bad;
    for (size_t k = 0; k < b.size(); k += 997) {
      if (b[k] != PatternFile::At(reads[i].offset + k)) ++bad;
    }
    std::lock_guard<std::mutex> lock(mu);
    seen.insert(i);
    return absl::OkStatus();
  }));
  EXPECT_EQ(bad, 0);
  ASSERT_EQ(seen.size(), reads.size());
  for (size_t i = 0; i < reads.size(); ++i) EXPECT_EQ(seen.count(i), 1u) << i;
}

TEST_P(ReadPipelineTest, ReadErrorIsReturnedAndStopsTheRest) {
  PatternFile f(200 * 4096, /*fail_at=*/17 * 4096);
  std::atomic<int> consumed{0};
  absl::Status s =
      RunReadPipeline(Env::Default(), Ranges(&f, 200, 4096), GetParam(), [&](size_t, std::span<const std::byte>) {
        ++consumed;
        return absl::OkStatus();
      });
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_THAT(std::string(s.message()), HasSubstr("injected at 69632"));
  EXPECT_LT(consumed.load(), 200);
}

TEST_P(ReadPipelineTest, ConsumeErrorIsReturnedAndTheRestIsDrained) {
  PatternFile f(300 * 4096);
  std::atomic<int> consumed{0};
  absl::Status s = RunReadPipeline(Env::Default(), Ranges(&f, 300, 4096), GetParam(),
                                   [&](size_t i, std::span<const std::byte>) -> absl::Status {
                                     ++consumed;
                                     if (i == 42) return absl::DataLossError("chunk 42 is bad");
                                     return absl::OkStatus();
                                   });
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_THAT(std::string(s.message()), HasSubstr("chunk 42"));
  // One I/O thread and one worker consume in order: 0..42, then only draining. With a few
  // threads the buffer limit keeps the readers from getting far past the failure.
  if (GetParam() == 1) {
    EXPECT_EQ(consumed.load(), 43);
  }
  if (GetParam() <= 8) {
    EXPECT_LT(consumed.load(), 300);
  }
}

// The pipeline's threads are its I/O threads and the workers beyond the caller, every one
// started through the Env: min(io_threads, reads) readers and min(readers, cores) workers.
TEST_P(ReadPipelineTest, StartsItsIoThreadsAndWorkersThroughTheEnvAndNoMore) {
  testing::ThreadCountingEnv env(Env::Default());
  PatternFile f(100 * 4096);
  CKPT_ASSERT_OK(RunReadPipeline(&env, Ranges(&f, 100, 4096), GetParam(),
                                 [](size_t, std::span<const std::byte>) { return absl::OkStatus(); }));
  const int io = std::min(GetParam(), 100);
  const int workers = std::min<int>(io, std::max(1u, std::thread::hardware_concurrency()));
  EXPECT_EQ(env.started(), io + workers - 1);
  EXPECT_LE(env.peak(), io + workers - 1);
  // Fewer ranges than threads: one reader per range.
  env.Reset();
  CKPT_ASSERT_OK(RunReadPipeline(&env, Ranges(&f, 1, 4096), GetParam(),
                                 [](size_t, std::span<const std::byte>) { return absl::OkStatus(); }));
  EXPECT_EQ(env.started(), 1);
}

INSTANTIATE_TEST_SUITE_P(IoThreads, ReadPipelineTest, ::testing::Values(1, 2, 8, 64));

}  // namespace
}  // namespace ckpt::internal
