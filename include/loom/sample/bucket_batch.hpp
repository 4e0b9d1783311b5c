// loom/sample/bucket_batch.hpp — DistributedBucketBatchSampler: whole shape-bucketed batches per rank.
//
// For data whose samples differ in shape, sharding *indices* (DistributedSampler) and bucketing
// afterwards gives every rank a different number of batches, and the rank with fewer batches
// waits forever at the next all-reduce. This sampler shards *batches* instead:
//   1. Plan. Every rank runs the same BucketPlanner (loom/collate/planner.hpp, the collators'
//      rules) over the dataset's shapes, visited in a seeded order (a permutation seeded
//      seed + epoch, as DistributedSampler; dataset order without shuffle). Partial buckets are
//      flushed, so every sample is in exactly one planned batch (unless drop_incomplete or
//      OversizePolicy::skip was asked for; both are counted in plan_stats()).
//   2. Shuffle. The planned batches are permuted with the same generator (shuffle only).
//   3. Shard. Step t of rank r runs batch t x R + r of the plan. Every rank runs the same number
//      of steps; the surplus in the last step (when R does not divide the number of batches B)
//      follows SurplusPolicy:
//        repeat  (default) ranks without a batch of their own rerun batch (t x R + r) mod B, flagged
//                repeated with weight 0: multiply the loss by Batch::weight so it adds nothing,
//                and every rank still joins the collective. steps = ceil(B / R).
//        idle    ranks without a batch get an empty one flagged idle (weight 0, no indices): run
//                the collectives with zero gradients. steps = ceil(B / R).
//        drop    the last B mod R batches are left out (counted in dropped_samples()); steps = B / R.
//   Every sample of the epoch is in exactly one batch of weight 1 across ranks (repeat and idle).
//
// Example:
//   std::vector<std::vector<int64_t>> shapes = ...;                  // shapes[i]: sample i's shape
//   loom::DistributedBucketBatchSampler s(shapes, {.num_replicas = world, .rank = rank, .seed = 7,
//       .pad = {{.dim = 0}}, .max_elements = 4096});
//   for (int64_t epoch = 0; epoch < epochs; ++epoch) {
//     s.set_epoch(epoch);
//     while (auto planned = s.next()) {
//       loom::Batch b = loom::collate_sampled(*planned, [&](int64_t i) { return dataset[i]; });
//       auto loss = criterion(model(b.data), b.targets) * b.weight;   // 0 for a repeated batch
//       ...
//     }
//   }
//
// Units: size() and positions count steps (batches), equal on every rank.
// Throws: loom::InvalidArgument for an empty dataset, num_replicas < 1, rank outside [0, R), bad
//         batching options (loom/collate/options.hpp), bad shapes (naming the sample index and
//         shape, as the collators do), a negative epoch, and a state of another configuration.
// Source: the plan-then-shard scheme follows fairseq's batch_by_size + shard of a batch sampler
//         and torch's DistributedSampler seeding (seed + epoch); weight-0 repeats replace the
//         sample-level padding DistributedSampler does.
#pragma once

#include <cstdint>
#include <numeric>
#include <optional>
#include <ranges>
#include <span>
#include <utility>
#include <vector>

#include <loom/collate/batch_rules.hpp>
#include <loom/collate/collator.hpp>
#include <loom/collate/planner.hpp>
#include <loom/comm/communicator.hpp>
#include <loom/error.hpp>
#include <loom/sample/concepts.hpp>
#include <loom/sample/detail/seeded_plan.hpp>
#include <loom/sample/distributed.hpp>
#include <loom/sample/sampled_batch.hpp>

