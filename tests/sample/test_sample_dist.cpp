// Multi-rank tests of loom/sample with real processes (loom::spawn, through loom::test::run_ranks)
// over Gloo on loopback: distributed evaluation gathers, sampler agreement across ranks, and bad
// input on one rank. Ranks write what they saw to files; the parent process checks them.
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <doctest/doctest.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>

#include <loom/comm/gloo.hpp>
#include <loom/sample/all.hpp>

#include "support/ranks.hpp"
#include "support/temp_dir.hpp"

namespace fs = std::filesystem;

namespace {

using loom::test::write_file;

const loom::test::RankOptions kRanks{.comm_timeout = std::chrono::seconds(30),
                                     .spawn_timeout = std::chrono::seconds(120)};

}  // namespace

TEST_CASE("multi-rank: gather_results over Gloo returns each sample once, in dataset order (3 ranks)") {
  loom::test::TempDir dir("loom-sample");
  const fs::path d = dir.path;
  loom::test::run_ranks(
      3,
      [d](loom::GlooCommunicator& comm, const loom::Environment& env) {
        const int64_t n = 10;
        auto s = loom::DistributedSampler::for_communicator(comm, {.dataset_size = n, .shuffle = true, .seed = 3});
        s.set_epoch(2);
        std::vector<int64_t> seen;
        std::vector<float> rows;
        while (auto i = s.next()) {
          seen.push_back(*i);
          rows.push_back(static_cast<float>(*i) * 10.f);  // "the model's loss for sample i" = 10 i
        }
        auto g = loom::gather_results(comm, seen, torch::tensor(rows), {.dataset_size = n});
        // Variable lengths: rank r contributes r rows (rank 0 none), indices 100 r + k.
        std::vector<int64_t> mine;
        for (int k = 0; k < env.rank; ++k) mine.push_back(100 * env.rank + k);
        auto vals = torch::empty({env.rank, 2}, torch::kLong);
        for (int k = 0; k < env.rank; ++k) {
          vals[k][0] = mine[static_cast<std::size_t>(k)];
          vals[k][1] = -mine[static_cast<std::size_t>(k)];
        }
        auto v = loom::gather_results(comm, mine, vals);
        write_file(
            d / fmt::format("rank{}", env.rank),
            fmt::format(
                "{}|{}|{}|{}|{}", fmt::join(g.indices, ","), g.duplicates_dropped,
                fmt::join(std::vector<float>(g.values.data_ptr<float>(), g.values.data_ptr<float>() + g.values.numel()),
                          ","),
                fmt::join(v.indices, ","),
                fmt::join(
                    std::vector<int64_t>(v.values.data_ptr<int64_t>(), v.values.data_ptr<int64_t>() + v.values.numel()),
                    ",")));
      },
      kRanks);
  for (int r = 0; r < 3; ++r)
    CHECK(dir.read(fmt::format("rank{}", r)) ==
          "0,1,2,3,4,5,6,7,8,9|2|0,10,20,30,40,50,60,70,80,90|100,200,201|100,-100,200,-200,201,-201");
}

TEST_CASE("multi-rank: samplers agree across ranks and every rank runs the same number of steps (3 ranks)") {
  loom::test::TempDir dir("loom-sample");
  const fs::path d = dir.path;
  std::vector<int64_t> lengths;
  for (int64_t i = 0; i < 97; ++i) lengths.push_back(1 + (i * 37) % 41);
  loom::test::run_ranks(
      3,
      [d, lengths](loom::GlooCommunicator& comm, const loom::Environment& env) {
        // DistributedSampler: the same permutation on every rank (compare rank 0's over the wire).
        auto ds = loom::DistributedSampler::for_communicator(comm, {.dataset_size = 50, .seed = 21});
        ds.set_epoch(6);
        const auto global = ds.global_indices();
        auto mine = torch::tensor(global, torch::kLong);
        comm.broadcast(mine, 0);
        if (!torch::equal(mine, torch::tensor(global, torch::kLong)))
          throw std::runtime_error("DistributedSampler permutations differ");
        // Bucket batch sampler: run its steps with a real collective per step (a rank with fewer
        // steps would hang or time out), summing the weighted sample counts.
        std::vector<std::vector<int64_t>> shapes;
        for (int64_t l : lengths) shapes.push_back({l});
        auto s = loom::DistributedBucketBatchSampler::for_communicator(
            comm, shapes, {.seed = 8, .pad = {{.dim = 0}}, .max_elements = 120});
        s.set_epoch(1);
        int64_t steps = 0;
        std::vector<int64_t> counted;
        auto total = torch::zeros({1}, torch::kDouble);
        while (auto b = s.next()) {
          auto t = torch::tensor({b->weight * static_cast<double>(b->indices.size())}, torch::kDouble);
          comm.all_reduce(t, loom::ReduceOp::sum);
          total += t;
          ++steps;
          if (b->weight == 1.0) counted.insert(counted.end(), b->indices.begin(), b->indices.end());
        }
        write_file(d / fmt::format("rank{}", env.rank),
                   fmt::format("{}|{}|{}", steps, total.item<double>(), fmt::join(counted, ",")));
      },
      kRanks);
  std::multiset<int64_t> all;
  std::string steps0;
  for (int r = 0; r < 3; ++r) {
    const std::string text = dir.read(fmt::format("rank{}", r));
    const auto a = text.find('|'), b = text.find('|', a + 1);
    const std::string steps = text.substr(0, a);
    if (r == 0) steps0 = steps;
    CHECK(steps == steps0);
    CHECK(text.substr(a + 1, b - a - 1) == "97");  // weighted samples summed over ranks and steps
    std::stringstream ss(text.substr(b + 1));
    for (std::string tok; std::getline(ss, tok, ',');)
      if (!tok.empty()) all.insert(std::stoll(tok));
  }
  CHECK(all.size() == 97);
  CHECK(std::set<int64_t>(all.begin(), all.end()).size() == 97);
}

TEST_CASE("multi-rank: a bad index on one rank makes every rank throw loom::InvalidArgument, not time out") {
  loom::test::TempDir dir("loom-sample");
  const fs::path d = dir.path;
  loom::test::run_ranks(
      2,
      [d](loom::GlooCommunicator& comm, const loom::Environment& env) {
        std::vector<int64_t> idx{env.rank == 1 ? int64_t{-4} : int64_t{0}};
        try {
          (void)loom::gather_results(comm, idx, torch::zeros({1, 3}), {.dataset_size = 4});
          write_file(d / fmt::format("rank{}", env.rank), "no error");
        } catch (const loom::InvalidArgument& e) {
          write_file(d / fmt::format("rank{}", env.rank), e.what());
        }
        comm.barrier();  // the communicator still works: nobody is stuck in a collective
      },
      kRanks);
  for (int r = 0; r < 2; ++r)
    CHECK(dir.read(fmt::format("rank{}", r)) == "loom: gather_results: rank 1 passed index -4, outside [0, 4)");
}
