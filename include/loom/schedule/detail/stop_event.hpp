// loom/schedule/detail/stop_event.hpp — the first event that stops a LoaderEngine's production,
// and the order in which events compete.
//
// Determinism: events are ordered by (step, device slot, position of the generator in its device),
// never by time, so which event the consumer sees does not depend on thread timing.
#pragma once

#include <cstdint>
#include <exception>
#include <optional>
#include <string>
#include <utility>

#include <loom/detail/exception_text.hpp>
#include <loom/schedule/results.hpp>

namespace loom::detail {

/// An event that stops production: a stop_at_shortest end, a failure, or an external stop (device
/// -1) requested by the per-rank agreement.
struct StopEvent {
  std::int64_t step = 0;
  int device = 0;    ///< core device slot; -1 = external stop (before every device)
  int position = 0;  ///< generator's position in its device; the device's size for a collate failure
  bool failure = false;
  int generator = -1;          ///< failing / ending generator; -1 for collate/transfer failures and external stops
  std::int64_t sample = -1;    ///< failure: index of the sample the generator was asked for
  std::exception_ptr error{};  ///< failure: what the consumer throws
};

/// Whether (step k, device slot d, position p) comes before event `e`.
inline bool comes_before(std::int64_t k, int d, int p, const StopEvent& e) {
  if (k != e.step) return k < e.step;
  if (d != e.device) return d < e.device;
  return p < e.position;
}

/// Keeps in `first` whichever of it and `e` comes first.
inline void keep_first(std::optional<StopEvent>& first, StopEvent e) {
  if (!first || comes_before(e.step, e.device, e.position, *first)) first = std::move(e);
}

/// The failure of generator `generator` (at `position` in device slot `device`, shown as device
/// `label`) at step `step`, asked for its sample `sample`: the consumer throws a loom::GeneratorError
/// that carries `error`.
inline StopEvent generator_failure(std::int64_t step, int device, int label, int position, int generator,
                                   std::int64_t sample, std::exception_ptr error) {
  return StopEvent{
      .step = step,
      .device = device,
      .position = position,
      .failure = true,
      .generator = generator,
      .sample = sample,
      .error = std::make_exception_ptr(GeneratorError(generator, label, sample, exception_text(error), error))};
}

}  // namespace loom::detail
