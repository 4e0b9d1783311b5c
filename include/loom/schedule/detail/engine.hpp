// loom/schedule/detail/engine.hpp — LoaderEngine: the worker threads, the bounded window of
// batches per device, and the ordered stop event behind both generator loaders.
//
// GeneratorLoader runs one engine with M device slots; RankGeneratorLoader runs one with a single
// slot (its rank) and agrees with the other ranks on top of it. This header is the consumer's side
// (waiting for a step, taking it, stopping); its parts live beside it: workers.hpp (the worker
// threads and the state they fill), engine_config.hpp (what it is told, and the option checks),
// device_window.hpp (a device's window of steps), progress.hpp (where each generator stands, and the
// stop event's rules), stop_event.hpp (events and their order), cursor.hpp (one generator).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include <loom/error.hpp>
#include <loom/schedule/collate_fn.hpp>
#include <loom/schedule/detail/cursor.hpp>
#include <loom/schedule/detail/engine_config.hpp>
#include <loom/schedule/detail/stop_event.hpp>
#include <loom/schedule/detail/workers.hpp>

namespace loom::detail {

/// Worker threads, a bounded window of batches per device, and the ordered stop event.
///
/// The workers (EngineWorkers, workers.hpp) fill each device's window; the consumer waits for a
/// step and takes it here.
/// Determinism: a sample's place depends only on (generator, step); the stop event is the first
/// in (step, device, position) order, and the consumer acts on it only once every generator
/// before it has resolved that step, so thread timing never changes what the consumer sees.
template <class G, class Collate, class Transfer>
class LoaderEngine : public EngineWorkers<G, Collate, Transfer> {
  using Base = EngineWorkers<G, Collate, Transfer>;
  // What the consumer's side reads of the workers' state (mutex_ guards it; see workers.hpp).
  using Base::collated;
  using Base::consumer_cv_;
  using Base::devices_;
  using Base::mutex_;
  using Base::progress_;
  using Base::step_resolved;
  using Base::waiting_step_;
  using Base::worker_cv_;
  using typename Base::Device;

 public:
  using Base::label;
  using Base::num_devices;
  using typename Base::B;
  using typename Base::Cursor;
  using typename Base::Item;
  enum class Resolved { batch, dry, event };

  /// Starts the workers. `cursors` is indexed by global generator id; entries of generators this
  /// core does not run may be null.
  LoaderEngine(EngineConfig config, std::vector<std::unique_ptr<Cursor>> cursors, const Collate& collate_fn,
               const Transfer& transfer)
      : Base(std::move(config), std::move(cursors), collate_fn, transfer) {}

  /// Blocks until step k of device slot d is resolved: its batch is collated, the device ran dry
  /// (drain: all its generators ended at or before k), or the stop event at (k, d) is final.
  /// The caller has taken every step < k of every device, and step k of devices < d.
  Resolved wait(int d, std::int64_t k) {
    std::unique_lock lk(mutex_);
    Resolved r = Resolved::batch;
    consumer_cv_.wait(lk, [&] {
      if (collated(d, k))
        r = Resolved::batch;
      else if (progress_.dry(d, k))
        r = Resolved::dry;
      else if (progress_.event_final(d, k))
        r = Resolved::event;
      else
        return false;
      return true;
    });
    return r;
  }

  /// Blocks until step k of every device slot is resolved (as wait() would return at once), or
  /// until the stop event is final at some device's step k: the consumer is woken once, when the
  /// last device's batch of the step is collated, not once per device. The caller has taken
  /// every step < k.
  void wait_step(std::int64_t k) {
    std::unique_lock lk(mutex_);
    waiting_step_ = k;
    consumer_cv_.wait(lk, [&] { return step_resolved(k); });
    waiting_step_ = -1;
  }

  /// Collated batches ready for device slot d (consecutive steps from the one the consumer is at).
  std::size_t ready(int d) {
    std::lock_guard lk(mutex_);
    return devices_[static_cast<std::size_t>(d)]->ready();
  }

  /// Takes the front batch of device slot d (wait() returned batch) and finishes its transfer.
  /// The freed window slot is handed to the workers by the next release().
  Item pop(int d) {
    Device& dev = *devices_[static_cast<std::size_t>(d)];
    std::optional<Item> item;
    {
      std::lock_guard lk(mutex_);
      item.emplace(dev.take_front());
    }
    dev.transfer.finish(item->batch, label(d), item->ticket);
    return std::move(*item);
  }

  /// Takes step k of every device slot under one lock, when wait_step(k) returned and no stop
  /// event ends the schedule at step k: items[d] = device d's batch (its transfer not finished
  /// yet: see finish()), or std::nullopt for a device that ran dry (drain). Returns false and
  /// takes nothing when the stop event is final at step k (see event()). `items` has one entry
  /// per device slot. The freed window slots are handed to the workers by the next release().
  bool take_step(std::int64_t k, std::vector<std::optional<Item>>& items) {
    std::lock_guard lk(mutex_);
    LOOM_ASSERT(step_resolved(k), "take_step after wait_step");
    for (int d = 0; d < num_devices(); ++d)
      if (!collated(d, k) && !progress_.dry(d, k)) return false;
    for (int d = 0; d < num_devices(); ++d) {
      auto& item = items[static_cast<std::size_t>(d)];
      item.reset();
      if (collated(d, k)) item.emplace(devices_[static_cast<std::size_t>(d)]->take_front());
    }
    return true;
  }

  /// Finishes the transfer of a batch take_step() took for device slot d (on the consumer's thread).
  void finish(int d, Item& item) {
    devices_[static_cast<std::size_t>(d)]->transfer.finish(item.batch, label(d), item.ticket);
  }

  /// Wakes the workers after pop()s (once per step, not once per device: fewer wake-ups).
  void release() { worker_cv_.notify_all(); }

  /// The stop event (valid after wait() returned event).
  StopEvent event() {
    std::lock_guard lk(mutex_);
    LOOM_ASSERT(progress_.event().has_value(), "event() without an event");
    return *progress_.event();
  }

  /// The batch a dry device gets under drain: collate function.empty(ctx) if it has one, else B{}.
  B empty_batch(int d, std::int64_t k) {
    return devices_[static_cast<std::size_t>(d)]->template empty_batch<B>(
        CollateContext{.device = label(d), .step = k, .generators = {}});
  }

  /// Records an external stop at step k (nothing at or after step k is pulled any more).
  void stop_at(std::int64_t k) {
    {
      std::lock_guard lk(mutex_);
      progress_.record(StopEvent{
          .step = k, .device = -1, .position = 0, .failure = false, .generator = -1, .sample = -1, .error = {}});
    }
    worker_cv_.notify_all();
  }
};

}  // namespace loom::detail
