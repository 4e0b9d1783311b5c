// loom/schedule/detail/next_iterator.hpp — range-for over anything with `std::optional<V> next()`
// (both generator loaders).
#pragma once

#include <cstddef>
#include <iterator>
#include <optional>

namespace loom::detail {

/// Calls `owner.next()` until it returns std::nullopt; lets range-for walk a loader.
/// The previous value is destroyed before the next one is made (keeps the memory bound).
template <class Owner, class Value>
class NextIterator {
 public:
  using value_type = Value;
  using difference_type = std::ptrdiff_t;

  NextIterator() = default;
  explicit NextIterator(Owner& owner) : owner_(&owner), current_(owner.next()) {}
  NextIterator(NextIterator&&) noexcept = default;
  NextIterator& operator=(NextIterator&&) noexcept = default;

  Value& operator*() const { return *current_; }
  NextIterator& operator++() {
    current_.reset();
    current_ = owner_->next();
    return *this;
  }
  void operator++(int) { ++*this; }
  friend bool operator==(const NextIterator& it, std::default_sentinel_t) noexcept { return !it.current_.has_value(); }

 private:
  Owner* owner_ = nullptr;
  mutable std::optional<Value> current_;
};

}  // namespace loom::detail
