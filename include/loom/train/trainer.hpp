// loom/train/trainer.hpp — Trainer: the short, safe training loop over loom's reducer and
// accumulator. The user writes forward, the loss and one call; loom owns every step of the
// protocol a loop can get wrong.
//
// One sentence: `for (loom::Batch& b : trainer.epoch(loader, e)) trainer.backward(loss_of(b), b);`
// runs each rank's share of every world-size-invariant optimizer step, weights each batch by its
// real samples, reduces gradients across ranks while backward runs, steps and zeroes the optimizer
// at each step boundary, joins steps in which this rank has no batch, and closes the epoch when
// the loop ends.
//
// Example: the README's loop — examples/readme_loop.cpp between its "----" markers, the one copy
// (README.md and docs/loop.md show it; tests/examples/check_readme_loop.py keeps them equal). Its
// core: a BatchLoader and a Trainer built from the process group, the model and the optimizer, then
//   for (loom::Batch& b : trainer.epoch(loader, epoch)) trainer.backward(loss_of(b), b);
//
// What loom does, so the loop cannot forget it:
//   - the loss is the batch MEAN (PyTorch's default reduction; TrainerOptions::loss = sum for a
//     summed loss); loom multiplies it by the batch's real samples, so the step's gradient is the
//     mean over every sample of the step on every rank (ReducerOptions::average = samples), and a
//     repeated batch (weight 0) adds nothing; with float16/bfloat16 parameters and a loader whose
//     sampler exposes plan() (BatchLoader) it multiplies by the batch's samples / the step's planned
//     global samples instead (BackwardPlan::loss_divisor), so a backward's gradient is its share of
//     the step's mean and does not overflow float16 (small ones can underflow without loss
//     scaling: set TrainerOptions::loss_scaling for float16), and the reducer sums the
//     micro-batches in float32 (ReducerOptions::float32_accumulation);
//   - the step boundary comes from the plan (Batch::step_end): the optimizer's step() and
//     zero_grad() run there, inside backward(); a step with inf/NaN is skipped on every rank and
//     reported (rank 0's warning names its epoch, step and samples; TrainerOptions::skipped_steps
//     makes it an error, and 50 in a row are one by default); before_step() runs before
//     optimizer.step() with the averaged gradients on the parameters (clipping goes there);
//   - a step in which this rank has no batch is joined without a backward (the loop never sees it);
//   - the epoch's end (remainder and join) runs when the loop over trainer.epoch(...) ends.
// What is checked, each a loom error naming what was forgotten or misplaced (docs/loop.md lists the
// messages):
//   - a batch the loop received but never passed to backward() (at the next batch or the end);
//   - a backward() outside backward() (loss.backward() by hand: its gradient would not be reduced);
//   - backward() twice for one batch, or for a batch the loop did not just receive;
//   - a loss that is not a one-element floating tensor requiring grad;
//   - a parameter written in place outside the Trainer's step and on_step() (its version counter
//     moved), or a gradient set by hand between two calls of the Trainer;
//   - replicas that differ: every step's reduction compares the optimizer's parameter-group options
//     across the ranks (riding in the window meta, Reducer::compare_replicas; a learning rate
//     changed in the loop body parts them), each epoch's last one also checksums of the parameters:
//     loom::Error on every rank naming the rank and the option or parameter (check_replicas() on
//     demand); ranks whose TrainerOptions::reducer differ stop at construction;
//   - leaving the loop before the epoch's end (break, return): ranks run the body different numbers
//     of times, so no place in the body is the same step on every rank. The rank that leaves closes
//     one last window marked "leaving" (BackwardPlan::leaving), the ranks still in that step see it
//     in their reduction, and every rank throws loom::Error; trainer.stop() from on_step() is the
//     way to end an epoch early (a break right after the boundary at which stop() took effect is
//     that stop). The Trainer refuses further use afterwards. An exception out of the loop body
//     sends nothing; when it left a step open, the Trainer refuses further use too.
// At construction (loom::InvalidArgument, before any collective): reducer options that contradict
// the Trainer's weighting (ReducerOptions::average other than samples); an optimizer (one with
// param_groups(), as every torch::optim optimizer) holding a tensor that is not one of the model's
// parameters, or missing one of its trainable parameters; a second Trainer or Reducer on a model
// whose first one is still alive (loom::Reducer's rule). Gradients the parameters already hold (a
// smoke-test backward) are cleared: the first step starts from zero, as the PyTorch habit of
// zero_grad() at the top of the loop would have it.
// Between the Trainer's calls the parameters hold no gradients, so a leftover zero_grad() or
// optimizer.step() in the loop body changes nothing (docs/loop.md explains why).
// One rule the loop keeps: no collective in the loop body. A step's batches are dealt to the ranks
// by cost, so ranks run the body different numbers of times; per-step work that talks to the other
// ranks (a progress count, a checkpoint) goes into on_step(), which every rank runs at every step.
// The low-level layer (loom::Reducer, loom::Accumulator) stays public for loops of another shape.
//
// Cost: one Accumulator micro-batch per batch (the callgrind comparison of
// scripts/callgrind_overhead.sh holds this layer to the hand-written loop); one tiny collective per
// epoch end, and one all_gather of 7 integers per epoch start (the plan check); the optimizer's
// options hashed on the host per backward; every parameter's bytes read once per epoch end (the
// replica checksum; a GPU parameter copied to the host first).
// Throws: see above; the reducer's, accumulator's, loader's and optimizer's errors.
// Source: the short path over a low-level layer of HF Accelerate (accumulate / backward /
//         gather_for_metrics) and Lightning Fabric (backward, no_backward_sync).
#pragma once

