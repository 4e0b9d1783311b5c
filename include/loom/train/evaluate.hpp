// loom/train/evaluate.hpp — evaluate: run a function over every batch of a validation loader on
// every rank, and gather its per-sample rows from all ranks, each sample exactly once, in dataset
// order (Accelerate's gather_for_metrics, without padded duplicates to drop).
//
// One sentence: `auto r = loom::evaluate(pg, val_loader, [&](loom::Batch& b) { return model->forward(b.data); })`
// gives r.values, n x C on the CPU, row i = sample i of the validation set, identical on every rank.
//
// Example (accuracy and mean loss over the validation set, from the Trainer's epoch loop):
//   // A batch per rank per step (with the default 1, every step's one batch goes to rank 0):
//   loom::BatchLoader val(pg, val_shapes, fetch_val,
//                         {.shuffle = false, .max_samples = 64, .batches_per_step = pg.world_size()});
//   for (int64_t epoch = 0; epoch < epochs; ++epoch) {
//     for (loom::Batch& b : trainer.epoch(train, epoch)) trainer.backward(loss_of(b), b);
//     model->eval();
//     auto r = loom::evaluate(pg, val, [&](loom::Batch& b) {
//       auto logits = model->forward(b.data);
//       auto correct = logits.argmax(1).eq(b.targets).to(torch::kDouble);
//       auto loss = F::cross_entropy(logits, b.targets, F::CrossEntropyFuncOptions().reduction(torch::kNone));
//       return torch::stack({correct, loss.to(torch::kDouble)}, 1);                  // N x 2
//     });
//     model->train();
//     auto mean = r.values.mean(0);       // [accuracy, loss] over every validation sample, once each
//   }
//
// What it does: loader.begin_epoch(epoch) (0 by default), then, under torch::NoGradGuard, calls
//   `fn(batch)` for each of this rank's batches (idle batches skipped: their rank has nothing in
//   that step), keeps (batch.indices, rows), and gathers them with loom::gather_results
//   (loom/sample/eval.hpp) with dataset_size = the loader's sample count. GlobalBatchSampler plans
//   the same batches on any world size and never repeats a sample, so the rows are the same on 1 or
//   8 ranks (bit for bit when fn computes each batch alike): only who computes which batch changes.
// Where to call it: every rank at the same point, outside the loop body (ranks run the body a
//   different number of times): between epoch loops, or in Trainer::on_step. Use a loader of its
//   own; a plan without shuffle reads the set in order. A loader inside an epoch (a training loop
//   runs over it) is refused; any other loader is put back where it stood afterwards (its cursor,
//   and a pending resume), so a checkpoint written after evaluate resumes where one before would.
//   The model's mode (eval()/train()) is the caller's, as in a PyTorch evaluation loop.
// Shape: fn(batch) returns an at::Tensor of batch.num_samples rows (N x any trailing shape, at most
//   6 trailing dimensions), the same dtype and trailing shape on every batch and rank, on any
//   device; a dtype the communicator supports (float32, float64, bfloat16, float16, int32, int64).
//   Result: GatheredResults (indices 0..n-1 ascending, values n x trailing shape on the CPU,
//   duplicates_dropped 0).
// Throws: loom::InvalidArgument when the loader is inside an epoch (naming its epoch and step), or
//   when the loader's plan drops or skips samples (drop_incomplete,
//   OversizePolicy::skip: they could not be evaluated), naming the counts; when fn returns an
//   undefined tensor or one whose row count is not the batch's sample count (naming the step and
//   both counts), or rows of another dtype or trailing shape than its earlier ones. Whatever fails
//   on one rank (fn's own exceptions included) fails on every rank: the failing rank rethrows its
//   error, the others throw loom::Error naming that rank and its error's first line; no rank is
//   left waiting in a collective. gather_results' errors; loom::CommError / TimeoutError.
// Source: Accelerate's `gather_for_metrics` and torchvision's reference evaluate(); the exactly-
//   once plan is GlobalBatchSampler's.
#pragma once

#include <concepts>
#include <cstdint>
#include <exception>
#include <functional>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <loom/collate/batch.hpp>
#include <loom/comm/communicator.hpp>
#include <loom/comm/host_values.hpp>
#include <loom/error.hpp>
#include <loom/sample/eval.hpp>
#include <loom/trace/recorder.hpp>
#include <loom/train/batch_source.hpp>

