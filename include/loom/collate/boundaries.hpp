// loom/collate/boundaries.hpp — bucket boundaries that minimise padding, chosen from a size histogram.
//
// Example:
//   std::map<int64_t, int64_t> lengths{{10, 50}, {12, 30}, {40, 5}, {100, 2}};   // size -> count
//   loom::BoundaryPlan plan = loom::auto_boundaries(lengths, 2);
//   // plan.boundaries == {12, 100}: 80 x 12 + 7 x 100 = 1660 padded elements for 1260 real ones
//   loom::PaddedBucketOptions o{.pad = {{.dim = 0, .boundaries = plan.boundaries}}, .max_elements = 4096};
//
// Units: sizes in elements along the padded dimension; counts in samples; costs in elements (per
//        padded dimension: multiply by the unpadded ones, channels or features, yourself).
// Guide: docs/collate.md#automatic-boundaries-loomcollateboundarieshpp.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <map>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <loom/error.hpp>

namespace loom {

/// Bucket edges and their padding cost on a histogram.
///
/// Example: `plan.padding_fraction()` is 1 - real / padded elements, in [0, 1).
/// Units: elements, size^exponent per sample (the unpadded dimensions left out).
struct BoundaryPlan {
  std::vector<int64_t> boundaries{};  ///< ascending upper edges; the last is the largest size
  int64_t real_elements = 0;          ///< sum over samples of size^exponent
  int64_t padded_elements = 0;        ///< sum over samples of boundary^exponent

  [[nodiscard]] double padding_fraction() const noexcept {
    return padded_elements == 0 ? 0.0 : 1.0 - static_cast<double>(real_elements) / static_cast<double>(padded_elements);
  }
};

namespace detail {
inline int64_t ipow_checked(int64_t base, int exponent) {
  int64_t r = 1;
  for (int i = 0; i < exponent; ++i)
    if (__builtin_mul_overflow(r, base, &r))
      throw InvalidArgument(fmt::format("boundaries: {}^{} overflows int64", base, exponent));
  return r;
}
inline int64_t mul_checked(int64_t a, int64_t b) {
  int64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r)) throw InvalidArgument(fmt::format("boundaries: {} x {} overflows int64", a, b));
  return r;
}
inline void check_histogram(const std::map<int64_t, int64_t>& histogram, int exponent) {
  if (histogram.empty()) throw InvalidArgument("boundaries: the size histogram is empty (no samples)");
  if (exponent < 1) throw InvalidArgument(fmt::format("boundaries: exponent = {} must be >= 1", exponent));
  for (const auto& [size, count] : histogram) {
    if (size <= 0) throw InvalidArgument(fmt::format("boundaries: size {} in the histogram must be positive", size));
    if (count < 0) throw InvalidArgument(fmt::format("boundaries: size {} has a negative count {}", size, count));
  }
}
}  // namespace detail

/// The padding cost of given boundaries on a histogram.
///
/// Example: `loom::evaluate_boundaries({{10, 3}, {20, 1}}, {32}).padded_elements == 128`.
/// Throws: loom::InvalidArgument for a bad histogram, unsorted boundaries, or a size above the last boundary.
inline BoundaryPlan evaluate_boundaries(const std::map<int64_t, int64_t>& histogram, std::vector<int64_t> boundaries,
                                        int exponent = 1) {
  detail::check_histogram(histogram, exponent);
  for (std::size_t i = 1; i < boundaries.size(); ++i)
    if (boundaries[i] <= boundaries[i - 1])
      throw InvalidArgument(fmt::format("boundaries [{}] must be strictly increasing", fmt::join(boundaries, ", ")));
  BoundaryPlan plan{std::move(boundaries), 0, 0};
  for (const auto& [size, count] : histogram) {
    auto it = std::lower_bound(plan.boundaries.begin(), plan.boundaries.end(), size);
    if (it == plan.boundaries.end())
      throw InvalidArgument(
          fmt::format("size {} is above the last boundary ({})", size,
                      plan.boundaries.empty() ? std::string("none") : std::to_string(plan.boundaries.back())));
    plan.real_elements += detail::mul_checked(count, detail::ipow_checked(size, exponent));
    plan.padded_elements += detail::mul_checked(count, detail::ipow_checked(*it, exponent));
  }
  return plan;
}

