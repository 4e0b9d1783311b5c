// Tests of loom/sample in one process: DistributedSampler against PyTorch's conventions, the
// distributed bucket batch sampler's guarantees, resuming, the concept ladder, and gather_results
// over a thread-group communicator archetype. Real multi-process runs: test_sample_dist.cpp.
#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <doctest/doctest.h>
#include <torch/torch.h>

#include <loom/collate/all.hpp>
#include <loom/comm/local.hpp>
#include <loom/sample/all.hpp>

#include "reference/sample_reference.hpp"
#include "support/thread_communicator.hpp"

namespace test_sample {

namespace {

std::vector<int64_t> drain(loom::DistributedSampler& s) {
  std::vector<int64_t> v;
  while (auto i = s.next()) v.push_back(*i);
  return v;
}

loom::DistributedSampler make(int64_t n, int r, int rank, bool shuffle, bool drop_last = false, uint64_t seed = 0) {
  return loom::DistributedSampler(
      {.dataset_size = n, .num_replicas = r, .rank = rank, .shuffle = shuffle, .seed = seed, .drop_last = drop_last});
}

// ---- concept ladder: models and non-models ----
struct OnlySampler {
  using value_type = int64_t;
  void set_epoch(int64_t) {}
  [[nodiscard]] int64_t size() const { return 0; }
  std::optional<int64_t> next() { return std::nullopt; }
};
struct NextNotOptional {
  using value_type = int64_t;
  void set_epoch(int64_t) {}
  [[nodiscard]] int64_t size() const { return 0; }
  int64_t next() { return 0; }
};
struct NoEpoch {
  using value_type = int64_t;
  [[nodiscard]] int64_t size() const { return 0; }
  std::optional<int64_t> next() { return std::nullopt; }
};
static_assert(loom::Sampler<OnlySampler> && !loom::ResumableSampler<OnlySampler>);
static_assert(!loom::Sampler<NextNotOptional>);
static_assert(!loom::Sampler<NoEpoch>);
static_assert(!loom::Sampler<std::vector<int64_t>>);
static_assert(loom::ResumableSampler<loom::DistributedSampler>);
static_assert(loom::ResumableSampler<loom::DistributedBucketBatchSampler>);

}  // namespace

// =============================================================================================
TEST_CASE("DistributedSampler: N=10, world 3, no shuffle: PyTorch's indices, with and without drop_last") {
  CHECK(make(10, 3, 0, false).indices() == std::vector<int64_t>{0, 3, 6, 9});
  CHECK(make(10, 3, 1, false).indices() == std::vector<int64_t>{1, 4, 7, 0});
  CHECK(make(10, 3, 2, false).indices() == std::vector<int64_t>{2, 5, 8, 1});
  for (int r = 0; r < 3; ++r) {
    auto s = make(10, 3, r, false, true);
    CHECK(s.size() == 3);
    CHECK(drain(s).size() == 3);
  }
  CHECK(make(10, 3, 2, false, true).indices() == std::vector<int64_t>{2, 5, 8});
  // Against a line-by-line translation of the Python sampler, many (N, R, drop_last).
  for (int64_t n : {1, 2, 3, 5, 9, 10, 12, 17}) {
    for (int r : {1, 2, 3, 4, 7, 11}) {
      for (bool drop : {false, true}) {
        for (int rank = 0; rank < r; ++rank) {
          auto s = make(n, r, rank, false, drop);
          const auto ref = loom_ref::py_distributed_sampler(n, r, rank, drop);
          CHECK(s.indices() == ref);
          CHECK(s.size() == static_cast<int64_t>(ref.size()));
        }
      }
    }
  }
}

TEST_CASE("field case: DistributedSampler N=3, world 7: the index list repeats as often as needed") {
  const std::vector<std::vector<int64_t>> expected{{0}, {1}, {2}, {0}, {1}, {2}, {0}};
  for (int r = 0; r < 7; ++r) CHECK(make(3, 7, r, false).indices() == expected[static_cast<std::size_t>(r)]);
  CHECK(make(3, 7, 0, false).global_indices() == std::vector<int64_t>{0, 1, 2, 0, 1, 2, 0});
  CHECK(make(3, 7, 4, false, true).size() == 0);  // drop_last with N < R: nothing, on every rank
}

TEST_CASE("DistributedSampler: shuffle with seed + epoch; every index once when N divides evenly") {
  const int64_t n = 12;
  const int r = 3;
  for (int64_t epoch : {0, 1, 5}) {
    std::vector<loom::DistributedSampler> ranks;
    for (int k = 0; k < r; ++k) ranks.push_back(make(n, r, k, true, false, 42));
    std::multiset<int64_t> all;
    for (auto& s : ranks) {
      s.set_epoch(epoch);
      auto v = drain(s);
      CHECK(v.size() == 4);
      all.insert(v.begin(), v.end());
      CHECK(s.global_indices() == ranks[0].global_indices());  // same permutation on every rank
    }
    CHECK(all == std::multiset<int64_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11});
    // The permutation is ATen's randperm with a CPU generator seeded seed + epoch (as PyTorch's sampler).
    auto gen = at::make_generator<at::CPUGeneratorImpl>(42 + static_cast<uint64_t>(epoch));
    auto perm = torch::randperm(n, gen, torch::kLong);
    CHECK(ranks[0].global_indices() == std::vector<int64_t>(perm.data_ptr<int64_t>(), perm.data_ptr<int64_t>() + n));
    CHECK(loom_ref::py_distributed_sampler(n, r, 1, false, ranks[1].global_indices()) == ranks[1].indices());
  }
  auto a = make(100, 2, 0, true, false, 1), b = make(100, 2, 0, true, false, 1);
  b.set_epoch(1);
  CHECK(a.indices() != b.indices());  // a new epoch reshuffles
  auto c = make(100, 2, 0, true, false, 2);
  CHECK(a.indices() != c.indices());  // another seed, another order
}

