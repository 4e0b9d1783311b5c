// loom/sample/concepts.hpp — the Sampler concept ladder and the state a resumable sampler saves.
//
// A sampler decides which items (dataset indices, or whole batches of indices) this rank takes in
// an epoch, in which order. It is pulled one item at a time, so its position inside the epoch is
// part of its state and a checkpoint taken mid-epoch resumes at exactly the next item.
//
// Example:
//   loom::DistributedSampler s({.dataset_size = 10, .num_replicas = 3, .rank = 1, .shuffle = false});
//   s.set_epoch(0);
//   while (auto i = s.next()) use(*i);                 // 1, 4, 7, 0
//   loom::SamplerState st = s.state();                 // save with the model checkpoint
//   std::string line = loom::to_string(st);            // "loom-sampler v1 seed=0 epoch=0 ..."
//
// Concept ladder (each rung adds one capability):
//   Sampler            value_type, set_epoch(e), size(), next() -> optional<value_type>
//   ResumableSampler   + state() / load_state(state): resume mid-epoch to the same sequence
//
// Models (each checked by a static_assert next to it): DistributedSampler (distributed.hpp),
// DistributedBucketBatchSampler (bucket_batch.hpp), GlobalBatchSampler (global_batch.hpp).
#pragma once

#include <concepts>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include <fmt/format.h>

#include <loom/detail/hash.hpp>
#include <loom/detail/text_fields.hpp>
#include <loom/error.hpp>

namespace loom {

/// A per-epoch source of items (indices or batches) for one rank.
///
/// Requirements:
///  1. `typename S::value_type`: what one step yields (int64_t index, a batch of indices, ...).
///     Reason: consumers (loops, schedulers) are written against the item type.
///  2. `s.set_epoch(e)` with an int64 epoch: selects the epoch's order (shuffle seed + e) and
///     rewinds to its start. Reason: every rank must agree on the order of an epoch without
///     talking, and a new epoch must reshuffle (as torch's DistributedSampler.set_epoch).
///  3. `s.size()`: items this rank yields in the current epoch. Reason: a loop needs its step
///     count up front, and for distributed samplers it is equal on every rank (no rank waits).
///  4. `s.next()` returns std::optional<value_type>: the next item, or nullopt at the end of the
///     epoch. Reason: a pull interface makes the position explicit, which resuming needs.
/// Not required: iterating twice, random access, copying, thread safety (one thread pulls).
/// Stronger: ResumableSampler.
template <class S>
concept Sampler = requires(S& s, const S& cs, int64_t epoch) {
  typename S::value_type;
  s.set_epoch(epoch);
  { cs.size() } -> std::convertible_to<int64_t>;
  { s.next() } -> std::same_as<std::optional<typename S::value_type>>;
};

/// A Sampler whose position can be saved and restored.
///
/// Requirements (in addition to Sampler):
///  1. `typename S::state_type`, returned by `cs.state()`: a value describing epoch and position.
///     Reason: checkpoints store it next to the model.
///  2. `s.load_state(st)`: afterwards `next()` yields exactly what the sampler that produced `st`
///     would have yielded next. Reason: a resumed run must see the same samples, no more, no fewer.
///  3. load_state throws loom::InvalidArgument when `st` came from a differently configured
///     sampler (other dataset size, world size, rank, seed or options). Reason: a silent mismatch
///     would repeat or skip samples.
/// Not required: a particular state type (SamplerState is what loom's samplers use).
template <class S>
concept ResumableSampler = Sampler<S> && requires(S& s, const S& cs, const typename S::state_type& st) {
  typename S::state_type;
  { cs.state() } -> std::convertible_to<typename S::state_type>;
  s.load_state(st);
};

/// Where a loom sampler stands: its configuration's identity and its position in an epoch.
///
/// Example: `loom::SamplerState{.seed = 0, .epoch = 3, .position = 17, ...}`;
///          `loom::parse_sampler_state(loom::to_string(st)) == st`.
/// Units: position in items (indices for DistributedSampler, steps for the bucket batch sampler).
struct SamplerState {
  uint64_t seed = 0;         ///< shuffle seed
  int64_t epoch = 0;         ///< epoch set by set_epoch
  int64_t position = 0;      ///< items already yielded in this epoch
  int64_t dataset_size = 0;  ///< samples in the dataset
  int num_replicas = 1;      ///< world size
  int rank = 0;              ///< this rank
  uint64_t fingerprint = 0;  ///< hash of the remaining configuration (options, shapes)

