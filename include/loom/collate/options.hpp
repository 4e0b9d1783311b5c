// loom/collate/options.hpp — what a bucketing collator (or the bucket batch sampler) is told:
// ShapeBucketOptions (exact-shape buckets) and PaddedBucketOptions (padded buckets).
//
// Example:
//   loom::ShapeBucketOptions exact{.max_samples = 64};
//   loom::PaddedBucketOptions tokens{.pad = {{.dim = 0}},                // pad to the batch's longest
//                                    .max_elements = 4096,             // padded tokens per batch
//                                    .multiple_of = 8};
//   loom::PaddedBucketOptions images{.pad = {{.dim = -2, .boundaries = {32, 64, 128}},
//                                            {.dim = -1, .boundaries = {32, 64, 128}}},
//                                    .max_samples = 32};
//
// Units: max_samples in samples; max_elements in *padded* elements (not bytes); set at least one.
// Throws: loom::InvalidArgument naming the option and its value, when the collator is built
//         (BatchRules::check lists them).
// Guide: docs/collate.md#collators (the limits, padding rules, partial batches).
// Source: budget semantics follow fairseq's data_utils.batch_by_size (max_tokens, required_batch_size_multiple),
//         with the cost taken as count x padded size as fairseq's num_tokens_fn does for padded batches.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include <loom/collate/pool.hpp>

namespace loom {

/// What happens to a sample whose padded size alone exceeds max_elements.
///
/// Example: `.on_oversize = loom::OversizePolicy::skip` (then CollateStats::skipped_oversize counts them).
/// Source: a sample is never truncated; fairseq raises for such samples unless told to skip them.
enum class OversizePolicy {
  raise,  ///< throw loom::InvalidArgument naming the sample index, its shape and the budget
  skip,   ///< leave the sample out and count it in CollateStats::skipped_oversize
};

/// How one sample dimension is padded in a padded bucket.
///
/// Example: `{.dim = -1, .multiple = 32}` pads the last dimension up to a multiple of 32;
///          `{.dim = 0, .boundaries = {16, 32, 64}}` sends a size 20 to the bucket of 32;
///          `{.dim = 0}` pads to the largest size in the batch (all sizes share one bucket).
/// Units: sizes in elements along `dim`. `dim` indexes the sample shape (no batch dimension);
///        negative values count from the end.
/// Throws: loom::InvalidArgument (when a sample arrives) for a size above the last boundary,
///         naming the sample index, the dimension, the size and the last boundary.
struct DimPadding {
  int64_t dim = 0;                    ///< sample dimension
  std::vector<int64_t> boundaries{};  ///< sorted, > 0: size s pads to the smallest boundary >= s
  int64_t multiple = 0;               ///< > 0: size s pads to s rounded up to a multiple
};

/// Options of exact-shape buckets: samples whose shapes are equal share a batch.
///
/// Example: `loom::ShapeBucketOptions{.max_samples = 4, .drop_incomplete = true}`.
/// Shape: every batch is N x (the shared sample shape); no mask.
/// Units: max_samples in samples, max_elements in elements (not bytes).
struct ShapeBucketOptions {
  std::optional<int64_t> max_samples{};   ///< samples per batch (> 0)
  std::optional<int64_t> max_elements{};  ///< elements per batch, count x sample numel (> 0)
  int64_t multiple_of = 1;                ///< budget-closed batches keep a multiple of this many samples
  bool drop_incomplete = false;           ///< drop (and count) partial batches at the end instead of emitting them
  OversizePolicy on_oversize = OversizePolicy::raise;
  std::shared_ptr<BufferPool> pool{};  ///< reuse batch buffers from this pool (null: a new buffer per batch)
  BatchAllocator allocate{};           ///< allocates batch buffers when there is no pool (empty: at::empty)
};

/// Options of padded buckets: sizes on the listed dimensions are padded, other dimensions must match.
///
/// Example: `loom::PaddedBucketOptions{.pad = {{.dim = 0}}, .pad_value = -1, .max_elements = 150}`.
/// Shape: every batch is N x (padded sample shape); `mask` has the same shape, dtype bool,
///        true = real element (emitted unless `mask` is false).
/// Units: as ShapeBucketOptions; pad_value is converted to the samples' dtype.
struct PaddedBucketOptions {
  std::vector<DimPadding> pad{};          ///< padded dimensions (at least one)
  double pad_value = 0.0;                 ///< value written into padding
  bool mask = true;                       ///< emit Batch::mask
  std::optional<int64_t> max_samples{};   ///< samples per batch (> 0)
  std::optional<int64_t> max_elements{};  ///< padded elements per batch (> 0)
  int64_t multiple_of = 1;
  bool drop_incomplete = false;
  OversizePolicy on_oversize = OversizePolicy::raise;
  std::shared_ptr<BufferPool> pool{};
  BatchAllocator allocate{};
};

/// What a collator (or planner) did so far: counts, in samples, batches and elements.
///
/// Example: `c.stats().dropped_incomplete == 4`; `c.stats().padding_fraction()` in [0, 1).
struct CollateStats {
  int64_t samples_in = 0;          ///< samples received
  int64_t samples_out = 0;         ///< samples emitted in batches
  int64_t batches_out = 0;         ///< batches emitted
  int64_t dropped_incomplete = 0;  ///< samples dropped with partial batches (drop_incomplete only)
  int64_t skipped_oversize = 0;    ///< samples skipped as larger than max_elements (OversizePolicy::skip only)
  int64_t real_elements = 0;       ///< elements of the emitted samples
  int64_t padded_elements = 0;     ///< elements of the emitted batches, padding included

  /// Share of emitted batch elements that are padding: 1 - real / padded (0 when nothing was emitted).
  [[nodiscard]] double padding_fraction() const noexcept {
    return padded_elements == 0 ? 0.0 : 1.0 - static_cast<double>(real_elements) / static_cast<double>(padded_elements);
  }
};

}  // namespace loom