TEST_CASE("DistributedSampler: a state saved mid-epoch resumes to the uninterrupted sequence") {
  auto full = make(25, 3, 2, true, false, 9);
  full.set_epoch(4);
  const auto expected = drain(full);
  auto first = make(25, 3, 2, true, false, 9);
  first.set_epoch(4);
  std::vector<int64_t> got;
  for (int k = 0; k < 3; ++k) got.push_back(*first.next());
  const std::string saved = loom::to_string(first.state());
  CHECK(saved == "loom-sampler v1 seed=9 epoch=4 position=3 dataset_size=25 num_replicas=3 rank=2 fingerprint=" +
                     std::to_string(first.state().fingerprint));
  auto resumed = make(25, 3, 2, true, false, 9);  // a fresh process: epoch 0, position 0
  resumed.load_state(loom::parse_sampler_state(saved));
  for (auto i : drain(resumed)) got.push_back(i);
  CHECK(got == expected);
  // A state of another configuration is refused, naming the field.
  auto other = make(25, 3, 2, true, false, 10);
  CHECK_THROWS_WITH_AS(other.load_state(first.state()), doctest::Contains("seed = 9 into a sampler with seed = 10"),
                       loom::InvalidArgument);
  auto dl = make(25, 3, 2, true, true, 9);
  CHECK_THROWS_WITH_AS(dl.load_state(first.state()), doctest::Contains("fingerprint"), loom::InvalidArgument);
  CHECK_THROWS_WITH_AS(loom::parse_sampler_state("loom-sampler v1 seed=x"),
                       doctest::Contains("field 'seed' is not a number"), loom::InvalidArgument);
}

TEST_CASE("DistributedSampler: bad input") {
  CHECK_THROWS_WITH_AS(make(0, 2, 0, false), doctest::Contains("dataset_size = 0 (the dataset is empty)"),
                       loom::InvalidArgument);
  CHECK_THROWS_WITH_AS(make(10, 3, 3, false), doctest::Contains("rank 3 is outside [0, 3)"), loom::InvalidArgument);
  CHECK_THROWS_WITH_AS(make(10, 0, 0, false), doctest::Contains("num_replicas = 0"), loom::InvalidArgument);
  auto s = make(10, 1, 0, false);
  CHECK_THROWS_WITH_AS(s.set_epoch(-1), doctest::Contains("epoch -1 is negative"), loom::InvalidArgument);
  loom::LocalCommunicator local;
  auto fc = loom::DistributedSampler::for_communicator(local, {.dataset_size = 5, .num_replicas = 4, .rank = 3});
  CHECK(fc.options().num_replicas == 1);
  CHECK(fc.size() == 5);
}

