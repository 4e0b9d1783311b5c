// Multi-rank tests of loom/sample with real processes (loom::spawn) over Gloo on loopback:
// distributed evaluation gathers, sampler agreement across ranks, and bad input on one rank.
// Ranks write what they saw to files; the parent process checks them.
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include <loom/comm/gloo.hpp>
#include <loom/dist/spawn.hpp>
#include <loom/sample/all.hpp>

namespace fs = std::filesystem;

namespace {

struct TempDir {
  fs::path path;
  TempDir() {
    std::string templ = (fs::temp_directory_path() / "loom-sample-XXXXXX").string();
    REQUIRE(mkdtemp(templ.data()) != nullptr);
    path = templ;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  [[nodiscard]] std::string read(const std::string& name) const {
    std::ifstream in(path / name);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }
};

void write_file(const fs::path& p, const std::string& text) {
  std::ofstream out(p);
  out << text;
}

const loom::GlooOptions kGloo{.timeout = std::chrono::seconds(30)};
const loom::SpawnOptions kSpawn{.timeout = std::chrono::seconds(120)};

}  // namespace

TEST_CASE("multi-rank: gather_results over Gloo returns each sample once, in dataset order (3 ranks)") {
  TempDir dir;
  const fs::path d = dir.path;
  loom::spawn(
      3,
      [d](const loom::Environment& env) {
        loom::GlooCommunicator comm(env, kGloo);
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
        write_file(d / fmt::format("rank{}", env.rank),
                   fmt::format("{}|{}|{}|{}|{}", fmt::join(g.indices, ","), g.duplicates_dropped,
                               fmt::join(std::vector<float>(g.values.data_ptr<float>(), g.values.data_ptr<float>() + g.values.numel()), ","),
                               fmt::join(v.indices, ","),
                               fmt::join(std::vector<int64_t>(v.values.data_ptr<int64_t>(), v.values.data_ptr<int64_t>() + v.values.numel()), ",")));
      },
      kSpawn);
  for (int r = 0; r < 3; ++r)
    CHECK(dir.read(fmt::format("rank{}", r)) == "0,1,2,3,4,5,6,7,8,9|2|0,10,20,30,40,50,60,70,80,90|100,200,201|100,-100,200,-200,201,-201");
}

TEST_CASE("multi-rank: samplers agree across ranks and every rank runs the same number of steps (3 ranks)") {
  TempDir dir;
  const fs::path d = dir.path;
  std::vector<int64_t> lengths;
  for (int64_t i = 0; i < 97; ++i) lengths.push_back(1 + (i * 37) % 41);
  loom::spawn(
      3,
      [d, lengths](const loom::Environment& env) {
        loom::GlooCommunicator comm(env, kGloo);
        // DistributedSampler: the same permutation on every rank (compare rank 0's over the wire).
        auto ds = loom::DistributedSampler::for_communicator(comm, {.dataset_size = 50, .seed = 21});
        ds.set_epoch(6);
        const auto global = ds.global_indices();
        auto mine = torch::tensor(global, torch::kLong);
        comm.broadcast(mine, 0);
        if (!torch::equal(mine, torch::tensor(global, torch::kLong))) throw std::runtime_error("DistributedSampler permutations differ");
        // Bucket batch sampler: run its steps with a real collective per step (a rank with fewer
        // steps would hang or time out), summing the weighted sample counts.
        std::vector<std::vector<int64_t>> shapes;
        for (int64_t l : lengths) shapes.push_back({l});
        auto s = loom::DistributedBucketBatchSampler::for_communicator(comm, shapes, {.seed = 8, .pad = {{.dim = 0}}, .max_elements = 120});
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
        write_file(d / fmt::format("rank{}", env.rank), fmt::format("{}|{}|{}", steps, total.item<double>(), fmt::join(counted, ",")));
      },
      kSpawn);
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
  TempDir dir;
  const fs::path d = dir.path;
  loom::spawn(
      2,
      [d](const loom::Environment& env) {
        loom::GlooCommunicator comm(env, kGloo);
        std::vector<int64_t> idx{env.rank == 1 ? int64_t{-4} : int64_t{0}};
        try {
          (void)loom::gather_results(comm, idx, torch::zeros({1, 3}), {.dataset_size = 4});
          write_file(d / fmt::format("rank{}", env.rank), "no error");
        } catch (const loom::InvalidArgument& e) {
          write_file(d / fmt::format("rank{}", env.rank), e.what());
        }
        comm.barrier();  // the communicator still works: nobody is stuck in a collective
      },
      kSpawn);
  for (int r = 0; r < 2; ++r)
    CHECK(dir.read(fmt::format("rank{}", r)) == "loom: gather_results: rank 1 passed index -4, outside [0, 4)");
}
