// loom/schedule/collate_fn.hpp — the collate step of the generator loaders: the k-th samples of
// one device's generators become that device's k-th batch.
//
// A loader calls its collate function (concept CollateFunction, a DataLoader's collate_fn) on a
// worker thread with the samples in generator order, and whatever it returns is what the consumer
// receives for that device. DefaultCollate, the default, is loom::collate
// (loom/collate/collate_list.hpp) with the step's context: samples are read through a
// SampleProjection (loom/collate/sample.hpp), each sample's bytes are copied once into one
// N x (sample shape) batch, and samples of differing shapes are refused (or, with `pad`, padded
// as loom::collate pads). In the loaders that one copy happens as each sample arrives, into its
// row of a batch buffer from the device's BufferPool (CollateContext::rows), and DefaultCollate
// takes the filled buffer as the batch's data.
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
// Source: torch.utils.data.DataLoader's collate_fn and default_collate (stack along a new leading
// batch dimension); padding and masks follow loom::collate.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/stack.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <loom/collate/batch.hpp>
#include <loom/collate/collate_list.hpp>
#include <loom/collate/detail/sample_read.hpp>
#include <loom/collate/sample.hpp>
#include <loom/error.hpp>
#include <loom/schedule/detail/own_sample.hpp>

namespace loom {

/// Where a collate happens: the device, the step, the generator of each sample, and (from the
/// loaders, for DefaultCollate) the batch the samples' data were already copied into.
///
/// Example: `CollateContext{.device = 1, .step = 7, .generators = ids}`; ids[i] produced sample i.
/// Units: device is a logical device index (in the per-rank mode: the rank); step counts batches
/// from 0 (from the resumed step when resuming); generator ids index the loader's generators.
/// Rows: when `rows` is defined, it is a contiguous N x (sample shape) tensor holding the samples'
/// data, row i = sample i's: the loaders copy each sample's data tensor into its row of a pooled
/// buffer as it arrives (the one copy collation needs) and leave an undefined tensor in its place
/// in the sample. DefaultCollate returns `rows` as the batch's data. The loaders set it only for
/// DefaultCollate without padding or a mask, reading samples with DefaultProjection, when every
/// generator of the device gave a sample of the first one's shape and dtype; otherwise it is
/// undefined and every sample holds its own data tensor.
struct CollateContext {
  int device = 0;
  std::int64_t step = 0;
  std::span<const int> generators;  ///< generator id of each sample, same length as the samples
  at::Tensor rows{};                ///< N x (sample shape), row i = sample i's data; or undefined
};

/// A callable that collates one device's samples of one step into a batch of type B: the collate
/// step of GeneratorLoader and RankGeneratorLoader (their `Collate` parameter).
///
/// Example: `[](std::span<at::Tensor> s, const loom::CollateContext&) { return at::stack(...); }`
///
/// Requirements:
///  1. `f(std::span<S> samples, const CollateContext& ctx)` returns a move-constructible object
///     type B. Reason: B travels from the worker thread through the prefetch queue to the consumer.
///     The samples are passed as a mutable span so the collate function may move from them; the
///     loader destroys them right after the call.
///  2. F is copy-constructible. Reason: each device gets its own copy, so a collate function may
///     keep reusable buffers without locks.
///  3. The call may throw; the exception reaches the consumer's thread unchanged (it is a
///     data-layout error of the user's, e.g. two shapes in one stacked batch).
///  4. A batch may keep the samples' tensors instead of copying them: the tensors loom reads are
///     the samples' own by then (see "Reuse" at CallableSampleGenerator, loom/schedule/generator.hpp);
///     other tensors are only as stable as the generator keeps them. Reason: the batch waits in
///     the prefetch queue while the generator runs on.
/// Not required: default construction of F, thread safety of one F object, a particular B.
/// Optional: `f.empty(ctx)` returning B: the batch a device with no rows left gets under
/// EndPolicy::drain (without it, a value-initialised B{} is used).
template <class F, class S>
concept CollateFunction = std::copy_constructible<F> &&
    requires(F& f, std::span<S> samples, const CollateContext& ctx) {
  { f(samples, ctx) } -> std::move_constructible;
};

/// The batch type a collate function F makes from samples of type S.
template <class F, class S>
requires CollateFunction<F, S>
using collate_result_t = std::remove_cvref_t<std::invoke_result_t<F&, std::span<S>, const CollateContext&>>;

/// The default collate function: loom::collate over the k-th samples of a device.
///
/// Example: `loom::DefaultCollate<>{.pad = true, .options = {.mask = true}}` as the third argument of
///          `loom::GeneratorLoader<Gen, loom::DefaultCollate<>>`.
/// Shape: data N x (sample shape) in the samples' dtype — with `pad`, N x options.padded_shape (or
///        the step's per-dimension maximum) and, with options.mask, a bool mask like data (true =
///        real); targets as loom::collate makes them (int64 N-vector for integer targets);
///        indices[i] = the projection's index(s) when it has one, else the generator id of row i;
///        num_samples = N; weight = 1 (0 for the empty batch of a device that ran dry under drain).
/// Throws: loom::InvalidArgument naming the device, step and generators when, without `pad`, two
///         samples differ in shape or dtype; loom::collate's errors (undefined or non-CPU data, a
///         zero-size dimension, different dtypes or target kinds, a sample larger than
///         padded_shape), prefixed with the device and step ("sample i" there = generator id i).
/// Storage: given CollateContext::rows (the loaders give it without `pad` and a mask), the
///        batch's data is `rows` itself and targets are a small new tensor; otherwise
///        loom::collate allocates from options.pool / options.allocate. The loaders give each
///        device's copy a BufferPool of prefetch_depth + 2 buffers when options names neither,
///        so batch memory is reused across steps (a batch the consumer keeps stays its own).
/// Source: loom::collate (copy once into preallocated storage; padding and masks).
template <class Projection = DefaultProjection>
struct DefaultCollate {
  bool pad = false;          ///< false: one shape and dtype per batch required; true: pad as loom::collate does
  CollateOptions options{};  ///< padded_shape, pad_value, mask, pool, allocate (see loom::collate)
  Projection projection{};   ///< reads data / target (/ index) from a sample