// ---- bucket batch sampler ---------------------------------------------------------------------
namespace {
std::vector<int64_t> random_lengths(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int64_t> len(1, 50);
  std::vector<int64_t> v;
  for (int64_t i = 0; i < n; ++i) v.push_back(len(rng));
  return v;
}
}  // namespace

TEST_CASE("bucket batch sampler: every sample in exactly one weight-1 batch; all ranks the same step count") {
  const int64_t n = 203;
  const auto lengths = random_lengths(n, 1);
  for (int r : {1, 2, 3, 5, 8}) {
    for (auto surplus : {loom::SurplusPolicy::repeat, loom::SurplusPolicy::idle}) {
      for (bool shuffle : {false, true}) {
        std::vector<loom::DistributedBucketBatchSampler> ranks;
        for (int k = 0; k < r; ++k)
          ranks.emplace_back(lengths, loom::BucketBatchSamplerOptions{.num_replicas = r,
                                                                      .rank = k,
                                                                      .shuffle = shuffle,
                                                                      .seed = 3,
                                                                      .pad = {{.dim = 0}},
                                                                      .max_elements = 256,
                                                                      .multiple_of = 2,
                                                                      .surplus = surplus});
        std::multiset<int64_t> counted;
        std::set<int64_t> plan_ids;
        for (auto& s : ranks) {
          s.set_epoch(7);
          CHECK(s.size() == ranks[0].size());
          CHECK((s.plan() == ranks[0].plan()));  // every rank computed the same plan
          int64_t steps = 0;
          while (auto b = s.next()) {
            CHECK(b->step == steps);
            ++steps;
            if (b->weight == 1.0) {
              counted.insert(b->indices.begin(), b->indices.end());
              CHECK(plan_ids.insert(b->batch_id).second);
              int64_t longest = 0;
              for (int64_t i : b->indices) longest = std::max(longest, lengths[static_cast<std::size_t>(i)]);
              CHECK(b->padded_shape == std::vector<int64_t>{longest});
              CHECK(longest * static_cast<int64_t>(b->indices.size()) <= 256);
            } else {
              CHECK(b->weight == 0.0);
              if (surplus == loom::SurplusPolicy::repeat) {
                CHECK(b->repeated);
                CHECK(b->indices == s.plan()[static_cast<std::size_t>(b->batch_id)].indices);
              } else {
                CHECK(b->idle);
                CHECK(b->indices.empty());
              }
            }
          }
          CHECK(steps == s.size());
        }
        CHECK(counted.size() == static_cast<std::size_t>(n));
        CHECK(std::set<int64_t>(counted.begin(), counted.end()).size() == static_cast<std::size_t>(n));
        const auto b = static_cast<int64_t>(ranks[0].plan().size());
        CHECK(ranks[0].size() == (b + r - 1) / r);
        CHECK(static_cast<int64_t>(plan_ids.size()) == b);
      }
    }
  }
}

TEST_CASE("bucket batch sampler: SurplusPolicy::drop runs B / R steps and counts what it left out") {
  const auto lengths = random_lengths(101, 2);
  const int r = 4;
  int64_t seen = 0, dropped = -1;
  for (int k = 0; k < r; ++k) {
    loom::DistributedBucketBatchSampler s(
        lengths, {.num_replicas = r, .rank = k, .seed = 1, .max_samples = 8, .surplus = loom::SurplusPolicy::drop});
    CHECK(s.size() == static_cast<int64_t>(s.plan().size()) / r);
    while (auto b = s.next()) {
      CHECK(b->weight == 1.0);
      seen += static_cast<int64_t>(b->indices.size());
    }
    dropped = s.dropped_samples();
  }
  CHECK(seen + dropped == 101);
}

