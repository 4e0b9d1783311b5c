// loom/schedule/detail/progress.hpp — where each generator of a LoaderEngine stands in the schedule
// (its next step, the step its stream ended at, whether it failed, its device slot and its position
// there) and the first stop event, with the rules the engine reads from them: whether a generator
// may still pull a step, whether a device is dry at a step (EndPolicy::drain), whether the stop event
// is final at a step. It knows no samples, windows or threads: the engine holds its mutex around
// every call.
//
// Determinism: events compete in (step, device slot, position) order (stop_event.hpp), so what the
// rules answer depends on where the generators stand, never on thread timing.
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <optional>
#include <utility>
#include <vector>

#include <loom/error.hpp>
#include <loom/schedule/detail/engine_config.hpp>
#include <loom/schedule/detail/stop_event.hpp>
#include <loom/schedule/options.hpp>

namespace loom::detail {

/// The schedule's state of `n` generators (by global id) and its stop event (see the file comment).
///
/// Example: `ScheduleProgress p(config, n); if (p.can_pull(g, window_end)) ...; p.record(event);`
/// Units: steps; a generator's position in its device is its index in config.device_generators[d].
class ScheduleProgress {
 public:
  /// Every generator of `config.device_generators` (ids below `n`) at config.start_step; the others
  /// are not run here (device -1).
  ScheduleProgress(const EngineConfig& config, std::size_t n)
      : end_(config.end), device_generators_(config.device_generators), device_labels_(config.device_labels) {
    next_step_.assign(n, config.start_step);
    ended_at_.assign(n, -1);
    failed_.assign(n, 0);
    device_of_.assign(n, -1);
    position_in_device_.assign(n, -1);
    for (std::size_t d = 0; d < device_generators_.size(); ++d) {
      const auto& gens = device_generators_[d];
      for (std::size_t p = 0; p < gens.size(); ++p) {
        const auto g = static_cast<std::size_t>(gens[p]);
        LOOM_ASSERT(g < n, "every assigned generator has a cursor");
        device_of_[g] = static_cast<int>(d);
        position_in_device_[g] = static_cast<int>(p);
      }
    }
  }

  [[nodiscard]] int device_of(int g) const { return device_of_[static_cast<std::size_t>(g)]; }
  [[nodiscard]] int position_in_device(int g) const { return position_in_device_[static_cast<std::size_t>(g)]; }
  /// The next step generator g pulls.
  [[nodiscard]] std::int64_t next_step(int g) const { return next_step_[static_cast<std::size_t>(g)]; }
  /// The step at which g's stream ended, or -1.
  [[nodiscard]] std::int64_t ended_at(int g) const { return ended_at_[static_cast<std::size_t>(g)]; }
  /// The first stop event so far, if any.
  [[nodiscard]] const std::optional<StopEvent>& event() const { return event_; }

  /// Generator g delivered its sample of its next step.
  void pulled(int g) { ++next_step_[static_cast<std::size_t>(g)]; }
  /// Generator g's stream ended when asked for step k.
  void ended(int g, std::int64_t k) { ended_at_[static_cast<std::size_t>(g)] = k; }

  // Generator at (device d, position p) may still pull step k.
  [[nodiscard]] bool may_pull(std::int64_t k, int d, int p) const { return !event_ || comes_before(k, d, p, *event_); }
  void record(StopEvent e) { keep_first(event_, std::move(e)); }
  // Records generator gi's failure at step k, asked for its sample `sample`.
  void record_failure(std::size_t gi, std::int64_t k, std::int64_t sample, std::exception_ptr error) {
    failed_[gi] = 1;
    const int d = device_of_[gi];
    record(generator_failure(k, d, device_labels_[static_cast<std::size_t>(d)], position_in_device_[gi],
                             static_cast<int>(gi), sample, std::move(error)));
  }

  // Under drain, every generator of device d ended at or before step k.
  [[nodiscard]] bool dry(int d, std::int64_t k) const {
    if (end_ != EndPolicy::drain) return false;
    for (int g : device_generators_[static_cast<std::size_t>(d)]) {
      const auto e = ended_at_[static_cast<std::size_t>(g)];
      if (e < 0 || e > k) return false;
    }
    return true;
  }
  // The event stops the consumer at (k, d) and no earlier event can still appear.
  [[nodiscard]] bool event_final(int d, std::int64_t k) const {
    if (!event_) return false;
    const StopEvent& e = *event_;
    if (e.device == -1) return e.step <= k;
    if (e.step != k) return e.step < k;
    if (e.device != d) return e.device < d;
    const auto& gens = device_generators_[static_cast<std::size_t>(d)];
    for (int p = 0; p < e.position && p < static_cast<int>(gens.size()); ++p) {
      const auto g = static_cast<std::size_t>(gens[static_cast<std::size_t>(p)]);
      if (!(next_step_[g] > k || ended_at_[g] >= 0 || failed_[g])) return false;
    }
    return true;
  }
  // Generator g may pull its next step now: it neither ended nor failed, and the step lies before
  // `window_end` (the end of its device's window) and before the stop event.
  [[nodiscard]] bool can_pull(int g, std::int64_t window_end) const {
    const auto gi = static_cast<std::size_t>(g);
    if (failed_[gi] || ended_at_[gi] >= 0) return false;
    const int d = device_of_[gi];
    const std::int64_t k = next_step_[gi];
    return k < window_end && may_pull(k, d, position_in_device_[gi]);
  }
  [[nodiscard]] bool finished(int g) const {  // nothing more will ever be pulled from g
    const auto gi = static_cast<std::size_t>(g);
    return failed_[gi] || ended_at_[gi] >= 0 || !may_pull(next_step_[gi], device_of_[gi], position_in_device_[gi]);
  }

 private:
  EndPolicy end_;
  std::vector<std::vector<int>> device_generators_;  // per core device slot, global generator ids
  std::vector<int> device_labels_;                   // per slot, the device index shown to users
  // by generator id:
  std::vector<std::int64_t> next_step_;  // next step to pull
  std::vector<std::int64_t> ended_at_;   // step at which the stream ended, -1
  std::vector<char> failed_;
  std::vector<int> device_of_;           // constant: core device slot, -1 = not run here
  std::vector<int> position_in_device_;  // constant
  std::optional<StopEvent> event_;
};

}  // namespace loom::detail
