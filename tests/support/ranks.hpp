// tests/support/ranks.hpp — runs a test body as N real processes (loom::spawn) joined by a
// GlooCommunicator on loopback: the harness of every multi-rank test outside tests/dist and
// tests/comm.
//
// Example:
//   loom::test::run_ranks(2, [](loom::GlooCommunicator& comm) {
//     auto t = torch::full({1}, double(comm.rank() + 1), torch::kDouble);
//     comm.all_reduce(t, loom::ReduceOp::sum);
//     REQUIRE(t.item<double>() == 3.0);
//   });
//   loom::test::run_ranks(3, [](loom::GlooCommunicator& comm, const loom::Environment& env) { ... },
//                         {.comm_timeout = std::chrono::seconds(20)});
//
// Inside a rank, failures must throw (REQUIRE or loom errors): spawn turns a child's exception into
// a SpawnError in the parent, which fails the test case. The ports come from spawn (never fixed).
#pragma once

#include <chrono>
#include <concepts>
#include <utility>

#include <loom/comm/gloo.hpp>
#include <loom/launch/environment.hpp>
#include <loom/launch/spawn.hpp>

namespace loom::test {

/// How long a rank's collectives and the whole spawned job may take.
struct RankOptions {
  std::chrono::milliseconds comm_timeout = std::chrono::seconds(30);    ///< GlooOptions::timeout
  std::chrono::milliseconds spawn_timeout = std::chrono::seconds(180);  ///< SpawnOptions::timeout
};

/// Runs fn(comm) or fn(comm, env) on `n` ranks, each with its own GlooCommunicator (blocking
/// collectives check their metadata across ranks, the GlooOptions default).
template <class Fn>
requires std::invocable<Fn&, loom::GlooCommunicator&> ||
    std::invocable<Fn&, loom::GlooCommunicator&, const loom::Environment&>
void run_ranks(int n, Fn&& fn, RankOptions options = {}) {
  loom::spawn(n,
              [&](const loom::Environment& env) {
                loom::GlooCommunicator comm(env, {.timeout = options.comm_timeout});
                if constexpr (std::invocable<Fn&, loom::GlooCommunicator&, const loom::Environment&>) {
                  fn(comm, env);
                } else {
                  fn(comm);
                }
              },
              {.timeout = options.spawn_timeout});
}

}  // namespace loom::test