#include <algorithm>
#include <concepts>
#include <cstdint>
#include <exception>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <loom/accumulate/accumulator.hpp>
#include <loom/collate/batch.hpp>
#include <loom/comm/communicator.hpp>
#include <loom/error.hpp>
#include <loom/reduce/module.hpp>
#include <loom/reduce/reducer.hpp>
#include <loom/sample/global_batch.hpp>
#include <loom/trace/recorder.hpp>
#include <loom/train/batch_source.hpp>
#include <loom/train/detail/replica_check.hpp>
#include <loom/train/detail/skip_report.hpp>
#include <loom/train/detail/trainer_checks.hpp>
#include <loom/train/epoch_range.hpp>
#include <loom/train/options.hpp>

namespace loom {

/// The short training path. See the file comment. Not copyable or movable (the epoch range and
/// the reducer's hooks point at it).
///
/// Example: see the file comment.
/// Throws: see the file comment.
/// Source: see the file comment.
template <Communicator Comm, StepOptimizer Opt>
class Trainer {
 public:
  using ReducerType = Reducer<Comm>;

  /// Checks the options and the optimizer's parameters against `params`, clears gradients the
  /// parameters already hold, then checks and broadcasts the parameters (rank 0's everywhere) and
  /// builds the reducer and accumulator.
  /// Throws: loom::InvalidArgument (see the file comment: options, optimizer parameters, a second
  ///         Trainer on the same model; the reducer's checks), the communicator's errors.
  Trainer(Comm& comm, ParameterList params, Opt& optimizer, TrainerOptions options = {})
      : comm_(&comm),
        optimizer_(&optimizer),
        options_(std::move(options)),
        reducer_(
            make_reducer(comm, detail::prepared_parameters(std::move(params), optimizer, options_), options_.reducer)),
        accumulator_(reducer_,
                     {.micro_batches_per_step = 0, .samples_per_step = 0, .loss_scaling = options_.loss_scaling}),
        skips_(options_.skipped_steps, options_.loss_scaling.has_value(), comm.rank()) {
    const auto& list = reducer_.parameters();
    guard_ = detail::TrainableGuard(list);
    for (std::size_t i : guard_.trainable()) {
      const auto dtype = list.params[i].scalar_type();
      if (dtype == at::kHalf || dtype == at::kBFloat16) sixteen_bit_ = true;
    }
  }

