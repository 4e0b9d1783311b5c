// loom/schedule/detail/workers.hpp — EngineWorkers: the worker threads of a LoaderEngine and the
// state they fill: each generator's cursor and counters, a window of steps per device
// (device_window.hpp), where each generator stands and the stop event (progress.hpp), all guarded by
// one mutex, with the two condition variables that wake the workers and the consumer. The consumer's
// side (waiting for a step and taking it) is LoaderEngine's (engine.hpp).
//
// Threads: each generator is pulled by one worker only; the worker that completes a step collates
// it; `mutex_` guards the windows, the progress and the flags (see each member).
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <thread>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include <loom/error.hpp>
#include <loom/schedule/collate_fn.hpp>
#include <loom/schedule/detail/cursor.hpp>
#include <loom/schedule/detail/device_window.hpp>
#include <loom/schedule/detail/engine_config.hpp>
#include <loom/schedule/detail/progress.hpp>
#include <loom/schedule/detail/stop_event.hpp>
#include <loom/schedule/generator.hpp>
#include <loom/schedule/options.hpp>

namespace loom::detail {

/// The worker threads behind LoaderEngine, and what they fill (see the file comment).
///
/// Workers pull generators (generator i of this core always on worker i % W, each in step
/// order, in rounds: see run_worker) into the window of its device: `depth` slots for the steps
/// [consumed, consumed + depth), each holding the samples of one step or their collated batch,
/// and (DefaultCollate) the step's pooled batch buffer that samples are copied into on arrival.
/// The worker that completes a step collates it (one collate at a time per device, in step order).
template <class G, class Collate, class Transfer>
class EngineWorkers {
 public:
  using Sample = generator_sample_t<G>;
  using B = collate_result_t<Collate, Sample>;
  using Ticket = typename Transfer::Ticket;
  using Cursor = GeneratorCursor<G>;

  struct Item {
    B batch;
    Ticket ticket;
    std::vector<int> generators;
    bool partial = false;
  };

  EngineWorkers(const EngineWorkers&) = delete;
  EngineWorkers& operator=(const EngineWorkers&) = delete;

  [[nodiscard]] int num_devices() const noexcept { return static_cast<int>(devices_.size()); }
  [[nodiscard]] int num_workers() const noexcept { return static_cast<int>(threads_.size()); }

  /// Stops every worker now and joins them (promptly: each finishes at most the sample it is
  /// pulling or the batch it is collating). Safe to call more than once.
  void abort() noexcept {
    {
      std::lock_guard lk(mutex_);
      aborted_ = true;
      stopping_.store(true, std::memory_order_relaxed);
    }
    worker_cv_.notify_all();
    consumer_cv_.notify_all();
    join();
  }

  /// Waits for the workers to finish on their own (after an end: they may count unread samples).
  void join() noexcept {
    for (auto& t : threads_)
      if (t.joinable()) t.join();
  }

  /// After join(): position of generator g in its stream (samples skipped + read).
  [[nodiscard]] std::int64_t position(int g) const { return position_[static_cast<std::size_t>(g)]; }
  /// After join(): whether generator g reached its end.
  [[nodiscard]] bool ended(int g) const { return cursors_[static_cast<std::size_t>(g)]->ended(); }
  /// After join(): whether every sample of g was read (so unread counts are exact).
  [[nodiscard]] bool counted(int g) const { return counted_[static_cast<std::size_t>(g)] != 0 && ended(g); }
  [[nodiscard]] int label(int d) const { return config_.device_labels[static_cast<std::size_t>(d)]; }
  [[nodiscard]] const std::vector<int>& generators(int d) const {
    return config_.device_generators[static_cast<std::size_t>(d)];
  }

