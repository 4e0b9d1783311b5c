// loom/train/detail/trainer_checks.hpp — the Trainer's misuse checks that need no Trainer state
// (the loss, the options, the optimizer's parameters) and TrainableGuard, which holds what the
// Trainer compares between its calls: the trainable parameters' version counters and, inside a
// step, their gradients. Not a public header: loom/train/trainer.hpp is; its file comment states
// the rules these enforce and docs/loop.md lists the messages.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <loom/collate/batch.hpp>
#include <loom/error.hpp>
#include <loom/reduce/detail/hooks.hpp>
#include <loom/reduce/options.hpp>
#include <loom/reduce/parameters.hpp>
#include <loom/train/batch_source.hpp>
#include <loom/train/options.hpp>

namespace loom::detail {

/// Validates the options and the optimizer against `params` and clears the gradients they hold (the
/// Trainer's constructor, before the reducer exists: no collective has run yet).
/// Throws: loom::InvalidArgument (check_trainer_options, check_optimizer_parameters, check_not_hooked).
template <class Opt>
ParameterList prepared_parameters(ParameterList params, Opt& optimizer, const TrainerOptions& options);

/// Trainer::epoch(loader, e) with a loader that is no BatchSource: one static_assert saying what it must be.
template <class Loader>
std::span<Batch> not_a_batch_source() {
  static_assert(
      BatchSource<Loader>,
      "loom::Trainer::epoch(loader, e): the loader must be a loom::BatchSource (loom/train/batch_source.hpp): "
      "loader.begin_epoch(int64_t) and loader.next() returning std::optional<loom::Batch>. loom::BatchLoader "
      "is one; a sampler is not: give it to a BatchLoader with a fetch function");
  return {};
}

/// `*part`, or loom::Error saying why the Trainer refuses further use (`broken`: a failed recovery
/// from a rank's death left it without a reducer).
template <class T>
T& engaged(std::optional<T>& part, const std::string& broken) {
  if (!part) throw Error(fmt::format("Trainer: this Trainer refuses further use: {}", broken));
  return *part;
}

/// The error every rank throws when `ranks` rank(s) left the loop of epoch `epoch` during `step`.
inline std::string ranks_left_message(int64_t epoch, int64_t ranks, int64_t step) {
  return fmt::format(
      "Trainer::epoch({}): {} rank(s) left the loop over trainer.epoch(...) before the epoch's end (a break or "
      "return in the loop body) while this rank was in step {}; ranks run the body different numbers of times "
      "per step, so every rank stops here with this error instead of training on out of step. To end an epoch "
      "early, call trainer.stop() from on_step(), which every rank runs at the same step",
      epoch, ranks, step);
}

/// The error of the rank whose loop of epoch `epoch` was left after batch `batch` of step `step`.
inline std::string loop_left_message(int64_t epoch, int64_t batch, int64_t step) {
  return fmt::format(
      "Trainer::epoch({}): the loop over trainer.epoch(...) was left before the epoch's end (a break or return "
      "after batch {} of step {}); ranks run the body different numbers of times per step, so no place in it is "
      "the same step on every rank, and every rank stops with this error. To end an epoch early, call "
      "trainer.stop() from on_step(), which every rank runs at the same step",
      epoch, batch, step);
}

/// The error for batch `batch` of step `step` that never reached Trainer::backward.
/// Trainer::load_state's counts are never negative, and a Trainer that scales the loss
/// (`scales_loss`) needs the state's loss scaler state. Throws: loom::InvalidArgument.
inline void check_trainer_state(const TrainerState& s, bool scales_loss) {
  if (s.steps < 0 || s.skipped_steps < 0)
    throw InvalidArgument(
        fmt::format("Trainer::load_state: steps {} and skipped_steps {} must be >= 0", s.steps, s.skipped_steps));
  if (scales_loss && !s.loss_scaler)
    throw InvalidArgument("Trainer::load_state: this Trainer scales the loss but the state has no loss scaler state");
}

/// The error for Trainer::stop() outside on_step().
inline constexpr const char* kStopOutsideOnStep =
    "Trainer::stop: call it from on_step(), which every rank runs at the same step; from the loop body it would stop "
    "this rank alone (ranks run the body different numbers of times per step)";

/// A backward ran outside trainer.backward (the reducer counted gradients the Trainer did not ask for).
inline std::string stray_backward_message(const char* where) {
  return fmt::format(
      "{}: a backward ran outside trainer.backward(loss, batch) (loss.backward() by hand?): its gradients would "
      "not be weighted or reduced across ranks",
      where);
}

/// Sets a flag for its lifetime (the Trainer's "on_step is running", also when the callback throws).
class FlagScope {
 public:
  explicit FlagScope(bool& flag) noexcept : flag_(flag) { flag_ = true; }
  FlagScope(const FlagScope&) = delete;
  FlagScope& operator=(const FlagScope&) = delete;
  ~FlagScope() { flag_ = false; }

