// loom/reduce/buckets.hpp (pure assignment rule) and the concepts of loom/reduce and
// loom/accumulate: which types model them and which do not.
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include <doctest/doctest.h>

#include <loom/accumulate/accumulator.hpp>
#include <loom/comm/local.hpp>
#include <loom/reduce/buckets.hpp>
#include <loom/reduce/detail/window_meta.hpp>
#include <loom/reduce/reducer.hpp>

#include "support/recording_communicator.hpp"

namespace test_buckets {

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
    return {.verdict = loom::StepVerdict::apply, .reduced = true, .global_samples = plans.back().window_samples};
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

TEST_CASE("MetaLimbs: bits per limb by dtype and world size, limbs per row") {
  using loom::detail::MetaLimbs;
  CHECK(MetaLimbs::bits(at::kFloat, 1) == 24);
  CHECK(MetaLimbs::bits(at::kFloat, 2) == 23);
  CHECK(MetaLimbs::bits(at::kFloat, 3) == 22);  // ceil(log2 3) = 2
  CHECK(MetaLimbs::bits(at::kDouble, 8) == 50);
  CHECK(MetaLimbs::bits(at::kHalf, 8) == 8);
  CHECK(MetaLimbs::bits(at::kBFloat16, 128) == 1);
  CHECK(MetaLimbs::bits(at::kBFloat16, 129) == 0);  // no room: the meta goes on its own
  CHECK(MetaLimbs::bits(at::kLong, 2) == 0);
  CHECK(MetaLimbs::count(24) == 3 + 1 + 1 + 1 + 2 + 1 + 1 + 2 + 1 + 1 + 2 + 1);
  CHECK(MetaLimbs::count(11) == 6 + 1 + 1 + 2 + 4 + 1 + 2 + 4 + 1 + 2 + 4 + 1);
  CHECK(MetaLimbs::count(1) == 63 + 1 + 1 + 21 + 41 + 1 + 20 + 40 + 1 + 20 + 40 + 1);
}

namespace {

/// The limbs of `rows` (one per rank) summed in dtype T, rank by rank in a shuffled order with a
/// rounding to T after every addition (what an all-reduce may do), then decoded both ways (host
/// and tensor ops); checks both against the int64 sum of the rows.
template <class T>
void check_limbs_sum(const std::vector<loom::detail::WindowMeta::Row>& rows, at::ScalarType dtype, std::mt19937& rng) {
  using loom::detail::MetaLimbs;
  using Row = loom::detail::WindowMeta::Row;
  const int world = static_cast<int>(rows.size());
  const int bits = MetaLimbs::bits(dtype, world);
  REQUIRE(bits >= 1);
  const auto n = static_cast<std::size_t>(MetaLimbs::count(bits));
  std::vector<std::vector<T>> limbs(rows.size(), std::vector<T>(n));
  for (std::size_t r = 0; r < rows.size(); ++r) MetaLimbs::encode(rows[r], bits, limbs[r].data());
  std::vector<std::size_t> order(rows.size());
  for (std::size_t r = 0; r < order.size(); ++r) order[r] = r;
  std::vector<T> sum(n, static_cast<T>(0.0));
  for (std::size_t k = 0; k < n; ++k) {
    std::shuffle(order.begin(), order.end(), rng);
    for (std::size_t r : order) sum[k] = static_cast<T>(static_cast<double>(sum[k]) + static_cast<double>(limbs[r][k]));
  }
  Row expected{};  // the int64 all-reduce's sum: modulo 2^64
  for (const Row& row : rows)
    for (std::size_t f = 0; f < row.size(); ++f)
      expected[f] =
          static_cast<std::int64_t>(static_cast<std::uint64_t>(expected[f]) + static_cast<std::uint64_t>(row[f]));
  CHECK(MetaLimbs::decode(sum.data(), bits, world) == expected);
  auto summed = at::empty({static_cast<std::int64_t>(n)}, at::TensorOptions().dtype(dtype));
  for (std::size_t k = 0; k < n; ++k) summed[static_cast<std::int64_t>(k)] = static_cast<double>(sum[k]);
  auto meta = at::empty({loom::detail::WindowMeta::kLength}, at::kLong);
  MetaLimbs::decode(summed, MetaLimbs::tables(bits, at::kCPU), meta);
  for (std::size_t f = 0; f < expected.size(); ++f)
    CHECK(meta[static_cast<std::int64_t>(f)].item<std::int64_t>() == expected[f]);
}

}  // namespace

TEST_CASE("MetaLimbs: the window meta summed as limbs in float32/float64/float16/bfloat16 is the int64 sum") {
  using loom::detail::WindowMeta;
  std::mt19937 rng(11);
  for (int world : {1, 2, 3, 7, 8, 100}) {
    // Random rows within every field's range (samples small enough that their sum fits an int64),
    // the largest rows (every field at its width's maximum, so every limb at 2^b - 1 but a top one;
    // samples 2^63 - 1: their sum over 2 or more ranks wraps modulo 2^64, as an int64 sum does).
    std::vector<WindowMeta::Row> random_rows, largest_rows;
    for (int r = 0; r < world; ++r) {
      auto draw = [&](std::int64_t hi) { return std::uniform_int_distribution<std::int64_t>(0, hi)(rng); };
      const std::int64_t d = draw(std::int64_t{1} << 20), f = draw((std::int64_t{1} << 20) - 1),
                         g = draw((std::int64_t{1} << 20) - 1);
      random_rows.push_back(
          {draw((std::int64_t{1} << 56) - 1), draw(1), draw(1), d, d * d, d > 0 ? 1 : 0, f, f * f, 1, g, g * g, 1});
      const std::int64_t top = (std::int64_t{1} << 20) - 1;
      largest_rows.push_back({std::numeric_limits<std::int64_t>::max(), 1, 1, std::int64_t{1} << 20,
                              std::int64_t{1} << 40, 1, top, top * top, 1, top, top * top, 1});
    }
    INFO("world size ", world);
    for (const auto* rows : {&random_rows, &largest_rows}) {
      check_limbs_sum<float>(*rows, at::kFloat, rng);
      check_limbs_sum<double>(*rows, at::kDouble, rng);
      check_limbs_sum<c10::Half>(*rows, at::kHalf, rng);
      check_limbs_sum<c10::BFloat16>(*rows, at::kBFloat16, rng);
    }
  }
  // A field outside its width is a loom bug, never a silently wrong sum.
  WindowMeta::Row bad{};
  bad[WindowMeta::fingerprint_sum] = std::int64_t{1} << 20;
  std::vector<float> out(static_cast<std::size_t>(loom::detail::MetaLimbs::count(23)));
  CHECK_THROWS_AS(loom::detail::MetaLimbs::encode(bad, 23, out.data()), loom::Error);
  // Sums that no ranks' rows give (the ranks all-reduced different collectives): a loom::CommError
  // naming the value, never a row.
  const int bits = loom::detail::MetaLimbs::bits(at::kFloat, 2);
  std::vector<float> limbs(static_cast<std::size_t>(loom::detail::MetaLimbs::count(bits)), 1.0f);
  CHECK(loom::detail::MetaLimbs::decode(limbs.data(), bits, 2)[WindowMeta::final_ranks] == 1);
  for (float wrong : {-1.0f, 0.5f, std::ldexp(2.0f, 23), std::numeric_limits<float>::quiet_NaN()}) {
    limbs[3] = wrong;
    CHECK_THROWS_AS(loom::detail::MetaLimbs::decode(limbs.data(), bits, 2), loom::CommError);
  }
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
  // The weakest model runs too: an Accumulator drives it with one plan per micro-batch and reads
  // its verdict.
  PlanRecorder recorder;
  loom::Accumulator acc(recorder, {.micro_batches_per_step = 2});
  CHECK_FALSE(acc.run(3, [] {}).boundary);
  const loom::SyncResult step = acc.run(2, [] {});
  REQUIRE(recorder.plans.size() == 2);
  CHECK_FALSE(recorder.plans[0].sync);
  CHECK(recorder.plans[1].sync);
  CHECK(recorder.plans[1].window_samples == 5);
  CHECK(recorder.finishes == 1);
  CHECK(step.apply);
  CHECK(step.global_samples == 5);
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

}  // namespace test_buckets
