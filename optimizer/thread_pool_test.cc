#include "optimizer/thread_pool.h"

#include <atomic>
#include <cstddef>
#include <memory>
#include <chrono>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

namespace ckpt::optimizer::internal {
namespace {

constexpr int kThreadCounts[] = {1, 2, 8};
constexpr size_t kTaskCounts[] = {0, 1, 2, 7, 1000};

class ThreadPoolTest : public ::testing::Test {
 protected:
  // Runs ParallelFor(count) on `pool` and returns how often each index ran.
  static std::vector<int> RunCounts(ThreadPool& pool, size_t count) {
    std::unique_ptr<std::atomic<int>[]> hits(new std::atomic<int>[count]());
    pool.ParallelFor(count, [&](size_t i) { hits[i].fetch_add(1); });
    std::vector<int> out(count);
    for (size_t i = 0; i < count; ++i) out[i] = hits[i].load();
    return out;
  }
};

TEST_F(ThreadPoolTest, SizeCountsTheCallingThread) {
  for (int threads : kThreadCounts) EXPECT_EQ(ThreadPool(threads).size(), threads);
}

TEST_F(ThreadPoolTest, EveryIndexRunsExactlyOnce) {
  for (int threads : kThreadCounts) {
    ThreadPool pool(threads);
    for (size_t count : kTaskCounts) {
      EXPECT_EQ(RunCounts(pool, count), std::vector<int>(count, 1))
          << threads << " threads, " << count << " tasks";
    }
  }
}

TEST_F(ThreadPoolTest, ReturnsOnlyAfterEveryTaskFinished) {
  for (int threads : kThreadCounts) {
    ThreadPool pool(threads);
    const std::thread::id caller = std::this_thread::get_id();
    std::atomic<size_t> finished{0};
    const size_t count = 500;
    pool.ParallelFor(count, [&](size_t) {
      // Tasks on workers take longer, so the caller runs out of indices while they still run.
      if (std::this_thread::get_id() != caller) {
        for (int k = 0; k < 1000; ++k) std::this_thread::yield();
      }
      finished.fetch_add(1);
    });
    EXPECT_EQ(finished.load(), count) << threads << " threads";
  }
}

TEST_F(ThreadPoolTest, OnePoolServesManySuccessiveCalls) {
  ThreadPool pool(8);
  for (int round = 0; round < 200; ++round) {
    const size_t count = static_cast<size_t>(round % 13) * 5;
    ASSERT_EQ(RunCounts(pool, count), std::vector<int>(count, 1)) << "round " << round;
  }
}

TEST_F(ThreadPoolTest, SingleThreadPoolRunsEveryTaskOnTheCaller) {
  ThreadPool pool(1);
  const std::thread::id caller = std::this_thread::get_id();
  std::vector<std::thread::id> ran_on(100);
  pool.ParallelFor(ran_on.size(), [&](size_t i) { ran_on[i] = std::this_thread::get_id(); });
  EXPECT_EQ(ran_on, std::vector<std::thread::id>(ran_on.size(), caller));
}

// A step beside an async save leaves cores to the writer: at most `threads` threads take part
// (the caller among them), every index still runs exactly once, and the next call may use all.
TEST_F(ThreadPoolTest, ParallelForOnFewerThreadsLeavesTheOthersIdle) {
  ThreadPool pool(6);
  for (int threads : {1, 2, 5, 6, 0}) {
    std::mutex mu;
    std::set<std::thread::id> used;
    std::vector<std::atomic<int>> runs(400);
    pool.ParallelFor(runs.size(), [&](size_t i) {
      runs[i].fetch_add(1);
      std::this_thread::sleep_for(std::chrono::microseconds(50));
      std::lock_guard<std::mutex> lock(mu);
      used.insert(std::this_thread::get_id());
    }, threads);
    for (size_t i = 0; i < runs.size(); ++i) ASSERT_EQ(runs[i].load(), 1) << i;
    EXPECT_LE(used.size(), static_cast<size_t>(threads == 0 ? 6 : threads)) << threads;
    if (threads == 1) {
      EXPECT_EQ(used, std::set<std::thread::id>{std::this_thread::get_id()});
    }
  }
}

}  // namespace
}  // namespace ckpt::optimizer::internal
