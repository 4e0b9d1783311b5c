// loom/reduce/detail/step_verdict.hpp — the one place a window's step verdict is decided: from
// what the arithmetic reduced (counts summed over the ranks, inf/NaN, the squared norm, the integer
// arithmetic's overflow), every rank computes the same Reduction (StepVerdict, clip coefficient)
// and whether the buckets are zeroed. Everything above the reducer reads Reduction::verdict.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include <loom/reduce/concepts.hpp>
#include <loom/reduce/detail/window_core.hpp>
#include <loom/reduce/options.hpp>

namespace loom::detail {

/// What decide_window found: the Reduction, what finish_window throws after the window is closed,
/// and what it does to the buckets first.
struct WindowDecision {
  Reduction reduction;           // what finish_window returns
  bool divisors_differ = false;  // the ranks' loss divisors differ: InvalidArgument
  bool diverged = false;         // the flight recorder's fingerprints differ: CommError
  bool zero = false;             // zero the buckets: the step is not applied
  double scale = 1.0;            // multiply the buckets by it first when below 1 (clipping)
};

/// Decides the window's step from `w` (the same values on every rank): leaving ranks first, then
/// replicas that differ, inf/NaN (in the buckets or the clipped norm), a grid overflow, no samples;
/// else apply. `fingerprint`: this rank's flight-recorder fingerprint of the window.
/// Example: a window whose summed counts hold 0 samples with average = samples decides
///          {.verdict = StepVerdict::skip_no_samples, .no_samples = true}, zero = true.
inline WindowDecision decide_window(const ReducedWindow& w, const ReducerOptions& options, int world_size,
                                    std::int64_t fingerprint) {
  WindowDecision d;
  Reduction& r = d.reduction;
  const WindowCounts& counts = w.summary.counts;
  const bool no_samples = options.average == Average::samples && counts.samples == 0;
  r.global_samples = counts.samples;
  r.all_final = counts.final_ranks == world_size;
  r.ranks_leaving = counts.leaving_ranks;
  // A rank leaving its loop closes its window wherever it is: its report comes first.
  d.divisors_differ = r.ranks_leaving == 0 && counts.divisors_differ();
  d.diverged = r.ranks_leaving == 0 && counts.fingerprints_differ(fingerprint, world_size);
  r.replicas_differ = r.ranks_leaving == 0 && counts.replicas_differ();
  bool non_finite = w.summary.non_finite;
  if (options.max_grad_norm && !no_samples) {
    const double total = std::sqrt(*w.summary.squared_norm);
    r.grad_norm = total;
    if (!std::isfinite(total)) non_finite = true;
    if (!non_finite) {
      r.clip_coef = std::min(1.0, *options.max_grad_norm / (total + 1e-6));
      d.scale = r.clip_coef;
    }
  }
  d.zero = non_finite || no_samples || r.ranks_leaving > 0 || d.divisors_differ || d.diverged || w.grid.overflow ||
           w.grid.too_many_contributions || r.replicas_differ;
  r.non_finite = non_finite;
  r.grid_overflow = w.grid.overflow;
  r.no_samples = no_samples;
  r.reduced = true;
  r.grid_wide_buckets = w.wide_buckets;
  r.verdict = r.ranks_leaving > 0 ? StepVerdict::leaving
              : r.replicas_differ ? StepVerdict::replicas_differ
              : non_finite        ? StepVerdict::skip_non_finite
              : w.grid.overflow   ? StepVerdict::skip_grid_overflow
              : no_samples        ? StepVerdict::skip_no_samples
                                  : StepVerdict::apply;
  return d;
}

}  // namespace loom::detail
