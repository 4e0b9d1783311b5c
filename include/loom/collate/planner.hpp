// loom/collate/planner.hpp — BucketPlanner: which samples go into which batch, from shapes alone.
// The collators copy bytes where it says; loom/sample/bucket_batch.hpp plans a whole dataset with
// it on every rank alike. One planner, one set of rules.
//
// Example:
//   loom::BucketPlanner planner(loom::PaddedBucketOptions{.pad = {{.dim = 0}}, .max_elements = 150});
//   std::vector<loom::PlannedBatch> out;
//   for (int64_t i = 0; i < 5; ++i) planner.add(i, {len[i]}, out);   // len = {100, 10, 10, 10, 100}
//   planner.flush(out);          // out: {0}, {1, 2, 3}, {4} with padded shapes {100}, {10}, {100}
//
// Same input order, same batches. Guide (bucket keys, capacities, when a batch closes):
// docs/collate.md#planning-from-shapes-to-batches-loomcollateplannerhpp.
// Source: the greedy in-order packing is fairseq's batch_by_size; buckets by padded length are
//         tf.data's bucket_by_sequence_length idea.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include <c10/util/ArrayRef.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <loom/collate/batch_rules.hpp>
#include <loom/collate/options.hpp>
#include <loom/error.hpp>

namespace loom {

/// One batch decided by a BucketPlanner: dataset indices in order, padded sample shape, element counts.
///
/// Example: `PlannedBatch{.indices = {1, 2, 3}, .padded_shape = {10}, .real_elements = 30, .padded_elements = 30}`.
/// Shape: the collated batch is indices.size() x padded_shape.
/// Units: elements (not bytes).
struct PlannedBatch {
  std::vector<int64_t> indices{};       ///< dataset index of each sample, in batch row order
  std::vector<int64_t> padded_shape{};  ///< sample shape every row is padded to
  int64_t real_elements = 0;            ///< sum of the samples' element counts
  int64_t padded_elements = 0;          ///< indices.size() x product(padded_shape)

  friend bool operator==(const PlannedBatch&, const PlannedBatch&) = default;
};

namespace detail {

inline int64_t checked_mul(int64_t a, int64_t b, int64_t index, c10::IntArrayRef shape) {
  int64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r))
    throw InvalidArgument(
        fmt::format("sample {} with shape [{}]: element count overflows int64", index, fmt::join(shape, ", ")));
  return r;
}

}  // namespace detail

/// Shape-only bucketing: decides batches from (index, shape) pairs, without touching tensor data.
///
/// Example: `planner.add(7, {3, 32, 48}, out);` appends to `out` the batches sample 7 closes.
/// Shape: shapes exclude the batch dimension; all samples given to one planner have the same
///        number of dimensions.
/// Throws: loom::InvalidArgument for bad options (BatchRules::check) and for bad samples, naming the
///         sample index and its shape: another number of dimensions than the first sample, a
///         zero-size or negative dimension, a size above the last boundary, a sample larger than
///         max_elements on its own (unless OversizePolicy::skip), a padded dimension out of range.
/// Source: fairseq's batch_by_size; tf.data's bucket_by_sequence_length.
class BucketPlanner {
 public:
  /// kAny marks a dimension padded to the batch's largest size in a bucket key.
  static constexpr int64_t kAny = 0;

  /// A bucket: its key and the samples waiting in it.
  struct Bucket {
    std::size_t id = 0;              ///< creation order
    std::vector<int64_t> key;        ///< per dimension: exact or padded size, or kAny
    bool fixed = true;               ///< no kAny dimension: padded shape known up front
    int64_t capacity = 0;            ///< samples at which the batch is emitted eagerly
    int64_t fixed_numel = 1;         ///< product of the non-kAny key entries
    std::vector<int64_t> indices;    ///< pending samples' dataset indices
    std::vector<int64_t> numels;     ///< pending samples' element counts
    std::vector<int64_t> any_sizes;  ///< pending samples' sizes on kAny dims (row-major, n x any_dims)
    std::vector<int64_t> any_max;    ///< max of any_sizes per kAny dim
    [[nodiscard]] int64_t size() const noexcept { return static_cast<int64_t>(indices.size()); }
  };

