// loom/schedule/collate_fn.hpp — the collate step of the loader: the k-th samples of one device's
// generators become that device's k-th batch.
//
// The loader calls a CollateFunction on a worker thread with the samples in generator order;
// whatever it returns is what the consumer receives for that device. DefaultCollate (the default)
// goes through loom's collator (loom::collate, loom/collate/collator.hpp): each sample's bytes are
// copied once into one N x (sample shape) batch, samples are read through a SampleProjection, and
// samples of differing shapes follow the collator's padding rules when `pad` is on. StackCollate is
// a self-contained alternative (plain stacking, no projection).
//
// Example:
//   loom::DefaultCollate<> collate_fn;
//   std::vector<at::Tensor> samples = {at::ones({3}), at::zeros({3})};
//   std::vector<int> ids = {4, 5};
//   loom::Batch b = collate_fn(std::span(samples), loom::CollateContext{.device = 2, .step = 0, .generators = ids});
//   // b.data: 2 x 3 float32, rows [1 1 1], [0 0 0]; b.indices == {4, 5}; b.num_samples == 2
//
// In: the k-th sample of each generator of a device, in generator order (N samples).
// Out: one batch of N rows, row i from the i-th sample.
//
// Source: the "collate = stack along a new leading batch dimension" convention of
// torch.utils.data.default_collate; padding and masks follow loom::collate.
#pragma once

#include <concepts>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <loom/collate/batch.hpp>
#include <loom/collate/collator.hpp>
#include <loom/collate/sample.hpp>
#include <loom/error.hpp>