TEST_CASE("field case: steps per epoch are computed per bucket, never from the dataset size") {
  std::vector<std::vector<int64_t>> shapes(13, std::vector<int64_t>{2, 2});
  shapes.insert(shapes.end(), 3, std::vector<int64_t>{3, 3});
  loom::DistributedBucketBatchSampler keep(shapes, {.shuffle = false, .max_samples = 4});
  CHECK(keep.size() == 5);  // A: 4, 4, 4, 1 and B: 3 -- not 16 / 4 = 4
  std::vector<int64_t> sizes;
  for (const auto& b : keep.batches()) sizes.push_back(static_cast<int64_t>(b.indices.size()));
  CHECK(sizes == std::vector<int64_t>{4, 4, 4, 1, 3});
  loom::DistributedBucketBatchSampler drop(shapes, {.shuffle = false, .max_samples = 4, .drop_incomplete = true});
  CHECK(drop.size() == 3);
  CHECK(drop.dropped_samples() == 4);
  CHECK(drop.plan_stats().dropped_incomplete == 4);
  loom::DistributedBucketBatchSampler two(shapes, {.num_replicas = 2, .rank = 1, .shuffle = true, .max_samples = 4});
  CHECK(two.size() == 3);  // ceil(5 / 2)
}

TEST_CASE("bucket batch sampler: the plan is the collator's, and collate_sampled builds the batch") {
  const auto lengths = random_lengths(77, 4);
  loom::DistributedBucketBatchSampler s(lengths,
                                        {.shuffle = false, .pad = {{.dim = 0, .multiple = 8}}, .max_samples = 6});
  loom::BucketCollator<> c(loom::PaddedBucketOptions{.pad = {{.dim = 0, .multiple = 8}}, .max_samples = 6});
  std::vector<std::pair<torch::Tensor, int64_t>> data;
  for (std::size_t i = 0; i < lengths.size(); ++i)
    data.emplace_back(torch::full({lengths[i]}, static_cast<double>(i)), static_cast<int64_t>(i));
  std::vector<loom::Batch> batches;
  for (const auto& d : data) {
    c.push(d);
    while (auto b = c.try_pop()) batches.push_back(std::move(*b));
  }
  c.flush();
  while (auto b = c.try_pop()) batches.push_back(std::move(*b));
  REQUIRE(batches.size() == s.plan().size());
  for (std::size_t k = 0; k < batches.size(); ++k) {
    CHECK(batches[k].indices == s.plan()[k].indices);
    const auto sb = s.next();
    REQUIRE(sb.has_value());
    auto mine =
        loom::collate_sampled(*sb, [&](int64_t i) { return data[static_cast<std::size_t>(i)]; }, {.mask = true});
    CHECK(torch::equal(mine.data, batches[k].data));
    CHECK(torch::equal(mine.mask, batches[k].mask));
    CHECK(torch::equal(mine.targets, batches[k].targets));
    CHECK(mine.weight == 1.0);
  }
  loom::SampledBatch idle{.weight = 0.0, .idle = true};
  auto e = loom::collate_sampled(idle, [&](int64_t i) { return data[static_cast<std::size_t>(i)]; });
  CHECK(e.num_samples == 0);
  CHECK(e.weight == 0.0);
}

TEST_CASE("collate_sampled: a fetch that decodes every sample into one reused buffer gives correct rows") {
  // The decoder writes sample i (lengths[i] elements, all i + 1) into one buffer and returns a
  // view of it, so each fetch overwrites the previous sample's bytes.
  const std::vector<int64_t> lengths{5, 3, 8, 6, 2};
  at::Tensor buffer = torch::empty({8}, torch::kFloat);
  auto fetch = [&](int64_t i) {
    at::Tensor view = buffer.narrow(0, 0, lengths[static_cast<std::size_t>(i)]);
    view.fill_(static_cast<float>(i + 1));
    return std::pair<at::Tensor, int64_t>(view, 10 * i);
  };
  const loom::SampledBatch sb{.indices = {3, 0, 4, 2}, .padded_shape = {8}};
  const loom::Batch b = loom::collate_sampled(sb, fetch, {.pad_value = -1, .mask = true});
  // By hand: row r = index i: i + 1 on lengths[i] elements, then -1.
  const at::Tensor expected = torch::tensor({{4.f, 4.f, 4.f, 4.f, 4.f, 4.f, -1.f, -1.f},
                                             {1.f, 1.f, 1.f, 1.f, 1.f, -1.f, -1.f, -1.f},
                                             {5.f, 5.f, -1.f, -1.f, -1.f, -1.f, -1.f, -1.f},
                                             {3.f, 3.f, 3.f, 3.f, 3.f, 3.f, 3.f, 3.f}});
  CHECK(torch::equal(b.data, expected));
  CHECK(torch::equal(b.mask, expected.ne(-1.f)));
  CHECK(torch::equal(b.targets, torch::tensor({30, 0, 40, 20}, torch::kLong)));
  CHECK(b.indices == sb.indices);
}

