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
// The plan and the dealing (world-size free; loom/sample/global_plan.hpp): samples in a seeded
//   order grouped into shape-bucketed batches by the collators' rules, the batches (shuffled) grouped
//   into optimizer steps by batches_per_step / samples_per_step / elements_per_step; each step's
//   batches dealt to the ranks by padded elements (Dealing::balanced, longest first) or round robin.
//   A rank that receives no batch of a step yields one item with `idle` set (no samples, weight 0):
//   it joins the step's synchronisation with zero gradients and zero samples. No batch is repeated
//   and none carries weight 0 otherwise, so the step's gradient, divided by its global sample count
//   (ReducerOptions::average = samples), is the same on any world size up to summation order.
// Resume: cursor() = (seed, epoch, next step, fingerprint of the options and shapes), a few integers
//   that do not mention the world size; resume(cursor) on any world size continues at that step. A
//   cursor taken after an epoch's last step is the next epoch's step 0. After resume(), until the
//   first next(), set_epoch() must name the cursor's epoch and keeps the resumed position, however
//   often it is called (a loop that calls set_epoch(e) at the top of each epoch, as with torch's
//   DistributedSampler, before Trainer::epoch(loader, e) calls it again, resumes as meant);
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
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <ATen/ops/empty.h>
#include <fmt/format.h>

#include <loom/collate/options.hpp>
#include <loom/collate/planner.hpp>
#include <loom/comm/communicator.hpp>
#include <loom/comm/host_values.hpp>
#include <loom/detail/text_fields.hpp>
#include <loom/error.hpp>
#include <loom/sample/concepts.hpp>
#include <loom/sample/global_plan.hpp>
#include <loom/sample/sample_seed.hpp>
#include <loom/sample/sampled_batch.hpp>

