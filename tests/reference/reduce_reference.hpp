// tests/reference/reduce_reference.hpp — the naive reduction loom's bucketed reducer must match:
// one blocking all-reduce per gradient tensor, then a division.
//
// Example:
//   auto ref = loom::test::per_tensor_average(comm, grads, /*divisor=*/global_samples);
//
// Shape: one tensor per parameter, any shape; returns new tensors (the inputs are not modified).
#pragma once

#include <vector>

#include <torch/torch.h>

#include <loom/comm/communicator.hpp>

namespace loom::test {

/// sum over ranks of each gradient (one all_reduce per tensor) divided by `divisor`.
template <loom::Communicator Comm>
std::vector<at::Tensor> per_tensor_average(Comm& comm, const std::vector<at::Tensor>& grads, double divisor) {
  std::vector<at::Tensor> out;
  for (const auto& g : grads) {
    auto t = g.defined() ? g.detach().clone().contiguous() : at::Tensor();
    if (t.defined()) {
      comm.all_reduce(t, loom::ReduceOp::sum);
      t /= divisor;
    }
    out.push_back(t);
  }
  return out;
}

}  // namespace loom::test
