// tests/support/thread_communicator.hpp — archetype: a Communicator whose ranks are threads of one process.
//
// Only for tests of the gather/deduplicate logic: collectives meet at a std::barrier and exchange
// tensors through shared slots. It records each rank's calls, and checks what real backends
// require (every rank passes the same shape and dtype to all_gather), so a helper that forgot to
// pad fails here as it would on Gloo. Real multi-process runs: tests/support/ranks.hpp.
#pragma once

#include <barrier>
#include <chrono>
#include <exception>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include <ATen/core/Tensor.h>

#include <loom/comm/communicator.hpp>

namespace loom::test {

class ThreadGroup {
 public:
  explicit ThreadGroup(int n) : n_(n), slots_(static_cast<std::size_t>(n)), sync_(n) {}
  [[nodiscard]] int size() const { return n_; }

  std::vector<at::Tensor> all_gather(int rank, const at::Tensor& t) {
    loom::detail::check_collective_tensor(t, "all_gather");
    slots_[static_cast<std::size_t>(rank)] = t.clone();
    sync_.arrive_and_wait();
    std::vector<at::Tensor> out;
    std::string mismatch;
    for (const auto& s : slots_) {
      if (s.sizes() != slots_[0].sizes() || s.scalar_type() != slots_[0].scalar_type())
        mismatch = "shape/dtype differ across ranks";
      out.push_back(s.clone());
    }
    sync_.arrive_and_wait();
    if (!mismatch.empty()) throw loom::CommError("all_gather: " + mismatch);
    return out;
  }
  void barrier() { sync_.arrive_and_wait(); }

  /// Runs fn(rank) on n threads and joins them; rethrows the first exception.
  void run(const std::function<void(int)>& fn) {
    std::vector<std::exception_ptr> errors(static_cast<std::size_t>(n_));
    std::vector<std::thread> threads;
    for (int r = 0; r < n_; ++r)
      threads.emplace_back([&, r] {
        try {
          fn(r);
        } catch (...) {
          errors[static_cast<std::size_t>(r)] = std::current_exception();
        }
      });
    for (auto& t : threads) t.join();
    for (auto& e : errors)
      if (e) std::rethrow_exception(e);
  }

 private:
  int n_;
  std::vector<at::Tensor> slots_;
  std::barrier<> sync_;
};

/// One rank's view of a ThreadGroup. Models loom::Communicator; records the collectives it ran.
class ThreadCommunicator {
 public:
  ThreadCommunicator(ThreadGroup& g, int rank) : g_(&g), rank_(rank) {}
  [[nodiscard]] int rank() const { return rank_; }
  [[nodiscard]] int world_size() const { return g_->size(); }
  [[nodiscard]] std::chrono::milliseconds timeout() const { return std::chrono::seconds(30); }
  [[nodiscard]] c10::Device device() const { return c10::Device(c10::kCPU); }
  void all_reduce(at::Tensor& t, loom::ReduceOp) {
    calls.push_back("all_reduce");
    auto all = g_->all_gather(rank_, t);
    at::Tensor sum = all[0].clone();
    for (std::size_t i = 1; i < all.size(); ++i) sum.add_(all[i]);
    t.copy_(sum);
  }
  void broadcast(at::Tensor& t, int root) {
    calls.push_back("broadcast");
    auto all = g_->all_gather(rank_, t);
    t.copy_(all[static_cast<std::size_t>(root)]);
  }
  std::vector<at::Tensor> all_gather(const at::Tensor& t) {
    calls.push_back("all_gather");
    return g_->all_gather(rank_, t);
  }
  void barrier() {
    calls.push_back("barrier");
    g_->barrier();
  }
  std::vector<std::string> calls;

 private:
  ThreadGroup* g_;
  int rank_;
};
static_assert(loom::Communicator<ThreadCommunicator>);

}  // namespace loom::test
