// loom/accumulate/accumulator.hpp — Accumulator: micro-batch gradient accumulation with exact
// sample weighting, no communication before the step boundary, and the epoch's remainder flushed.
//
// One sentence: open a micro-batch scope with its sample count, run forward and backward with a
// loss SUMMED over the micro-batch's samples, finish the scope; every K micro-batches (or S samples)
// the scope's backward reduces the window's gradients across ranks (earlier backward passes only
// accumulate: DDP's no_sync), and at the end of the epoch end_epoch() makes the remainder step.
//
// Example:
//   loom::Reducer reducer(comm, loom::parameters_of(*model));
//   loom::Accumulator acc(reducer, {.micro_batches_per_step = 4});
//   for (const loom::Batch& b : loader) {
//     auto mb = acc.micro_batch(b);                          // counts b.num_samples
//     auto loss = loss_fn_sum(model->forward(b.data), b.targets);
//     mb.scale(loss).backward();                             // scale() = loss scale, or 1
//     loom::SyncResult step = mb.finish();
//     if (step) optimizer.step();                            // a finite, averaged step
//     if (step.boundary) optimizer.zero_grad();
//   }
//   while (auto step = acc.end_epoch()) {                    // remainder, and uneven ranks
//     if (*step) optimizer.step();
//     optimizer.zero_grad();
//   }
// The callable form does the same: `acc.run(n, [&](auto& mb) { mb.scale(loss()).backward(); })`.
//
// Weighting: with the reducer's default Average::samples the step's gradient is the gradient of
//   the mean loss over every sample of the window on every rank (sum of losses / global count),
//   whatever the micro-batch sizes; padding rows masked out of the loss and not counted change
//   nothing. Batches a distributed sampler repeated only to even out ranks (Batch::weight == 0)
//   count 0 samples: multiply their loss by the weight. A loss summed over many samples can
//   overflow float16: divide every loss of a step by one number d, the same on every rank (the
//   step's planned global samples), and pass it as micro_batch's / join_step's loss_divisor; the
//   reduction multiplies it back (loom::Trainer does this for 16-bit parameters).
// Boundaries: after every `micro_batches_per_step` micro-batches and/or once the window holds
//   `local_samples_per_step` samples, whichever comes first (0 disables a rule), and after a micro-batch
//   opened with closes_step (a batch with step_end: GlobalBatchSampler defines steps itself; set
//   K = 0 and S = 0 with it, so the steps do not depend on the world size). A rank with no batch in
//   such a step calls join_step(). A window never carries into the next epoch: end_epoch()
//   reduces what is left (fewer than K micro-batches) with its true sample count.
// Uneven ranks: ranks may run different numbers of micro-batches and samples. Each rank calls
//   end_epoch() until it returns std::nullopt; while another rank still has steps, end_epoch()
//   joins them (contributing zero gradients and zero samples) and returns a SyncResult the caller must
//   apply like any other, so replicas stay identical. A rank with no sample at all contributes
//   nothing and divides by the global count: no NaN, no hang.
// Loss scaling (loss_scaling set): losses are multiplied by scale() (use mb.scale(loss)), the
//   reduction unscales once per step, then clips (ReducerOptions::max_grad_norm); when any rank
//   produced inf/NaN every rank skips the step (SyncResult::apply false, gradients zeroed, window
//   cleared) and the scale backs off once.
//
// Units: samples are whatever the loss sums over (rows, tokens).
// Throws: loom::InvalidArgument (negative sample count, bad options), loom::Error (calls out of
//         order; any call after an abandoned micro-batch or a failed collective, naming that first
//         cause), and the reducer's / communicator's errors.
// Source: DDP's no_sync() accumulation; "exact" weighting as in gradient accumulation with
//         sum-reduced losses divided by the token/sample count; GradScaler for loss scaling.
#pragma once

#include <concepts>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <utility>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <loom/accumulate/loss_scaler.hpp>
#include <loom/collate/batch.hpp>
#include <loom/error.hpp>
#include <loom/reduce/concepts.hpp>

