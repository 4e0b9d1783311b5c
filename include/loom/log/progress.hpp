// loom/log/progress.hpp — global training progress (samples done summed over ranks, samples/s,
// ETA): a live bar on a terminal, a plain line every N seconds otherwise (CI logs, files).
//
// Example:
//   loom::Progress bar{loom::StreamSink{stdout}, me, {.total = sampler_total, .label = "epoch 3"}};
//   for (auto& batch : loader) {
//     train_step(batch);
//     bar.step(comm, batch.num_samples);   // every rank; an all_reduce every sync_every steps
//   }
//   bar.finish(comm);                      // every rank; final sum, final line
//   // not a terminal, every 30 s:  "epoch 3: 1200/5000 samples (24.0%), 120.0 samples/s, elapsed 0:00:10, ETA 0:00:32"
//   // terminal, redrawn in place:  "epoch 3 [#######-----------------------]  24.0% 1200/5000, 120.0 samples/s, ETA 0:00:32"
//
// Collectives: every rank calls step() equally often and finish() once (under loom::Trainer, use
// add_global from on_step instead, which communicates nothing). Units: samples, seconds.
// Throws: loom::InvalidArgument for a negative sample count or bad options (naming them); what the
//         communicator throws.
// Guide: docs/log.md#progress.
// Source: tqdm (a live bar on a tty, `mininterval`) and Keras' `verbose=2` (a line per interval).
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <utility>

#include <fmt/format.h>

#include <loom/comm/communicator.hpp>
#include <loom/comm/host_values.hpp>
#include <loom/error.hpp>
#include <loom/log/rank.hpp>
#include <loom/log/sink.hpp>
#include <loom/trace/recorder.hpp>

namespace loom {

/// How progress is shown: `automatic` picks `bar` on a terminal (TerminalSink::is_terminal) and
/// `lines` otherwise.
enum class ProgressDisplay { automatic, bar, lines };

/// Options of a Progress (an aggregate: `{.total = 60000, .label = "train"}`).
struct ProgressOptions {
  std::int64_t total = 0;          ///< samples over all ranks; 0: unknown (no %, no ETA)
  std::string label = "progress";  ///< first word(s) of every line
  ProgressDisplay display = ProgressDisplay::automatic;
  std::chrono::milliseconds line_interval = std::chrono::seconds(30);  ///< lines mode: at most one line per interval
  std::chrono::milliseconds redraw_interval{100};                      ///< bar mode: at most one redraw per interval
  int sync_every = 10;                                                 ///< steps between sums over ranks (>= 1)
  Leader shown_on = Leader::global_rank_zero;                          ///< which rank(s) show it
  int bar_width = 30;                                                  ///< characters between [ and ]
};

/// A clock Progress can read.
///
/// Requirements:
///  1. `C::time_point`, ordered and subtractable into a std::chrono duration. Reason: elapsed
///     time, rates and the next output time are computed from differences.
///  2. `c.now()` on a const clock returns a time_point. Reason: tests inject a manual clock whose
///     now() they advance by hand, so every line is exact.
/// Not required: monotonicity checks or a static now() (std::chrono::steady_clock models it).
template <class C>
concept ProgressClock = requires(const C& c, typename C::time_point t) {
  { c.now() } -> std::convertible_to<typename C::time_point>;
  std::chrono::duration<double>(t - t);
  { t < t } -> std::convertible_to<bool>;
};

namespace detail {
/// "H:MM:SS" of a non-negative number of seconds (rounded to the nearest second).
inline std::string format_hms(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const auto total = static_cast<std::int64_t>(std::llround(seconds));
  return fmt::format("{}:{:02}:{:02}", total / 3600, (total / 60) % 60, total % 60);
}
}  // namespace detail

/// Global progress of a data-parallel loop, shown by the leader rank(s).
///
/// Example:
///   loom::MemorySink out;                       // not a terminal: lines mode
///   loom::Progress p{out, me, {.total = 100, .label = "train", .line_interval = std::chrono::seconds(10), .sync_every = 1}};
///   p.step(comm, 20);                           // after 10 s on the clock, rank 0 writes
///   // "train: 40/100 samples (40.0%), 4.0 samples/s, elapsed 0:00:10, ETA 0:00:15"  (2 ranks x 20)
template <LogSink Sink = StreamSink, ProgressClock Clock = std::chrono::steady_clock>
class Progress {
 public:
  Progress(Sink sink, RankInfo me, ProgressOptions options = {}, Clock clock = {})
      : sink_(std::move(sink)), me_(me), options_(std::move(options)), clock_(std::move(clock)) {
    me_.validate();
    if (options_.total < 0) throw InvalidArgument(fmt::format("Progress: total {} is negative", options_.total));
    if (options_.sync_every < 1)
      throw InvalidArgument(fmt::format("Progress: sync_every {} is < 1", options_.sync_every));
    if (options_.bar_width < 1) throw InvalidArgument(fmt::format("Progress: bar_width {} is < 1", options_.bar_width));
    if (options_.line_interval.count() < 0 || options_.redraw_interval.count() < 0)
      throw InvalidArgument(fmt::format("Progress: negative interval (line {} ms, redraw {} ms)",
                                        options_.line_interval.count(), options_.redraw_interval.count()));
    shown_ = is_leader(me_, options_.shown_on);
    bool terminal = false;
    if constexpr (TerminalSink<Sink>) terminal = static_cast<bool>(sink_.is_terminal());
    bar_ = options_.display == ProgressDisplay::bar || (options_.display == ProgressDisplay::automatic && terminal);
    if (options_.shown_on == Leader::local_rank_zero) prefix_ = detail::rank_prefix(me_);
    start_ = clock_.now();
    next_output_ = start_ + (bar_ ? std::chrono::milliseconds(0) : options_.line_interval);
  }

