// loom/schedule/detail/device_window.hpp — one device slot's bounded window inside LoaderEngine:
// `depth` steps [consumed, consumed + depth), each holding the samples pulled for that step (by
// position of their generator in the device) or, once collated, its batch; plus the device's
// collate function and transfer, and the batch a dry device gets under EndPolicy::drain.
//
// Threads: the engine guards the window, `consumed`, `next_collate` and `collating` with its mutex;
// the collate function runs on one worker at a time (collating), the transfer's finish on the consumer.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <optional>
#include <vector>

#include <loom/error.hpp>
#include <loom/schedule/collate_fn.hpp>

namespace loom::detail {

template <class Sample, class Item, class Collate, class Transfer>
struct DeviceWindow {
  /// One step of the window.
  struct Slot {
    explicit Slot(std::size_t n) : samples(n) {}
    std::vector<std::optional<Sample>> samples;  ///< by position in the device
    std::optional<Item> item;                    ///< the collated batch
  };

  /// A window of `depth` empty steps from `start_step`, for `generators` generators.
  DeviceWindow(const Collate& c, const Transfer& t, int depth, std::size_t generators, std::int64_t start_step)
      : collate_fn(c), transfer(t), consumed(start_step), next_collate(start_step), width(generators) {
    for (int i = 0; i < depth; ++i) window.emplace_back(width);
  }

  /// Step k's slot, or nullptr when k lies outside the window.
  Slot* slot(std::int64_t k) {
    const std::int64_t i = k - consumed;
    if (i < 0 || i >= static_cast<std::int64_t>(window.size())) return nullptr;
    return &window[static_cast<std::size_t>(i)];
  }

  /// Collated batches at the front of the window (consecutive steps from `consumed`).
  [[nodiscard]] std::size_t ready() const {
    std::size_t n = 0;
    for (const Slot& s : window) {
      if (!s.item) break;
      ++n;
    }
    return n;
  }

  /// Takes the front step's batch (it must be collated) and opens a new step at the back.
  Item take_front() {
    LOOM_ASSERT(window.front().item.has_value(), "pop() after wait() returned batch");
    Item item = std::move(*window.front().item);
    window.pop_front();
    window.emplace_back(width);
    ++consumed;
    return item;
  }

  /// The batch of type B a dry device gets at `ctx` under drain: collate_fn.empty(ctx) if the
  /// collate function has it, else B{}. Throws loom::InvalidArgument when B has neither.
  template <class B>
  B empty_batch(const CollateContext& ctx) {
    if constexpr (requires {
                    { collate_fn.empty(ctx) } -> std::convertible_to<B>;
                  }) {
      return collate_fn.empty(ctx);
    } else if constexpr (std::default_initializable<B>) {
      return B{};
    } else {
      throw InvalidArgument(
          "schedule: EndPolicy::drain needs a batch type with a default constructor or a collate function with "
          "empty(ctx)");
    }
  }

  Collate collate_fn;  ///< used by one collating worker at a time (collating flag)
  Transfer transfer;
  std::deque<Slot> window;        ///< steps [consumed, consumed + depth)
  std::int64_t consumed = 0;      ///< the consumer's next step
  std::int64_t next_collate = 0;  ///< the next step to collate
  bool collating = false;         ///< a worker is collating this device's step
  std::size_t width = 0;          ///< generators of this device
};

}  // namespace loom::detail
