// loom/log/rank.hpp — who this process is (RankInfo), which ranks write log lines (the
// RankPolicy concept and its models), and which rank leads (Leader: main-process-first blocks and
// the progress bar).
//
// Example:
//   loom::RankInfo me{.rank = 2, .world_size = 4, .local_rank = 0, .local_world_size = 2};
//   loom::is_leader(me, loom::Leader::global_rank_zero);  // false
//   loom::is_leader(me, loom::Leader::local_rank_zero);   // true: first rank of the second node
//   loom::AllRanks{}.prefix(me);                          // "[rank 2/4] "
//
// Policies (each models RankPolicy):
//   RankZero       only global rank 0 writes, no prefix                       (the default)
//   LocalRankZero  local rank 0 of every node writes, "[rank r/w] " prefix
//   AllRanks       every rank writes, "[rank r/w] " prefix (`.with_prefix = false`: one file per rank)
//   RankOrdered    every rank's lines, printed by rank 0 in rank order at Logger::sync (a collective)
//
// Guide: docs/log.md#rank-policies-rankpolicy.
// Source: "rank 0 logs" and "local rank 0 per node" follow torch.distributed / Accelerate's
// `is_main_process` / `is_local_main_process`; the "[rank r/w]" prefix is loom's own.
#pragma once

#include <concepts>
#include <string>

#include <fmt/format.h>

#include <loom/error.hpp>

namespace loom {

/// This process's place in the job: global rank and size, rank and size within its node.
///
/// Example: torchrun --nnodes 2 --nproc-per-node 2, second process of the second node:
///   RankInfo{.rank = 3, .world_size = 4, .local_rank = 1, .local_world_size = 2}
/// Units: counts of processes. A single process is the default value {0, 1, 0, 1}.
/// Source: the fields are torchrun's RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE.
struct RankInfo {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;

  /// Throws loom::InvalidArgument naming the field and value when a field is out of range
  /// (world_size < 1, rank outside [0, world_size), local_rank outside [0, local_world_size),
  /// local_world_size > world_size).
  void validate() const {
    if (world_size < 1) throw InvalidArgument(fmt::format("RankInfo: world_size {} is < 1", world_size));
    if (rank < 0 || rank >= world_size)
      throw InvalidArgument(fmt::format("RankInfo: rank {} is outside [0, {})", rank, world_size));
    if (local_world_size < 1 || local_world_size > world_size)
      throw InvalidArgument(
          fmt::format("RankInfo: local_world_size {} is outside [1, {}]", local_world_size, world_size));
    if (local_rank < 0 || local_rank >= local_world_size)
      throw InvalidArgument(fmt::format("RankInfo: local_rank {} is outside [0, {})", local_rank, local_world_size));
  }

