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
//     zero_grad() run there, inside backward(); a step with inf/NaN is skipped on every rank;
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
// Gradients between the Trainer's calls: the parameters hold none. Inside a step the Trainer keeps
// the partial sums of the step's micro-batches itself and hands them back to the parameters at the
// next backward(); after a step they are zeroed and dropped (as zero_grad(set_to_none = true), on
// LibTorch 1.13 too). So the PyTorch habits left in a loop body do what the user meant: an
// optimizer.zero_grad() at the top of the body finds nothing to clear (the step's earlier
// micro-batches are kept), and a leftover optimizer.step() finds no gradient and changes nothing
// (torch::optim optimizers skip parameters without one); the Trainer alone steps, once per step.
// A parameter no rank used in a step has no gradient at that step (optimizers skip it).
// One rule the loop keeps: no collective in the loop body. A step's batches are dealt to the ranks
// by cost, so ranks run the body different numbers of times; per-step work that talks to the other
// ranks (a progress count, a checkpoint) goes into on_step(), which every rank runs at every step.
// The low-level layer (loom::Reducer, loom::Accumulator) stays public for loops of another shape.
//
// Cost: one Accumulator micro-batch per batch (the callgrind comparison of
// scripts/callgrind_overhead.sh holds this layer to the hand-written loop); one tiny collective per
// epoch end, and one all_gather of 6 integers per epoch start (the plan check).
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
#include <string>
#include <string_view>
#include <unordered_set>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <loom/accumulate/accumulator.hpp>
#include <loom/collate/batch.hpp>
#include <loom/comm/communicator.hpp>
#include <loom/error.hpp>
#include <loom/reduce/module.hpp>
#include <loom/reduce/reducer.hpp>
#include <loom/sample/bucket_batch.hpp>
#include <loom/sample/global_batch.hpp>

namespace loom {

/// What the loss handed to Trainer::backward is over the batch's samples.
enum class LossReduction {
  mean,  ///< the mean over the batch's samples (PyTorch's default `reduction = mean`)
  sum,   ///< the sum over the batch's samples
};

/// Options of Trainer; use with designated initializers.
///
/// Example: `loom::TrainerOptions{.reducer = {.max_grad_norm = 1.0}, .loss = loom::LossReduction::sum}`.
struct TrainerOptions {
  ReducerOptions reducer{};                         ///< bucketing, clipping, wire dtype, buffers
  std::optional<LossScalerOptions> loss_scaling{};  ///< dynamic loss scaling (float16 training)
  LossReduction loss = LossReduction::mean;         ///< what backward()'s loss is over the batch
};

/// What Trainer needs of an optimizer: step() and zero_grad() (every torch::optim optimizer).
///
/// Requirements:
///  1. `o.step()` applies the gradients. Reason: loom calls it at each step boundary.
///  2. `o.zero_grad()` clears them. Reason: loom calls it after each step (applied or skipped).
/// Not required: parameter groups, a learning-rate scheduler, state (the user keeps those).
/// For a custom update, pass a loom::StepFunctions.
template <class O>
concept StepOptimizer = requires(O& o) {
  o.step();
  o.zero_grad();
};

/// An optimizer made of two callables, for users with their own update rule.
///
/// Example: `loom::StepFunctions opt{[&] { my_update(); }, [&] { my_zero(); }};`
struct StepFunctions {
  std::function<void()> on_step;
  std::function<void()> on_zero_grad;
  void step() const { on_step(); }
  void zero_grad() const { on_zero_grad(); }
};

/// An optimizer whose parameters loom can list: `o.param_groups()`, each group with `params()`
/// (torch::optim::Optimizer). Trainer compares them with the model's parameters when it is built.
template <class O>
concept HasParamGroups = requires(O& o) {
  o.param_groups().begin()->params().begin()->unsafeGetTensorImpl();
};

template <class T, class L>
class EpochRange;

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
        reducer_(comm, prepared(std::move(params), optimizer, options_), options_.reducer),
        accumulator_(reducer_,
                     {.micro_batches_per_step = 0, .samples_per_step = 0, .loss_scaling = options_.loss_scaling}) {
    const auto& list = reducer_.parameters();
    for (std::size_t i = 0; i < list.params.size(); ++i) {
      if (!list.params[i].requires_grad()) continue;
      trainable_.push_back(i);
      const auto dtype = list.params[i].scalar_type();
      if (dtype == at::kHalf || dtype == at::kBFloat16) sixteen_bit_ = true;
    }
    record_parameter_versions();
  }

