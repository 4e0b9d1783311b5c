// loom/train/batch_source.hpp — BatchSource: what Trainer::epoch loops over (loom::BatchLoader is
// the model loom ships), and PlannedBatchSource, a source whose batches come from a
// GlobalBatchSampler's plan, which lets the trainer check the plan across ranks.
//
// Example:
//   static_assert(loom::BatchSource<loom::BatchLoader<Fetch>>);
//   for (loom::Batch& b : trainer.epoch(source, e)) trainer.backward(loss_of(b), b);
#pragma once

#include <concepts>
#include <cstdint>
#include <optional>

#include <loom/collate/batch.hpp>
#include <loom/sample/global_batch.hpp>

namespace loom {

/// A source of this rank's batches, epoch by epoch.
///
/// Requirements:
///  1. `s.begin_epoch(e)` (int64_t) prepares epoch e. Reason: Trainer::epoch(source, e) names the
///     epoch, and a seeded source's order depends on it.
///  2. `s.next()` returns std::optional<loom::Batch>: this rank's next batch of the epoch, in step
///     order; std::nullopt at the epoch's end. Reason: the trainer pulls one batch per loop turn.
///  3. Each batch carries its step: `step_end` on this rank's last batch of an optimizer step, and
///     an `idle` batch (no samples) for a step in which this rank has nothing; `step` numbers the
///     step when the source plans them (-1 otherwise). Every rank's source yields the same steps in
///     the same order. Reason: a step is one all-reduce on every rank; the trainer closes the step
///     after step_end and joins idle steps, so no rank waits for another.
/// Not required: a sampler, a plan, a device, copyability.
/// Models: loom::BatchLoader (loom/train/loader.hpp). Used by loom::Trainer::epoch.
template <class S>
concept BatchSource = requires(S& s, int64_t epoch) {
  s.begin_epoch(epoch);
  { s.next() } -> std::same_as<std::optional<Batch>>;
};

/// A BatchSource whose batches follow a GlobalBatchSampler's plan.
///
/// Requirements:
///  1. BatchSource<S>.
///  2. `s.sampler()` returns the (const) GlobalBatchSampler the batches follow. Reason: Trainer::epoch
///     compares the plans of every rank with one all_gather (check_same_plan) and, for float16 /
///     bfloat16 parameters, divides each step's losses by its planned global sample count.
/// Models: loom::BatchLoader.
template <class S>
concept PlannedBatchSource = BatchSource<S> && requires(S& s) {
  { s.sampler() } -> std::convertible_to<const GlobalBatchSampler&>;
};

}  // namespace loom