  /// The same, for a torch::nn::Module (its parameters and buffers, see loom::parameters_of).
  Trainer(Comm& comm, const torch::nn::Module& model, Opt& optimizer, TrainerOptions options = {})
      : Trainer(comm, parameters_of(model), optimizer, std::move(options)) {}

  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  /// The loop over this rank's batches of epoch `epoch` (see EpochRange). Parameters may be changed between epochs (a checkpoint loaded, an evaluation's write-back):
  /// the check for changes outside the optimizer step starts afresh here.
  /// Every rank must plan alike: one all_gather of 7 integers compares the loader's plan (seed, epoch,
  /// step, options and shapes, dealing, world size) across ranks (loom::check_same_plan).
  /// Throws: loom::Error when this Trainer refuses further use (a previous loop was left early);
  ///         loom::InvalidArgument when the ranks plan differently, or the loader was resumed into
  ///         another epoch (the loader's errors).
  template <BatchSource Loader>
  [[nodiscard]] EpochRange<Trainer, Loader> epoch(Loader& loader, int64_t epoch) {
    if (!broken_.empty())
      throw Error(fmt::format("Trainer::epoch({}): this Trainer refuses further use: {}", epoch, broken_));
    current_.reset();
    stop_ = false;
    stopped_ = false;
    loop_open_ = true;
    std::exception_ptr failed;  // a rank that cannot prepare the epoch still joins the plan check
    try {
      loader.begin_epoch(epoch);
    } catch (...) {
      failed = std::current_exception();
    }
    epoch_ = epoch;
    step_divisors_.clear();
    skips_.begin_epoch(epoch);
    steps_in_epoch_ = 0;
    plan_ = nullptr;
    // A planned source gives every rank every step (joined when it has no batch there), so the
    // flight recorder may compare the ranks' steps; other sources may end ranks at different steps.
    planned_ = PlannedBatchSource<Loader>;
    if constexpr (PlannedBatchSource<Loader>) {
      if (!failed) plan_ = &loader.sampler().plan();
      if (sixteen_bit_ && !failed)
        for (const auto& step : loader.sampler().plan().steps)
          step_divisors_.push_back(std::clamp<int64_t>(step.num_samples, 1, kMaxLossDivisor));
      trace::set_position(*comm_, 0, 0, planned_);
      trace::Scope scope(*comm_, trace::Context::sampler_check);
      check_same_plan(*comm_, loader.sampler(), fmt::format("Trainer::epoch({})", epoch), failed);
    } else if (failed) {
      std::rethrow_exception(failed);
    }
    guard_.record_versions(reducer_.parameters());
    return EpochRange<Trainer, Loader>(this, &loader);
  }
  /// What epoch() is called with when the loader is no BatchSource: one static_assert saying what it
  /// must be (the empty span only lets the caller's range-for compile on to that message).
  template <class Loader>
  requires(!BatchSource<Loader>) std::span<Batch> epoch(Loader&, int64_t) {
    static_assert(
        BatchSource<Loader>,
        "loom::Trainer::epoch(loader, e): the loader must be a loom::BatchSource (loom/train/batch_source.hpp): "
        "loader.begin_epoch(int64_t) and loader.next() returning std::optional<loom::Batch>. loom::BatchLoader "
        "is one; a sampler is not: give it to a BatchLoader with a fetch function");
    return {};
  }

  /// Advances the running epoch loop (what EpochRange's iterator does): joins the steps in which
  /// this rank has no batch (idle batches), closes the epoch at the source's end, and ends the loop at
  /// the step boundary after stop(). Returns this rank's next batch (valid until the next call), or
  /// nullptr when the loop is over.
  /// Throws: loom::Error without a running loop (epoch() first, once per loop) or when the previous
  ///         batch was never passed to backward; the source's, the reducer's and on_step's errors.
  template <BatchSource Loader>
  Batch* next_batch(Loader& loader) {
    if (!loop_open_) throw Error("Trainer::next_batch: no epoch loop is running (call trainer.epoch(loader, e) first)");
    for (;;) {
      if (stop_ && accumulator_.window_micro_batches() == 0) {  // stop() at a step boundary
        stopped_ = true;
        loop_open_ = false;
        return nullptr;
      }
      std::optional<Batch> batch = loader.next();
      if (!batch) {
        loop_open_ = false;
        end_epoch();
        return nullptr;
      }
      if (batch->idle) {
        join(batch->step);
        continue;
      }
      receive(std::move(*batch));
      return &*current_;
    }
  }

  /// A started loop ended before next_batch returned nullptr (EpochRange's destructor):
  ///  - by an exception (`by_exception`): nothing is sent (the error is on its way); when a step was
  ///    open, this Trainer refuses further use (its gradients and counts belong to a step that never
  ///    closed);
  ///  - right after stop() took effect at a boundary: as if the loop had ended by stop() (the other
  ///    ranks stop there too);
  ///  - otherwise (a break or return): every rank is told, and this throws loom::Error (see the file comment).
  void end_loop_early(bool by_exception) {
    loop_open_ = false;
    if (by_exception) {
      abandon_loop();
      return;
    }
    if (stop_ && accumulator_.window_micro_batches() == 0) {
      stopped_ = true;
      return;
    }
    leave_loop();
  }