  friend bool operator==(const RankInfo&, const RankInfo&) = default;
};

/// RankInfo from anything with int-convertible members rank, world_size, local_rank,
/// local_world_size (loom::Environment, a user's own struct). Validated.
///
/// Example:  auto me = loom::rank_info(loom::Environment::from_env());
/// Throws: loom::InvalidArgument as RankInfo::validate.
template <class E>
requires requires(const E& e) {
  { e.rank } -> std::convertible_to<int>;
  { e.world_size } -> std::convertible_to<int>;
  { e.local_rank } -> std::convertible_to<int>;
  { e.local_world_size } -> std::convertible_to<int>;
}
[[nodiscard]] RankInfo rank_info(const E& e) {
  RankInfo r{.rank = static_cast<int>(e.rank),
             .world_size = static_cast<int>(e.world_size),
             .local_rank = static_cast<int>(e.local_rank),
             .local_world_size = static_cast<int>(e.local_world_size)};
  r.validate();
  return r;
}

/// RankInfo of a process group that knows its job (loom::ProcessGroup: `g.environment()`).
///
/// Example:  auto me = loom::rank_info(pg);
template <class G>
requires requires(const G& g) {
  rank_info(g.environment());
}
[[nodiscard]] RankInfo rank_info(const G& g) {
  return rank_info(g.environment());
}

/// Which rank leads: runs a main-process-first block first, shows the progress bar.
enum class Leader {
  global_rank_zero,  ///< one leader for the job: global rank 0
  local_rank_zero,   ///< one leader per node: every process with local rank 0
};

/// True when `me` is a leader under `leader` (global: rank 0; local: local rank 0).
///
/// Example: 2 nodes x 2 ranks, Leader::local_rank_zero -> true on global ranks 0 and 2.
[[nodiscard]] constexpr bool is_leader(const RankInfo& me, Leader leader) noexcept {
  return leader == Leader::global_rank_zero ? me.rank == 0 : me.local_rank == 0;
}

/// Decides whether this rank writes log lines and what precedes each line.
///
/// Requirements:
///  1. `p.emits(me)` -> bool, a pure function of `me`. Reason: the logger decides once, at
///     construction, so a silent rank pays one branch per call and formats nothing.
///  2. `p.prefix(me)` -> std::string, put before every line (may be empty). Reason: lines from
///     several ranks in one terminal must say where they come from.
/// Not required: any communication (policies are local decisions; the only collective policy,
/// RankOrdered, opts in with the tag `ordered_tag` and is handled by Logger::sync).
template <class P>
concept RankPolicy = requires(const P& p, const RankInfo& me) {
  { p.emits(me) } -> std::convertible_to<bool>;
  { p.prefix(me) } -> std::convertible_to<std::string>;
};

/// A RankPolicy whose lines are buffered on every rank and printed in rank order by rank 0 when
/// all ranks call Logger::sync (a collective). Opt-in tag: `using ordered_tag = void;`.
template <class P>
concept OrderedRankPolicy = RankPolicy<P> && requires {
  typename P::ordered_tag;
};

namespace detail {
inline std::string rank_prefix(const RankInfo& me) {
  return fmt::format("[rank {}/{}] ", me.rank, me.world_size);
}
}  // namespace detail

/// Only global rank 0 writes; no prefix. The default policy.
struct RankZero {
  [[nodiscard]] constexpr bool emits(const RankInfo& me) const noexcept { return me.rank == 0; }
  [[nodiscard]] std::string prefix(const RankInfo& /*me*/) const { return {}; }
};

/// Local rank 0 of every node writes, with a "[rank r/w] " prefix (the global rank).
struct LocalRankZero {
  [[nodiscard]] constexpr bool emits(const RankInfo& me) const noexcept { return me.local_rank == 0; }
  [[nodiscard]] std::string prefix(const RankInfo& me) const { return detail::rank_prefix(me); }
};

/// Every rank writes at once, each line prefixed with "[rank r/w] " unless `with_prefix` is false
/// (use `.with_prefix = false` with FileSink::per_rank: one file per rank says the rank already).
struct AllRanks {
  bool with_prefix = true;
  [[nodiscard]] constexpr bool emits(const RankInfo& /*me*/) const noexcept { return true; }
  [[nodiscard]] std::string prefix(const RankInfo& me) const {
    return with_prefix ? detail::rank_prefix(me) : std::string{};
  }
};

/// Every rank's lines, "[rank r/w] "-prefixed, printed by rank 0 in rank order: all of rank 0's
/// lines since the last sync, then rank 1's, ... Lines are buffered until every rank calls
/// Logger::sync(comm) at the same point (a collective; for debugging, not for hot loops).
struct RankOrdered {
  using ordered_tag = void;
  [[nodiscard]] constexpr bool emits(const RankInfo& /*me*/) const noexcept { return true; }
  [[nodiscard]] std::string prefix(const RankInfo& me) const { return detail::rank_prefix(me); }
};

static_assert(RankPolicy<RankZero> && RankPolicy<LocalRankZero> && RankPolicy<AllRanks>);
static_assert(OrderedRankPolicy<RankOrdered> && !OrderedRankPolicy<AllRanks>);

}  // namespace loom
