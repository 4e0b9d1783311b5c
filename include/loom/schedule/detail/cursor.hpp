// loom/schedule/detail/cursor.hpp — GeneratorCursor: one interface over both kinds of
// SampleGenerator (callables and input ranges), remembering the end; resume skips, and the count of unread samples after an end.
#pragma once

#include <cstdint>
#include <exception>
#include <optional>
#include <ranges>
#include <utility>

#include <loom/schedule/generator.hpp>

namespace loom::detail {

/// Why GeneratorCursor::count_to_end stopped: the stream ended (the count is exact), the limit was
/// reached, the caller said stop, or the generator threw.
enum class CountEnd { ended, limit, stopped, failed };

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

  /// next(), with a throw stored in `error` (the generator's failure); then std::nullopt. The
  /// caller makes the sample's tensors its own (own_sample.hpp) before calling again.
  std::optional<Sample> next_caught(std::exception_ptr& error) {
    try {
      return next();
    } catch (...) {
      error = std::current_exception();
      return std::nullopt;
    }
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

  /// Reads on and drops samples until the end of the stream, at most `limit` of them, while
  /// `go_on()` (asked before each sample) returns true. Returns how many it read and why it stopped;
  /// a throw of the generator stops it (CountEnd::failed) and is not rethrown.
  template <class F>
  std::pair<std::int64_t, CountEnd> count_to_end(std::int64_t limit, F go_on) {
    std::int64_t read = 0;
    while (!ended_) {
      if (read == limit) return {read, CountEnd::limit};
      if (!go_on()) return {read, CountEnd::stopped};
      try {
        if (next()) ++read;
      } catch (...) {
        return {read, CountEnd::failed};
      }
    }
    return {read, CountEnd::ended};
  }

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