  template <class S>
  requires SampleProjection<Projection, S> Batch operator()(std::span<S> samples, const CollateContext& ctx) const {
    LOOM_ASSERT(samples.size() == ctx.generators.size(), "one generator id per sample");
    LOOM_ASSERT(!samples.empty(), "a device step has at least one sample");
    if (!pad) {
      const at::Tensor& first = projection.data(samples[0]);
      for (std::size_t i = 1; i < samples.size(); ++i) {
        const at::Tensor& t = projection.data(samples[i]);
        if (first.defined() && t.defined() && (t.sizes() != first.sizes() || t.scalar_type() != first.scalar_type()))
          throw InvalidArgument(
              fmt::format("DefaultCollate: device {}, step {}: generator {} gave a data tensor of shape [{}] {}, "
                          "generator {} gave [{}] {}; "
                          "one batch needs one shape and dtype (collate with padding: DefaultCollate{{.pad = true}})",
                          ctx.device, ctx.step, ctx.generators[0], fmt::join(first.sizes(), ", "),
                          c10::toString(first.scalar_type()), ctx.generators[i], fmt::join(t.sizes(), ", "),
                          c10::toString(t.scalar_type())));
      }
    }
    std::vector<int64_t> indices(samples.size());
    for (std::size_t i = 0; i < samples.size(); ++i) {
      if constexpr (SampleProjectionWithIndex<Projection, S>)
        indices[i] = static_cast<int64_t>(projection.index(samples[i]));
      else
        indices[i] = ctx.generators[i];
    }
    if (ctx.rows.defined()) {
      if (accepts_rows()) {
        if (std::optional<Batch> b = from_rows(samples, ctx.rows, indices)) return std::move(*b);
      }
      restore_rows(samples, ctx.rows);
    }
    try {
      return collate(samples, std::span<const int64_t>(indices), options, projection);
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(
          fmt::format("DefaultCollate: device {}, step {} (sample index = {}): {}", ctx.device, ctx.step,
                      SampleProjectionWithIndex<Projection, S> ? "the sample's index" : "generator id", e.what()));
    }
  }

