// loom/schedule/detail/device_window.hpp — one device slot's bounded window inside LoaderEngine:
// `depth` steps [consumed, consumed + depth) in a ring of slots, each holding the samples pulled
// for that step (by position of their generator in the device) and its batch buffer, or, once
// collated, its batch; plus the device's collate function, transfer and batch buffer pool, the
// staging of an arriving sample into its step's buffer, the samples of a complete step handed to
// collation, and the batch a dry device gets under EndPolicy::drain.
//
// Threads: the engine guards the window, `consumed`, `next_collate` and `collating` with its mutex;
// the collate function runs on one worker at a time (collating), the transfer's finish on the consumer;
// a sample is staged by the worker that pulled it (stage_sample).
#pragma once

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/util/SmallVector.h>

#include <loom/collate/pool.hpp>
#include <loom/error.hpp>
#include <loom/schedule/collate_fn.hpp>
#include <loom/schedule/detail/own_sample.hpp>

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

  /// Makes sample `s` (just pulled for slot `sl`'s step, position p) the loader's own before its
  /// generator runs again. With staged rows (stage_rows), a data tensor of the step's row layout (the
  /// first arrived sample's shape and dtype) is copied into row p of the step's pooled buffer and
  /// replaced by that row (the copy collation would make anyway); every other tensor loom reads is
  /// copied unless it owns its memory (own_sample). Returns whether the data was staged. `has_rows`:
  /// sl.rows was seen set under the engine's mutex `m`, which is taken here to set them. The slot's
  /// rows and their layout do not change once set until the step is collated, which waits for this
  /// sample, so they are read here without the mutex. Throws what the copy throws (out of memory, the
  /// allocator's).
  bool stage_sample(Slot& sl, bool has_rows, int p, Sample& s, std::mutex& m) {
    at::Tensor* data = stage_rows ? data_tensor(s) : nullptr;
    if (data == nullptr || !data->defined() || !data->is_cpu() || data->dim() == 0 || data->numel() == 0) {
      own_sample(s);
      return false;
    }
    if (!has_rows) {
      std::lock_guard lk(m);
      if (!sl.rows.storage) {
        sl.row_shape.assign(data->sizes().begin(), data->sizes().end());
        sl.row_dtype = data->scalar_type();
        sl.row_bytes = static_cast<std::int64_t>(data->nbytes());
        sl.rows = pool->acquire_block(sl.row_bytes * static_cast<std::int64_t>(width));
      }
    }
    if (data->scalar_type() != sl.row_dtype || data->sizes() != c10::IntArrayRef(sl.row_shape)) {
      own_sample(s);
      return false;
    }
    auto* dst = static_cast<char*>(writable_bytes(sl.rows.storage)) + sl.rows.offset + sl.row_bytes * p;
    if (data->is_contiguous())
      std::memcpy(dst, data->data_ptr(), static_cast<std::size_t>(sl.row_bytes));
    else
      carve(sl.rows, sl.row_bytes * p, sl.row_dtype, data->sizes()).copy_(*data);
    *data = at::Tensor();  // moved into its row: the generator's tensor is not held any longer
    own_sample(s, data);
    return true;
  }

  /// Moves the samples of the complete step in slot `sl` into `samples`, and the ids of their
  /// generators (`gens`: this device's, by position) into `ids`; returns false when there are none
  /// (drain: the device ran dry at that step). Every sample's data in its row: `rows` becomes the
  /// step's rows, which the collate function gets as CollateContext::rows. Otherwise (drain, or a
  /// sample of another shape) each staged sample's data becomes a view of its row again, and the
  /// collate function reads the samples as they are. Then the slot lets go of its rows.
  bool take_samples(Slot& sl, const std::vector<int>& gens, std::vector<Sample>& samples, std::vector<int>& ids,
                    at::Tensor& rows) {
    const bool all_in_rows = sl.staged == gens.size();
    samples.reserve(gens.size());
    ids.reserve(gens.size());
    for (std::size_t p = 0; p < gens.size(); ++p) {
      if (!sl.samples[p]) continue;
      samples.push_back(std::move(*sl.samples[p]));
      sl.samples[p].reset();
      ids.push_back(gens[p]);
      if (!all_in_rows && sl.in_row[p] != 0)
        *data_tensor(samples.back()) =
            carve(sl.rows, sl.row_bytes * static_cast<std::int64_t>(p), sl.row_dtype, sl.row_shape);
    }
    if (samples.empty()) return false;
    if (all_in_rows) {
      c10::SmallVector<std::int64_t, 8> shape{static_cast<std::int64_t>(gens.size())};
      shape.append(sl.row_shape.begin(), sl.row_shape.end());
      rows = carve(sl.rows, 0, sl.row_dtype, shape);
    }
    sl.rows = ByteBlock{};
    return true;
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
