// loom/schedule/detail/cursor.hpp — GeneratorCursor: one interface over both kinds of
// SampleGenerator (callables and input ranges), remembering the end.
#pragma once

#include <cstdint>
#include <optional>
#include <ranges>
#include <utility>

#include <loom/schedule/generator.hpp>

namespace loom::detail {

/// Pulls samples from one generator of either kind through one interface: `next()` returns the
/// next sample or std::nullopt at the end; after the end it is never called again (the cursor
/// remembers). For a range, begin() is called lazily on the first next(), on the worker thread.
template <SampleGenerator G>
class GeneratorCursor {
 public:
  using Sample = generator_sample_t<G>;

  explicit GeneratorCursor(G generator) : generator_(std::move(generator)) {}
  GeneratorCursor(GeneratorCursor&&) = delete;  // a range's iterator may point into generator_

  /// The next sample, or std::nullopt when the stream has ended (then and forever after).
  std::optional<Sample> next() {
    if (ended_) return std::nullopt;
    std::optional<Sample> out = pull();
    if (!out) ended_ = true;
    return out;
  }

  /// Jumps over n samples (g.skip(n) when G has it, else pulls and drops them). Returns how many
  /// were skipped when that is known (< n means the stream ended first); a skip() of a
  /// SkippableSampleGenerator reports n.
  std::int64_t skip(std::int64_t n) {
    if constexpr (SkippableSampleGenerator<G>) {
      if (n > 0) generator_.skip(n);
      return n;
    } else {
      std::int64_t done = 0;
      while (done < n && next()) ++done;
      return done;
    }
  }

  [[nodiscard]] bool ended() const noexcept { return ended_; }

 private:
  std::optional<Sample> pull() {
    if constexpr (CallableSampleGenerator<G>) {
      return generator_();
    } else {
      if (!started_) {
        it_.emplace(std::ranges::begin(generator_));
        started_ = true;
      } else {
        ++*it_;
      }
      if (*it_ == std::ranges::end(generator_)) return std::nullopt;
      return std::optional<Sample>(std::in_place, **it_);
    }
  }

  template <class T>
  struct iterator_of {
    using type = char;  // unused: callables keep no iterator
  };
  template <RangeSampleGenerator T>
  struct iterator_of<T> {
    using type = std::ranges::iterator_t<T>;
  };
  using Iterator = typename iterator_of<G>::type;

  G generator_;
  std::optional<Iterator> it_;
  bool started_ = false;
  bool ended_ = false;
};

}  // namespace loom::detail
