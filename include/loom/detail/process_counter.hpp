// loom/detail/process_counter.hpp — per-process counts of the objects every rank creates in the same
// order, which give each one its own keys in a shared c10d store.
//
// Example:
//   const auto n = loom::detail::next_in_process(loom::detail::Counted::gloo_communicator);  // 0, 1, ...
//   prefix = fmt::format("loom/gloo/{}", n);
//
// Rule: ranks create rendezvous, Gloo and NCCL communicators in the same order (as with c10d's
// process groups), so the n-th of a kind has the same number n on every rank. Thread-safe. A
// process forked from another (loom::spawn's ranks) starts from its parent's counts, the same on
// every rank.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>

namespace loom::detail {

/// What is counted: each kind has its own count.
/// flight_recorder counts the communicators (Gloo and NCCL together) that keep a flight recorder: the
/// n-th writes its records to the trace folder's subfolder "comm<n>" (the first: the folder itself).
enum class Counted : std::size_t { rendezvous = 0, gloo_communicator = 1, nccl_communicator = 2, flight_recorder = 3 };

/// This process's count of `what` before this call (0 for the first), then counts one more.
inline std::uint64_t next_in_process(Counted what) noexcept {
  static std::array<std::atomic<std::uint64_t>, 4> counts{};
  return counts[static_cast<std::size_t>(what)].fetch_add(1);
}

}  // namespace loom::detail
