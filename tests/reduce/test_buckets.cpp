// loom/reduce/buckets.hpp (pure assignment rule) and the concepts of loom/reduce and
// loom/accumulate: which types model them and which do not.
#include <cstdint>
#include <vector>

#include <doctest/doctest.h>

#include <loom/accumulate/accumulator.hpp>
#include <loom/comm/local.hpp>
#include <loom/reduce/buckets.hpp>
#include <loom/reduce/reducer.hpp>

#include "support/recording_communicator.hpp"

namespace {

std::vector<loom::GradSpec> float32_specs(std::initializer_list<std::int64_t> numels) {
  std::vector<loom::GradSpec> s;
  for (auto n : numels) s.push_back({.numel = n, .element_size = 4, .kind = 0});
  return s;
}

// Archetype: the weakest GradientReducer (records the plans it gets).
struct PlanRecorder {
  std::vector<loom::BackwardPlan> plans;
  int finishes = 0;
  void prepare_backward(const loom::BackwardPlan& p) { plans.push_back(p); }
  loom::Reduction finish_window() {
    ++finishes;
    return {.reduced = true, .global_samples = plans.back().window_samples};
  }
};
struct OnlyPrepares {
  void prepare_backward(const loom::BackwardPlan&) {}
};
struct WrongResult {
  void prepare_backward(const loom::BackwardPlan&) {}
  bool finish_window() { return true; }
};
struct NotAComm {
  int rank() const { return 0; }
};
template <class C>
concept CanMakeReducer = requires {
  typename loom::Reducer<C>;
};

}  // namespace

TEST_CASE("assign_buckets: reverse order, first bucket smaller, closes at the cap, never splits") {
  // 6 float32 gradients of 100 elements (400 bytes); first cap 400 bytes, then 1000 bytes.
  auto specs = float32_specs({100, 100, 100, 100, 100, 100});
  auto b =
      loom::assign_buckets(specs, loom::reverse_order(6), {.first_bucket_cap_bytes = 400, .bucket_cap_bytes = 1000});
  // 5 alone reaches 400; then 4,3,2 reach 1200 >= 1000; then 1,0 (800) flushed at the end.
  REQUIRE(b.size() == 3);
  CHECK(b[0] == std::vector<std::size_t>{5});
  CHECK(b[1] == std::vector<std::size_t>{4, 3, 2});
  CHECK(b[2] == std::vector<std::size_t>{1, 0});

  // One gradient larger than the cap gets a bucket of its own.
  auto big = float32_specs({10, 1000, 10});
  auto bb = loom::assign_buckets(big, loom::reverse_order(3), {.first_bucket_cap_bytes = 100, .bucket_cap_bytes = 100});
  REQUIRE(bb.size() == 2);
  CHECK(bb[0] == std::vector<std::size_t>{2, 1});  // 40 bytes, then 4040 >= 100
  CHECK(bb[1] == std::vector<std::size_t>{0});
}

TEST_CASE("assign_buckets: kinds never share a bucket; launch order follows the first member") {
  std::vector<loom::GradSpec> s = {{.numel = 10, .element_size = 4, .kind = 0},
                                   {.numel = 10, .element_size = 8, .kind = 1},
                                   {.numel = 10, .element_size = 4, .kind = 0},
                                   {.numel = 10, .element_size = 8, .kind = 1}};
  auto b = loom::assign_buckets(s, loom::reverse_order(4));  // default caps: everything fits
  REQUIRE(b.size() == 2);
  CHECK(b[0] == std::vector<std::size_t>{3, 1});  // kind 1 opened first (index 3 comes first)
  CHECK(b[1] == std::vector<std::size_t>{2, 0});
  // Defaults are DDP's: 25 MiB and 1 MiB.
  CHECK(loom::BucketCaps{}.bucket_cap_bytes == 25u * 1024 * 1024);
  CHECK(loom::BucketCaps{}.first_bucket_cap_bytes == 1u * 1024 * 1024);
}

TEST_CASE("assign_buckets: bad input names the value") {
  auto s = float32_specs({1, 2, 3});
  std::vector<std::size_t> repeat = {0, 0, 2};
  CHECK_THROWS_WITH_AS(loom::assign_buckets(s, repeat), doctest::Contains("index 0 repeats"), loom::InvalidArgument);
  std::vector<std::size_t> out_of_range = {0, 1, 7};
  CHECK_THROWS_WITH_AS(loom::assign_buckets(s, out_of_range), doctest::Contains("index 7 is out of range"),
                       loom::InvalidArgument);
  CHECK_THROWS_WITH_AS(loom::assign_buckets(s, loom::reverse_order(3), {.first_bucket_cap_bytes = 0}),
                       doctest::Contains("first_bucket_cap_bytes = 0"), loom::InvalidArgument);
  std::vector<std::size_t> short_order = {0, 1};
  CHECK_THROWS_AS(loom::assign_buckets(s, short_order), loom::InvalidArgument);
}

TEST_CASE("concepts: GradientReducer models and non-models") {
  static_assert(loom::GradientReducer<loom::Reducer<loom::LocalCommunicator>>);
  static_assert(loom::GradientReducer<loom::Reducer<loom::test::RecordingCommunicator>>);
  static_assert(loom::GradientReducer<PlanRecorder>);
  static_assert(!loom::GradientReducer<OnlyPrepares>, "finish_window is required");
  static_assert(!loom::GradientReducer<WrongResult>, "finish_window must return loom::Reduction");
  static_assert(CanMakeReducer<loom::LocalCommunicator>);
  static_assert(!CanMakeReducer<NotAComm>, "a Reducer needs a Communicator");
  static_assert(!CanMakeReducer<int>);
  static_assert(std::is_move_constructible_v<loom::Reducer<loom::LocalCommunicator>>);
  static_assert(!std::is_copy_constructible_v<loom::Reducer<loom::LocalCommunicator>>);
  CHECK(true);
}

TEST_CASE("Accumulator drives any GradientReducer: sync only on the K-th micro-batch, remainder at end_epoch") {
  PlanRecorder r;
  loom::Accumulator acc(r, {.micro_batches_per_step = 4});
  int steps = 0;
  std::vector<std::int64_t> windows;
  for (int i = 0; i < 10; ++i) {
    auto s = acc.run(3, [] {});
    if (s.boundary) {
      ++steps;
      windows.push_back(s.micro_batches);
    }
  }
  while (auto s = acc.end_epoch()) {
    ++steps;
    windows.push_back(s->micro_batches);
    break;  // PlanRecorder never reports all ranks final; one flush is the remainder
  }
  CHECK(steps == 3);
  CHECK(windows == std::vector<std::int64_t>{4, 4, 2});
  REQUIRE(r.plans.size() == 11);
  for (int i = 0; i < 10; ++i) CHECK(r.plans[i].sync == (i == 3 || i == 7));
  CHECK(r.plans[3].window_samples == 12);
  CHECK(r.plans[10].sync);
  CHECK(r.plans[10].final);
  CHECK(r.plans[10].window_samples == 6);
}
