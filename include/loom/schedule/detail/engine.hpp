// loom/schedule/detail/engine.hpp — LoaderEngine: the worker threads, the bounded window of
// batches per device, and the ordered stop event behind both generator loaders.
//
// GeneratorLoader runs one engine with M device slots; RankGeneratorLoader runs one with a single
// slot (its rank) and agrees with the other ranks on top of it. Its parts live beside it:
// engine_config.hpp (what it is told, and the option checks), device_window.hpp (a device's
// window of steps), stop_event.hpp (events and their order), cursor.hpp (one generator).
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/util/SmallVector.h>

#include <loom/collate/pool.hpp>
#include <loom/collate/transfer.hpp>
#include <loom/error.hpp>
#include <loom/schedule/collate_fn.hpp>
#include <loom/schedule/detail/cursor.hpp>
#include <loom/schedule/detail/device_window.hpp>
#include <loom/schedule/detail/engine_config.hpp>
#include <loom/schedule/detail/own_sample.hpp>
#include <loom/schedule/detail/stop_event.hpp>
#include <loom/schedule/generator.hpp>
#include <loom/schedule/options.hpp>
#include <loom/schedule/results.hpp>

namespace loom::detail {

/// Worker threads, a bounded window of batches per device, and the ordered stop event.
///
/// Workers pull generators (generator i of this core always on worker i % W, each in step
/// order, in rounds: see run_worker) into the window of its device: `depth` slots for the steps
/// [consumed, consumed + depth), each holding the samples of one step or their collated batch,
/// and (DefaultCollate) the step's pooled batch buffer that samples are copied into on arrival.
/// The worker that completes a step collates it (one collate at a time per device, in step order).
/// Determinism: a sample's place depends only on (generator, step); the stop event is the first
/// in (step, device, position) order, and the consumer acts on it only once every generator
/// before it has resolved that step, so thread timing never changes what the consumer sees.
template <class G, class Collate, class Transfer>
class LoaderEngine {
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
  enum class Resolved { batch, dry, event };