  /// Where add() put a sample: its bucket and row (slot) in the bucket's pending batch.
  struct Placement {
    std::size_t bucket = 0;
    int64_t slot = 0;
  };

  /// Plans with `rules` (empty pad: exact-shape buckets). Throws: loom::InvalidArgument (BatchRules::check).
  explicit BucketPlanner(BatchRules rules) : config_(std::move(rules)) { config_.check(); }
  explicit BucketPlanner(const ShapeBucketOptions& o) : BucketPlanner(batch_rules(o)) {}
  /// Throws: loom::InvalidArgument also for an empty `pad`.
  explicit BucketPlanner(const PaddedBucketOptions& o) : BucketPlanner(padded_rules(o)) {}

  /// Adds one sample and appends the batches it closes to `out`.
  void add(int64_t index, c10::IntArrayRef shape, std::vector<PlannedBatch>& out) {
    auto collect = [&out](const Bucket& b, int64_t count, c10::IntArrayRef padded) {
      out.push_back(make_planned(b, count, padded));
    };
    if (auto id = bucket_of(index, shape)) {
      const Placement p = place(*id, index, shape, collect);
      commit(p, collect);
    }
  }

  /// Emits (or, with drop_incomplete, drops and counts) every pending sample; appends to `out`.
  void flush(std::vector<PlannedBatch>& out) {
    flush([&out](const Bucket& b, int64_t count, c10::IntArrayRef padded) {
      out.push_back(make_planned(b, count, padded));
    });
  }

  // ---- the two-phase interface collators use (bucket_of, place, commit, flush) ----

  /// Validates the sample and finds (or creates) its bucket. Returns nullopt for an oversize
  /// sample under OversizePolicy::skip (counted). Does not place the sample.
  std::optional<std::size_t> bucket_of(int64_t index, c10::IntArrayRef shape) {
    ++stats_.samples_in;
    check_shape(index, shape);
    key_scratch_.assign(shape.begin(), shape.end());
    std::uint64_t hash = 0;
    int64_t alone = 1;  // padded numel of the sample in a batch of its own
    for (std::size_t d = 0; d < shape.size(); ++d) {
      const DimPadding* p = pad_index_[d] < 0 ? nullptr : &config_.pad[static_cast<std::size_t>(pad_index_[d])];
      int64_t k = shape[d];
      if (p != nullptr) {
        if (!p->boundaries.empty()) {
          auto it = std::lower_bound(p->boundaries.begin(), p->boundaries.end(), shape[d]);
          if (it == p->boundaries.end())
            throw InvalidArgument(
                fmt::format("sample {} with shape [{}]: size {} on dimension {} is above the last boundary {}", index,
                            fmt::join(shape, ", "), shape[d], d, p->boundaries.back()));
          k = *it;
        } else if (p->multiple > 0) {
          k = (shape[d] + p->multiple - 1) / p->multiple * p->multiple;
        } else {
          k = kAny;
        }
      }
      key_scratch_[d] = k;
      hash = (hash ^ static_cast<std::uint64_t>(k)) * 0x9E3779B97F4A7C15ULL;  // Fibonacci hashing's multiplier
      alone = detail::checked_mul(alone, k == kAny ? shape[d] : k, index, shape);
    }
    if (config_.max_elements && alone > *config_.max_elements) {
      if (config_.on_oversize == OversizePolicy::skip) {
        ++stats_.skipped_oversize;
        return std::nullopt;
      }
      throw InvalidArgument(fmt::format(
          "sample {} with shape [{}] needs {} (padded) elements, more than max_elements = {}; a sample is never "
          "truncated: raise max_elements or set on_oversize = OversizePolicy::skip",
          index, fmt::join(shape, ", "), alone, *config_.max_elements));
    }
    hash ^= hash >> 32;
    if (last_bucket_ < buckets_.size() && hashes_[last_bucket_] == hash &&
        same_key(buckets_[last_bucket_].key, key_scratch_))
      return last_bucket_;
    // One probe in the usual case, whatever the number of buckets; comparing keys one bucket after
    // another instead costs a mispredicted branch per bucket when the shapes come shuffled.
    const std::size_t mask = table_.size() - 1;
    for (std::size_t i = hash & mask; table_[i] != 0; i = (i + 1) & mask) {
      const std::size_t id = table_[i] - 1;
      if (hashes_[id] == hash && same_key(buckets_[id].key, key_scratch_)) return last_bucket_ = id;
    }
    return last_bucket_ = create_bucket(hash);
  }