  /// The same, for a torch::nn::Module (its parameters and buffers, see loom::parameters_of).
  Trainer(Comm& comm, const torch::nn::Module& model, Opt& optimizer, TrainerOptions options = {})
      : Trainer(comm, parameters_of(model), optimizer, std::move(options)) {}

  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  /// The loop over this rank's batches of epoch `epoch` (see EpochRange). Parameters may be changed between epochs (a checkpoint loaded, an evaluation's write-back):
  /// the check for changes outside the optimizer step starts afresh here.
  /// Every rank must plan alike: one all_gather of 6 integers compares the loader's plan (seed, epoch,
  /// step, options and shapes, dealing, world size) across ranks (loom::check_same_plan).
  /// Throws: loom::Error when this Trainer refuses further use (a previous loop was left early);
  ///         loom::InvalidArgument when the ranks plan differently, or the loader was resumed into
  ///         another epoch (the loader's errors).
  template <class Loader>
  [[nodiscard]] EpochRange<Trainer, Loader> epoch(Loader& loader, int64_t epoch) {
    if (!broken_.empty())
      throw Error(fmt::format("Trainer::epoch({}): this Trainer refuses further use: {}", epoch, broken_));
    current_.reset();
    stop_ = false;
    stopped_ = false;
    std::exception_ptr failed;  // a rank that cannot prepare the epoch still joins the plan check
    try {
      loader.begin_epoch(epoch);
    } catch (...) {
      failed = std::current_exception();
    }
    epoch_ = epoch;
    step_divisors_.clear();
    if constexpr (requires { loader.sampler().plan().steps; })
      if (sixteen_bit_ && !failed)
        for (const auto& step : loader.sampler().plan().steps)
          step_divisors_.push_back(std::clamp<int64_t>(step.num_samples, 1, kMaxLossDivisor));
    if constexpr (requires { check_same_plan(*comm_, loader.sampler(), std::string_view{}, failed); })
      check_same_plan(*comm_, loader.sampler(), fmt::format("Trainer::epoch({})", epoch), failed);
    else if (failed)
      std::rethrow_exception(failed);
    record_parameter_versions();
    return EpochRange<Trainer, Loader>(this, &loader);
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
    check_loss(loss);
    check_parameters_untouched("Trainer::backward");
    restore_gradients("Trainer::backward");
    const int64_t divisor = loss_divisor(current_step_);
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
    if (!last_.boundary) hide_gradients(/*keep=*/true);
    return last_;
  }

  /// Calls `fn(result)` after every step boundary on this rank — applied or skipped, including
  /// steps this rank only joined and the epoch's end — so every rank calls it equally often
  /// (unlike the loop body: a step's batches are dealt unevenly). The place for per-step work that
  /// must stay in step across ranks: a progress count (Progress::add_global(r.global_samples)), a
  /// learning-rate schedule, a checkpoint every N steps.
  /// Example: `trainer.on_step([&](const loom::SyncResult& r) { progress.add_global(r.global_samples); });`
  void on_step(std::function<void(const SyncResult&)> fn) { on_step_ = std::move(fn); }

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
  /// Whether the last epoch loop ended by stop().
  [[nodiscard]] bool stopped() const noexcept { return stopped_; }