  /// Backward of `loss` for `batch`, the batch the epoch loop just yielded; at the end of this rank's
  /// share of a step: the reduction, optimizer.step() (unless inf/NaN anywhere) and zero_grad().
  /// Returns the SyncResult (boundary, apply, global samples, norm).
  /// Shape: `loss` has one element (the batch mean, or the sum with LossReduction::sum).
  /// Throws: loom::InvalidArgument (a bad loss), loom::Error (a protocol step out of order, see the
  ///         file comment), the reducer's errors.
  SyncResult backward(const at::Tensor& loss, const Batch& batch) {
    check_no_stray_backward("Trainer::backward");
    if (!current_ || !same_batch(*current_, batch))
      throw Error(
          "Trainer::backward: this batch is not the one the epoch loop just yielded (pass each batch of "
          "`for (loom::Batch& b : trainer.epoch(loader, e))` to backward once, in order)");
    if (backward_done_)
      throw Error(
          fmt::format("Trainer::backward: called twice for batch {} of step {} (one backward per batch; sum "
                      "several losses first)",
                      batch_number_, current_step_));
    detail::check_trainer_loss(loss);
    guard_.check_untouched(reducer_.parameters(), "Trainer::backward");
    guard_.restore(reducer_.parameters(), "Trainer::backward");
    const int64_t divisor = loss_divisor(current_step_);
    share_replica_state(/*with_parameters=*/false);
    auto mb = accumulator_.micro_batch(batch, divisor);
    at::Tensor total = loss.reshape({});
    double factor = batch.weight / static_cast<double>(divisor);
    if (options_.loss == LossReduction::mean) factor *= static_cast<double>(batch.num_samples);
    if (factor != 1.0) total = total * factor;
    mb.scale(total).backward();
    arrivals_seen_ = reducer_.gradient_arrivals();
    backward_done_ = true;
    last_ = mb.finish();
    apply(last_);
    if (!last_.boundary) guard_.hide(reducer_.parameters(), /*keep=*/true);
    return last_;
  }

  /// Calls `fn(result)` after every step boundary on this rank — applied or skipped, including
  /// steps this rank only joined and the epoch's end — so every rank calls it equally often
  /// (unlike the loop body: a step's batches are dealt unevenly). The place for per-step work that
  /// must stay in step across ranks: a progress count (Progress::add_global(r.global_samples)), a
  /// learning-rate schedule, a checkpoint every N steps.
  /// Example: `trainer.on_step([&](const loom::SyncResult& r) { progress.add_global(r.global_samples); });`
  void on_step(std::function<void(const SyncResult&)> fn) { on_step_ = std::move(fn); }

  /// Calls `fn(result)` at every step boundary that applies a step, after the reduction and before
  /// optimizer.step(): each parameter's .grad() holds the step's averaged gradient, the same on every
  /// rank. The place for clipping (torch::nn::utils::clip_grad_norm_ / clip_grad_value_), gradient
  /// logging or surgery; what it does must be the same on every rank (it runs on every rank at the
  /// same steps). In the loop body the parameters hold no gradient, so clipping there does nothing.
  /// Example: `trainer.before_step([&](const loom::SyncResult&) { torch::nn::utils::clip_grad_value_(params, 0.5); });`
  void before_step(std::function<void(const SyncResult&)> fn) { before_step_ = std::move(fn); }

  /// Compares the optimizer's options and the parameters' values (checksums of their bytes) across
  /// the ranks now: two small all_gathers. Every rank must call it at the same point (between epoch
  /// loops, or in on_step); save_checkpoint calls it before writing. The Trainer also compares the
  /// options at every step and the parameters at every epoch's end, inside its reductions.
  /// Throws: loom::Error on every rank naming the first option (group, name, both values, the rank) or
  ///         parameter that differs; the communicator's errors.
  void check_replicas(const char* where = "Trainer::check_replicas") {
    detail::check_replicas_now(*comm_, *optimizer_, reducer_.parameters(), where);
  }