namespace loom {

/// Options of Accumulator; use with designated initializers.
///
/// Example: `loom::AccumulatorOptions{.micro_batches_per_step = 0, .local_samples_per_step = 256}`.
/// Units: micro-batches; samples.
struct AccumulatorOptions {
  std::int64_t micro_batches_per_step = 1;          ///< K: a boundary every K micro-batches (0 = rule off)
  std::int64_t local_samples_per_step = 0;          ///< S: a boundary once the window holds >= S samples (0 = off)
  std::optional<LossScalerOptions> loss_scaling{};  ///< dynamic loss scaling (see LossScaler)
};

/// What a micro-batch (MicroBatch::finish), a join (join_step) or an end-of-epoch flush
/// (end_epoch) reports: the window's Reduction (its fields: global samples, norm, clipping, ranks
/// leaving; default values when the call closed no window), whether the call synchronised the
/// gradients across ranks (`boundary`) and whether the caller should apply them. Converts to true
/// when the optimizer should step.
///
/// Example: `if (loom::SyncResult s = mb.finish()) optimizer.step();`
/// Units: samples; grad_norm in gradient units (after averaging and unscaling, before clipping).
struct SyncResult : Reduction {
  bool boundary = false;            ///< this call closed a window: gradients were reduced (Reduction::reduced)
  bool apply = false;               ///< the gradients are the global average: call optimizer.step()
  bool skipped_non_finite = false;  ///< inf/NaN on some rank: every rank skipped, gradients zeroed (non_finite)
  std::int64_t micro_batches = 0;   ///< this rank's micro-batches in the window so far
  std::int64_t local_samples = 0;   ///< this rank's samples in the window so far
  double loss_scale = 1.0;          ///< the scale the window's losses were multiplied by

  explicit operator bool() const noexcept { return apply; }
};

/// Gradient accumulation over micro-batches in front of a GradientReducer. See the file comment.
///
/// Example: see the file comment.
/// Throws: see the file comment.
/// Source: see the file comment.
template <class R>
class Accumulator {
  static_assert(GradientReducer<R>,
                "loom::Accumulator needs a GradientReducer: a type with prepare_backward(const loom::BackwardPlan&) "
                "and finish_window() -> loom::Reduction (for example loom::Reducer)");

 public:
  /// A micro-batch in flight: opened by Accumulator::micro_batch, closed by finish().
  ///
  /// Example: `auto mb = acc.micro_batch(32); mb.scale(loss).backward(); auto step = mb.finish();`
  /// Destroying it without finish() (an exception in forward/backward) makes the accumulator refuse
  /// further use: the ranks may be out of step, so go on only with a fresh reducer.
  class MicroBatch {
   public:
    MicroBatch(MicroBatch&& other) noexcept : acc_(std::exchange(other.acc_, nullptr)), boundary_(other.boundary_) {}
    MicroBatch& operator=(MicroBatch&&) = delete;
    MicroBatch(const MicroBatch&) = delete;
    MicroBatch& operator=(const MicroBatch&) = delete;
    ~MicroBatch() {
      if (acc_) acc_->abandon();
    }

    /// Whether this micro-batch's backward closes the window (its finish() reduces).
    [[nodiscard]] bool boundary() const noexcept { return boundary_; }
    /// `loss * loss scale` (the loss itself without loss scaling). Shape: any.
    [[nodiscard]] at::Tensor scale(const at::Tensor& loss) const {
      LOOM_ASSERT(acc_ != nullptr, "MicroBatch::scale after finish()");
      return acc_->scaler_ ? acc_->scaler_->scale(loss) : loss;
    }
    /// Call after backward. At a boundary: reduces and returns the step; otherwise a SyncResult with
    /// boundary == false. Throws: the reducer's errors; loom::Error when called twice.
    SyncResult finish() {
      if (!acc_) throw Error("MicroBatch::finish called twice (or on a moved-from micro-batch)");
      return std::exchange(acc_, nullptr)->finish_micro_batch(boundary_);
    }

   private:
    friend class Accumulator;
    MicroBatch(Accumulator* acc, bool boundary) : acc_(acc), boundary_(boundary) {}
    Accumulator* acc_;
    bool boundary_;
  };

