// RankGeneratorLoader: the per-rank mode with 2 real processes over Gloo on loopback (loom::spawn,
// through loom::test::run_ranks). Inside a spawned rank, failures must throw (REQUIRE or loom
// errors): a CHECK in a child cannot fail the parent's test; spawn turns a child's exception into a
// SpawnError.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <doctest/doctest.h>
#include <torch/torch.h>

#include <loom/comm/gloo.hpp>
#include <loom/comm/local.hpp>
#include <loom/schedule/rank_generator_loader.hpp>

#include "helpers.hpp"
#include "support/ranks.hpp"

using loom::test::expected_rows;
using loom::test::Stream;

namespace {
const loom::test::RankOptions kRanks{.comm_timeout = std::chrono::seconds(20),
                                     .spawn_timeout = std::chrono::seconds(90)};

const std::vector<int64_t> kLengths = {5, 7, 3, 9};

// After each step every rank all-reduces its row count, as a training loop all-reduces
// gradients: a rank that stopped early would leave the other waiting here.
int64_t all_rows(loom::GlooCommunicator& comm, int64_t rows) {
  auto t = torch::full({1}, rows, torch::kLong);
  comm.all_reduce(t, loom::ReduceOp::sum);
  return t.item<int64_t>();
}
}  // namespace

TEST_CASE("RankGeneratorLoader: with a LocalCommunicator it is the 1-device schedule") {
  loom::LocalCommunicator comm;
  loom::RankGeneratorLoader s(comm, 3, [](int g) { return Stream{.g = g, .length = 4, .jitter_us = 200}; });
  CHECK(s.generators() == std::vector<int>{0, 1, 2});
  int64_t k = 0;
  for (auto& db : s) {
    CHECK(db.device == 0);
    CHECK(db.batch.data.equal(expected_rows({0, 1, 2}, k)));
    ++k;
  }
  CHECK(k == 4);
  CHECK(s.report().generators[1].unread == 0);
}

TEST_CASE(
    "RankGeneratorLoader: a generator that reuses one output tensor still gets its own rows in every batch (1 rank)") {
  loom::LocalCommunicator comm;
  loom::RankGeneratorLoader loader(comm, loom::test::fast_and_slow_reusing(6), {.prefetch_depth = 3});
  int64_t k = 0;
  for (auto& db : loader) {
    CAPTURE(k);
    CHECK(db.batch.data.equal(expected_rows({0, 1}, k)));
    ++k;
  }
  CHECK(k == 6);
}

TEST_CASE("RankGeneratorLoader: batch buffers are reused across steps (1 rank)") {
  // DefaultCollate's allocator allocates the loader's pooled batch buffers: a few for 30 steps
  // (depth + 2 at most), where a buffer per batch would take 30 calls.
  const int depth = 3;
  auto calls = std::make_shared<std::atomic<int>>(0);
  loom::DefaultCollate<> collate_fn;
  collate_fn.options.allocate = [calls](c10::IntArrayRef sizes, c10::ScalarType dtype) {
    calls->fetch_add(1);
    return torch::empty(sizes, torch::TensorOptions(dtype));
  };
  std::vector<Stream> gens;
  for (int g = 0; g < 3; ++g) gens.push_back(Stream{.g = g, .length = 30});
  loom::LocalCommunicator comm;
  loom::RankGeneratorLoader<Stream, loom::LocalCommunicator> loader(comm, std::move(gens), {.prefetch_depth = depth},
                                                                    collate_fn);
  int64_t k = 0;
  for (auto& db : loader) {
    CAPTURE(k);
    CHECK(db.batch.data.equal(expected_rows({0, 1, 2}, k)));
    ++k;
  }
  CHECK(k == 30);
  CHECK(calls->load() >= 1);
  CHECK(calls->load() <= depth + 2);
}

TEST_CASE("RankGeneratorLoader: num_devices other than 1 is refused, naming the value") {
  loom::LocalCommunicator comm;
  CHECK_THROWS_WITH_AS(
      loom::RankGeneratorLoader(comm, 4, [](int g) { return Stream{.g = g, .length = 4}; }, {.num_devices = 4}),
      doctest::Contains("num_devices is 4, must be 1"), loom::InvalidArgument);
}

TEST_CASE("RankGeneratorLoader: 2 ranks — each rank's generators and batches, as the assignment says") {
  loom::test::run_ranks(
      2,
      [](loom::GlooCommunicator& comm, const loom::Environment& env) {
        for (auto policy : {loom::Assignment::contiguous(), loom::Assignment::round_robin()}) {
          // 6 generators over 2 ranks: contiguous {0,1,2} / {3,4,5}; round-robin {0,2,4} / {1,3,5}
          const std::vector<int> hand = policy.kind == loom::Assignment::Kind::contiguous
                                            ? (env.rank == 0 ? std::vector<int>{0, 1, 2} : std::vector<int>{3, 4, 5})
                                            : (env.rank == 0 ? std::vector<int>{0, 2, 4} : std::vector<int>{1, 3, 5});
          int built = 0;
          loom::RankGeneratorLoader s(
              comm, 6,
              [&](int g) {
                ++built;
                return Stream{.g = g, .length = 6, .jitter_us = 300, .seed = static_cast<uint64_t>(env.rank + 1)};
              },
              {.assignment = policy, .prefetch_depth = 3});
          REQUIRE(built == 3);  // only this rank's generators are made
          REQUIRE(s.generators() == hand);
          int64_t k = 0;
          for (auto& db : s) {
            REQUIRE(db.device == env.rank);
            REQUIRE(db.step == k);
            REQUIRE(db.generators == hand);
            REQUIRE(db.batch.data.equal(expected_rows(hand, k)));
            REQUIRE(all_rows(comm, db.num_rows()) == 6);
            ++k;
          }
          REQUIRE(k == 6);
        }
      },
      kRanks);
}