namespace loom {

/// Where a collate happens: the device, the step, and the generator of each sample.
///
/// Example: `CollateContext{.device = 1, .step = 7, .generators = ids}`; ids[i] produced sample i.
/// Units: device is a logical device index (in the per-rank mode: the rank); step counts batches
/// from 0 (from the resumed step when resuming); generator ids index the loader's generators.
struct CollateContext {
  int device = 0;
  std::int64_t step = 0;
  std::span<const int> generators;  ///< generator id of each sample, same length as the samples
};

/// A callable that collates one device's samples of one step into a batch of type B.
///
/// Example: `[](std::span<at::Tensor> s, const loom::CollateContext&) { return at::stack(...); }`
///
/// Requirements:
///  1. `m(std::span<S> samples, const CollateContext& ctx)` returns a move-constructible object
///     type B. Reason: B travels from the worker thread through the prefetch queue to the consumer.
///     The samples are passed as a mutable span so the collate function may move from them; the loader
///     destroys them right after the call.
///  2. M is copy-constructible. Reason: each device's worker gets its own copy, so a collate function may
///     keep reusable buffers without locks.
///  3. The call may throw; the exception reaches the consumer's thread unchanged (it is a
///     data-layout error of the user's, e.g. two shapes in one stacked batch).
/// Not required: default construction of M, thread safety of one M object, a particular B.
/// Optional: `m.empty(ctx)` returning B: the batch a device with no rows left gets under
/// EndPolicy::drain (without it, a value-initialised B{} is used).
template <class M, class S>
concept CollateFunction = std::copy_constructible<M> && requires(M& m, std::span<S> samples, const CollateContext& ctx) {
  { m(samples, ctx) } -> std::move_constructible;
};

/// The batch type a collate function M makes from samples of type S.
template <class M, class S>
  requires CollateFunction<M, S>
using collate_result_t = std::remove_cvref_t<std::invoke_result_t<M&, std::span<S>, const CollateContext&>>;

namespace detail {

template <class S>
concept TupleLikeSample = requires { typename std::tuple_size<S>::type; } && std::tuple_size_v<S> == 2;

template <class S>
concept DataMemberSample = requires(const S& s) {
  { s.data } -> std::convertible_to<const at::Tensor&>;
};
template <class S>
concept TensorTupleSample = TupleLikeSample<S> && requires(const S& s) {
  { std::get<0>(s) } -> std::convertible_to<const at::Tensor&>;
};

/// The data tensor of a sample: the sample itself (at::Tensor), the first element of a pair or
/// 2-tuple, or the member `data`.
template <class S>
  requires std::same_as<S, at::Tensor> || DataMemberSample<S> || TensorTupleSample<S>
const at::Tensor& sample_data(const S& s) {
  if constexpr (std::is_same_v<S, at::Tensor>) {
    return s;
  } else if constexpr (DataMemberSample<S>) {
    return s.data;
  } else {
    return std::get<0>(s);
  }
}

/// Whether a sample carries a target: the second element of a pair / 2-tuple, or member `target`.
template <class S>
constexpr bool sample_has_target() {
  if constexpr (std::is_same_v<S, at::Tensor>) return false;
  else if constexpr (requires(const S& s) { s.target; }) return true;
  else return TupleLikeSample<S>;
}

template <class S>
decltype(auto) sample_target(const S& s) {
  if constexpr (requires { s.target; }) return (s.target);
  else return std::get<1>(s);
}

}  // namespace detail

namespace detail {
/// The message for two samples of one step whose data differ in shape or dtype.
inline std::string shape_mismatch(const CollateContext& ctx, std::size_t i, const at::Tensor& first, const at::Tensor& t,
                                  const char* what) {
  return fmt::format(
      "device {}, step {}: generator {} gave a {} tensor of shape [{}] {}, generator {} gave [{}] {}; "
      "one batch needs one shape and dtype (collate with padding: DefaultCollate{{.pad = true}})",
      ctx.device, ctx.step, ctx.generators[0], what, fmt::join(first.sizes(), ", "), c10::toString(first.scalar_type()),
      ctx.generators[i], fmt::join(t.sizes(), ", "), c10::toString(t.scalar_type()));
}
}  // namespace detail

/// A sample StackCollate can collate: an at::Tensor, a pair (tensor, target) with an integral or
/// tensor target, or a struct with a `data` tensor member (and optionally a `target`).
///
/// Example: `static_assert(loom::StackableSample<std::pair<at::Tensor, int64_t>>);`
template <class S>
concept StackableSample = requires(const S& s) {
  { detail::sample_data(s) } -> std::convertible_to<const at::Tensor&>;
};

/// A self-contained collate function: stacks the samples of one step into one new N x (sample shape) tensor,
/// copying each sample's bytes once; targets (if the sample has them) into an N x (target
/// shape) tensor (integral targets: int64, shape N).
///
/// Example: see the file comment.
/// Shape: data N x (sample shape), the dtype of the samples; targets N or N x (target shape);
///        indices[i] = generator id of row i (a stream has no dataset index); num_samples = N;
///        weight = 1 (0 for the empty batch of a device that ran dry under EndPolicy::drain).
/// Throws: loom::InvalidArgument naming the generator, device and step when a sample's data or
///         target is undefined, or its shape or dtype differs from the first sample's (use a
///         padding collator for samples of different shapes).
/// Source: torch.utils.data.default_collate (stack along a new leading dimension).
struct StackCollate {
  template <StackableSample S>
  Batch operator()(std::span<S> samples, const CollateContext& ctx) const {
    LOOM_ASSERT(samples.size() == ctx.generators.size(), "one generator id per sample");
    LOOM_ASSERT(!samples.empty(), "a device step has at least one sample");
    Batch b;
    b.data = stack_rows(samples, ctx, [](const S& s) -> const at::Tensor& { return detail::sample_data(s); }, "data");
    if constexpr (detail::sample_has_target<S>()) {
      using T = std::remove_cvref_t<decltype(detail::sample_target(std::declval<const S&>()))>;
      if constexpr (std::is_integral_v<T>) {
        b.targets = at::empty({static_cast<int64_t>(samples.size())}, at::TensorOptions().dtype(at::kLong));
        auto* out = b.targets.data_ptr<int64_t>();
        for (std::size_t i = 0; i < samples.size(); ++i) out[i] = static_cast<int64_t>(detail::sample_target(samples[i]));
      } else {
        b.targets = stack_rows(samples, ctx, [](const S& s) -> const at::Tensor& { return detail::sample_target(s); }, "target");
      }
    }
    b.indices.assign(ctx.generators.begin(), ctx.generators.end());
    b.num_samples = static_cast<int64_t>(samples.size());
    return b;
  }

  /// The batch of a device with no rows left (EndPolicy::drain): undefined tensors, 0 samples, weight 0.
  Batch empty(const CollateContext& /*ctx*/) const {
    Batch b;
    b.weight = 0.0;
    return b;
  }

