// loom/collate/collator.hpp — BucketCollator: samples in, one at a time; loom::Batch out, whenever
// a bucket's batch closes. Also brings loom::collate and CollateOptions (collate_list.hpp).
//
// Example:
//   loom::BucketCollator<> c(loom::ShapeBucketOptions{.max_samples = 4});
//   for (int64_t i = 0; i < n; ++i) {
//     c.push(i, std::pair{images[i], labels[i]});        // at::Tensor 3 x H x W, int64 label
//     while (auto b = c.try_pop()) train_step(*b);
//   }
//   c.flush();                                           // partial buckets: emitted, not dropped
//   while (auto b = c.try_pop()) train_step(*b);
//
// Every sample is read when push() receives it: the collator keeps no reference to the caller's
// tensors, so a source may reuse one output buffer. One collator per thread; batches may outlive it.
// Guide: docs/collate.md#storage-read-on-arrival-reuse-buffers-loomcollatepoolhpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <optional>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <fmt/format.h>

#include <loom/collate/batch.hpp>
#include <loom/collate/collate_list.hpp>
#include <loom/collate/detail/batch_writer.hpp>
#include <loom/collate/detail/rows.hpp>
#include <loom/collate/detail/sample_read.hpp>
#include <loom/collate/detail/staged_samples.hpp>
#include <loom/collate/options.hpp>
#include <loom/collate/planner.hpp>
#include <loom/collate/sample.hpp>
#include <loom/error.hpp>

namespace loom {

/// Groups samples into shape buckets (exact or padded, as the options say) and emits loom::Batch
/// objects.
///
/// Example: `loom::BucketCollator<> c(loom::PaddedBucketOptions{.pad = {{.dim = 0}}, .max_elements = 4096});`
/// Shape: Batch::data N x (padded) sample shape in the samples' dtype; targets an int64 N-vector
///        (integer targets), N x (target shape) (tensor targets) or undefined (NoTarget); mask (padded,
///        mask = true) bool like data, true = real; indices from the projection's index(), from
///        push(index, s), or the 0-based input position, in row order; num_samples N; weight 1.
/// Throws: loom::InvalidArgument naming the sample index and the bad value: data undefined or not
///         on the CPU, another number of dimensions than the first sample, a zero-size dimension,
///         a dtype or tensor-target shape/dtype other than its bucket's, a sample above
///         max_elements alone (unless OversizePolicy::skip), flush() before any push (an empty
///         dataset), pop() with no batch ready; bad options when built (options.hpp).
/// Source: the map-keyed-by-shape grouping of hand-written collate functions; copying into
///         preallocated storage as torch's DataLoader does with pin_memory buffers, minus the stack.
template <class Projection = DefaultProjection>
class BucketCollator {
 public:
  /// Exact-shape buckets.
  explicit BucketCollator(const ShapeBucketOptions& o, Projection proj = {})
      : planner_(o), proj_(std::move(proj)), storage_{o.pool, o.allocate} {}
  /// Padded buckets.
  explicit BucketCollator(const PaddedBucketOptions& o, Projection proj = {})
      : planner_(o),
        proj_(std::move(proj)),
        storage_{o.pool, o.allocate},
        padded_(true),
        mask_(o.mask),
        pad_value_(o.pad_value) {}

  // Move-only: a copy would share the open batch buffers and write into them twice.
  BucketCollator(const BucketCollator&) = delete;
  BucketCollator& operator=(const BucketCollator&) = delete;
  BucketCollator(BucketCollator&&) = default;
  BucketCollator& operator=(BucketCollator&&) = default;

  /// Adds a sample; its dataset index is `proj.index(s)` when the projection has one, else the
  /// number of samples pushed before it.
  template <class S>
  void push(const S& sample) {
    static_assert(SampleProjection<Projection, S>,
                  "BucketCollator: the projection cannot read this sample type; give a projection with data(s) and "
                  "target(s) (see loom/collate/sample.hpp)");
    int64_t index = position_;
    if constexpr (SampleProjectionWithIndex<Projection, S>) index = static_cast<int64_t>(proj_.index(sample));
    push(index, sample);
  }

  /// Adds a sample with an explicit dataset index.
  template <class S>
  void push(int64_t index, const S& sample) {
    static_assert(SampleProjection<Projection, S>,
                  "BucketCollator: the projection cannot read this sample type; give a projection with data(s) and "
                  "target(s) (see loom/collate/sample.hpp)");
    ++position_;
    const detail::SampleRead read = detail::read_sample(proj_, sample, index);
    const at::Tensor& data = read.data();
    auto id = planner_.bucket_of(index, data.sizes());
    if (!id) return;  // oversize, skipped and counted
    if (*id >= stores_.size()) stores_.resize(*id + 1);
    Store& st = stores_[*id];
    check_types(st, *id, index, data, read.target);

    const BucketPlanner::Bucket& bucket = planner_.buckets()[*id];
    const BucketPlanner::Placement p = planner_.place(*id, index, data.sizes(), emitter());
    if (bucket.fixed) {
      if (p.slot == 0) {
        if (!st.fixed_layout) st.fixed_layout = layout(st, bucket.key);  // the same for every batch of the bucket
        st.open.emplace(*st.fixed_layout, bucket.capacity, storage_);
      }
      st.open->write(p.slot, data, read.target);
    } else {
      st.staged.push(data, read.target);  // copied now: the caller may overwrite its tensors as soon as push() returns
    }
    planner_.commit(p, emitter());
  }

  /// Emits every partial bucket (or drops and counts them with drop_incomplete).
  /// Throws loom::InvalidArgument when no sample was ever pushed (an empty dataset).
  void flush() {
    if (planner_.stats().samples_in == 0)
      throw InvalidArgument("collator: no samples were pushed before flush (the dataset is empty)");
    planner_.flush(emitter());
    for (Store& st : stores_) {  // dropped partial batches free their buffers
      st.open.reset();
      st.staged.clear();
    }
  }