 private:
  bool& flag_;
};

inline std::string forgotten_message(int64_t epoch, int64_t batch, int64_t step) {
  return fmt::format(
      "Trainer::epoch({}): batch {} of step {} was never passed to trainer.backward(loss, batch), so its samples "
      "would be missing from the step",
      epoch, batch, step);
}

/// The loss handed to Trainer::backward: one element, floating, requiring grad.
/// Throws: loom::InvalidArgument naming the shape, the dtype, or the missing grad.
inline void check_trainer_loss(const at::Tensor& loss) {
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

/// The Trainer weights each batch by its samples and divides by the step's global count: reducer
/// options with another average contradict it.
/// Throws: loom::InvalidArgument naming the average.
inline void check_trainer_options(const TrainerOptions& options) {
  if (options.reducer.average != Average::samples)
    throw InvalidArgument(fmt::format(
        "Trainer: TrainerOptions::reducer.average = {} contradicts the Trainer's weighting (each batch's loss "
        "is multiplied by its samples and the step's sum divided by the global sample count: Average::samples), "
        "so the gradient would depend on batch sizes and the world size; leave it at samples (for another rule, "
        "use loom::Reducer and loom::Accumulator directly)",
        to_string(options.reducer.average)));
  if (options.checkpoint && options.checkpoint->file.empty())
    throw InvalidArgument("Trainer: TrainerOptions::checkpoint has an empty file name; name the checkpoint file");
  if (options.checkpoint && options.checkpoint->every_steps < 0)
    throw InvalidArgument(
        fmt::format("Trainer: TrainerOptions::checkpoint.every_steps = {} (need >= 0; 0: epoch ends only)",
                    options.checkpoint->every_steps));
}

/// The optimizer updates exactly the model's trainable parameters (frozen ones may be in it too).
/// Throws: loom::InvalidArgument naming a tensor of the optimizer that is not the model's, or a
///         trainable parameter missing from the optimizer.
template <class Opt>
void check_optimizer_parameters(const ParameterList& list, Opt& optimizer) {
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

template <class Opt>
ParameterList prepared_parameters(ParameterList params, Opt& optimizer, const TrainerOptions& options) {
  check_trainer_options(options);
  if constexpr (HasParamGroups<Opt>) check_optimizer_parameters(params, optimizer);
  check_not_hooked(params, "Trainer");  // before the gradients below are touched
  at::NoGradGuard no_grad;
  for (auto& p : params.params)
    if (p.defined() && p.grad().defined()) p.mutable_grad().reset();
  return params;
}

/// What the Trainer keeps of its trainable parameters between its calls. Every call passes the
/// same ParameterList (the reducer's), whose trainable entries were fixed at construction.
///  - Version counters: a parameter's moves with every in-place write (an optimizer step included);
///    between the Trainer's own writes nothing may write them.
///  - Gradients: between the Trainer's calls the parameters hold none. Inside a step (hide with
///    `keep`) the partial sums are held here and handed back before the reducer runs again; after a
///    step they were zeroed and are dropped.
class TrainableGuard {
 public:
  TrainableGuard() = default;
  /// Takes the trainable (requires_grad) entries of `list` and records their versions.
  explicit TrainableGuard(const ParameterList& list) {
    for (std::size_t i = 0; i < list.params.size(); ++i)
      if (list.params[i].requires_grad()) trainable_.push_back(i);
    record_versions(list);
  }

  /// Indices of the trainable parameters in the list.
  [[nodiscard]] const std::vector<std::size_t>& trainable() const noexcept { return trainable_; }
  /// Whether gradients of an open step are held here.
  [[nodiscard]] bool holds_gradients() const noexcept { return !hidden_.empty(); }

  /// After a write of the Trainer's own (its step, on_step, a new epoch): the versions to compare with.
  void record_versions(const ParameterList& list) {
    versions_.clear();
    for (std::size_t i : trainable_) versions_.push_back(list.params[i]._version());
  }

  /// Throws: loom::Error naming the first parameter written in place since record_versions.
  void check_untouched(const ParameterList& list, const char* where) const {
    for (std::size_t k = 0; k < trainable_.size(); ++k)
      if (list.params[trainable_[k]]._version() != versions_[k])
        throw Error(fmt::format(
            "{}: {} was written in place outside the Trainer's optimizer step and on_step() (in the loop body, "
            "which ranks run different numbers of times per step), so the replicas would differ; per-step changes "
            "to parameters (clipping weights, loading values) belong in on_step() or between epochs",
            where, list.describe(trainable_[k])));
  }

  /// Takes the gradients off the parameters; keeps them when `keep` (inside a step).
  void hide(const ParameterList& list, bool keep) {
    hidden_.clear();
    for (std::size_t i : trainable_) {
      at::Tensor& g = list.params[i].mutable_grad();
      if (keep) hidden_.push_back(g);
      g.reset();
    }
  }

  /// Before the reducer runs again: the held partial sums go back to the parameters. A gradient that
  /// appeared in between was set by hand (a backward by hand is caught by the reducer's count).
  /// Throws: loom::Error naming the parameter whose gradient was set.
  void restore(const ParameterList& list, const char* where) {
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

  /// The held gradients back on the parameters without any check (a loop left early: the last
  /// window must be sent, and nothing may throw before it is).
  void put_back(const ParameterList& list) {
    for (std::size_t k = 0; k < trainable_.size(); ++k)
      list.params[trainable_[k]].mutable_grad() = k < hidden_.size() ? hidden_[k] : at::Tensor();
    hidden_.clear();
  }

 private:
  std::vector<std::size_t> trainable_;  // indices of the trainable parameters in the list
  std::vector<int64_t> versions_;       // their version counters after the Trainer's last write
  std::vector<at::Tensor> hidden_;      // inside a step: their gradients between the Trainer's calls
};

/// Trainer::backward's order: `batch` must be the one the loop just yielded (`current`, by its data
/// tensor), and its backward not done yet. Throws: loom::Error naming the batch and step.
inline void check_backward_order(const Batch* current, const Batch& batch, bool done, int64_t batch_number,
                                 int64_t step) {
  if (current == nullptr || current->num_samples != batch.num_samples ||
      current->data.unsafeGetTensorImpl() != batch.data.unsafeGetTensorImpl())
    throw Error(
        "Trainer::backward: this batch is not the one the epoch loop just yielded (pass each batch of "
        "`for (loom::Batch& b : trainer.epoch(loader, e))` to backward once, in order)");
  if (done)
    throw Error(fmt::format(
        "Trainer::backward: called twice for batch {} of step {} (one backward per batch; sum several losses first)",
        batch_number, step));
}

/// Builds the Trainer's reducer; its refusals (bad TrainerOptions::reducer, parameters it cannot
/// reduce) name the Trainer. Throws: loom::InvalidArgument "Trainer: its loom::Reducer ... refused: ...".
template <class ReducerType, class Comm>
ReducerType make_trainer_reducer(Comm& comm, ParameterList params, const ReducerOptions& options) {
  try {
    return ReducerType(comm, std::move(params), options);
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(
        fmt::format("Trainer: its loom::Reducer (TrainerOptions::reducer, the model's parameters) refused: {}",
                    first_line(e.what())));
  }
}

}  // namespace loom::detail
