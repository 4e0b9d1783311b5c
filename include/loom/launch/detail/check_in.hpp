// loom/launch/detail/check_in.hpp — the check-in every rank makes at the job's store before
// loom::rendezvous returns (the claim of its RANK, the comparison of WORLD_SIZE, the count of the
// ranks that arrived), and the small helpers the rendezvous code and the communicators' connect
// share: a store value as text, seconds since a start, whether a backend message says "timed out".
// Not a public header: loom/launch/rendezvous.hpp is.
//
// Example: `detail::store_check_in(*store, "loom/rdzv/0", rank, world_size, timeout, start);`
// Throws: loom::ConfigError naming a launch mistake (a RANK claimed twice, a WORLD_SIZE
//         disagreement) on every rank that sees it; loom::TimeoutError naming how many ranks arrived.
// Source: loom's own protocol over a c10d::Store; key names are loom's.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <loom/detail/exception_text.hpp>
#include <loom/detail/host_and_pid.hpp>
#include <loom/error.hpp>

namespace loom::detail {

/// True when a backend message says the operation timed out.
inline bool mentions_timeout(const std::string& text) {
  return text.find("imed out") != std::string::npos || text.find("imeout") != std::string::npos;
}

/// Seconds since `start`.
inline double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

/// The bytes of a store value as text, and back.
inline std::string store_text(const std::vector<std::uint8_t>& v) {
  return std::string(v.begin(), v.end());
}
inline std::vector<std::uint8_t> store_bytes(const std::string& s) {
  return std::vector<std::uint8_t>(s.begin(), s.end());
}

/// The value a check-in's outcome key holds when a rank found a launch mistake.
inline constexpr std::string_view kCheckInConflict = "conflict: ";

/// Checks this rank in under `prefix` and waits until every rank of `world_size` did:
///   1. claims "<prefix>/rank/<rank>" with compare-set (the first process keeps it): a second
///      claimant is a launch mistake, "two processes claim RANK=r: <host:pid> and <host:pid>";
///   2. compares its world size with the first one posted ("<prefix>/world_size"): "rank 1 says
///      WORLD_SIZE=3, rank 0 says WORLD_SIZE=2";
///   3. counts itself ("<prefix>/arrived"); the last to arrive sets "<prefix>/all".
/// A rank that finds a mistake sets "<prefix>/all" to "conflict: <what>" instead (compare-set: the
/// first outcome stays), so the ranks waiting for the others learn it at once. `hosts_store`: this
/// process hosts the store; after a mistake it stays until every process that checked in was told
/// (at most until the timeout), so that none loses the store in the middle of its requests.
/// `hint` ends a claim conflict's message (why it may be another job).
/// Throws: loom::ConfigError naming the mistake (on every rank that sees it, at once);
///         loom::TimeoutError naming how many ranks arrived when some never do.
inline void store_check_in(c10d::Store& store, const std::string& prefix, int rank, int world_size,
                           std::chrono::milliseconds timeout, std::chrono::steady_clock::time_point start,
                           std::string_view hint = {}, bool hosts_store = false) {
  const std::string count_key = prefix + "/arrived";
  const std::string done_key = prefix + "/all";
  const std::string seen_key = prefix + "/seen";
  const std::string told_key = prefix + "/told";
  const std::string me = host_and_pid();
  // A process that learnt of a mistake counts itself told; the one hosting the store keeps it until
  // every process that came has been told (within the timeout), so none loses the store mid-request.
  auto told = [&] {
    try {
      store.add(told_key, 1);
      while (hosts_store && store.add(told_key, 0) < store.add(seen_key, 0) &&
             std::chrono::steady_clock::now() < start + timeout)
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
    } catch (const std::exception&) {
    }
  };
  try {
    std::string conflict;
    store.add(seen_key, 1);
    const std::string claim =
        store_text(store.compareSet(fmt::format("{}/rank/{}", prefix, rank), {}, store_bytes(me)));
    if (claim != me) {
      conflict = fmt::format("two processes claim RANK={}: {} and {}; every process of a job needs a RANK of its own{}",
                             rank, claim, me, hint);
    } else {
      const std::string first =
          store_text(store.compareSet(prefix + "/world_size", {}, store_bytes(fmt::format("{} {}", world_size, rank))));
      int first_size = 0, first_rank = 0;
      if (std::sscanf(first.c_str(), "%d %d", &first_size, &first_rank) == 2 && first_size != world_size) {
        // The higher rank first, so every rank words the same disagreement the same way.
        const bool mine_first = rank > first_rank;
        conflict =
            fmt::format("the ranks disagree on WORLD_SIZE: rank {} says WORLD_SIZE={}, rank {} says WORLD_SIZE={}",
                        mine_first ? rank : first_rank, mine_first ? world_size : first_size,
                        mine_first ? first_rank : rank, mine_first ? first_size : world_size);
      }
    }
    if (!conflict.empty()) {
      (void)store.compareSet(done_key, {}, store_bytes(std::string(kCheckInConflict) + conflict));
      told();
      throw ConfigError(fmt::format("rendezvous: {} (seen by rank {} on {})", conflict, rank, me));
    }
    if (store.add(count_key, 1) == world_size) (void)store.compareSet(done_key, {}, store_bytes("all"));
    // Polled rather than waited for: LibTorch 1.13's store wakes no waiter for a compare-set.
    while (!store.check({done_key})) {
      if (std::chrono::steady_clock::now() >= start + timeout)
        throw std::runtime_error(fmt::format("no outcome within the {:.3f} s timeout", timeout.count() / 1000.0));
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    const std::string outcome = store_text(store.get(done_key));
    if (outcome.starts_with(kCheckInConflict)) {
      told();
      throw ConfigError(
          fmt::format("rendezvous: {} (reported to rank {} on {})", outcome.substr(kCheckInConflict.size()), rank, me));
    }
  } catch (const ConfigError&) {
    throw;
  } catch (const std::exception& e) {
    std::int64_t arrived = -1;
    try {
      arrived = store.add(count_key, 0);
    } catch (...) {
    }
    throw TimeoutError(
        "rendezvous", rank, seconds_since(start),
        fmt::format("{} of {} ranks arrived at the store ({})",
                    arrived < 0 ? std::string("?") : std::to_string(arrived), world_size, exception_text(e)));
  }
}

}  // namespace loom::detail