  /// Optimizer steps applied so far (skipped inf/NaN steps not counted).
  [[nodiscard]] int64_t steps() const noexcept { return steps_; }
  /// Steps skipped because some rank had inf/NaN gradients.
  [[nodiscard]] int64_t skipped_steps() const noexcept { return skipped_; }
  /// The loss scaler's state (TrainerOptions::loss_scaling), for a checkpoint; nullopt without loss scaling.
  [[nodiscard]] std::optional<LossScalerState> loss_scaler_state() const {
    const LossScaler* s = accumulator_.loss_scaler();
    return s ? std::optional<LossScalerState>(s->state()) : std::nullopt;
  }
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
  template <class T, class L>
  friend class EpochRange;

  static bool same_batch(const Batch& a, const Batch& b) {
    return a.num_samples == b.num_samples && a.data.unsafeGetTensorImpl() == b.data.unsafeGetTensorImpl();
  }

  static void check_loss(const at::Tensor& loss) {
    if (!loss.defined()) throw InvalidArgument("Trainer::backward: the loss is undefined");
    if (loss.numel() != 1)
      throw InvalidArgument(
          fmt::format("Trainer::backward: the loss has shape [{}] ({} elements); pass one number per batch "
                      "(reduction mean or sum, not none)",
                      fmt::join(loss.sizes(), ", "), loss.numel()));
    if (!at::isFloatingType(loss.scalar_type()))
      throw InvalidArgument(fmt::format("Trainer::backward: the loss has dtype {} (need a floating dtype)",
                                        c10::toString(loss.scalar_type())));
    if (!loss.requires_grad())
      throw InvalidArgument(
          "Trainer::backward: the loss does not require grad (computed under NoGradGuard, or detached?)");
  }

  // Every gradient an autograd hook delivers is counted by the reducer; between two calls of the
  // trainer the count must not move.
  void check_no_stray_backward(const char* where) {
    if (reducer_.gradient_arrivals() != arrivals_seen_)
      throw Error(
          fmt::format("{}: a backward ran outside trainer.backward(loss, batch) (loss.backward() by hand?): its "
                      "gradients would not be weighted or reduced across ranks",
                      where));
  }

  void apply(const SyncResult& s) {
    if (!s.boundary) return;
    if (s.ranks_leaving > 0) {
      broken_ = fmt::format("{} rank(s) left the loop over trainer.epoch(...) during step {} of epoch {}",
                            s.ranks_leaving, current_step_, epoch_);
      throw Error(fmt::format(
          "Trainer::epoch({}): {} rank(s) left the loop over trainer.epoch(...) before the epoch's end (a break or "
          "return in the loop body) while this rank was in step {}; ranks run the body different numbers of times "
          "per step, so every rank stops here with this error instead of training on out of step. To end an epoch "
          "early, call trainer.stop() from on_step(), which every rank runs at the same step",
          epoch_, s.ranks_leaving, current_step_));
    }
    check_parameters_untouched("Trainer: at a step boundary");
    if (s.apply) {
      optimizer_->step();
      ++steps_;
    } else if (s.skipped_non_finite) {
      ++skipped_;
    }
    optimizer_->zero_grad();
    hide_gradients(/*keep=*/false);
    if (on_step_) {
      in_on_step_ = true;
      try {
        on_step_(s);
      } catch (...) {
        in_on_step_ = false;
        throw;
      }
      in_on_step_ = false;
    }
    record_parameter_versions();
  }

  /// Validates the options and the optimizer against `params` and clears existing gradients
  /// (constructor, before the reducer exists: no collective has run yet).
  static ParameterList prepared(ParameterList params, Opt& optimizer, const TrainerOptions& options) {
    if (options.reducer.average != Average::samples)
      throw InvalidArgument(fmt::format(
          "Trainer: TrainerOptions::reducer.average = {} contradicts the Trainer's weighting (each batch's loss "
          "is multiplied by its samples and the step's sum divided by the global sample count: Average::samples), "
          "so the gradient would depend on batch sizes and the world size; leave it at samples (for another rule, "
          "use loom::Reducer and loom::Accumulator directly)",
          to_string(options.reducer.average)));
    if constexpr (HasParamGroups<Opt>) check_optimizer_parameters(params, optimizer);
    detail::check_not_hooked(params, "Trainer");  // before the gradients below are touched
    at::NoGradGuard no_grad;
    for (auto& p : params.params)
      if (p.defined() && p.grad().defined()) p.mutable_grad().reset();
    return params;
  }

