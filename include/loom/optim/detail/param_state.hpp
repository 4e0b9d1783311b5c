// loom/optim/detail/param_state.hpp — the torch::optim optimizers whose update is element by element
// (SGD, Adam, AdamW, RMSprop, Adagrad), named by OptimizerKind, with their per-parameter state as
// numbered tensors and a step count: what loom::ShardedOptimizer slices into shards and joins back;
// and a snapshot of an optimizer's parameter groups, to see that they changed.
//
// Example:
//   auto kind = loom::detail::kind_of(adam);                     // OptimizerKind::adam
//   loom::detail::with_kind(*kind, [&](auto tag) {
//     using F = typename decltype(tag)::Fields;                  // StateFields<torch::optim::AdamParamState>
//     static_assert(F::kTensors == 3);                           // exp_avg, exp_avg_sq, max_exp_avg_sq
//   });
//   auto key = loom::detail::state_key(adam, p);                 // p's key in adam.state()
// The state map's key is a std::string (the TensorImpl address printed) on LibTorch 1.13 and the
// TensorImpl address (void*) on 2.x: state_key gives the right one.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

namespace loom::detail {

/// The optimizers a ShardedOptimizer can shard (those that update element by element).
enum class OptimizerKind { sgd, adam, adamw, rmsprop, adagrad };

/// A parameter state type's tensors, numbered 0..kTensors-1, and its step count (0 where it has none).
template <class S>
struct StateFields;

template <>
struct StateFields<torch::optim::SGDParamState> {
  using S = torch::optim::SGDParamState;
  static constexpr int kTensors = 1;  // momentum_buffer
  static const at::Tensor& get(const S& s, int /*i*/) { return s.momentum_buffer(); }
  static void set(S& s, int /*i*/, at::Tensor t) { s.momentum_buffer(std::move(t)); }
  static std::int64_t step(const S& /*s*/) { return 0; }
  static void set_step(S& /*s*/, std::int64_t /*v*/) {}
};

/// AdamParamState and AdamWParamState hold the same fields.
template <class S>
struct AdamLikeFields {
  static constexpr int kTensors = 3;  // exp_avg, exp_avg_sq, max_exp_avg_sq
  static const at::Tensor& get(const S& s, int i) {
    return i == 0 ? s.exp_avg() : i == 1 ? s.exp_avg_sq() : s.max_exp_avg_sq();
  }
  static void set(S& s, int i, at::Tensor t) {
    if (i == 0)
      s.exp_avg(std::move(t));
    else if (i == 1)
      s.exp_avg_sq(std::move(t));
    else
      s.max_exp_avg_sq(std::move(t));
  }
  static std::int64_t step(const S& s) { return s.step(); }
  static void set_step(S& s, std::int64_t v) { s.step(v); }
};
template <>
struct StateFields<torch::optim::AdamParamState> : AdamLikeFields<torch::optim::AdamParamState> {};
template <>
struct StateFields<torch::optim::AdamWParamState> : AdamLikeFields<torch::optim::AdamWParamState> {};

template <>
struct StateFields<torch::optim::RMSpropParamState> {
  using S = torch::optim::RMSpropParamState;
  static constexpr int kTensors = 3;  // square_avg, momentum_buffer, grad_avg
  static const at::Tensor& get(const S& s, int i) {
    return i == 0 ? s.square_avg() : i == 1 ? s.momentum_buffer() : s.grad_avg();
  }
  static void set(S& s, int i, at::Tensor t) {
    if (i == 0)
      s.square_avg(std::move(t));
    else if (i == 1)
      s.momentum_buffer(std::move(t));
    else
      s.grad_avg(std::move(t));
  }
  static std::int64_t step(const S& s) { return s.step(); }
  static void set_step(S& s, std::int64_t v) { s.step(v); }
};

template <>
struct StateFields<torch::optim::AdagradParamState> {
  using S = torch::optim::AdagradParamState;
  static constexpr int kTensors = 1;  // sum
  static const at::Tensor& get(const S& s, int /*i*/) { return s.sum(); }
  static void set(S& s, int /*i*/, at::Tensor t) { s.sum(std::move(t)); }
  static std::int64_t step(const S& s) { return s.step(); }
  static void set_step(S& s, std::int64_t v) { s.step(v); }
};

/// The optimizer, options and state types of one OptimizerKind.
template <class O, class Options, class State>
struct KindTag {
  using Optimizer = O;
  using OptionsType = Options;
  using StateType = State;
  using Fields = StateFields<State>;
};

/// The kind of `o` when its dynamic type is exactly one of the five (a subclass may change the
/// update rule, so it is none of them); std::nullopt otherwise.
inline std::optional<OptimizerKind> kind_of(const torch::optim::Optimizer& o) {
  const std::type_info& t = typeid(o);
  if (t == typeid(torch::optim::SGD)) return OptimizerKind::sgd;
  if (t == typeid(torch::optim::Adam)) return OptimizerKind::adam;
  if (t == typeid(torch::optim::AdamW)) return OptimizerKind::adamw;
  if (t == typeid(torch::optim::RMSprop)) return OptimizerKind::rmsprop;
  if (t == typeid(torch::optim::Adagrad)) return OptimizerKind::adagrad;
  return std::nullopt;
}

/// Calls `f(KindTag<...>{})` with the types of `kind`.
template <class F>
decltype(auto) with_kind(OptimizerKind kind, F&& f) {
  namespace o = torch::optim;
  switch (kind) {
    case OptimizerKind::sgd: return f(KindTag<o::SGD, o::SGDOptions, o::SGDParamState>{});
    case OptimizerKind::adam: return f(KindTag<o::Adam, o::AdamOptions, o::AdamParamState>{});
    case OptimizerKind::adamw: return f(KindTag<o::AdamW, o::AdamWOptions, o::AdamWParamState>{});
    case OptimizerKind::rmsprop: return f(KindTag<o::RMSprop, o::RMSpropOptions, o::RMSpropParamState>{});
    case OptimizerKind::adagrad: break;
  }
  return f(KindTag<o::Adagrad, o::AdagradOptions, o::AdagradParamState>{});
}

/// The key of parameter `p` in `o.state()` (a std::string on LibTorch 1.13, the TensorImpl address on
/// 2.x). A template, so that only the branch of this LibTorch's key type is compiled.
template <class O = torch::optim::Optimizer>
auto state_key(const O& o, const at::Tensor& p) {
  using Key = typename std::decay_t<decltype(o.state())>::key_type;
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream text;  // what c10::guts::to_string(p.unsafeGetTensorImpl()) writes
    text << p.unsafeGetTensorImpl();
    return text.str();
  } else {
    return static_cast<Key>(p.unsafeGetTensorImpl());
  }
}

