#include "optimizer/thread_pool.h"

namespace ckpt::optimizer::internal {

ThreadPool::ThreadPool(int threads) {
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this, i] { WorkerLoop(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  for (std::thread& t : workers_) t.join();
}

void ThreadPool::Drain() {
  for (size_t i = next_++; i < count_; i = next_++) (*fn_)(i);
}

void ThreadPool::WorkerLoop(int index) {
  uint64_t seen = 0;
  for (;;) {
    bool takes_part = false;
    {
      std::unique_lock<std::mutex> lock(mu_);
      wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      takes_part = index < participants_;
    }
    if (takes_part) Drain();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (--active_ == 0) done_.notify_all();
    }
  }
}

void ThreadPool::ParallelFor(size_t count, const std::function<void(size_t)>& fn, int threads) {
  if (threads <= 0 || threads > size()) threads = size();
  if (workers_.empty() || count <= 1 || threads == 1) {
    for (size_t i = 0; i < count; ++i) fn(i);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    fn_ = &fn;
    count_ = count;
    next_ = 0;
    participants_ = threads;
    active_ = static_cast<int>(workers_.size());
    ++generation_;
  }
  wake_.notify_all();
  Drain();
  std::unique_lock<std::mutex> lock(mu_);
  done_.wait(lock, [&] { return active_ == 0; });
  fn_ = nullptr;
}

}  // namespace ckpt::optimizer::internal