  /// The optimizer updates exactly the model's trainable parameters (frozen ones may be in it too).
  static void check_optimizer_parameters(const ParameterList& list, Opt& optimizer) {
    std::unordered_set<const c10::TensorImpl*> model, held;
    for (const auto& p : list.params)
      if (p.defined()) model.insert(p.unsafeGetTensorImpl());
    std::size_t group = 0;
    for (auto& g : optimizer.param_groups()) {
      std::size_t index = 0;
      for (const auto& t : g.params()) {
        if (!model.contains(t.unsafeGetTensorImpl()))
          throw InvalidArgument(fmt::format(
              "Trainer: tensor {} of the optimizer's parameter group {} ({} [{}]) is not a parameter of the model "
              "given to the Trainer, so its gradient would never be reduced across ranks or divided by the step's "
              "samples and the replicas would drift apart; give the Trainer every tensor the optimizer updates "
              "(a loom::ParameterList), or leave it out of the optimizer",
              index, group, c10::toString(t.scalar_type()), fmt::join(t.sizes(), ", ")));
        held.insert(t.unsafeGetTensorImpl());
        ++index;
      }
      ++group;
    }
    for (std::size_t i = 0; i < list.params.size(); ++i)
      if (list.params[i].defined() && list.params[i].requires_grad() &&
          !held.contains(list.params[i].unsafeGetTensorImpl()))
        throw InvalidArgument(fmt::format(
            "Trainer: {} is trainable but not in the optimizer, so its gradient would be reduced every step and "
            "never applied; add it to the optimizer, or freeze it (requires_grad_(false)) before building the "
            "Trainer",
            list.describe(i)));
  }

  void record_parameter_versions() {
    const auto& params = reducer_.parameters().params;
    param_versions_.clear();
    for (std::size_t i : trainable_) param_versions_.push_back(params[i]._version());
  }

  // A parameter's version counter moves with every in-place write (an optimizer step included);
  // between the Trainer's own steps nothing may write them.
  void check_parameters_untouched(const char* where) const {
    const auto& list = reducer_.parameters();
    for (std::size_t k = 0; k < trainable_.size(); ++k)
      if (list.params[trainable_[k]]._version() != param_versions_[k])
        throw Error(fmt::format(
            "{}: {} was written in place outside the Trainer's optimizer step and on_step() (in the loop body, "
            "which ranks run different numbers of times per step), so the replicas would differ; per-step changes "
            "to parameters (clipping weights, loading values) belong in on_step() or between epochs",
            where, list.describe(trainable_[k])));
  }

  // Between the Trainer's calls the parameters hold no gradient (see the file comment): inside a
  // step (`keep`) the partial sums are kept in hidden_; after a step they were zeroed and are dropped.
  void hide_gradients(bool keep) {
    const auto& params = reducer_.parameters().params;
    hidden_.clear();
    for (std::size_t i : trainable_) {
      at::Tensor& g = params[i].mutable_grad();
      if (keep) hidden_.push_back(g);
      g.reset();
    }
  }

  // Before the reducer runs again: the kept partial sums go back to the parameters. A gradient that
  // appeared in between was set by hand (a backward by hand is caught by check_no_stray_backward).
  void restore_gradients(const char* where) {
    const auto& list = reducer_.parameters();
    for (std::size_t k = 0; k < trainable_.size(); ++k) {
      at::Tensor& g = list.params[trainable_[k]].mutable_grad();
      if (g.defined())
        throw Error(fmt::format(
            "{}: the gradient of {} was set between two calls of the Trainer (the Trainer holds the step's "
            "gradients between its calls and applies them at the step boundary itself); leave .grad() alone in "
            "the loop body",
            where, list.describe(trainable_[k])));
      if (k < hidden_.size()) g = hidden_[k];
    }
    hidden_.clear();
  }