  Progress(Progress&&) = delete;  // stays where it was built (it may own a half-drawn bar)
  Progress& operator=(Progress&&) = delete;
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  /// Leaves the terminal on a fresh line if a bar was drawn and finish() was not called.
  ~Progress() {
    if (bar_drawn_ && !finished_) {
      detail::bar_line_open() = false;
      try {
        sink_.write("\n");
      } catch (...) {  // a destructor must not throw
      }
    }
  }

  /// Counts `local_samples` done on this rank in one step. Every rank calls it once per step; every
  /// sync_every-th call is a collective (one float64 all_reduce) after which the leader may write.
  /// Throws: loom::InvalidArgument for a negative count or a call after finish().
  template <Communicator C>
  void step(C& comm, std::int64_t local_samples) {
    if (local_samples < 0)
      throw InvalidArgument(fmt::format("Progress::step: local_samples {} is negative", local_samples));
    if (finished_) throw InvalidArgument("Progress::step: called after finish()");
    local_ += local_samples;
    if (++steps_ % options_.sync_every != 0) return;
    sync(comm);
    show();
  }

  /// Counts `samples` done over ALL ranks, a number every rank already knows (e.g. the
  /// global_samples of a loom::SyncResult at each step of loom::Trainer, reported on every rank):
  /// no collective, so it may be called where ranks run different numbers of batches (a
  /// GlobalBatchSampler deals a step's batches unevenly). The leader may write a line or redraw.
  /// Throws: loom::InvalidArgument for a negative count or a call after finish().
  void add_global(std::int64_t samples) {
    if (samples < 0) throw InvalidArgument(fmt::format("Progress::add_global: samples {} is negative", samples));
    if (finished_) throw InvalidArgument("Progress::add_global: called after finish()");
    known_ += samples;
    global_ += samples;
    show();
  }

  /// Ends the run: a final sum over ranks (a collective: every rank calls it once) and, on the
  /// showing rank, a final line ("<label>: done, N samples in H:MM:SS, R samples/s") or the bar
  /// at its final state followed by a newline.
  template <Communicator C>
  void finish(C& comm) {
    if (finished_) return;
    sync(comm);
    finished_ = true;
    if (!shown_) return;
    const auto now = clock_.now();
    if (bar_) {
      draw_bar(now, true);
    } else {
      const double secs = seconds_since_start(now);
      sink_.write(fmt::format("{}{}: done, {} samples in {}, {:.1f} samples/s\n", prefix_, options_.label, global_,
                              detail::format_hms(secs), rate(secs)));
    }
    sink_.flush();
  }

  /// Samples summed over all ranks at the last sync.
  [[nodiscard]] std::int64_t global_samples() const noexcept { return global_; }
  /// Samples counted on this rank so far (synced or not).
  [[nodiscard]] std::int64_t local_samples() const noexcept { return local_; }
  /// Whether this rank shows progress (is a leader under options.shown_on).
  [[nodiscard]] bool shown() const noexcept { return shown_; }
  /// Whether progress is drawn as a live bar (else: plain lines).
  [[nodiscard]] bool live_bar() const noexcept { return bar_; }
  [[nodiscard]] Sink& sink() noexcept { return sink_; }

