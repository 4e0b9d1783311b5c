// loom/sample/global_batch.hpp — GlobalBatchSampler: optimizer steps whose content does not depend
// on the world size, dealt to the ranks by cost; resume on another world size with every sample
// used exactly once.
//
// One sentence: the epoch's plan — which samples, in which shape-bucketed batches, in which
// optimizer step — is a pure function of (seed, epoch, shapes, options); each step's batches are
// then dealt to the ranks so the most loaded rank's padded elements stay close to the mean, each
// rank accumulates its share, and the step synchronises once.
//
// Example:
//   loom::GlobalBatchSampler sampler(comm, shapes, {.seed = 7, .max_samples = 16, .batches_per_step = 8});
//   sampler.set_epoch(epoch);
//   while (auto sb = sampler.next()) {            // this rank's batches of step sb->step, in order
//     if (sb->idle) { acc.idle_step(); continue; } // no batch of this step here: join the sync
//     loom::Batch b = loom::collate_sampled(*sb, fetch);
//     ...                                           // b.step_end: this rank's last batch of the step
//   }
//   auto cursor = sampler.cursor();                // after a step: save with the checkpoint
//   // later, on any number of ranks:  sampler.resume(cursor);
//
// The plan (world-size free):
//   1. Samples are visited in a seeded order (a permutation from a generator seeded with all 64
//      bits of seed + epoch, loom::generator64; dataset order without shuffle) and grouped into batches by the collators' BucketPlanner rules (exact-shape
//      or padded buckets, max_samples / max_elements, partial buckets flushed: nothing is lost
//      unless drop_incomplete or OversizePolicy::skip ask for it, and plan().stats counts them).
//   2. The batches are shuffled with the same generator (shuffle only).
//   3. Consecutive batches form the optimizer steps: a step closes after `batches_per_step`
//      batches, or once it holds `samples_per_step` samples, or `elements_per_step` padded
//      elements (whichever first; 0 turns a rule off). The last step takes what is left.
// Dealing (per step, identically on every rank): Dealing::balanced gives each batch, largest
//   padded-element count first (ties: plan order), to the rank with the least load so far (ties:
//   the lowest rank) — longest-processing-time-first — then moves or swaps single batches between
//   the busiest and the idlest rank while that lowers the busiest load; Dealing::round_robin gives batch j of the step
//   to rank j mod world_size. A rank's batches of a step run in plan order. A rank that receives no
//   batch of a step yields one item with `idle` set (no samples, weight 0): it joins the step's
//   synchronisation with zero gradients and zero samples. No batch is repeated and none carries
//   weight 0 otherwise, so the step's gradient, divided by its global sample count
//   (ReducerOptions::average = samples), is the same on any world size up to summation order.
// Resume: cursor() = (seed, epoch, next step, fingerprint of the options and shapes), a few integers
//   that do not mention the world size; resume(cursor) on any world size continues at that step. A
//   cursor taken after an epoch's last step is the next epoch's step 0. After resume(), the next
//   set_epoch() must name the cursor's epoch and keeps the resumed position (a loop that calls
//   set_epoch(e) at the top of each epoch, as with torch's DistributedSampler, resumes as meant);
//   another epoch is loom::InvalidArgument. state()/load_state() resume mid-step at the same world
//   size (ResumableSampler).
// Ranks must plan alike: check_same_plan(comm, sampler) compares seed, epoch, step, fingerprint,
//   dealing and world size across ranks in one small all_gather (loom::Trainer runs it per epoch).
//
// Units: steps are optimizer steps (equal on every rank); size() counts this rank's items.
// Throws: loom::InvalidArgument for an empty dataset, world_size < 1, rank outside [0, world_size),
//         bad batching options (as the collators), no step rule, a negative epoch, a cursor or
//         state of another configuration (naming what differs), set_epoch after resume() to
//         another epoch, ranks that plan differently (check_same_plan).
// Source: the world-size-free global batch follows MosaicML streaming's deterministic sample order
//         across device counts, generalised to variable-shape batches; LPT dealing is Graham's
//         longest-processing-time-first rule; seeding as torch's DistributedSampler (seed + epoch),
//         with all 64 bits of the seed.
#pragma once