  /// Places a sample (already validated by bucket_of) in bucket `id`; first emits, through
  /// `on_emit(bucket, count, padded_shape)`, the batches it closes (kAny buckets only).
  template <class OnEmit>
  Placement place(std::size_t id, int64_t index, c10::IntArrayRef shape, OnEmit&& on_emit) {
    Bucket& b = buckets_[id];
    if (!b.fixed && config_.max_elements) {
      while (b.size() > 0 && cost_with(b, shape) > *config_.max_elements) {
        const int64_t n = b.size();
        const int64_t k = config_.multiple_of;
        emit(b, n >= k ? n / k * k : n, on_emit);
      }
    }
    const Placement p{id, b.size()};
    b.indices.push_back(index);
    int64_t numel = 1;
    for (int64_t s : shape) numel *= s;
    b.numels.push_back(numel);
    if (!b.fixed) {
      for (std::size_t j = 0; j < any_dims_.size(); ++j) {
        const int64_t s = shape[static_cast<std::size_t>(any_dims_[j])];
        b.any_sizes.push_back(s);
        b.any_max[j] = std::max(b.any_max[j], s);
      }
    }
    return p;
  }

  /// After the sample at `p` was stored: emits its bucket if it reached capacity.
  template <class OnEmit>
  void commit(const Placement& p, OnEmit&& on_emit) {
    Bucket& b = buckets_[p.bucket];
    if (b.size() >= b.capacity) emit(b, b.size(), on_emit);
  }

  /// Emits (or drops) every pending sample, buckets in creation order.
  template <class OnEmit>
  requires std::invocable<OnEmit&, const Bucket&, int64_t, c10::IntArrayRef>
  void flush(OnEmit&& on_emit) {
    for (Bucket& b : buckets_) {
      if (b.size() == 0) continue;
      if (config_.drop_incomplete) {
        stats_.dropped_incomplete += b.size();
        erase_front(b, b.size());
      } else {
        emit(b, b.size(), on_emit);
      }
    }
  }

  /// Counts so far (samples, batches, elements, drops, skips).
  [[nodiscard]] const CollateStats& stats() const noexcept { return stats_; }
  /// Buckets seen so far, in creation order.
  [[nodiscard]] const std::vector<Bucket>& buckets() const noexcept { return buckets_; }
  /// Samples waiting in buckets.
  [[nodiscard]] int64_t pending() const noexcept {
    int64_t n = 0;
    for (const Bucket& b : buckets_) n += b.size();
    return n;
  }
  /// Number of dimensions of the samples (-1 before the first sample).
  [[nodiscard]] int64_t sample_dim() const noexcept { return ndim_; }

 private:
  static BatchRules padded_rules(const PaddedBucketOptions& o) {
    if (o.pad.empty())
      throw InvalidArgument(
          "PaddedBucketOptions::pad is empty: list at least one padded dimension "
          "(or use ShapeBucketOptions for exact-shape buckets)");
    return batch_rules(o);
  }

