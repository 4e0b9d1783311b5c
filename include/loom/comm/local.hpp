// loom/comm/local.hpp — LocalCommunicator: the world-size-1 process group.
//
// Every collective is the identity (a sum over one rank is the value itself; avg divides by 1),
// but the tensor checks are the same as on Gloo and NCCL, so code tested on one process fails
// the same way on many. Use it for single-process training with the same loop code, and in tests.
//
// Example:
//   loom::LocalCommunicator comm;
//   auto t = torch::tensor({1.0, 2.0});
//   comm.all_reduce(t, loom::ReduceOp::avg);   // t unchanged: [1, 2]
//   auto all = comm.all_gather(t);             // all.size() == 1, all[0] equals t (a copy)
//
// Throws: loom::InvalidArgument for an undefined / non-contiguous / unsupported-dtype tensor,
//         or a broadcast root other than 0.
#pragma once

#include <chrono>
#include <vector>

#include <loom/comm/communicator.hpp>

namespace loom {

/// A completed work handle: wait() returns at once. Returned by LocalCommunicator::all_reduce_async.
struct CompletedWork {
  void wait() const noexcept {}
  [[nodiscard]] bool is_completed() const noexcept { return true; }
};

/// The process group of one process (rank 0 of world size 1). Models AsyncCommunicator.
class LocalCommunicator {
 public:
  explicit LocalCommunicator(std::chrono::milliseconds timeout = kDefaultTimeout) : timeout_(timeout) {}

  [[nodiscard]] int rank() const noexcept { return 0; }
  [[nodiscard]] int world_size() const noexcept { return 1; }
  [[nodiscard]] std::chrono::milliseconds timeout() const noexcept { return timeout_; }

  /// In place; the identity for every op on one rank.
  void all_reduce(at::Tensor& t, ReduceOp /*op*/) const { detail::check_collective_tensor(t, "all_reduce"); }

  /// Same as all_reduce; the returned handle is already complete.
  CompletedWork all_reduce_async(at::Tensor& t, ReduceOp op) const {
    all_reduce(t, op);
    return {};
  }

  /// In place; root must be 0.
  void broadcast(at::Tensor& t, int root) const {
    detail::check_collective_tensor(t, "broadcast");
    detail::check_root(root, 1, "broadcast");
  }

  /// Returns {copy of t}.
  [[nodiscard]] std::vector<at::Tensor> all_gather(const at::Tensor& t) const {
    detail::check_collective_tensor(t, "all_gather");
    return {t.clone()};
  }

  void barrier() const noexcept {}

  /// The CPU: collectives take CPU tensors (a copy or nothing happens; any device would do, the CPU
  /// keeps loom's own collective tensors off the GPU).
  [[nodiscard]] c10::Device device() const noexcept { return c10::Device(c10::kCPU); }

 private:
  std::chrono::milliseconds timeout_;
};

static_assert(AsyncCommunicator<LocalCommunicator>);
static_assert(WorkHandle<CompletedWork>);

}  // namespace loom
