// loom/schedule/detail/engine.hpp — LoaderEngine: the worker threads, the bounded window of
// batches per device, and the ordered stop event behind both generator loaders.
//
// GeneratorLoader runs one engine with M device slots; RankGeneratorLoader runs one with a single
// slot (its rank) and agrees with the other ranks on top of it. Its parts live beside it:
// engine_config.hpp (what it is told, and the option checks), device_window.hpp (a device's
// window of steps), stop_event.hpp (events and their order), cursor.hpp (one generator).
#pragma once

#include <algorithm>
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
/// Workers pull generators (generator i of this core always on worker i % W, one sample at a
/// time, in step order) into the window of its device: `depth` slots for the steps
/// [consumed, consumed + depth), each holding the samples of one step or their collated batch.
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

  // One worker: pulls its generators round-robin (each pull in step order; a generator is skipped
  // while its step lies beyond its device's window), one lock of the engine mutex per sample (the
  // delivery of one sample and the choice of the next), plus one per collated step.
  void run_worker(const std::vector<int>& mine) {
    if (!skip_to_resume(mine)) return;
    std::size_t turn = 0;  // where the round-robin search starts in `mine`
    std::unique_lock lk(mutex_);
    for (;;) {
      int g = -1;
      bool all_finished = false;
      worker_cv_.wait(lk, [&] {
        if (aborted_) return true;
        g = pick(mine, turn, all_finished);
        return g >= 0 || all_finished;
      });
      if (aborted_) return;
      if (g < 0) break;
      const auto gi = static_cast<std::size_t>(g);
      const std::int64_t k = next_step_[gi];
      const int d = device_of_[gi];
      const int p = position_in_device_[gi];
      Slot* sl = slot(d, k);
      LOOM_ASSERT(sl != nullptr, "a pulled step lies in its device's window");
      const bool has_rows = static_cast<bool>(sl->rows.storage);
      lk.unlock();

      std::exception_ptr error;
      std::optional<Sample> s = cursors_[gi]->next_caught(error);
      bool staged = false;
      if (s) {
        try {
          staged = take_sample(d, *sl, has_rows, p, *s);
        } catch (...) {
          error = std::current_exception();
          s.reset();
        }
      }

      lk.lock();
      bool stop_others = false;
      const bool tell_consumer = event_.has_value() || !s;  // what the consumer waits on: an end, a failure
      bool complete = false;
      if (error) {
        record_failure(gi, k, error);
        stop_others = true;
      } else if (!s) {
        ended_at_[gi] = k;
        if (config_.end == EndPolicy::stop_at_shortest) {
          record(StopEvent{
              .step = k, .device = d, .position = p, .failure = false, .generator = g, .sample = -1, .error = {}});
          stop_others = true;
        }
      } else {
        sl->samples[static_cast<std::size_t>(p)].emplace(std::move(*s));
        if (staged) {
          sl->in_row[static_cast<std::size_t>(p)] = 1;
          ++sl->staged;
        }
        complete = ++sl->arrived == sl->samples.size();
        ++next_step_[gi];
        ++position_[gi];
        ++read_[gi];
      }
      if (tell_consumer) consumer_cv_.notify_all();
      if (stop_others) worker_cv_.notify_all();
      // A step can become collatable only when its last sample arrives, or (drain) when a generator ends.
      if (complete || !s || config_.end == EndPolicy::drain) collate_ready(d, lk);
    }
    lk.unlock();
    if (config_.count_unread && config_.end == EndPolicy::stop_at_shortest) count_unread(mine);
  }

  // The next generator of `mine` that can pull, searching round-robin from `turn` (then moved past
  // it); -1 when none can, with all_finished telling whether none ever will. mutex_ held.
  int pick(const std::vector<int>& mine, std::size_t& turn, bool& all_finished) const {
    const std::size_t n = mine.size();
    for (std::size_t i = 0, j = turn; i < n; ++i, j = j + 1 == n ? 0 : j + 1) {
      if (can_pull(mine[j])) {
        turn = j + 1 == n ? 0 : j + 1;
        all_finished = false;
        return mine[j];
      }
    }
    all_finished = std::all_of(mine.begin(), mine.end(), [this](int c) { return finished(c); });
    return -1;
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
    auto* dst = static_cast<char*>(sl.rows.storage.mutable_data()) + sl.rows.offset + sl.row_bytes * p;
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
      consumer_cv_.notify_all();
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
  std::optional<StopEvent> event_;  // guarded by mutex_
  bool aborted_ = false;            // guarded by mutex_
  std::vector<std::thread> threads_;
};

}  // namespace loom::detail