namespace loom {

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
    (void)BucketPlanner(batch_rules(o_));  // validates the batching options now
    fingerprint_ = detail::plan_fingerprint(shapes_, o_);
    set_epoch(0);
  }

  /// Takes the world size and rank from a communicator (`o`'s are left at their defaults, 1 and 0,
  /// or equal the communicator's).
  /// Throws: as above; loom::InvalidArgument when `o` sets another world size or rank than `comm`'s.
  template <Communicator C>
  GlobalBatchSampler(const C& comm, std::vector<std::vector<int64_t>> shapes, GlobalBatchOptions o)
      : GlobalBatchSampler(std::move(shapes), with_comm(comm, std::move(o))) {}

  /// Selects the epoch and rewinds to its first step; after resume() and before the first next(),
  /// keeps the resumed position when `epoch` is the cursor's (each time it is called).
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
      return;  // the resume stays pending until next(): set_epoch(e) before Trainer::epoch(loader, e) keeps it
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
  /// Whether this rank is inside its epoch: it has yielded items of it, and not yet its last one
  /// (a training loop runs over it), with no resume pending.
  [[nodiscard]] bool in_epoch() const noexcept { return !resume_pending_ && position_ > 0 && step_ < num_steps(); }
  /// Whether resume() ran and no next() since (the next set_epoch must name the cursor's epoch).
  [[nodiscard]] bool resume_pending() const noexcept { return resume_pending_; }
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
    s.step_samples = plan_.steps[static_cast<std::size_t>(step_)].num_samples;
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

  /// Throws what resume(c) would throw, and changes nothing (load_checkpoint checks a cursor before
  /// it changes anything). Plans epoch c.epoch when the sampler stands in another one.
  void check_resume(const GlobalCursor& c) const {
    if (c.seed != o_.seed)
      throw InvalidArgument(
          fmt::format("GlobalBatchSampler::resume: the cursor has seed {}, this sampler {}", c.seed, o_.seed));
    if (c.fingerprint != fingerprint_)
      throw InvalidArgument(
          fmt::format("GlobalBatchSampler::resume: the cursor's fingerprint {} differs from this sampler's {} "
                      "(other options or shapes)",
                      c.fingerprint, fingerprint_));
    if (c.epoch < 0) throw InvalidArgument(fmt::format("GlobalBatchSampler: epoch {} is negative", c.epoch));
    const int64_t steps = c.epoch == plan_.epoch && !plan_.steps.empty()
                              ? num_steps()
                              : static_cast<int64_t>(plan_epoch(shapes_, o_, c.epoch).steps.size());
    if (c.step < 0 || c.step > steps)
      throw InvalidArgument(
          fmt::format("GlobalBatchSampler::resume: step {} is outside [0, {}] for epoch {}", c.step, steps, c.epoch));
  }

  /// Continues at `c.step` of `c.epoch` on this sampler's world size (step = that epoch's number of
  /// steps means the next epoch's step 0). Until the next next(), set_epoch() keeps this position
  /// if it names the epoch resumed at (see the file comment).
  /// Throws: loom::InvalidArgument when `c` came from another seed, options or shapes, or its step
  ///         is outside [0, steps of that epoch]; the sampler is then unchanged.
  void resume(const GlobalCursor& c) {
    check_resume(c);
    resume_pending_ = false;
    set_epoch(c.epoch);
    if (c.step == num_steps()) {
      set_epoch(c.epoch + 1);
    } else {
      position_ = items_before(c.step);
      seek(c.step);
    }
    resume_pending_ = true;
  }

  /// Deals epoch `epoch` from step `step` on (`step` = num_steps(): the epoch's end, where next()
  /// gives nullopt) over `world_size` ranks, as rank `rank`; the plan stays the same. How the
  /// survivors of a rank's death re-deal the step it died in (loom::Trainer with an elastic
  /// ProcessGroup, docs/elastic.md).
  /// Example: `sampler.reshard(0, 2, 1, 7);`  // rank 0 of 2 from step 7 of epoch 1
  /// Throws: loom::InvalidArgument for a rank outside [0, world_size), a negative epoch or a step
  ///         outside [0, steps of that epoch]; the sampler is then unchanged.
  void reshard(int rank, int world_size, int64_t epoch, int64_t step) {
    if (world_size < 1 || rank < 0 || rank >= world_size)
      throw InvalidArgument(
          fmt::format("GlobalBatchSampler::reshard: rank {} is outside [0, world size {})", rank, world_size));
    if (epoch < 0) throw InvalidArgument(fmt::format("GlobalBatchSampler::reshard: epoch {} is negative", epoch));
    const int64_t steps = epoch == plan_.epoch && !plan_.steps.empty()
                              ? num_steps()
                              : static_cast<int64_t>(plan_epoch(shapes_, o_, epoch).steps.size());
    if (step < 0 || step > steps)
      throw InvalidArgument(
          fmt::format("GlobalBatchSampler::reshard: step {} is outside [0, {}] for epoch {}", step, steps, epoch));
    o_.world_size = world_size;
    o_.rank = rank;
    resume_pending_ = false;
    if (epoch != plan_.epoch) plan_ = plan_epoch(shapes_, o_, epoch);
    epoch_size_ = 0;
    for (std::size_t k = 0; k < plan_.steps.size(); ++k)
      epoch_size_ += std::max<int64_t>(1, static_cast<int64_t>(mine(static_cast<int64_t>(k)).size()));
    position_ = items_before(step);
    seek(step);
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
    if ((o.world_size != 1 && o.world_size != comm.world_size()) || (o.rank != 0 && o.rank != comm.rank()))
      throw InvalidArgument(fmt::format(
          "GlobalBatchSampler: the options say world_size = {}, rank = {}, but the communicator (process group) has "
          "world size {} and this is rank {}; leave world_size and rank unset when a communicator is given",
          o.world_size, o.rank, comm.world_size(), comm.rank()));
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
  bool resume_pending_ = false;   // resume() ran and no next() since
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
  const auto all = detail::all_gather_int64(comm, std::span<const std::int64_t>(mine, 7));
  if (local_error) std::rethrow_exception(local_error);
  for (std::size_t r = 0; r < all.size(); ++r)
    if (all[r][6] != 0)
      throw InvalidArgument(fmt::format(
          "{}: rank {} could not prepare the epoch (its own error says why), so every rank stops here", where, r));
  static constexpr const char* kNames[6] = {"seed",    "epoch",     "step", "fingerprint (options and shapes)",
                                            "dealing", "world size"};
  for (std::size_t r = 1; r < all.size(); ++r) {
    for (std::size_t k = 0; k < 6; ++k) {
      const int64_t a = all[0][k], b = all[r][k];
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
