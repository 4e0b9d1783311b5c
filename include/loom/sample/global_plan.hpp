// loom/sample/global_plan.hpp — the world-size-free plan of an epoch (plan_epoch: which samples, in
// which shape-bucketed batches, in which optimizer step) and the dealing of a step's batches to the
// ranks (deal). GlobalBatchSampler (loom/sample/global_batch.hpp) runs both; they are also usable
// alone, e.g. to inspect a plan.
//
// Example:
//   auto plan = loom::plan_epoch(shapes, {.seed = 7, .max_samples = 16, .batches_per_step = 8}, epoch);
//   const loom::GlobalStep& s = plan.steps[0];
//   std::vector<int64_t> costs;                       // padded elements of the step's batches
//   for (int64_t j = 0; j < s.num_batches; ++j) costs.push_back(plan.batches[s.first_batch + j].padded_elements);
//   auto mine = loom::deal(costs, world_size, loom::Dealing::balanced)[rank];   // positions in the step
//
// The plan (world-size free):
//   1. Samples are visited in a seeded order (a permutation from a generator seeded with all 64
//      bits of seed + epoch, loom::generator64; dataset order without shuffle) and grouped into
//      batches by the collators' BucketPlanner rules (exact-shape or padded buckets, max_samples /
//      max_elements, partial buckets flushed: nothing is lost unless drop_incomplete or
//      OversizePolicy::skip ask for it, and EpochPlan::stats counts them).
//   2. The batches are shuffled with the same generator (shuffle only).
//   3. Consecutive batches form the optimizer steps: a step closes after `batches_per_step`
//      batches, or once it holds `samples_per_step` samples, or `elements_per_step` padded
//      elements (whichever first; 0 turns a rule off). The last step takes what is left.
//   With `global_batch_size` G > 0 (PyTorch's "batch size" of a step, summed over ranks) steps
//   are cut first: the seeded sample order is cut into steps of exactly G samples (the epoch's last
//   step takes the rest), and each step's samples are grouped into batches by the same rules,
//   partial buckets flushed at the step's end (1. per step; no batch shuffle: the sample order is
//   already random). A step then holds G samples as one or more same-shape micro-batches, on any
//   world size.
// Dealing (per step, identically on every rank): Dealing::balanced gives each batch, largest
//   padded-element count first (ties: plan order), to the rank with the least load so far (ties:
//   the lowest rank) — longest-processing-time-first — then moves or swaps single batches between
//   the busiest and the idlest rank while that lowers the busiest load; Dealing::round_robin gives
//   batch j of the step to rank j mod world_size. A rank's batches of a step run in plan order.
//
// Throws: loom::InvalidArgument for an empty dataset, bad batching options (as the collators), no
//         step rule, a negative epoch, world_size < 1 or a negative cost (deal).
// Source: LPT dealing is Graham's longest-processing-time-first rule; seeding as torch's
//         DistributedSampler (seed + epoch), with all 64 bits of the seed.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/randperm.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <loom/collate/batch_rules.hpp>
#include <loom/collate/options.hpp>
#include <loom/collate/planner.hpp>
#include <loom/error.hpp>
#include <loom/sample/concepts.hpp>
#include <loom/sample/detail/seeded_plan.hpp>
#include <loom/sample/sample_seed.hpp>

