// loom/log/main_process_first.hpp — run a block on the leader rank(s) first, then on the others:
// the usual way to let one process download, unpack or cache data while the others wait, and
// then read the prepared files.
//
// Example:
//   auto me = loom::rank_info(loom::Environment::from_env());
//   auto n = loom::main_process_first(comm, me, [&] { return prepare_cache(dir); });  // rank 0, then the rest
//   loom::main_process_first(comm, me, [&] { unpack(dir); }, loom::Leader::local_rank_zero);  // per node
//
// Protocol: a collective (every rank, same point); a block that throws on any rank reaches every
// rank, and nobody runs the block twice or hangs. Cost: two all_reduces of one float64.
// Units: the waiting ranks wait at most comm.timeout() for the leaders' block.
// Guide: docs/log.md#main_process_first.
// Source: the pattern of Accelerate's `main_process_first()` / torch's
//         `torch_distributed_zero_first`, with the failure path made explicit instead of a hang.
#pragma once

#include <exception>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include <loom/comm/communicator.hpp>
#include <loom/comm/host_values.hpp>
#include <loom/error.hpp>
#include <loom/log/rank.hpp>
#include <loom/trace/recorder.hpp>

namespace loom {

namespace detail {

/// Runs `block` and stores its result (if any); returns the exception it threw, or null.
template <class F, class Result>
std::exception_ptr run_capturing(F& block, Result& result) {
  try {
    if constexpr (std::is_void_v<std::invoke_result_t<F&>>) {
      std::invoke(block);
    } else {
      result.emplace(std::invoke(block));
    }
    return nullptr;
  } catch (...) {
    return std::current_exception();
  }
}

inline std::string failure_text(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& ex) {
    const std::string what = ex.what();
    return what.empty() ? std::string("(an exception with an empty message)") : what;
  } catch (...) {
    return "(an exception not derived from std::exception)";
  }
}

/// One phase's status exchange: every rank learns whether any rank failed, and if so which and why.
/// Returns "" when no rank failed, else a description of every failure. Collective.
template <Communicator C>
std::string exchange_failures(C& comm, const std::exception_ptr& mine) {
  const double flag = mine ? 1.0 : 0.0;
  trace::Scope scope(comm, trace::Context::main_process_first);
  const double failed = all_reduce_sums(comm, std::span<const double>(&flag, 1))[0];
  if (failed == 0.0) return {};
  const std::vector<std::string> messages = all_gather_strings(comm, mine ? failure_text(mine) : std::string{});
  std::string out;
  for (std::size_t r = 0; r < messages.size(); ++r) {
    if (messages[r].empty()) continue;
    out += fmt::format("{}rank {}: {}", out.empty() ? "" : "; ", r, messages[r]);
  }
  // A failed rank whose message was empty still counted in the flag.
  return out.empty() ? fmt::format("{} rank(s) failed", failed) : out;
}

}  // namespace detail

/// Runs `block` on the leader rank(s) first (global rank 0, or local rank 0 of every node), then on
/// every other rank; returns the block's result on every rank. A collective.
///
/// Example:
///   loom::main_process_first(comm, me, [&] { build_index(dir); });
///   // rank 0 builds the index; ranks 1..n-1 start their build_index only after rank 0's returned
///
/// Throws: the block's own exception on the rank where it was thrown; loom::RemoteError on the
///         others, naming the failed rank(s) and their messages; loom::InvalidArgument when `me`
///         does not match the communicator (rank, world size); what the communicator throws
///         (loom::TimeoutError, e.g. a preparation longer than comm.timeout()).
template <Communicator C, std::invocable F>
auto main_process_first(C& comm, const RankInfo& me, F&& block, Leader leader = Leader::global_rank_zero)
    -> std::invoke_result_t<F&> {
  using R = std::invoke_result_t<F&>;
  static_assert(!std::is_reference_v<R>, "main_process_first: the block must return a value or void, not a reference");
  me.validate();
  if (comm.rank() != me.rank || comm.world_size() != me.world_size)
    throw InvalidArgument(
        fmt::format("main_process_first: the communicator is rank {} of {}, RankInfo says rank {} of {}", comm.rank(),
                    comm.world_size(), me.rank, me.world_size));
  using Slot = std::conditional_t<std::is_void_v<R>, std::optional<int>, std::optional<R>>;
  Slot result;
  const bool leads = is_leader(me, leader);
  const char* leader_name = leader == Leader::global_rank_zero ? "rank 0" : "local rank 0";

  // Phase 1: leaders.
  std::exception_ptr mine = leads ? detail::run_capturing(block, result) : nullptr;
  if (std::string failures = detail::exchange_failures(comm, mine); !failures.empty()) {
    if (mine) std::rethrow_exception(mine);
    throw RemoteError(fmt::format("main_process_first: the block failed on {} so rank {} did not run it: {}",
                                  leader_name, me.rank, failures));
  }
  // Phase 2: everyone else.
  mine = leads ? nullptr : detail::run_capturing(block, result);
  if (std::string failures = detail::exchange_failures(comm, mine); !failures.empty()) {
    if (mine) std::rethrow_exception(mine);
    throw RemoteError(
        fmt::format("main_process_first: the block failed on another rank (rank {} succeeded): {}", me.rank, failures));
  }
  if constexpr (!std::is_void_v<R>) return std::move(*result);
}

/// main_process_first with global rank 0 as the leader, for a communicator alone (no local ranks).
template <Communicator C, std::invocable F>
auto main_process_first(C& comm, F&& block) -> std::invoke_result_t<F&> {
  const RankInfo me{.rank = comm.rank(),
                    .world_size = comm.world_size(),
                    .local_rank = comm.rank(),
                    .local_world_size = comm.world_size()};
  return main_process_first(comm, me, std::forward<F>(block), Leader::global_rank_zero);
}

}  // namespace loom