TEST_CASE("bucket batch sampler: resume equals the uninterrupted sequence; epochs reshuffle") {
  const auto lengths = random_lengths(150, 5);
  const loom::BucketBatchSamplerOptions o{
      .num_replicas = 3, .rank = 2, .seed = 11, .pad = {{.dim = 0}}, .max_elements = 200};
  loom::DistributedBucketBatchSampler full(lengths, o);
  full.set_epoch(3);
  const auto expected = full.batches();
  loom::DistributedBucketBatchSampler first(lengths, o);
  first.set_epoch(3);
  std::vector<loom::SampledBatch> got;
  for (int k = 0; k < 4; ++k) got.push_back(*first.next());
  const auto saved = loom::parse_sampler_state(loom::to_string(first.state()));
  loom::DistributedBucketBatchSampler resumed(lengths, o);  // fresh: epoch 0
  resumed.load_state(saved);
  while (auto b = resumed.next()) got.push_back(*b);
  CHECK((got == expected));
  loom::DistributedBucketBatchSampler other_epoch(lengths, o);
  other_epoch.set_epoch(4);
  CHECK((other_epoch.plan() != full.plan()));
  auto other_lengths = lengths;
  other_lengths[0] += 1;
  loom::DistributedBucketBatchSampler mismatch(other_lengths, o);
  CHECK_THROWS_WITH_AS(mismatch.load_state(saved), doctest::Contains("fingerprint"), loom::InvalidArgument);
}

TEST_CASE("bucket batch sampler: bad input") {
  CHECK_THROWS_WITH_AS(loom::DistributedBucketBatchSampler(std::vector<std::vector<int64_t>>{}, {.max_samples = 2}),
                       doctest::Contains("the dataset is empty"), loom::InvalidArgument);
  CHECK_THROWS_WITH_AS(
      loom::DistributedBucketBatchSampler(std::vector<int64_t>{3, 4}, {.num_replicas = 2, .rank = 2, .max_samples = 2}),
      doctest::Contains("rank 2 is outside [0, 2)"), loom::InvalidArgument);
  CHECK_THROWS_WITH_AS(loom::DistributedBucketBatchSampler(std::vector<int64_t>{3, 4}, {.max_samples = 0}),
                       doctest::Contains("max_samples = 0"), loom::InvalidArgument);
  CHECK_THROWS_WITH_AS(loom::DistributedBucketBatchSampler(std::vector<int64_t>{3, 0, 4}, {.max_samples = 2}),
                       doctest::Contains("shape [0]: a zero-size dimension"), loom::InvalidArgument);
  CHECK_THROWS_WITH_AS(
      loom::DistributedBucketBatchSampler(std::vector<int64_t>{3, 400}, {.pad = {{.dim = 0}}, .max_elements = 100}),
      doctest::Contains("shape [400] needs 400 (padded) elements, more than max_elements = 100"),
      loom::InvalidArgument);
}

