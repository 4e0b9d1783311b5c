// loom/train/detail/worker_pool.hpp — a fixed set of threads running jobs in submission order
// (first in, first started): the background workers of loom::BatchLoader (LoaderOptions::num_workers).
//
// Example:
//   loom::detail::WorkerPool pool(2);
//   std::future<int> f = pool.submit([] { return 6 * 7; });   // f.get() == 42, or rethrows the job's error
//
// Destruction drops the jobs no thread has started (their futures report std::future_errc::broken_promise),
// waits for the running ones and joins the threads.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

namespace loom::detail {

class WorkerPool {
 public:
  /// Starts `threads` threads (at least 1). When the system cannot start one (std::system_error),
  /// the ones started are stopped and joined before the error propagates.
  explicit WorkerPool(int threads) {
    const int n = threads < 1 ? 1 : threads;
    threads_.reserve(static_cast<std::size_t>(n));
    try {
      for (int t = 0; t < n; ++t) threads_.emplace_back([this] { work(); });
    } catch (...) {
      shut_down();
      throw;
    }
  }

  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  ~WorkerPool() { shut_down(); }

  /// Queues `job`; its result (or exception) arrives through the future.
  template <class Job>
  [[nodiscard]] std::future<std::invoke_result_t<Job&>> submit(Job job) {
    using R = std::invoke_result_t<Job&>;
    // std::function needs a copyable callable: the task is shared.
    auto task = std::make_shared<std::packaged_task<R()>>(std::move(job));
    std::future<R> result = task->get_future();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      jobs_.emplace_back([task] { (*task)(); });
    }
    wake_.notify_one();
    return result;
  }

  [[nodiscard]] int size() const noexcept { return static_cast<int>(threads_.size()); }

 private:
  // Drops the jobs not started, lets the running ones finish, joins every thread.
  void shut_down() noexcept {
    std::deque<std::function<void()>> dropped;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
      dropped.swap(jobs_);
    }
    wake_.notify_all();
    for (auto& t : threads_)
      if (t.joinable()) t.join();
  }

  void work() {
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [this] { return stop_ || !jobs_.empty(); });
        if (stop_) return;
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      job();  // a packaged_task: its exceptions go to the future
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::function<void()>> jobs_;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace loom::detail
