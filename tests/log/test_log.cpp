// loom/log in one process: sinks, rank policies, the Logger, weighted metrics, main_process_first
// and Progress, against LocalCommunicator and a recording communicator that plays the other ranks.
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include <ATen/ATen.h>
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <loom/comm/local.hpp>
#include <loom/log/all.hpp>

#include "support/recording_communicator.hpp"
#include "support/temp_dir.hpp"

namespace test_log {

namespace {

using loom::test::read_file;
using loom::test::RecordingCommunicator;

/// A clock the test advances by hand; copies share the time.
struct ManualClock {
  using duration = std::chrono::milliseconds;
  using time_point = std::chrono::time_point<std::chrono::steady_clock, duration>;
  std::shared_ptr<time_point> t = std::make_shared<time_point>(duration(1'000'000));
  [[nodiscard]] time_point now() const { return *t; }
  void advance(duration d) const { *t += d; }
};

// --- types that do and do not model the concepts ------------------------------------------------
struct WriteOnly {
  void write(std::string_view) {}
};
struct NoTerminalQuery {
  void write(std::string_view) {}
  void flush() {}
};
struct EmitsOnly {
  bool emits(const loom::RankInfo&) const { return true; }
};
struct UntaggedOrdered {
  bool emits(const loom::RankInfo&) const { return true; }
  std::string prefix(const loom::RankInfo&) const { return {}; }
};
struct EnvLike {  // what loom::Environment offers, as plain members
  int rank = 3, world_size = 4, local_rank = 1, local_world_size = 2;
};

}  // namespace

TEST_CASE("log concepts: which types model LogSink, TerminalSink, RankPolicy, ProgressClock") {
  static_assert(loom::TerminalSink<loom::StreamSink>);
  static_assert(loom::TerminalSink<loom::FileSink>);
  static_assert(loom::TerminalSink<loom::MemorySink>);
  static_assert(!loom::LogSink<WriteOnly>, "flush() is required");
  static_assert(loom::LogSink<NoTerminalQuery> && !loom::TerminalSink<NoTerminalQuery>);
  static_assert(!loom::LogSink<int>);
  static_assert(loom::RankPolicy<loom::RankZero> && loom::RankPolicy<loom::LocalRankZero>);
  static_assert(loom::RankPolicy<loom::AllRanks> && loom::RankPolicy<loom::RankOrdered>);
  static_assert(!loom::RankPolicy<EmitsOnly>, "prefix() is required");
  static_assert(loom::RankPolicy<UntaggedOrdered> && !loom::OrderedRankPolicy<UntaggedOrdered>,
                "ordering is opt-in through ordered_tag");
  static_assert(loom::OrderedRankPolicy<loom::RankOrdered>);
  static_assert(loom::ProgressClock<std::chrono::steady_clock> && loom::ProgressClock<ManualClock>);
  static_assert(!loom::ProgressClock<int>);
  static_assert(loom::Communicator<RecordingCommunicator>);
  // A sink without is_terminal() still works with Progress: lines mode.
  loom::RankInfo me;
  loom::Progress p{NoTerminalQuery{}, me, {.display = loom::ProgressDisplay::automatic}};
  CHECK_FALSE(p.live_bar());
}

TEST_CASE("RankInfo: validation names the field; rank_info() reads launcher-like structs") {
  CHECK_NOTHROW(loom::RankInfo{}.validate());
  CHECK_THROWS_WITH_AS((loom::RankInfo{.rank = 4, .world_size = 4}.validate()),
                       "loom: RankInfo: rank 4 is outside [0, 4)", loom::InvalidArgument);
  CHECK_THROWS_WITH_AS((loom::RankInfo{.world_size = 0}.validate()), "loom: RankInfo: world_size 0 is < 1",
                       loom::InvalidArgument);
  CHECK_THROWS_WITH_AS((loom::RankInfo{.rank = 1, .world_size = 4, .local_rank = 2, .local_world_size = 2}.validate()),
                       "loom: RankInfo: local_rank 2 is outside [0, 2)", loom::InvalidArgument);
  CHECK_THROWS_WITH_AS((loom::RankInfo{.world_size = 2, .local_world_size = 3}.validate()),
                       "loom: RankInfo: local_world_size 3 is outside [1, 2]", loom::InvalidArgument);
  const loom::RankInfo r = loom::rank_info(EnvLike{});
  CHECK(r == loom::RankInfo{.rank = 3, .world_size = 4, .local_rank = 1, .local_world_size = 2});
  CHECK_THROWS_AS((void)loom::rank_info(EnvLike{.rank = 5}), loom::InvalidArgument);
}

TEST_CASE("Leader: 2 nodes x 2 ranks -> global leader rank 0, local leaders ranks 0 and 2") {
  std::vector<int> global, local, bars_default, bars_local;
  for (int rank = 0; rank < 4; ++rank) {
    const loom::RankInfo me{.rank = rank, .world_size = 4, .local_rank = rank % 2, .local_world_size = 2};
    if (loom::is_leader(me, loom::Leader::global_rank_zero)) global.push_back(rank);
    if (loom::is_leader(me, loom::Leader::local_rank_zero)) local.push_back(rank);
    loom::Progress def{loom::MemorySink{}, me};
    loom::Progress per_node{loom::MemorySink{}, me, {.shown_on = loom::Leader::local_rank_zero}};
    if (def.shown()) bars_default.push_back(rank);
    if (per_node.shown()) bars_local.push_back(rank);
  }
  CHECK(global == std::vector<int>{0});
  CHECK(local == std::vector<int>{0, 2});
  CHECK(bars_default == std::vector<int>{0});
  CHECK(bars_local == std::vector<int>{0, 2});
}

TEST_CASE("Logger, rank-0 policy: only rank 0 writes; silent ranks write nothing") {
  for (int rank = 0; rank < 3; ++rank) {
    loom::MemorySink mem;
    loom::Logger log{mem, loom::RankInfo{.rank = rank, .world_size = 3, .local_rank = rank, .local_world_size = 3}};
    static_assert(std::is_same_v<decltype(log), loom::Logger<loom::MemorySink, loom::RankZero>>);
    log.info("epoch {} loss {:.4f}", 3, 0.75287356);
    log.warning("{} samples padded", 2);
    if (rank == 0) {
      CHECK(mem.text() == "epoch 3 loss 0.7529\nwarning: 2 samples padded\n");
      CHECK(mem.writes() == 2);
      CHECK(log.emits());
    } else {
      CHECK(mem.text().empty());
      CHECK(mem.writes() == 0);
      CHECK_FALSE(log.emits());
      CHECK_FALSE(log.enabled(loom::LogLevel::error));
    }
  }
}

TEST_CASE("Logger: levels filter lines and tag them") {
  loom::MemorySink mem;
  loom::Logger log{mem, loom::RankInfo{}, loom::LogOptions{.level = loom::LogLevel::warning}};
  log.debug("d");
  log.info("i");
  log.warning("w");
  log.error("e {}", 1);
  CHECK(mem.lines() == std::vector<std::string>{"warning: w", "error: e 1"});
  log.set_level(loom::LogLevel::debug);
  log.debug("now {}", "visible");
  CHECK(mem.lines().back() == "debug: now visible");
  log.set_level(loom::LogLevel::off);
  log.error("dropped");
  CHECK(mem.lines().size() == 3);
  CHECK(loom::to_string(loom::LogLevel::warning) == "warning");
}

TEST_CASE("Logger, all-ranks policy: every line carries [rank r/w], multi-line messages too, one write each") {
  loom::MemorySink mem;
  loom::Logger log{mem, loom::AllRanks{},
                   loom::RankInfo{.rank = 2, .world_size = 4, .local_rank = 0, .local_world_size = 2}};
  log.info("first\nsecond");
  log.error("bad value {}", -1);
  log.info("");
  CHECK(mem.text() == "[rank 2/4] first\n[rank 2/4] second\n[rank 2/4] error: bad value -1\n[rank 2/4] \n");
  CHECK(mem.writes() == 3);
  loom::MemorySink plain;
  loom::Logger unprefixed{plain, loom::AllRanks{.with_prefix = false}, loom::RankInfo{.rank = 1, .world_size = 2}};
  unprefixed.info("x");
  CHECK(plain.text() == "x\n");
}

TEST_CASE("Logger, local-rank-0 policy: one writer per node, prefixed with its global rank") {
  std::string all;
  for (int rank = 0; rank < 4; ++rank) {
    loom::MemorySink mem;
    loom::Logger log{mem, loom::LocalRankZero{},
                     loom::RankInfo{.rank = rank, .world_size = 4, .local_rank = rank % 2, .local_world_size = 2}};
    log.info("node ready");
    all += mem.text();
  }
  CHECK(all == "[rank 0/4] node ready\n[rank 2/4] node ready\n");
}

TEST_CASE("Logger, rank-ordered policy: rank 0 prints every rank's lines in rank order at sync") {
  const std::string rank1_lines = "[rank 1/3] r1 a\n[rank 1/3] r1 b\n";
  const std::string rank2_lines = "[rank 2/3] r2 a\n";
  SUBCASE("rank 0 prints its lines, then rank 1's, then rank 2's") {
    loom::MemorySink mem;
    RecordingCommunicator comm(0, 3);
    comm.on_all_gather = loom::test::gather_strings_from({"", rank1_lines, rank2_lines}, 0);
    loom::Logger log{mem, loom::RankOrdered{},
                     loom::RankInfo{.rank = 0, .world_size = 3, .local_rank = 0, .local_world_size = 3}};
    log.info("r0 a");
    CHECK(mem.text().empty());  // buffered until sync
    log.sync(comm);
    CHECK(mem.text() == "[rank 0/3] r0 a\n" + rank1_lines + rank2_lines);
    CHECK(comm.signatures() ==
          std::vector<std::string>{"all_gather Long[1]", "all_gather Int[8]"});  // 32 bytes -> 8 words
  }
  SUBCASE("a non-zero rank sends its lines and prints nothing") {
    loom::MemorySink mem;
    RecordingCommunicator comm(1, 3);
    comm.on_all_gather = loom::test::gather_strings_from({"[rank 0/3] x\n", "", rank2_lines}, 1);
    loom::Logger log{mem, loom::RankOrdered{},
                     loom::RankInfo{.rank = 1, .world_size = 3, .local_rank = 1, .local_world_size = 3}};
    log.info("r1 a\nr1 b");
    log.sync(comm);
    CHECK(mem.text().empty());
    const at::Tensor sent = comm.calls()[1].input;
    CHECK(std::string(reinterpret_cast<const char*>(sent.data_ptr<std::int32_t>()), rank1_lines.size()) == rank1_lines);
    CHECK(comm.calls()[0].input.item<std::int64_t>() == static_cast<std::int64_t>(rank1_lines.size()));
  }
  SUBCASE("lines never synced are written locally when the logger is destroyed") {
    loom::MemorySink mem;
    {
      loom::Logger log{mem, loom::RankOrdered{}, loom::RankInfo{.rank = 1, .world_size = 2}};
      log.info("late");
    }
    CHECK(mem.text() == "[rank 1/2] late\n");
  }
  SUBCASE("a communicator that is not this logger's rank is refused") {
    RecordingCommunicator comm(0, 2);
    loom::Logger log{loom::MemorySink{}, loom::RankOrdered{}, loom::RankInfo{.rank = 1, .world_size = 2}};
    CHECK_THROWS_WITH_AS(log.sync(comm), doctest::Contains("communicator is rank 0 of 2, the logger rank 1 of 2"),
                         loom::InvalidArgument);
  }
  SUBCASE("other policies: sync communicates nothing") {
    RecordingCommunicator comm(0, 2);
    loom::Logger log{loom::MemorySink{}, loom::AllRanks{}, loom::RankInfo{.rank = 0, .world_size = 2}};
    log.sync(comm);
    CHECK(comm.calls().empty());
  }
}

TEST_CASE("all_gather_strings over a real LocalCommunicator round-trips any bytes") {
  loom::LocalCommunicator comm;
  for (std::string s :
       {std::string{}, std::string("a"), std::string("abcd"), std::string("with\0nul", 8), std::string(1001, 'z')}) {
    auto out = loom::detail::all_gather_strings(comm, s);
    REQUIRE(out.size() == 1);
    CHECK(out[0] == s);
  }
}

TEST_CASE("FileSink: one file per rank, errors name the path or pattern") {
  const loom::test::TempDir tmp("loom-test-log-files");
  const auto& dir = tmp.path;
  for (int rank = 0; rank < 2; ++rank) {
    loom::Logger log{loom::FileSink::per_rank((dir / "train.{rank}.log").string(), rank),
                     loom::AllRanks{.with_prefix = false}, loom::RankInfo{.rank = rank, .world_size = 2}};
    log.info("hello from {}", rank);
    CHECK(log.sink().path() == (dir / fmt::format("train.{}.log", rank)).string());
  }
  CHECK(read_file(dir / "train.0.log") == "hello from 0\n");
  CHECK(read_file(dir / "train.1.log") == "hello from 1\n");
  {
    loom::FileSink again((dir / "train.0.log").string(), loom::FileSink::Mode::append);
    again.write("more\n");
  }
  CHECK(read_file(dir / "train.0.log") == "hello from 0\nmore\n");
  CHECK_THROWS_WITH_AS(loom::FileSink::per_rank("train.log", 0), doctest::Contains("'train.log' has no {rank}"),
                       loom::InvalidArgument);
  CHECK_THROWS_WITH_AS(loom::FileSink::per_rank("train.{rank}.{oops}.log", 0), doctest::Contains("does not format"),
                       loom::InvalidArgument);
  const std::string missing = (dir / "no" / "such" / "dir.log").string();
  const std::string expected = "cannot open log file '" + missing + "': No such file";
  CHECK_THROWS_WITH_AS(loom::FileSink{missing}, doctest::Contains(expected.c_str()), loom::InvalidArgument);
}

TEST_CASE("WeightedMean, field case 1: batches (0.7,256),(0.8,256),(0.9,10) on one rank -> 393/522") {
  loom::WeightedMean m;
  m.add(0.7, 256);
  m.add(0.8, 256);
  m.add(0.9, 10);
  // Hand computation: 0.7*256 + 0.8*256 + 0.9*10 = 179.2 + 204.8 + 9 = 393; 256+256+10 = 522.
  CHECK(m.weight() == 522.0);
  CHECK(m.local_mean() == doctest::Approx(393.0 / 522.0).epsilon(1e-14));
  CHECK(m.local_mean() == doctest::Approx(0.7528736).epsilon(1e-7));
  const double unweighted = (0.7 + 0.8 + 0.9) / 3;  // the bug: mean of batch means
  CHECK(unweighted == doctest::Approx(0.8));
  CHECK(std::abs(m.local_mean() - unweighted) > 0.04);
  loom::LocalCommunicator comm;
  CHECK(loom::global_mean(comm, m) == doctest::Approx(393.0 / 522.0).epsilon(1e-14));
}

TEST_CASE("global_mean, field case 2: rank 0 (1.0 x 3), rank 1 (1.0 x 2) -> exactly 1.0, one collective") {
  // Rank 0's view; the hook adds rank 1's contribution (weighted sum 2.0, weight 2).
  for (int me = 0; me < 2; ++me) {
    RecordingCommunicator comm(me, 2);
    const double other_sum = me == 0 ? 2.0 : 3.0, other_weight = me == 0 ? 2.0 : 3.0;
    comm.on_all_reduce = [&](at::Tensor& t, loom::ReduceOp op) {
      REQUIRE(op == loom::ReduceOp::sum);
      t[0] += other_sum;
      t[1] += other_weight;
    };
    loom::WeightedMean m;
    m.add(1.0, me == 0 ? 3 : 2);
    const double mean = loom::global_mean(comm, m);
    CHECK(mean == 1.0);  // exact: 5.0 / 5.0
    REQUIRE(comm.calls().size() == 1);
    CHECK(comm.signatures()[0] == "all_reduce(sum) Double[2]");
    CHECK(comm.calls()[0].input[0].item<double>() == (me == 0 ? 3.0 : 2.0));
  }
}

TEST_CASE("global_means: several metrics in one collective; errors") {
  RecordingCommunicator comm(0, 2);  // default: the other rank holds the same values
  std::array<loom::WeightedMean, 3> ms;
  ms[0].add(2.0, 4);
  ms[1].add(1.0);
  ms[1].add(0.0);
  ms[2].add(-3.0, 0.5);
  const auto means = loom::global_means(comm, ms);
  CHECK(means == std::vector<double>{2.0, 0.5, -3.0});
  CHECK(comm.signatures() == std::vector<std::string>{"all_reduce(sum) Double[6]"});
  loom::WeightedMean empty;
  CHECK_THROWS_WITH_AS((void)loom::global_mean(comm, empty),
                       "loom: global_means: metric 0 has total weight 0 over 2 rank(s)", loom::InvalidArgument);
  CHECK_THROWS_WITH_AS((void)empty.local_mean(), doctest::Contains("no weight was added"), loom::InvalidArgument);
  CHECK_THROWS_WITH_AS(empty.add(1.0, -2), doctest::Contains("weight -2 is negative or not finite"),
                       loom::InvalidArgument);
  CHECK(loom::global_means(comm, std::span<const loom::WeightedMean>{}).empty());
  ms[0].reset();
  CHECK(ms[0].weight() == 0.0);
}

TEST_CASE("main_process_first on one process: runs once, returns the value, rethrows the block's own error") {
  loom::LocalCommunicator comm;
  int runs = 0;
  const int v = loom::main_process_first(comm, [&] {
    ++runs;
    return 42;
  });
  CHECK(v == 42);
  CHECK(runs == 1);
  loom::main_process_first(comm, [&] { ++runs; });
  CHECK(runs == 2);
  CHECK_THROWS_WITH_AS(loom::main_process_first(comm, []() -> int { throw std::out_of_range("cache index 7"); }),
                       "cache index 7", std::out_of_range);
  CHECK_THROWS_WITH_AS(loom::main_process_first(comm, loom::RankInfo{.rank = 1, .world_size = 2}, [] {}),
                       doctest::Contains("the communicator is rank 0 of 1, RankInfo says rank 1 of 2"),
                       loom::InvalidArgument);
}

TEST_CASE("main_process_first as a non-leader: waits for the leader, then runs; same collectives as the leader") {
  std::vector<std::string> events;
  RecordingCommunicator leader_comm(0, 2), follower_comm(1, 2);
  for (auto* c : {&leader_comm, &follower_comm}) {
    c->on_all_reduce = [&events, c](at::Tensor&, loom::ReduceOp) {
      events.push_back(fmt::format("rank {} collective", c->rank()));
    };
  }
  loom::main_process_first(leader_comm, [&] { events.emplace_back("rank 0 block"); });
  loom::main_process_first(follower_comm, [&] { events.emplace_back("rank 1 block"); });
  CHECK(events == std::vector<std::string>{"rank 0 block", "rank 0 collective", "rank 0 collective",
                                           "rank 1 collective", "rank 1 block", "rank 1 collective"});
  CHECK(leader_comm.signatures() == follower_comm.signatures());
  CHECK(leader_comm.signatures() == std::vector<std::string>{"all_reduce(sum) Double[1]", "all_reduce(sum) Double[1]"});
}

TEST_CASE("main_process_first: rank 0's exception reaches rank 1 as RemoteError, and rank 1 does not run the block") {
  RecordingCommunicator comm(1, 2);
  int reduces = 0;
  comm.on_all_reduce = [&](at::Tensor& t, loom::ReduceOp) {
    if (++reduces == 1) t[0] += 1.0;  // phase 1: rank 0 reports a failure
  };
  comm.on_all_gather = loom::test::gather_strings_from({"cache directory /data is read-only", ""}, 1);
  bool ran = false;
  CHECK_THROWS_WITH_AS(loom::main_process_first(comm, [&] { ran = true; }),
                       "loom: main_process_first: the block failed on rank 0 so rank 1 did not run it: "
                       "rank 0: cache directory /data is read-only",
                       loom::RemoteError);
  CHECK_FALSE(ran);
  CHECK(comm.signatures() ==
        std::vector<std::string>{"all_reduce(sum) Double[1]", "all_gather Long[1]", "all_gather Int[9]"});
}

TEST_CASE("main_process_first: a follower's failure reaches the leader too (phase 2)") {
  RecordingCommunicator comm(0, 3);
  int reduces = 0;
  comm.on_all_reduce = [&](at::Tensor& t, loom::ReduceOp) {
    if (++reduces == 2) t[0] += 1.0;  // phase 2: rank 2 reports a failure
  };
  comm.on_all_gather = loom::test::gather_strings_from({"", "", "disk full"}, 0);
  CHECK_THROWS_WITH_AS(
      loom::main_process_first(comm, [] {}),
      "loom: main_process_first: the block failed on another rank (rank 0 succeeded): rank 2: disk full",
      loom::RemoteError);
}

TEST_CASE("main_process_first per node: local rank 0 leads") {
  for (int rank = 0; rank < 4; ++rank) {
    RecordingCommunicator comm(rank, 4);
    std::vector<std::string> events;
    comm.on_all_reduce = [&](at::Tensor&, loom::ReduceOp) { events.emplace_back("collective"); };
    const loom::RankInfo me{.rank = rank, .world_size = 4, .local_rank = rank % 2, .local_world_size = 2};
    loom::main_process_first(
        comm, me, [&] { events.emplace_back("block"); }, loom::Leader::local_rank_zero);
    const bool leads = rank % 2 == 0;
    CHECK(events == (leads ? std::vector<std::string>{"block", "collective", "collective"}
                           : std::vector<std::string>{"collective", "block", "collective"}));
  }
}

TEST_CASE("Progress, non-terminal: a plain line every N seconds with global samples, rate and ETA") {
  ManualClock clock;
  loom::MemorySink out;              // not a terminal
  RecordingCommunicator comm(0, 2);  // the other rank did as many samples as this one
  loom::Progress p{out,
                   loom::RankInfo{.rank = 0, .world_size = 2, .local_rank = 0, .local_world_size = 2},
                   {.total = 200, .label = "train", .line_interval = std::chrono::seconds(5), .sync_every = 1},
                   clock};
  CHECK_FALSE(p.live_bar());
  for (int s = 1; s <= 10; ++s) {
    clock.advance(std::chrono::seconds(1));
    p.step(comm, 10);
    if (s == 4) CHECK(out.text().empty());
  }
  p.finish(comm);
  // By hand: at t=5 s, 2 ranks x 50 samples = 100 of 200 (50%), 20 samples/s, ETA 100/20 = 5 s;
  // at t=10 s, 200 samples (100%), 20 samples/s, ETA 0.
  CHECK(out.lines() == std::vector<std::string>{
                           "train: 100/200 samples (50.0%), 20.0 samples/s, elapsed 0:00:05, ETA 0:00:05",
                           "train: 200/200 samples (100.0%), 20.0 samples/s, elapsed 0:00:10, ETA 0:00:00",
                           "train: done, 200 samples in 0:00:10, 20.0 samples/s",
                       });
  CHECK(p.global_samples() == 200);
  CHECK(p.local_samples() == 100);
  CHECK(comm.calls().size() == 11);  // 10 steps + finish
}

TEST_CASE("Progress: sums only every sync_every steps, the same collectives on shown and silent ranks") {
  std::vector<std::vector<std::string>> sigs;
  for (int rank = 0; rank < 2; ++rank) {
    ManualClock clock;
    loom::MemorySink out;
    RecordingCommunicator comm(rank, 2);
    comm.on_all_reduce = [&](at::Tensor& t, loom::ReduceOp) { t[0] += 1000.0; };  // the other rank: 1000 samples so far
    loom::Progress p{out,
                     loom::RankInfo{.rank = rank, .world_size = 2},
                     {.label = "eval", .line_interval = std::chrono::seconds(0), .sync_every = 3},
                     clock};
    for (int s = 0; s < 7; ++s) {
      clock.advance(std::chrono::milliseconds(500));
      p.step(comm, 1);
    }
    p.finish(comm);
    sigs.push_back(comm.signatures());
    CHECK(comm.calls().size() == 3);  // after steps 3 and 6, and finish
    CHECK(comm.calls()[0].input.item<double>() == 3.0);
    CHECK(comm.calls()[2].input.item<double>() == 7.0);
    if (rank == 0) {
      // Unknown total: no percentage, no ETA. Step 3 at 1.5 s: 1003 samples; step 6 at 3 s: 1006; finish at 3.5 s: 1007.
      CHECK(out.lines() == std::vector<std::string>{
                               "eval: 1003 samples, 668.7 samples/s, elapsed 0:00:02",
                               "eval: 1006 samples, 335.3 samples/s, elapsed 0:00:03",
                               "eval: done, 1007 samples in 0:00:04, 287.7 samples/s",
                           });
    } else {
      CHECK(out.text().empty());
    }
  }
  CHECK(sigs[0] == sigs[1]);
}

TEST_CASE("Progress, terminal: a live bar redrawn in place, throttled, ending with a newline") {
  ManualClock clock;
  loom::MemorySink tty(true);
  loom::LocalCommunicator comm;
  loom::Progress p{
      tty,
      loom::RankInfo{},
      {.total = 40, .label = "fit", .redraw_interval = std::chrono::seconds(1), .sync_every = 1, .bar_width = 10},
      clock};
  CHECK(p.live_bar());
  for (int s = 0; s < 4; ++s) {
    clock.advance(std::chrono::milliseconds(500));
    p.step(comm, 10);
  }
  p.finish(comm);
  // Redraws at 0.5 s (10 samples) and 1.5 s (30); 1.0 s and 2.0 s fall inside the 1 s throttle; finish draws 40.
  CHECK(tty.text() ==
        "\rfit [##--------]  25.0% 10/40, 20.0 samples/s, ETA 0:00:02\x1b[K"
        "\rfit [#######---]  75.0% 30/40, 20.0 samples/s, ETA 0:00:01\x1b[K"
        "\rfit [##########] 100.0% 40/40, 20.0 samples/s, elapsed 0:00:02\x1b[K\n");
  CHECK(tty.writes() == 3);
}

TEST_CASE(
    "Progress bar and Logger on one terminal: the Logger's line replaces the open bar line, the bar goes on below") {
  ManualClock clock;
  loom::MemorySink tty(true);
  loom::LocalCommunicator comm;
  loom::Logger log(tty, loom::RankInfo{});
  {
    loom::Progress p{
        tty,
        loom::RankInfo{},
        {.total = 20, .label = "fit", .redraw_interval = std::chrono::seconds(1), .sync_every = 1, .bar_width = 4},
        clock};
    clock.advance(std::chrono::seconds(1));
    p.step(comm, 10);
    log.info("epoch 0 loss {:.1f}", 0.5);  // replaces the bar's open line
    clock.advance(std::chrono::seconds(1));
    p.step(comm, 10);
    p.finish(comm);
  }
  log.info("done");  // the bar's line ended: nothing to replace
  CHECK(tty.text() ==
        "\rfit [##--]  50.0% 10/20, 10.0 samples/s, ETA 0:00:01\x1b[K"
        "\r\x1b[Kepoch 0 loss 0.5\n"
        "\rfit [####] 100.0% 20/20, 10.0 samples/s, ETA 0:00:00\x1b[K"
        "\rfit [####] 100.0% 20/20, 10.0 samples/s, elapsed 0:00:02\x1b[K\n"
        "done\n");
  // A Logger on a sink that is no terminal never writes the control characters.
  loom::MemorySink file;
  loom::Logger to_file(file, loom::RankInfo{});
  loom::detail::bar_line_open() = true;
  to_file.info("x");
  CHECK(file.text() == "x\n");
  loom::detail::bar_line_open() = false;
}

TEST_CASE("Progress per node: leaders' lines carry their rank; options are validated") {
  ManualClock clock;
  loom::MemorySink out;
  loom::LocalCommunicator comm;
  loom::Progress p{out,
                   loom::RankInfo{},
                   {.total = 10,
                    .label = "x",
                    .line_interval = std::chrono::seconds(1),
                    .sync_every = 1,
                    .shown_on = loom::Leader::local_rank_zero},
                   clock};
  clock.advance(std::chrono::seconds(2));
  p.step(comm, 5);
  CHECK(out.lines().at(0) == "[rank 0/1] x: 5/10 samples (50.0%), 2.5 samples/s, elapsed 0:00:02, ETA 0:00:02");
  CHECK_THROWS_WITH_AS(p.step(comm, -1), "loom: Progress::step: local_samples -1 is negative", loom::InvalidArgument);
  p.finish(comm);
  CHECK_THROWS_WITH_AS(p.step(comm, 1), doctest::Contains("after finish()"), loom::InvalidArgument);
  CHECK_THROWS_WITH_AS((loom::Progress{out, loom::RankInfo{}, {.sync_every = 0}}),
                       doctest::Contains("sync_every 0 is < 1"), loom::InvalidArgument);
  CHECK_THROWS_WITH_AS((loom::Progress{out, loom::RankInfo{}, {.total = -5}}),
                       doctest::Contains("total -5 is negative"), loom::InvalidArgument);
  CHECK(loom::detail::format_hms(3725.4) == "1:02:05");
  CHECK(loom::detail::format_hms(-1) == "?");
}

}  // namespace test_log