  /// Throws: loom::InvalidArgument for negative K or S, or both 0 with no way to end a window
  /// other than end_epoch() (allowed: one step per epoch), and for bad loss-scaling options.
  explicit Accumulator(R& reducer, AccumulatorOptions options = {}) : reducer_(&reducer), options_(std::move(options)) {
    if (options_.micro_batches_per_step < 0)
      throw InvalidArgument(
          fmt::format("Accumulator: micro_batches_per_step = {} (must be >= 0)", options_.micro_batches_per_step));
    if (options_.local_samples_per_step < 0)
      throw InvalidArgument(
          fmt::format("Accumulator: local_samples_per_step = {} (must be >= 0)", options_.local_samples_per_step));
    if (options_.loss_scaling) scaler_.emplace(*options_.loss_scaling);
  }

  Accumulator(const Accumulator&) = delete;
  Accumulator& operator=(const Accumulator&) = delete;

  /// Opens a micro-batch of `num_samples` samples (0 allowed: a rank with nothing still takes part).
  /// With `closes_step`, this micro-batch's backward closes the window whatever K and S say (a
  /// sampler that defines the steps, e.g. GlobalBatchSampler, knows where they end).
  /// `loss_divisor` (>= 1): the summed loss was divided by it before backward; the reduction multiplies
  /// it back (BackwardPlan::loss_divisor). Equal for every micro-batch of a window and on every rank —
  /// the step's planned global sample count keeps a float16 gradient in range, where the loss summed
  /// over many samples would overflow; join_step takes the same value for steps this rank only joins.
  /// Throws: loom::InvalidArgument (negative count, a divisor < 1 or other than the window's earlier
  ///         micro-batches'), loom::Error (previous micro-batch still open).
  [[nodiscard]] MicroBatch micro_batch(std::int64_t num_samples, bool closes_step = false,
                                       std::int64_t loss_divisor = 1) {
    check_usable("micro_batch");
    if (num_samples < 0)
      throw InvalidArgument(fmt::format("Accumulator::micro_batch: num_samples = {} (must be >= 0)", num_samples));
    take_loss_divisor("micro_batch", loss_divisor);
    all_final_seen_ = false;
    ++window_micro_batches_;
    window_samples_ += num_samples;
    const bool boundary =
        closes_step ||
        (options_.micro_batches_per_step > 0 && window_micro_batches_ >= options_.micro_batches_per_step) ||
        (options_.local_samples_per_step > 0 && window_samples_ >= options_.local_samples_per_step);
    open_ = true;
    try {
      reducer_->prepare_backward({.sync = boundary,
                                  .window_samples = window_samples_,
                                  .grad_scale = grad_scale(),
                                  .loss_divisor = window_divisor_});
    } catch (const std::exception& e) {
      open_ = false;
      break_with(fmt::format("prepare_backward failed in micro_batch ({})", e.what()));
      throw;
    }
    return MicroBatch(this, boundary);
  }

  /// Opens a micro-batch for a collated batch: counts batch.counted_samples() (0 when weight == 0);
  /// closes the window after it when batch.step_end is set. `loss_divisor`: as above.
  /// Throws: loom::InvalidArgument for a Batch::weight other than 1 (counts) or 0 (a repeated batch):
  ///         a fractional weight would count every sample while scaling the loss.
  [[nodiscard]] MicroBatch micro_batch(const Batch& batch, std::int64_t loss_divisor = 1) {
    if (batch.weight != 0.0 && batch.weight != 1.0)
      throw InvalidArgument(fmt::format(
          "Accumulator::micro_batch: Batch::weight is {}; it is 1 (the batch counts) or 0 (a repeated batch that "
          "counts no sample); to weight samples differently, scale the loss",
          batch.weight));
    return micro_batch(batch.counted_samples(), batch.step_end, loss_divisor);
  }