  /// Ends the running epoch loop at the current step boundary: the range stops yielding batches
  /// without running further steps (and without the end-of-epoch flush, which has nothing to do at
  /// a boundary). Call it from on_step, which every rank runs at the same step, so every rank stops
  /// there. The next epoch() clears it.
  /// Example: `trainer.on_step([&](const loom::SyncResult&) { if (++n == max_steps) trainer.stop(); });`
  /// Throws: loom::Error when called outside on_step (from the loop body it would stop this rank
  ///         alone, at a step the other ranks do not stop at).
  void stop() {
    if (!in_on_step_)
      throw Error(
          "Trainer::stop: call it from on_step(), which every rank runs at the same step; from the loop body it "
          "would stop this rank alone (ranks run the body different numbers of times per step)");
    stop_ = true;
  }
  [[nodiscard]] bool stopped() const noexcept { return stopped_; }         ///< the last epoch loop ended by stop()
  [[nodiscard]] bool loop_running() const noexcept { return loop_open_; }  ///< an epoch loop is running

  /// Optimizer steps applied so far (skipped inf/NaN steps not counted).
  [[nodiscard]] int64_t steps() const noexcept { return steps_; }
  /// Steps skipped because some rank had inf/NaN gradients (or a deterministic grid overflowed).
  [[nodiscard]] int64_t skipped_steps() const noexcept { return skipped_; }
  /// Of those, the ones in the running (or last) epoch.
  [[nodiscard]] int64_t epoch_skipped_steps() const noexcept { return skips_.in_epoch(); }
  /// The loss scaler's state (TrainerOptions::loss_scaling), for a checkpoint; nullopt without loss scaling.
  [[nodiscard]] std::optional<LossScalerState> loss_scaler_state() const {
    const LossScaler* s = accumulator_.loss_scaler();
    return s ? std::optional<LossScalerState>(s->state()) : std::nullopt;
  }
  /// What a checkpoint keeps of this Trainer (loom::save_checkpoint, loom/train/checkpoint.hpp).
  [[nodiscard]] TrainerState state() const {
    return {steps_, skipped_, loss_scaler_state(),
            reducer_.options().deterministic ? reducer_.grid_exponents() : std::vector<int>{}};
  }
  /// Continues the step counts and the loss scaler from a checkpoint's state, between epoch loops,
  /// and a deterministic reducer's grid exponents (ignored when this Trainer's reducer is not
  /// deterministic; a state without them keeps the current grids, e.g. a floating run's checkpoint).
  /// Throws: loom::Error while an epoch loop runs; loom::InvalidArgument for negative counts, as
  ///         load_loss_scaler_state, when this Trainer scales the loss and `state` has no scaler
  ///         state, or as Reducer::load_grid_exponents (another count of trainable parameters).
  void load_state(const TrainerState& state) {
    if (loop_open_) throw Error("Trainer::load_state: an epoch loop is running; load a checkpoint between epochs");
    detail::check_trainer_state(state);
    if (state.loss_scaler)
      load_loss_scaler_state(*state.loss_scaler);
    else if (accumulator_.loss_scaler() != nullptr)
      throw InvalidArgument("Trainer::load_state: this Trainer scales the loss but the state has no loss scaler state");
    if (!state.grid_exponents.empty() && reducer_.options().deterministic)
      reducer_.load_grid_exponents(state.grid_exponents);
    steps_ = state.steps;
    skipped_ = state.skipped_steps;
  }
  [[nodiscard]] Opt& optimizer() const noexcept { return *optimizer_; }  ///< the optimizer this Trainer steps
  /// Continues the loss scaler from a checkpoint's state (call before the first epoch loop).
  /// Throws: loom::InvalidArgument without TrainerOptions::loss_scaling, or for a bad state.
  void load_loss_scaler_state(const LossScalerState& state) {
    LossScaler* s = accumulator_.loss_scaler();
    if (s == nullptr)
      throw InvalidArgument(
          "Trainer::load_loss_scaler_state: this Trainer has no loss scaler (TrainerOptions::loss_scaling unset)");
    s->load_state(state);
  }

  /// The SyncResult of the last boundary or micro-batch.
  [[nodiscard]] const SyncResult& last_step() const noexcept { return last_; }
  [[nodiscard]] ReducerType& reducer() noexcept { return reducer_; }
  [[nodiscard]] Accumulator<ReducerType>& accumulator() noexcept { return accumulator_; }
  [[nodiscard]] Comm& communicator() const noexcept { return *comm_; }
  [[nodiscard]] const TrainerOptions& options() const noexcept { return options_; }

