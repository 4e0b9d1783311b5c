// loom/train/options.hpp — what a Trainer is built with: TrainerOptions (the reducer's options, loss
// scaling, what the loss is over the batch) and what it needs of an optimizer (StepOptimizer;
// StepFunctions for an update rule of one's own; HasParamGroups, the optimizers whose parameters the
// Trainer compares with the model's).
//
// Example:
//   torch::optim::AdamW opt(model->parameters(), 1e-3);               // a StepOptimizer with param_groups()
//   loom::Trainer trainer(pg, *model, opt, {.reducer = {.max_grad_norm = 1.0}});
//
// See loom/train/trainer.hpp and docs/loop.md.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>

#include <loom/accumulate/loss_scaler.hpp>
#include <loom/reduce/options.hpp>

namespace loom {

/// What the loss handed to Trainer::backward is over the batch's samples.
enum class LossReduction {
  mean,  ///< the mean over the batch's samples (PyTorch's default `reduction = mean`)
  sum,   ///< the sum over the batch's samples
};

/// What the Trainer does about a skipped step: one whose gradients held inf/NaN on some rank (or
/// overflowed the deterministic grid), so that every rank zeroed them and did not step. Rank 0
/// prints a warning per skipped step naming the epoch, the step and its samples' dataset indices
/// (with loss scaling, whose scaler skips steps by design while it backs off, only the epoch's
/// count), and a line at each epoch's end counting them; Trainer::skipped_steps() and
/// Trainer::epoch_skipped_steps() count them.
///
/// Example: `loom::TrainerOptions{.skipped_steps = {.error = true}}` — the first skipped step stops the run.
struct SkippedStepOptions {
  bool error = false;                 ///< a skipped step is a loom::Error on every rank (its message the warning's)
  std::int64_t max_consecutive = 50;  ///< this many skipped steps in a row is a loom::Error (0: no limit)
  bool warn = true;                   ///< rank 0 prints the warnings (stderr)
};

/// Options of Trainer; use with designated initializers.
///
/// Example: `loom::TrainerOptions{.reducer = {.max_grad_norm = 1.0}, .loss = loom::LossReduction::sum}`.
/// The Trainer's own checkpoint (TrainerOptions::checkpoint), written with loom::save_checkpoint
/// every `every_steps` optimizer steps and after each epoch's last step. When `file` exists at the
/// first epoch loop, the Trainer resumes from it (loom::load_checkpoint, on any world size) and the
/// epochs before its cursor's run no batch: a restarted job (torchrun --max-restarts, a rerun)
/// continues with no line of code of its own (docs/elastic.md, "The restart path").
///
/// Example: `loom::Trainer trainer(pg, *model, opt, {.checkpoint = loom::CheckpointOptions{.file = "run.ckpt", .every_steps = 100}});`
struct CheckpointOptions {
  std::filesystem::path file{};  ///< where (rank 0 writes it; every rank reads it through rank 0)
  int64_t every_steps = 0;       ///< optimizer steps between saves inside an epoch; 0: epoch ends only
};

struct TrainerOptions {
  ReducerOptions reducer{};                         ///< bucketing, clipping, wire dtype, buffers
  std::optional<LossScalerOptions> loss_scaling{};  ///< dynamic loss scaling (float16 training)
  LossReduction loss = LossReduction::mean;         ///< what backward()'s loss is over the batch
  SkippedStepOptions skipped_steps{};               ///< warnings and errors for skipped (inf/NaN) steps
  std::optional<CheckpointOptions> checkpoint{};    ///< saved every N steps and per epoch; resumed on start
  /// 1: ZeRO stage 1 (loom::ShardedOptimizer, docs/zero.md): each rank keeps and steps the optimizer
  /// state of about 1/world_size of the parameters' elements, and the updated parameters are
  /// all-gathered after each step; weights bit-identical to stage 0's. 0: every rank steps everything.
  int zero_stage = 0;
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

/// What a checkpoint keeps of a Trainer (Trainer::state / load_state).
struct TrainerState {
  int64_t steps = 0;                                ///< optimizer steps applied
  int64_t skipped_steps = 0;                        ///< steps skipped for inf/NaN gradients
  std::optional<LossScalerState> loss_scaler = {};  ///< set when the Trainer scales the loss
  /// ReducerOptions::deterministic: the reducer's grid exponents (Reducer::grid_exponents), else empty.
  std::vector<int> grid_exponents = {};
};

}  // namespace loom
