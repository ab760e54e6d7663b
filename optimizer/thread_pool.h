// A fixed pool of worker threads for data-parallel loops over units.
#ifndef CKPT_OPTIMIZER_THREAD_POOL_H_
#define CKPT_OPTIMIZER_THREAD_POOL_H_

#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace ckpt::optimizer::internal {

// Owns `threads - 1` workers; the calling thread is the last worker. ParallelFor hands out
// indices [0, count) dynamically and returns when all are done. One ParallelFor at a time.
class ThreadPool {
 public:
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;  // Owns threads.
  ThreadPool& operator=(const ThreadPool&) = delete;
  int size() const { return static_cast<int>(workers_.size()) + 1; }
  // Runs fn(i) for every i in [0, count) on at most `threads` threads (the caller included;
  // 0 or more than size(): all of them), so that the others' cores stay free.
  void ParallelFor(size_t count, const std::function<void(size_t)>& fn, int threads = 0);

 private:
  void WorkerLoop(int index);
  void Drain();

  std::mutex mu_;
  std::condition_variable wake_, done_;
  uint64_t generation_ = 0;
  bool stop_ = false;
  int active_ = 0;
  const std::function<void(size_t)>* fn_ = nullptr;
  size_t count_ = 0;
  int participants_ = 0;  // Threads of the current ParallelFor, the caller included.
  std::atomic<size_t> next_{0};
  std::vector<std::thread> workers_;  // Last: joined in the destructor before the rest goes.
};

}  // namespace ckpt::optimizer::internal

#endif  // CKPT_OPTIMIZER_THREAD_POOL_H_