/// Boundaries that round every size up to a multiple of `multiple` (the distinct rounded sizes).
///
/// Example: `loom::round_up_boundaries({{8, 1}, {24, 1}, {48, 1}}, 32) == std::vector<int64_t>{32, 64}`.
/// Throws: loom::InvalidArgument for a bad histogram or multiple < 1.
inline std::vector<int64_t> round_up_boundaries(const std::map<int64_t, int64_t>& histogram, int64_t multiple) {
  detail::check_histogram(histogram, 1);
  if (multiple < 1) throw InvalidArgument(fmt::format("round_up_boundaries: multiple = {} must be >= 1", multiple));
  std::vector<int64_t> b;
  for (const auto& [size, count] : histogram) {
    const int64_t r = (size + multiple - 1) / multiple * multiple;
    if (b.empty() || b.back() != r) b.push_back(r);
  }
  return b;
}

/// At most `num_buckets` boundaries minimising padded elements on `histogram` (exact DP);
/// `exponent` is the number of dimensions padded to the same boundary (1 sequences, 2 square images).
///
/// Example: `loom::auto_boundaries({{10, 50}, {12, 30}, {40, 5}, {100, 2}}, 2).boundaries`
///          == std::vector<int64_t>{12, 100}.
/// Shape: boundaries ascending; each is a size present in the histogram; the last is the largest size.
/// Cost: O(k m^2) time, O(k m) memory for m distinct sizes (m = 4096 and k = 16: ~0.3 s).
/// Throws: loom::InvalidArgument for an empty histogram, a size <= 0, a count < 0, num_buckets < 1,
///         exponent < 1, or an element count that overflows int64 — naming the value.
/// Source: the exact DP for 1-D optimal partitioning (as in optimal histogram / Jenks-style
///         segmentation); the padding criterion is that of tf.data's bucket_by_sequence_length.
inline BoundaryPlan auto_boundaries(const std::map<int64_t, int64_t>& histogram, int64_t num_buckets,
                                    int exponent = 1) {
  detail::check_histogram(histogram, exponent);
  if (num_buckets < 1)
    throw InvalidArgument(fmt::format("auto_boundaries: num_buckets = {} must be >= 1", num_buckets));
  std::vector<int64_t> sizes, weights, cum{0};  // weights: size^exponent; cum: prefix sums of counts
  for (const auto& [size, count] : histogram) {
    if (count == 0) continue;
    sizes.push_back(size);
    weights.push_back(detail::ipow_checked(size, exponent));
    cum.push_back(cum.back() + count);
  }
  if (sizes.empty()) throw InvalidArgument("auto_boundaries: every count in the histogram is 0");
  const auto m = static_cast<int64_t>(sizes.size());
  const int64_t k = std::min(num_buckets, m);
  constexpr int64_t kInf = std::numeric_limits<int64_t>::max();
  // best[g][j]: least cost of the first j sizes in exactly g groups; cut[g][j]: start of the last group.
  std::vector<std::vector<int64_t>> best(static_cast<std::size_t>(k + 1),
                                         std::vector<int64_t>(static_cast<std::size_t>(m + 1), kInf));
  std::vector<std::vector<int64_t>> cut(static_cast<std::size_t>(k + 1),
                                        std::vector<int64_t>(static_cast<std::size_t>(m + 1), 0));
  best[0][0] = 0;
  for (int64_t g = 1; g <= k; ++g) {
    auto& bg = best[static_cast<std::size_t>(g)];
    const auto& prev = best[static_cast<std::size_t>(g - 1)];
    for (int64_t j = g; j <= m; ++j) {
      const int64_t w = weights[static_cast<std::size_t>(j - 1)];
      for (int64_t i = g - 1; i < j; ++i) {
        if (prev[static_cast<std::size_t>(i)] == kInf) continue;
        const int64_t c = prev[static_cast<std::size_t>(i)] +
                          detail::mul_checked(w, cum[static_cast<std::size_t>(j)] - cum[static_cast<std::size_t>(i)]);
        if (c < bg[static_cast<std::size_t>(j)]) {
          bg[static_cast<std::size_t>(j)] = c;
          cut[static_cast<std::size_t>(g)][static_cast<std::size_t>(j)] = i;
        }
      }
    }
  }
  int64_t g_best = 1;
  for (int64_t g = 1; g <= k; ++g)
    if (best[static_cast<std::size_t>(g)][static_cast<std::size_t>(m)] <
        best[static_cast<std::size_t>(g_best)][static_cast<std::size_t>(m)])
      g_best = g;
  std::vector<int64_t> edges;
  for (int64_t g = g_best, j = m; g > 0; --g) {
    edges.push_back(sizes[static_cast<std::size_t>(j - 1)]);
    j = cut[static_cast<std::size_t>(g)][static_cast<std::size_t>(j)];
  }
  std::reverse(edges.begin(), edges.end());
  return evaluate_boundaries(histogram, std::move(edges), exponent);
}

}  // namespace loom