  /// The plain-line text of the state at the last sync, as of time `now` (without prefix or '\n').
  [[nodiscard]] std::string line(typename Clock::time_point now) const {
    const double secs = seconds_since_start(now);
    const double r = rate(secs);
    if (options_.total > 0) {
      return fmt::format("{}: {}/{} samples ({:.1f}%), {:.1f} samples/s, elapsed {}, ETA {}", options_.label, global_,
                         options_.total, percent(), r, detail::format_hms(secs), eta(r));
    }
    return fmt::format("{}: {} samples, {:.1f} samples/s, elapsed {}", options_.label, global_, r,
                       detail::format_hms(secs));
  }

 private:
  /// On the showing rank: a line or a redraw, when the interval since the last one has passed.
  void show() {
    if (!shown_) return;
    const auto now = clock_.now();
    if (now < next_output_) return;
    if (bar_) {
      draw_bar(now, false);
      next_output_ = now + options_.redraw_interval;
    } else {
      sink_.write(prefix_ + line(now) + "\n");
      next_output_ = now + options_.line_interval;
    }
  }

  template <Communicator C>
  void sync(C& comm) {
    const double mine = static_cast<double>(local_);
    trace::Scope scope(comm, trace::Context::progress);
    global_ = known_ + static_cast<std::int64_t>(detail::all_reduce_sums(comm, std::span<const double>(&mine, 1))[0]);
  }

  [[nodiscard]] double seconds_since_start(typename Clock::time_point now) const {
    return std::chrono::duration<double>(now - start_).count();
  }
  [[nodiscard]] double rate(double secs) const { return secs > 0 ? static_cast<double>(global_) / secs : 0.0; }
  [[nodiscard]] double percent() const {
    return options_.total > 0 ? 100.0 * static_cast<double>(global_) / static_cast<double>(options_.total) : 0.0;
  }
  [[nodiscard]] std::string eta(double r) const {
    if (global_ >= options_.total) return detail::format_hms(0);
    if (r <= 0) return "?";
    return detail::format_hms(static_cast<double>(options_.total - global_) / r);
  }

  void draw_bar(typename Clock::time_point now, bool final) {
    const double secs = seconds_since_start(now);
    const double r = rate(secs);
    std::string text = "\r" + prefix_ + options_.label;
    if (options_.total > 0) {
      const double fraction = std::clamp(static_cast<double>(global_) / static_cast<double>(options_.total), 0.0, 1.0);
      const auto filled = static_cast<int>(fraction * options_.bar_width);
      text += fmt::format(" [{}{}] {:5.1f}% {}/{}, {:.1f} samples/s, {} {}", std::string(filled, '#'),
                          std::string(options_.bar_width - filled, '-'), percent(), global_, options_.total, r,
                          final ? "elapsed" : "ETA", final ? detail::format_hms(secs) : eta(r));
    } else {
      text += fmt::format(" {} samples, {:.1f} samples/s, elapsed {}", global_, r, detail::format_hms(secs));
    }
    text += "\x1b[K";  // clear what a longer previous redraw left on the right
    if (final) text += "\n";
    sink_.write(text);
    bar_drawn_ = true;
    detail::bar_line_open() = !final;
  }

  Sink sink_;
  RankInfo me_;
  ProgressOptions options_;
  Clock clock_;
  typename Clock::time_point start_{};
  typename Clock::time_point next_output_{};
  std::string prefix_;
  std::int64_t local_ = 0;
  std::int64_t global_ = 0;
  std::int64_t known_ = 0;  // samples added with add_global (the same on every rank)
  std::int64_t steps_ = 0;
  bool shown_ = false;
  bool bar_ = false;
  bool bar_drawn_ = false;
  bool finished_ = false;
};

template <class Sink>
Progress(Sink, RankInfo) -> Progress<Sink>;
template <class Sink>
Progress(Sink, RankInfo, ProgressOptions) -> Progress<Sink>;
template <class Sink, class Clock>
Progress(Sink, RankInfo, ProgressOptions, Clock) -> Progress<Sink, Clock>;

}  // namespace loom
