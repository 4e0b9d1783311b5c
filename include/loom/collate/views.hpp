// loom/collate/views.hpp — range-v3 view adaptors that turn a range of samples into batches, lazily.
//
// Example:
//   std::vector<std::pair<torch::Tensor, int64_t>> samples = ...;      // 3 x H x W images, labels
//   for (loom::Batch& b : samples | loom::views::bucket_by_shape({.max_samples = 64})) step(b);
//
//   auto tokens = sequences | ranges::views::transform(to_sample)         // 1-D int64 token tensors
//               | loom::views::bucket_padded({.pad = {{.dim = 0}}, .pad_value = 0, .max_elements = 4096});
//
// Single pass: begin() once per view; each input element is read once. The batches are those a
// BucketCollator given the same samples would emit (they are built by one).
// Throws: as BucketCollator (collator.hpp), from begin() and from ++; an empty input range throws
//         loom::InvalidArgument ("the dataset is empty").
// Guide: docs/collate.md#views.
// Source: adaptor shape follows range-v3's views::chunk (a *_fn object with a pipe form made with
//         make_view_closure(bind_back(...))).
#pragma once

#include <cstddef>
#include <memory>
#include <optional>
#include <type_traits>
#include <utility>

#include <c10/core/StorageImpl.h>
#include <c10/core/TensorImpl.h>
#include <range/v3/functional/bind_back.hpp>
#include <range/v3/iterator/default_sentinel.hpp>
#include <range/v3/iterator/operations.hpp>
#include <range/v3/range/access.hpp>
#include <range/v3/range/concepts.hpp>
#include <range/v3/range/traits.hpp>
#include <range/v3/view/all.hpp>
#include <range/v3/view/interface.hpp>
#include <range/v3/view/view.hpp>

#include <loom/collate/batch.hpp>
#include <loom/collate/collator.hpp>
#include <loom/collate/options.hpp>
#include <loom/collate/sample.hpp>

namespace loom {

/// The view behind views::bucket_by_shape and views::bucket_padded: an input range of loom::Batch.
///
/// In:  input range of samples S (any S the projection reads; single-pass is fine)
/// Out: input range of loom::Batch, N x (padded) sample shape each; every sample appears once
///      (unless dropped by drop_incomplete or skipped as oversize, both counted in stats()).
template <class V, class Options, class Projection>
requires ranges::view_<V> && ranges::input_range<V>
class BucketView : public ranges::view_base {
  struct State {
    ranges::iterator_t<V> it;
    ranges::sentinel_t<V> end;
    BucketCollator<Projection> collator;
    std::optional<Batch> current;
    bool flushed = false;
    bool done = false;

    Projection proj;

    State(V& base, const Options& o, const Projection& p)
        : it(ranges::begin(base)), end(ranges::end(base)), collator(o, p), proj(p) {
      prefetch_first();
    }

    // For in-memory inputs (a forward range of lvalues, e.g. a std::vector of samples) the tensors'
    // metadata is usually cold in cache: each sample costs three dependent memory round trips, its
    // TensorImpl (dtype, sizes), then its StorageImpl (the data pointer), then the first lines of
    // its data, before its copy can stream. The view works three samples ahead, one step of the
    // chain each: while sample i is copied it prefetches the TensorImpl (first four cache lines) of
    // sample i+3, the StorageImpl of sample i+2 (through the TensorImpl prefetched one sample
    // earlier) and the first eight cache lines of sample i+1's data (CPU samples; through its
    // StorageImpl, prefetched one sample earlier), so every load of the chain has a whole
    // sample's copy to arrive in (bench_collate's collate_mixed and sweep; the figures are in
    // docs/benchmarks.md, "Collation"). Never used for ranges that compute their elements (that
    // would compute them twice).
    static constexpr bool kPrefetch = ranges::forward_range<V> &&
                                      std::is_lvalue_reference_v<ranges::range_reference_t<V>> &&
                                      std::is_reference_v<decltype(std::declval<const Projection&>().data(
                                          std::declval<ranges::range_reference_t<V>>()))>;

    static void prefetch_lines(const char* p, int lines) {
      for (int i = 0; i < lines; ++i) __builtin_prefetch(p + 64 * i);
      // GCC 12 finds a function of prefetches free of side effects (prefetches do not count) and
      // deletes its call; an empty volatile asm that uses the pointer keeps it.
      asm volatile("" : : "r"(p));
    }

    void prefetch_next() {
      if constexpr (kPrefetch) {
        auto next = ranges::next(it);
        if (next == end) return;
        if (const c10::TensorImpl* impl = proj.data(*next).unsafeGetTensorImpl();
            impl->device_type() == c10::DeviceType::CPU) {
          if (const c10::StorageImpl* storage = impl->unsafe_storage().unsafeGetStorageImpl(); storage != nullptr) {
            // A storage whose data may not be read (LibTorch 2.x throws from data_ptr()) is not
            // prefetched: the sample's own copy reports that error, at its own push.
            try {
              const char* data = static_cast<const char*>(storage->data_ptr().get());
              if (data != nullptr)
                prefetch_lines(data + impl->storage_offset() * static_cast<int64_t>(impl->dtype().itemsize()), 8);
            } catch (...) {  // NOLINT(bugprone-empty-catch): only a prefetch is lost
            }
          }
        }
        if (++next == end) return;
        {
          const c10::TensorImpl* impl = proj.data(*next).unsafeGetTensorImpl();
          if (const c10::StorageImpl* storage = impl->unsafe_storage().unsafeGetStorageImpl(); storage != nullptr)
            prefetch_lines(reinterpret_cast<const char*>(storage), 2);
        }
        if (++next == end) return;
        prefetch_lines(reinterpret_cast<const char*>(proj.data(*next).unsafeGetTensorImpl()), 4);
      }
    }

