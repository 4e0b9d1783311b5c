// loom/train/trainer.hpp — Trainer: the short training loop over loom's reducer and accumulator.
// The user writes forward, the loss and one call; loom owns every step of the protocol.
//
// Example (the README's loop, examples/readme_loop.cpp, kept equal by tests/examples/check_readme_loop.py):
//   loom::Trainer trainer(pg, *model, optimizer);
//   for (loom::Batch& b : trainer.epoch(loader, epoch)) trainer.backward(loss_of(b), b);
//
// What it does for the loop and what it checks (a batch never passed to backward, a backward by
// hand, a parameter written in the loop body, replicas that differ, leaving the loop early, ranks
// that plan differently): docs/loop.md, with every message. One rule: no collective in the loop
// body; per-step work that talks to the other ranks goes into on_step(), which every rank runs at
// every step. A rank's death (an elastic ProcessGroup) and its own checkpoint: docs/elastic.md.
// Cost: one Accumulator micro-batch per batch; one all_gather of the plan per epoch start, one tiny
// collective per epoch end; the optimizer's options hashed per backward; the parameters read per epoch end.
// Throws: loom::Error for a protocol step out of order, loom::InvalidArgument for bad input (both
//         listed in docs/loop.md); the reducer's, accumulator's, loader's and optimizer's errors.
// Source: the short path over a low-level layer of HF Accelerate (accumulate / backward /
//         gather_for_metrics) and Lightning Fabric (backward, no_backward_sync).
#pragma once

#include <algorithm>
#include <chrono>
#include <concepts>
#include <cstdint>
#include <cstdio>
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
#include <loom/train/detail/auto_checkpoint.hpp>
#include <loom/train/detail/loop_exit.hpp>
#include <loom/train/detail/replica_check.hpp>
#include <loom/train/detail/skip_report.hpp>
#include <loom/train/detail/trainer_checks.hpp>
#include <loom/train/detail/trainer_recovery.hpp>
#include <loom/train/detail/trainer_sharding.hpp>
#include <loom/train/epoch_range.hpp>
#include <loom/train/options.hpp>

namespace loom {

/// The short training path: epoch(), backward() and the step at each boundary (guide: docs/loop.md).
/// Not copyable or movable (the epoch range and the reducer's hooks point at it).
/// Example: `loom::Trainer trainer(pg, *model, sgd); for (auto& b : trainer.epoch(loader, e)) trainer.backward(loss_of(b), b);`
template <Communicator Comm, StepOptimizer Opt>
class Trainer {
 public:
  using ReducerType = Reducer<Comm>;

