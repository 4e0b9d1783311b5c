// The in-process GeneratorLoader: exact time alignment, end-of-data policies, failures, early stop,
// bounded memory, determinism, resume, and the collate step / transfer seams.
#include <atomic>
#include <functional>
#include <mutex>
#include <set>
#include <thread>

#include <doctest/doctest.h>
#include <torch/torch.h>

#include <loom/schedule/generator_loader.hpp>

#include "helpers.hpp"

namespace test_generator_loader {

using loom::test::expected_rows;
using loom::test::Stream;
using loom::test::streams;
using V = std::vector<std::vector<int>>;

namespace {

// Runs a schedule to its end and checks every step against the hand-written assignment:
// step k, device d = rows [g, k] for g in `hand[d]`. Returns the number of steps.
int64_t run_and_check(loom::GeneratorLoader<Stream>& sched, const V& hand, int64_t expected_steps) {
  int64_t k = 0;
  for (auto& step : sched) {
    REQUIRE(step.index == k);
    REQUIRE(step.devices.size() == hand.size());
    for (size_t d = 0; d < hand.size(); ++d) {
      const auto& db = step.devices[d];
      CHECK(db.device == static_cast<int>(d));
      CHECK(db.step == k);
      CHECK(db.generators == hand[d]);
      CHECK_FALSE(db.partial);
      CHECK(db.batch.num_samples == static_cast<int64_t>(hand[d].size()));
      CHECK(db.batch.data.equal(expected_rows(hand[d], k)));
      CHECK(db.batch.indices == std::vector<int64_t>(hand[d].begin(), hand[d].end()));
    }
    ++k;
  }
  CHECK(k == expected_steps);
  return k;
}

}  // namespace

TEST_CASE("GeneratorLoader: 16 onto 8, 10 onto 4, 3 onto 1 — exact ordering and time alignment") {
  SUBCASE("16 onto 8, contiguous: device d gets generators 2d and 2d+1") {
    loom::GeneratorLoader<Stream> s(streams(16, 6, 300), {.num_devices = 8});
    V hand;
    for (int d = 0; d < 8; ++d) hand.push_back({2 * d, 2 * d + 1});
    CHECK(s.assignment() == hand);
    run_and_check(s, hand, 6);
  }
  SUBCASE("16 onto 8, round-robin: device d gets d and d+8") {
    loom::GeneratorLoader<Stream> s(streams(16, 5, 300),
                                    {.num_devices = 8, .assignment = loom::Assignment::round_robin()});
    V hand;
    for (int d = 0; d < 8; ++d) hand.push_back({d, d + 8});
    run_and_check(s, hand, 5);
  }
  SUBCASE("10 onto 4, contiguous") {
    loom::GeneratorLoader<Stream> s(streams(10, 7, 300), {.num_devices = 4, .prefetch_depth = 1});
    run_and_check(s, V{{0, 1, 2}, {3, 4, 5}, {6, 7}, {8, 9}}, 7);
  }
  SUBCASE("10 onto 4, round-robin, 3 workers") {
    loom::GeneratorLoader<Stream> s(
        streams(10, 7, 300), {.num_devices = 4, .assignment = loom::Assignment::round_robin(), .num_workers = 3});
    run_and_check(s, V{{0, 4, 8}, {1, 5, 9}, {2, 6}, {3, 7}}, 7);
  }
  SUBCASE("10 onto 4, explicit map, 1 worker for all devices") {
    std::vector<int> map = {3, 0, 0, 1, 2, 3, 1, 2, 0, 3};
    loom::GeneratorLoader<Stream> s(
        streams(10, 4, 300), {.num_devices = 4, .assignment = loom::Assignment::explicit_map(map), .num_workers = 1});
    run_and_check(s, V{{1, 2, 8}, {3, 6}, {4, 7}, {0, 5, 9}}, 4);
  }
  SUBCASE("3 onto 1") {
    loom::GeneratorLoader<Stream> s(streams(3, 9, 300), {.num_devices = 1, .prefetch_depth = 4});
    run_and_check(s, V{{0, 1, 2}}, 9);
  }
}

TEST_CASE("GeneratorLoader: input-range generators and pair samples with targets") {
  std::vector<std::vector<std::pair<at::Tensor, int64_t>>> gens(4);
  for (int g = 0; g < 4; ++g)
    for (int k = 0; k < 3; ++k)
      gens[static_cast<size_t>(g)].push_back({torch::full({2, 2}, 10.0 * g + k), 100 * g + k});
  loom::GeneratorLoader s(std::move(gens), {.num_devices = 2, .assignment = loom::Assignment::round_robin()});
  int64_t k = 0;
  while (auto step = s.next()) {
    for (int d = 0; d < 2; ++d) {
      const auto& b = step->devices[static_cast<size_t>(d)].batch;
      // device d has generators d and d + 2
      CHECK(b.data.equal(torch::stack({torch::full({2, 2}, 10.0 * d + k), torch::full({2, 2}, 10.0 * (d + 2) + k)})));
      CHECK(b.targets.equal(torch::tensor({100 * d + k, 100 * (d + 2) + k})));
    }
    ++k;
  }
  CHECK(k == 3);
}

TEST_CASE("GeneratorLoader: stop_at_shortest ends at the shortest generator and reports unread samples") {
  // lengths 5, 7, 3, 9 onto 2 devices (contiguous: {0,1}, {2,3}): 3 steps.
  std::vector<Stream> gens = streams(4, 0, 200);
  const std::vector<int64_t> lengths = {5, 7, 3, 9};
  for (size_t g = 0; g < 4; ++g) gens[g].length = lengths[g];
  SUBCASE("count_unread on: exact counts") {
    loom::GeneratorLoader<Stream> s(gens, {.num_devices = 2, .count_unread = true});
    run_and_check(s, V{{0, 1}, {2, 3}}, 3);
    CHECK_FALSE(s.next().has_value());  // stays ended
    const loom::GeneratorLoaderReport r = s.report();
    CHECK(r.steps == 3);
    CHECK(r.shortest_generator == 2);
    REQUIRE(r.generators.size() == 4);
    for (int g = 0; g < 4; ++g) {
      const auto& gr = r.generators[static_cast<size_t>(g)];
      CHECK(gr.generator == g);
      CHECK(gr.device == g / 2);
      CHECK(gr.delivered == 3);
      CHECK(gr.unread == lengths[static_cast<size_t>(g)] - 3);
      CHECK(gr.unread_exact);
      CHECK(gr.ended);
    }
  }
  SUBCASE("count_unread off (the default): lower bounds, flagged") {
    loom::GeneratorLoader<Stream> s(gens, {.num_devices = 2, .prefetch_depth = 1});
    run_and_check(s, V{{0, 1}, {2, 3}}, 3);
    const loom::GeneratorLoaderReport r = s.report();
    CHECK(r.shortest_generator == 2);
    CHECK(r.generators[2].unread == 0);
    CHECK(r.generators[2].unread_exact);  // generator 2 ended: nothing left
    for (int g : {0, 1, 3}) {
      CHECK(r.generators[static_cast<size_t>(g)].unread <= lengths[static_cast<size_t>(g)] - 3);
      CHECK_FALSE(r.generators[static_cast<size_t>(g)].unread_exact);
    }
  }
  SUBCASE("ties: the first ending generator in (step, device, order) is the one reported") {
    std::vector<Stream> tie = streams(4, 4, 300);
    tie[3].length = 2;
    tie[1].length = 2;
    loom::GeneratorLoader<Stream> s(tie, {.num_devices = 2});
    run_and_check(s, V{{0, 1}, {2, 3}}, 2);
    CHECK(s.report().shortest_generator == 1);
  }
}

TEST_CASE("GeneratorLoader: stop_at_shortest with an endless generator — report() returns; counting opt-in, bounded") {
  using namespace std::chrono_literals;
  using Gen = std::function<std::optional<at::Tensor>()>;
  // generator 0 ends after 4 samples, generator 1 never ends; both on device 0: 4 steps
  auto make = [] {
    std::vector<Gen> gens;
    gens.emplace_back(Stream{.g = 0, .length = 4});
    gens.emplace_back(loom::test::EndlessStream{.g = 1});
    return gens;
  };
  auto run = [](loom::GeneratorLoader<Gen>& s) {
    int64_t k = 0;
    for (auto& step : s) {
      CHECK(step.devices[0].batch.data.equal(expected_rows({0, 1}, k)));
      ++k;
    }
    CHECK(k == 4);
    const loom::GeneratorLoaderReport r =
        loom::test::within(20s, "GeneratorLoader::report()", [&] { return s.report(); });
    CHECK(r.steps == 4);
    CHECK(r.shortest_generator == 0);
    REQUIRE(r.generators.size() == 2);
    CHECK(r.generators[0].delivered == 4);
    CHECK(r.generators[0].unread == 0);
    CHECK(r.generators[0].unread_exact);
    CHECK(r.generators[0].ended);
    CHECK(r.generators[1].delivered == 4);
    CHECK_FALSE(r.generators[1].ended);
    CHECK_FALSE(r.generators[1].unread_exact);  // a lower bound: the stream did not end
    return r.generators[1].unread;
  };
  SUBCASE("default options: no counting; unread = samples prefetched and dropped (at most prefetch_depth)") {
    loom::GeneratorLoader<Gen> s(make(), {.num_devices = 1, .prefetch_depth = 2});
    const int64_t unread = run(s);
    CHECK(unread >= 0);
    CHECK(unread <= 2);
  }
  SUBCASE("count_unread on: reads at most count_unread_limit more samples per generator") {
    loom::GeneratorLoader<Gen> s(
        make(), {.num_devices = 1, .prefetch_depth = 2, .count_unread = true, .count_unread_limit = 50});
    const int64_t unread = run(s);
    CHECK(unread >= 50);
    CHECK(unread <= 52);
  }
}

TEST_CASE("GeneratorLoader: drain delivers every sample, partial batches flagged, dry devices empty") {
  std::vector<Stream> gens = streams(4, 0, 200);
  const std::vector<int64_t> lengths = {5, 7, 3, 9};
  for (size_t g = 0; g < 4; ++g) gens[g].length = lengths[g];
  loom::GeneratorLoader<Stream> s(gens, {.num_devices = 2, .end = loom::EndPolicy::drain});
  int64_t k = 0;
  int64_t rows = 0;
  for (auto& step : s) {
    CHECK(step.index == k);
    // the generators still alive at step k, per device, in order
    V alive(2);
    for (int g = 0; g < 4; ++g)
      if (k < lengths[static_cast<size_t>(g)]) alive[static_cast<size_t>(g / 2)].push_back(g);
    for (size_t d = 0; d < 2; ++d) {
      const auto& db = step.devices[d];
      CHECK(db.generators == alive[d]);
      CHECK(db.partial == (alive[d].size() < 2));
      if (alive[d].empty()) {
        CHECK_FALSE(db.batch.data.defined());
        CHECK(db.batch.num_samples == 0);
        CHECK(db.batch.weight == 0.0);
      } else {
        CHECK(db.batch.data.equal(expected_rows(alive[d], k)));
        CHECK(db.batch.weight == 1.0);
      }
      rows += db.num_rows();
    }
    CHECK(step.partial() == (k >= 3));
    ++k;
  }
  CHECK(k == 9);
  CHECK(rows == 5 + 7 + 3 + 9);  // nothing lost
  const auto r = s.report();
  CHECK(r.shortest_generator == -1);
  for (int g = 0; g < 4; ++g) {
    CHECK(r.generators[static_cast<size_t>(g)].delivered == lengths[static_cast<size_t>(g)]);
    CHECK(r.generators[static_cast<size_t>(g)].unread == 0);
  }
}

TEST_CASE("GeneratorLoader: a generator that throws at sample 5 reaches the consumer, naming it; no hang") {
  for (int workers : {0, 1}) {
    CAPTURE(workers);
    std::vector<Stream> gens = streams(8, 1'000'000, 500);
    gens[3].throw_at = 5;  // device 1 (contiguous, 2 per device)
    loom::GeneratorLoader<Stream> s(std::move(gens), {.num_devices = 4, .num_workers = workers});
    int64_t delivered = 0;
    try {
      while (auto step = s.next()) {
        CHECK(step->devices[1].batch.data.equal(expected_rows({2, 3}, delivered)));
        ++delivered;
      }
      FAIL("the schedule ended without the generator's error");
    } catch (const loom::GeneratorError& e) {
      CHECK(e.generator() == 3);
      CHECK(e.device() == 1);
      CHECK(e.sample() == 5);
      CHECK(std::string(e.what()).find("generator 3 (device 1) threw at its sample 5") != std::string::npos);
      CHECK(std::string(e.what()).find("boom at sample 5") != std::string::npos);
      CHECK_THROWS_WITH_AS(std::rethrow_exception(e.original()), "boom at sample 5", std::runtime_error);
    }
    CHECK(delivered == 5);                         // every step before the failing one, deterministically
    CHECK_THROWS_AS(s.next(), loom::RemoteError);  // the same error again
    CHECK_THROWS_AS(s.report(), loom::GeneratorError);
  }
}

TEST_CASE("GeneratorLoader: a collate error (shapes differ) reaches the consumer with its own type") {
  static_assert(std::same_as<loom::GeneratorLoader<Stream>::BatchType, loom::Batch>,
                "the default collate function is DefaultCollate");
  std::vector<std::function<std::optional<at::Tensor>()>> gens;
  for (int g = 0; g < 4; ++g)
    gens.emplace_back([g, k = 0]() mutable -> std::optional<at::Tensor> {
      ++k;
      return torch::zeros({g == 2 && k == 4 ? 3 : 2});
    });
  loom::GeneratorLoader s(std::move(gens), {.num_devices = 2});
  CHECK(s.next().has_value());
  CHECK(s.next().has_value());
  CHECK(s.next().has_value());
  CHECK_THROWS_WITH_AS(s.next(),
                       doctest::Contains("DefaultCollate: device 1, step 3: generator 2 gave a data tensor of shape "
                                         "[3] Float, generator 3 gave [2] Float"),
                       loom::InvalidArgument);
}

TEST_CASE("GeneratorLoader: samples of differing shapes through the collator's padding rules") {
  // generator g yields vectors of length g + 1 filled with k: padded to 3 per device step
  std::vector<std::function<std::optional<at::Tensor>()>> gens;
  for (int g = 0; g < 4; ++g)
    gens.emplace_back([g, k = int64_t{0}]() mutable -> std::optional<at::Tensor> {
      if (k == 3) return std::nullopt;
      return torch::full({g + 1}, static_cast<double>(k++));
    });
  using Sched = loom::GeneratorLoader<std::function<std::optional<at::Tensor>()>>;
  Sched s(std::move(gens), {.num_devices = 2, .assignment = loom::Assignment::round_robin()},
          loom::DefaultCollate<>{.pad = true, .options = {.padded_shape = {4}, .mask = true}});
  int64_t k = 0;
  for (auto& step : s) {
    for (int d = 0; d < 2; ++d) {
      const auto& b = step.devices[static_cast<size_t>(d)].batch;  // generators d and d + 2: lengths d+1, d+3
      auto data = torch::zeros({2, 4});
      auto mask = torch::zeros({2, 4}, torch::kBool);
      data[0].slice(0, 0, d + 1).fill_(static_cast<double>(k));
      mask[0].slice(0, 0, d + 1).fill_(true);
      data[1].slice(0, 0, d + 3).fill_(static_cast<double>(k));
      mask[1].slice(0, 0, d + 3).fill_(true);
      CHECK(b.data.equal(data));
      CHECK(b.mask.equal(mask));
    }
    ++k;
  }
  CHECK(k == 3);
}

TEST_CASE("GeneratorLoader: early stop (break, exception, destructor) stops and joins the workers") {
  auto pulls = std::make_shared<std::atomic<int64_t>>(0);
  auto endless = [&] {
    std::vector<Stream> gens = streams(6, 1'000'000, 1000);
    for (auto& g : gens) g.pulls = pulls;
    return gens;
  };
  SUBCASE("exception in the loop") {
    try {
      loom::GeneratorLoader<Stream> s(endless(), {.num_devices = 3});
      for (auto& step : s)
        if (step.index == 2) throw std::logic_error("consumer gives up");
    } catch (const std::logic_error&) {
    }
  }
  SUBCASE("break, then destruction") {
    {
      loom::GeneratorLoader<Stream> s(endless(), {.num_devices = 3, .prefetch_depth = 3});
      for (auto& step : s)
        if (step.index == 1) break;
    }
  }
  SUBCASE("stop()") {
    loom::GeneratorLoader<Stream> s(endless(), {.num_devices = 3});
    CHECK(s.next().has_value());
    s.stop();
    CHECK_FALSE(s.next().has_value());
  }
  // the workers are joined: no generator is called any more
  const int64_t after = pulls->load();
  CHECK(after > 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  CHECK(pulls->load() == after);
}

namespace {
// A sample that counts live instances (the bounded-memory test keeps samples alive inside its
// batches with VectorCollate, so every queued batch counts).
struct Counted {
  // live = samples that exist as values (a moved-from husk no longer counts), so the count is
  // the number of logical samples alive anywhere: in a generator's return value, a queue, a batch.
  static inline std::atomic<int64_t> live{0};
  static inline std::atomic<int64_t> peak{0};
  int g = 0;
  int64_t k = 0;
  bool husk = false;
  Counted(int g_, int64_t k_) : g(g_), k(k_) { bump(); }
  Counted(const Counted& o) : g(o.g), k(o.k) { bump(); }
  Counted(Counted&& o) noexcept : g(o.g), k(o.k), husk(o.husk) { o.husk = true; }
  Counted& operator=(const Counted&) = delete;
  ~Counted() {
    if (!husk) live.fetch_sub(1);
  }
  static void bump() {
    const int64_t now = live.fetch_add(1) + 1;
    int64_t p = peak.load();
    while (now > p && !peak.compare_exchange_weak(p, now)) {
    }
  }
};
struct CountedStream {
  int g;
  int64_t length;
  int64_t k = 0;
  std::optional<Counted> operator()() {
    if (k >= length) return std::nullopt;
    return Counted(g, k++);
  }
};
// Collates by keeping the samples (moved) in a vector: a non-Batch batch type through the seam.
struct VectorCollate {
  std::vector<Counted> operator()(std::span<Counted> s, const loom::CollateContext&) const {
    return {std::make_move_iterator(s.begin()), std::make_move_iterator(s.end())};
  }
};
}  // namespace

TEST_CASE("GeneratorLoader: bounded memory — the workers fill exactly depth batches per device ahead, never more") {
  // While the consumer holds step k, the workers build the next min(depth, 39 - k) steps of every
  // device and then stop: live samples reach exactly (1 + min(depth, 39 - k)) x 6 (the held step
  // plus the prefetched ones) and never exceed (depth + 1) x 6. Waiting for the exact count (an
  // event, with a generous deadline that only a broken loader reaches) makes the lower bound
  // testable: a loader that prefetched less (or not at all) never reaches it.
  for (int depth : {1, 3}) {
    CAPTURE(depth);
    Counted::live = 0;
    Counted::peak = 0;
    std::vector<CountedStream> gens;
    for (int g = 0; g < 6; ++g) gens.push_back({g, 40});
    {
      loom::GeneratorLoader<CountedStream, VectorCollate> s(std::move(gens),
                                                            {.num_devices = 3, .prefetch_depth = depth});
      int64_t k = 0;
      for (auto& step : s) {
        const int64_t ahead = std::min<int64_t>(depth, 39 - k);
        const int64_t expected = (1 + ahead) * 6;
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
        while (Counted::live.load() < expected && std::chrono::steady_clock::now() < deadline)
          std::this_thread::sleep_for(std::chrono::microseconds(200));
        CAPTURE(k);
        REQUIRE(Counted::live.load() == expected);  // prefetched all it may, and no more
        for (auto& db : step.devices) {
          REQUIRE(db.batch.size() == 2);
          CHECK(db.batch[0].k == k);
          CHECK(db.batch[1].g == 2 * db.device + 1);
        }
        ++k;
      }
      CHECK(k == 40);
    }
    // inside the loader: at most `depth` batches per device (queued or being built), 2 samples
    // each; plus the step the consumer holds (6 samples).
    CHECK(Counted::peak.load() <= (depth + 1) * 6);
    CHECK(Counted::live.load() == 0);
  }
}

TEST_CASE("GeneratorLoader: determinism — the same batches on every run whatever the thread timing") {
  auto collect = [](uint64_t seed, int workers, int depth) {
    std::vector<Stream> gens = streams(10, 12, 400, seed);
    gens[7].length = 9;
    std::vector<at::Tensor> out;
    loom::GeneratorLoader<Stream> s(std::move(gens), {.num_devices = 4,
                                                      .assignment = loom::Assignment::round_robin(),
                                                      .prefetch_depth = depth,
                                                      .num_workers = workers,
                                                      .end = loom::EndPolicy::drain});
    for (auto& step : s)
      for (auto& db : step.devices) out.push_back(db.batch.data.defined() ? db.batch.data : torch::empty({0}));
    return out;
  };
  const auto first = collect(1, 0, 2);
  REQUIRE(first.size() == 12 * 4);
  for (auto [seed, workers, depth] : {std::tuple{2, 0, 1}, {3, 2, 3}, {4, 1, 2}, {5, 4, 1}}) {
    const auto again = collect(static_cast<uint64_t>(seed), workers, depth);
    REQUIRE(again.size() == first.size());
    for (size_t i = 0; i < first.size(); ++i) CHECK(again[i].equal(first[i]));
  }
}

TEST_CASE("GeneratorLoader: a saved state resumes to the uninterrupted sequence") {
  const V hand = {{0, 1, 2}, {3, 4, 5}, {6, 7}, {8, 9}};
  loom::GeneratorLoaderState saved;
  {
    loom::GeneratorLoader<Stream> s(streams(10, 8, 200), {.num_devices = 4});
    for (int i = 0; i < 3; ++i) REQUIRE(s.next().has_value());
    saved = s.state();
  }
  CHECK(saved.steps == 3);
  CHECK(saved.samples == std::vector<int64_t>(10, 3));
  CHECK(saved.num_devices == 4);
  SUBCASE("replaying generators (pull and drop)") {
    loom::GeneratorLoader<Stream> s(streams(10, 8, 200), {.num_devices = 4, .resume = saved});
    int64_t k = 3;
    for (auto& step : s) {
      CHECK(step.index == k);
      for (size_t d = 0; d < 4; ++d) CHECK(step.devices[d].batch.data.equal(expected_rows(hand[d], k)));
      ++k;
    }
    CHECK(k == 8);
    CHECK(s.report().generators[0].delivered == 8);
  }
  SUBCASE("skippable generators: skip() instead of replay") {
    auto skipped = std::make_shared<std::atomic<int64_t>>(0);
    std::vector<loom::test::SkippableStream> gens(10);
    for (int g = 0; g < 10; ++g) {
      gens[static_cast<size_t>(g)].g = g;
      gens[static_cast<size_t>(g)].length = 8;
      gens[static_cast<size_t>(g)].skipped = skipped;
    }
    loom::GeneratorLoader s(std::move(gens), {.num_devices = 4, .resume = saved});
    auto step = s.next();
    REQUIRE(step.has_value());
    CHECK(step->index == 3);
    CHECK(step->devices[3].batch.data.equal(expected_rows({8, 9}, 3)));
    CHECK(skipped->load() == 30);
  }
  SUBCASE("a state from another device count is refused") {
    CHECK_THROWS_WITH_AS(loom::GeneratorLoader<Stream>(streams(10), {.num_devices = 5, .resume = saved}),
                         doctest::Contains("taken with 4 devices"), loom::InvalidArgument);
  }
}

namespace {
struct ThreadCheckTransfer {
  struct Ticket {
    std::thread::id worker;
    int64_t rows = 0;
  };
  std::shared_ptr<std::atomic<int>> bad;
  Ticket start(loom::Batch& b, int device) {
    b.targets = torch::full({1}, device, torch::kLong);  // a transfer may rewrite the batch
    return {std::this_thread::get_id(), b.num_samples};
  }
  void finish(loom::Batch& b, int, Ticket& t) {
    if (t.worker == std::this_thread::get_id() || t.rows != b.num_samples) bad->fetch_add(1);
  }
};
}  // namespace

TEST_CASE("GeneratorLoader: the transfer seam — start on the worker thread, finish on the consumer's") {
  auto bad = std::make_shared<std::atomic<int>>(0);
  loom::GeneratorLoader<Stream, loom::DefaultCollate<>, ThreadCheckTransfer> s(streams(4, 5), {.num_devices = 2}, {},
                                                                               ThreadCheckTransfer{bad});
  int64_t steps = 0;
  for (auto& step : s) {
    for (auto& db : step.devices) CHECK(db.batch.targets.item<int64_t>() == db.device);
    ++steps;
  }
  CHECK(steps == 5);
  CHECK(bad->load() == 0);
}

TEST_CASE("GeneratorLoader with DeviceTransfer: batches arrive on the device; a label without a device is named") {
  // The meta device keeps shapes and dtypes without storage, on any build. Samples: int64 [g, k].
  loom::GeneratorLoader<Stream, loom::DefaultCollate<>, loom::DeviceTransfer> s(
      streams(4, 3), {.num_devices = 2}, {}, loom::DeviceTransfer({.type = c10::kMeta}));
  int64_t steps = 0;
  for (auto& step : s) {
    for (auto& db : step.devices) {
      CHECK(db.batch.data.is_meta());
      CHECK_FALSE(db.batch.targets.defined());  // Stream's samples have no target
      CHECK(db.batch.num_samples == 2);
      CHECK(db.batch.data.size(0) == 2);
    }
    ++steps;
  }
  CHECK(steps == 3);

  // Two device slots, one device listed: slot 1's first batch fails on its worker, and the
  // consumer gets the error naming the label.
  loom::GeneratorLoader<Stream, loom::DefaultCollate<>, loom::DeviceTransfer> bad(
      streams(4, 3), {.num_devices = 2}, {}, loom::DeviceTransfer({.type = c10::kMeta, .devices = {0}}));
  auto run = [&] {
    for (auto& step : bad) (void)step;
  };
  CHECK_THROWS_WITH_AS(run(), doctest::Contains("device label 1 has no entry in devices [0]"), loom::InvalidArgument);
}

namespace {
struct FailingFinish {  // finish() throws at step 2: the consumer gets it, then the same error again
  struct Ticket {};
  Ticket start(loom::Batch&, int) { return {}; }
  void finish(loom::Batch& b, int, Ticket&) {
    if (b.data[0][1].item<int64_t>() == 2) throw std::runtime_error("copy failed at step 2");
  }
};
}  // namespace

TEST_CASE("GeneratorLoader: a transfer that fails on the consumer's side ends the schedule, no hang") {
  loom::GeneratorLoader<Stream, loom::DefaultCollate<>, FailingFinish> s(streams(4, 10, 200), {.num_devices = 2});
  CHECK(s.next().has_value());
  CHECK(s.next().has_value());
  CHECK_THROWS_WITH_AS(s.next(), "copy failed at step 2", std::runtime_error);
  CHECK_THROWS_WITH_AS(s.next(), "copy failed at step 2", std::runtime_error);
}

TEST_CASE("GeneratorLoader: a generator that reuses one output tensor still gets its own rows in every batch") {
  loom::GeneratorLoader<loom::test::ReusingStream> loader(loom::test::fast_and_slow_reusing(6),
                                                          {.num_devices = 1, .prefetch_depth = 3});
  int64_t k = 0;
  for (auto& step : loader) {
    CAPTURE(k);
    CHECK(step.devices[0].batch.data.equal(expected_rows({0, 1}, k)));
    ++k;
  }
  CHECK(k == 6);
}

namespace {
// Keeps the samples' tensors as the batch (no copy): what reaches the consumer is what the
// loader held.
struct KeepCollate {
  std::vector<at::Tensor> operator()(std::span<at::Tensor> s, const loom::CollateContext&) const {
    return {s.begin(), s.end()};
  }
};
// A generator of fresh tensors that records where each sample's memory is. `where` has a slot per
// sample, sized before the loader starts: the generator runs on a worker thread, and a push_back
// there could reallocate the vector while the test thread reads an earlier slot (AddressSanitizer:
// heap-use-after-free). Slot k is written before sample k is handed over, and read after.
struct RecordingStream {
  std::shared_ptr<std::vector<const void*>> where;
  int64_t k = 0;
  std::optional<at::Tensor> operator()() {
    if (k == static_cast<int64_t>(where->size())) return std::nullopt;
    at::Tensor t = torch::full({3}, k, torch::kLong);
    (*where)[static_cast<std::size_t>(k++)] = t.data_ptr();
    return t;
  }
};
}  // namespace

TEST_CASE("GeneratorLoader: fresh samples reach the batch without a copy; a reused buffer is copied once") {
  SUBCASE("fresh tensors: the batch holds the generator's own memory") {
    auto where = std::make_shared<std::vector<const void*>>(5);
    std::vector<RecordingStream> gens{RecordingStream{where}};
    loom::GeneratorLoader<RecordingStream, KeepCollate> loader(std::move(gens),
                                                               {.num_devices = 1, .prefetch_depth = 3});
    int64_t k = 0;
    for (auto& step : loader) {
      const at::Tensor& t = step.devices[0].batch.at(0);
      CHECK(t.equal(torch::full({3}, k, torch::kLong)));
      CHECK(t.data_ptr() == where->at(static_cast<std::size_t>(k)));
      ++k;
    }
    CHECK(k == 5);
  }
  SUBCASE("a reused buffer: each batch holds its own copy with its own values") {
    loom::GeneratorLoader<loom::test::ReusingStream, KeepCollate> loader(loom::test::fast_and_slow_reusing(5),
                                                                         {.num_devices = 1, .prefetch_depth = 3});
    std::vector<std::vector<at::Tensor>> kept;
    for (auto& step : loader) kept.push_back(step.devices[0].batch);  // batches kept past the generator's later calls
    REQUIRE(kept.size() == 5);
    for (std::size_t k = 0; k < kept.size(); ++k) {
      CAPTURE(k);
      CHECK(torch::stack(kept[k]).equal(expected_rows({0, 1}, static_cast<int64_t>(k))));
    }
  }
}

namespace {
// Sample k of generator g is the float32 2 x 3 tensor [[g, k, 0], [g, k, 1]] + 100 * c (c = 0..2
// over the columns), written into one 3 x 2 buffer the generator keeps and returned transposed: a
// view of a reused buffer, not contiguous.
struct TransposedReusingStream {
  int g = 0;
  int64_t length = 0;
  at::Tensor buffer = torch::empty({3, 2}, torch::kFloat);
  int64_t k = 0;
  std::optional<at::Tensor> operator()() {
    if (k >= length) return std::nullopt;
    auto* p = buffer.data_ptr<float>();  // buffer[c][r] = value at row r, column c of the sample
    for (int c = 0; c < 3; ++c)
      for (int r = 0; r < 2; ++r) p[c * 2 + r] = static_cast<float>(1000 * g + 10 * k + r + 100 * c);
    ++k;
    return buffer.t();
  }
};
float transposed_value(int g, int64_t k, int r, int c) {
  return static_cast<float>(1000 * g + 10 * k + r + 100 * c);
}

// A generator that returns the same (cached) tensor each time: sample k of generator g is
// full({4}, g) for every k, a tensor the loader does not own.
struct CachedStream {
  at::Tensor sample;
  int64_t length = 0;
  int64_t k = 0;
  std::optional<at::Tensor> operator()() {
    if (k++ >= length) return std::nullopt;
    return sample;
  }
};
}  // namespace

TEST_CASE("GeneratorLoader: batch buffers are reused across steps; a batch kept longer keeps its values") {
  const int depth = 2;
  SUBCASE("range-for: each step dropped before the next, so at most depth + 2 buffers cycle") {
    loom::GeneratorLoader<Stream> loader(streams(2, 30), {.num_devices = 1, .prefetch_depth = depth});
    std::vector<const void*> where;
    int64_t k = 0;
    for (auto& step : loader) {
      CAPTURE(k);
      CHECK(step.devices[0].batch.data.equal(expected_rows({0, 1}, k)));
      where.push_back(step.devices[0].batch.data.data_ptr());
      ++k;
    }
    REQUIRE(k == 30);
    const std::set<const void*> distinct(where.begin(), where.end());
    CHECK(distinct.size() <= static_cast<std::size_t>(depth + 2));
  }
  SUBCASE("every batch kept: none is overwritten, each has its own buffer") {
    loom::GeneratorLoader<Stream> loader(streams(2, 30), {.num_devices = 1, .prefetch_depth = depth});
    std::vector<loom::Batch> kept;
    while (auto step = loader.next()) kept.push_back(std::move(step->devices[0].batch));
    REQUIRE(kept.size() == 30);
    std::set<const void*> distinct;
    for (std::size_t k = 0; k < kept.size(); ++k) {
      CAPTURE(k);
      CHECK(kept[k].data.equal(expected_rows({0, 1}, static_cast<int64_t>(k))));
      distinct.insert(kept[k].data.data_ptr());
    }
    CHECK(distinct.size() == 30);
  }
  SUBCASE("an allocator given to DefaultCollate allocates the loader's pooled buffers, not one per batch") {
    auto calls = std::make_shared<std::atomic<int>>(0);
    loom::DefaultCollate<> collate_fn;
    collate_fn.options.allocate = [calls](c10::IntArrayRef sizes, c10::ScalarType dtype) {
      calls->fetch_add(1);
      return torch::empty(sizes, torch::TensorOptions(dtype));
    };
    loom::GeneratorLoader<Stream> loader(streams(2, 30), {.num_devices = 1, .prefetch_depth = depth}, collate_fn);
    int64_t k = 0;
    for (auto& step : loader) {
      CHECK(step.devices[0].batch.data.equal(expected_rows({0, 1}, k)));
      ++k;
    }
    CHECK(k == 30);
    CHECK(calls->load() >= 1);
    CHECK(calls->load() <= depth + 2);
  }
  SUBCASE("a pool given to DefaultCollate is the one the loader uses") {
    auto pool = std::make_shared<loom::BufferPool>();
    loom::DefaultCollate<> collate_fn;
    collate_fn.options.pool = pool;
    loom::GeneratorLoader<Stream> loader(streams(4, 20), {.num_devices = 2, .prefetch_depth = depth}, collate_fn);
    int64_t k = 0;
    for (auto& step : loader) {
      CHECK(step.devices[1].batch.data.equal(expected_rows({2, 3}, k)));
      ++k;
    }
    CHECK(k == 20);
    CHECK(pool->allocations() + pool->reuses() == 40);  // one buffer per device and step
    CHECK(pool->allocations() <= 2 * (depth + 2));
  }
}

TEST_CASE("GeneratorLoader: generators returning a cached tensor or a transposed view of a reused buffer") {
  SUBCASE("a transposed view of one reused buffer, depth 4, 2 workers, 2 devices") {
    std::vector<TransposedReusingStream> gens;
    for (int g = 0; g < 4; ++g) gens.push_back({.g = g, .length = 12});
    loom::GeneratorLoader<TransposedReusingStream> loader(std::move(gens),
                                                          {.num_devices = 2, .prefetch_depth = 4, .num_workers = 2});
    std::vector<loom::GeneratorLoaderStep<loom::Batch>> kept;
    while (auto step = loader.next()) kept.push_back(std::move(*step));
    REQUIRE(kept.size() == 12);
    for (int64_t k = 0; k < 12; ++k) {
      for (int d = 0; d < 2; ++d) {
        const at::Tensor& data = kept[static_cast<std::size_t>(k)].devices[static_cast<std::size_t>(d)].batch.data;
        REQUIRE(data.sizes() == c10::IntArrayRef({2, 2, 3}));
        auto a = data.accessor<float, 3>();
        for (int i = 0; i < 2; ++i)
          for (int r = 0; r < 2; ++r)
            for (int c = 0; c < 3; ++c) {
              CAPTURE(k);
              CAPTURE(d);
              CHECK(a[i][r][c] == transposed_value(2 * d + i, k, r, c));
            }
      }
    }
  }
  SUBCASE("the same cached tensor every call: its values in every row, the tensor itself unchanged") {
    std::vector<at::Tensor> cached;
    std::vector<CachedStream> gens;
    for (int g = 0; g < 3; ++g) {
      cached.push_back(torch::full({4}, static_cast<double>(g), torch::kDouble));
      gens.push_back({.sample = cached.back(), .length = 9});
    }
    loom::GeneratorLoader<CachedStream> loader(std::move(gens), {.num_devices = 1, .prefetch_depth = 4});
    int64_t k = 0;
    for (auto& step : loader) {
      const loom::Batch& b = step.devices[0].batch;
      CHECK(b.data.equal(torch::stack({torch::full({4}, 0.0, torch::kDouble), torch::full({4}, 1.0, torch::kDouble),
                                       torch::full({4}, 2.0, torch::kDouble)})));
      CHECK(b.indices == std::vector<int64_t>{0, 1, 2});
      CHECK(b.data.data_ptr() != cached[0].data_ptr());
      ++k;
    }
    CHECK(k == 9);
    for (int g = 0; g < 3; ++g)
      CHECK(cached[static_cast<std::size_t>(g)].equal(torch::full({4}, double(g), torch::kDouble)));
  }
  SUBCASE("pairs with integer targets and a generator of another shape: the error names both generators") {
    std::vector<std::vector<std::pair<at::Tensor, int64_t>>> gens(2);
    for (int k = 0; k < 3; ++k) {
      gens[0].push_back({torch::full({2}, 1.0 + k), 10 + k});
      gens[1].push_back({torch::full({k == 2 ? 3 : 2}, 2.0 + k), 20 + k});
    }
    loom::GeneratorLoader s(std::move(gens), {.num_devices = 1});
    for (int64_t k = 0; k < 2; ++k) {
      auto step = s.next();
      REQUIRE(step.has_value());
      CHECK(step->devices[0].batch.data.equal(torch::stack({torch::full({2}, 1.0 + k), torch::full({2}, 2.0 + k)})));
      CHECK(step->devices[0].batch.targets.equal(torch::tensor({10 + k, 20 + k})));
    }
    CHECK_THROWS_WITH_AS(s.next(),
                         doctest::Contains("device 0, step 2: generator 0 gave a data tensor of shape [2] Float, "
                                           "generator 1 gave [3] Float"),
                         loom::InvalidArgument);
  }
}

TEST_CASE("GeneratorLoader: bad options name the value") {
  CHECK_THROWS_WITH_AS(loom::GeneratorLoader<Stream>(streams(4), {.num_devices = 0}),
                       doctest::Contains("num_devices is 0"), loom::InvalidArgument);
  CHECK_THROWS_WITH_AS(loom::GeneratorLoader<Stream>(streams(4), {.num_devices = 2, .prefetch_depth = 0}),
                       doctest::Contains("prefetch_depth is 0"), loom::InvalidArgument);
  CHECK_THROWS_WITH_AS(loom::GeneratorLoader<Stream>(streams(3), {.num_devices = 4}),
                       doctest::Contains("3 generators onto 4 devices"), loom::InvalidArgument);
  CHECK_THROWS_WITH_AS(
      loom::GeneratorLoader<Stream>(streams(4), {.num_devices = 2, .count_unread = true, .count_unread_limit = 0}),
      doctest::Contains("count_unread_limit is 0"), loom::InvalidArgument);
  CHECK_THROWS_AS(loom::GeneratorLoader<Stream>(streams(4), {.num_devices = 2, .num_workers = -1}),
                  loom::InvalidArgument);
  CHECK_THROWS_AS(loom::GeneratorLoader<Stream>(std::vector<Stream>{}, {}), loom::InvalidArgument);
  loom::GeneratorLoader<Stream> s(streams(2, 3), {.num_devices = 1});
  CHECK_THROWS_WITH_AS(s.report(), doctest::Contains("has not ended"), loom::InvalidArgument);
}

}  // namespace test_generator_loader