  /// The batch of a device with no rows left (EndPolicy::drain): undefined tensors, 0 samples, weight 0.
  Batch empty(const CollateContext& /*ctx*/) const {
    Batch b;
    b.weight = 0.0;
    return b;
  }

  /// Whether this collate takes CollateContext::rows as the batch's data: without padding, a
  /// padded_shape or a mask (each of which changes the layout).
  [[nodiscard]] bool accepts_rows() const noexcept { return !pad && options.padded_shape.empty() && !options.mask; }

 private:
  // The batch whose data is `rows` (see CollateContext::rows: the samples' data tensors are
  // undefined, their data is in rows), when the targets stack: all none, all integers, or tensors
  // of one shape and dtype; std::nullopt otherwise (loom::collate then decides, and names any error).
  template <class S>
  std::optional<Batch> from_rows(std::span<S> samples, const at::Tensor& rows, std::vector<int64_t>& indices) const {
    const auto n = static_cast<int64_t>(samples.size());
    if (rows.dim() < 2 || rows.size(0) != n || !rows.is_contiguous() || !rows.is_cpu()) return std::nullopt;
    for (int64_t d : rows.sizes().slice(1))
      if (d <= 0) return std::nullopt;
    for (std::size_t i = 0; i < samples.size(); ++i)
      if (projection.data(samples[i]).defined()) return std::nullopt;
    Batch b;
    using Target = std::remove_cvref_t<decltype(projection.target(samples[0]))>;
    if constexpr (!std::same_as<Target, NoTarget>) {
      std::vector<detail::TargetValue> targets;
      targets.reserve(samples.size());
      for (std::size_t i = 0; i < samples.size(); ++i) {
        try {
          targets.push_back(detail::to_target_value(projection.target(samples[i]), indices[i], ""));
        } catch (const InvalidArgument&) {
          return std::nullopt;  // an undefined or non-CPU target: loom::collate names it
        }
        const detail::TargetValue& first = targets.front();
        const detail::TargetValue& v = targets.back();
        if (v.kind != first.kind) return std::nullopt;
        if (v.kind == detail::TargetValue::Kind::tensor &&
            (v.tensor.sizes() != first.tensor.sizes() || v.tensor.scalar_type() != first.tensor.scalar_type()))
          return std::nullopt;
      }
      if (targets.front().kind == detail::TargetValue::Kind::integer) {
        b.targets = at::empty({n}, at::TensorOptions(at::kLong));
        auto* out = b.targets.data_ptr<int64_t>();
        for (std::size_t i = 0; i < targets.size(); ++i) out[i] = targets[i].integer;
      } else if (targets.front().kind == detail::TargetValue::Kind::tensor) {
        std::vector<at::Tensor> ts;
        ts.reserve(targets.size());
        for (const auto& v : targets) ts.push_back(v.tensor);
        b.targets = at::stack(ts);
      }
    }
    b.data = rows;
    b.indices = std::move(indices);
    b.num_samples = n;
    return b;
  }

  // Gives each sample whose data tensor is undefined row i of `rows` back as its data (a view),
  // so loom::collate reads the samples as the generators gave them.
  template <class S>
  static void restore_rows(std::span<S> samples, const at::Tensor& rows) {
    if constexpr (requires(S & s) {
                    { detail::data_tensor(s) } -> std::same_as<at::Tensor*>;
                  }) {
      for (std::size_t i = 0; i < samples.size() && static_cast<int64_t>(i) < rows.size(0); ++i) {
        at::Tensor* t = detail::data_tensor(samples[i]);
        if (t != nullptr && !t->defined()) *t = rows.select(0, static_cast<int64_t>(i));
      }
    }
  }
};

namespace detail {
/// True for loom::DefaultCollate<P>: the loaders give it a buffer pool and staged rows.
template <class C>
inline constexpr bool is_default_collate = false;
template <class P>
inline constexpr bool is_default_collate<DefaultCollate<P>> = true;
}  // namespace detail

}  // namespace loom