    // Before the first sample: the TensorImpls of the first three (prefetch_next reads the second's
    // and the third's).
    void prefetch_first() {
      if constexpr (kPrefetch) {
        auto at = it;
        for (int k = 0; k < 3 && at != end; ++k, ++at)
          prefetch_lines(reinterpret_cast<const char*>(proj.data(*at).unsafeGetTensorImpl()), 4);
      }
    }

    void advance() {
      current.reset();
      while (!collator.ready()) {
        if (it == end) {
          if (flushed) {
            done = true;
            return;
          }
          collator.flush();
          flushed = true;
          continue;
        }
        prefetch_next();
        auto&& sample = *it;
        collator.push(sample);
        ++it;
      }
      current.emplace(collator.pop());
    }
  };

 public:
  /// Input iterator over the batches; `*it` is the current batch (move from it if you like).
  class iterator {
   public:
    using value_type = Batch;
    using difference_type = std::ptrdiff_t;
    using iterator_concept = std::input_iterator_tag;
    using iterator_category = std::input_iterator_tag;

    iterator() = default;
    explicit iterator(State* s) : state_(s) {}

    Batch& operator*() const { return *state_->current; }
    iterator& operator++() {
      state_->advance();
      return *this;
    }
    void operator++(int) { ++*this; }
    friend bool operator==(const iterator& i, ranges::default_sentinel_t) {
      return i.state_ == nullptr || i.state_->done;
    }

   private:
    State* state_ = nullptr;
  };

  BucketView() = default;
  BucketView(V base, Options options, Projection proj)
      : base_(std::move(base)), options_(std::move(options)), proj_(std::move(proj)) {}

  /// Starts pulling samples; call once per view.
  iterator begin() {
    state_ = std::make_shared<State>(base_, options_, proj_);
    state_->advance();
    return iterator(state_.get());
  }
  ranges::default_sentinel_t end() const noexcept { return {}; }

  /// Counts of the pass in progress (or finished): samples, batches, drops, padding.
  /// Empty stats before begin().
  [[nodiscard]] CollateStats stats() const { return state_ ? state_->collator.stats() : CollateStats{}; }

 private:
  V base_{};
  Options options_{};
  Projection proj_{};
  std::shared_ptr<State> state_;  // shared so the view stays copyable (range-v3 views are semiregular)
};

namespace views {
namespace detail {

template <class Options>
struct bucket_base_fn {
  template <class Rng, class Projection = DefaultProjection>
  requires ranges::viewable_range<Rng> && ranges::input_range<Rng>
  auto operator()(Rng&& rng, Options options, Projection proj = {}) const {
    using Sample = std::remove_cvref_t<ranges::range_reference_t<Rng>>;
    static_assert(SampleProjection<Projection, Sample>,
                  "loom::views bucketing: the projection cannot read the range's samples; pass a projection with "
                  "data(s) and target(s) (see loom/collate/sample.hpp)");
    return BucketView<ranges::views::all_t<Rng>, Options, Projection>(ranges::views::all(std::forward<Rng>(rng)),
                                                                      std::move(options), std::move(proj));
  }
};

template <class Options>
struct bucket_fn : bucket_base_fn<Options> {
  using bucket_base_fn<Options>::operator();

  auto operator()(Options options) const {
    return ranges::make_view_closure(ranges::bind_back(bucket_base_fn<Options>{}, std::move(options)));
  }
  template <class Projection>
  requires(!ranges::range<Projection>) auto operator()(Options options, Projection proj) const {
    return ranges::make_view_closure(ranges::bind_back(bucket_base_fn<Options>{}, std::move(options), std::move(proj)));
  }
};

}  // namespace detail

/// Exact-shape buckets as a lazy view: `samples | loom::views::bucket_by_shape(options[, projection])`.
///
/// In:  input range of samples (data tensor of any shape; see SampleProjection)
/// Out: input range of loom::Batch, N x (sample shape), all rows of one batch of equal shape
///
/// Example: `for (auto& b : samples | loom::views::bucket_by_shape({.max_samples = 4})) ...`
/// Throws: see BucketView. Source: range-v3's views::chunk, keyed by shape.
inline constexpr detail::bucket_fn<ShapeBucketOptions> bucket_by_shape{};

/// Padded buckets as a lazy view: `samples | loom::views::bucket_padded(options[, projection])`.
///
/// In:  input range of samples whose shapes differ on the padded dimensions
/// Out: input range of loom::Batch, N x (padded sample shape), with a bool mask (true = real)
///
/// Example: `seqs | loom::views::bucket_padded({.pad = {{.dim = 0}}, .max_elements = 150})`
/// Throws: see BucketView. Source: tf.data bucket_by_sequence_length / fairseq max_tokens batching.
inline constexpr detail::bucket_fn<PaddedBucketOptions> bucket_padded{};

}  // namespace views
}  // namespace loom