  friend bool operator==(const SamplerState&, const SamplerState&) = default;
};

/// One line of text for a SamplerState, e.g. for a checkpoint file.
///
/// Example: `loom::to_string(st)` -> "loom-sampler v1 seed=0 epoch=3 position=17 dataset_size=10 num_replicas=3 rank=1 fingerprint=42"
inline std::string to_string(const SamplerState& s) {
  return fmt::format(
      "loom-sampler v1 seed={} epoch={} position={} dataset_size={} num_replicas={} rank={} fingerprint={}", s.seed,
      s.epoch, s.position, s.dataset_size, s.num_replicas, s.rank, s.fingerprint);
}

/// Parses the text of to_string() (a trailing newline allowed; the grammar is detail::TextFields').
/// Throws loom::InvalidArgument quoting the text: malformed, or values no sampler has (a negative
/// epoch, position or dataset size; num_replicas < 1; rank outside [0, num_replicas)).
inline SamplerState parse_sampler_state(std::string_view text) {
  detail::TextFields f(text, "loom-sampler v1", "sampler state");
  SamplerState s;
  s.seed = f.integer<uint64_t>("seed");
  s.epoch = f.integer<int64_t>("epoch");
  s.position = f.integer<int64_t>("position");
  s.dataset_size = f.integer<int64_t>("dataset_size");
  s.num_replicas = f.integer<int>("num_replicas");
  s.rank = f.integer<int>("rank");
  s.fingerprint = f.integer<uint64_t>("fingerprint");
  f.finish();
  if (s.epoch < 0 || s.position < 0 || s.dataset_size < 0)
    throw f.fail(
        fmt::format("epoch {}, position {} and dataset_size {} must be >= 0", s.epoch, s.position, s.dataset_size));
  if (s.num_replicas < 1 || s.rank < 0 || s.rank >= s.num_replicas)
    throw f.fail(fmt::format("rank {} of num_replicas {} (need num_replicas >= 1 and 0 <= rank < num_replicas)", s.rank,
                             s.num_replicas));
  return s;
}

namespace detail {
/// Configuration fingerprints of the samplers: loom's one hash (detail::Fnv1a).
using Fingerprint = Fnv1a;

/// Throws unless `st` matches the sampler's own configuration `own` (all but epoch and position).
inline void check_state_matches(const SamplerState& st, const SamplerState& own, int64_t epoch_size,
                                std::string_view sampler) {
  auto mismatch = [&](std::string_view what, auto saved, auto mine) {
    return InvalidArgument(fmt::format("{}: cannot load a state saved with {} = {} into a sampler with {} = {}",
                                       sampler, what, saved, what, mine));
  };
  if (st.dataset_size != own.dataset_size) throw mismatch("dataset_size", st.dataset_size, own.dataset_size);
  if (st.num_replicas != own.num_replicas) throw mismatch("num_replicas", st.num_replicas, own.num_replicas);
  if (st.rank != own.rank) throw mismatch("rank", st.rank, own.rank);
  if (st.seed != own.seed) throw mismatch("seed", st.seed, own.seed);
  if (st.fingerprint != own.fingerprint)
    throw mismatch("fingerprint (options or shapes)", st.fingerprint, own.fingerprint);
  if (st.epoch < 0) throw InvalidArgument(fmt::format("{}: saved epoch {} is negative", sampler, st.epoch));
  if (st.position < 0 || st.position > epoch_size)
    throw InvalidArgument(fmt::format("{}: saved position {} is outside [0, {}] for epoch {}", sampler, st.position,
                                      epoch_size, st.epoch));
}
}  // namespace detail

}  // namespace loom