  /// `cursors` is indexed by global generator id; entries of generators this core does not run
  /// may be null.
  LoaderEngine(EngineConfig config, std::vector<std::unique_ptr<Cursor>> cursors, const Collate& collate_fn,
               const Transfer& transfer)
      : config_(std::move(config)), cursors_(std::move(cursors)) {
    const std::size_t n = cursors_.size();
    position_.assign(n, 0);
    read_.assign(n, 0);
    counted_.assign(n, 1);
    next_step_.assign(n, config_.start_step);
    ended_at_.assign(n, -1);
    failed_.assign(n, 0);
    device_of_.assign(n, -1);
    position_in_device_.assign(n, -1);
    std::vector<int> active;
    for (std::size_t d = 0; d < config_.device_generators.size(); ++d) {
      const auto& gens = config_.device_generators[d];
      for (std::size_t p = 0; p < gens.size(); ++p) {
        const auto g = static_cast<std::size_t>(gens[p]);
        LOOM_ASSERT(g < n && cursors_[g] != nullptr, "every assigned generator has a cursor");
        device_of_[g] = static_cast<int>(d);
        position_in_device_[g] = static_cast<int>(p);
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

  LoaderEngine(const LoaderEngine&) = delete;
  LoaderEngine& operator=(const LoaderEngine&) = delete;
  ~LoaderEngine() { abort(); }

  [[nodiscard]] int num_devices() const noexcept { return static_cast<int>(devices_.size()); }
  [[nodiscard]] int num_workers() const noexcept { return static_cast<int>(threads_.size()); }

  /// Blocks until step k of device slot d is resolved: its batch is collated, the device ran dry
  /// (drain: all its generators ended at or before k), or the stop event at (k, d) is final.
  /// The caller has taken every step < k of every device, and step k of devices < d.
  Resolved wait(int d, std::int64_t k) {
    std::unique_lock lk(mutex_);
    Resolved r = Resolved::batch;
    consumer_cv_.wait(lk, [&] {
      if (collated(d, k))
        r = Resolved::batch;
      else if (dry(d, k))
        r = Resolved::dry;
      else if (event_final(d, k))
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
      if (!collated(d, k) && !dry(d, k)) return false;
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
    LOOM_ASSERT(event_.has_value(), "event() without an event");
    return *event_;
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
      record(StopEvent{
          .step = k, .device = -1, .position = 0, .failure = false, .generator = -1, .sample = -1, .error = {}});
    }
    worker_cv_.notify_all();
  }

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

 private:
  using Device = DeviceWindow<Sample, Item, Collate, Transfer>;
  using Slot = typename Device::Slot;

  // Generator at (device d, position p) may still pull step k.
  bool may_pull(std::int64_t k, int d, int p) const { return !event_ || comes_before(k, d, p, *event_); }
  void record(StopEvent e) { keep_first(event_, std::move(e)); }
  // Records generator gi's failure at step k (its sample position_[gi]); mutex_ held.
  void record_failure(std::size_t gi, std::int64_t k, std::exception_ptr error) {
    failed_[gi] = 1;
    const int d = device_of_[gi];
    record(generator_failure(k, d, label(d), position_in_device_[gi], static_cast<int>(gi), position_[gi],
                             std::move(error)));
  }

  Slot* slot(int d, std::int64_t k) { return devices_[static_cast<std::size_t>(d)]->slot(k); }
  bool collated(int d, std::int64_t k) {
    Slot* s = slot(d, k);
    return s != nullptr && s->item.has_value();
  }
  bool dry(int d, std::int64_t k) const {
    if (config_.end != EndPolicy::drain) return false;
    for (int g : generators(d)) {
      const auto e = ended_at_[static_cast<std::size_t>(g)];
      if (e < 0 || e > k) return false;
    }
    return true;
  }
  // Every device's step k is collated or dry, or the stop event is final at some device's step k.
  bool step_resolved(std::int64_t k) {
    for (int d = 0; d < num_devices(); ++d) {
      if (collated(d, k) || dry(d, k)) continue;
      return event_final(d, k);
    }
    return true;
  }
  // The event stops the consumer at (k, d) and no earlier event can still appear.
  bool event_final(int d, std::int64_t k) const {
    if (!event_) return false;
    const StopEvent& e = *event_;
    if (e.device == -1) return e.step <= k;
    if (e.step != k) return e.step < k;
    if (e.device != d) return e.device < d;
    const auto& gens = generators(d);
    for (int p = 0; p < e.position && p < static_cast<int>(gens.size()); ++p) {
      const auto g = static_cast<std::size_t>(gens[static_cast<std::size_t>(p)]);
      if (!(next_step_[g] > k || ended_at_[g] >= 0 || failed_[g])) return false;
    }
    return true;
  }
  bool can_pull(int g) const {
    const auto gi = static_cast<std::size_t>(g);
    if (failed_[gi] || ended_at_[gi] >= 0) return false;
    const int d = device_of_[gi];
    const std::int64_t k = next_step_[gi];
    return k < devices_[static_cast<std::size_t>(d)]->consumed + config_.depth &&
           may_pull(k, d, position_in_device_[gi]);
  }
  bool finished(int g) const {  // nothing more will ever be pulled from g
    const auto gi = static_cast<std::size_t>(g);
    return failed_[gi] || ended_at_[gi] >= 0 || !may_pull(next_step_[gi], device_of_[gi], position_in_device_[gi]);
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
            pl.staged = take_sample(pl.d, *pl.sl, pl.has_rows, pl.p, *pl.s);
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
        tell_consumer = tell_consumer || event_.has_value() || !pl.s;
        bool collate = config_.end == EndPolicy::drain || !pl.s;  // drain: an end may complete steps
        if (pl.error) {
          record_failure(gi, pl.k, pl.error);
          stop_others = true;
        } else if (!pl.s) {
          ended_at_[gi] = pl.k;
          if (config_.end == EndPolicy::stop_at_shortest) {
            record(StopEvent{.step = pl.k,
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
          ++next_step_[gi];
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
      const auto ci = static_cast<std::size_t>(c);
      Pull pl;
      pl.g = c;
      pl.k = next_step_[ci];
      pl.d = device_of_[ci];
      pl.p = position_in_device_[ci];
      pl.sl = slot(pl.d, pl.k);
      LOOM_ASSERT(pl.sl != nullptr, "a pulled step lies in its device's window");
      pl.has_rows = static_cast<bool>(pl.sl->rows.storage);
      round.push_back(std::move(pl));
      turn = j + 1 == n ? 0 : j + 1;
    }
    all_finished = round.empty() && std::all_of(mine.begin(), mine.end(), [this](int c) { return finished(c); });
  }

  // Makes sample `s` (just pulled for slot `sl`'s step, position p of device d) the loader's own
  // before its generator runs again. With staged rows (DeviceWindow::stage_rows), a data tensor of
  // the step's row layout (the first arrived sample's shape and dtype) is copied into row p of the
  // step's pooled buffer and replaced by that row (the copy collation would make anyway); every
  // other tensor loom reads is copied unless it owns its memory (own_sample). Returns whether the
  // data was staged. `has_rows`: sl.rows was seen set under the mutex. The slot's rows and their
  // layout do not change once set until the step is collated, which waits for this sample, so they
  // are read here without the mutex. Throws what the copy throws (out of memory, the allocator's).
  bool take_sample(int d, Slot& sl, bool has_rows, int p, Sample& s) {
    Device& dev = *devices_[static_cast<std::size_t>(d)];
    at::Tensor* data = dev.stage_rows ? data_tensor(s) : nullptr;
    if (data == nullptr || !data->defined() || !data->is_cpu() || data->dim() == 0 || data->numel() == 0) {
      own_sample(s);
      return false;
    }
    if (!has_rows) {
      std::lock_guard lk(mutex_);
      if (!sl.rows.storage) {
        sl.row_shape.assign(data->sizes().begin(), data->sizes().end());
        sl.row_dtype = data->scalar_type();
        sl.row_bytes = static_cast<std::int64_t>(data->nbytes());
        sl.rows = dev.pool->acquire_block(sl.row_bytes * static_cast<std::int64_t>(dev.width));
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
          const auto e = ended_at_[static_cast<std::size_t>(gens[p])];
          if (config_.end == EndPolicy::drain && e >= 0 && e <= k) continue;
          return;  // still being pulled (or ended / failed under stop_at_shortest: never complete)
        }
      }
      // Every sample's data in its row: the collate function gets them as CollateContext::rows.
      // Otherwise (drain, or a sample of another shape) each staged sample's data becomes a view
      // of its row again, and the collate function reads the samples as they are.
      const bool all_in_rows = sl->staged == gens.size();
      samples.reserve(gens.size());
      ids.reserve(gens.size());
      for (std::size_t p = 0; p < gens.size(); ++p) {
        if (!sl->samples[p]) continue;
        samples.push_back(std::move(*sl->samples[p]));
        sl->samples[p].reset();
        ids.push_back(gens[p]);
        if (!all_in_rows && sl->in_row[p] != 0)
          *data_tensor(samples.back()) =
              carve(sl->rows, sl->row_bytes * static_cast<std::int64_t>(p), sl->row_dtype, sl->row_shape);
      }
      if (samples.empty()) return;  // drain: the device ran dry at step k
      if (all_in_rows) {
        c10::SmallVector<std::int64_t, 8> shape{static_cast<std::int64_t>(gens.size())};
        shape.append(sl->row_shape.begin(), sl->row_shape.end());
        rows = carve(sl->rows, 0, sl->row_dtype, shape);
      }
      sl->rows = ByteBlock{};
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
        record(StopEvent{.step = k,
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
        return !aborted_ && event_ && !event_->failure;
      });
      position_[gi] += read;
      read_[gi] += read;
      if (end != CountEnd::ended) counted_[gi] = 0;
      if (end == CountEnd::stopped) return;
    }
  }

  EngineConfig config_;
  std::vector<std::unique_ptr<Cursor>> cursors_;  // by generator id; each pulled by one worker only
  // by generator id:
  std::vector<std::int64_t> position_;   // stream position (skipped + read); written by its worker
  std::vector<std::int64_t> read_;       // samples read in this run; written by its worker
  std::vector<char> counted_;            // written by its worker
  std::vector<std::int64_t> next_step_;  // guarded by mutex_: next step to pull
  std::vector<std::int64_t> ended_at_;   // guarded by mutex_: step at which the stream ended, -1
  std::vector<char> failed_;             // guarded by mutex_
  std::vector<int> device_of_;           // constant: core device slot, -1 = not run here
  std::vector<int> position_in_device_;  // constant
  std::vector<std::unique_ptr<Device>> devices_;
  std::mutex mutex_;
  std::condition_variable consumer_cv_;
  std::condition_variable worker_cv_;
  std::optional<StopEvent> event_;     // guarded by mutex_
  bool aborted_ = false;               // guarded by mutex_
  std::atomic<bool> stopping_{false};  // aborted_, read by workers between the pulls of a round
  std::int64_t waiting_step_ = -1;     // guarded by mutex_: the step the consumer waits for in wait_step, or -1
  std::vector<std::thread> threads_;
};

}  // namespace loom::detail