  /// Checks the options and the optimizer's parameters against `params`, clears gradients they hold,
  /// broadcasts rank 0's parameters and builds the reducer and accumulator.
  /// Throws: loom::InvalidArgument (options, the optimizer's parameters, a second Trainer on the
  ///         same model, the reducer's checks; docs/loop.md lists them), the communicator's errors.
  Trainer(Comm& comm, ParameterList params, Opt& optimizer, TrainerOptions options = {})
      : comm_(&comm),
        optimizer_(&optimizer),
        options_(std::move(options)),
        reducer_(detail::make_trainer_reducer<ReducerType>(
            comm, detail::prepared_parameters(std::move(params), optimizer, options_), options_.reducer)),
        accumulator_(std::in_place, *reducer_, accumulator_options()),
        sharded_(detail::make_trainer_sharding(comm, optimizer, options_)),
        skips_(options_.skipped_steps, options_.loss_scaling.has_value(), comm.rank()) {
    const auto& list = reducer_->parameters();
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

  /// The loop over this rank's batches of epoch `epoch` (an EpochRange); the ranks' plans are
  /// compared first (loom::check_same_plan). Parameters may change between epochs.
  /// Example: `for (loom::Batch& b : trainer.epoch(loader, e)) trainer.backward(loss_of(b), b);`
  /// Throws: loom::Error when this Trainer refuses further use; loom::InvalidArgument when the ranks
  ///         plan differently or the loader was resumed into another epoch.
  template <BatchSource Loader>
  [[nodiscard]] EpochRange<Trainer, Loader> epoch(Loader& loader, int64_t epoch) {
    if (!broken_.empty())
      throw Error(fmt::format("Trainer::epoch({}): this Trainer refuses further use: {}", epoch, broken_));
    current_.reset();
    stop_ = false;
    stopped_ = false;
    if (detail::AutoCheckpoint::begin(*this, loader, epoch)) return EpochRange<Trainer, Loader>(this, &loader);
    loop_open_ = true;
    std::exception_ptr failed;  // a rank that cannot prepare the epoch still joins the plan check
    try {
      loader.begin_epoch(epoch);
    } catch (...) {
      failed = std::current_exception();
    }
    epoch_ = epoch;
    skips_.begin_epoch(epoch);
    steps_in_epoch_ = 0;
    plan_ = nullptr;
    // A planned source gives every rank every step (joined when it has no batch there), so the
    // flight recorder may compare the ranks' steps; other sources may end ranks at different steps.
    planned_ = PlannedBatchSource<Loader>;
    if constexpr (PlannedBatchSource<Loader>) {
      if (!failed) plan_ = &loader.sampler().plan();
      detail::TrainerRecovery::check_plan(*this, loader, failed);
    } else if (failed) {
      std::rethrow_exception(failed);
    }
    guard_.record_versions(reducer_->parameters());
    return EpochRange<Trainer, Loader>(this, &loader);
  }
  /// A loader that is no BatchSource: one static_assert saying what it must be.
  template <class Loader>
  requires(!BatchSource<Loader>) std::span<Batch> epoch(Loader&, int64_t) {
    return detail::not_a_batch_source<Loader>();
  }

  /// EpochRange's step: joins steps without a batch here, closes the epoch at the source's end, stops
  /// at the boundary after stop(). Returns the next batch (valid until the next call) or nullptr.
  /// Throws: loom::Error without a running loop or when the previous batch missed its backward.
  template <BatchSource Loader>
  Batch* next_batch(Loader& loader) {
    if (auto_.skipping) return nullptr;  // an epoch before the checkpoint's (TrainerOptions::checkpoint)
    if (!loop_open_) throw Error("Trainer::next_batch: no epoch loop is running (call trainer.epoch(loader, e) first)");
    for (;;) {
      if (elastic_.redeal) detail::TrainerRecovery::redeal(*this, loader);
      if (stop_ && accumulator_->window_micro_batches() == 0) {  // stop() at a step boundary
        stopped_ = true;
        loop_open_ = false;
        return nullptr;
      }
      std::optional<Batch> batch = loader.next();
      try {
        if (!batch) {
          loop_open_ = false;
          end_epoch();
          detail::AutoCheckpoint::after_epoch(*this);
          return nullptr;
        }
        if (batch->idle) {
          join(*batch);
          continue;
        }
      } catch (const CommError& e) {
        detail::TrainerRecovery::recover(*this, e);  // rethrows unless the job goes on without a dead rank
        loop_open_ = true;
        continue;
      }
      receive(std::move(*batch));
      return &*current_;
    }
  }

  /// EpochRange's destructor before the loop's end: after an exception nothing is sent (a step left
  /// open makes this Trainer refuse further use); right after stop() it is that stop; after a break
  /// or return every rank is told and this throws loom::Error (docs/loop.md, "What loom checks").
  void end_loop_early(bool by_exception) { detail::LoopExit::end_early(*this, by_exception); }

  /// Backward of `loss` for the batch the loop just yielded; at this rank's end of a step also the
  /// reduction, optimizer.step() (when the verdict is apply) and zero_grad(). Returns the SyncResult.
  /// Shape: `loss` has one element (the batch mean, or the sum with LossReduction::sum).
  /// Throws: loom::InvalidArgument (a bad loss), loom::Error (a protocol step out of order), the
  ///         reducer's errors.
  SyncResult backward(const at::Tensor& loss, const Batch& batch) {
    check_no_stray_backward("Trainer::backward");
    detail::check_backward_order(current_ ? &*current_ : nullptr, batch, backward_done_, batch_number_, current_step_);
    detail::check_trainer_loss(loss);
    guard_.check_untouched(reducer_->parameters(), "Trainer::backward");
    guard_.restore(reducer_->parameters(), "Trainer::backward");
    const int64_t divisor = loss_divisor(batch);
    share_replica_state(/*with_parameters=*/false);
    try {
      auto mb = accumulator_->micro_batch(batch, divisor);
      at::Tensor total = loss.reshape({});
      // The loss's weight: its real samples (mean loss) or 1 (summed loss); 0 for a repeated batch.
      const auto counted = static_cast<double>(batch.counted_samples());
      const double factor =
          (options_.loss == LossReduction::mean ? counted : (counted > 0 ? 1.0 : 0.0)) / static_cast<double>(divisor);
      if (factor != 1.0) total = total * factor;
      mb.scale(total).backward();
      arrivals_seen_ = reducer_->gradient_arrivals();
      backward_done_ = true;
      last_ = mb.finish();
      apply(last_);
    } catch (const CommError& e) {
      detail::TrainerRecovery::recover(*this, e);  // rethrows unless the job goes on; the step is dealt again
      last_ = SyncResult{};
      return last_;
    }
    if (!last_.boundary) guard_.hide(reducer_->parameters(), /*keep=*/true);
    return last_;
  }

  /// Calls `fn(result)` after every step boundary (applied, skipped or joined), equally often on
  /// every rank: the place for per-step work across ranks (progress, a schedule, checkpoints).
  /// Example: `trainer.on_step([&](const loom::SyncResult& r) { progress.add_global(r.global_samples); });`
  void on_step(std::function<void(const SyncResult&)> fn) { on_step_ = std::move(fn); }

  /// Calls `fn(result)` before each applied optimizer.step(), with the step's averaged gradients on
  /// the parameters (the same on every rank): the place for clipping or gradient surgery.
  /// Example: `trainer.before_step([&](const loom::SyncResult&) { torch::nn::utils::clip_grad_value_(params, 0.5); });`
  void before_step(std::function<void(const SyncResult&)> fn) { before_step_ = std::move(fn); }

  /// Compares the optimizer's options and the parameters' checksums across the ranks now (two small
  /// all_gathers; every rank at the same point, e.g. in on_step). save_checkpoint calls it.
  /// Throws: loom::Error on every rank naming the first option or parameter that differs.
  void check_replicas(const char* where = "Trainer::check_replicas") {
    detail::check_replicas_now(*comm_, *optimizer_, reducer_->parameters(), where);
  }

  /// Ends the running epoch loop at the current step boundary on every rank (call it from on_step).
  /// Example: `trainer.on_step([&](const loom::SyncResult&) { if (++n == max_steps) trainer.stop(); });`
  /// Throws: loom::Error outside on_step (from the loop body it would stop this rank alone).
  void stop() {
    if (!in_on_step_) throw Error(detail::kStopOutsideOnStep);
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
    const LossScaler* s = accumulator_->loss_scaler();
    return s ? std::optional<LossScalerState>(s->state()) : std::nullopt;
  }
  /// What a checkpoint keeps of this Trainer (loom::save_checkpoint, loom/train/checkpoint.hpp).
  [[nodiscard]] TrainerState state() const {
    return {steps_, skipped_, loss_scaler_state(), reducer_ ? reducer_->grid_exponents() : std::vector<int>{}};
  }
  /// Continues the step counts, the loss scaler and a deterministic reducer's grid exponents from a
  /// checkpoint's state, between epoch loops (grids absent from `state` stay as they are).
  /// Throws: loom::Error inside an epoch loop; loom::InvalidArgument for negative counts, a missing
  ///         scaler state, or as Reducer::load_grid_exponents.
  void load_state(const TrainerState& state) {
    if (loop_open_) throw Error("Trainer::load_state: an epoch loop is running; load a checkpoint between epochs");
    detail::check_trainer_state(state, accumulator_->loss_scaler() != nullptr);
    if (state.loss_scaler) load_loss_scaler_state(*state.loss_scaler);
    if (!state.grid_exponents.empty() && reducer_->options().deterministic)
      reducer_->load_grid_exponents(state.grid_exponents);
    steps_ = state.steps;
    skipped_ = state.skipped_steps;
  }
  [[nodiscard]] Opt& optimizer() const noexcept { return *optimizer_; }  ///< the optimizer this Trainer steps
  /// TrainerOptions::zero_stage = 1: the sharded optimizer state (state_bytes(), ...); nullptr at stage 0.
  [[nodiscard]] ShardedOptimizer<Comm>* sharded_optimizer() noexcept { return sharded_ ? &*sharded_ : nullptr; }
  /// Continues the loss scaler from a checkpoint's state (call before the first epoch loop).
  /// Throws: loom::InvalidArgument without TrainerOptions::loss_scaling, or for a bad state.
  void load_loss_scaler_state(const LossScalerState& state) {
    LossScaler* s = accumulator_->loss_scaler();
    if (s == nullptr)
      throw InvalidArgument(
          "Trainer::load_loss_scaler_state: this Trainer has no loss scaler (TrainerOptions::loss_scaling unset)");
    s->load_state(state);
  }

  /// The recoveries from ranks' deaths so far (an elastic ProcessGroup, docs/elastic.md), oldest first.
  [[nodiscard]] const std::vector<Recovery>& recoveries() const noexcept { return elastic_.recoveries; }
  /// Calls `fn(recovery)` on every survivor after each recovery, before training goes on; without
  /// it the new rank 0 prints one line to stderr ("loom: recovered: rank 2 died at step 5 ...").
  /// Example: `trainer.on_recovery([](const loom::Recovery& r) { log(r.lost, r.seconds); });`
  void on_recovery(std::function<void(const Recovery&)> fn) { elastic_.on_recovery = std::move(fn); }

  /// The SyncResult of the last boundary or micro-batch.
  [[nodiscard]] const SyncResult& last_step() const noexcept { return last_; }
  [[nodiscard]] ReducerType& reducer() { return detail::engaged(reducer_, broken_); }
  [[nodiscard]] Accumulator<ReducerType>& accumulator() { return detail::engaged(accumulator_, broken_); }
  [[nodiscard]] Comm& communicator() const noexcept { return *comm_; }
  [[nodiscard]] const TrainerOptions& options() const noexcept { return options_; }

 private:
  // The reducer counts every gradient its hooks deliver: between two calls of the Trainer none arrives.
  void check_no_stray_backward(const char* where) {
    if (!reducer_) throw Error(fmt::format("{}: this Trainer refuses further use: {}", where, broken_));
    if (reducer_->gradient_arrivals() != arrivals_seen_) throw Error(detail::stray_backward_message(where));
  }

  // Before the loop moves on: no stray backward, no parameter written, the last batch's backward done.
  void check_between_calls() {
    check_no_stray_backward("Trainer::epoch");
    guard_.check_untouched(reducer_->parameters(), "Trainer::epoch");
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
    guard_.check_untouched(reducer_->parameters(), "Trainer: at a step boundary");
    const bool skipped = s.verdict == StepVerdict::skip_non_finite || s.verdict == StepVerdict::skip_grid_overflow;
    if (s.verdict == StepVerdict::apply) {
      if (before_step_) {
        const detail::FlagScope running(in_on_step_);
        before_step_(s);
      }
      sharded_ ? sharded_->step() : static_cast<void>(optimizer_->step());  // sharded: all-gathered after
      ++steps_;
      ++steps_in_epoch_;
      skips_.applied();
    } else if (skipped) {
      ++skipped_;
      ++steps_in_epoch_;
    }
    optimizer_->zero_grad();
    ++elastic_.boundaries;
    elastic_.next_step = current_step_ + 1;
    guard_.hide(reducer_->parameters(), /*keep=*/false);
    if (skipped)
      skips_.skipped(current_step_, detail::skip_reason(s.verdict, reducer_->options()),
                     detail::step_indices(plan_, current_step_));
    if (on_step_) {
      const detail::FlagScope running(in_on_step_);
      on_step_(s);
    }
    detail::AutoCheckpoint::after_step(*this, s.verdict == StepVerdict::apply);
    guard_.record_versions(reducer_->parameters());
  }

  /// What must be equal on every replica goes into the reducer's next windows: the optimizer's
  /// options, and with `with_parameters` the parameters' checksums (Reducer::compare_replicas).
  void share_replica_state(bool with_parameters) {
    replica_ = detail::replica_state_of(*optimizer_, reducer_->parameters(), with_parameters);
    reducer_->compare_replicas(replica_.fingerprint());
  }

  /// A window found the ranks' replica fingerprints different (the same verdict on every rank).
  [[noreturn]] void replicas_differ() {
    const std::string where = replica_.checksums.empty() ? fmt::format("at step {} of epoch {}", current_step_, epoch_)
                                                         : fmt::format("at the end of epoch {}", epoch_);
    broken_ = fmt::format("the replicas differed {}", where);
    detail::throw_replicas_differ(*comm_, replica_, reducer_->parameters(), where);
  }

  void receive(Batch batch) {
    check_between_calls();
    current_step_ = batch.step;
    // The flight recorder's position: this batch's step and its micro-batch number in the step.
    trace::set_position(*comm_, batch.step, accumulator_->window_micro_batches(), planned_);
    current_ = std::move(batch);
    ++batch_number_;
    backward_done_ = false;
  }

  void join(const Batch& idle) {
    check_between_calls();
    guard_.restore(reducer_->parameters(), "Trainer::epoch");
    current_step_ = idle.step;
    trace::set_position(*comm_, idle.step, 0, planned_);
    share_replica_state(/*with_parameters=*/false);
    last_ = accumulator_->join_step(loss_divisor(idle));
    apply(last_);
  }

  void end_epoch() {
    check_between_calls();
    guard_.restore(reducer_->parameters(), "Trainer::epoch");
    current_.reset();
    // The epoch's last windows also compare the parameters' checksums across the ranks.
    share_replica_state(/*with_parameters=*/true);
    while (auto s = accumulator_->end_epoch()) {
      last_ = *s;
      apply(last_);
    }
    batch_number_ = 0;
    skips_.end_epoch(steps_in_epoch_);
  }

  /// What the losses of `batch`'s step are divided by (BackwardPlan::loss_divisor): with
  /// float16/bfloat16 parameters the step's planned global samples (Batch::step_samples, capped at
  /// kMaxLossDivisor), the same on every rank, so a backward's gradient is its share of the step's
  /// mean and stays in the 16-bit range; otherwise 1 (divided once by the global count after the all-reduce).
  int64_t loss_divisor(const Batch& batch) const {
    return sixteen_bit_ && batch.step_samples > 0 ? std::clamp<int64_t>(batch.step_samples, 1, kMaxLossDivisor) : 1;
  }

  friend struct detail::TrainerRecovery;
  friend struct detail::LoopExit;
  friend struct detail::AutoCheckpoint;

  AccumulatorOptions accumulator_options() const {
    return {.micro_batches_per_step = 0, .local_samples_per_step = 0, .loss_scaling = options_.loss_scaling};
  }

  [[noreturn]] void forgotten() { throw Error(detail::forgotten_message(epoch_, batch_number_, current_step_)); }

  Comm* comm_;
  Opt* optimizer_;
  TrainerOptions options_;
  std::optional<ReducerType> reducer_;  // rebuilt over the survivors after a rank died
  std::optional<Accumulator<ReducerType>> accumulator_;
  std::optional<ShardedOptimizer<Comm>> sharded_;  // TrainerOptions::zero_stage = 1
  detail::TrainableGuard guard_;                   // the trainable parameters' versions and held gradients
  bool sixteen_bit_ = false;                       // a trainable parameter is float16 or bfloat16
  std::string broken_;                             // why this Trainer refuses further use (empty: usable)
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
  detail::ElasticProgress elastic_;
  detail::AutoCheckpointState auto_;  // where a recovery from a rank's death starts (trainer_recovery.hpp)
  bool backward_done_ = false;
  bool loop_open_ = false;   // an epoch loop is running (epoch() until next_batch returns nullptr)
  bool stop_ = false;        // stop() was called
  bool stopped_ = false;     // the last epoch loop ended by stop()
  bool in_on_step_ = false;  // on_step's callback is running
};

}  // namespace loom

// TrainerOptions::checkpoint saves and loads through loom::save_checkpoint / load_checkpoint, which
// need the Trainer's definition above.
#include <loom/train/checkpoint.hpp>  // IWYU pragma: export