#include <algorithm>
#include <cstdint>
#include <exception>
#include <numeric>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/randperm.h>
#include <fmt/format.h>

#include <loom/collate/options.hpp>
#include <loom/collate/planner.hpp>
#include <loom/comm/communicator.hpp>
#include <loom/detail/text_fields.hpp>
#include <loom/error.hpp>
#include <loom/sample/bucket_batch.hpp>
#include <loom/sample/concepts.hpp>
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
  int world_size = 1;                     ///< ranks sharing each step (not part of the plan)
  int rank = 0;                           ///< this rank, in [0, world_size)
  bool shuffle = true;                    ///< seeded sample order and batch order per epoch
  uint64_t seed = 0;                      ///< shared by every rank
  std::vector<DimPadding> pad{};          ///< padded dimensions; empty: exact-shape buckets
  std::optional<int64_t> max_samples{};   ///< samples per batch
  std::optional<int64_t> max_elements{};  ///< padded elements per batch
  int64_t multiple_of = 1;
  bool drop_incomplete = false;
  OversizePolicy on_oversize = OversizePolicy::raise;
  int64_t batches_per_step = 1;         ///< a step closes after this many batches (0 = rule off)
  int64_t samples_per_step = 0;         ///< ... or once it holds >= this many samples (0 = off)
  int64_t elements_per_step = 0;        ///< ... or >= this many padded elements (0 = off)
  Dealing dealing = Dealing::balanced;  ///< who runs which batch of a step (not part of the plan)
};

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

/// Where a world-size-free run stands: the configuration's identity and the next optimizer step.
///
/// Example: `loom::to_string(c)` -> "loom-global-cursor v1 seed=7 epoch=2 step=13 fingerprint=..."
/// Units: step counts optimizer steps committed in `epoch` (the next one to run).
struct GlobalCursor {
  uint64_t seed = 0;
  int64_t epoch = 0;
  int64_t step = 0;
  uint64_t fingerprint = 0;  ///< hash of the options that shape the plan, and of the shapes

  friend bool operator==(const GlobalCursor&, const GlobalCursor&) = default;
};

/// One line of text for a GlobalCursor (for a checkpoint file).
inline std::string to_string(const GlobalCursor& c) {
  return fmt::format("loom-global-cursor v1 seed={} epoch={} step={} fingerprint={}", c.seed, c.epoch, c.step,
                     c.fingerprint);
}

/// Parses the text of to_string(GlobalCursor) (a trailing newline allowed; the grammar is
/// detail::TextFields'). Throws loom::InvalidArgument quoting the text: malformed, or a negative
/// epoch or step.
inline GlobalCursor parse_global_cursor(std::string_view text) {
  detail::TextFields f(text, "loom-global-cursor v1", "global cursor");
  GlobalCursor c;
  c.seed = f.integer<uint64_t>("seed");
  c.epoch = f.integer<int64_t>("epoch");
  c.step = f.integer<int64_t>("step");
  c.fingerprint = f.integer<uint64_t>("fingerprint");
  f.finish();
  if (c.epoch < 0 || c.step < 0) throw f.fail(fmt::format("epoch {} and step {} must be >= 0", c.epoch, c.step));
  return c;
}