 private:
  static bool same_batch(const Batch& a, const Batch& b) {
    return a.num_samples == b.num_samples && a.data.unsafeGetTensorImpl() == b.data.unsafeGetTensorImpl();
  }

  // Every gradient an autograd hook delivers is counted by the reducer; between two calls of the
  // trainer the count must not move.
  void check_no_stray_backward(const char* where) {
    if (reducer_.gradient_arrivals() != arrivals_seen_) throw Error(detail::stray_backward_message(where));
  }

  // Before the loop moves on: no stray backward, no parameter written, the last batch's backward done.
  void check_between_calls() {
    check_no_stray_backward("Trainer::epoch");
    guard_.check_untouched(reducer_.parameters(), "Trainer::epoch");
    if (current_ && !backward_done_) forgotten();
  }

  void apply(const SyncResult& s) {
    if (!s.boundary) return;
    if (s.verdict == StepVerdict::leaving) {
      broken_ = fmt::format("{} rank(s) left the loop over trainer.epoch(...) during step {} of epoch {}",
                            s.ranks_leaving, current_step_, epoch_);
      throw Error(detail::ranks_left_message(epoch_, s.ranks_leaving, current_step_));
    }
    if (s.verdict == StepVerdict::replicas_differ) replicas_differ();
    guard_.check_untouched(reducer_.parameters(), "Trainer: at a step boundary");
    const bool skipped = s.verdict == StepVerdict::skip_non_finite || s.verdict == StepVerdict::skip_grid_overflow;
    if (s.verdict == StepVerdict::apply) {
      if (before_step_) {
        const detail::FlagScope running(in_on_step_);
        before_step_(s);
      }
      optimizer_->step();
      ++steps_;
      ++steps_in_epoch_;
      skips_.applied();
    } else if (skipped) {
      ++skipped_;
      ++steps_in_epoch_;
    }
    optimizer_->zero_grad();
    guard_.hide(reducer_.parameters(), /*keep=*/false);
    if (skipped)
      skips_.skipped(
          current_step_,
          s.verdict == StepVerdict::skip_grid_overflow ? "a gradient too large for the deterministic grid"
          : reducer_.options().wire_dtype == at::kHalf
              ? "inf/NaN gradients, or a gradient above 65504 on the float16 wire (ReducerOptions::wire_dtype)"
              : "inf/NaN gradients",
          detail::step_indices(plan_, current_step_));
    if (on_step_) {
      const detail::FlagScope running(in_on_step_);
      on_step_(s);
    }
    guard_.record_versions(reducer_.parameters());
  }

  /// An exception left the loop (EpochRange's destructor while unwinding): with a step open on this
  /// rank the Trainer refuses further use (no collective is attempted).
  void abandon_loop() noexcept {
    if (accumulator_.window_micro_batches() == 0 && !guard_.holds_gradients()) return;
    if (broken_.empty())
      broken_ = fmt::format(
          "an exception left the loop over epoch {} inside step {}, whose micro-batches were never reduced (the "
          "ranks may be out of step); build a new Trainer",
          epoch_, current_step_);
  }

  /// A loop over trainer.epoch(...) ended before the epoch's end, not by stop() and not by an
  /// exception (EpochRange's destructor): one last window marked leaving, so the other ranks stop
  /// with an error instead of waiting for this one; then the error here.
  [[noreturn]] void leave_loop() {
    const int64_t step = current_step_, batch = batch_number_;
    current_.reset();
    if (broken_.empty()) {
      broken_ = fmt::format("its loop over epoch {} was left before the epoch's end (step {})", epoch_, step);
      // No check may throw here: the other ranks wait for this window.
      guard_.put_back(reducer_.parameters());
      (void)accumulator_.leave_step();
    }
    throw Error(detail::loop_left_message(epoch_, batch, step));
  }

  /// What must be equal on every replica goes into the reducer's next windows: the optimizer's
  /// options, and with `with_parameters` the parameters' checksums (Reducer::compare_replicas).
  void share_replica_state(bool with_parameters) {
    replica_ = detail::replica_state_of(*optimizer_, reducer_.parameters(), with_parameters);
    reducer_.compare_replicas(replica_.fingerprint());
  }