// ---- gather_results over a thread-group communicator -------------------------------------------
TEST_CASE("gather_results: drops the padding duplicates and returns dataset order (3 thread ranks)") {
  const int64_t n = 10;
  const int r = 3;
  loom::test::ThreadGroup group(r);
  std::vector<loom::GatheredResults> results(r);
  std::vector<std::vector<std::string>> calls(r);
  group.run([&](int rank) {
    loom::test::ThreadCommunicator comm(group, rank);
    auto s = loom::DistributedSampler::for_communicator(comm, {.dataset_size = n, .shuffle = true, .seed = 5});
    std::vector<int64_t> seen;
    std::vector<double> rows;
    while (auto i = s.next()) {
      seen.push_back(*i);
      rows.push_back(static_cast<double>(*i) * 2);
      rows.push_back(static_cast<double>(*i) * 2 + 1);
    }
    auto values = torch::tensor(rows, torch::kDouble).reshape({-1, 2});
    results[static_cast<std::size_t>(rank)] = loom::gather_results(comm, seen, values, {.dataset_size = n});
    calls[static_cast<std::size_t>(rank)] = comm.calls;
  });
  for (int rank = 0; rank < r; ++rank) {
    const auto& g = results[static_cast<std::size_t>(rank)];
    CHECK(g.indices == std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9});
    CHECK(torch::equal(g.values, torch::arange(20, torch::kDouble).reshape({10, 2})));
    CHECK(g.duplicates_dropped == 2);  // 12 evaluated, 10 distinct
    CHECK(calls[static_cast<std::size_t>(rank)] == std::vector<std::string>{"all_gather", "all_gather", "all_gather"});
  }
}

TEST_CASE("gather_results: variable-length ranks (one with no rows), no dataset_size, first occurrence wins") {
  loom::test::ThreadGroup group(3);
  std::vector<loom::GatheredResults> results(3);
  group.run([&](int rank) {
    loom::test::ThreadCommunicator comm(group, rank);
    std::vector<int64_t> idx;
    at::Tensor values;
    if (rank == 0) {
      idx = {7, 3, 9};
      values = torch::tensor({70, 30, 90}, torch::kInt).reshape({3, 1});
    } else if (rank == 1) {
      idx = {3};  // also index 3: row 0 of rank 1 precedes row 1 of rank 0 in the global order, so it wins
      values = torch::tensor({31}, torch::kInt).reshape({1, 1});
    } else {
      values = torch::empty({0, 1}, torch::kInt);
    }
    results[static_cast<std::size_t>(rank)] = loom::gather_results(comm, idx, values);
  });
  for (const auto& g : results) {
    CHECK(g.indices == std::vector<int64_t>{3, 7, 9});
    CHECK(torch::equal(g.values, torch::tensor({31, 70, 90}, torch::kInt).reshape({3, 1})));
    CHECK(g.duplicates_dropped == 1);
  }
}

TEST_CASE("gather_results: a rank with no rows may pass an undefined tensor and adopts the others' dtype and shape") {
  loom::test::ThreadGroup group(3);
  std::vector<loom::GatheredResults> results(3);
  group.run([&](int rank) {
    loom::test::ThreadCommunicator comm(group, rank);
    std::vector<int64_t> idx;
    at::Tensor values;  // rank 0: nothing evaluated, no tensor to take a shape from
    if (rank == 1) {
      idx = {2, 0};
      values = torch::tensor({20., 21., 0., 1.}, torch::kDouble).reshape({2, 2});
    } else if (rank == 2) {
      idx = {1};
      values = torch::tensor({10., 11.}, torch::kDouble).reshape({1, 2});
    }
    results[static_cast<std::size_t>(rank)] = loom::gather_results(comm, idx, values, {.dataset_size = 3});
  });
  for (const auto& g : results) {
    CHECK(g.indices == std::vector<int64_t>{0, 1, 2});
    CHECK((g.values.scalar_type() == at::kDouble));
    CHECK(torch::equal(g.values, torch::tensor({0., 1., 10., 11., 20., 21.}, torch::kDouble).reshape({3, 2})));
  }
  // Every rank empty: an empty result, no error without dataset_size.
  group.run([&](int rank) {
    loom::test::ThreadCommunicator comm(group, rank);
    results[static_cast<std::size_t>(rank)] = loom::gather_results(comm, {}, at::Tensor());
  });
  for (const auto& g : results) {
    CHECK(g.indices.empty());
    CHECK(g.values.size(0) == 0);
  }
}