TEST_CASE("RankGeneratorLoader: 2 ranks, unequal lengths, stop_at_shortest — same step count, unread reported") {
  loom::test::run_ranks(
      2,
      [](loom::GlooCommunicator& comm, const loom::Environment& env) {
        // lengths 5, 7, 3, 9: rank 0 runs {0, 1}, rank 1 runs {2, 3}; generator 2 is the shortest (3)
        loom::RankGeneratorLoader s(
            comm, 4,
            [&](int g) { return Stream{.g = g, .length = kLengths[static_cast<size_t>(g)], .jitter_us = 300}; },
            {.count_unread = true});
        const std::vector<int> mine = env.rank == 0 ? std::vector<int>{0, 1} : std::vector<int>{2, 3};
        int64_t k = 0;
        for (auto& db : s) {
          REQUIRE(db.batch.data.equal(expected_rows(mine, k)));
          REQUIRE(all_rows(comm, db.num_rows()) == 4);
          ++k;
        }
        REQUIRE(k == 3);
        const auto r = s.report();
        REQUIRE(r.steps == 3);
        REQUIRE(r.shortest_generator == 2);  // known on both ranks
        REQUIRE(r.generators.size() == 2);
        for (const auto& g : r.generators) {
          REQUIRE(g.delivered == 3);
          REQUIRE(g.unread == kLengths[static_cast<size_t>(g.generator)] - 3);
          REQUIRE(g.unread_exact);
        }
      },
      kRanks);
}

namespace {
using AnyStream = std::function<std::optional<at::Tensor>()>;

// Generator 0 ends after 4 samples, generator 1 never ends.
AnyStream four_or_endless(int g) {
  if (g == 0) return Stream{.g = 0, .length = 4};
  return loom::test::EndlessStream{.g = g};
}

// Runs the schedule of `s` (this rank's generator `g`, 4 steps), then report() under a deadline.
template <class Sched>
loom::GeneratorLoaderReport run_four_steps_and_report(Sched& s, int g, loom::GlooCommunicator* comm) {
  using namespace std::chrono_literals;
  int64_t k = 0;
  for (auto& db : s) {
    REQUIRE(db.batch.data.equal(expected_rows({g}, k)));
    if (comm != nullptr) REQUIRE(all_rows(*comm, db.num_rows()) == 2);
    ++k;
  }
  REQUIRE(k == 4);
  const loom::GeneratorLoaderReport r =
      loom::test::within(20s, "RankGeneratorLoader::report()", [&] { return s.report(); });
  REQUIRE(r.steps == 4);
  REQUIRE(r.shortest_generator == 0);
  REQUIRE(r.generators.size() == 1);
  const auto& gr = r.generators[0];
  REQUIRE(gr.generator == g);
  REQUIRE(gr.delivered == 4);
  REQUIRE(gr.ended == (g == 0));
  REQUIRE(gr.unread_exact == (g == 0));  // the endless stream's count is a lower bound
  if (g == 0) REQUIRE(gr.unread == 0);
  return r;
}
}  // namespace

TEST_CASE("RankGeneratorLoader: stop_at_shortest with an endless generator — report() returns (1 rank)") {
  loom::LocalCommunicator comm;
  // one rank runs both: generator 0 stops the schedule after 4 steps, generator 1 is endless
  loom::RankGeneratorLoader s(comm, 2, four_or_endless, {.prefetch_depth = 2});
  int64_t k = 0;
  for (auto& db : s) {
    CHECK(db.batch.data.equal(expected_rows({0, 1}, k)));
    ++k;
  }
  CHECK(k == 4);
  using namespace std::chrono_literals;
  const loom::GeneratorLoaderReport r =
      loom::test::within(20s, "RankGeneratorLoader::report()", [&] { return s.report(); });
  REQUIRE(r.generators.size() == 2);
  CHECK(r.generators[0].unread == 0);
  CHECK(r.generators[0].unread_exact);
  CHECK(r.generators[1].delivered == 4);
  CHECK_FALSE(r.generators[1].ended);
  CHECK_FALSE(r.generators[1].unread_exact);
  CHECK(r.generators[1].unread <= 2);  // prefetched and dropped: at most prefetch_depth
}