  /// True when a batch is ready.
  [[nodiscard]] bool ready() const noexcept { return !ready_.empty(); }
  /// Number of batches ready.
  [[nodiscard]] std::size_t ready_count() const noexcept { return ready_.size(); }

  /// Takes the oldest ready batch. Throws loom::InvalidArgument when none is ready.
  [[nodiscard]] Batch pop() {
    if (ready_.empty()) throw InvalidArgument("collator: pop() with no batch ready (check ready() or use try_pop())");
    Batch b = std::move(ready_.front());
    ready_.pop_front();
    return b;
  }

  /// Takes the oldest ready batch, or nullopt.
  [[nodiscard]] std::optional<Batch> try_pop() {
    if (ready_.empty()) return std::nullopt;
    return pop();
  }

  /// Counts so far: samples in/out, batches, dropped and skipped samples, real/padded elements.
  [[nodiscard]] const CollateStats& stats() const noexcept { return planner_.stats(); }
  /// The planner (bucket keys and pending samples), for inspection.
  [[nodiscard]] const BucketPlanner& planner() const noexcept { return planner_; }

 private:
  struct Store {
    bool typed = false;
    c10::ScalarType dtype = c10::ScalarType::Undefined;
    int64_t first_index = 0;
    detail::TargetValue::Kind target_kind = detail::TargetValue::Kind::none;
    c10::ScalarType target_dtype = c10::ScalarType::Undefined;
    std::vector<int64_t> target_shape;
    detail::ElementPattern pad;
    std::optional<detail::BatchLayout> fixed_layout;  // fixed buckets: the layout of their batches, made once
    std::optional<detail::BatchWriter> open;          // fixed buckets: the open batch (capacity rows)
    detail::StagedSamples staged;  // kAny buckets: copies of the samples waiting for their batch to close
  };

  void check_types(Store& st, std::size_t id, int64_t index, const at::Tensor& data, const detail::TargetValue& t) {
    const auto& key = planner_.buckets()[id].key;
    if (!st.typed) {
      st.typed = true;
      st.dtype = data.scalar_type();
      st.first_index = index;
      st.target_kind = t.kind;
      if (t.kind == detail::TargetValue::Kind::tensor) {
        st.target_dtype = t.tensor.scalar_type();
        st.target_shape.assign(t.tensor.sizes().begin(), t.tensor.sizes().end());
      }
      if (padded_) st.pad = detail::ElementPattern(pad_value_, st.dtype);
      return;
    }
    if (data.scalar_type() != st.dtype)
      throw InvalidArgument(
          fmt::format("sample {} with shape {} has dtype {}, but its bucket {} holds dtype {} (from sample {})", index,
                      detail::shape_str(data.sizes()), c10::toString(data.scalar_type()), detail::shape_str(key),
                      c10::toString(st.dtype), st.first_index));
    if (t.kind != st.target_kind)
      throw InvalidArgument(
          fmt::format("sample {}: its target kind differs from sample {} in the same bucket", index, st.first_index));
    if (t.kind == detail::TargetValue::Kind::tensor &&
        (t.tensor.scalar_type() != st.target_dtype || t.tensor.sizes() != c10::IntArrayRef(st.target_shape)))
      throw InvalidArgument(
          fmt::format("sample {}: target of shape {} and dtype {}, but its bucket's targets are {} {} (from sample {})",
                      index, detail::shape_str(t.tensor.sizes()), c10::toString(t.tensor.scalar_type()),
                      detail::shape_str(st.target_shape), c10::toString(st.target_dtype), st.first_index));
  }

  // The layout of a batch of this bucket padded to `padded`.
  detail::BatchLayout layout(const Store& st, c10::IntArrayRef padded) const {
    return {.padded = std::vector<int64_t>(padded.begin(), padded.end()),
            .dtype = st.dtype,
            .mask = padded_ && mask_,
            .pad = st.pad,
            .target_kind = st.target_kind,
            .target_shape = st.target_shape,
            .target_dtype = st.target_dtype};
  }

  auto emitter() {
    return
        [this](const BucketPlanner::Bucket& b, int64_t count, c10::IntArrayRef padded) { on_emit(b, count, padded); };
  }

  void on_emit(const BucketPlanner::Bucket& b, int64_t count, c10::IntArrayRef padded) {
    Store& st = stores_[b.id];
    std::vector<int64_t> indices(b.indices.begin(), b.indices.begin() + count);
    if (b.fixed) {
      LOOM_ASSERT(count == b.size(), "fixed buckets are emitted whole");
      LOOM_ASSERT(st.open.has_value(), "a fixed bucket with samples has an open batch");
      ready_.push_back(std::move(*st.open).finish(count, std::move(indices)));
      st.open.reset();
    } else {
      detail::BatchWriter writer(layout(st, padded), count, storage_);
      for (int64_t i = 0; i < count; ++i) {
        const auto ui = static_cast<std::size_t>(i);
        writer.write(i, st.staged.data(ui), st.staged.sizes(ui), st.staged.target(ui));
      }
      ready_.push_back(std::move(writer).finish(count, std::move(indices)));
      st.staged.erase_front(static_cast<std::size_t>(count));
    }
  }

  BucketPlanner planner_;
  Projection proj_;
  detail::StorageSource storage_;
  bool padded_ = false;
  bool mask_ = false;
  double pad_value_ = 0.0;
  int64_t position_ = 0;
  std::vector<Store> stores_;
  std::deque<Batch> ready_;
};

}  // namespace loom
