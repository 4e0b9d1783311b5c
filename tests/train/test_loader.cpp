// BatchLoader's background loading (LoaderOptions::num_workers): the batches, their order and the
// cursor equal those of loading on the training thread; loads run ahead by at most
// num_workers * prefetch_factor batches; resume, a sampler moved by hand, a move of the loader and
// its destruction mid-epoch; a worker's error reaches next() naming the sample. Multi-rank twin:
// "a loader with workers on 2 ranks" in test_trainer_dist.cpp.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <typeinfo>
#include <utility>
#include <vector>

#include <doctest/doctest.h>
#include <torch/torch.h>

#include <loom/comm/local.hpp>

#include "trainer_fixture.hpp"

namespace test_loader {

namespace {

using namespace std::chrono_literals;

// Sample i of the trainer fixture, after a delay that differs by index (so workers finish out of
// order), counting the calls.
struct SlowFetch {
  std::atomic<int64_t>* calls;
  std::pair<at::Tensor, at::Tensor> operator()(int64_t i) const {
    std::this_thread::sleep_for(std::chrono::microseconds(300 * (i % 4)));
    calls->fetch_add(1);
    return loom::test::trainer_sample(i);
  }
};

using SlowLoader = loom::BatchLoader<SlowFetch>;

SlowLoader make_loader(loom::LocalCommunicator& comm, std::atomic<int64_t>& calls, int workers, int prefetch = 2) {
  return SlowLoader(comm, loom::test::trainer_shapes(), SlowFetch{&calls}, loom::test::kTrainerPlan,
                    {.num_workers = workers, .prefetch_factor = prefetch});
}

bool same(const at::Tensor& a, const at::Tensor& b) {
  if (a.defined() != b.defined()) return false;
  return !a.defined() || (a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type() && torch::equal(a, b));
}

bool same(const loom::Batch& a, const loom::Batch& b) {
  return same(a.data, b.data) && same(a.targets, b.targets) && same(a.mask, b.mask) && a.indices == b.indices &&
         a.num_samples == b.num_samples && a.weight == b.weight && a.step_end == b.step_end && a.step == b.step &&
         a.idle == b.idle;
}

// The rest of the epoch from `loader`.
template <class L>
std::vector<loom::Batch> drain(L& loader) {
  std::vector<loom::Batch> out;
  while (auto b = loader.next()) out.push_back(std::move(*b));
  return out;
}

void check_same(const std::vector<loom::Batch>& a, const std::vector<loom::Batch>& b) {
  REQUIRE(a.size() == b.size());
  for (std::size_t k = 0; k < a.size(); ++k) {
    CAPTURE(k);
    CHECK(same(a[k], b[k]));
  }
}

// Waits until `calls` reaches `want` (at most 10 s), then 200 ms more (time for loads beyond it to
// show); returns its value.
int64_t settled(const std::atomic<int64_t>& calls, int64_t want) {
  for (int k = 0; k < 1000 && calls.load() < want; ++k) std::this_thread::sleep_for(10ms);
  std::this_thread::sleep_for(200ms);
  return calls.load();
}

}  // namespace

TEST_CASE("BatchLoader num_workers: the batches, their order and the cursor equal loading on the training thread") {
  loom::LocalCommunicator comm;
  std::atomic<int64_t> calls{0};
  SlowLoader reference = make_loader(comm, calls, 0);
  std::vector<std::vector<loom::Batch>> expected;
  for (int64_t e = 0; e < 2; ++e) {
    reference.begin_epoch(e);
    expected.push_back(drain(reference));
  }
  REQUIRE(expected[0].size() > 8);
  for (const int workers : {1, 2, 4}) {
    for (const int prefetch : {1, 3}) {
      CAPTURE(workers);
      CAPTURE(prefetch);
      SlowLoader loader = make_loader(comm, calls, workers, prefetch);
      SlowLoader sync = make_loader(comm, calls, 0);
      for (int64_t e = 0; e < 2; ++e) {
        loader.begin_epoch(e);
        sync.begin_epoch(e);
        std::vector<loom::Batch> got;
        while (auto b = loader.next()) {
          got.push_back(std::move(*b));
          REQUIRE(sync.next());
          // The cursor names exactly the batches handed out, however far the workers ran ahead.
          CHECK(loader.sampler().cursor() == sync.sampler().cursor());
        }
        check_same(got, expected[static_cast<std::size_t>(e)]);
      }
    }
  }
}

TEST_CASE("BatchLoader num_workers: loads run ahead by num_workers * prefetch_factor batches, no more") {
  loom::LocalCommunicator comm;
  std::atomic<int64_t> calls{0};
  SlowLoader loader = make_loader(comm, calls, 2, 2);
  loader.begin_epoch(0);
  CHECK(calls.load() == 0);  // nothing starts before the first next()
  REQUIRE(loader.next());
  // The first batch and the 4 after it are loaded; then the workers wait for the loop.
  const auto& batches = loader.sampler().plan().batches;
  int64_t ahead = 0;
  for (std::size_t k = 0; k < 5; ++k) ahead += static_cast<int64_t>(batches[k].indices.size());
  CHECK(settled(calls, ahead) == ahead);
  REQUIRE(loader.next());
  const int64_t more = ahead + static_cast<int64_t>(batches[5].indices.size());
  CHECK(settled(calls, more) == more);
}

TEST_CASE("BatchLoader num_workers: resume, a sampler moved by hand and a moved loader continue exactly") {
  loom::LocalCommunicator comm;
  std::atomic<int64_t> calls{0};
  SlowLoader sync = make_loader(comm, calls, 0);
  sync.begin_epoch(1);
  for (int k = 0; k < 4; ++k) REQUIRE(sync.next());
  const loom::GlobalCursor cursor = sync.sampler().cursor();
  REQUIRE(cursor.step > 0);
  SlowLoader from_cursor = make_loader(comm, calls, 0);
  from_cursor.resume(cursor);
  from_cursor.begin_epoch(1);
  const std::vector<loom::Batch> rest = drain(from_cursor);

  SUBCASE("resume() while the workers are loading another epoch") {
    SlowLoader loader = make_loader(comm, calls, 3);
    loader.begin_epoch(0);
    REQUIRE(loader.next());
    loader.resume(cursor);
    loader.begin_epoch(1);
    check_same(drain(loader), rest);
  }
  SUBCASE("sampler().resume() by hand mid-epoch: next() notices and continues from the sampler") {
    SlowLoader loader = make_loader(comm, calls, 3);
    loader.begin_epoch(1);
    REQUIRE(loader.next());
    loader.sampler().resume(cursor);
    check_same(drain(loader), rest);
  }
  SUBCASE("a loader moved mid-epoch continues where it was") {
    SlowLoader loader = make_loader(comm, calls, 2);
    loader.resume(cursor);
    loader.begin_epoch(1);
    auto first = loader.next();
    REQUIRE(first);
    SlowLoader moved = std::move(loader);
    std::vector<loom::Batch> got{std::move(*first)};
    for (auto& b : drain(moved)) got.push_back(std::move(b));
    check_same(got, rest);
  }
}

TEST_CASE("BatchLoader num_workers: destroyed mid-epoch, its workers stop; no fetch runs afterwards") {
  loom::LocalCommunicator comm;
  std::atomic<int64_t> calls{0};
  {
    SlowLoader loader = make_loader(comm, calls, 4, 4);
    loader.begin_epoch(0);
    REQUIRE(loader.next());
  }
  const int64_t after = calls.load();
  std::this_thread::sleep_for(100ms);
  CHECK(calls.load() == after);
}

TEST_CASE("BatchLoader num_workers: the Trainer's run equals the run loading on the training thread, bit for bit") {
  loom::LocalCommunicator comm;
  const auto sync = loom::test::train_short(comm, 2);
  const auto background = loom::test::train_short(comm, 2, {.num_workers = 2});
  REQUIRE(sync.size() == background.size());
  for (std::size_t k = 0; k < sync.size(); ++k) CHECK(torch::equal(sync[k], background[k]));
}

TEST_CASE("BatchLoader num_workers: a worker's error reaches next() when its batch is due, naming the sample") {
  loom::LocalCommunicator comm;
  const auto shapes = loom::test::trainer_shapes();
  // Which batch holds sample 7, and how many batches come before it.
  loom::BatchLoader probe(comm, shapes, loom::test::trainer_fetch(), loom::test::kTrainerPlan);
  probe.begin_epoch(0);
  int64_t before = 0;
  for (auto b = probe.next(); b && std::find(b->indices.begin(), b->indices.end(), 7) == b->indices.end();
       b = probe.next())
    ++before;
  SUBCASE("a fetch that throws") {
    auto failed = std::make_shared<std::atomic<bool>>(false);
    auto fetch = [failed](int64_t i) {  // fails once
      if (i == 7 && !failed->exchange(true)) throw std::runtime_error("disk gone");
      return loom::test::trainer_sample(i);
    };
    loom::BatchLoader loader(comm, shapes, fetch, loom::test::kTrainerPlan, {.num_workers = 2});
    loader.begin_epoch(0);
    for (int64_t k = 0; k < before; ++k) REQUIRE(loader.next());  // the batches before it arrive
    std::string text;
    try {
      (void)loader.next();
    } catch (const loom::Error& e) {
      CHECK(typeid(e) == typeid(loom::Error));  // what a spawned rank reports by name
      text = e.what();
    }
    CHECK(text.find("a worker thread failed to load step") != std::string::npos);
    CHECK(text.find("in fetch(7): disk gone") != std::string::npos);
    // The loader starts over at the next epoch, sample 7 included.
    loader.begin_epoch(1);
    int64_t samples = 0;
    while (auto b = loader.next()) samples += b->num_samples;
    CHECK(samples == loom::test::kTrainerSamples);
  }
  SUBCASE("a sample of another shape than declared") {
    auto fetch = [](int64_t i) {
      auto s = loom::test::trainer_sample(i);
      if (i == 7) s.first = torch::zeros({9, loom::test::kIn}, torch::kDouble);
      return s;
    };
    loom::BatchLoader loader(comm, shapes, fetch, loom::test::kTrainerPlan, {.num_workers = 3});
    loader.begin_epoch(0);
    for (int64_t k = 0; k < before; ++k) REQUIRE(loader.next());
    CHECK_THROWS_WITH_AS((void)loader.next(), doctest::Contains("fetch(7) returned a sample of shape [9, 3]"),
                         loom::InvalidArgument);  // the type loading on the training thread throws
  }
}

TEST_CASE("BatchLoader num_workers: a fetch that reuses one buffer across threads is an error; thread_local is not") {
  // A decoder writing every sample into one buffer and returning a view of it: with 2 workers one
  // thread's decode overwrites the other's sample before it is copied (wrong batches, were it not
  // refused).
  loom::LocalCommunicator comm;
  auto shared = std::make_shared<at::Tensor>(torch::zeros({5, loom::test::kIn}, torch::kDouble));
  auto shared_fetch = [shared](int64_t i) {
    auto [x, y] = loom::test::trainer_sample(i);
    at::Tensor view = shared->narrow(0, 0, x.size(0));
    view.copy_(x);
    std::this_thread::sleep_for(std::chrono::microseconds(500));
    return std::make_pair(view, y);
  };
  loom::BatchLoader bad(comm, loom::test::trainer_shapes(), shared_fetch, loom::test::kTrainerPlan, {.num_workers = 2});
  bad.begin_epoch(0);
  CHECK_THROWS_WITH_AS((void)drain(bad), doctest::Contains("fetch reuses one buffer across threads"),
                       loom::InvalidArgument);
  // One buffer per thread: the batches of loading on the training thread.
  auto own_fetch = [](int64_t i) {
    thread_local at::Tensor buffer = torch::zeros({5, loom::test::kIn}, torch::kDouble);
    auto [x, y] = loom::test::trainer_sample(i);
    at::Tensor view = buffer.narrow(0, 0, x.size(0));
    view.copy_(x);
    std::this_thread::sleep_for(std::chrono::microseconds(500));
    return std::make_pair(view, y);
  };
  loom::BatchLoader good(comm, loom::test::trainer_shapes(), own_fetch, loom::test::kTrainerPlan, {.num_workers = 2});
  loom::BatchLoader plain(comm, loom::test::trainer_shapes(), loom::test::trainer_fetch(), loom::test::kTrainerPlan);
  // A constant tensor per shape returned for every sample (placeholder data) is shared but never rewritten.
  auto constant_fetch = [](int64_t i) {
    static const std::vector<at::Tensor> by_length = {torch::ones({2, loom::test::kIn}, torch::kDouble),
                                                      torch::ones({3, loom::test::kIn}, torch::kDouble),
                                                      torch::ones({5, loom::test::kIn}, torch::kDouble)};
    const int64_t length = loom::test::trainer_length(i);
    return std::make_pair(by_length[length == 2 ? 0 : length == 3 ? 1 : 2], loom::test::trainer_sample(i).second);
  };
  loom::BatchLoader constant(comm, loom::test::trainer_shapes(), constant_fetch, loom::test::kTrainerPlan,
                             {.num_workers = 2});
  for (int64_t epoch = 0; epoch < 2; ++epoch) {
    good.begin_epoch(epoch);
    plain.begin_epoch(epoch);
    constant.begin_epoch(epoch);
    check_same(drain(good), drain(plain));
    CHECK(drain(constant).size() == static_cast<std::size_t>(plain.sampler().size()));
  }
}

TEST_CASE("BatchLoader: num_workers < 0 and prefetch_factor < 1 are named") {
  loom::LocalCommunicator comm;
  auto make = [&](loom::LoaderOptions o) {
    return loom::BatchLoader(comm, loom::test::trainer_shapes(), loom::test::trainer_fetch(), loom::test::kTrainerPlan,
                             o);
  };
  CHECK_THROWS_WITH_AS(make({.num_workers = -1}), doctest::Contains("num_workers = -1 must be >= 0"),
                       loom::InvalidArgument);
  CHECK_THROWS_WITH_AS(make({.num_workers = 2, .prefetch_factor = 0}),
                       doctest::Contains("prefetch_factor = 0 must be >= 1 with num_workers = 2"),
                       loom::InvalidArgument);
  CHECK_NOTHROW(make({.num_workers = 0, .prefetch_factor = 0}));  // unused without workers
}

TEST_CASE("Short-path errors name what the user wrote: BatchLoader, its calls, Trainer") {
  loom::LocalCommunicator comm;
  auto text_of = [](auto&& f) -> std::string {
    try {
      f();
    } catch (const loom::InvalidArgument& e) {
      return e.what();
    }
    return "(no loom::InvalidArgument)";
  };
  CHECK(text_of([&] { loom::BatchLoader(comm, {}, loom::test::trainer_fetch()); }) ==
        "loom: BatchLoader: GlobalBatchSampler: no shapes (the dataset is empty)");
  loom::BatchLoader loader(comm, loom::test::trainer_shapes(), loom::test::trainer_fetch(), loom::test::kTrainerPlan);
  loader.resume({.seed = 3, .epoch = 1, .step = 2, .fingerprint = loader.sampler().cursor().fingerprint});
  CHECK(text_of([&] { loader.begin_epoch(0); }).starts_with("loom: BatchLoader::begin_epoch: GlobalBatchSampler::"));
  CHECK(text_of([&] { loader.resume({.seed = 4}); }) ==
        "loom: BatchLoader::resume: GlobalBatchSampler::resume: the cursor has seed 4, this sampler 3");
  loom::test::Mlp model(at::kDouble);
  torch::optim::SGD sgd(model.params, torch::optim::SGDOptions(0.05));
  CHECK(text_of([&] { loom::Trainer trainer(comm, model.list(), sgd, {.reducer = {.max_grad_norm = -1.0}}); }) ==
        "loom: Trainer: its loom::Reducer (TrainerOptions::reducer, the model's parameters) refused: Reducer: "
        "max_grad_norm = -1 (must be > 0)");
}

}  // namespace test_loader
