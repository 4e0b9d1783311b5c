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
// Example (the README's loop, examples/readme_loop.cpp):
//   loom::run([](loom::ProcessGroup& pg) {
//     ...  // data, shapes, model, optimizer `opt`
//     loom::BatchLoader loader(pg, shapes, [&](int64_t i) { return data[i]; }, {.max_samples = 8, .batches_per_step = 2});
//     loom::Trainer trainer(pg, *model, opt);
//     loom::Logger log(loom::StreamSink{stdout}, pg);
//     for (int64_t epoch = 0; epoch < 4; ++epoch) {
//       loom::Metrics metrics(pg);
//       for (loom::Batch& b : trainer.epoch(loader, epoch)) {
//         auto loss = F::cross_entropy(model->forward(b.data), b.targets);  // mean over the batch
//         trainer.backward(loss, b);
//         metrics.add("loss", loss, b);
//       }
//       log.info("epoch {} loss {:.4f}", epoch, metrics.mean("loss"));
//     }
//   }, {.nproc = 2});
//
// What loom does, so the loop cannot forget it:
//   - the loss is the batch MEAN (PyTorch's default reduction; TrainerOptions::loss = sum for a
//     summed loss); loom multiplies it by the batch's real samples, so the step's gradient is the
//     mean over every sample of the step on every rank (ReducerOptions::average = samples), and a
//     repeated batch (weight 0) adds nothing;
//   - the step boundary comes from the plan (Batch::step_end): the optimizer's step() and
//     zero_grad() run there, inside backward(); a step with inf/NaN is skipped on every rank;
//   - a step in which this rank has no batch is joined without a backward (the loop never sees it);
//   - the epoch's end (remainder and join) runs when the loop over trainer.epoch(...) ends.
// What is checked, each a loom::Error naming what was forgotten:
//   - a batch the loop received but never passed to backward() (at the next batch or the end);
//   - a backward() outside backward() (loss.backward() by hand: its gradient would not be reduced);
//   - backward() twice for one batch, or for a batch the loop did not just receive;
//   - a loss that is not a one-element floating tensor requiring grad;
//   - a new epoch while the previous loop ended early (break) inside a step (leaving right after
//     a step boundary is fine).
// One rule the loop keeps: no collective in the loop body. A step's batches are dealt to the ranks
// by cost, so ranks run the body different numbers of times; per-step work that talks to the other
// ranks (a progress count, a checkpoint) goes into on_step(), which every rank runs at every step.
// The low-level layer (loom::Reducer, loom::Accumulator) stays public for loops of another shape.
//
// Cost: one Accumulator micro-batch per batch (the callgrind comparison of
// scripts/callgrind_overhead.sh holds this layer to the hand-written loop); one tiny collective per
// epoch end.
// Throws: see above; the reducer's, accumulator's, loader's and optimizer's errors.
// Source: the short path over a low-level layer of HF Accelerate (accumulate / backward /
//         gather_for_metrics) and Lightning Fabric (backward, no_backward_sync).
#pragma once

#include <concepts>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>

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

  /// Checks and broadcasts the parameters (rank 0's everywhere), builds the reducer and accumulator.
  Trainer(Comm& comm, ParameterList params, Opt& optimizer, TrainerOptions options = {})
      : comm_(&comm),
        optimizer_(&optimizer),
        options_(std::move(options)),
        reducer_(comm, std::move(params), options_.reducer),
        accumulator_(reducer_,
                     {.micro_batches_per_step = 0, .samples_per_step = 0, .loss_scaling = options_.loss_scaling}) {}

  /// The same, for a torch::nn::Module (its parameters and buffers, see loom::parameters_of).
  Trainer(Comm& comm, const torch::nn::Module& model, Opt& optimizer, TrainerOptions options = {})
      : Trainer(comm, parameters_of(model), optimizer, std::move(options)) {}

  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  /// The loop over this rank's batches of epoch `epoch` (see EpochRange). Throws: loom::Error when
  /// the previous epoch's loop ended inside a step (a `break`).
  template <class Loader>
  [[nodiscard]] EpochRange<Trainer, Loader> epoch(Loader& loader, int64_t epoch) {
    if (accumulator_.window_micro_batches() > 0)
      throw Error(
          fmt::format("Trainer::epoch({}): the previous loop ended inside an optimizer step (a break out of "
                      "trainer.epoch(...)?), so {} micro-batch(es) were never reduced; leave a loop only right "
                      "after a step boundary (trainer.backward(...).boundary)",
                      epoch, accumulator_.window_micro_batches()));
    current_.reset();
    stop_ = false;
    stopped_ = false;
    loader.begin_epoch(epoch);
    epoch_ = epoch;
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
    auto mb = accumulator_.micro_batch(batch);
    at::Tensor total = loss.reshape({});
    if (options_.loss == LossReduction::mean) total = total * static_cast<double>(batch.num_samples);
    if (batch.weight != 1.0) total = total * batch.weight;
    mb.scale(total).backward();
    arrivals_seen_ = reducer_.gradient_arrivals();
    backward_done_ = true;
    last_ = mb.finish();
    apply(last_);
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
  /// there; called between boundaries it takes effect at the next one. The next epoch() clears it.
  /// Example: `trainer.on_step([&](const loom::SyncResult&) { if (++n == max_steps) trainer.stop(); });`
  void stop() noexcept { stop_ = true; }
  /// Whether the last epoch loop ended by stop().
  [[nodiscard]] bool stopped() const noexcept { return stopped_; }

  /// Optimizer steps applied so far (skipped inf/NaN steps not counted).
  [[nodiscard]] int64_t steps() const noexcept { return steps_; }
  /// Steps skipped because some rank had inf/NaN gradients.
  [[nodiscard]] int64_t skipped_steps() const noexcept { return skipped_; }
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
    if (s.apply) {
      optimizer_->step();
      ++steps_;
    } else if (s.skipped_non_finite) {
      ++skipped_;
    }
    optimizer_->zero_grad();
    if (on_step_) on_step_(s);
  }

  // Called by EpochRange.
  void receive(Batch batch, int64_t step) {
    check_no_stray_backward("Trainer::epoch");
    if (current_ && !backward_done_) forgotten();
    current_ = std::move(batch);
    current_step_ = step;
    ++batch_number_;
    backward_done_ = false;
  }

  void join() {
    if (current_ && !backward_done_) forgotten();
    last_ = accumulator_.join_step();
    apply(last_);
  }

  void end_epoch() {
    check_no_stray_backward("Trainer::epoch");
    if (current_ && !backward_done_) forgotten();
    current_.reset();
    while (auto s = accumulator_.end_epoch()) {
      last_ = *s;
      apply(last_);
    }
    batch_number_ = 0;
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
  bool stop_ = false;     // stop() was called
  bool stopped_ = false;  // the last epoch loop ended by stop()
};

/// The loop over this rank's batches of one epoch, made by Trainer::epoch. Iterating it yields
/// `loom::Batch&`; advancing joins steps without a batch here; reaching the end closes the epoch
/// (remainder and join). Single pass.
///
/// Example: `for (loom::Batch& b : trainer.epoch(loader, e)) trainer.backward(loss_of(b), b);`
/// Throws (while advancing): the checks of Trainer (a batch without backward, a stray backward),
/// the loader's errors, the reducer's errors.
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

  EpochRange(T* trainer, L* loader) : trainer_(trainer), loader_(loader) {}
  EpochRange(const EpochRange&) = delete;
  EpochRange& operator=(const EpochRange&) = delete;
  EpochRange(EpochRange&&) = default;

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
        trainer_->join();
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
};

}  // namespace loom