  // Key equality inline: the first dimension that differs usually decides, and a call to memcmp
  // (what std::vector's == becomes) costs more than the comparison on keys of a few dimensions.
  static bool same_key(const std::vector<int64_t>& a, const std::vector<int64_t>& b) noexcept {
    if (a.size() != b.size()) return false;
    for (std::size_t d = 0; d < a.size(); ++d)
      if (a[d] != b[d]) return false;
    return true;
  }

  static PlannedBatch make_planned(const Bucket& b, int64_t count, c10::IntArrayRef padded) {
    PlannedBatch pb;
    pb.indices.assign(b.indices.begin(), b.indices.begin() + count);
    pb.padded_shape.assign(padded.begin(), padded.end());
    for (int64_t i = 0; i < count; ++i) pb.real_elements += b.numels[static_cast<std::size_t>(i)];
    int64_t per = 1;
    for (int64_t s : padded) per *= s;
    pb.padded_elements = per * count;
    return pb;
  }

  void check_shape(int64_t index, c10::IntArrayRef shape) {
    if (ndim_ < 0) {
      ndim_ = static_cast<int64_t>(shape.size());
      first_shape_.assign(shape.begin(), shape.end());
      first_index_ = index;
      pad_index_.assign(shape.size(), -1);
      for (std::size_t i = 0; i < config_.pad.size(); ++i) {
        const DimPadding& p = config_.pad[i];
        const int64_t d = p.dim < 0 ? p.dim + ndim_ : p.dim;
        if (d < 0 || d >= ndim_)
          throw InvalidArgument(
              fmt::format("padded dimension {} is out of range for sample {} with shape [{}] ({} dimensions)", p.dim,
                          index, fmt::join(shape, ", "), ndim_));
        if (pad_index_[static_cast<std::size_t>(d)] >= 0)
          throw InvalidArgument(fmt::format("dimension {} is listed twice in pad (as {})", d, p.dim));
        pad_index_[static_cast<std::size_t>(d)] = static_cast<int>(i);
        if (p.boundaries.empty() && p.multiple == 0) any_dims_.push_back(d);
      }
      std::sort(any_dims_.begin(), any_dims_.end());
    } else if (static_cast<int64_t>(shape.size()) != ndim_) {
      throw InvalidArgument(fmt::format(
          "sample {} has shape [{}] ({} dimensions) but sample {} had [{}] ({} dimensions); one collator takes samples "
          "with the same number of dimensions",
          index, fmt::join(shape, ", "), shape.size(), first_index_, fmt::join(first_shape_, ", "), ndim_));
    }
    for (int64_t s : shape) {
      if (s <= 0)
        throw InvalidArgument(fmt::format("sample {} has shape [{}]: a {} dimension cannot be batched", index,
                                          fmt::join(shape, ", "), s == 0 ? "zero-size" : "negative"));
    }
  }

  std::size_t create_bucket(std::uint64_t hash) {
    Bucket b;
    b.id = buckets_.size();
    b.key = key_scratch_;
    for (int64_t k : b.key) {
      if (k == kAny)
        b.fixed = false;
      else
        b.fixed_numel *= k;
    }
    constexpr int64_t kUnlimited = std::numeric_limits<int64_t>::max();
    b.capacity = config_.max_samples ? *config_.max_samples : kUnlimited;
    if (b.fixed && config_.max_elements) {
      int64_t cap = *config_.max_elements / b.fixed_numel;
      LOOM_ASSERT(cap >= 1, "oversize samples are rejected before a bucket is created");
      if (cap >= config_.multiple_of) cap = cap / config_.multiple_of * config_.multiple_of;
      b.capacity = std::min(b.capacity, cap);
    }
    if (!b.fixed) b.any_max.assign(any_dims_.size(), 0);
    // Everything that may throw (allocation) comes before the first change, so a bad_alloc leaves
    // buckets_, hashes_ and table_ as they were.
    const std::size_t n = buckets_.size() + 1;
    std::vector<std::size_t> grown;
    if (2 * n > table_.size()) grown.assign(2 * table_.size(), 0);  // at most half full: probes stay short
    if (buckets_.capacity() < n) buckets_.reserve(2 * n);
    if (hashes_.capacity() < n) hashes_.reserve(2 * n);
    buckets_.push_back(std::move(b));
    hashes_.push_back(hash);
    if (!grown.empty()) {
      table_.swap(grown);
      for (std::size_t id = 0; id < n; ++id) insert(id);
    } else {
      insert(n - 1);
    }
    return n - 1;
  }

