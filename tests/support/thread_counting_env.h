// An Env that counts the threads started through it (Env::StartThread) and how many ran at
// once: the tests that each parallel part of libckpt obeys its threads option.
#ifndef CKPT_TESTS_SUPPORT_THREAD_COUNTING_ENV_H_
#define CKPT_TESTS_SUPPORT_THREAD_COUNTING_ENV_H_

#include <algorithm>
#include <atomic>
#include <functional>
#include <memory>

#include "ckpt/env.h"

namespace ckpt::testing {

class ThreadCountingEnv : public EnvWrapper {
 public:
  explicit ThreadCountingEnv(Env* target) : EnvWrapper(target) {}

  std::unique_ptr<EnvThread> StartThread(std::function<void()> fn) override {
    started_.fetch_add(1);
    return EnvWrapper::StartThread([this, fn = std::move(fn)] {
      const int now = running_.fetch_add(1) + 1;
      int seen = peak_.load();
      while (now > seen && !peak_.compare_exchange_weak(seen, now)) {
      }
      fn();
      running_.fetch_sub(1);
    });
  }

  int started() const { return started_.load(); }
  int peak() const { return peak_.load(); }  // Most threads of this Env alive at once.
  void Reset() {
    started_ = 0;
    peak_ = running_.load();
  }

 private:
  std::atomic<int> started_{0}, running_{0}, peak_{0};
};

}  // namespace ckpt::testing

#endif  // CKPT_TESTS_SUPPORT_THREAD_COUNTING_ENV_H_
