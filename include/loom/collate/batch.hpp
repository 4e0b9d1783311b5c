// loom/collate/batch.hpp — Batch: what a collator emits and a training step consumes.
//
// Example:
//   loom::Batch b = ...;                      // from a collator or a generator loader
//   auto mb   = accumulator.micro_batch(b);   // counts b.num_samples (0 when b.weight == 0)
//   auto out  = model->forward(b.data);       // b.data: N x C x H x W (images) or N x L (tokens)
//   auto loss = torch::nn::functional::cross_entropy(out, b.targets,
//                   torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum));
//   (loss * b.weight).backward();             // a repeated batch (weight 0) adds no gradient
//   if (mb.finish()) optimizer.step();
//
// Guide: docs/collate.md#what-a-batch-holds-loomcollatebatchhpp.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

namespace loom {

/// A collated batch of N samples.
///
/// Example: `b.data.size(0) == b.num_samples` and `b.indices[i]` is row i's dataset index.
/// Shape: data N x (sample shape), for padded buckets the bucket's padded shape, with `mask` (bool,
///        like data, true = real element); targets N x (target shape) (int64 class ids: N), or
///        undefined without targets; indices N entries, in row order.
/// Units: num_samples in samples; weight 1, or 0 for a repeated batch (multiply the loss by it).
struct Batch {
  at::Tensor data;               ///< N x (sample shape); dtype of the samples
  at::Tensor targets;            ///< N x (target shape), or undefined
  at::Tensor mask;               ///< like data, bool, true = real element; undefined unless padded
  std::vector<int64_t> indices;  ///< dataset index of each row, in row order (size N)
  int64_t num_samples = 0;       ///< N, in samples
  double weight = 1.0;           ///< 1 = counts; 0 = a repeated (padding) batch that must not count
  bool step_end = false;         ///< this rank's last batch of its optimizer step (GlobalBatchSampler):
                                 ///< loom::Accumulator closes the window after it
  int64_t step = -1;             ///< optimizer step within the epoch (batch samplers); -1: not planned
  bool idle = false;             ///< no samples: this rank only joins step `step` (weight 0)
  int64_t step_samples = 0;      ///< samples step `step` holds over all ranks (GlobalBatchSampler); 0: not planned

  /// The samples this batch counts for: num_samples, or 0 for a weight-0 (repeated) batch. The one
  /// rule loom::Accumulator (window sample counts), loom::Trainer (the loss's weight) and
  /// loom::Metrics (weights of means) apply; loom::Accumulator refuses a weight other than 0 or 1.
  [[nodiscard]] int64_t counted_samples() const noexcept { return weight == 0 ? 0 : num_samples; }
};

}  // namespace loom