 protected:
  /// Starts the workers. `cursors` is indexed by global generator id; entries of generators this
  /// core does not run may be null.
  EngineWorkers(EngineConfig config, std::vector<std::unique_ptr<Cursor>> cursors, const Collate& collate_fn,
                const Transfer& transfer)
      : config_(std::move(config)), cursors_(std::move(cursors)), progress_(config_, cursors_.size()) {
    const std::size_t n = cursors_.size();
    position_.assign(n, 0);
    read_.assign(n, 0);
    counted_.assign(n, 1);
    std::vector<int> active;
    for (std::size_t d = 0; d < config_.device_generators.size(); ++d) {
      const auto& gens = config_.device_generators[d];
      for (std::size_t p = 0; p < gens.size(); ++p) {
        const auto g = static_cast<std::size_t>(gens[p]);
        LOOM_ASSERT(g < n && cursors_[g] != nullptr, "every assigned generator has a cursor");
        active.push_back(gens[p]);
      }
      devices_.push_back(
          std::make_unique<Device>(collate_fn, transfer, config_.depth, gens.size(), config_.start_step));
    }
    std::sort(active.begin(), active.end());
    const int w = config_.workers <= 0 ? static_cast<int>(active.size())
                                       : std::min<int>(config_.workers, static_cast<int>(active.size()));
    std::vector<std::vector<int>> mine(static_cast<std::size_t>(w));
    for (std::size_t i = 0; i < active.size(); ++i) mine[i % static_cast<std::size_t>(w)].push_back(active[i]);
    try {
      for (auto& gens : mine) threads_.emplace_back([this, gens] { run_worker(gens); });
    } catch (...) {
      abort();
      throw;
    }
  }

  ~EngineWorkers() { abort(); }

  using Device = DeviceWindow<Sample, Item, Collate, Transfer>;
  using Slot = typename Device::Slot;

  Slot* slot(int d, std::int64_t k) { return devices_[static_cast<std::size_t>(d)]->slot(k); }
  bool collated(int d, std::int64_t k) {
    Slot* s = slot(d, k);
    return s != nullptr && s->item.has_value();
  }
  // Every device's step k is collated or dry, or the stop event is final at some device's step k.
  bool step_resolved(std::int64_t k) {
    for (int d = 0; d < num_devices(); ++d) {
      if (collated(d, k) || progress_.dry(d, k)) continue;
      return progress_.event_final(d, k);
    }
    return true;
  }

 private:
  // Records generator gi's failure at step k (its sample position_[gi]); mutex_ held.
  void record_failure(std::size_t gi, std::int64_t k, std::exception_ptr error) {
    progress_.record_failure(gi, k, position_[gi], std::move(error));
  }

  bool can_pull(int g) const {
    return progress_.can_pull(g, devices_[static_cast<std::size_t>(progress_.device_of(g))]->consumed + config_.depth);
  }

  // One pick of a worker: generator g's sample for step k (position p of device d, slot sl) and
  // what pulling it gave.
  struct Pull {
    int g = -1;
    std::int64_t k = 0;
    int d = 0;
    int p = 0;
    Slot* sl = nullptr;
    bool has_rows = false;  // sl->rows was set when picked
    std::optional<Sample> s;
    bool staged = false;
    std::exception_ptr error;
  };