  /// An exception left the loop (EpochRange's destructor while unwinding): with a step open on this
  /// rank the Trainer refuses further use (no collective is attempted).
  void abandon_loop() noexcept {
    if (accumulator_.window_micro_batches() == 0 && hidden_.empty()) return;
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
      const auto& params = reducer_.parameters().params;
      for (std::size_t k = 0; k < trainable_.size(); ++k)
        params[trainable_[k]].mutable_grad() = k < hidden_.size() ? hidden_[k] : at::Tensor();
      hidden_.clear();
      (void)accumulator_.leave_step();
    }
    throw Error(fmt::format(
        "Trainer::epoch({}): the loop over trainer.epoch(...) was left before the epoch's end (a break or return "
        "after batch {} of step {}); ranks run the body different numbers of times per step, so no place in it is "
        "the same step on every rank, and every rank stops with this error. To end an epoch early, call "
        "trainer.stop() from on_step(), which every rank runs at the same step",
        epoch_, batch, step));
  }

  // Called by EpochRange.
  void receive(Batch batch, int64_t step) {
    check_no_stray_backward("Trainer::epoch");
    check_parameters_untouched("Trainer::epoch");
    if (current_ && !backward_done_) forgotten();
    current_ = std::move(batch);
    current_step_ = step;
    ++batch_number_;
    backward_done_ = false;
  }

  void join(int64_t step) {
    check_no_stray_backward("Trainer::epoch");
    check_parameters_untouched("Trainer::epoch");
    if (current_ && !backward_done_) forgotten();
    restore_gradients("Trainer::epoch");
    current_step_ = step;
    last_ = accumulator_.join_step(loss_divisor(step));
    apply(last_);
  }

  void end_epoch() {
    check_no_stray_backward("Trainer::epoch");
    check_parameters_untouched("Trainer::epoch");
    if (current_ && !backward_done_) forgotten();
    restore_gradients("Trainer::epoch");
    current_.reset();
    while (auto s = accumulator_.end_epoch()) {
      last_ = *s;
      apply(last_);
    }
    batch_number_ = 0;
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

  [[noreturn]] void forgotten() {
    throw Error(
        fmt::format("Trainer::epoch({}): batch {} of step {} was never passed to trainer.backward(loss, batch), "
                    "so its samples would be missing from the step",
                    epoch_, batch_number_, current_step_));
  }

  Comm* comm_;
  Opt* optimizer_;
  TrainerOptions options_;
  ReducerType reducer_;
  Accumulator<ReducerType> accumulator_;
  std::vector<std::size_t> trainable_;   // indices of the trainable parameters in reducer_.parameters()
  std::vector<int64_t> param_versions_;  // their version counters after the Trainer's last write
  std::vector<at::Tensor> hidden_;       // inside a step: their gradients between the Trainer's calls
  std::vector<int64_t> step_divisors_;   // this epoch's loss divisor per step (empty: 1 for every step)
  bool sixteen_bit_ = false;             // a trainable parameter is float16 or bfloat16
  std::string broken_;                   // why this Trainer refuses further use (empty: usable)
  std::optional<Batch> current_;
  SyncResult last_{};
  std::function<void(const SyncResult&)> on_step_;
  int64_t epoch_ = 0;
  int64_t current_step_ = 0;
  int64_t batch_number_ = 0;
  int64_t steps_ = 0;
  int64_t skipped_ = 0;
  int64_t arrivals_seen_ = 0;
  bool backward_done_ = false;
  bool stop_ = false;        // stop() was called
  bool stopped_ = false;     // the last epoch loop ended by stop()
  bool in_on_step_ = false;  // on_step's callback is running
};

