// tests/reduce/dist_harness.hpp — runs a test body as N real processes (loom::spawn) connected by
// a GlooCommunicator on loopback. Inside a rank, failures must throw (REQUIRE or loom errors):
// spawn turns a child's exception into a SpawnError in the parent, which fails the test case.
#pragma once

#include <chrono>
#include <functional>

#include <loom/comm/gloo.hpp>
#include <loom/dist/spawn.hpp>

namespace loom::test {

inline constexpr auto kRankTimeout = std::chrono::seconds(30);

/// Runs fn(comm) on `n` ranks; blocking collectives check their metadata across ranks (GlooOptions
/// default), the reducer's bucket all-reduces do not (async).
inline void run_ranks(int n, const std::function<void(loom::GlooCommunicator&)>& fn) {
  loom::spawn(
      n,
      [&](const loom::Environment& env) {
        loom::GlooCommunicator comm(env, {.timeout = kRankTimeout});
        fn(comm);
      },
      {.timeout = std::chrono::seconds(180)});
}

}  // namespace loom::test
