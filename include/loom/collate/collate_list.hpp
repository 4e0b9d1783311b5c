// loom/collate/collate_list.hpp — loom::collate: one batch from a given list of samples (the
// samples of a batch a bucket batch sampler planned, the k-th samples of a device's generators).
//
// Example:
//   std::vector<std::pair<at::Tensor, int64_t>> s = {{at::ones({2}), 3}, {at::ones({3}), 4}};
//   std::vector<int64_t> ids = {10, 11};
//   loom::Batch b = loom::collate(s, ids, {.mask = true});
//   // b.data 2 x 3 float32 [[1, 1, 0], [1, 1, 1]]; b.mask like it, true = real; b.targets {3, 4}
//
// Reading: a std::vector of samples (a forward range of lvalues) is read in place; any other range
// has each sample copied as the walk reaches it, so a view over one reused buffer must yield
// samples by value. Guide: docs/collate.md#storage-read-on-arrival-reuse-buffers-loomcollatepoolhpp.
// Source: like a DataLoader collate_fn (torch.utils.data.default_collate), but copying into one
// preallocated buffer instead of stacking; padding to the batch's maximum as in
// torch.nn.utils.rnn.pad_sequence.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <memory>
#include <ranges>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <fmt/format.h>
#include <range/v3/range/concepts.hpp>

#include <loom/collate/batch.hpp>
#include <loom/collate/detail/batch_writer.hpp>
#include <loom/collate/detail/rows.hpp>
#include <loom/collate/detail/sample_read.hpp>
#include <loom/collate/detail/staged_samples.hpp>
#include <loom/collate/pool.hpp>
#include <loom/collate/sample.hpp>
#include <loom/error.hpp>