  /// For a rank with no micro-batch in a step another rank runs (an idle item of
  /// GlobalBatchSampler): closes this rank's window now, without a backward, joining the others'
  /// synchronisation with its zero gradients (and whatever samples its window already holds). Apply
  /// the returned SyncResult like any other. `loss_divisor`: 0 (default) takes the divisor of the
  /// ranks that have losses in this step (or this window's own, when it has micro-batches); a value
  /// >= 1 must be theirs (see micro_batch).
  /// Throws: loom::InvalidArgument (a negative divisor, or one other than the window's), loom::Error
  ///         (a micro-batch still open), the reducer's errors.
  SyncResult join_step(std::int64_t loss_divisor = 0) {
    check_usable("join_step");
    take_loss_divisor("join_step", loss_divisor, /*required=*/false);
    all_final_seen_ = false;
    try {
      reducer_->prepare_backward({.sync = true,
                                  .window_samples = window_samples_,
                                  .grad_scale = grad_scale(),
                                  .loss_divisor = window_divisor_});
      return close_window(reducer_->finish_window());
    } catch (const std::exception& e) {
      break_with(fmt::format("a collective failed in join_step ({})", e.what()));
      throw;
    }
  }

  /// For a rank that abandons its loop in the middle of an epoch (loom::Trainer, on a `break`): closes
  /// this rank's window now, like join_step, with BackwardPlan::leaving set, so the other ranks' current
  /// step completes and reports ranks_leaving > 0 on every rank (gradients zeroed, not applied) instead
  /// of waiting for this rank. The accumulator refuses further use afterwards.
  /// Throws: loom::Error (a micro-batch still open), the reducer's errors.
  SyncResult leave_step() {
    check_usable("leave_step");
    try {
      reducer_->prepare_backward({.sync = true,
                                  .leaving = true,
                                  .window_samples = window_samples_,
                                  .grad_scale = grad_scale(),
                                  .loss_divisor = window_divisor_});
      SyncResult s = close_window(reducer_->finish_window());
      break_with("this rank left its loop in the middle of an epoch (leave_step)");
      return s;
    } catch (const std::exception& e) {
      break_with(fmt::format("a collective failed in leave_step ({})", e.what()));
      throw;
    }
  }

  /// Callable form: opens a micro-batch, calls `fn(mb)` (or `fn()`), which runs forward and
  /// backward, and returns mb.finish().
  template <class F>
  SyncResult run(std::int64_t num_samples, F&& fn) {
    auto mb = micro_batch(num_samples);
    if constexpr (std::invocable<F&, MicroBatch&>)
      std::forward<F>(fn)(mb);
    else
      std::forward<F>(fn)();
    return mb.finish();
  }

  /// End of epoch: reduces this rank's remainder (or zeros) together with every other rank, until
  /// no rank has anything left. Call it until it returns std::nullopt; apply each returned SyncResult
  /// like any other (`if (*step) optimizer.step();`).
  /// Throws: loom::Error (a micro-batch still open), the reducer's errors.
  std::optional<SyncResult> end_epoch() {
    check_usable("end_epoch");
    if (all_final_seen_) {  // every rank saw the last reduction report all ranks final
      all_final_seen_ = false;
      return std::nullopt;
    }
    Reduction r;
    try {
      reducer_->prepare_backward({.sync = true,
                                  .final = true,
                                  .window_samples = window_samples_,
                                  .grad_scale = grad_scale(),
                                  .loss_divisor = window_divisor_});
      r = reducer_->finish_window();
    } catch (const std::exception& e) {
      break_with(fmt::format("a collective failed in end_epoch ({})", e.what()));
      throw;
    }
    if (!r.reduced) {
      reset_window();
      return std::nullopt;
    }
    all_final_seen_ = r.all_final;
    return close_window(r);
  }

  /// The loss scale the current window's losses must be multiplied by (1 without loss scaling).
  [[nodiscard]] double loss_scale() const noexcept { return scaler_ ? scaler_->scale() : 1.0; }
  /// The loss scaler (AccumulatorOptions::loss_scaling), or nullptr without loss scaling. Its state()
  /// belongs in a checkpoint; load_state() it when resuming.
  [[nodiscard]] LossScaler* loss_scaler() noexcept { return scaler_ ? &*scaler_ : nullptr; }
  [[nodiscard]] const LossScaler* loss_scaler() const noexcept { return scaler_ ? &*scaler_ : nullptr; }
  /// Micro-batches in the open window on this rank.
  [[nodiscard]] std::int64_t window_micro_batches() const noexcept { return window_micro_batches_; }
  /// Samples in the open window on this rank.
  [[nodiscard]] std::int64_t window_samples() const noexcept { return window_samples_; }
  [[nodiscard]] const AccumulatorOptions& options() const noexcept { return options_; }
  [[nodiscard]] R& reducer() const noexcept { return *reducer_; }