namespace loom {

/// How a step's batches are shared out among the ranks.
enum class Dealing {
  balanced,     ///< longest-processing-time-first on padded elements (default)
  round_robin,  ///< batch j of the step to rank j mod world_size
};

/// Settings of a GlobalBatchSampler and of plan_epoch. Use with designated initializers.
/// The batching fields mean what they mean in ShapeBucketOptions / PaddedBucketOptions.
///
/// Example: `loom::GlobalBatchOptions{.seed = 7, .max_samples = 16, .batches_per_step = 4}`.
/// Units: batches, samples, padded elements per optimizer step.
struct GlobalBatchOptions {
  int world_size = 1;                     ///< ranks sharing each step (not part of the plan); leave unset
                                          ///< with a communicator (it supplies them)
  int rank = 0;                           ///< this rank, in [0, world_size)
  bool shuffle = true;                    ///< seeded sample order and batch order per epoch
  uint64_t seed = 0;                      ///< shared by every rank
  std::vector<DimPadding> pad{};          ///< padded dimensions; empty: exact-shape buckets
  std::optional<int64_t> max_samples{};   ///< samples per batch
  std::optional<int64_t> max_elements{};  ///< padded elements per batch
  int64_t multiple_of = 1;
  bool drop_incomplete = false;
  OversizePolicy on_oversize = OversizePolicy::raise;
  int64_t batches_per_step = 1;   ///< a step closes after this many batches (0 = rule off)
  int64_t samples_per_step = 0;   ///< ... or once it holds >= this many samples (0 = off)
  int64_t elements_per_step = 0;  ///< ... or >= this many padded elements (0 = off)
  /// Exactly this many samples per optimizer step, over all ranks (the epoch's last step: the
  /// rest), as same-shape micro-batches of at most max_samples / max_elements (when neither is
  /// set: at most global_batch_size samples); 0 = off (the three rules above apply). With it,
  /// batches_per_step must stay 1 (its default) or 0, samples_per_step and elements_per_step 0 and
  /// drop_incomplete false (each would change the step's sample count).
  int64_t global_batch_size = 0;
  Dealing dealing = Dealing::balanced;  ///< who runs which batch of a step (not part of the plan)
};

/// The batching rules of a global plan: as batch_rules() of the collators' options, except that
/// with global_batch_size set and neither max_samples nor max_elements given, a batch holds at
/// most global_batch_size samples (no step holds more).
inline BatchRules batch_rules(const GlobalBatchOptions& o) {
  BatchRules r{.pad = o.pad,
               .max_samples = o.max_samples,
               .max_elements = o.max_elements,
               .multiple_of = o.multiple_of,
               .drop_incomplete = o.drop_incomplete,
               .on_oversize = o.on_oversize};
  if (o.global_batch_size > 0 && !r.max_samples && !r.max_elements) r.max_samples = o.global_batch_size;
  return r;
}

/// One optimizer step of an epoch's plan: batches [first_batch, first_batch + num_batches).
///
/// Units: samples; padded elements.
struct GlobalStep {
  int64_t first_batch = 0;  ///< position of its first batch in EpochPlan::batches
  int64_t num_batches = 0;  ///< batches in the step (>= 1)
  int64_t num_samples = 0;  ///< samples in the step, over all its batches
  int64_t elements = 0;     ///< padded elements in the step