  // One worker. Under the engine mutex it picks every generator of `mine` that can pull now (its
  // next step lies in its device's window and before any stop event), round-robin from where the
  // last round stopped; then, without the mutex, pulls them one after another (stopping at a
  // failure or an abort); then, under the mutex again, delivers the samples and collates the
  // steps they completed, and picks the next round. So the mutex is taken about twice per round,
  // not per sample, plus once per collated step.
  void run_worker(const std::vector<int>& mine) {
    if (!skip_to_resume(mine)) return;
    std::size_t turn = 0;  // where the next round starts in `mine`
    std::vector<Pull> round;
    round.reserve(mine.size());
    std::vector<int> collate_devices;
    std::unique_lock lk(mutex_);
    for (;;) {
      bool all_finished = false;
      worker_cv_.wait(lk, [&] {
        if (aborted_) return true;
        pick(mine, turn, round, all_finished);
        return !round.empty() || all_finished;
      });
      if (aborted_) return;
      if (round.empty()) break;
      lk.unlock();

      std::size_t pulled = 0;
      for (Pull& pl : round) {
        if (stopping_.load(std::memory_order_relaxed)) break;
        if (std::optional<Sample> got = cursors_[static_cast<std::size_t>(pl.g)]->next_caught(pl.error))
          pl.s.emplace(std::move(*got));  // Sample need not be assignable
        if (pl.s) {
          try {
            pl.staged =
                devices_[static_cast<std::size_t>(pl.d)]->stage_sample(*pl.sl, pl.has_rows, pl.p, *pl.s, mutex_);
          } catch (...) {
            pl.error = std::current_exception();
            pl.s.reset();
          }
        }
        ++pulled;
        if (pl.error) break;  // the schedule fails here: the rest of the round is not pulled
      }

      lk.lock();
      bool tell_consumer = false;  // what the consumer waits on: an end, a failure
      bool stop_others = false;
      collate_devices.clear();
      for (std::size_t i = 0; i < pulled; ++i) {
        Pull& pl = round[i];
        const auto gi = static_cast<std::size_t>(pl.g);
        tell_consumer = tell_consumer || progress_.event().has_value() || !pl.s;
        bool collate = config_.end == EndPolicy::drain || !pl.s;  // drain: an end may complete steps
        if (pl.error) {
          record_failure(gi, pl.k, pl.error);
          stop_others = true;
        } else if (!pl.s) {
          progress_.ended(pl.g, pl.k);
          if (config_.end == EndPolicy::stop_at_shortest) {
            progress_.record(StopEvent{.step = pl.k,
                                       .device = pl.d,
                                       .position = pl.p,
                                       .failure = false,
                                       .generator = pl.g,
                                       .sample = -1,
                                       .error = {}});
            stop_others = true;
          }
        } else {
          Slot& sl = *pl.sl;
          sl.samples[static_cast<std::size_t>(pl.p)].emplace(std::move(*pl.s));
          if (pl.staged) {
            sl.in_row[static_cast<std::size_t>(pl.p)] = 1;
            ++sl.staged;
          }
          if (++sl.arrived == sl.samples.size()) collate = true;  // the step's last sample
          progress_.pulled(pl.g);
          ++position_[gi];
          ++read_[gi];
        }
        if (collate && std::find(collate_devices.begin(), collate_devices.end(), pl.d) == collate_devices.end())
          collate_devices.push_back(pl.d);
      }
      round.clear();
      if (tell_consumer) consumer_cv_.notify_all();
      if (stop_others) worker_cv_.notify_all();
      for (int d : collate_devices) collate_ready(d, lk);
    }
    lk.unlock();
    if (config_.count_unread && config_.end == EndPolicy::stop_at_shortest) count_unread(mine);
  }

  // Fills `round` with every generator of `mine` that can pull now, in round-robin order from
  // `turn` (then moved past the last one picked); all_finished tells, when none can, whether none
  // ever will. mutex_ held.
  void pick(const std::vector<int>& mine, std::size_t& turn, std::vector<Pull>& round, bool& all_finished) {
    round.clear();
    const std::size_t n = mine.size();
    for (std::size_t i = 0, j = turn; i < n; ++i, j = j + 1 == n ? 0 : j + 1) {
      const int c = mine[j];
      if (!can_pull(c)) continue;
      Pull pl;
      pl.g = c;
      pl.k = progress_.next_step(c);
      pl.d = progress_.device_of(c);
      pl.p = progress_.position_in_device(c);
      pl.sl = slot(pl.d, pl.k);
      LOOM_ASSERT(pl.sl != nullptr, "a pulled step lies in its device's window");
      pl.has_rows = static_cast<bool>(pl.sl->rows.storage);
      round.push_back(std::move(pl));
      turn = j + 1 == n ? 0 : j + 1;
    }
    all_finished =
        round.empty() && std::all_of(mine.begin(), mine.end(), [this](int c) { return progress_.finished(c); });
  }