 private:
  template <class S, class Get>
  static at::Tensor stack_rows(std::span<S> samples, const CollateContext& ctx, Get get, const char* what) {
    const at::Tensor& first = get(samples[0]);
    check_defined(first, ctx, 0, what);
    std::vector<int64_t> shape;
    shape.reserve(static_cast<std::size_t>(first.dim()) + 1);
    shape.push_back(static_cast<int64_t>(samples.size()));
    for (auto s : first.sizes()) shape.push_back(s);
    at::Tensor out = at::empty(shape, first.options().device(at::kCPU));
    const auto row_bytes = static_cast<std::size_t>(first.numel()) * first.element_size();
    auto* dst = static_cast<char*>(out.data_ptr());
    for (std::size_t i = 0; i < samples.size(); ++i) {
      const at::Tensor& t = get(samples[i]);
      check_defined(t, ctx, i, what);
      if (t.sizes() != first.sizes() || t.scalar_type() != first.scalar_type())
        throw InvalidArgument("StackCollate: " + detail::shape_mismatch(ctx, i, first, t, what));
      if (t.is_contiguous() && t.device().is_cpu()) {
        if (row_bytes != 0) std::memcpy(dst + i * row_bytes, t.data_ptr(), row_bytes);
      } else {
        out.select(0, static_cast<int64_t>(i)).copy_(t);
      }
    }
    return out;
  }

  static void check_defined(const at::Tensor& t, const CollateContext& ctx, std::size_t i, const char* what) {
    if (!t.defined())
      throw InvalidArgument(fmt::format("StackCollate: generator {} (device {}, step {}) gave an undefined {} tensor",
                                        ctx.generators[i], ctx.device, ctx.step, what));
  }
};

/// The default collate function: loom's collator over the k-th samples of a device (loom::collate).
///
/// Example: `loom::GeneratorLoader<Gen, loom::DefaultCollate<>> s(gens, {.num_devices = 2}, {.pad = true, .options = {.mask = true}});`
/// Shape: data N x (sample shape) in the samples' dtype — with `pad`, N x options.padded_shape (or
///        the step's per-dimension maximum) and, with options.mask, a bool mask like data (true =
///        real); targets as loom::collate makes them (int64 N-vector for integer targets);
///        indices[i] = the projection's index(s) when it has one, else the generator id of row i;
///        num_samples = N; weight = 1 (0 for the empty batch of a device that ran dry under drain).
/// Throws: loom::InvalidArgument naming the device, step and generators when, without `pad`, two
///         samples differ in shape or dtype; loom::collate's errors (undefined or non-CPU data, a
///         zero-size dimension, different dtypes or target kinds, a sample larger than
///         padded_shape), prefixed with the device and step ("sample i" there = generator id i).
/// Source: loom::collate (copy once into preallocated storage; padding and masks).
template <class Projection = DefaultProjection>
struct DefaultCollate {
  bool pad = false;              ///< false: one shape per batch required; true: pad as loom::collate does
  CollateOptions options{};      ///< padded_shape, pad_value, mask, pool, allocate (see loom::collate)
  Projection projection{};       ///< reads data / target (/ index) from a sample

  template <class S>
    requires SampleProjection<Projection, S>
  Batch operator()(std::span<S> samples, const CollateContext& ctx) const {
    LOOM_ASSERT(samples.size() == ctx.generators.size(), "one generator id per sample");
    LOOM_ASSERT(!samples.empty(), "a device step has at least one sample");
    if (!pad) {
      const at::Tensor& first = projection.data(samples[0]);
      for (std::size_t i = 1; i < samples.size(); ++i) {
        const at::Tensor& t = projection.data(samples[i]);
        if (first.defined() && t.defined() && (t.sizes() != first.sizes() || t.scalar_type() != first.scalar_type()))
          throw InvalidArgument("DefaultCollate: " + detail::shape_mismatch(ctx, i, first, t, "data"));
      }
    }
    std::vector<int64_t> indices(samples.size());
    for (std::size_t i = 0; i < samples.size(); ++i) {
      if constexpr (SampleProjectionWithIndex<Projection, S>) indices[i] = static_cast<int64_t>(projection.index(samples[i]));
      else indices[i] = ctx.generators[i];
    }
    try {
      return collate(samples, std::span<const int64_t>(indices), options, projection);
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(fmt::format("DefaultCollate: device {}, step {} (sample index = {}): {}", ctx.device, ctx.step,
                                        SampleProjectionWithIndex<Projection, S> ? "the sample's index" : "generator id",
                                        e.what()));
    }
  }

  /// The batch of a device with no rows left (EndPolicy::drain): undefined tensors, 0 samples, weight 0.
  Batch empty(const CollateContext& /*ctx*/) const {
    Batch b;
    b.weight = 0.0;
    return b;
  }
};

}  // namespace loom