namespace loom {

/// Options of evaluate.
struct EvalOptions {
  int64_t epoch = 0;  ///< the loader's epoch to read (matters only when its plan shuffles)
};

/// Runs `fn` over this rank's batches of `loader` and gathers the rows of every rank in dataset
/// order, each sample once. See the file comment.
///
/// Example: see the file comment.
/// Shape: see the file comment.
/// Throws: see the file comment.
/// Source: see the file comment.
template <Communicator C, PlannedBatchSource Loader, class Fn>
GatheredResults evaluate(C& comm, Loader& loader, Fn&& fn, EvalOptions o = {}) {
  static_assert(std::invocable<Fn&, Batch&>,
                "loom::evaluate: fn must be callable as fn(loom::Batch&) and return an at::Tensor of "
                "batch.num_samples rows");
  static_assert(std::convertible_to<std::invoke_result_t<Fn&, Batch&>, at::Tensor>,
                "loom::evaluate: fn(batch) must return an at::Tensor of batch.num_samples rows");
  std::vector<int64_t> indices;
  std::vector<at::Tensor> rows;
  std::exception_ptr failed;
  std::string failure;
  int64_t dataset_size = 0;
  std::function<void()> restore;
  try {
    const GlobalBatchSampler& sampler = loader.sampler();
    if (sampler.in_epoch())
      throw InvalidArgument(fmt::format(
          "evaluate: the loader is inside epoch {} (at step {} of {}; a training loop runs over it): evaluating it "
          "would rewind it and end that epoch early; give evaluate a loader of its own (a BatchLoader over the "
          "validation set)",
          sampler.epoch(), sampler.cursor().step, sampler.num_steps()));
    const GlobalCursor before = sampler.cursor();
    const bool resumed = sampler.resume_pending();
    // Afterwards the loader stands where it stood: a checkpoint written after evaluate names the same
    // position as one written before.
    restore = [&loader, before, resumed] {
      if (resumed) {
        if constexpr (requires { loader.resume(before); }) loader.resume(before);
      } else {
        loader.begin_epoch(before.epoch);
      }
    };
    if (resumed) {  // a pending resume would start the evaluation at its step: point it at the epoch's start
      if constexpr (requires { loader.resume(before); })
        loader.resume(GlobalCursor{before.seed, o.epoch, 0, before.fingerprint});
      else
        throw InvalidArgument("evaluate: the loader has a pending resume and no resume(cursor) to put it back");
    }
    loader.begin_epoch(o.epoch);
    dataset_size = static_cast<int64_t>(sampler.shapes().size());
    const CollateStats& stats = sampler.plan().stats;
    if (stats.dropped_incomplete > 0 || stats.skipped_oversize > 0)
      throw InvalidArgument(fmt::format(
          "evaluate: the loader's plan leaves out {} of its {} samples ({} dropped with incomplete batches, {} "
          "skipped as oversize): an evaluation must see every sample; plan it without drop_incomplete and with "
          "OversizePolicy::raise or a larger max_elements",
          stats.dropped_incomplete + stats.skipped_oversize, dataset_size, stats.dropped_incomplete,
          stats.skipped_oversize));
    at::NoGradGuard no_grad;
    while (std::optional<Batch> b = loader.next()) {
      if (b->idle || b->num_samples == 0) continue;
      at::Tensor out = fn(*b);
      if (!out.defined() || out.dim() == 0 || out.size(0) != b->num_samples)
        throw InvalidArgument(fmt::format(
            "evaluate: fn returned {} for the batch of step {} with {} samples; it must return one row per sample "
            "(a tensor of {} rows)",
            !out.defined() ? std::string("an undefined tensor")
                           : fmt::format("a tensor of shape [{}]", fmt::join(out.sizes(), ", ")),
            b->step, b->num_samples, b->num_samples));
      if (!rows.empty() &&
          (out.scalar_type() != rows.front().scalar_type() || out.sizes().slice(1) != rows.front().sizes().slice(1)))
        throw InvalidArgument(fmt::format(
            "evaluate: fn returned rows of dtype {} and trailing shape [{}] for step {}, but {} and [{}] before",
            c10::toString(out.scalar_type()), fmt::join(out.sizes().slice(1), ", "), b->step,
            c10::toString(rows.front().scalar_type()), fmt::join(rows.front().sizes().slice(1), ", ")));
      indices.insert(indices.end(), b->indices.begin(), b->indices.end());
      rows.push_back(out.detach());
    }
    restore();
  } catch (const std::exception& e) {
    failed = std::current_exception();
    failure = detail::first_line(e.what());
    if (failure.empty()) failure = "an error without a message";
  } catch (...) {
    failed = std::current_exception();
    failure = "an exception that is not a std::exception";
  }
  if (failed && restore) {
    try {
      restore();  // a failed evaluation leaves the loader where it stood too
    } catch (...) {
    }
  }
  // Every rank learns whether any rank failed before the gather, so none waits in it alone.
  trace::Scope scope(comm, trace::Context::evaluation);
  const std::vector<std::string> all = detail::all_gather_strings(comm, failure);
  if (failed) std::rethrow_exception(failed);
  for (std::size_t r = 0; r < all.size(); ++r)
    if (!all[r].empty()) throw Error(fmt::format("evaluate: rank {} failed: {}", r, all[r]));
  const at::Tensor values = rows.empty() ? at::Tensor() : at::cat(rows);
  return gather_results(comm, indices, values, {.dataset_size = dataset_size});
}

}  // namespace loom