 private:
  double grad_scale() const noexcept { return scaler_ ? 1.0 / scaler_->scale() : 1.0; }

  void check_usable(const char* what) const {
    if (!broken_.empty())
      throw Error(
          fmt::format("Accumulator::{}: {}; the ranks may be out of step, so this accumulator refuses further use "
                      "(build a new reducer and accumulator)",
                      what, broken_));
    if (open_)
      throw Error(fmt::format("Accumulator::{}: the previous micro-batch was not finished (call finish())", what));
  }

  SyncResult finish_micro_batch(bool boundary) {
    open_ = false;
    if (!boundary) {
      SyncResult s;
      s.micro_batches = window_micro_batches_;
      s.local_samples = window_samples_;
      s.loss_scale = loss_scale();
      return s;
    }
    try {
      return close_window(reducer_->finish_window());
    } catch (const std::exception& e) {
      break_with(fmt::format("a collective failed at a step boundary ({})", e.what()));  // the ranks are out of step
      throw;
    }
  }

  SyncResult close_window(const Reduction& r) {
    SyncResult s;
    static_cast<Reduction&>(s) = r;
    s.boundary = r.reduced;
    s.skipped_non_finite = r.verdict == StepVerdict::skip_non_finite;
    s.apply = r.verdict == StepVerdict::apply;
    s.micro_batches = window_micro_batches_;
    s.local_samples = window_samples_;
    s.loss_scale = loss_scale();
    if (r.ranks_leaving > 0)
      break_with(fmt::format("{} rank(s) left their loop in the middle of an epoch", r.ranks_leaving));
    if (scaler_ && (r.verdict == StepVerdict::apply || r.verdict == StepVerdict::skip_non_finite))
      scaler_->update(r.verdict == StepVerdict::skip_non_finite);
    reset_window();
    return s;
  }

  void reset_window() noexcept {
    window_micro_batches_ = 0;
    window_samples_ = 0;
    window_divisor_ = 0;
  }

  /// The window's loss divisor: the first micro-batch (or join with d >= 1) of a window sets it,
  /// later ones must match; 0 (join_step's default) says nothing. A window without one sends 0: the
  /// reducer then uses the other ranks' (BackwardPlan::loss_divisor).
  void take_loss_divisor(const char* where, std::int64_t d, bool required = true) {
    if (d < (required ? 1 : 0))
      throw InvalidArgument(
          fmt::format("Accumulator::{}: loss_divisor = {} (must be >= {})", where, d, required ? 1 : 0));
    if (d == 0) return;
    if (window_divisor_ != 0 && d != window_divisor_)
      throw InvalidArgument(fmt::format(
          "Accumulator::{}: loss_divisor = {}, but this step's earlier micro-batches used {} (one divisor per step)",
          where, d, window_divisor_));
    window_divisor_ = d;
  }

  void abandon() noexcept {
    open_ = false;
    if (broken_.empty())
      broken_ = "a micro-batch was abandoned (its scope ended without finish(), e.g. by an exception)";
  }

  /// Marks the accumulator unusable; the first cause is kept for every later call's message.
  void break_with(std::string cause) {
    if (broken_.empty()) broken_ = std::move(cause);
  }

  R* reducer_;
  AccumulatorOptions options_;
  std::optional<LossScaler> scaler_;
  std::int64_t window_micro_batches_ = 0;
  std::int64_t window_samples_ = 0;
  std::int64_t window_divisor_ = 0;  // BackwardPlan::loss_divisor of the open window (0: none given yet)
  bool open_ = false;
  std::string broken_;  // why this accumulator refuses further use (empty: usable)
  bool all_final_seen_ = false;
};

}  // namespace loom
