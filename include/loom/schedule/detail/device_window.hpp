// loom/schedule/detail/device_window.hpp — one device slot's bounded window inside LoaderEngine:
// `depth` steps [consumed, consumed + depth) in a ring of slots, each holding the samples pulled
// for that step (by position of their generator in the device) and its batch buffer, or, once
// collated, its batch; plus the device's collate function, transfer and batch buffer pool, and
// the batch a dry device gets under EndPolicy::drain.
//
// Threads: the engine guards the window, `consumed`, `next_collate` and `collating` with its mutex;
// the collate function runs on one worker at a time (collating), the transfer's finish on the consumer.
#pragma once

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include <c10/core/ScalarType.h>

#include <loom/collate/pool.hpp>
#include <loom/error.hpp>
#include <loom/schedule/collate_fn.hpp>

namespace loom::detail {

template <class Sample, class Item, class Collate, class Transfer>
struct DeviceWindow {
  /// One step of the window.
  struct Slot {
    explicit Slot(std::size_t n) : samples(n), in_row(n, 0) {}
    std::vector<std::optional<Sample>> samples;  ///< by position in the device
    std::optional<Item> item;                    ///< the collated batch
    // Staged rows (stage_rows): the step's batch buffer, `width` rows of the first arrived
    // sample's data shape and dtype; samples of that layout are copied into their row on arrival.
    ByteBlock rows{};                         ///< the buffer (no storage: none yet)
    std::vector<std::int64_t> row_shape{};    ///< data shape of one row
    c10::ScalarType row_dtype = c10::kFloat;  ///< dtype of the rows
    std::int64_t row_bytes = 0;               ///< bytes of one row
    std::vector<char> in_row;                 ///< by position: the sample's data was moved into its row
    std::size_t staged = 0;                   ///< samples whose data was moved into their row
    std::size_t arrived = 0;                  ///< samples placed in `samples`
  };

  /// A window of `depth` empty steps from `start_step`, for `generators` generators. With
  /// DefaultCollate, the device gets a BufferPool of depth + 2 buffers (the window, the step the
  /// consumer holds, one spare), allocated by the collate's options.allocate, else by the
  /// transfer's batch_allocator() when it has one (pinned memory for a CUDA transfer), else
  /// at::empty; the collate uses it when its options name neither a pool nor an allocator (a pool
  /// given there is used for the staged rows too). Rows are staged when the collate accepts
  /// them and reads samples with DefaultProjection.
  DeviceWindow(const Collate& c, const Transfer& t, int depth, std::size_t generators, std::int64_t start_step)
      : collate_fn(c), transfer(t), consumed(start_step), next_collate(start_step), width(generators) {
    window.reserve(static_cast<std::size_t>(depth));
    for (int i = 0; i < depth; ++i) window.emplace_back(width);
    if constexpr (is_default_collate<Collate>) {
      CollateOptions& o = collate_fn.options;
      if (o.pool) {
        pool = o.pool;
      } else {
        BufferPoolOptions po{.allocate = o.allocate, .max_buffers = static_cast<std::size_t>(depth) + 2};
        if constexpr (requires(const Transfer& tr) {
                        { tr.batch_allocator() } -> std::convertible_to<BatchAllocator>;
                      }) {
          if (!po.allocate) po.allocate = transfer.batch_allocator();
        }
        pool = std::make_shared<BufferPool>(std::move(po));
        if (!o.allocate) o.pool = pool;
      }
      stage_rows = collate_fn.accepts_rows() && std::same_as<decltype(collate_fn.projection), DefaultProjection>;
    }
  }

  /// Step k's slot, or nullptr when k lies outside the window. A slot stays at its address while
  /// its step is in the window (the window is a ring of `depth` slots: step k in slot k % depth).
  Slot* slot(std::int64_t k) {
    const std::int64_t i = k - consumed;
    if (i < 0 || i >= static_cast<std::int64_t>(window.size())) return nullptr;
    return &window[static_cast<std::size_t>(k % static_cast<std::int64_t>(window.size()))];
  }

  /// Collated batches at the front of the window (consecutive steps from `consumed`).
  [[nodiscard]] std::size_t ready() const {
    const auto depth = static_cast<std::int64_t>(window.size());
    std::size_t n = 0;
    for (std::int64_t i = 0; i < depth; ++i) {
      if (!window[static_cast<std::size_t>((consumed + i) % depth)].item) break;
      ++n;
    }
    return n;
  }

  /// Takes the front step's batch (it must be collated) and empties its slot for step
  /// consumed + depth.
  Item take_front() {
    Slot& front = window[static_cast<std::size_t>(consumed % static_cast<std::int64_t>(window.size()))];
    LOOM_ASSERT(front.item.has_value(), "pop() after wait() returned batch");
    Item item = std::move(*front.item);
    front.item.reset();
    for (auto& sample : front.samples) sample.reset();
    std::fill(front.in_row.begin(), front.in_row.end(), 0);
    front.rows = ByteBlock{};
    front.staged = 0;
    front.arrived = 0;
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
  std::shared_ptr<BufferPool> pool;  ///< batch buffers (DefaultCollate only; else null)
  bool stage_rows = false;           ///< copy samples' data into their row of the step's buffer on arrival
  std::vector<Slot> window;          ///< steps [consumed, consumed + depth)
  std::int64_t consumed = 0;         ///< the consumer's next step
  std::int64_t next_collate = 0;     ///< the next step to collate
  bool collating = false;            ///< a worker is collating this device's step
  std::size_t width = 0;             ///< generators of this device
};

}  // namespace loom::detail
