// loom/reduce/concepts.hpp — the GradientReducer concept: what an accumulator needs from the box
// that turns every rank's local gradients into the same global gradient, and what it reports.
//
// Example:
//   reducer.prepare_backward({.sync = false});                         // accumulate only (no_sync)
//   reducer.prepare_backward({.sync = true, .window_samples = 32});    // this backward closes the window
//   loss_sum.backward();
//   if (reducer.finish_window().verdict == loom::StepVerdict::apply) optimizer.step();
//
// Units: samples are counted by the caller (rows of a batch, tokens, whatever the loss sums over).
// Guide: docs/reduce.md#the-step-verdict.
// Source: PyTorch DDP's split of Reducer::prepare_for_backward / the autograd hooks /
//         finalize_backward, and its no_sync() context (a backward that only accumulates).
#pragma once

#include <concepts>
#include <cstdint>
#include <limits>
#include <string_view>

namespace loom {

/// The largest BackwardPlan::loss_divisor (2^20): the per-window check that every rank used the same
/// divisor sums the divisors and their squares, exactly, in the float64 summary of up to 8192 ranks
/// (beyond, world size x divisor^2 must stay below 2^53).
inline constexpr std::int64_t kMaxLossDivisor = std::int64_t{1} << 20;

/// What the accumulator tells a reducer before a micro-batch's backward.
///
/// Example: `reducer.prepare_backward({.sync = false})` (accumulate only: DDP's no_sync);
///          `reducer.prepare_backward({.sync = true, .window_samples = 10})` (this backward ends the window).
/// Units: window_samples in samples, this rank's total for the window including this micro-batch.
struct BackwardPlan {
  bool sync = false;                ///< this backward closes the window: reduce after it
  bool final = false;               ///< end-of-epoch flush on this rank (sync only): it has no further
                                    ///< micro-batches this epoch and only helps the others finish (join)
  bool leaving = false;             ///< sync only: this rank abandons its loop after this window (a
                                    ///< `break` out of loom::Trainer's epoch loop); every rank's
                                    ///< Reduction reports it (ranks_leaving) and skips the step
  std::int64_t window_samples = 0;  ///< samples of this rank's window (sync only)
  double grad_scale = 1.0;          ///< sync only: multiply the averaged gradient by this (1 / loss scale)
  /// Sync only, in [0, kMaxLossDivisor]: the caller divided every loss of the window by this (the
  /// same on every rank that has one: e.g. the step's planned global sample count, which keeps
  /// float16 gradients in range); the reduction multiplies it back. 0: this rank's window holds no
  /// loss (it joins with zeros) and takes the others' divisor. Ranks that disagree get
  /// loom::InvalidArgument from finish_window.
  std::int64_t loss_divisor = 1;
};

/// What a synchronising window decided: the one answer to "does the optimizer step?"
/// (Reduction::verdict), the same on every rank. Everything but `apply` means: no step, the
/// gradients are zeroed (or, for not_reduced, left as they were).
/// Example: `if (reducer.finish_window().verdict == loom::StepVerdict::apply) optimizer.step();`
enum class StepVerdict : std::uint8_t {
  not_reduced,         ///< a final flush found nothing to do on any rank (no step to take)
  apply,               ///< the gradients are the global average: step
  skip_non_finite,     ///< some rank produced inf/NaN (a loss scaler backs off)
  skip_grid_overflow,  ///< deterministic mode: a contribution was too large for its grid
  skip_no_samples,     ///< averaging by samples and no rank had one
  replicas_differ,     ///< the ranks' replica fingerprints differ (Reducer::compare_replicas)
  leaving,             ///< some rank left its loop (ranks_leaving > 0)
};

/// The verdict's name, as messages print it ("apply", "skip_non_finite", ...).
constexpr std::string_view to_string(StepVerdict v) noexcept {
  switch (v) {
    case StepVerdict::not_reduced: return "not_reduced";
    case StepVerdict::apply: return "apply";
    case StepVerdict::skip_non_finite: return "skip_non_finite";
    case StepVerdict::skip_grid_overflow: return "skip_grid_overflow";
    case StepVerdict::skip_no_samples: return "skip_no_samples";
    case StepVerdict::replicas_differ: return "replicas_differ";
    case StepVerdict::leaving: return "leaving";
  }
  return "?";
}

/// What a reducer reports when a window is closed. Every field is equal on every rank; `verdict`
/// is the decision, the flags below are the facts it was made from.
///
/// Example: `if (r.verdict == loom::StepVerdict::apply) optimizer.step();`
/// Units: global_samples in samples (summed over ranks); grad_norm in gradient units (after
///        averaging and unscaling, before clipping).
struct Reduction {
  StepVerdict verdict = StepVerdict::not_reduced;  ///< whether the optimizer steps (see StepVerdict)
  bool reduced = false;             ///< gradients were all-reduced (false only when a final flush found nothing to do)
  bool all_final = false;           ///< every rank was in its end-of-epoch flush (no rank has micro-batches left)
  bool non_finite = false;          ///< some rank produced inf/NaN: every rank must skip the step (gradients zeroed)
  bool no_samples = false;          ///< averaging by samples and no rank had one: gradients zeroed, skip the step
  std::int64_t global_samples = 0;  ///< samples of the window summed over ranks
  std::int64_t ranks_leaving = 0;   ///< ranks that closed this window leaving their loop (BackwardPlan::leaving):
                                    ///< when > 0 the gradients are zeroed and nobody steps
  double grad_norm = std::numeric_limits<double>::quiet_NaN();  ///< global L2 norm, when clipping computed it
  double clip_coef = 1.0;  ///< factor applied by global-norm clipping (1 = not clipped)
  /// ReducerOptions::deterministic only: a gradient contribution was too large for its parameter's
  /// integer grid; every rank skips the step (gradients zeroed) and that grid is made coarser.
  bool grid_overflow = false;
  /// ReducerOptions::deterministic only: buckets whose integers did not fit the int32 wire on some
  /// rank this window and were all-reduced again as int64 (one more all-reduce each; the sums are
  /// the same integers, so the gradient is the same). Common in a first window and on many ranks.
  std::int64_t grid_wide_buckets = 0;
  /// The ranks that set a replica fingerprint (Reducer::compare_replicas) sent different ones:
  /// something that must be equal on every replica is not (loom::Trainer: an optimizer option, or at
  /// an epoch's end a parameter). Gradients zeroed; nobody steps.
  bool replicas_differ = false;
};

/// A box that reduces gradients across ranks at step boundaries.
///
/// Requirements:
///  1. `r.prepare_backward(plan)` before every backward of a micro-batch, in the same sequence of
///     sync/non-sync plans on every rank's windows. Reason: the reducer must know, while backward
///     runs, whether to send gradients (sync) or only let them accumulate locally (no_sync); it is
///     where a reducer starts its collectives, so every rank must issue them in the same order.
///  2. `r.finish_window()` after the backward of a sync plan (or directly after a final plan,
///     without a backward) returns a Reduction whose `verdict` says whether the caller steps (the
///     Accumulator and the Trainer read nothing else for that); after StepVerdict::apply each
///     parameter's gradient is the global average, multiplied by the plan's `grad_scale` (1 / loss
///     scale, known only to the caller, given before backward so a reducer may scale each bucket
///     before it leaves). Reason: the step boundary is where the caller needs identical gradients
///     and one decision on every rank.
/// Not required: knowledge of optimizers, loss scaling state, micro-batch counting (the
/// Accumulator owns those), thread safety across calls, copyability.
/// Models: loom::Reducer (reduce/reducer.hpp). Used by loom::Accumulator (accumulate/accumulator.hpp).
template <class R>
concept GradientReducer = requires(R& r, const BackwardPlan& plan) {
  r.prepare_backward(plan);
  { r.finish_window() } -> std::same_as<Reduction>;
};

}  // namespace loom