namespace detail {

inline BucketPlanner global_planner(const GlobalBatchOptions& o) {
  if (o.pad.empty())
    return BucketPlanner(ShapeBucketOptions{.max_samples = o.max_samples,
                                            .max_elements = o.max_elements,
                                            .multiple_of = o.multiple_of,
                                            .drop_incomplete = o.drop_incomplete,
                                            .on_oversize = o.on_oversize});
  return BucketPlanner(PaddedBucketOptions{.pad = o.pad,
                                           .max_samples = o.max_samples,
                                           .max_elements = o.max_elements,
                                           .multiple_of = o.multiple_of,
                                           .drop_incomplete = o.drop_incomplete,
                                           .on_oversize = o.on_oversize});
}

inline void check_step_rules(const GlobalBatchOptions& o) {
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
  f.add(static_cast<uint64_t>(o.max_samples.value_or(-1)));
  f.add(static_cast<uint64_t>(o.max_elements.value_or(-1)));
  f.add(static_cast<uint64_t>(o.multiple_of));
  f.add(o.drop_incomplete ? 1 : 0);
  f.add(static_cast<uint64_t>(o.on_oversize));
  f.add(static_cast<uint64_t>(o.batches_per_step));
  f.add(static_cast<uint64_t>(o.samples_per_step));
  f.add(static_cast<uint64_t>(o.elements_per_step));
  for (const DimPadding& p : o.pad) {
    f.add(static_cast<uint64_t>(p.dim));
    f.add(static_cast<uint64_t>(p.multiple));
    for (int64_t x : p.boundaries) f.add(static_cast<uint64_t>(x));
    f.add(~uint64_t{0});
  }
  for (const auto& s : shapes) {
    for (int64_t x : s) f.add(static_cast<uint64_t>(x));
    f.add(~uint64_t{0});
  }
  return f.h;
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
  const auto n = static_cast<int64_t>(shapes.size());
  std::vector<int64_t> order(static_cast<std::size_t>(n));
  at::Generator gen;
  if (o.shuffle) {
    gen = generator64(o.seed + static_cast<uint64_t>(epoch));
    const at::Tensor p = at::randperm(n, gen, at::TensorOptions(at::kLong));
    const auto* ptr = p.data_ptr<int64_t>();
    order.assign(ptr, ptr + n);
  } else {
    std::iota(order.begin(), order.end(), int64_t{0});
  }
  BucketPlanner planner = detail::global_planner(o);
  std::vector<PlannedBatch> planned;
  for (int64_t i : order) planner.add(i, shapes[static_cast<std::size_t>(i)], planned);
  planner.flush(planned);
  EpochPlan plan;
  plan.epoch = epoch;
  plan.stats = planner.stats();
  const auto b = static_cast<int64_t>(planned.size());
  if (o.shuffle && b > 0) {
    const at::Tensor p = at::randperm(b, gen, at::TensorOptions(at::kLong));  // the same generator, continued
    const auto* ptr = p.data_ptr<int64_t>();
    plan.batches.reserve(planned.size());
    for (int64_t j = 0; j < b; ++j) plan.batches.push_back(std::move(planned[static_cast<std::size_t>(ptr[j])]));
  } else {
    plan.batches = std::move(planned);
  }
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

/// World-size-invariant optimizer steps, dealt to this rank. Models ResumableSampler (same world
/// size) and resumes across world sizes through cursor() / resume().
///
/// Example: see the file comment.
/// Shape: items are SampledBatch: `step` is the global step, `step_end` marks this rank's last item
///        of the step, `idle` an item without samples (this rank has no batch in the step).
/// Throws: see the file comment.
/// Source: see the file comment.
class GlobalBatchSampler {
 public:
  using value_type = SampledBatch;
  using state_type = SamplerState;

  /// `shapes[i]` is the shape of dataset sample i (without the batch dimension).
  GlobalBatchSampler(std::vector<std::vector<int64_t>> shapes, GlobalBatchOptions o)
      : shapes_(std::move(shapes)), o_(std::move(o)) {
    if (shapes_.empty()) throw InvalidArgument("GlobalBatchSampler: no shapes (the dataset is empty)");
    if (o_.world_size < 1)
      throw InvalidArgument(fmt::format("GlobalBatchSampler: world_size = {} must be >= 1", o_.world_size));
    if (o_.rank < 0 || o_.rank >= o_.world_size)
      throw InvalidArgument(fmt::format("GlobalBatchSampler: rank {} is outside [0, {})", o_.rank, o_.world_size));
    detail::check_step_rules(o_);
    (void)detail::global_planner(o_);  // validates the batching options now
    fingerprint_ = detail::plan_fingerprint(shapes_, o_);
    set_epoch(0);
  }

  /// Takes the world size and rank from a communicator (overriding those in `o`).
  template <Communicator C>
  GlobalBatchSampler(const C& comm, std::vector<std::vector<int64_t>> shapes, GlobalBatchOptions o)
      : GlobalBatchSampler(std::move(shapes), with_comm(comm, std::move(o))) {}

  /// Selects the epoch and rewinds to its first step; right after resume(), keeps the resumed
  /// position when `epoch` is the cursor's.
  /// Throws: loom::InvalidArgument for a negative epoch, or another epoch than a pending resume's.
  void set_epoch(int64_t epoch) {
    if (epoch < 0) throw InvalidArgument(fmt::format("GlobalBatchSampler: epoch {} is negative", epoch));
    if (resume_pending_) {
      if (epoch != plan_.epoch)
        throw InvalidArgument(fmt::format(
            "GlobalBatchSampler::set_epoch({}): the sampler was resumed at epoch {}, step {} (resume(cursor)), so "
            "this loop would silently retrain or skip epochs; start the epoch loop at the cursor's epoch ({}; a "
            "cursor that names the end of an epoch resumes at the next one)",
            epoch, plan_.epoch, step_, plan_.epoch));
      resume_pending_ = false;
      return;
    }
    if (epoch != plan_.epoch || plan_.steps.empty()) {
      plan_ = plan_epoch(shapes_, o_, epoch);
      epoch_size_ = 0;
      for (std::size_t k = 0; k < plan_.steps.size(); ++k)
        epoch_size_ += std::max<int64_t>(1, static_cast<int64_t>(mine(static_cast<int64_t>(k)).size()));
    }
    position_ = 0;
    seek(0);
  }

  /// Items this rank yields in the epoch (its batches, plus one idle item per step without one).
  [[nodiscard]] int64_t size() const noexcept { return epoch_size_; }
  /// Optimizer steps of the epoch, equal on every rank and for every world size.
  [[nodiscard]] int64_t num_steps() const noexcept { return static_cast<int64_t>(plan_.steps.size()); }
  [[nodiscard]] int64_t epoch() const noexcept { return plan_.epoch; }
  [[nodiscard]] const EpochPlan& plan() const noexcept { return plan_; }
  [[nodiscard]] const GlobalBatchOptions& options() const noexcept { return o_; }

  /// Batch positions (into plan().batches) that `rank` runs in step `step`, in plan order.
  [[nodiscard]] std::vector<int64_t> assignment(int64_t step, int rank) const {
    if (step < 0 || step >= num_steps())
      throw InvalidArgument(
          fmt::format("GlobalBatchSampler::assignment: step {} is outside [0, {})", step, num_steps()));
    if (rank < 0 || rank >= o_.world_size)
      throw InvalidArgument(
          fmt::format("GlobalBatchSampler::assignment: rank {} is outside [0, {})", rank, o_.world_size));
    return dealt(step)[static_cast<std::size_t>(rank)];
  }

  /// This rank's next item, or nullopt at the end of the epoch.
  std::optional<SampledBatch> next() {
    resume_pending_ = false;
    if (step_ >= num_steps()) return std::nullopt;
    SampledBatch s;
    s.step = step_;
    if (current_.empty()) {
      s.weight = 0.0;
      s.idle = true;
      s.step_end = true;
    } else {
      const int64_t id = current_[static_cast<std::size_t>(within_)];
      const PlannedBatch& p = plan_.batches[static_cast<std::size_t>(id)];
      s.indices = p.indices;
      s.padded_shape = p.padded_shape;
      s.batch_id = id;
      s.step_end = within_ + 1 == static_cast<int64_t>(current_.size());
    }
    ++position_;
    if (s.step_end)
      seek(step_ + 1);
    else
      ++within_;
    return s;
  }

  /// The first step not yet finished by this rank, as a world-size-free cursor. Taken right after a
  /// step's last item (a step boundary) it is the next step to run; mid-step it is the current one
  /// (resuming reruns the whole step, which was never applied); after the epoch's last step it is
  /// step 0 of the next epoch.
  [[nodiscard]] GlobalCursor cursor() const {
    if (step_ >= num_steps()) return {o_.seed, plan_.epoch + 1, 0, fingerprint_};
    return {o_.seed, plan_.epoch, step_, fingerprint_};
  }

  /// Continues at `c.step` of `c.epoch` on this sampler's world size (step = that epoch's number of
  /// steps means the next epoch's step 0). The next set_epoch() keeps this position if it names the
  /// epoch resumed at (see the file comment).
  /// Throws: loom::InvalidArgument when `c` came from another seed, options or shapes, or its step
  ///         is outside [0, steps of that epoch].
  void resume(const GlobalCursor& c) {
    resume_pending_ = false;
    if (c.seed != o_.seed)
      throw InvalidArgument(
          fmt::format("GlobalBatchSampler::resume: the cursor has seed {}, this sampler {}", c.seed, o_.seed));
    if (c.fingerprint != fingerprint_)
      throw InvalidArgument(
          fmt::format("GlobalBatchSampler::resume: the cursor's fingerprint {} differs from this sampler's {} "
                      "(other options or shapes)",
                      c.fingerprint, fingerprint_));
    set_epoch(c.epoch);
    if (c.step < 0 || c.step > num_steps())
      throw InvalidArgument(fmt::format("GlobalBatchSampler::resume: step {} is outside [0, {}] for epoch {}", c.step,
                                        num_steps(), c.epoch));
    if (c.step == num_steps()) {
      set_epoch(c.epoch + 1);
    } else {
      position_ = items_before(c.step);
      seek(c.step);
    }
    resume_pending_ = true;
  }

  /// The shapes the plan was made from (`shapes()[i]`: dataset sample i's shape).
  [[nodiscard]] const std::vector<std::vector<int64_t>>& shapes() const noexcept { return shapes_; }

  /// Position for ResumableSampler (same world size and rank; exact to the item).
  [[nodiscard]] SamplerState state() const {
    SamplerState s = identity();
    s.epoch = plan_.epoch;
    s.position = position_;
    return s;
  }

  /// Resumes at the saved epoch and item. Throws loom::InvalidArgument for a state of another
  /// configuration (world size and rank included: use resume(cursor) to change them).
  void load_state(const SamplerState& st) {
    resume_pending_ = false;
    SamplerState config_only = st;
    config_only.position = 0;
    detail::check_state_matches(config_only, identity(), 0, "GlobalBatchSampler");
    set_epoch(st.epoch);
    detail::check_state_matches(st, identity(), epoch_size_, "GlobalBatchSampler");
    while (position_ < st.position) (void)next();
  }

 private:
  static GlobalBatchOptions with_comm(const auto& comm, GlobalBatchOptions o) {
    o.world_size = comm.world_size();
    o.rank = comm.rank();
    return o;
  }

  std::vector<std::vector<int64_t>> dealt(int64_t step) const {
    const GlobalStep& g = plan_.steps[static_cast<std::size_t>(step)];
    std::vector<int64_t> costs;
    costs.reserve(static_cast<std::size_t>(g.num_batches));
    for (int64_t j = 0; j < g.num_batches; ++j)
      costs.push_back(plan_.batches[static_cast<std::size_t>(g.first_batch + j)].padded_elements);
    auto out = deal(costs, o_.world_size, o_.dealing);
    for (auto& v : out)
      for (auto& j : v) j += g.first_batch;
    return out;
  }

  std::vector<int64_t> mine(int64_t step) const { return dealt(step)[static_cast<std::size_t>(o_.rank)]; }

  // Moves to the start of `step` (num_steps() = the end of the epoch); position_ is the caller's.
  void seek(int64_t step) {
    step_ = step;
    within_ = 0;
    current_ = step < num_steps() ? mine(step) : std::vector<int64_t>{};
  }

  int64_t items_before(int64_t step) const {
    int64_t items = 0;
    for (int64_t k = 0; k < step; ++k) items += std::max<int64_t>(1, static_cast<int64_t>(mine(k).size()));
    return items;
  }

  SamplerState identity() const {
    SamplerState s;
    s.seed = o_.seed;
    s.dataset_size = static_cast<int64_t>(shapes_.size());
    s.num_replicas = o_.world_size;
    s.rank = o_.rank;
    s.fingerprint = fingerprint_;
    return s;
  }

  std::vector<std::vector<int64_t>> shapes_;
  GlobalBatchOptions o_;
  uint64_t fingerprint_ = 0;
  EpochPlan plan_{.epoch = -1};
  int64_t epoch_size_ = 0;
  int64_t step_ = 0;              // current global step
  int64_t within_ = 0;            // index into current_
  int64_t position_ = 0;          // items yielded this epoch
  std::vector<int64_t> current_;  // this rank's batch positions in step_
  bool resume_pending_ = false;   // resume() ran and no set_epoch() / next() since
};

static_assert(ResumableSampler<GlobalBatchSampler>);

/// Checks that every rank's sampler plans the same steps: seed, epoch, next step, fingerprint
/// (options and shapes, in order), dealing and world size, compared with rank 0's in one all_gather
/// of 7 int64 values on comm.device(). Call it on every rank at the same point (loom::Trainer::epoch
/// does, once per epoch). A rank whose preparation of the epoch failed passes its error as
/// `local_error`: it still takes part, then rethrows it, and every other rank throws naming it.
///
/// Example: `sampler.set_epoch(e); loom::check_same_plan(comm, sampler, "my loop");`
/// Throws: `local_error` on the rank that passed it, loom::InvalidArgument naming that rank on the
///         others; loom::InvalidArgument on every rank when a rank differs, naming the first such rank,
///         what differs and both values (a seed taken from the rank, shapes listed in another
///         order, other batching options would each make ranks train some samples twice and others
///         never); the communicator's errors.
template <Communicator C>
void check_same_plan(C& comm, const GlobalBatchSampler& sampler, std::string_view where,
                     std::exception_ptr local_error = nullptr) {
  const GlobalCursor c = sampler.cursor();
  const GlobalBatchOptions& o = sampler.options();
  // The position check uses the step the sampler stands at (cursor() maps an epoch's end forward).
  const int64_t mine[7] = {static_cast<int64_t>(c.seed),
                           sampler.epoch(),
                           c.epoch == sampler.epoch() ? c.step : sampler.num_steps(),
                           static_cast<int64_t>(c.fingerprint),
                           static_cast<int64_t>(o.dealing),
                           static_cast<int64_t>(o.world_size),
                           local_error ? 1 : 0};
  at::Tensor local = at::empty({7}, at::TensorOptions(at::kLong));
  std::copy(mine, mine + 7, local.data_ptr<int64_t>());
  local = local.to(comm.device());
  const std::vector<at::Tensor> all = comm.all_gather(local);
  if (local_error) std::rethrow_exception(local_error);
  for (std::size_t r = 0; r < all.size(); ++r)
    if (all[r].to(at::kCPU).data_ptr<int64_t>()[6] != 0)
      throw InvalidArgument(fmt::format(
          "{}: rank {} could not prepare the epoch (its own error says why), so every rank stops here", where, r));
  static constexpr const char* kNames[6] = {"seed",    "epoch",     "step", "fingerprint (options and shapes)",
                                            "dealing", "world size"};
  const at::Tensor first = all[0].to(at::kCPU);
  for (std::size_t r = 1; r < all.size(); ++r) {
    const at::Tensor other = all[r].to(at::kCPU);
    for (int64_t k = 0; k < 6; ++k) {
      const int64_t a = first.data_ptr<int64_t>()[k], b = other.data_ptr<int64_t>()[k];
      if (a == b) continue;
      const bool unsigned_value = k == 0 || k == 3;
      throw InvalidArgument(fmt::format(
          "{}: the ranks plan different steps: rank {} has {} {}, rank 0 has {} {} (every rank must build its "
          "sampler or loader with the same seed, options and shapes in the same order, and start the same epoch "
          "and step; otherwise some samples are trained twice and others never)",
          where, r, kNames[k], unsigned_value ? fmt::format("{}", static_cast<uint64_t>(b)) : fmt::format("{}", b),
          kNames[k], unsigned_value ? fmt::format("{}", static_cast<uint64_t>(a)) : fmt::format("{}", a)));
    }
  }
}

}  // namespace loom
