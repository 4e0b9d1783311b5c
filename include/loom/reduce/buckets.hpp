// loom/reduce/buckets.hpp — how gradients are grouped into flat buckets: a pure function (no
// tensors, no communication), so the rule can be tested and reused by other reducers.
//
// Example: `auto buckets = loom::assign_buckets(specs, loom::reverse_order(specs.size()));`
// Units: caps in bytes; numel in elements; element_size in bytes.
// Guide: docs/reduce.md#buckets-views-overlap.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <numeric>
#include <span>
#include <vector>

#include <fmt/format.h>

#include <loom/error.hpp>

namespace loom {

/// One mebibyte, in bytes.
inline constexpr std::size_t kMiB = std::size_t{1} << 20;

/// What assign_buckets needs to know about one gradient.
///
/// Example: `loom::GradSpec{.numel = 2048, .element_size = 4, .kind = 0}` (a float32 gradient).
/// Units: numel in elements, element_size in bytes. `kind` is any integer that is equal for
/// gradients that may share a bucket (same dtype and device) and different otherwise.
struct GradSpec {
  std::int64_t numel = 0;         ///< elements
  std::int64_t element_size = 4;  ///< bytes per element
  std::int64_t kind = 0;          ///< dtype/device class; buckets never mix kinds
};

/// Byte caps of assign_buckets; use with designated initializers.
///
/// Example: `loom::BucketCaps{.first_bucket_cap_bytes = 1 * loom::kMiB, .bucket_cap_bytes = 25 * loom::kMiB}`.
/// Units: bytes. A bucket closes as soon as its size reaches the cap, so one gradient larger than
/// the cap gets a bucket of its own; nothing is ever split.
struct BucketCaps {
  std::size_t first_bucket_cap_bytes = 1 * kMiB;  ///< cap of the first bucket of each kind (filled first, sent first)
  std::size_t bucket_cap_bytes = 25 * kMiB;       ///< cap of every later bucket
};

/// The order {n-1, ..., 1, 0}: reverse registration order, the default launch order.
///
/// Example: `loom::reverse_order(3)` == {2, 1, 0}.
inline std::vector<std::size_t> reverse_order(std::size_t n) {
  std::vector<std::size_t> order(n);
  std::iota(order.rbegin(), order.rend(), std::size_t{0});
  return order;
}

/// Groups gradients into buckets: walks them in `order`, keeps one open bucket per kind, closes it
/// when it reaches its cap (the first of each kind has the smaller cap), and returns, per bucket in
/// launch order (by the position of its first gradient), the indices into `specs` it holds.
///
/// Example:
///   std::vector<loom::GradSpec> specs = {{.numel = 1000, .element_size = 4, .kind = 0},
///                                        {.numel = 3000, .element_size = 4, .kind = 0},
///                                        {.numel = 500,  .element_size = 8, .kind = 1}};
///   auto buckets = loom::assign_buckets(specs, loom::reverse_order(3),
///                                       {.first_bucket_cap_bytes = 2000, .bucket_cap_bytes = 1 << 20});
///   // {{2}, {1}, {0}}: 2 fills kind 1's first bucket; 1 (12000 bytes) alone passes kind 0's
///   // 2000-byte first cap; 0 opens the next kind-0 bucket, flushed at the end.
/// Shape: `order` is a permutation of 0..specs.size()-1 (the order gradients are expected to become
///        ready); every index appears in exactly one bucket.
/// Throws: loom::InvalidArgument when `order` is not a permutation (names the bad index), when a
///         cap is 0, or when a spec has numel < 0 or element_size < 1.
/// Source: PyTorch DDP's compute_bucket_assignment_by_size (size-capped, one dtype per bucket; the
///         reverse registration order because backward produces the last layer's gradients first).
inline std::vector<std::vector<std::size_t>> assign_buckets(std::span<const GradSpec> specs,
                                                            std::span<const std::size_t> order, BucketCaps caps = {}) {
  if (caps.first_bucket_cap_bytes == 0 || caps.bucket_cap_bytes == 0)
    throw InvalidArgument(
        fmt::format("assign_buckets: caps must be > 0 bytes (first_bucket_cap_bytes = {}, "
                    "bucket_cap_bytes = {})",
                    caps.first_bucket_cap_bytes, caps.bucket_cap_bytes));
  if (order.size() != specs.size())
    throw InvalidArgument(
        fmt::format("assign_buckets: order has {} entries for {} gradients", order.size(), specs.size()));
  std::vector<bool> seen(specs.size(), false);
  for (std::size_t i : order) {
    if (i >= specs.size() || seen[i])
      throw InvalidArgument(fmt::format("assign_buckets: order is not a permutation of 0..{} (index {} {})",
                                        specs.size() - 1, i, i >= specs.size() ? "is out of range" : "repeats"));
    seen[i] = true;
    if (specs[i].numel < 0 || specs[i].element_size < 1)
      throw InvalidArgument(fmt::format("assign_buckets: gradient {} has numel {} and element_size {}", i,
                                        specs[i].numel, specs[i].element_size));
  }

  struct Open {
    std::vector<std::size_t> members;
    std::size_t bytes = 0;
    bool first = true;  // the kind's first bucket: smaller cap
  };
  std::map<std::int64_t, Open> open;  // one open bucket per kind
  std::vector<std::vector<std::size_t>> closed;
  for (std::size_t i : order) {
    Open& b = open[specs[i].kind];
    b.members.push_back(i);
    b.bytes += static_cast<std::size_t>(specs[i].numel) * static_cast<std::size_t>(specs[i].element_size);
    const std::size_t cap = b.first ? caps.first_bucket_cap_bytes : caps.bucket_cap_bytes;
    if (b.bytes >= cap) {
      closed.push_back(std::move(b.members));
      b.members.clear();
      b.bytes = 0;
      b.first = false;
    }
  }
  for (auto& [kind, b] : open)
    if (!b.members.empty()) closed.push_back(std::move(b.members));

  // Launch order: by the position (in `order`) of each bucket's first gradient.
  std::vector<std::size_t> position(specs.size());
  for (std::size_t p = 0; p < order.size(); ++p) position[order[p]] = p;
  std::stable_sort(closed.begin(), closed.end(),
                   [&](const auto& a, const auto& b) { return position[a.front()] < position[b.front()]; });
  return closed;
}

}  // namespace loom