namespace loom {

/// What ranks without a batch of their own do in the last step. See the file comment.
enum class SurplusPolicy {
  repeat,  ///< rerun another rank's batch, flagged repeated, weight 0
  idle,    ///< an empty batch flagged idle, weight 0
  drop,    ///< leave out the last B mod R batches (counted)
};

/// Settings of a DistributedBucketBatchSampler. Use with designated initializers.
/// The batching fields mean what they mean in ShapeBucketOptions / PaddedBucketOptions.
struct BucketBatchSamplerOptions {
  int num_replicas = 1;                   ///< R, world size
  int rank = 0;                           ///< this rank, in [0, R)
  bool shuffle = true;                    ///< seeded sample order and batch order per epoch
  uint64_t seed = 0;                      ///< shared by every rank
  std::vector<DimPadding> pad{};          ///< padded dimensions; empty: exact-shape buckets
  std::optional<int64_t> max_samples{};   ///< samples per batch
  std::optional<int64_t> max_elements{};  ///< padded elements per batch
  int64_t multiple_of = 1;
  bool drop_incomplete = false;
  OversizePolicy on_oversize = OversizePolicy::raise;
  SurplusPolicy surplus = SurplusPolicy::repeat;
};

/// Whole batches of shape-bucketed samples per rank, the same step count on every rank.
///
/// Example: see the file comment.
/// Shape: see SampledBatch.
/// Throws: see the file comment.
/// Source: see the file comment.
class DistributedBucketBatchSampler {
 public:
  using value_type = SampledBatch;
  using state_type = SamplerState;

  /// `shapes[i]` is the shape of dataset sample i (without the batch dimension).
  DistributedBucketBatchSampler(std::vector<std::vector<int64_t>> shapes, BucketBatchSamplerOptions o)
      : shapes_(std::move(shapes)), o_(std::move(o)) {
    if (shapes_.empty()) throw InvalidArgument("DistributedBucketBatchSampler: no shapes (the dataset is empty)");
    if (o_.num_replicas < 1)
      throw InvalidArgument(
          fmt::format("DistributedBucketBatchSampler: num_replicas = {} must be >= 1", o_.num_replicas));
    if (o_.rank < 0 || o_.rank >= o_.num_replicas)
      throw InvalidArgument(
          fmt::format("DistributedBucketBatchSampler: rank {} is outside [0, {})", o_.rank, o_.num_replicas));
    (void)make_planner();  // validates the batching options now
    build_plan(0);
  }

  /// Sequences: `lengths[i]` is the length of sample i (a shape of one dimension).
  DistributedBucketBatchSampler(const std::vector<int64_t>& lengths, BucketBatchSamplerOptions o)
      : DistributedBucketBatchSampler(to_shapes(lengths), std::move(o)) {}

  /// Uses the communicator's rank and world size (overriding those in `o`).
  template <Communicator C>
  static DistributedBucketBatchSampler for_communicator(const C& comm, std::vector<std::vector<int64_t>> shapes,
                                                        BucketBatchSamplerOptions o) {
    o.num_replicas = comm.world_size();
    o.rank = comm.rank();
    return DistributedBucketBatchSampler(std::move(shapes), std::move(o));
  }

  /// Selects the epoch (plan order seeded seed + epoch) and rewinds to its first step.
  void set_epoch(int64_t epoch) {
    if (epoch < 0) throw InvalidArgument(fmt::format("DistributedBucketBatchSampler: epoch {} is negative", epoch));
    if (epoch != epoch_) build_plan(epoch);
    position_ = 0;
  }

  /// Steps of the current epoch, equal on every rank.
  [[nodiscard]] int64_t size() const noexcept { return steps_; }
  [[nodiscard]] int64_t epoch() const noexcept { return epoch_; }

  /// This rank's batch for the next step, or nullopt at the end of the epoch.
  std::optional<SampledBatch> next() {
    if (position_ >= steps_) return std::nullopt;
    return batch_at(position_++);
  }

  /// This rank's batches of the current epoch, from step 0 (independent of the position).
  [[nodiscard]] std::vector<SampledBatch> batches() const {
    std::vector<SampledBatch> v;
    v.reserve(static_cast<std::size_t>(steps_));
    for (int64_t t = 0; t < steps_; ++t) v.push_back(batch_at(t));
    return v;
  }

  /// The epoch's plan over all ranks, in step-major order (batch t x R + r is rank r's step t).
  [[nodiscard]] const std::vector<PlannedBatch>& plan() const noexcept { return plan_; }
  /// How planning went this epoch: samples, batches, padding, drops and skips.
  [[nodiscard]] const CollateStats& plan_stats() const noexcept { return plan_stats_; }
  /// Samples of this epoch in no weight-1 batch: dropped_incomplete + skipped_oversize + surplus drops.
  [[nodiscard]] int64_t dropped_samples() const noexcept {
    return plan_stats_.dropped_incomplete + plan_stats_.skipped_oversize + surplus_dropped_;
  }