TEST_CASE("gather_results: bad input on one rank makes every rank throw the same error (nobody hangs)") {
  for (int bad_kind = 0; bad_kind < 4; ++bad_kind) {
    loom::test::ThreadGroup group(3);
    std::vector<std::string> errors(3);
    group.run([&](int rank) {
      loom::test::ThreadCommunicator comm(group, rank);
      std::vector<int64_t> idx{rank};
      at::Tensor values = torch::zeros({1, 2});
      if (rank == 1) {
        if (bad_kind == 0) idx = {99};
        if (bad_kind == 1) values = torch::zeros({1, 3});
        if (bad_kind == 2) values = torch::zeros({1, 2}, torch::kBool);
        if (bad_kind == 3) idx = {1, 2};
      }
      try {
        (void)loom::gather_results(comm, idx, values, {.dataset_size = 10});
      } catch (const loom::InvalidArgument& e) {
        errors[static_cast<std::size_t>(rank)] = e.what();
      }
    });
    const char* expected[] = {"rank 1 passed index 99, outside [0, 10)",
                              "rank 1 has values of dtype Float and trailing shape [3], rank 0 has Float and [2]",
                              "rank 1 passed values of unsupported dtype Bool",
                              "rank 1 passed 2 indices but 1 value rows"};
    for (const auto& e : errors) CHECK(e.find(expected[bad_kind]) != std::string::npos);
  }
  // A sample no rank evaluated.
  loom::test::ThreadGroup group(2);
  std::vector<std::string> errors(2);
  group.run([&](int rank) {
    loom::test::ThreadCommunicator comm(group, rank);
    std::vector<int64_t> idx{rank == 0 ? 0 : 2};
    try {
      (void)loom::gather_results(comm, idx, torch::zeros({1}), {.dataset_size = 3});
    } catch (const loom::InvalidArgument& e) {
      errors[static_cast<std::size_t>(rank)] = e.what();
    }
  });
  for (const auto& e : errors)
    CHECK(e.find("index 1 (and 1 in all) of [0, 3) was evaluated by no rank") != std::string::npos);
  // World size 1 with loom's LocalCommunicator.
  loom::LocalCommunicator local;
  std::vector<int64_t> idx{2, 0, 1, 0};
  auto g = loom::gather_results(local, idx, torch::tensor({2.f, 0.f, 1.f, 5.f}));
  CHECK(g.indices == std::vector<int64_t>{0, 1, 2});
  CHECK(torch::equal(g.values, torch::tensor({0.f, 1.f, 2.f})));
  CHECK(g.duplicates_dropped == 1);
}

