// loom/log with real ranks: processes started by loom::spawn, talking Gloo on loopback
// (loom::test::run_ranks). A failed REQUIRE in a child throws; spawn turns it into a SpawnError that
// fails the test here. Ranks write to files in a per-test temporary folder; the parent reads them
// after the ranks returned.
#include <array>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <doctest/doctest.h>
#include <fmt/format.h>

#include <loom/comm/gloo.hpp>
#include <loom/log/all.hpp>

#include "support/ranks.hpp"
#include "support/temp_dir.hpp"

namespace test_log_multirank {

namespace {

const loom::test::RankOptions kRanks{.comm_timeout = std::chrono::seconds(20),
                                     .spawn_timeout = std::chrono::seconds(120)};

using loom::test::read_file;

/// 2 nodes x (world/2) ranks, as torchrun would number them.
loom::RankInfo two_nodes(int rank, int world) {
  return {.rank = rank, .world_size = world, .local_rank = rank % (world / 2), .local_world_size = world / 2};
}

/// Creates `path` (an event another rank can see).
void touch(const std::filesystem::path& path) {
  std::ofstream(path) << "1\n";
}

/// Waits until every path exists (another rank's event); false if `limit` passed first. The
/// limit only turns a missing event into a failure instead of a hang.
bool wait_for_files(const std::vector<std::filesystem::path>& paths,
                    std::chrono::seconds limit = std::chrono::seconds(30)) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  for (const auto& p : paths) {
    while (!std::filesystem::exists(p)) {
      if (std::chrono::steady_clock::now() > deadline) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  }
  return true;
}

struct ManualClock {
  using duration = std::chrono::milliseconds;
  using time_point = std::chrono::time_point<std::chrono::steady_clock, duration>;
  std::shared_ptr<time_point> t = std::make_shared<time_point>(duration(0));
  [[nodiscard]] time_point now() const { return *t; }
};

}  // namespace

TEST_CASE("multi-rank Logger: rank-0 policy writes only rank 0's lines; all-ranks prefixes every rank's") {
  const loom::test::TempDir tmp("loom-test-logmr-policies");
  const auto& dir = tmp.path;
  loom::test::run_ranks(
      3,
      [&](loom::GlooCommunicator& comm, const loom::Environment& env) {
        const auto me = loom::rank_info(env);
        {
          loom::Logger log{loom::FileSink((dir / "rank0.log").string(), loom::FileSink::Mode::append), me};
          log.info("hello from rank {}", env.rank);
        }
        {
          loom::Logger log{loom::FileSink((dir / "all.log").string(), loom::FileSink::Mode::append), loom::AllRanks{},
                           me};
          log.info("hello from rank {}", env.rank);
        }
        comm.barrier();
      },
      kRanks);
  CHECK(read_file(dir / "rank0.log") == "hello from rank 0\n");
  std::istringstream all(read_file(dir / "all.log"));
  std::set<std::string> lines;
  for (std::string l; std::getline(all, l);) lines.insert(l);
  CHECK(lines == std::set<std::string>{"[rank 0/3] hello from rank 0", "[rank 1/3] hello from rank 1",
                                       "[rank 2/3] hello from rank 2"});
}

TEST_CASE("multi-rank Logger: rank-ordered lines come out in rank order, whatever the arrival order") {
  const loom::test::TempDir tmp("loom-test-logmr-ordered");
  const auto& dir = tmp.path;
  loom::test::run_ranks(
      3,
      [&](loom::GlooCommunicator& comm, const loom::Environment& env) {
        // Every rank writes to its own file; only rank 0's may receive text.
        loom::Logger log{loom::FileSink::per_rank((dir / "ordered.{rank}.log").string(), env.rank), loom::RankOrdered{},
                         loom::rank_info(env)};
        // Ranks log in reverse rank order (rank r waits for rank r + 1's "logged" event); the
        // output must still be 0, 1, 2.
        if (env.rank < 2) REQUIRE(wait_for_files({dir / fmt::format("logged.{}", env.rank + 1)}));
        log.info("step 1 on rank {}", env.rank);
        if (env.rank == 1) log.warning("rank 1 has a second line");
        touch(dir / fmt::format("logged.{}", env.rank));
        log.sync(comm);
        log.info("step 2 on rank {}", env.rank);
        log.sync(comm);
      },
      kRanks);
  CHECK(read_file(dir / "ordered.0.log") ==
        "[rank 0/3] step 1 on rank 0\n"
        "[rank 1/3] step 1 on rank 1\n"
        "[rank 1/3] warning: rank 1 has a second line\n"
        "[rank 2/3] step 1 on rank 2\n"
        "[rank 0/3] step 2 on rank 0\n"
        "[rank 1/3] step 2 on rank 1\n"
        "[rank 2/3] step 2 on rank 2\n");
  CHECK(read_file(dir / "ordered.1.log").empty());
  CHECK(read_file(dir / "ordered.2.log").empty());
}

TEST_CASE("multi-rank global_mean: sizes 3 and 2 with value 1.0 give exactly 1.0; 3 ranks against a hand sum") {
  loom::test::run_ranks(
      2,
      [](loom::GlooCommunicator& comm, const loom::Environment& env) {
        loom::WeightedMean m;
        m.add(1.0, env.rank == 0 ? 3 : 2);
        REQUIRE(loom::global_mean(comm, m) == 1.0);
      },
      kRanks);
  loom::test::run_ranks(
      3,
      [](loom::GlooCommunicator& comm, const loom::Environment& env) {
        // rank r: batches (r + 1, 2) and (0.5, r); by hand: sum = 2+0 + 4+0.5 + 6+1 = 13.5, weight = 6 + 3 = 9.
        loom::WeightedMean loss, count;
        loss.add(env.rank + 1.0, 2);
        loss.add(0.5, env.rank);
        count.add(static_cast<double>(env.rank));
        std::array ms{loss, count};
        const auto means = loom::global_means(comm, ms);
        REQUIRE(means[0] == 13.5 / 9.0);
        REQUIRE(means[1] == 1.0);  // (0 + 1 + 2) / 3
      },
      kRanks);
}

TEST_CASE("multi-rank main_process_first: rank 0 finishes its block before the others start theirs") {
  const loom::test::TempDir tmp("loom-test-logmr-first");
  const auto& dir = tmp.path;
  loom::test::run_ranks(
      3,
      [&](loom::GlooCommunicator& comm, const loom::Environment& env) {
        const auto marker = dir / "cache.ready";
        if (env.rank != 0) touch(dir / fmt::format("entered.{}", env.rank));  // about to call it
        const int n = loom::main_process_first(comm, loom::rank_info(env), [&] {
          if (env.rank == 0) {
            // A slow preparation, still running when both followers have reached
            // main_process_first (their events) and for 300 ms after: a follower that did not
            // wait would run its block now and find no marker.
            REQUIRE(wait_for_files({dir / "entered.1", dir / "entered.2"}));
            std::this_thread::sleep_for(std::chrono::milliseconds(300));
            std::ofstream(marker) << "prepared\n";
            return 1;
          }
          REQUIRE(std::filesystem::exists(marker));  // would fail if a follower ran first
          return 2;
        });
        REQUIRE(n == (env.rank == 0 ? 1 : 2));
      },
      kRanks);
}

TEST_CASE("multi-rank main_process_first per node: local rank 0 of each simulated node leads") {
  const loom::test::TempDir tmp("loom-test-logmr-pernode");
  const auto& dir = tmp.path;
  loom::test::run_ranks(
      4,
      [&](loom::GlooCommunicator& comm, const loom::Environment& env) {
        const auto me = two_nodes(env.rank, 4);
        const int node = env.rank / 2;
        const auto marker = dir / fmt::format("node{}.ready", node);
        if (me.local_rank != 0) touch(dir / fmt::format("entered.{}", env.rank));  // about to call it
        loom::main_process_first(
            comm, me,
            [&] {
              if (me.local_rank == 0) {
                // Still preparing when this node's follower has reached main_process_first, and
                // for 200 ms after (see the previous test).
                REQUIRE(wait_for_files({dir / fmt::format("entered.{}", env.rank + 1)}));
                std::this_thread::sleep_for(std::chrono::milliseconds(200));
                std::ofstream(marker) << env.rank << "\n";
              } else {
                REQUIRE(read_file(marker) == fmt::format("{}\n", env.rank - 1));
              }
            },
            loom::Leader::local_rank_zero);
      },
      kRanks);
}

TEST_CASE("multi-rank main_process_first: an exception on rank 0 reaches the others as RemoteError, no hang") {
  loom::test::run_ranks(
      3,
      [](loom::GlooCommunicator& comm, const loom::Environment& env) {
        bool ran = false;
        try {
          loom::main_process_first(comm, [&] {
            ran = true;
            if (env.rank == 0) throw std::runtime_error("cache archive is corrupt");
          });
          FAIL("main_process_first returned after rank 0 threw");
        } catch (const loom::RemoteError& e) {
          REQUIRE(env.rank != 0);
          REQUIRE_FALSE(ran);
          REQUIRE(std::string(e.what()) ==
                  fmt::format("loom: main_process_first: the block failed on rank 0 so rank {} did not run "
                              "it: rank 0: cache archive is corrupt",
                              env.rank));
        } catch (const loom::TimeoutError& e) {
          // A follower that waited for a peer until the collective timeout: the failure was not
          // passed on (the no-hang guarantee broken).
          throw std::runtime_error(
              fmt::format("rank {} timed out instead of hearing of rank 0's failure: {}", env.rank, e.what()));
        } catch (const std::runtime_error& e) {
          REQUIRE(env.rank == 0);
          REQUIRE(std::string(e.what()) == "cache archive is corrupt");
        }
        // The group is still usable: everyone reached the same point, and the followers' errors
        // above are RemoteErrors carrying rank 0's message, not TimeoutErrors: nobody waited for
        // a peer that would never come.
        comm.barrier();
      },
      kRanks);
}

TEST_CASE("multi-rank Progress: global samples summed over ranks; bars on rank 0, or on ranks 0 and 2 per node") {
  const loom::test::TempDir tmp("loom-test-logmr-progress");
  const auto& dir = tmp.path;
  loom::test::run_ranks(
      4,
      [&](loom::GlooCommunicator& comm, const loom::Environment& env) {
        const auto me = two_nodes(env.rank, 4);
        for (auto leader : {loom::Leader::global_rank_zero, loom::Leader::local_rank_zero}) {
          ManualClock clock;
          const auto name =
              fmt::format("{}.{}.log", leader == loom::Leader::global_rank_zero ? "global" : "local", env.rank);
          loom::Progress p{loom::FileSink((dir / name).string()),
                           me,
                           {.total = 100,
                            .label = "epoch",
                            .line_interval = std::chrono::seconds(2),
                            .sync_every = 2,
                            .shown_on = leader},
                           clock};
          for (int s = 0; s < 4; ++s) {  // rank r does r + 1 samples per step: 10 per step over 4 ranks
            *clock.t += std::chrono::seconds(1);
            p.step(comm, env.rank + 1);
          }
          p.finish(comm);
          REQUIRE(p.global_samples() == 40);
        }
      },
      kRanks);
  // By hand: sums after steps 2 and 4 (t = 2 s, 4 s): 20 and 40 of 100 samples, 10 samples/s.
  const std::string lines =
      "epoch: 20/100 samples (20.0%), 10.0 samples/s, elapsed 0:00:02, ETA 0:00:08\n"
      "epoch: 40/100 samples (40.0%), 10.0 samples/s, elapsed 0:00:04, ETA 0:00:06\n"
      "epoch: done, 40 samples in 0:00:04, 10.0 samples/s\n";
  CHECK(read_file(dir / "global.0.log") == lines);
  for (int r : {1, 2, 3}) CHECK(read_file(dir / fmt::format("global.{}.log", r)).empty());
  for (int r : {0, 2}) {
    std::string prefixed;
    std::istringstream in(lines);
    for (std::string l; std::getline(in, l);) prefixed += fmt::format("[rank {}/4] {}\n", r, l);
    CHECK(read_file(dir / fmt::format("local.{}.log", r)) == prefixed);
  }
  for (int r : {1, 3}) CHECK(read_file(dir / fmt::format("local.{}.log", r)).empty());
}

}  // namespace test_log_multirank
