// GlobalBatchSampler, plan_epoch and deal in one process: the plan does not depend on the world
// size, every sample is used exactly once, dealing is balanced and deterministic, cursors move
// between world sizes. Multi-rank trajectories and resumes: test_elastic_dist.cpp.
#include <algorithm>
#include <map>
#include <numeric>
#include <random>
#include <set>

#include <ATen/ATen.h>
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <loom/comm/local.hpp>
#include <loom/sample/global_batch.hpp>
#include <loom/sample/sample_seed.hpp>
#include <loom/sample/sampled_batch.hpp>

namespace test_global_batch {

namespace {

using Shapes = std::vector<std::vector<int64_t>>;

/// Random image-like shapes (3 x h x w) with h, w from a few sizes; seeded.
Shapes random_shapes(uint64_t seed, int n, int sizes) {
  std::mt19937_64 rng(seed);
  Shapes s;
  for (int i = 0; i < n; ++i) {
    const int64_t h = 8 * (1 + static_cast<int64_t>(rng() % static_cast<uint64_t>(sizes)));
    const int64_t w = 8 * (1 + static_cast<int64_t>(rng() % static_cast<uint64_t>(sizes)));
    s.push_back({3, h, w});
  }
  return s;
}

/// Per global step, the sorted sample indices every rank of a world of `w` runs (weight-1 items),
/// gathered by iterating each rank's sampler; also counts uses of every sample.
std::vector<std::vector<int64_t>> steps_over_ranks(const Shapes& shapes, loom::GlobalBatchOptions o, int w,
                                                   int64_t epoch, std::map<int64_t, int>* uses = nullptr) {
  std::vector<std::vector<int64_t>> steps;
  std::map<int64_t, std::set<int64_t>> step_samples;  // per step: the Batch::step_samples every item carried
  for (int r = 0; r < w; ++r) {
    o.world_size = w;
    o.rank = r;
    loom::GlobalBatchSampler s(shapes, o);
    s.set_epoch(epoch);
    steps.resize(static_cast<std::size_t>(s.num_steps()));
    int64_t items = 0;
    int64_t last_step = -1;
    while (auto b = s.next()) {
      ++items;
      REQUIRE(b->step >= last_step);
      last_step = b->step;
      step_samples[b->step].insert(b->step_samples);
      if (b->idle) {
        CHECK(b->weight == 0.0);
        CHECK(b->indices.empty());
        CHECK(b->step_end);
        continue;
      }
      CHECK(b->weight == 1.0);
      CHECK_FALSE(b->repeated);
      for (int64_t i : b->indices) {
        steps[static_cast<std::size_t>(b->step)].push_back(i);
        if (uses) ++(*uses)[i];
      }
    }
    CHECK(items == s.size());
  }
  for (auto& v : steps) std::sort(v.begin(), v.end());
  // Every item of a step, idle ones included, on every rank, carries the samples the ranks ran in it.
  for (std::size_t k = 0; k < steps.size(); ++k)
    CHECK(step_samples[static_cast<int64_t>(k)] == std::set<int64_t>{static_cast<int64_t>(steps[k].size())});
  return steps;
}

}  // namespace

TEST_CASE("deal: LPT on costs, deterministic, every item once; round robin as documented") {
  const std::vector<int64_t> costs = {5, 1, 4, 2};
  CHECK(loom::deal(costs, 2, loom::Dealing::balanced) == std::vector<std::vector<int64_t>>{{0, 1}, {2, 3}});
  CHECK(loom::deal(costs, 2, loom::Dealing::round_robin) == std::vector<std::vector<int64_t>>{{0, 2}, {1, 3}});
  // More ranks than items: the extra ranks get nothing.
  CHECK(loom::deal(costs, 6, loom::Dealing::balanced) == std::vector<std::vector<int64_t>>{{0}, {2}, {3}, {1}, {}, {}});
  // Ties: plan order first, lowest rank first.
  CHECK(loom::deal(std::vector<int64_t>{3, 3, 3}, 2, loom::Dealing::balanced) ==
        std::vector<std::vector<int64_t>>{{0, 2}, {1}});
  CHECK_THROWS_WITH_AS(loom::deal(costs, 0, loom::Dealing::balanced), doctest::Contains("world_size = 0"),
                       loom::InvalidArgument);
  CHECK_THROWS_WITH_AS(loom::deal(std::vector<int64_t>{1, -4}, 2, loom::Dealing::balanced),
                       doctest::Contains("cost -4 of item 1"), loom::InvalidArgument);
  // Property: every item exactly once; the max load within Graham's list-scheduling bound
  // total / W + (1 - 1/W) x largest (round robin has no such bound).
  std::mt19937_64 rng(11);
  for (int trial = 0; trial < 200; ++trial) {
    const int w = 1 + static_cast<int>(rng() % 8);
    std::vector<int64_t> c(1 + rng() % 40);
    for (auto& x : c) x = static_cast<int64_t>(1 + rng() % 1000);
    const auto d = loom::deal(c, w, loom::Dealing::balanced);
    std::vector<int> seen(c.size(), 0);
    int64_t max_load = 0, total = 0, biggest = 0;
    for (const auto& v : d) {
      int64_t load = 0;
      for (int64_t j : v) {
        ++seen[static_cast<std::size_t>(j)];
        load += c[static_cast<std::size_t>(j)];
      }
      max_load = std::max(max_load, load);
    }
    for (auto x : c) {
      total += x;
      biggest = std::max(biggest, x);
    }
    CHECK(std::all_of(seen.begin(), seen.end(), [](int k) { return k == 1; }));
    CHECK(static_cast<double>(max_load) <=
          static_cast<double>(total) / w + (1.0 - 1.0 / w) * static_cast<double>(biggest) + 1e-9);
  }
}

TEST_CASE("plan_epoch: steps by batches, samples or elements; the last step takes the rest; nothing lost") {
  const Shapes shapes = random_shapes(3, 101, 3);
  auto count = [](const loom::EpochPlan& p) {
    std::set<int64_t> all;
    int64_t n = 0;
    for (const auto& b : p.batches)
      for (auto i : b.indices) {
        all.insert(i);
        ++n;
      }
    return std::pair{static_cast<int64_t>(all.size()), n};
  };
  const auto by_batches = loom::plan_epoch(shapes, {.seed = 5, .max_samples = 4, .batches_per_step = 3}, 2);
  CHECK(count(by_batches) == std::pair<int64_t, int64_t>{101, 101});
  for (std::size_t k = 0; k + 1 < by_batches.steps.size(); ++k) CHECK(by_batches.steps[k].num_batches == 3);
  CHECK(by_batches.steps.back().num_batches >= 1);
  CHECK(by_batches.steps.back().num_batches <= 3);
  int64_t next = 0, samples = 0;
  for (const auto& st : by_batches.steps) {
    CHECK(st.first_batch == next);
    next += st.num_batches;
    samples += st.num_samples;
  }
  CHECK(next == static_cast<int64_t>(by_batches.batches.size()));
  CHECK(samples == 101);

  const auto by_samples =
      loom::plan_epoch(shapes, {.seed = 5, .max_samples = 4, .batches_per_step = 0, .samples_per_step = 10}, 2);
  for (std::size_t k = 0; k + 1 < by_samples.steps.size(); ++k) {
    CHECK(by_samples.steps[k].num_samples >= 10);
    CHECK(by_samples.steps[k].num_samples - 10 < 4);  // closed by the batch that reached 10
  }
  // The same batches, only grouped differently.
  CHECK((by_samples.batches == by_batches.batches));

  CHECK_THROWS_WITH_AS(loom::plan_epoch(shapes, {.batches_per_step = 0}, 0), doctest::Contains("no rule closes a step"),
                       loom::InvalidArgument);
  CHECK_THROWS_WITH_AS(loom::plan_epoch(shapes, {.batches_per_step = -2}, 0),
                       doctest::Contains("batches_per_step = -2"), loom::InvalidArgument);
  CHECK_THROWS_AS(loom::plan_epoch({}, {}, 0), loom::InvalidArgument);
  CHECK_THROWS_WITH_AS(loom::plan_epoch(shapes, {}, -1), doctest::Contains("epoch -1"), loom::InvalidArgument);
}

TEST_CASE("GlobalBatchSampler: for W = 1..5 every step holds the same samples, each sample once, none dropped") {
  for (uint64_t trial = 0; trial < 12; ++trial) {  // property test over random shape lists and options
    const Shapes shapes = random_shapes(100 + trial, 30 + static_cast<int>(trial * 7), 2 + static_cast<int>(trial % 3));
    loom::GlobalBatchOptions o{.seed = trial,
                               .max_samples = 2 + static_cast<int64_t>(trial % 4),
                               .batches_per_step = 1 + static_cast<int64_t>(trial % 5)};
    if (trial % 3 == 1) o.pad = {{.dim = 1, .boundaries = {16, 32}}, {.dim = 2, .boundaries = {16, 32}}};
    if (trial % 4 == 3) o.dealing = loom::Dealing::round_robin;
    for (int64_t epoch : {0, 3}) {
      std::map<int64_t, int> uses1;
      const auto ref = steps_over_ranks(shapes, o, 1, epoch, &uses1);
      CHECK(static_cast<int64_t>(uses1.size()) == static_cast<int64_t>(shapes.size()));
      for (const auto& [i, k] : uses1) CHECK(k == 1);
      for (int w = 2; w <= 5; ++w) {
        std::map<int64_t, int> uses;
        const auto got = steps_over_ranks(shapes, o, w, epoch, &uses);
        CHECK(got == ref);
        CHECK(uses == uses1);
      }
    }
  }
}

TEST_CASE("GlobalBatchSampler: a rank with no batch of a step yields one idle item; step_end marks the last") {
  const Shapes shapes(6, std::vector<int64_t>{1, 4});  // one shape: 3 batches of 2
  loom::GlobalBatchOptions o{.world_size = 4, .rank = 3, .shuffle = false, .max_samples = 2, .batches_per_step = 3};
  loom::GlobalBatchSampler s(shapes, o);
  REQUIRE(s.num_steps() == 1);
  auto b = s.next();
  REQUIRE(b);
  CHECK(b->idle);
  CHECK(b->step_end);
  CHECK(b->step_samples == 6);  // the step's 6 samples run on ranks 0-2
  const loom::Batch joined = loom::collate_sampled(*b, [](int64_t) { return at::zeros({1, 4}); });
  CHECK(joined.idle);
  CHECK(joined.step_samples == 6);
  CHECK_FALSE(s.next());
  o.rank = 0;
  o.world_size = 2;
  loom::GlobalBatchSampler two(shapes, o);  // 3 equal batches on 2 ranks: rank 0 runs 2
  auto first = two.next(), second = two.next();
  REQUIRE((first && second));
  CHECK_FALSE(first->step_end);
  CHECK(second->step_end);
  CHECK(first->indices == std::vector<int64_t>{0, 1});
  CHECK(loom::collate_sampled(*first, [](int64_t i) {
          return at::full({1, 4}, static_cast<double>(i));
        }).step_samples == 6);
  CHECK(second->indices == std::vector<int64_t>{4, 5});
  CHECK_FALSE(two.next());
}

TEST_CASE("GlobalBatchSampler: a cursor from W = 2 resumes on W = 3 and W = 1 with every sample exactly once") {
  const Shapes shapes = random_shapes(9, 64, 3);
  const loom::GlobalBatchOptions base{.seed = 4, .max_samples = 3, .batches_per_step = 4};
  // W = 2 runs the first 3 steps of epoch 1; its cursor is taken after step 3 on rank 0.
  std::map<int64_t, int> uses;
  loom::GlobalCursor cursor;
  for (int r = 0; r < 2; ++r) {
    auto o = base;
    o.world_size = 2;
    o.rank = r;
    loom::GlobalBatchSampler s(shapes, o);
    s.set_epoch(1);
    while (auto b = s.next()) {
      for (int64_t i : b->indices) ++uses[i];
      if (b->step_end && b->step == 2) break;
    }
    const auto c = s.cursor();
    CHECK(c.step == 3);
    CHECK(c.epoch == 1);
    if (r == 0)
      cursor = c;
    else
      CHECK(c == cursor);
  }
  // The checkpoint's text survives a round trip, also as a line read with its newline.
  CHECK(loom::parse_global_cursor(loom::to_string(cursor)) == cursor);
  CHECK(loom::parse_global_cursor(loom::to_string(cursor) + "\n") == cursor);
  for (int w : {3, 1}) {
    auto resumed = uses;
    for (int r = 0; r < w; ++r) {
      auto o = base;
      o.world_size = w;
      o.rank = r;
      loom::GlobalBatchSampler s(shapes, o);
      s.resume(cursor);
      while (auto b = s.next()) {
        CHECK(b->step >= 3);
        for (int64_t i : b->indices) ++resumed[i];
      }
    }
    CHECK(static_cast<int64_t>(resumed.size()) == 64);
    for (const auto& [i, k] : resumed) CHECK(k == 1);
  }
  // A cursor of another configuration is refused, naming the difference.
  auto other = base;
  other.max_samples = 5;
  loom::GlobalBatchSampler s(shapes, other);
  CHECK_THROWS_WITH_AS(s.resume(cursor), doctest::Contains("fingerprint"), loom::InvalidArgument);
  auto reseeded = base;
  reseeded.seed = 5;
  loom::GlobalBatchSampler t(shapes, reseeded);
  CHECK_THROWS_WITH_AS(t.resume(cursor), doctest::Contains("seed 4"), loom::InvalidArgument);
  loom::GlobalBatchSampler u(shapes, base);
  CHECK_THROWS_WITH_AS(u.resume({.seed = 4, .epoch = 1, .step = 999, .fingerprint = cursor.fingerprint}),
                       doctest::Contains("step 999 is outside"), loom::InvalidArgument);
  CHECK_THROWS_WITH_AS(loom::parse_global_cursor("loom-global-cursor v1 seed=1"), doctest::Contains("malformed"),
                       loom::InvalidArgument);
}

TEST_CASE("GlobalBatchSampler: state() / load_state() resume mid-step at the same world size") {
  const Shapes shapes = random_shapes(21, 50, 3);
  const loom::GlobalBatchOptions o{.world_size = 3, .rank = 1, .seed = 8, .max_samples = 2, .batches_per_step = 5};
  loom::GlobalBatchSampler a(shapes, o);
  a.set_epoch(2);
  for (int k = 0; k < 4; ++k) (void)a.next();
  const auto st = a.state();
  std::vector<loom::SampledBatch> rest;
  while (auto b = a.next()) rest.push_back(*b);
  loom::GlobalBatchSampler b(shapes, o);
  b.load_state(st);
  std::vector<loom::SampledBatch> again;
  while (auto x = b.next()) again.push_back(*x);
  CHECK((again == rest));
  auto other_rank = o;
  other_rank.rank = 2;
  loom::GlobalBatchSampler c(shapes, other_rank);
  CHECK_THROWS_WITH_AS(c.load_state(st), doctest::Contains("rank"), loom::InvalidArgument);
}

TEST_CASE("GlobalBatchSampler: balanced dealing keeps the busiest rank near the mean; bad options are named") {
  const Shapes shapes = random_shapes(33, 400, 6);
  const loom::GlobalBatchOptions o{.world_size = 4, .seed = 1, .max_samples = 4, .batches_per_step = 16};
  loom::GlobalBatchSampler s(shapes, o);
  auto worst = [&](loom::Dealing d) {
    auto oo = o;
    oo.dealing = d;
    loom::GlobalBatchSampler x(shapes, oo);
    double ratio = 0;
    for (int64_t k = 0; k + 1 < x.num_steps(); ++k) {  // full steps (16 batches: 4 per rank)
      std::vector<double> load(4, 0);
      for (int r = 0; r < 4; ++r)
        for (int64_t j : x.assignment(k, r))
          load[static_cast<std::size_t>(r)] +=
              static_cast<double>(x.plan().batches[static_cast<std::size_t>(j)].padded_elements);
      const double mean = (load[0] + load[1] + load[2] + load[3]) / 4;
      ratio = std::max(ratio, *std::max_element(load.begin(), load.end()) / mean);
    }
    return ratio;
  };
  const double balanced = worst(loom::Dealing::balanced), rr = worst(loom::Dealing::round_robin);
  MESSAGE(fmt::format("max/mean per step: balanced {:.3f}, round robin {:.3f}", balanced, rr));
  CHECK(balanced < rr);
  CHECK(balanced < 1.25);
  CHECK_THROWS_WITH_AS(loom::GlobalBatchSampler(shapes, {.world_size = 2, .rank = 2}),
                       doctest::Contains("rank 2 is outside [0, 2)"), loom::InvalidArgument);
  CHECK_THROWS_WITH_AS(loom::GlobalBatchSampler(shapes, {.world_size = 0}), doctest::Contains("world_size = 0"),
                       loom::InvalidArgument);
  CHECK_THROWS_WITH_AS(loom::GlobalBatchSampler(Shapes{}, {}), doctest::Contains("empty"), loom::InvalidArgument);
  CHECK_THROWS_WITH_AS(s.assignment(s.num_steps(), 0), doctest::Contains("outside"), loom::InvalidArgument);
}

TEST_CASE(
    "GlobalBatchSampler with a communicator: a world size or rank in the options that contradicts it is refused") {
  const Shapes shapes(12, std::vector<int64_t>{3});
  loom::LocalCommunicator comm;  // world size 1, rank 0
  CHECK_THROWS_WITH_AS(loom::GlobalBatchSampler(comm, shapes, {.world_size = 2}),
                       doctest::Contains("the options say world_size = 2, rank = 0, but the communicator (process "
                                         "group) has world size 1 and this is rank 0"),
                       loom::InvalidArgument);
  CHECK_THROWS_WITH_AS(loom::GlobalBatchSampler(comm, shapes, {.rank = 3}),
                       doctest::Contains("world_size = 1, rank = 3"), loom::InvalidArgument);
  // Unset, or equal to the communicator's: accepted.
  const loom::GlobalBatchSampler s(comm, shapes, {.world_size = 1, .rank = 0, .max_samples = 4});
  CHECK(s.options().world_size == 1);
  CHECK(s.num_steps() == 3);
}

TEST_CASE("sample_seed: a function of (seed, epoch, index) only") {
  CHECK(loom::sample_seed(7, 0, 42) == loom::sample_seed(7, 0, 42));
  CHECK(loom::sample_seed(7, 0, 42) != loom::sample_seed(7, 1, 42));
  CHECK(loom::sample_seed(7, 0, 42) != loom::sample_seed(7, 0, 43));
  CHECK(loom::sample_seed(7, 0, 42) != loom::sample_seed(8, 0, 42));
  std::set<uint64_t> seen;
  for (int64_t e = 0; e < 10; ++e)
    for (int64_t i = 0; i < 1000; ++i) seen.insert(loom::sample_seed(3, e, i));
  CHECK(seen.size() == 10000);
  auto a = at::rand({4}, loom::sample_generator(3, 2, 17));
  auto b = at::rand({4}, loom::sample_generator(3, 2, 17));
  CHECK(at::equal(a, b));
}

TEST_CASE("GlobalBatchSampler: a cursor after an epoch's last step is the next epoch's step 0") {
  const Shapes shapes = random_shapes(5, 30, 3);
  const loom::GlobalBatchOptions o{.seed = 2, .max_samples = 3, .batches_per_step = 2};
  loom::GlobalBatchSampler s(shapes, o);
  s.set_epoch(4);
  while (s.next()) {
  }
  const loom::GlobalCursor c = s.cursor();
  CHECK(c.epoch == 5);
  CHECK(c.step == 0);
  // A cursor written the old way, (epoch, its number of steps), resumes at the same place.
  loom::GlobalBatchSampler t(shapes, o);
  t.resume({.seed = 2, .epoch = 4, .step = s.num_steps(), .fingerprint = c.fingerprint});
  CHECK(t.epoch() == 5);
  t.set_epoch(5);  // the natural loop, starting at the cursor's epoch, keeps the position
  const auto first = t.next();
  REQUIRE(first);
  CHECK(first->step == 0);
}

TEST_CASE("GlobalBatchSampler: set_epoch after resume keeps the resumed step; another epoch is an error") {
  const Shapes shapes = random_shapes(6, 40, 3);
  const loom::GlobalBatchOptions o{.seed = 3, .max_samples = 2, .batches_per_step = 2};
  loom::GlobalBatchSampler a(shapes, o);
  a.set_epoch(2);
  for (int k = 0; k < 6; ++k) (void)a.next();  // 3 steps of 2 batches on one rank
  const loom::GlobalCursor c = a.cursor();
  REQUIRE(c.step == 3);
  loom::GlobalBatchSampler b(shapes, o);
  b.resume(c);
  b.set_epoch(2);  // a loop that calls set_epoch at the top of each epoch, as with DistributedSampler
  const auto item = b.next();
  REQUIRE(item);
  CHECK(item->step == 3);
  b.set_epoch(2);  // after the resume has been consumed, set_epoch rewinds as always
  CHECK(b.next()->step == 0);
  loom::GlobalBatchSampler d(shapes, o);
  d.resume(c);
  CHECK_THROWS_WITH_AS(d.set_epoch(0),
                       doctest::Contains("set_epoch(0): the sampler was resumed at epoch 2, step 3 (resume(cursor))"),
                       loom::InvalidArgument);
}

TEST_CASE("generator64 and plans use all 64 bits of a seed") {
  const uint64_t high = uint64_t{1} << 32;
  // ATen's own seeding keeps 32 bits: these two generators draw the same numbers...
  auto a32 = at::make_generator<at::CPUGeneratorImpl>(uint64_t{7});
  auto b32 = at::make_generator<at::CPUGeneratorImpl>(7 + high);
  CHECK(at::equal(at::randint(1 << 30, {8}, a32, at::kLong), at::randint(1 << 30, {8}, b32, at::kLong)));
  // ... loom's do not, and each is reproducible.
  auto a = loom::generator64(7), b = loom::generator64(7 + high), a2 = loom::generator64(7);
  const auto da = at::randint(1 << 30, {8}, a, at::kLong);
  CHECK_FALSE(at::equal(da, at::randint(1 << 30, {8}, b, at::kLong)));
  CHECK(at::equal(da, at::randint(1 << 30, {8}, a2, at::kLong)));
  CHECK(loom::generator64(7 + high).current_seed() == 7 + high);
  // Plans seeded 7 and 7 + 2^32 differ.
  const Shapes shapes = random_shapes(8, 60, 3);
  const auto p = loom::plan_epoch(shapes, {.seed = 7, .max_samples = 4, .batches_per_step = 2}, 0);
  const auto q = loom::plan_epoch(shapes, {.seed = 7 + high, .max_samples = 4, .batches_per_step = 2}, 0);
  bool same = p.batches.size() == q.batches.size();
  for (std::size_t j = 0; same && j < p.batches.size(); ++j) same = p.batches[j].indices == q.batches[j].indices;
  CHECK_FALSE(same);
  // Per-sample seeds: 300 000 samples of one epoch draw 300 000 different first numbers (with 32-bit
  // seeding about 10 pairs collide).
  std::set<int64_t> firsts;
  for (int64_t i = 0; i < 300000; ++i) {
    auto g = loom::sample_generator(11, 0, i);
    firsts.insert(static_cast<int64_t>(g.get<at::CPUGeneratorImpl>()->random64()));
  }
  CHECK(firsts.size() == 300000);
}

TEST_CASE("plan_epoch with global_batch_size: steps of exactly G samples of the seeded order, same-shape batches") {
  const Shapes shapes = random_shapes(31, 103, 3);
  const int64_t g = 16;
  for (const bool shuffle : {true, false}) {
    CAPTURE(shuffle);
    const loom::GlobalBatchOptions o{.shuffle = shuffle, .seed = 9, .max_samples = 4, .global_batch_size = g};
    const auto plan = loom::plan_epoch(shapes, o, 2);
    // The order the steps must follow, computed here: randperm of the epoch's generator (or 0..n-1).
    std::vector<int64_t> order(shapes.size());
    std::iota(order.begin(), order.end(), int64_t{0});
    if (shuffle) {
      at::Generator gen = loom::generator64(9 + 2);
      const at::Tensor p = at::randperm(static_cast<int64_t>(shapes.size()), gen, at::TensorOptions(at::kLong));
      order.assign(p.data_ptr<int64_t>(), p.data_ptr<int64_t>() + p.numel());
    }
    REQUIRE(plan.steps.size() == 7);  // 103 = 6 x 16 + 7
    std::set<int64_t> all;
    for (std::size_t k = 0; k < plan.steps.size(); ++k) {
      CAPTURE(k);
      const auto& st = plan.steps[k];
      CHECK(st.num_samples == (k + 1 < plan.steps.size() ? g : 7));
      std::set<int64_t> got, want(order.begin() + static_cast<std::ptrdiff_t>(k) * g,
                                  order.begin() + std::min<std::ptrdiff_t>(static_cast<std::ptrdiff_t>(k + 1) * g,
                                                                           static_cast<std::ptrdiff_t>(order.size())));
      for (int64_t j = st.first_batch; j < st.first_batch + st.num_batches; ++j) {
        const auto& b = plan.batches[static_cast<std::size_t>(j)];
        CHECK(static_cast<int64_t>(b.indices.size()) <= 4);
        for (int64_t i : b.indices) {
          CHECK(shapes[static_cast<std::size_t>(i)] == shapes[static_cast<std::size_t>(b.indices[0])]);  // one shape
          got.insert(i);
          CHECK(all.insert(i).second);  // each sample once
        }
      }
      CHECK(got == want);
      // Fewest batches for the step's shapes: one per shape, more only where max_samples splits it.
      std::map<std::vector<int64_t>, int64_t> per_shape;
      for (int64_t i : want) ++per_shape[shapes[static_cast<std::size_t>(i)]];
      int64_t needed = 0;
      for (const auto& [shape, c] : per_shape) needed += (c + 3) / 4;
      CHECK(st.num_batches == needed);
    }
    CHECK(all.size() == shapes.size());
    CHECK(plan.stats.samples_out == 103);
  }
}

TEST_CASE("GlobalBatchSampler with global_batch_size: the same steps on W = 1..5, every sample once") {
  const Shapes shapes = random_shapes(77, 90, 2);
  for (const int64_t g : {1, 8, 32, 200}) {
    CAPTURE(g);
    const loom::GlobalBatchOptions o{.seed = 3, .max_samples = 6, .global_batch_size = g};
    std::map<int64_t, int> uses1;
    const auto ref = steps_over_ranks(shapes, o, 1, 1, &uses1);
    CHECK(uses1.size() == shapes.size());
    for (const auto& [i, k] : uses1) CHECK(k == 1);
    for (std::size_t k = 0; k < ref.size(); ++k)
      CHECK(static_cast<int64_t>(ref[k].size()) ==
            std::min<int64_t>(g, static_cast<int64_t>(shapes.size()) - static_cast<int64_t>(k) * g));
    for (int w = 2; w <= 5; ++w) {
      std::map<int64_t, int> uses;
      CHECK(steps_over_ranks(shapes, o, w, 1, &uses) == ref);
      CHECK(uses == uses1);
    }
  }
}

TEST_CASE("global_batch_size: conflicting step rules are named; it changes the fingerprint only when set") {
  const Shapes shapes = random_shapes(5, 20, 2);
  CHECK_THROWS_WITH_AS(loom::plan_epoch(shapes, {.batches_per_step = 2, .global_batch_size = 8}, 0),
                       doctest::Contains("global_batch_size = 8 fixes each step's samples; batches_per_step = 2"),
                       loom::InvalidArgument);
  CHECK_THROWS_WITH_AS(loom::plan_epoch(shapes, {.samples_per_step = 8, .global_batch_size = 8}, 0),
                       doctest::Contains("samples_per_step = 8"), loom::InvalidArgument);
  CHECK_THROWS_WITH_AS(loom::plan_epoch(shapes, {.drop_incomplete = true, .global_batch_size = 8}, 0),
                       doctest::Contains("drop_incomplete = true"), loom::InvalidArgument);
  CHECK_THROWS_WITH_AS(loom::plan_epoch(shapes, {.global_batch_size = -1}, 0),
                       doctest::Contains("global_batch_size = -1"), loom::InvalidArgument);
  // Without max_samples / max_elements a batch holds at most the global batch size.
  const auto plan = loom::plan_epoch(shapes, {.batches_per_step = 0, .global_batch_size = 8}, 0);
  REQUIRE(plan.steps.size() == 3);  // 20 = 8 + 8 + 4
  std::map<std::vector<int64_t>, int64_t> per_shape;
  for (int64_t j = 0; j < plan.steps[0].num_batches; ++j) {
    const auto& b = plan.batches[static_cast<std::size_t>(j)];
    CHECK(static_cast<int64_t>(b.indices.size()) <= 8);
    CHECK(++per_shape[shapes[static_cast<std::size_t>(b.indices[0])]] == 1);  // one batch per shape in the step
  }
  const auto fp = [&](int64_t g) { return loom::detail::plan_fingerprint(shapes, {.global_batch_size = g}); };
  CHECK(fp(0) != fp(8));
  CHECK(fp(8) != fp(16));
  // Plans without it keep the fingerprint they had before the option existed (value taken at
  // commit 1c5f542), so their saved cursors still resume.
  CHECK(fp(0) == 0xee8c622c6db79c9eULL);
  // batches_per_step 0 and 1 plan alike with it, and fingerprint alike.
  CHECK(loom::detail::plan_fingerprint(shapes, {.batches_per_step = 0, .global_batch_size = 8}) == fp(8));
  // A cursor of one global batch size does not resume a sampler of another.
  loom::GlobalBatchSampler a(shapes, {.global_batch_size = 8});
  loom::GlobalBatchSampler b(shapes, {.global_batch_size = 16});
  CHECK_THROWS_AS(b.resume(a.cursor()), loom::InvalidArgument);
}

}  // namespace test_global_batch