namespace loom {

/// Options of collate(): one batch from a given list of samples.
///
/// Example: `loom::CollateOptions{.padded_shape = {3, 64, 64}, .mask = true}`.
/// Shape: padded_shape excludes the batch dimension; empty = the per-dimension maximum of the samples.
/// Units: pad_value is converted to the samples' dtype.
struct CollateOptions {
  std::vector<int64_t> padded_shape{};  ///< pad every sample to this shape (empty: the samples' max)
  double pad_value = 0.0;               ///< value written into padding
  bool mask = false;                    ///< emit Batch::mask (bool, true = real)
  std::shared_ptr<BufferPool> pool{};   ///< reuse storage from this pool
  BatchAllocator allocate{};            ///< allocates storage when there is no pool (empty: at::empty)
};

/// The sample type of a list: what dereferencing its iterator gives, without references and const.
template <class R>
using list_sample_t = std::remove_cvref_t<decltype(*std::begin(std::declval<const R&>()))>;

/// A list collate() takes with projection P: a forward range (walked twice: counted, then read)
/// whose elements P reads.
///
/// Requirements:
///  1. `std::ranges::forward_range<const R>` or range-v3's `ranges::forward_range<const R>`.
///     Reason: collate counts the samples before it reads them; a single-pass range would be used
///     up by the count. (range-v3's views do not model the std concepts under GCC 12.)
///  2. `SampleProjection<P, list_sample_t<R>>`. Reason: collate reads data and target through P
///     (see sample.hpp).
/// Not required: a sized or random-access range; elements that are lvalues (those are read in
/// place, others are copied on arrival).
template <class R, class P>
concept CollatableRange = (std::ranges::forward_range<const R> ||
                           ranges::forward_range<const R>)&&SampleProjection<P, list_sample_t<R>>;

/// Collates a given list of samples into one Batch (e.g. the samples of a PlannedBatch that a
/// bucket batch sampler chose): each sample padded to one shape (given, or the per-dimension
/// maximum) and copied once into the batch storage, by the bucket collators' kernel.
///
/// Example: `auto b = loom::collate(samples, planned.indices, {.padded_shape = planned.padded_shape});`
/// Shape: data N x padded shape (samples' dtype), targets an int64 N-vector (integer targets) or
///        N x target shape, mask (bool, like data, true = real) when asked; indices as given;
///        num_samples = N; weight = 1.
/// Throws: loom::InvalidArgument for an empty list, indices of a different length, data that is
///         undefined or not on the CPU, samples that differ in number of dimensions, dtype or
///         target kind / shape / dtype, a zero-size dimension, or a sample larger than
///         padded_shape; each message names the sample index.
/// Source: torch.utils.data.default_collate, copying instead of stacking; torch.nn.utils.rnn.pad_sequence.
template <class Range, class Projection = DefaultProjection>
requires CollatableRange<Range, Projection> Batch collate(const Range& samples, std::span<const int64_t> indices,
                                                          const CollateOptions& o = {}, const Projection& proj = {}) {
  using Reference = decltype(*std::begin(samples));
  // The samples outlive the walk (and stay unchanged) only when the range stores them.
  constexpr bool kStable = std::is_lvalue_reference_v<Reference> &&
                           std::is_lvalue_reference_v<decltype(proj.data(std::declval<Reference>()))>;
  int64_t n = 0;
  for (auto it = std::begin(samples), end = std::end(samples); it != end; ++it) ++n;
  if (n == 0) throw InvalidArgument("collate: the list of samples is empty");
  if (static_cast<int64_t>(indices.size()) != n)
    throw InvalidArgument(fmt::format("collate: {} samples but {} indices", n, indices.size()));
  std::vector<detail::SampleRead> held;  // kStable: the samples' own (contiguous) tensors
  detail::StagedSamples staged;          // otherwise: copies made on arrival
  if constexpr (kStable) held.reserve(static_cast<std::size_t>(n));
  detail::BatchLayout layout;
  layout.padded = o.padded_shape;
  layout.mask = o.mask;
  const bool given = !layout.padded.empty();
  std::vector<int64_t> first_shape;
  std::size_t i = 0;
  for (const auto& s : samples) {
    const int64_t index = indices[i];
    detail::SampleRead read = detail::read_sample(proj, s, index, "collate: ");
    const at::Tensor& t = read.data();
    for (int64_t d : t.sizes())
      if (d <= 0)
        throw InvalidArgument(fmt::format("collate: sample {} has shape {}: a zero-size dimension cannot be batched",
                                          index, detail::shape_str(t.sizes())));
    const detail::TargetValue& target = read.target;
    if (i == 0) {
      first_shape.assign(t.sizes().begin(), t.sizes().end());
      layout.dtype = t.scalar_type();
      layout.target_kind = target.kind;
      if (target.kind == detail::TargetValue::Kind::tensor) {
        layout.target_shape.assign(target.tensor.sizes().begin(), target.tensor.sizes().end());
        layout.target_dtype = target.tensor.scalar_type();
      }
    } else {
      if (t.dim() != static_cast<int64_t>(first_shape.size()))
        throw InvalidArgument(fmt::format("collate: sample {} has shape {}, but sample {} has {}", index,
                                          detail::shape_str(t.sizes()), indices[0], detail::shape_str(first_shape)));
      if (t.scalar_type() != layout.dtype)
        throw InvalidArgument(fmt::format("collate: sample {} has dtype {}, but sample {} has {}", index,
                                          c10::toString(t.scalar_type()), indices[0], c10::toString(layout.dtype)));
      if (target.kind != layout.target_kind || (target.kind == detail::TargetValue::Kind::tensor &&
                                                (target.tensor.sizes() != c10::IntArrayRef(layout.target_shape) ||
                                                 target.tensor.scalar_type() != layout.target_dtype)))
        throw InvalidArgument(
            fmt::format("collate: sample {}: its target is {}, but sample {}'s is {}", index,
                        detail::target_text(target.kind, target.tensor), indices[0],
                        detail::target_text(layout.target_kind, layout.target_shape, layout.target_dtype)));
    }
    if (!given) {
      if (layout.padded.empty()) layout.padded.assign(t.sizes().begin(), t.sizes().end());
      for (std::size_t d = 0; d < layout.padded.size(); ++d)
        layout.padded[d] = std::max(layout.padded[d], t.sizes()[d]);
    } else {
      bool fits = static_cast<std::size_t>(t.dim()) == layout.padded.size();
      for (std::size_t d = 0; fits && d < layout.padded.size(); ++d) fits = t.sizes()[d] <= layout.padded[d];
      if (!fits)
        throw InvalidArgument(fmt::format("collate: sample {} with shape {} does not fit padded_shape {}", index,
                                          detail::shape_str(t.sizes()), detail::shape_str(layout.padded)));
    }
    if constexpr (kStable)
      held.push_back(std::move(read));
    else
      staged.push(t, target);
    ++i;
  }
  layout.pad = detail::ElementPattern(o.pad_value, layout.dtype);
  detail::BatchWriter writer(layout, n, detail::StorageSource{o.pool, o.allocate});
  for (std::size_t r = 0; r < static_cast<std::size_t>(n); ++r) {
    if constexpr (kStable)
      writer.write(static_cast<int64_t>(r), held[r].data(), held[r].target);
    else
      writer.write(static_cast<int64_t>(r), staged.data(r), staged.sizes(r), staged.target(r));
  }
  return std::move(writer).finish(n, std::vector<int64_t>(indices.begin(), indices.end()));
}

}  // namespace loom
