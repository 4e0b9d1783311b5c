// loom/collate/sample.hpp — how a collator reads a sample: the SampleProjection customization point
// (data tensor, target, optional dataset index), so any sample type works.
//
// Example:
//   struct Utterance { torch::Tensor features; std::string text; int64_t speaker; int64_t id; };
//   struct UtteranceProjection {
//     const at::Tensor& data(const Utterance& u) const { return u.features; }
//     int64_t target(const Utterance& u) const { return u.speaker; }
//     int64_t index(const Utterance& u) const { return u.id; }          // optional member
//   };
//   auto batches = utterances | loom::views::bucket_by_shape({.max_samples = 32}, UtteranceProjection{});
//
// Shape: the data tensor is one sample without the batch dimension (e.g. C x H x W); the collator
//        adds the leading N. Its shape is the sample's *shape key* for bucketing.
// Guide: docs/collate.md#any-sample-type-projections-loomcollatesamplehpp.
// Source: projections follow the C++20 ranges idea of a projection (std::ranges::sort(r, {}, proj)).
#pragma once

#include <concepts>
#include <cstdint>
#include <tuple>
#include <type_traits>
#include <utility>

#include <ATen/core/Tensor.h>

namespace loom {

/// The target of a sample that has none; a collator leaves Batch::targets undefined for it.
///
/// Example: `loom::NoTarget target(const at::Tensor&) const { return {}; }`
struct NoTarget {};

/// True for the target types a collator can stack: an integer class id, a tensor, or NoTarget.
template <class T>
concept CollatableTarget = std::integral<std::remove_cvref_t<T>> || std::same_as<std::remove_cvref_t<T>, at::Tensor> ||
    std::same_as<std::remove_cvref_t<T>, NoTarget>;

/// A projection P reads samples of type S for a collator.
///
/// Requirements:
///  1. `p.data(s)` returns something convertible to `const at::Tensor&`: the sample's data.
///     Reason: the collator copies its bytes into the batch and buckets by its shape.
///  2. `p.target(s)` returns an integer, an at::Tensor or loom::NoTarget.
///     Reason: integers become an int64 N-vector, tensors are stacked, NoTarget leaves targets empty.
///  3. `p` is copyable and its calls are const. Reason: views copy their adaptors.
/// Optional: `p.index(s)` -> integer, the sample's dataset index (see SampleProjectionWithIndex);
///           without it the collator numbers samples by their position in the input (0, 1, ...).
/// Not required: default construction, a particular sample type, that the tensor be contiguous
///               (non-contiguous data is made contiguous first, at the cost of one more copy).
template <class P, class S>
concept SampleProjection = std::copy_constructible<P> && requires(const P& p, const S& s) {
  { p.data(s) } -> std::convertible_to<const at::Tensor&>;
  { p.target(s) } -> CollatableTarget;
};

/// A SampleProjection that also knows each sample's dataset index.
///
/// Requirements (in addition to SampleProjection): `p.index(s)` returns an integer.
/// Reason: samples that come from a sampler carry their index; the Batch reports it in `indices`.
template <class P, class S>
concept SampleProjectionWithIndex = SampleProjection<P, S> && requires(const P& p, const S& s) {
  { p.index(s) } -> std::convertible_to<int64_t>;
};

namespace detail {
template <class S>
concept HasDataMember = requires(const S& s) {
  { s.data } -> std::convertible_to<const at::Tensor&>;
};
template <class S>
concept HasTargetMember = requires(const S& s) {
  { s.target } -> CollatableTarget;
};
template <class S>
concept HasIndexMember = requires(const S& s) {
  { s.index } -> std::convertible_to<int64_t>;
};
template <class S>
concept TupleOfTwo = requires {
  typename std::tuple_size<S>::type;
}
&&std::tuple_size_v<S> == 2;
template <class S>
concept TensorTuple = !HasDataMember<S> && TupleOfTwo<S> && requires(const S& s) {
  { std::get<0>(s) } -> std::convertible_to<const at::Tensor&>;
  { std::get<1>(s) } -> CollatableTarget;
};
}  // namespace detail

namespace detail {
/// Calls `f(at::Tensor&)` on each tensor DefaultProjection reads from `s` — the data, and the
/// target when it is a tensor — that `s` holds as a modifiable at::Tensor. The generator loaders
/// use it to give a sample its own copy of tensors that share memory (loom/schedule).
template <class S, class F>
void for_each_read_tensor(S& s, F&& f) {
  if constexpr (std::same_as<S, at::Tensor>) {
    f(s);
  } else if constexpr (HasDataMember<S>) {
    if constexpr (std::same_as<decltype(s.data), at::Tensor>) f(s.data);
    if constexpr (requires { s.target; }) {
      if constexpr (std::same_as<decltype(s.target), at::Tensor>) f(s.target);
    }
  } else if constexpr (TensorTuple<S>) {
    if constexpr (std::same_as<std::remove_reference_t<decltype(std::get<0>(s))>, at::Tensor>) f(std::get<0>(s));
    if constexpr (std::same_as<std::remove_reference_t<decltype(std::get<1>(s))>, at::Tensor>) f(std::get<1>(s));
  }
}
}  // namespace detail

/// The projection collators use unless given another: reads std::pair<at::Tensor, int64_t> and
/// std::pair<at::Tensor, at::Tensor> (first the data, second the target), any 2-element tuple-like
/// (std::get<0>, std::get<1>), structs with `.data` and `.target` (an integer or a tensor;
/// optionally `.index`), structs with `.data` only and bare tensors (no target: Batch::targets
/// undefined). It is loom's one reading of a sample: the collators, loom::collate and the generator
/// loader's DefaultCollate all go through it (or through a projection the user gives instead).
///
/// Example: `std::pair<at::Tensor, int64_t> s{torch::zeros({3, 8, 8}), 7};`
///          `DefaultProjection{}.target(s) == 7`.
struct DefaultProjection {
  template <class S>
  requires detail::TensorTuple<S> || detail::HasDataMember<S> || std::convertible_to<const S&, const at::Tensor&>
  const at::Tensor& data(const S& s) const {
    if constexpr (detail::TensorTuple<S>)
      return std::get<0>(s);
    else if constexpr (detail::HasDataMember<S>)
      return s.data;
    else
      return s;
  }

  template <class S>
  requires detail::TensorTuple<S> || detail::HasDataMember<S> || std::convertible_to<const S&, const at::Tensor&>
  decltype(auto) target(const S& s) const {
    if constexpr (detail::TensorTuple<S>)
      return std::get<1>(s);
    else if constexpr (detail::HasTargetMember<S>)
      return (s.target);
    else
      return NoTarget{};
  }

  template <detail::HasIndexMember S>
  int64_t index(const S& s) const {
    return static_cast<int64_t>(s.index);
  }
};

}  // namespace loom