/// Every parameter group's parameters (their TensorImpl and whether they are trainable), to see
/// whether an optimizer's groups changed.
using GroupSnapshot = std::vector<std::vector<std::pair<const void*, bool>>>;

inline GroupSnapshot group_snapshot(const torch::optim::Optimizer& o) {
  GroupSnapshot out;
  for (const auto& g : o.param_groups()) {
    out.emplace_back();
    for (const at::Tensor& p : g.params()) out.back().emplace_back(p.unsafeGetTensorImpl(), p.requires_grad());
  }
  return out;
}

/// Whether `o`'s groups hold the parameters of `snapshot` (compared in place: no allocation).
inline bool same_groups(const torch::optim::Optimizer& o, const GroupSnapshot& snapshot) {
  const auto& groups = o.param_groups();
  if (groups.size() != snapshot.size()) return false;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    const auto& params = groups[g].params();
    if (params.size() != snapshot[g].size()) return false;
    for (std::size_t i = 0; i < params.size(); ++i)
      if (params[i].unsafeGetTensorImpl() != snapshot[g][i].first || params[i].requires_grad() != snapshot[g][i].second)
        return false;
  }
  return true;
}

/// Bytes of every tensor in `o.state()` (the five kinds' states; 0 for another optimizer's).
inline std::int64_t state_bytes_of(const torch::optim::Optimizer& o) {
  const std::optional<OptimizerKind> kind = kind_of(o);
  if (!kind) return 0;
  return with_kind(*kind, [&](auto tag) {
    using Tag = decltype(tag);
    std::int64_t bytes = 0;
    for (const auto& entry : o.state()) {
      const auto* s = dynamic_cast<const typename Tag::StateType*>(entry.second.get());
      if (s == nullptr) continue;
      for (int i = 0; i < Tag::Fields::kTensors; ++i) {
        const at::Tensor& t = Tag::Fields::get(*s, i);
        if (t.defined()) bytes += static_cast<std::int64_t>(t.nbytes());
      }
    }
    return bytes;
  });
}

}  // namespace loom::detail