TEST_CASE(
    "RankGeneratorLoader: 2 ranks, stop_at_shortest with an endless generator on rank 1 — report() returns on both") {
  loom::test::run_ranks(
      2,
      [](loom::GlooCommunicator& comm, const loom::Environment& env) {
        // rank 0 runs generator 0 (4 samples), rank 1 runs generator 1 (endless)
        {  // default: no counting; unread = prefetched and dropped, at most prefetch_depth
          loom::RankGeneratorLoader s(comm, 2, four_or_endless, {.prefetch_depth = 2});
          const loom::GeneratorLoaderReport r = run_four_steps_and_report(s, env.rank, &comm);
          if (env.rank == 1) REQUIRE(r.generators[0].unread <= 2);
        }
        {  // counting on: rank 1 reads 30 more samples, then reports a lower bound
          loom::RankGeneratorLoader s(comm, 2, four_or_endless,
                                      {.prefetch_depth = 2, .count_unread = true, .count_unread_limit = 30});
          const loom::GeneratorLoaderReport r = run_four_steps_and_report(s, env.rank, &comm);
          if (env.rank == 1) {
            REQUIRE(r.generators[0].unread >= 30);
            REQUIRE(r.generators[0].unread <= 32);
          }
        }
      },
      kRanks);
}

TEST_CASE("RankGeneratorLoader: 2 ranks, unequal lengths, drain — every sample once, dry rank gets empty batches") {
  loom::test::run_ranks(
      2,
      [](loom::GlooCommunicator& comm, const loom::Environment& env) {
        // round-robin: rank 0 runs {0, 2} (lengths 5, 3), rank 1 runs {1, 3} (lengths 7, 9): 9 steps
        loom::RankGeneratorLoader s(
            comm, 4,
            [&](int g) { return Stream{.g = g, .length = kLengths[static_cast<size_t>(g)], .jitter_us = 300}; },
            {.assignment = loom::Assignment::round_robin(), .prefetch_depth = 2, .end = loom::EndPolicy::drain});
        const std::vector<int> mine = env.rank == 0 ? std::vector<int>{0, 2} : std::vector<int>{1, 3};
        int64_t k = 0, rows = 0;
        for (auto& db : s) {
          std::vector<int> alive;
          for (int g : mine)
            if (k < kLengths[static_cast<size_t>(g)]) alive.push_back(g);
          REQUIRE(db.generators == alive);
          REQUIRE(db.partial == (alive.size() < 2));
          if (alive.empty()) {
            REQUIRE(db.batch.num_samples == 0);
            REQUIRE(db.batch.weight == 0.0);
          } else {
            REQUIRE(db.batch.data.equal(expected_rows(alive, k)));
          }
          // all 4 generators alive at step k, summed over both ranks
          int64_t expected = 0;
          for (auto len : kLengths) expected += k < len ? 1 : 0;
          REQUIRE(all_rows(comm, db.num_rows()) == expected);
          rows += db.num_rows();
          ++k;
        }
        REQUIRE(k == 9);
        REQUIRE(rows == (env.rank == 0 ? 5 + 3 : 7 + 9));
      },
      kRanks);
}

TEST_CASE("RankGeneratorLoader: a generator throwing at sample 5 on rank 1 reaches both ranks, naming it") {
  loom::test::run_ranks(
      2,
      [](loom::GlooCommunicator& comm, const loom::Environment& env) {
        loom::RankGeneratorLoader s(
            comm, 4, [&](int g) { return Stream{.g = g, .throw_at = g == 3 ? 5 : -1, .jitter_us = 500}; });
        int64_t k = 0;
        try {
          while (auto db = s.next()) {
            REQUIRE(all_rows(comm, db->num_rows()) == 4);
            ++k;
          }
          throw std::runtime_error("the schedule ended without an error");
        } catch (const loom::GeneratorError& e) {
          REQUIRE(env.rank == 1);
          REQUIRE(e.generator() == 3);
          REQUIRE(e.sample() == 5);
          REQUIRE(std::string(e.what()).find("boom at sample 5") != std::string::npos);
        } catch (const loom::RemoteError& e) {
          REQUIRE(env.rank == 0);
          const std::string what = e.what();
          REQUIRE(what.find("rank 1 stopped at step 5") != std::string::npos);
          REQUIRE(what.find("generator 3") != std::string::npos);
          REQUIRE(what.find("boom at sample 5") != std::string::npos);
        }
        REQUIRE(k == 5);
      },
      kRanks);
}

TEST_CASE("RankGeneratorLoader: ranks configured differently get a ConfigError, not a hang") {
  loom::test::run_ranks(
      2,
      [](loom::GlooCommunicator& comm, const loom::Environment& env) {
        const int n = env.rank == 0 ? 4 : 6;
        loom::RankGeneratorLoader s(comm, n, [&](int g) { return Stream{.g = g, .length = 3}; });
        bool threw = false;
        try {
          (void)s.next();
        } catch (const loom::ConfigError& e) {
          threw = std::string(e.what()).find("ranks disagree") != std::string::npos;
        }
        REQUIRE(threw);
      },
      kRanks);
}
