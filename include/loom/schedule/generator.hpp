// loom/schedule/generator.hpp — the SampleGenerator concept ladder: a source that yields one
// sample at a time, may end, and may throw.
//
// A generator is a time-correlated stream (a simulator, a sensor log, a video, a market feed):
// the loader asks it for its next sample, in order, from one thread at a time, and never asks
// again once it has ended.
//
// Example:
//   int k = 0;
//   auto counter = [k]() mutable -> std::optional<at::Tensor> {        // a callable generator
//     if (k == 100) return std::nullopt;                              // ends after 100 samples
//     return at::full({3}, k++);
//   };
//   static_assert(loom::SampleGenerator<decltype(counter)>);
//   std::vector<at::Tensor> log = ...;
//   static_assert(loom::SampleGenerator<std::vector<at::Tensor>>);      // an input range is one too
//
// Ladder (each rung adds one capability):
//   CallableSampleGenerator  g() returns std::optional<Sample>; std::nullopt = end
//   RangeSampleGenerator     an input range of samples; its end = end of the stream
//   SampleGenerator          either of the two
//   SkippableSampleGenerator + g.skip(n): jump over n samples (makes resuming a schedule cheap)
//
// Source: the callable form follows the "optional next()" generator convention of C++ data
// loaders (e.g. torch::data::samplers' optional batch); the range form is std::ranges::input_range.
#pragma once

#include <concepts>
#include <cstdint>
#include <optional>
#include <ranges>
#include <type_traits>

namespace loom {

namespace detail {
template <class T>
struct is_optional : std::false_type {};
template <class T>
struct is_optional<std::optional<T>> : std::true_type {};
}  // namespace detail

/// A callable that returns the next sample as a `std::optional`, `std::nullopt` at the end.
///
/// Example: `[&]() -> std::optional<at::Tensor> { return sim.step(); }`
///
/// Requirements:
///  1. `g()` is valid on an lvalue `G&`. Reason: a generator keeps its position as state
///     (`mutable` lambdas, objects with an `operator()`), so the loader calls it on an lvalue.
///  2. It returns exactly `std::optional<S>` for some S. Reason: the empty optional is the one
///     unambiguous end-of-stream signal; a sentinel value inside S would be data.
///  3. S is an object type that is move-constructible. Reason: samples travel from the worker
///     thread to the collate step by move.
///  4. G is move-constructible. Reason: the loader takes ownership of its generators.
///  5. The tensors of a returned sample that the loader does not copy (see "Reuse" below) are
///     not overwritten by the generator's later calls. Reason: the loader holds up to
///     prefetch_depth samples of each generator until their step is collated, while the
///     generator runs ahead.
/// Reuse: a generator may decode every sample into one output tensor and return it (or a view
/// of it). On arrival, before the generator runs again, the loader copies what it reads from the
/// sample (a bare tensor, a (tensor, target) pair or 2-tuple, a struct's .data and tensor
/// .target). With DefaultCollate (no padding, no mask, DefaultProjection) the data tensor is
/// copied into its row of the step's pooled batch buffer and dropped from the sample: the one
/// copy collation makes anyway, whatever the generator returned (see CollateContext::rows).
/// Otherwise, and for a tensor target, a tensor is replaced by a copy unless it already owns its
/// memory (one handle, one tensor on its storage, allocated by a tensor allocator): a fresh
/// tensor per sample costs nothing, a reused buffer, a cached tensor or an element of an
/// in-memory dataset one copy per sample. Other tensors of a sample (other members, other sample
/// types) are not copied: requirement 5.
/// Not required: copyability, const-callability, thread safety (one thread calls a generator at
/// a time), noexcept (a generator may throw; the loader reports it), a known length.
template <class G>
concept CallableSampleGenerator =
    std::move_constructible<G> && std::invocable<G&> && detail::is_optional<std::invoke_result_t<G&>>::value &&
    std::move_constructible<typename std::invoke_result_t<G&>::value_type>;

/// An input range whose elements are the samples, in stream order.
///
/// Example: `std::vector<at::Tensor>`, or `std::views::iota(0, 10) | std::views::transform(load)`.
///
/// Requirements:
///  1. `std::ranges::input_range<G>`. Reason: samples are read once, front to back; a single-pass
///     range (an istream view, a network reader) is enough.
///  2. Its value type is move-constructible. Reason: the loader copies or moves each element
///     (by `S(*it)`) out of the range before collating.
///  3. G is move-constructible. Reason: the loader takes ownership of the range.
///  4. G is not also a CallableSampleGenerator. Reason: one type, one meaning.
/// Not required: forward or sized ranges, a range that can be walked twice, common ranges.
template <class G>
concept RangeSampleGenerator = std::move_constructible<G> && std::ranges::input_range<G> &&
    std::move_constructible<std::ranges::range_value_t<G>> &&
    std::constructible_from<std::ranges::range_value_t<G>, std::ranges::range_reference_t<G>> &&
    !CallableSampleGenerator<G>;

/// Anything that yields one sample at a time: a CallableSampleGenerator or a RangeSampleGenerator.
///
/// Example: `static_assert(loom::SampleGenerator<std::function<std::optional<at::Tensor>()>>);`
/// (std::function is the type-erased form for generators of different types in one schedule).
/// Throws: — (a concept). Generators themselves may throw; see GeneratorError in results.hpp.
template <class G>
concept SampleGenerator = CallableSampleGenerator<G> || RangeSampleGenerator<G>;

namespace detail {
template <class G>
struct generator_sample;
template <CallableSampleGenerator G>
struct generator_sample<G> {
  using type = typename std::invoke_result_t<G&>::value_type;
};
template <RangeSampleGenerator G>
struct generator_sample<G> {
  using type = std::ranges::range_value_t<G>;
};
}  // namespace detail

/// The sample type S that generator G yields.
///
/// Example: `loom::generator_sample_t<std::vector<int>>` is `int`.
template <SampleGenerator G>
using generator_sample_t = typename detail::generator_sample<G>::type;

/// A callable generator that can jump over samples without producing them.
///
/// Example: a log reader with `void skip(std::int64_t n) { offset_ += n * record_bytes_; }`.
///
/// Requirements:
///  1. CallableSampleGenerator<G>. Reason: a range's position lives in its iterator, which the
///     loader holds; a skip() on the range object could not move that iterator.
///  2. `g.skip(n)` with an `std::int64_t n >= 0` advances the stream by n samples, as if g had
///     been asked for n samples that were then dropped. Reason: resuming a schedule from a saved
///     state must not replay hours of a simulator; without skip(), loom replays (pulls and drops).
/// Not required: a return value; skipping past the end (then the next sample is the end).
template <class G>
concept SkippableSampleGenerator = CallableSampleGenerator<G> && requires(G& g, std::int64_t n) {
  g.skip(n);
};

}  // namespace loom
