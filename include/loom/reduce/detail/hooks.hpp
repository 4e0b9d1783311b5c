// loom/reduce/detail/hooks.hpp — the autograd post-hook a reducer hangs on every trainable
// parameter's gradient accumulator, and the check that no parameter carries two reducers' hooks.
//
// Errors: check_not_hooked throws loom::InvalidArgument naming the first parameter already hooked.
// Source: the hook point is the one PyTorch DDP's Reducer uses (the gradient accumulator's post-hooks).
#pragma once

#include <cstddef>
#include <string>

#include <fmt/format.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <loom/error.hpp>
#include <loom/reduce/parameters.hpp>

namespace loom::detail {

/// Carried by every loom reducer's gradient hook (whatever its communicator type), so that a second
/// reducer on the same parameters finds the first one's hooks (see check_not_hooked).
class ReducerHookMarker {
 public:
  virtual ~ReducerHookMarker() = default;
};

/// The describe() text of the first trainable parameter in `list` whose gradient accumulator already
/// carries a loom reducer's hook, or an empty string. Creates missing accumulators (as hooking does).
inline std::string first_hooked_parameter(const ParameterList& list) {
  for (std::size_t i = 0; i < list.params.size(); ++i) {
    const auto& p = list.params[i];
    if (!p.defined() || !p.requires_grad() || !p.is_leaf()) continue;
    auto acc = torch::autograd::impl::grad_accumulator(p);
    if (acc == nullptr) continue;
    for (const auto& hook : acc->post_hooks())
      if (dynamic_cast<const ReducerHookMarker*>(hook.get()) != nullptr) return list.describe(i);
  }
  return {};
}

/// Throws loom::InvalidArgument when a trainable parameter of `list` is already hooked by another
/// live loom::Reducer (see first_hooked_parameter). `who` starts the message.
inline void check_not_hooked(const ParameterList& list, const char* who) {
  if (const std::string hooked = first_hooked_parameter(list); !hooked.empty())
    throw InvalidArgument(fmt::format(
        "{}: {} already belongs to another live loom::Reducer (a second Trainer or Reducer on the same model "
        "while the first exists); both would take its gradient, and one of them would apply it unreduced. "
        "Destroy the first before building another (one Trainer per model: keep it, or scope each phase's "
        "Trainer so it ends before the next begins)",
        who, hooked));
}

/// The post-hook on one parameter's gradient accumulator: tells `state` (a ReducerState) that the
/// gradient of its slot `slot` arrived. Runs on autograd's thread, after the gradient was accumulated.
template <class State>
class GradReadyHook final : public torch::autograd::FunctionPostHook, public ReducerHookMarker {
 public:
  GradReadyHook(State* state, std::size_t slot) : state_(state), slot_(slot) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    state_->on_grad_ready(slot_);
    return outputs;
  }

 private:
  State* state_;
  std::size_t slot_;
};

}  // namespace loom::detail