  friend bool operator==(const GlobalStep&, const GlobalStep&) = default;
};

/// The plan of one epoch: its batches in plan order, grouped into steps. Independent of the world size.
struct EpochPlan {
  int64_t epoch = 0;
  std::vector<PlannedBatch> batches{};  ///< plan order
  std::vector<GlobalStep> steps{};      ///< consecutive runs of batches
  CollateStats stats{};                 ///< samples, batches, padding, drops and skips of the planning
};

namespace detail {

inline void check_step_rules(const GlobalBatchOptions& o) {
  if (o.global_batch_size < 0)
    throw InvalidArgument(
        fmt::format("GlobalBatchOptions: global_batch_size = {} (must be >= 0)", o.global_batch_size));
  if (o.global_batch_size > 0) {
    if (o.batches_per_step > 1 || o.samples_per_step != 0 || o.elements_per_step != 0)
      throw InvalidArgument(fmt::format(
          "GlobalBatchOptions: global_batch_size = {} fixes each step's samples; batches_per_step = {}, "
          "samples_per_step = {} and elements_per_step = {} would close steps too (leave them at 1 or 0, 0, 0)",
          o.global_batch_size, o.batches_per_step, o.samples_per_step, o.elements_per_step));
    if (o.drop_incomplete)
      throw InvalidArgument(fmt::format(
          "GlobalBatchOptions: global_batch_size = {} with drop_incomplete = true would drop each step's partial "
          "micro-batches (samples lost every step); leave drop_incomplete false",
          o.global_batch_size));
    if (o.batches_per_step < 0)
      throw InvalidArgument(
          fmt::format("GlobalBatchOptions: batches_per_step = {} (must be >= 0)", o.batches_per_step));
    return;
  }
  if (o.batches_per_step < 0 || o.samples_per_step < 0 || o.elements_per_step < 0)
    throw InvalidArgument(
        fmt::format("GlobalBatchOptions: batches_per_step = {}, samples_per_step = {}, elements_per_step "
                    "= {} (each must be >= 0)",
                    o.batches_per_step, o.samples_per_step, o.elements_per_step));
  if (o.batches_per_step == 0 && o.samples_per_step == 0 && o.elements_per_step == 0)
    throw InvalidArgument(
        "GlobalBatchOptions: batches_per_step, samples_per_step and elements_per_step are all 0 "
        "(no rule closes a step)");
}

/// The planning scheme, part of every fingerprint: 2 since plans are seeded with all 64 bits
/// (generator64). A cursor of an older scheme would resume into another sample order, so it is
/// refused (its fingerprint differs).
inline constexpr uint64_t kPlanScheme = 2;

/// Hash of what shapes the plan: the scheme, options but world_size, rank and dealing; and the shapes.
inline uint64_t plan_fingerprint(const std::vector<std::vector<int64_t>>& shapes, const GlobalBatchOptions& o) {
  Fingerprint f;
  f.add(kPlanScheme);
  f.add(o.shuffle ? 1 : 0);
  const BatchRules rules = batch_rules(o);
  rules.add_limits_to(f);
  // With global_batch_size, batches_per_step 0 and 1 plan alike: one value for both.
  f.add(static_cast<uint64_t>(o.global_batch_size > 0 ? 1 : o.batches_per_step));
  f.add(static_cast<uint64_t>(o.samples_per_step));
  f.add(static_cast<uint64_t>(o.elements_per_step));
  rules.add_padding_to(f);
  // Only when set, so that plans without it keep the fingerprints (and cursors) they had.
  if (o.global_batch_size > 0) f.add(static_cast<uint64_t>(o.global_batch_size) ^ 0x6c6f6f6d67627300ULL);
  add_shapes_to(f, shapes);
  return f.h;
}

/// What plan_fingerprint hashes, readable: (name, value) of every option that shapes the plan, as
/// the user wrote it, then the dataset ("samples": its size; "shapes": FNV-1a of the shapes, hex).
/// A checkpoint keeps them, so a resume refused for another plan names what changed.
/// Example: plan_fields(shapes, {.max_samples = 3})[1] is {"max_samples", "3"}; unset optionals are "unset".
inline std::vector<std::pair<std::string, std::string>> plan_fields(const std::vector<std::vector<int64_t>>& shapes,
                                                                    const GlobalBatchOptions& o) {
  auto optional = [](const std::optional<int64_t>& v) { return v ? fmt::format("{}", *v) : std::string("unset"); };
  std::string pad;
  for (const DimPadding& d : o.pad)
    pad += fmt::format("{}{{dim {}, boundaries [{}], multiple {}}}", pad.empty() ? "" : ", ", d.dim,
                       fmt::join(d.boundaries, ", "), d.multiple);
  Fingerprint f;
  add_shapes_to(f, shapes);
  return {{"shuffle", o.shuffle ? "true" : "false"},
          {"max_samples", optional(o.max_samples)},
          {"max_elements", optional(o.max_elements)},
          {"multiple_of", fmt::format("{}", o.multiple_of)},
          {"drop_incomplete", o.drop_incomplete ? "true" : "false"},
          {"on_oversize", o.on_oversize == OversizePolicy::raise ? "raise" : "skip"},
          {"batches_per_step", fmt::format("{}", o.batches_per_step)},
          {"samples_per_step", fmt::format("{}", o.samples_per_step)},
          {"elements_per_step", fmt::format("{}", o.elements_per_step)},
          {"global_batch_size", fmt::format("{}", o.global_batch_size)},
          {"pad", pad.empty() ? std::string("none") : "[" + pad + "]"},
          {"plan scheme", fmt::format("{}", kPlanScheme)},
          {"samples", fmt::format("{}", shapes.size())},
          {"shapes", fmt::format("{:016x}", f.h)}};
}

/// plan_epoch's steps of exactly `o.global_batch_size` samples: the seeded order cut into steps,
/// each step's samples planned into batches on their own (see the file comment).
inline void plan_fixed_steps(const std::vector<std::vector<int64_t>>& shapes, const GlobalBatchOptions& o,
                             int64_t epoch, EpochPlan& plan) {
  const auto n = static_cast<int64_t>(shapes.size());
  std::optional<at::Generator> gen;
  if (o.shuffle) gen = generator64(o.seed + static_cast<uint64_t>(epoch));
  const std::vector<int64_t> order = seeded_order(n, gen);
  const BatchRules rules = batch_rules(o);
  CollateStats total;
  for (int64_t begin = 0; begin < n; begin += o.global_batch_size) {
    const int64_t end = std::min(n, begin + o.global_batch_size);
    BucketPlanner planner(rules);
    std::vector<PlannedBatch> planned;
    for (int64_t k = begin; k < end; ++k)
      planner.add(order[static_cast<std::size_t>(k)],
                  shapes[static_cast<std::size_t>(order[static_cast<std::size_t>(k)])], planned);
    planner.flush(planned);
    const CollateStats& st = planner.stats();
    total.samples_in += st.samples_in;
    total.samples_out += st.samples_out;
    total.batches_out += st.batches_out;
    total.dropped_incomplete += st.dropped_incomplete;
    total.skipped_oversize += st.skipped_oversize;
    total.real_elements += st.real_elements;
    total.padded_elements += st.padded_elements;
    if (planned.empty()) continue;  // every sample of the step was skipped (OversizePolicy::skip)
    GlobalStep step;
    step.first_batch = static_cast<int64_t>(plan.batches.size());
    for (auto& pb : planned) {
      ++step.num_batches;
      step.num_samples += static_cast<int64_t>(pb.indices.size());
      step.elements += pb.padded_elements;
      plan.batches.push_back(std::move(pb));
    }
    plan.steps.push_back(step);
  }
  plan.stats = total;
}

}  // namespace detail

/// Plans epoch `epoch`: its batches and steps (see the file comment). Reads no world size or rank.
///
/// Example: `auto plan = loom::plan_epoch(shapes, {.seed = 1, .max_samples = 4, .batches_per_step = 2}, 0);`
/// Shape: `shapes[i]` is sample i's shape without the batch dimension.
/// Throws: loom::InvalidArgument (empty dataset, bad options, bad shapes, negative epoch).
inline EpochPlan plan_epoch(const std::vector<std::vector<int64_t>>& shapes, const GlobalBatchOptions& o,
                            int64_t epoch) {
  if (shapes.empty()) throw InvalidArgument("plan_epoch: no shapes (the dataset is empty)");
  if (epoch < 0) throw InvalidArgument(fmt::format("plan_epoch: epoch {} is negative", epoch));
  detail::check_step_rules(o);
  if (o.global_batch_size > 0) {
    EpochPlan plan;
    plan.epoch = epoch;
    detail::plan_fixed_steps(shapes, o, epoch, plan);
    return plan;
  }
  detail::SeededPlan planned = detail::plan_batches(
      shapes, batch_rules(o),
      o.shuffle ? std::optional(generator64(o.seed + static_cast<uint64_t>(epoch))) : std::nullopt);
  EpochPlan plan;
  plan.epoch = epoch;
  plan.stats = planned.stats;
  plan.batches = std::move(planned.batches);
  const auto b = static_cast<int64_t>(plan.batches.size());
  GlobalStep open;
  for (int64_t j = 0; j < b; ++j) {
    const PlannedBatch& pb = plan.batches[static_cast<std::size_t>(j)];
    if (open.num_batches == 0) open.first_batch = j;
    ++open.num_batches;
    open.num_samples += static_cast<int64_t>(pb.indices.size());
    open.elements += pb.padded_elements;
    const bool close = (o.batches_per_step > 0 && open.num_batches >= o.batches_per_step) ||
                       (o.samples_per_step > 0 && open.num_samples >= o.samples_per_step) ||
                       (o.elements_per_step > 0 && open.elements >= o.elements_per_step);
    if (close) {
      plan.steps.push_back(open);
      open = GlobalStep{};
    }
  }
  if (open.num_batches > 0) plan.steps.push_back(open);
  return plan;
}

/// Shares out items of the given costs among `world_size` ranks; returns, per rank, the positions
/// (into `costs`) it runs, in ascending order. Deterministic: the same answer on every rank.
///
/// Example: `loom::deal({5, 1, 4, 2}, 2, loom::Dealing::balanced)` == {{0, 1}, {2, 3}} (loads 6 and 6;
///          round_robin gives {{0, 2}, {1, 3}}, loads 9 and 3).
/// Units: costs in any additive unit (loom uses padded elements).
/// Throws: loom::InvalidArgument when world_size < 1 or a cost is negative.
/// Source: Graham's longest-processing-time-first list scheduling, then a move/swap local search
///         between the busiest and idlest rank (balanced).
inline std::vector<std::vector<int64_t>> deal(std::span<const int64_t> costs, int world_size, Dealing dealing) {
  if (world_size < 1) throw InvalidArgument(fmt::format("deal: world_size = {} (need >= 1)", world_size));
  std::vector<std::vector<int64_t>> out(static_cast<std::size_t>(world_size));
  const auto n = static_cast<int64_t>(costs.size());
  for (int64_t j = 0; j < n; ++j)
    if (costs[static_cast<std::size_t>(j)] < 0)
      throw InvalidArgument(fmt::format("deal: cost {} of item {} is negative", costs[static_cast<std::size_t>(j)], j));
  if (dealing == Dealing::round_robin) {
    for (int64_t j = 0; j < n; ++j) out[static_cast<std::size_t>(j % world_size)].push_back(j);
    return out;
  }
  std::vector<int64_t> by_cost(static_cast<std::size_t>(n));
  std::iota(by_cost.begin(), by_cost.end(), int64_t{0});
  std::stable_sort(by_cost.begin(), by_cost.end(), [&](int64_t a, int64_t b) {
    return costs[static_cast<std::size_t>(a)] > costs[static_cast<std::size_t>(b)];
  });
  std::vector<int64_t> load(static_cast<std::size_t>(world_size), 0);
  for (int64_t j : by_cost) {
    const auto r =
        static_cast<std::size_t>(std::min_element(load.begin(), load.end()) - load.begin());  // lowest rank on ties
    out[r].push_back(j);
    load[r] += costs[static_cast<std::size_t>(j)];
  }
  // Refinement: while moving one item from the busiest rank to the idlest, or swapping one item of
  // each, lowers the busier of the two below the busiest load, do the best such move (a bounded
  // number of times; deterministic: ties by rank and position).
  for (int round = 0; round < 4 * world_size; ++round) {
    const auto a = static_cast<std::size_t>(std::max_element(load.begin(), load.end()) - load.begin());
    const auto b = static_cast<std::size_t>(std::min_element(load.begin(), load.end()) - load.begin());
    if (a == b) break;
    int64_t best = load[a];
    std::ptrdiff_t best_i = -1, best_j = -1;  // j == -1: a move, not a swap
    for (std::size_t i = 0; i < out[a].size(); ++i) {
      const int64_t ci = costs[static_cast<std::size_t>(out[a][i])];
      for (std::ptrdiff_t j = -1; j < static_cast<std::ptrdiff_t>(out[b].size()); ++j) {
        const int64_t cj = j < 0 ? 0 : costs[static_cast<std::size_t>(out[b][static_cast<std::size_t>(j)])];
        const int64_t worse = std::max(load[a] - ci + cj, load[b] + ci - cj);
        if (worse < best) {
          best = worse;
          best_i = static_cast<std::ptrdiff_t>(i);
          best_j = j;
        }
      }
    }
    if (best_i < 0) break;
    const int64_t item = out[a][static_cast<std::size_t>(best_i)];
    out[a].erase(out[a].begin() + best_i);
    load[a] -= costs[static_cast<std::size_t>(item)];
    if (best_j >= 0) {
      const int64_t other = out[b][static_cast<std::size_t>(best_j)];
      out[b].erase(out[b].begin() + best_j);
      load[b] -= costs[static_cast<std::size_t>(other)];
      out[a].push_back(other);
      load[a] += costs[static_cast<std::size_t>(other)];
    }
    out[b].push_back(item);
    load[b] += costs[static_cast<std::size_t>(item)];
  }
  for (auto& v : out) std::sort(v.begin(), v.end());
  return out;
}

}  // namespace loom