// ---- the batching rules, read from every options aggregate -----------------------------------
TEST_CASE("BatchRules: every options aggregate hands over the same rules; the planner and the samplers read them") {
  const loom::PaddedBucketOptions padded{.pad = {{.dim = 0, .multiple = 8}},
                                         .max_samples = 4,
                                         .max_elements = 96,
                                         .multiple_of = 2,
                                         .drop_incomplete = true,
                                         .on_oversize = loom::OversizePolicy::skip};
  const loom::BatchRules r = loom::batch_rules(padded);
  REQUIRE(r.pad.size() == 1);
  CHECK(r.pad[0].dim == 0);
  CHECK(r.pad[0].multiple == 8);
  CHECK(r.max_samples == std::optional<int64_t>(4));
  CHECK(r.max_elements == std::optional<int64_t>(96));
  CHECK(r.multiple_of == 2);
  CHECK(r.drop_incomplete);
  CHECK(r.on_oversize == loom::OversizePolicy::skip);
  CHECK(loom::batch_rules(loom::ShapeBucketOptions{.max_samples = 3}).pad.empty());
  const loom::GlobalBatchOptions global{.pad = padded.pad, .max_samples = 4, .max_elements = 96, .multiple_of = 2};
  CHECK(loom::batch_rules(global).max_elements == std::optional<int64_t>(96));
  CHECK(loom::batch_rules(global).pad.size() == 1);

  // The planner from the rules plans what the planner from the options plans. By hand: lengths 5,
  // 7, 20, 3, 30, 6 pad to multiples of 8 (8, 8, 24, 8, 32, 8); bucket 8 holds min(4, 96 / 8) = 4
  // samples and is emitted when sample 5 fills it ({0, 1, 3, 5}); samples 2 and 4 wait alone in
  // buckets 24 and 32, and the flush drops them (drop_incomplete): 2 samples dropped.
  const std::vector<int64_t> len{5, 7, 20, 3, 30, 6};
  auto plan = [&](loom::BucketPlanner p) {
    std::vector<loom::PlannedBatch> out;
    for (std::size_t i = 0; i < len.size(); ++i) p.add(static_cast<int64_t>(i), {len[i]}, out);
    p.flush(out);
    return std::make_pair(out, p.stats());
  };
  const auto [from_rules, rules_stats] = plan(loom::BucketPlanner(r));
  const auto [from_options, options_stats] = plan(loom::BucketPlanner(padded));
  CHECK((from_rules == from_options));
  REQUIRE(from_rules.size() == 1);
  CHECK(from_rules[0].indices == std::vector<int64_t>{0, 1, 3, 5});
  CHECK(from_rules[0].padded_shape == std::vector<int64_t>{8});
  CHECK(rules_stats.dropped_incomplete == 2);
  CHECK(options_stats.dropped_incomplete == 2);

  // One check, one message, whichever part is given the rules.
  loom::BatchRules bad = r;
  bad.max_samples = 3;  // not a multiple of multiple_of = 2
  CHECK_THROWS_WITH_AS(bad.check(), doctest::Contains("max_samples = 3 is not a multiple of multiple_of = 2"),
                       loom::InvalidArgument);
  CHECK_THROWS_WITH_AS(loom::BucketPlanner{bad}, doctest::Contains("max_samples = 3 is not a multiple"),
                       loom::InvalidArgument);
  const std::vector<std::vector<int64_t>> two{{1}, {2}};
  CHECK_THROWS_WITH_AS(loom::GlobalBatchSampler(two, {.max_samples = 3, .multiple_of = 2}),
                       doctest::Contains("max_samples = 3 is not a multiple"), loom::InvalidArgument);
  CHECK_THROWS_WITH_AS(loom::DistributedBucketBatchSampler(two, {.max_samples = 3, .multiple_of = 2}),
                       doctest::Contains("max_samples = 3 is not a multiple"), loom::InvalidArgument);
}

TEST_CASE("BatchRules: the bucket sampler's fingerprint folds the fields in a fixed order (saved states stay valid)") {
  // Reference, written out field by field with the hash alone: shuffle, surplus, max_samples,
  // max_elements (unset: -1), multiple_of, drop_incomplete, on_oversize, each padded dimension
  // (dim, multiple, boundaries, all-ones), each shape (sizes, all-ones).
  const std::vector<std::vector<int64_t>> shapes{{4}, {9}, {2}};
  const loom::BucketBatchSamplerOptions o{
      .seed = 5, .pad = {{.dim = 0, .boundaries = {4, 16}}}, .max_samples = 2, .surplus = loom::SurplusPolicy::idle};
  loom::detail::Fnv1a f;
  f.add(uint64_t{1});                                                                 // shuffle
  f.add(static_cast<uint64_t>(loom::SurplusPolicy::idle));                            // surplus
  f.add(uint64_t{2});                                                                 // max_samples
  f.add(static_cast<uint64_t>(int64_t{-1}));                                          // max_elements unset
  f.add(uint64_t{1});                                                                 // multiple_of
  f.add(uint64_t{0});                                                                 // drop_incomplete
  f.add(static_cast<uint64_t>(loom::OversizePolicy::raise));                          // on_oversize
  for (uint64_t x : {uint64_t{0}, uint64_t{0}, uint64_t{4}, uint64_t{16}}) f.add(x);  // dim, multiple, boundaries
  f.add(~uint64_t{0});
  for (int64_t s : {4, 9, 2}) {
    f.add(static_cast<uint64_t>(s));
    f.add(~uint64_t{0});
  }
  loom::DistributedBucketBatchSampler sampler(shapes, o);
  CHECK(sampler.state().fingerprint == f.value());
  auto other = o;
  other.multiple_of = 2;
  CHECK(loom::DistributedBucketBatchSampler(shapes, other).state().fingerprint != f.value());
}

}  // namespace test_sample
