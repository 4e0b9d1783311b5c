// loom/collate/batch_rules.hpp — the batching rules in one place: padding, the batch limits, the
// multiple, partial and oversize batches. Every bucketing part reads them from here: the
// collators' BucketPlanner, DistributedBucketBatchSampler and GlobalBatchSampler / plan_epoch,
// whose options carry the same fields (so designated initializers stay flat) and hand them over
// with batch_rules(options). Their checks and their share of a sampler's fingerprint live here too.
//
// Example:
//   loom::BatchRules rules = loom::batch_rules(loom::PaddedBucketOptions{.pad = {{.dim = 0}}, .max_elements = 4096});
//   rules.check();                                  // throws for bad values
//   loom::BucketPlanner planner(rules);             // plans with exactly these rules
//
// Units: as loom/collate/options.hpp (samples; padded elements, not bytes).
// Errors: check() throws loom::InvalidArgument naming the option and its value (see options.hpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <loom/collate/options.hpp>
#include <loom/detail/hash.hpp>
#include <loom/error.hpp>

namespace loom {

/// The batching fields of ShapeBucketOptions, PaddedBucketOptions, BucketBatchSamplerOptions and
/// GlobalBatchOptions (their meanings: loom/collate/options.hpp). An empty `pad` means exact-shape
/// buckets.
struct BatchRules {
  std::vector<DimPadding> pad{};          ///< padded dimensions; empty: exact-shape buckets
  std::optional<int64_t> max_samples{};   ///< samples per batch (> 0)
  std::optional<int64_t> max_elements{};  ///< padded elements per batch (> 0)
  int64_t multiple_of = 1;                ///< budget-closed batches keep a multiple of this many samples
  bool drop_incomplete = false;           ///< drop (and count) partial batches at the end
  OversizePolicy on_oversize = OversizePolicy::raise;

  /// Throws loom::InvalidArgument for max_samples <= 0, max_elements <= 0, neither set,
  /// multiple_of < 1, max_samples not a multiple of multiple_of, a negative padding multiple,
  /// boundaries and a multiple on one dimension, or boundaries not positive and increasing.
  void check() const {
    if (max_samples && *max_samples <= 0)
      throw InvalidArgument(fmt::format("max_samples = {}: a batch must hold at least one sample", *max_samples));
    if (max_elements && *max_elements <= 0)
      throw InvalidArgument(fmt::format("max_elements = {}: the element budget must be positive", *max_elements));
    if (!max_samples && !max_elements)
      throw InvalidArgument("neither max_samples nor max_elements is set: a batch needs a limit");
    if (multiple_of < 1) throw InvalidArgument(fmt::format("multiple_of = {}: must be >= 1", multiple_of));
    if (max_samples && *max_samples % multiple_of != 0)
      throw InvalidArgument(
          fmt::format("max_samples = {} is not a multiple of multiple_of = {}", *max_samples, multiple_of));
    for (std::size_t i = 0; i < pad.size(); ++i) {
      const DimPadding& p = pad[i];
      if (p.multiple < 0)
        throw InvalidArgument(fmt::format("pad[{}] (dim {}): multiple = {} is negative", i, p.dim, p.multiple));
      if (p.multiple > 0 && !p.boundaries.empty())
        throw InvalidArgument(fmt::format("pad[{}] (dim {}): give boundaries or a multiple, not both", i, p.dim));
      for (std::size_t b = 0; b < p.boundaries.size(); ++b) {
        if (p.boundaries[b] <= 0 || (b > 0 && p.boundaries[b] <= p.boundaries[b - 1]))
          throw InvalidArgument(
              fmt::format("pad[{}] (dim {}): boundaries [{}] must be positive and strictly increasing", i, p.dim,
                          fmt::join(p.boundaries, ", ")));
      }
    }
  }

  /// Folds the limits (max_samples, max_elements, multiple_of, drop_incomplete, on_oversize) into
  /// a sampler's fingerprint; an unset limit counts as -1.
  void add_limits_to(detail::Fnv1a& f) const {
    f.add(static_cast<uint64_t>(max_samples.value_or(-1)));
    f.add(static_cast<uint64_t>(max_elements.value_or(-1)));
    f.add(static_cast<uint64_t>(multiple_of));
    f.add(drop_incomplete ? 1 : 0);
    f.add(static_cast<uint64_t>(on_oversize));
  }

  /// Folds the padded dimensions into a sampler's fingerprint (each ends with an all-ones word).
  void add_padding_to(detail::Fnv1a& f) const {
    for (const DimPadding& p : pad) {
      f.add(static_cast<uint64_t>(p.dim));
      f.add(static_cast<uint64_t>(p.multiple));
      for (int64_t x : p.boundaries) f.add(static_cast<uint64_t>(x));
      f.add(~uint64_t{0});
    }
  }
};

/// Folds the dataset's sample shapes into a sampler's fingerprint (each ends with an all-ones word).
inline void add_shapes_to(detail::Fnv1a& f, const std::vector<std::vector<int64_t>>& shapes) {
  for (const auto& s : shapes) {
    for (int64_t x : s) f.add(static_cast<uint64_t>(x));
    f.add(~uint64_t{0});
  }
}

/// An options aggregate that carries the batch limits (and, when it pads, `pad`).
template <class O>
concept HasBatchRules = requires(const O& o) {
  o.max_samples;
  o.max_elements;
  o.multiple_of;
  o.drop_incomplete;
  o.on_oversize;
};

/// The batching rules of `o` (its `pad` when it has one, else exact-shape buckets). Not checked:
/// call check(), or give them to a BucketPlanner, which checks them.
template <HasBatchRules O>
BatchRules batch_rules(const O& o) {
  BatchRules r{.pad = {},
               .max_samples = o.max_samples,
               .max_elements = o.max_elements,
               .multiple_of = o.multiple_of,
               .drop_incomplete = o.drop_incomplete,
               .on_oversize = o.on_oversize};
  if constexpr (requires { o.pad; }) r.pad = o.pad;
  return r;
}

}  // namespace loom
