// loom/compat.hpp — what a program needs to run the same on the LibTorch versions loom is built and
// tested with (Debian's 1.13, pip's and the zip's 2.x): the version number (LOOM_TORCH_VERSION, from
// loom/detail/torch_api.hpp, where loom's own API differences are named) and clearing an
// optimizer's gradients in a way that says what it wants.
//
// Example:
//   torch::optim::SGD sgd(model->parameters(), 0.1);
//   loom::zero_grad(sgd, loom::GradReset::zero);   // every gradient a tensor of zeros, on 1.13 and 2.x
//   loom::zero_grad(sgd, loom::GradReset::none);   // every gradient undefined, on 1.13 and 2.x
//
// Why: torch::optim::Optimizer::zero_grad() zeroes the gradients on LibTorch 1.13 (detach_() then
//      zero_()) and sets them to none on 2.x (zero_grad(bool set_to_none = true), as Python's
//      Optimizer.zero_grad since PyTorch 2.0). Code that reads a gradient after zero_grad() (a test, a
//      loop that adds into grad() by hand) must say which it wants; loom's Reducer and Trainer work
//      with both.
// Source: torch/csrc/api/include/torch/optim/optimizer.h (1.13 and 2.x), torch/version.h.
#pragma once

#include <torch/optim/optimizer.h>

#include <loom/detail/torch_api.hpp>  // LOOM_TORCH_VERSION

namespace loom {

/// What zero_grad() leaves in each parameter's grad().
enum class GradReset {
  zero,  ///< a tensor of zeros where a gradient existed (the same tensor, detached from any graph; an
         ///< undefined gradient stays undefined): LibTorch 1.13's zero_grad()
  none,  ///< undefined (the memory is released; the next backward allocates): LibTorch 2.x's zero_grad()
};

/// Clears the gradients of every parameter of `optimizer` as `how` says, the same on every LibTorch
/// version. Never throws.
inline void zero_grad(torch::optim::Optimizer& optimizer, GradReset how) {
#if TORCH_VERSION_MAJOR >= 2
  optimizer.zero_grad(/*set_to_none=*/how == GradReset::none);
#else
  if (how == GradReset::zero) {
    optimizer.zero_grad();
    return;
  }
  for (auto& group : optimizer.param_groups())
    for (auto& p : group.params()) p.mutable_grad().reset();
#endif
}

}  // namespace loom
