// loom/sample/sampled_batch.hpp — SampledBatch, the item of the batch samplers
// (DistributedBucketBatchSampler, GlobalBatchSampler), and collate_sampled, which turns one into a
// loom::Batch by fetching its samples.
//
// Example:
//   while (auto planned = sampler.next()) {
//     loom::Batch b = loom::collate_sampled(*planned, [&](int64_t i) { return dataset[i]; });
//     ...
//   }
//
// Shape: collated data is indices.size() x padded_shape.
// Errors: as loom::collate (loom/collate/collate_list.hpp).
#pragma once

#include <cstdint>
#include <ranges>
#include <span>
#include <type_traits>
#include <vector>

#include <loom/collate/batch.hpp>
#include <loom/collate/collate_list.hpp>
#include <loom/collate/sample.hpp>

namespace loom {

/// One step's batch for this rank: which samples, their padded shape, and whether it counts.
///
/// Example: `if (b.weight == 0) assert(b.repeated || b.idle);`
/// Shape: collated data is indices.size() x padded_shape.
struct SampledBatch {
  std::vector<int64_t> indices{};       ///< dataset indices in row order (empty when idle)
  std::vector<int64_t> padded_shape{};  ///< sample shape to pad to (empty when idle)
  double weight = 1.0;                  ///< 1: counts; 0: repeated or idle
  bool repeated = false;                ///< another rank runs the same batch with weight 1
  bool idle = false;                    ///< no samples this step (SurplusPolicy::idle)
  int64_t step = 0;                     ///< step within the epoch
  int64_t batch_id = -1;                ///< position in the epoch's plan (-1 when idle)
  bool step_end = false;                ///< this rank's last batch of its optimizer step (GlobalBatchSampler)
  int64_t step_samples = 0;             ///< samples the step holds over all ranks (GlobalBatchSampler); 0: not planned

  friend bool operator==(const SampledBatch&, const SampledBatch&) = default;
};

/// Collates the samples of a SampledBatch: fetches each index, pads to its padded_shape, and
/// copies the batch's weight, step, step_end, step_samples and idle flag. Idle batches give an empty Batch
/// (num_samples 0, weight 0, idle, no tensors).
/// Each sample's bytes are copied (to a staging buffer, then into the batch) before the next
/// fetch, so a `fetch` that decodes into one reused output buffer gives correct rows.
///
/// Example: `loom::Batch b = loom::collate_sampled(*s.next(), [&](int64_t i) { return dataset.get(i); });`
/// Shape: data indices.size() x padded_shape; mask when `o.mask`.
/// Throws: as loom::collate (collator.hpp).
template <class Fetch, class Projection = DefaultProjection>
Batch collate_sampled(const SampledBatch& sb, Fetch&& fetch, CollateOptions o = {}, const Projection& proj = {}) {
  if (sb.idle) {
    Batch b;
    b.weight = 0.0;
    b.step = sb.step;
    b.step_end = sb.step_end;
    b.step_samples = sb.step_samples;
    b.idle = true;
    return b;
  }
  using Sample = std::remove_cvref_t<std::invoke_result_t<Fetch&, int64_t>>;
  // Fetched during collate's walk, one at a time, and returned by value: collate copies each
  // sample as it arrives (a by-value range is never read in place), before the next fetch.
  const std::span<const int64_t> indices(sb.indices);
  auto samples = std::views::transform(indices, [&fetch](int64_t i) -> Sample { return fetch(i); });
  if (o.padded_shape.empty()) o.padded_shape = sb.padded_shape;
  Batch b = collate(samples, indices, o, proj);
  b.weight = sb.weight;
  b.step = sb.step;
  b.step_end = sb.step_end;
  b.step_samples = sb.step_samples;
  return b;
}

}  // namespace loom