  void insert(std::size_t id) {
    const std::size_t mask = table_.size() - 1;
    std::size_t i = hashes_[id] & mask;
    while (table_[i] != 0) i = (i + 1) & mask;
    table_[i] = id + 1;
  }

  // Padded elements of the bucket's pending samples plus `shape` in one batch (kAny buckets).
  int64_t cost_with(const Bucket& b, c10::IntArrayRef shape) const {
    int64_t per = b.fixed_numel;
    for (std::size_t j = 0; j < any_dims_.size(); ++j)
      per *= std::max(b.any_max[j], shape[static_cast<std::size_t>(any_dims_[j])]);
    return per * (b.size() + 1);
  }

  template <class OnEmit>
  void emit(Bucket& b, int64_t count, OnEmit& on_emit) {
    LOOM_ASSERT(count > 0 && count <= b.size());
    padded_scratch_ = b.key;
    if (!b.fixed) {
      const std::size_t nd = any_dims_.size();
      for (std::size_t j = 0; j < nd; ++j) {
        int64_t m = 0;
        for (int64_t i = 0; i < count; ++i) m = std::max(m, b.any_sizes[static_cast<std::size_t>(i) * nd + j]);
        padded_scratch_[static_cast<std::size_t>(any_dims_[j])] = m;
      }
    }
    int64_t per = 1;
    for (int64_t s : padded_scratch_) per *= s;
    int64_t real = 0;
    for (int64_t i = 0; i < count; ++i) real += b.numels[static_cast<std::size_t>(i)];
    on_emit(static_cast<const Bucket&>(b), count, c10::IntArrayRef(padded_scratch_));
    stats_.samples_out += count;
    stats_.batches_out += 1;
    stats_.real_elements += real;
    stats_.padded_elements += per * count;
    erase_front(b, count);
  }

  void erase_front(Bucket& b, int64_t count) {
    b.indices.erase(b.indices.begin(), b.indices.begin() + count);
    b.numels.erase(b.numels.begin(), b.numels.begin() + count);
    if (!b.fixed) {
      const auto nd = static_cast<int64_t>(any_dims_.size());
      b.any_sizes.erase(b.any_sizes.begin(), b.any_sizes.begin() + count * nd);
      for (std::size_t j = 0; j < any_dims_.size(); ++j) {
        int64_t m = 0;
        for (std::size_t i = j; i < b.any_sizes.size(); i += any_dims_.size()) m = std::max(m, b.any_sizes[i]);
        b.any_max[j] = m;
      }
    }
  }

  BatchRules config_;
  int64_t ndim_ = -1;
  int64_t first_index_ = 0;
  std::vector<int64_t> first_shape_;
  std::vector<int> pad_index_;     // per sample dim: index into config_.pad, or -1
  std::vector<int64_t> any_dims_;  // sample dims padded to the batch max, ascending
  std::vector<Bucket> buckets_;
  // The buckets' index: open addressing with linear probing on a hash of the key; an entry is a
  // bucket id + 1 (0 = empty). The size is a power of two, at least twice the number of buckets.
  std::vector<std::size_t> table_ = std::vector<std::size_t>(16, 0);
  std::vector<std::uint64_t> hashes_;  // per bucket: the hash of its key
  std::size_t last_bucket_ = std::numeric_limits<std::size_t>::max();
  std::vector<int64_t> key_scratch_;
  std::vector<int64_t> padded_scratch_;
  CollateStats stats_;
};

}  // namespace loom
