// loom/optim/detail/shard_layout.hpp — which elements of which parameters each rank's optimizer
// steps under loom::ShardedOptimizer: a pure function of the parameters' sizes and dtypes, the world
// size and a byte cap (no tensors, no communication), the same on every rank.
//
// Example:
//   auto layout = loom::detail::ShardLayout::build({1000, 10}, {at::kFloat, at::kFloat}, 2, 25 * loom::kMiB);
//   // one bucket of 1010 elements: rank 0 steps w[0, 448), rank 1 w[448, 1000) and all of b (10)
// Rule: the trainable parameters, in the optimizer's order, go into buckets of one dtype each, a
//   bucket closing once it holds `cap_bytes`; a bucket of T elements is cut into world_size
//   contiguous shards near T / world_size elements each; every cut falls on a multiple of
//   kShardAlignment elements from the start of the parameter it cuts, so a parameter's piece meets
//   the same vector and scalar-tail kernels as the whole parameter does (bit-identical updates).
//   Shards are of unequal size (a cut moves back to the alignment; a parameter smaller than the
//   alignment is never cut). Each rank's pieces lie end to end in its shard, and the all-gather of a
//   bucket exchanges `chunk` elements per rank (its longest shard).
// Units: elements.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include <c10/core/ScalarType.h>
#include <fmt/format.h>

#include <loom/error.hpp>

namespace loom::detail {

/// A cut between two ranks' shards falls on a multiple of this many elements from the start of the
/// parameter it cuts: a multiple of every CPU vector width ATen uses (2 x 16 floats) and of 16-byte
/// GPU vector loads.
inline constexpr std::int64_t kShardAlignment = 64;

/// One rank's part of one parameter: elements [offset, offset + length) in the parameter's storage
/// order, at `position` in the rank's shard of the bucket.
struct ShardPiece {
  std::size_t param = 0;
  std::int64_t offset = 0;
  std::int64_t length = 0;
  std::int64_t position = 0;
};

/// Parameters of one dtype all-gathered together, and the pieces each rank steps.
struct ShardBucket {
  c10::ScalarType dtype = c10::ScalarType::Float;
  std::vector<std::size_t> params;              ///< in the optimizer's order
  std::vector<std::vector<ShardPiece>> pieces;  ///< by rank
  std::int64_t elements = 0;                    ///< sum of the parameters' elements
  std::int64_t chunk = 1;                       ///< elements each rank sends in the all-gather (>= 1)
};

/// The buckets and cuts of every parameter (see the file comment).
struct ShardLayout {
  std::vector<ShardBucket> buckets;

  /// Throws: loom::InvalidArgument for a world size below 1, a cap of 0, or sizes and dtypes of
  ///         different counts.
  static ShardLayout build(const std::vector<std::int64_t>& numels, const std::vector<c10::ScalarType>& dtypes,
                           int world_size, std::size_t cap_bytes) {
    if (world_size < 1) throw InvalidArgument(fmt::format("ShardLayout: world size {} is below 1", world_size));
    if (cap_bytes == 0) throw InvalidArgument("ShardLayout: bucket_cap_bytes is 0");
    if (numels.size() != dtypes.size())
      throw InvalidArgument(fmt::format("ShardLayout: {} sizes but {} dtypes", numels.size(), dtypes.size()));
    ShardLayout layout;
    std::vector<std::size_t> open;  // per dtype seen: the index of its open bucket + 1 (0: none)
    std::vector<c10::ScalarType> open_dtype;
    std::vector<std::size_t> open_bytes;
    for (std::size_t i = 0; i < numels.size(); ++i) {
      const auto it = std::find(open_dtype.begin(), open_dtype.end(), dtypes[i]);
      std::size_t slot = static_cast<std::size_t>(it - open_dtype.begin());
      if (it == open_dtype.end()) {
        open_dtype.push_back(dtypes[i]);
        open.push_back(0);
        open_bytes.push_back(0);
      }
      if (open[slot] == 0) {
        layout.buckets.push_back(
            ShardBucket{.dtype = dtypes[i], .params = {}, .pieces = {}, .elements = 0, .chunk = 1});
        open[slot] = layout.buckets.size();
        open_bytes[slot] = 0;
      }
      ShardBucket& b = layout.buckets[open[slot] - 1];
      b.params.push_back(i);
      b.elements += numels[i];
      open_bytes[slot] += static_cast<std::size_t>(numels[i]) * c10::elementSize(dtypes[i]);
      if (open_bytes[slot] >= cap_bytes) open[slot] = 0;
    }
    for (ShardBucket& b : layout.buckets) cut(b, numels, world_size);
    return layout;
  }

 private:
  /// Cuts bucket `b` into world_size shards (see the file comment) and fills its pieces and chunk.
  static void cut(ShardBucket& b, const std::vector<std::int64_t>& numels, int world_size) {
    const auto world = static_cast<std::int64_t>(world_size);
    std::vector<std::int64_t> starts;  // each parameter's first element in the bucket
    std::int64_t at = 0;
    for (std::size_t i : b.params) {
      starts.push_back(at);
      at += numels[i];
    }
    std::vector<std::int64_t> bounds(static_cast<std::size_t>(world) + 1, 0);
    bounds.back() = b.elements;
    const std::int64_t target = (b.elements + world - 1) / world;
    for (std::int64_t r = 1; r < world; ++r) {
      std::int64_t t = std::min(r * target, b.elements);
      if (t < b.elements) {
        // The parameter holding element t: its last start at or before t.
        const auto k = static_cast<std::size_t>(std::upper_bound(starts.begin(), starts.end(), t) - starts.begin()) - 1;
        t = starts[k] + (t - starts[k]) / kShardAlignment * kShardAlignment;
      }
      bounds[static_cast<std::size_t>(r)] = std::max(t, bounds[static_cast<std::size_t>(r) - 1]);
    }
    b.pieces.assign(static_cast<std::size_t>(world), {});
    for (std::int64_t r = 0; r < world; ++r) {
      const std::int64_t lo = bounds[static_cast<std::size_t>(r)];
      const std::int64_t hi = bounds[static_cast<std::size_t>(r) + 1];
      std::int64_t position = 0;
      for (std::size_t k = 0; k < b.params.size(); ++k) {
        const std::int64_t a = std::max(lo, starts[k]);
        const std::int64_t e = std::min(hi, starts[k] + numels[b.params[k]]);
        if (a >= e) continue;
        b.pieces[static_cast<std::size_t>(r)].push_back(
            ShardPiece{.param = b.params[k], .offset = a - starts[k], .length = e - a, .position = position});
        position += e - a;
      }
      b.chunk = std::max(b.chunk, hi - lo);
    }
  }
};

}  // namespace loom::detail
