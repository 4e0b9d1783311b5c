// loom/sample/detail/seeded_plan.hpp — the one planning function both planned samplers run: a
// seeded sample order, the collators' BucketPlanner over it, then a seeded batch order.
// DistributedBucketBatchSampler shards its result (batch j to rank j mod R); plan_epoch groups it
// into steps that GlobalBatchSampler deals out.
//
// Shape: shapes[i] is sample i's shape without the batch dimension.
// Errors: the BucketPlanner's (bad rules, bad shapes), loom::InvalidArgument.
#pragma once

#include <cstddef>
#include <cstdint>
#include <numeric>
#include <optional>
#include <utility>
#include <vector>

#include <ATen/core/Generator.h>
#include <ATen/ops/randperm.h>

#include <loom/collate/batch_rules.hpp>
#include <loom/collate/options.hpp>
#include <loom/collate/planner.hpp>

namespace loom::detail {

/// An epoch's batches in plan order, and how planning went.
struct SeededPlan {
  std::vector<PlannedBatch> batches;
  CollateStats stats;
};

/// The order samples 0..n-1 are visited in: a randperm drawn from `gen`, or 0..n-1 without one.
inline std::vector<int64_t> seeded_order(int64_t n, std::optional<at::Generator>& gen) {
  std::vector<int64_t> order(static_cast<std::size_t>(n));
  if (gen) {
    const at::Tensor p = at::randperm(n, *gen, at::TensorOptions(at::kLong));
    const auto* ptr = p.data_ptr<int64_t>();
    order.assign(ptr, ptr + n);
  } else {
    std::iota(order.begin(), order.end(), int64_t{0});
  }
  return order;
}

/// Plans `shapes` with `rules`. With a generator: samples enter the planner in the order of a
/// randperm drawn from it, and the batches come out in the order of a second randperm drawn from
/// the same generator, continued. Without: dataset order, and batches in the order they closed.
inline SeededPlan plan_batches(const std::vector<std::vector<int64_t>>& shapes, const BatchRules& rules,
                               std::optional<at::Generator> gen) {
  const std::vector<int64_t> order = seeded_order(static_cast<int64_t>(shapes.size()), gen);
  BucketPlanner planner(rules);
  std::vector<PlannedBatch> planned;
  for (int64_t i : order) planner.add(i, shapes[static_cast<std::size_t>(i)], planned);
  planner.flush(planned);
  SeededPlan plan;
  plan.stats = planner.stats();
  const auto b = static_cast<int64_t>(planned.size());
  if (gen && b > 0) {
    const at::Tensor p = at::randperm(b, *gen, at::TensorOptions(at::kLong));  // the same generator, continued
    const auto* ptr = p.data_ptr<int64_t>();
    plan.batches.reserve(planned.size());
    for (int64_t j = 0; j < b; ++j) plan.batches.push_back(std::move(planned[static_cast<std::size_t>(ptr[j])]));
  } else {
    plan.batches = std::move(planned);
  }
  return plan;
}

}  // namespace loom::detail