  // Collates the device's complete steps, in step order, one collate at a time per device.
  // Called and returns with `lk` (on mutex_) held; unlocks it while a collate function runs.
  void collate_ready(int d, std::unique_lock<std::mutex>& lk) {
    Device& dev = *devices_[static_cast<std::size_t>(d)];
    const auto& gens = generators(d);
    for (;;) {
      std::vector<Sample> samples;
      std::vector<int> ids;
      at::Tensor rows;
      if (dev.collating || aborted_) return;
      const std::int64_t k = dev.next_collate;
      Slot* sl = slot(d, k);
      if (sl == nullptr) return;
      if (sl->arrived < gens.size()) {
        for (std::size_t p = 0; p < gens.size(); ++p) {
          if (sl->samples[p]) continue;
          const auto e = progress_.ended_at(gens[p]);
          if (config_.end == EndPolicy::drain && e >= 0 && e <= k) continue;
          return;  // still being pulled (or ended / failed under stop_at_shortest: never complete)
        }
      }
      if (!dev.take_samples(*sl, gens, samples, ids, rows)) return;  // drain: the device ran dry at step k
      dev.collating = true;
      lk.unlock();

      std::optional<Item> item;
      std::exception_ptr error;
      try {
        CollateContext ctx{
            .device = label(d), .step = k, .generators = std::span<const int>(ids), .rows = std::move(rows)};
        B batch = dev.collate_fn(std::span<Sample>(samples), ctx);
        samples.clear();
        Ticket ticket = dev.transfer.start(batch, label(d));
        const bool partial = ids.size() < gens.size();
        item.emplace(Item{std::move(batch), std::move(ticket), std::move(ids), partial});
      } catch (...) {
        error = std::current_exception();
      }
      samples.clear();

      lk.lock();
      dev.collating = false;
      if (error) {
        progress_.record(StopEvent{.step = k,
                                   .device = d,
                                   .position = static_cast<int>(gens.size()),
                                   .failure = true,
                                   .generator = -1,
                                   .sample = -1,
                                   .error = error});
      } else {
        slot(d, k)->item = std::move(item);
        ++dev.next_collate;
      }
      // A consumer in wait_step(k) is woken only once its whole step is resolved (or on an error).
      if (error || waiting_step_ < 0 || (waiting_step_ == k && step_resolved(k))) consumer_cv_.notify_all();
      if (error) {
        worker_cv_.notify_all();
        return;
      }
    }
  }

  // Skips the resumed samples of this worker's generators; false if a generator threw (recorded).
  bool skip_to_resume(const std::vector<int>& mine) {
    for (int g : mine) {
      const auto gi = static_cast<std::size_t>(g);
      const std::int64_t n = config_.skip.empty() ? 0 : config_.skip[gi];
      if (n == 0) continue;
      std::int64_t done = 0;
      std::exception_ptr error;
      try {
        done = cursors_[gi]->skip(n);
      } catch (...) {
        error = std::current_exception();
      }
      std::lock_guard lk(mutex_);
      if (error) {
        record_failure(gi, config_.start_step, error);
        consumer_cv_.notify_all();
        worker_cv_.notify_all();
        return false;
      }
      position_[gi] = done;
    }
    return true;
  }

  // After a stop_at_shortest end: reads this worker's generators on (dropping the samples), each
  // to its end or for config_.count_limit samples, whichever comes first, so the report's unread
  // counts are exact for the generators that ended. Stops on abort or on a failure event.
  void count_unread(const std::vector<int>& mine) {
    for (int g : mine) {
      const auto gi = static_cast<std::size_t>(g);
      const auto [read, end] = cursors_[gi]->count_to_end(config_.count_limit, [&] {
        std::lock_guard lk(mutex_);
        return !aborted_ && progress_.event() && !progress_.event()->failure;
      });
      position_[gi] += read;
      read_[gi] += read;
      if (end != CountEnd::ended) counted_[gi] = 0;
      if (end == CountEnd::stopped) return;
    }
  }

 protected:
  EngineConfig config_;
  std::vector<std::unique_ptr<Cursor>> cursors_;  // by generator id; each pulled by one worker only
  // by generator id:
  std::vector<std::int64_t> position_;  // stream position (skipped + read); written by its worker
  std::vector<std::int64_t> read_;      // samples read in this run; written by its worker
  std::vector<char> counted_;           // written by its worker
  ScheduleProgress progress_;           // guarded by mutex_: where each generator stands, the stop event
  std::vector<std::unique_ptr<Device>> devices_;
  std::mutex mutex_;
  std::condition_variable consumer_cv_;
  std::condition_variable worker_cv_;
  bool aborted_ = false;               // guarded by mutex_
  std::atomic<bool> stopping_{false};  // aborted_, read by workers between the pulls of a round
  std::int64_t waiting_step_ = -1;     // guarded by mutex_: the step the consumer waits for in wait_step, or -1
  std::vector<std::thread> threads_;
};

}  // namespace loom::detail