  /// A window found the ranks' replica fingerprints different (the same verdict on every rank).
  [[noreturn]] void replicas_differ() {
    const std::string where = replica_.checksums.empty() ? fmt::format("at step {} of epoch {}", current_step_, epoch_)
                                                         : fmt::format("at the end of epoch {}", epoch_);
    broken_ = fmt::format("the replicas differed {}", where);
    detail::throw_replicas_differ(*comm_, replica_, reducer_.parameters(), where);
  }

  void receive(Batch batch) {
    check_between_calls();
    current_step_ = batch.step;
    // The flight recorder's position: this batch's step and its micro-batch number in the step.
    trace::set_position(*comm_, batch.step, accumulator_.window_micro_batches(), planned_);
    current_ = std::move(batch);
    ++batch_number_;
    backward_done_ = false;
  }

  void join(int64_t step) {
    check_between_calls();
    guard_.restore(reducer_.parameters(), "Trainer::epoch");
    current_step_ = step;
    trace::set_position(*comm_, step, 0, planned_);
    share_replica_state(/*with_parameters=*/false);
    last_ = accumulator_.join_step(loss_divisor(step));
    apply(last_);
  }

  void end_epoch() {
    check_between_calls();
    guard_.restore(reducer_.parameters(), "Trainer::epoch");
    current_.reset();
    // The epoch's last windows also compare the parameters' checksums across the ranks.
    share_replica_state(/*with_parameters=*/true);
    while (auto s = accumulator_.end_epoch()) {
      last_ = *s;
      apply(last_);
    }
    batch_number_ = 0;
    skips_.end_epoch(steps_in_epoch_);
  }

  /// What the losses of `step` are divided by (BackwardPlan::loss_divisor): with float16/bfloat16
  /// parameters the step's planned global sample count (capped at kMaxLossDivisor), the same on every
  /// rank, so a backward's gradient is its share of the step's mean and stays in the 16-bit range;
  /// otherwise 1 (the loss times its samples, divided once by the global count after the all-reduce).
  int64_t loss_divisor(int64_t step) const {
    return step >= 0 && step < static_cast<int64_t>(step_divisors_.size())
               ? step_divisors_[static_cast<std::size_t>(step)]
               : 1;
  }

  [[noreturn]] void forgotten() { throw Error(detail::forgotten_message(epoch_, batch_number_, current_step_)); }

  Comm* comm_;
  Opt* optimizer_;
  TrainerOptions options_;
  // The reducer; its refusals (bad TrainerOptions::reducer, parameters it cannot reduce) name the Trainer.
  static ReducerType make_reducer(Comm& comm, ParameterList params, const ReducerOptions& options) {
    try {
      return ReducerType(comm, std::move(params), options);
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(
          fmt::format("Trainer: its loom::Reducer (TrainerOptions::reducer, the model's parameters) "
                      "refused: {}",
                      detail::first_line(e.what())));
    }
  }

  ReducerType reducer_;
  Accumulator<ReducerType> accumulator_;
  detail::TrainableGuard guard_;        // the trainable parameters' versions and held gradients
  std::vector<int64_t> step_divisors_;  // this epoch's loss divisor per step (empty: 1 for every step)
  bool sixteen_bit_ = false;            // a trainable parameter is float16 or bfloat16
  std::string broken_;                  // why this Trainer refuses further use (empty: usable)
  std::optional<Batch> current_;
  SyncResult last_{};
  std::function<void(const SyncResult&)> on_step_;
  std::function<void(const SyncResult&)> before_step_;
  detail::SkipReport skips_;         // skipped steps: counts, warnings, errors (TrainerOptions::skipped_steps)
  detail::ReplicaState replica_;     // what this rank's windows compare (share_replica_state)
  const EpochPlan* plan_ = nullptr;  // the running epoch's plan (a PlannedBatchSource), for step_indices
  int64_t steps_in_epoch_ = 0;       // steps applied or skipped in the running epoch
  int64_t epoch_ = 0;
  int64_t current_step_ = 0;
  bool planned_ = false;  // the running epoch's source is a PlannedBatchSource (flight recorder steps checked)
  int64_t batch_number_ = 0;
  int64_t steps_ = 0;
  int64_t skipped_ = 0;
  int64_t arrivals_seen_ = 0;
  bool backward_done_ = false;
  bool loop_open_ = false;   // an epoch loop is running (epoch() until next_batch returns nullptr)
  bool stop_ = false;        // stop() was called
  bool stopped_ = false;     // the last epoch loop ended by stop()
  bool in_on_step_ = false;  // on_step's callback is running
};

}  // namespace loom