/// The loop over this rank's batches of one epoch, made by Trainer::epoch. Iterating it yields
/// `loom::Batch&`; advancing joins steps without a batch here; reaching the end closes the epoch
/// (remainder and join). Single pass.
///
/// Example: `for (loom::Batch& b : trainer.epoch(loader, e)) trainer.backward(loss_of(b), b);`
/// Throws (while advancing): the checks of Trainer (a batch without backward, a stray backward),
/// the loader's errors, the reducer's errors. Its destructor throws loom::Error when a started loop
/// ends before the epoch's end other than by stop() or an exception (a break or return: see the
/// Trainer's file comment); it is noexcept(false) for that reason.
template <class T, class L>
class EpochRange {
 public:
  struct End {};
  class Iterator {
   public:
    using value_type = Batch;
    using difference_type = std::ptrdiff_t;
    Batch& operator*() const { return *range_->trainer_->current_; }
    Iterator& operator++() {
      range_->advance();
      return *this;
    }
    void operator++(int) { ++*this; }
    friend bool operator==(const Iterator& it, End) { return it.range_->finished(); }

   private:
    friend class EpochRange;
    explicit Iterator(EpochRange* r) : range_(r) {}
    EpochRange* range_;
  };

  EpochRange(T* trainer, L* loader) : trainer_(trainer), loader_(loader), exceptions_(std::uncaught_exceptions()) {}
  EpochRange(const EpochRange&) = delete;
  EpochRange& operator=(const EpochRange&) = delete;
  EpochRange& operator=(EpochRange&&) = delete;
  EpochRange(EpochRange&& other) noexcept
      : trainer_(std::exchange(other.trainer_, nullptr)),
        loader_(other.loader_),
        started_(other.started_),
        done_(other.done_),
        exceptions_(other.exceptions_) {}

  /// A loop that started and did not reach the epoch's end:
  ///  - left by an exception: nothing is sent (the error is on its way); when a step was open, the
  ///    Trainer refuses further use (its gradients and counts belong to a step that never closed);
  ///  - left by a break or return right after stop() took effect at a boundary: as if the loop
  ///    had ended by stop() (the other ranks stop there too);
  ///  - otherwise (a break or return): the Trainer tells every rank and throws (see its file comment).
  ~EpochRange() noexcept(false) {
    if (trainer_ == nullptr || !started_ || done_) return;
    if (std::uncaught_exceptions() > exceptions_) {
      trainer_->abandon_loop();
      return;
    }
    if (trainer_->stop_ && trainer_->accumulator_.window_micro_batches() == 0) {
      trainer_->stopped_ = true;
      return;
    }
    trainer_->leave_loop();
  }

  friend class Iterator;

  /// Whether the loop reached the end of the epoch (and closed it).
  [[nodiscard]] bool finished() const noexcept { return done_; }

  Iterator begin() {
    if (started_) throw Error("Trainer::epoch: an epoch range is single-pass; call trainer.epoch(loader, e) again");
    started_ = true;
    advance();
    return Iterator(this);
  }
  End end() const noexcept { return {}; }

 private:
  void advance() {
    for (;;) {
      if (trainer_->stop_ && trainer_->accumulator_.window_micro_batches() == 0) {  // stop() at a step boundary
        trainer_->stopped_ = true;
        done_ = true;
        return;
      }
      auto item = loader_->sampler().next();
      if (!item) {
        trainer_->end_epoch();
        done_ = true;
        return;
      }
      if (item->idle) {
        trainer_->join(item->step);
        continue;
      }
      trainer_->receive(loader_->load(*item), item->step);
      return;
    }
  }

  T* trainer_;
  L* loader_;
  bool started_ = false;
  bool done_ = false;
  int exceptions_ = 0;  // std::uncaught_exceptions() when the range was made
};

}  // namespace loom
