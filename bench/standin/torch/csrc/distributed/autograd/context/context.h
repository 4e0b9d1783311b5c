// Stand-in for LibTorch's torch/csrc/distributed/autograd/context/context.h, which Debian's
// libtorch-dev 1.13 does not ship although torch/csrc/distributed/c10d/reducer.hpp includes it.
//
// Used only by bench/bench_reduce.cpp, which drives c10d::Reducer (DDP's reducer, exported by
// libtorch_cpu.so) as the "ddp" baseline. reducer.hpp needs two names from this header:
//   - DistAutogradContext::GradCallback, in a static_assert that it equals
//     std::function<bool(at::Tensor&)>;
//   - ContextPtr (a std::shared_ptr<DistAutogradContext>), held by Reducer::RpcContext.
// Neither changes c10d::Reducer's object layout (a shared_ptr and an atomic raw pointer have the
// same size whatever they point to), and the benchmark never uses distributed autograd (RPC), so
// declaring the class without its members is enough. Not part of loom.
#pragma once

#include <functional>
#include <memory>

#include <ATen/core/Tensor.h>

namespace torch {
namespace distributed {
namespace autograd {

class DistAutogradContext {
 public:
  using GradCallback = std::function<bool(at::Tensor&)>;
};

using ContextPtr = std::shared_ptr<DistAutogradContext>;

}  // namespace autograd
}  // namespace distributed
}  // namespace torch