  [[nodiscard]] SamplerState state() const {
    SamplerState s = identity();
    s.epoch = epoch_;
    s.position = position_;
    return s;
  }

  /// Resumes at the saved epoch and step. Throws loom::InvalidArgument for a state of another configuration.
  void load_state(const SamplerState& st) {
    SamplerState config_only = st;
    config_only.position = 0;
    detail::check_state_matches(config_only, identity(), 0, "DistributedBucketBatchSampler");
    if (st.epoch != epoch_) build_plan(st.epoch);
    detail::check_state_matches(st, identity(), steps_, "DistributedBucketBatchSampler");
    position_ = st.position;
  }

 private:
  static std::vector<std::vector<int64_t>> to_shapes(const std::vector<int64_t>& lengths) {
    std::vector<std::vector<int64_t>> s;
    s.reserve(lengths.size());
    for (int64_t l : lengths) s.push_back({l});
    return s;
  }

  BucketPlanner make_planner() const { return BucketPlanner(batch_rules(o_)); }

  void build_plan(int64_t epoch) {
    detail::SeededPlan planned = detail::plan_batches(
        shapes_, batch_rules(o_),
        o_.shuffle ? std::optional(at::make_generator<at::CPUGeneratorImpl>(o_.seed + static_cast<uint64_t>(epoch)))
                   : std::nullopt);
    plan_stats_ = planned.stats;
    plan_ = std::move(planned.batches);
    const auto b = static_cast<int64_t>(plan_.size());
    const int64_t r = o_.num_replicas;
    surplus_dropped_ = 0;
    if (o_.surplus == SurplusPolicy::drop) {
      steps_ = b / r;
      for (int64_t j = steps_ * r; j < b; ++j)
        surplus_dropped_ += static_cast<int64_t>(plan_[static_cast<std::size_t>(j)].indices.size());
    } else {
      steps_ = (b + r - 1) / r;
    }
    epoch_ = epoch;
  }

  SampledBatch batch_at(int64_t step) const {
    const auto b = static_cast<int64_t>(plan_.size());
    const int64_t slot = step * o_.num_replicas + o_.rank;
    SampledBatch s;
    s.step = step;
    if (slot < b) {
      const PlannedBatch& p = plan_[static_cast<std::size_t>(slot)];
      s.indices = p.indices;
      s.padded_shape = p.padded_shape;
      s.batch_id = slot;
    } else if (o_.surplus == SurplusPolicy::repeat) {
      const int64_t id = slot % b;
      const PlannedBatch& p = plan_[static_cast<std::size_t>(id)];
      s.indices = p.indices;
      s.padded_shape = p.padded_shape;
      s.batch_id = id;
      s.weight = 0.0;
      s.repeated = true;
    } else {
      LOOM_ASSERT(o_.surplus == SurplusPolicy::idle, "drop never yields a step past the plan");
      s.weight = 0.0;
      s.idle = true;
    }
    return s;
  }

  SamplerState identity() const {
    detail::Fingerprint f;
    f.add(o_.shuffle ? 1 : 0);
    f.add(static_cast<uint64_t>(o_.surplus));
    const BatchRules rules = batch_rules(o_);
    rules.add_limits_to(f);
    rules.add_padding_to(f);
    add_shapes_to(f, shapes_);
    SamplerState s;
    s.seed = o_.seed;
    s.dataset_size = static_cast<int64_t>(shapes_.size());
    s.num_replicas = o_.num_replicas;
    s.rank = o_.rank;
    s.fingerprint = f.h;
    return s;
  }

  std::vector<std::vector<int64_t>> shapes_;
  BucketBatchSamplerOptions o_;
  int64_t epoch_ = -1;
  int64_t position_ = 0;
  int64_t steps_ = 0;
  int64_t surplus_dropped_ = 0;
  std::vector<PlannedBatch> plan_;
  CollateStats plan_stats_;
};

static_assert(ResumableSampler<DistributedBucketBatchSampler>);

}  // namespace loom
