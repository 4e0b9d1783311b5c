// loom::Accumulator and loom::LossScaler in one process: field cases with their numbers worked by
// hand (sample weighting, the remainder, loss scaling with clipping), boundaries every S samples,
// ranks without samples, misuse, a failed collective in end_epoch, and the loss scaler's dtype
// promotion. Multi-rank field cases: test_field_dist.cpp.
#include <cstdint>
#include <stdexcept>
#include <vector>

#include <doctest/doctest.h>
#include <torch/torch.h>

#include <loom/accumulate/accumulator.hpp>
#include <loom/accumulate/loss_scaler.hpp>
#include <loom/comm/local.hpp>
#include <loom/compat.hpp>
#include <loom/reduce/reducer.hpp>

#include "support/recording_communicator.hpp"

namespace {

at::Tensor scalar_param(double v, at::ScalarType dtype = at::kDouble) {
  return torch::tensor({v}, torch::kDouble).to(dtype).requires_grad_();
}

double value(const at::Tensor& t) {
  return t.item<double>();
}

// One scalar parameter w = 1; the loss of a sample x is w * x, so d loss / dw = x.
struct Scalar {
  at::Tensor w = torch::ones({1}, torch::kDouble).requires_grad_();
  loom::LocalCommunicator comm;
  loom::Reducer<loom::LocalCommunicator> reducer;
  explicit Scalar(loom::ReducerOptions o = {}) : reducer(comm, {.names = {"w"}, .params = {w}}, o) {}
  double grad() const { return w.grad().item<double>(); }
};

// Accumulates the micro-batches (lists of x) as one step and returns the gradient.
double accumulate(const std::vector<std::vector<double>>& micro_batches) {
  Scalar s;
  loom::Accumulator acc(s.reducer, {.micro_batches_per_step = static_cast<std::int64_t>(micro_batches.size())});
  loom::SyncResult step;
  for (const auto& xs : micro_batches) {
    step = acc.run(static_cast<std::int64_t>(xs.size()), [&] {
      (s.w * torch::tensor(xs, torch::kDouble)).sum().backward();  // loss summed over the micro-batch
    });
  }
  REQUIRE(step.apply);
  REQUIRE(step.global_samples == 10);
  return s.grad();
}

}  // namespace

TEST_CASE("field: sample-weighted accumulation gives 18/10 = 1.8, not the mean of micro-batch means 2.0") {
  CHECK(accumulate({{1, 3}, {2, 2, 5}, {1, 1, 1, 1, 1}}) == doctest::Approx(1.8).epsilon(1e-15));
  // Any regrouping of the same 10 samples.
  CHECK(accumulate({{1, 3, 2}, {2, 5, 1}, {1, 1, 1, 1}}) == doctest::Approx(1.8).epsilon(1e-15));
  CHECK(accumulate({{1, 3, 2, 2, 5, 1, 1, 1, 1, 1}}) == doctest::Approx(1.8).epsilon(1e-15));
  CHECK(accumulate({{1}, {3}, {2}, {2}, {5}, {1}, {1}, {1}, {1}, {1}}) == doctest::Approx(1.8).epsilon(1e-15));

  // Three padding positions in the first micro-batch, masked out of the loss and not counted.
  {
    Scalar s;
    loom::Accumulator acc(s.reducer, {.micro_batches_per_step = 3});
    auto x = torch::tensor({1.0, 3.0, 100.0, -50.0, 7.0}, torch::kDouble);
    auto mask = torch::tensor({1.0, 1.0, 0.0, 0.0, 0.0}, torch::kDouble);
    acc.run(2, [&] { (s.w * x * mask).sum().backward(); });
    acc.run(3, [&] { (s.w * torch::tensor({2.0, 2.0, 5.0}, torch::kDouble)).sum().backward(); });
    auto step = acc.run(5, [&] { (s.w * torch::ones({5}, torch::kDouble)).sum().backward(); });
    REQUIRE(step.apply);
    CHECK(s.grad() == doctest::Approx(1.8).epsilon(1e-15));
  }
  // A batch a distributed sampler repeated (weight 0) counts no sample and its loss is multiplied by 0.
  {
    Scalar s;
    loom::Accumulator acc(s.reducer, {.micro_batches_per_step = 4});
    loom::Batch repeated;
    repeated.data = torch::tensor({9.0, 9.0}, torch::kDouble);
    repeated.num_samples = 2;
    repeated.weight = 0.0;
    acc.run(2, [&] { (s.w * torch::tensor({1.0, 3.0}, torch::kDouble)).sum().backward(); });
    auto mb = acc.micro_batch(repeated);
    (s.w * repeated.data).sum().mul(repeated.weight).backward();
    mb.finish();
    acc.run(3, [&] { (s.w * torch::tensor({2.0, 2.0, 5.0}, torch::kDouble)).sum().backward(); });
    auto step = acc.run(5, [&] { (s.w * torch::ones({5}, torch::kDouble)).sum().backward(); });
    REQUIRE(step.apply);
    CHECK(step.global_samples == 10);
    CHECK(s.grad() == doctest::Approx(1.8).epsilon(1e-15));
  }
  // The known bug, shown: averaging per-micro-batch means (mean loss / K, summed) gives 2.0.
  {
    Scalar s({.average = loom::Average::none});
    loom::Accumulator acc(s.reducer, {.micro_batches_per_step = 3});
    for (const auto& xs : std::vector<std::vector<double>>{{1, 3}, {2, 2, 5}, {1, 1, 1, 1, 1}})
      acc.run(static_cast<std::int64_t>(xs.size()),
              [&] { (s.w * torch::tensor(xs, torch::kDouble)).mean().div(3.0).backward(); });
    CHECK(s.grad() == doctest::Approx(2.0).epsilon(1e-15));
    CHECK(s.grad() != doctest::Approx(1.8));
  }
}

TEST_CASE("field: remainder — 10 micro-batches with K = 4 make 3 steps (windows 4, 4, 2), gradient 1.0 each") {
  auto run_epochs = [](int micro_batches, int epochs) {
    Scalar s;
    loom::Accumulator acc(s.reducer, {.micro_batches_per_step = 4});
    torch::optim::SGD sgd({s.w}, torch::optim::SGDOptions(0.0));  // lr 0: keeps w = 1
    std::vector<std::int64_t> windows;
    std::vector<double> grads;
    auto record = [&](const loom::SyncResult& step) {
      windows.push_back(step.micro_batches);
      grads.push_back(s.grad());
      sgd.step();
      loom::zero_grad(sgd, loom::GradReset::zero);
    };
    for (int e = 0; e < epochs; ++e) {
      for (int i = 0; i < micro_batches; ++i) {
        // Each micro-batch: 2 samples with x = 1 (mean-loss gradient 1.0).
        auto step = acc.run(2, [&] { (s.w * torch::ones({2}, torch::kDouble)).sum().backward(); });
        if (step.boundary) record(step);
      }
      while (auto step = acc.end_epoch()) record(*step);
    }
    return std::pair{windows, grads};
  };
  auto [w10, g10] = run_epochs(10, 2);
  CHECK(w10 == std::vector<std::int64_t>{4, 4, 2, 4, 4, 2});  // no window carries into the next epoch
  for (double g : g10) CHECK(g == 1.0);                       // not 0.5 at the last step
  auto [w8, g8] = run_epochs(8, 1);
  CHECK(w8 == std::vector<std::int64_t>{4, 4});
  auto [w3, g3] = run_epochs(3, 1);
  CHECK(w3 == std::vector<std::int64_t>{3});
  CHECK(g3 == std::vector<double>{1.0});
}

TEST_CASE(
    "field: loss scale 1024, K = 2, [1.5, 0] + [1.5, 4], max norm 1: unscale once, clip -> [0.6, 0.8]; inf skips and "
    "halves once") {
  auto w = torch::zeros({2}).requires_grad_();
  loom::LocalCommunicator comm;
  loom::Reducer reducer(comm, {.names = {"w"}, .params = {w}},
                        {.average = loom::Average::world_size, .max_grad_norm = 1.0});
  loom::Accumulator acc(reducer,
                        {.micro_batches_per_step = 2, .loss_scaling = loom::LossScalerOptions{.init_scale = 1024}});
  auto g1 = torch::tensor({1.5f, 0.0f});
  auto g2 = torch::tensor({1.5f, 4.0f});
  auto window = [&](const at::Tensor& second) {
    acc.run(1, [&](auto& mb) { mb.scale((w * g1).sum()).backward(); });
    return acc.run(1, [&](auto& mb) { mb.scale((w * second).sum()).backward(); });
  };
  CHECK(acc.loss_scale() == 1024.0);
  auto step = window(g2);
  REQUIRE(step.apply);
  CHECK(step.loss_scale == 1024.0);
  CHECK(step.grad_norm == doctest::Approx(5.0).epsilon(1e-6));
  CHECK(w.grad()[0].item<double>() == doctest::Approx(0.6).epsilon(1e-6));
  CHECK(w.grad()[1].item<double>() == doctest::Approx(0.8).epsilon(1e-6));
  CHECK(std::abs(w.grad()[0].item<double>() - 0.6) < 1e-6);
  CHECK(std::abs(w.grad()[1].item<double>() - 0.8) < 1e-6);
  // The bug, shown: clipping the scaled gradient [3072, 4096] to norm 1 and unscaling afterwards.
  auto wrong = torch::tensor({3072.0, 4096.0});
  wrong = wrong * (1.0 / (wrong.norm().item<double>() + 1e-6)) / 1024.0;
  CHECK(wrong[0].item<double>() == doctest::Approx(0.6 / 1024).epsilon(1e-5));
  w.mutable_grad().zero_();

  // inf in the second micro-batch: skipped, window cleared, scale halves once.
  torch::optim::SGD sgd({w}, torch::optim::SGDOptions(0.1));
  const auto before = w.detach().clone();
  auto bad = window(torch::tensor({1.5f, std::numeric_limits<float>::infinity()}));
  CHECK(bad.boundary);
  CHECK_FALSE(bad.apply);
  CHECK(bad.skipped_non_finite);
  if (bad) sgd.step();
  CHECK(torch::equal(w.detach(), before));
  CHECK(torch::equal(w.grad(), torch::zeros({2})));
  CHECK(acc.loss_scale() == 512.0);
  CHECK(acc.window_micro_batches() == 0);
  // The next window is clean again, at the halved scale.
  auto again = window(g2);
  REQUIRE(again.apply);
  CHECK(again.loss_scale == 512.0);
  CHECK(std::abs(w.grad()[0].item<double>() - 0.6) < 1e-6);
  CHECK(std::abs(w.grad()[1].item<double>() - 0.8) < 1e-6);
}

TEST_CASE("Accumulator: boundaries every S samples; the remainder keeps its true count") {
  Scalar s;
  loom::Accumulator acc(s.reducer, {.micro_batches_per_step = 0, .local_samples_per_step = 6});
  std::vector<std::int64_t> boundaries;
  int i = 0;
  for (std::vector<double> xs :
       std::vector<std::vector<double>>{{1, 1}, {2, 2, 2}, {3, 3, 3, 3, 3}, {4}, {5, 5, 5, 5}}) {
    auto step = acc.run(static_cast<std::int64_t>(xs.size()),
                        [&] { (s.w * torch::tensor(xs, torch::kDouble)).sum().backward(); });
    if (step.boundary) {
      boundaries.push_back(i);
      CHECK(step.global_samples == 10);
      CHECK(s.grad() == doctest::Approx((2.0 + 6.0 + 15.0) / 10.0).epsilon(1e-15));
      s.w.mutable_grad().zero_();
    }
    ++i;
  }
  CHECK(boundaries == std::vector<std::int64_t>{2});
  auto rest = acc.end_epoch();
  REQUIRE(rest.has_value());
  CHECK(rest->global_samples == 5);
  CHECK(s.grad() == doctest::Approx((4.0 + 20.0) / 5.0).epsilon(1e-15));
  CHECK_FALSE(acc.end_epoch().has_value());
}

TEST_CASE("Accumulator: a rank with no sample gets no NaN; misuse is a loom error") {
  Scalar s;
  loom::Accumulator acc(s.reducer, {.micro_batches_per_step = 2});
  auto empty = acc.run(0, [&] { (s.w * torch::zeros({0}, torch::kDouble)).sum().backward(); });
  CHECK_FALSE(empty.boundary);
  // No sample anywhere at the end of the epoch: nothing to reduce, no step, no NaN.
  CHECK_FALSE(acc.end_epoch().has_value());
  CHECK_FALSE(torch::isnan(s.w.grad()).any().item<bool>());
  // A boundary whose window holds no sample: reduced, but nothing to apply (and no 0/0).
  acc.run(0, [&] { (s.w * torch::zeros({0}, torch::kDouble)).sum().backward(); });
  auto zero = acc.run(0, [&] { (s.w * torch::zeros({0}, torch::kDouble)).sum().backward(); });
  CHECK(zero.boundary);
  CHECK_FALSE(zero.apply);
  CHECK(zero.global_samples == 0);
  CHECK(s.w.grad().item<double>() == 0.0);

  CHECK_THROWS_WITH_AS(loom::Accumulator(s.reducer, {.micro_batches_per_step = -1}),
                       doctest::Contains("micro_batches_per_step = -1"), loom::InvalidArgument);
  CHECK_THROWS_WITH_AS((void)acc.micro_batch(-2), doctest::Contains("num_samples = -2"), loom::InvalidArgument);
  {
    loom::Batch half;
    half.num_samples = 4;
    half.weight = 0.5;  // would count 4 samples while a loss scaled by it adds half: refused, named
    CHECK_THROWS_WITH_AS((void)acc.micro_batch(half), doctest::Contains("Batch::weight is 0.5"), loom::InvalidArgument);
  }
  {
    auto open = acc.micro_batch(1);
    CHECK_THROWS_WITH_AS((void)acc.micro_batch(1), doctest::Contains("previous micro-batch was not finished"),
                         loom::Error);
    open.finish();
    CHECK_THROWS_WITH_AS(open.finish(), doctest::Contains("finish called twice"), loom::Error);
  }
  // An exception between micro_batch() and finish() leaves the accumulator unusable, loudly.
  CHECK_THROWS_AS(acc.run(1, [] { throw std::runtime_error("forward failed"); }), std::runtime_error);
  CHECK_THROWS_WITH_AS((void)acc.micro_batch(1), doctest::Contains("abandoned"), loom::Error);
}

TEST_CASE("LossScaler: a float16 loss is scaled in float32 (GradScaler's promotion), so loss x 65536 stays finite") {
  loom::LossScaler scaler;  // 65536
  auto loss = torch::tensor({2.0}, torch::kDouble).to(torch::kHalf).squeeze();
  auto scaled = scaler.scale(loss);
  CHECK((scaled.scalar_type() == torch::kFloat));
  CHECK(value(scaled) == 131072.0);
  auto bf = scaler.scale(torch::tensor({3.0}, torch::kBFloat16));
  CHECK((bf.scalar_type() == torch::kFloat));
  CHECK(value(bf) == 196608.0);
  // float32 and float64 losses keep their dtype.
  CHECK((scaler.scale(torch::tensor({1.0}, torch::kDouble)).scalar_type() == torch::kDouble));
  CHECK((scaler.scale(torch::tensor({1.0}, torch::kFloat)).scalar_type() == torch::kFloat));
}

namespace {

/// World size 1, but every all-reduce after the first `healthy` ones fails in wait() like a dead peer.
class FailingCommunicator : public loom::test::RecordingCommunicator {
 public:
  struct Work {
    bool fail = false;
    void wait() const {
      if (fail) throw loom::TimeoutError("all_reduce", 0, 1.5, "a peer closed its connection");
    }
    [[nodiscard]] bool is_completed() const { return true; }
  };
  explicit FailingCommunicator(int healthy) : healthy_(healthy) {}
  Work all_reduce_async(at::Tensor& t, loom::ReduceOp) {
    loom::detail::check_collective_tensor(t, "all_reduce");
    return Work{.fail = healthy_-- <= 0};
  }

 private:
  int healthy_;
};

}  // namespace

TEST_CASE("Accumulator::end_epoch: a failed collective marks the accumulator broken, so a retry names the cause") {
  auto w = scalar_param(1.0);
  FailingCommunicator comm(/*healthy=*/0);
  loom::Reducer reducer(comm, {.names = {"w"}, .params = {w}});
  loom::Accumulator acc(reducer, {.micro_batches_per_step = 4});
  REQUIRE_FALSE(acc.run(1, [&] { (w * 2.0).sum().backward(); }).boundary);
  CHECK_THROWS_AS((void)acc.end_epoch(), loom::TimeoutError);
  CHECK_THROWS_WITH_AS((void)acc.end_epoch(), doctest::Contains("failed"), loom::Error);
  CHECK_THROWS_WITH_AS((void)acc.micro_batch(1), doctest::Contains("all_reduce timed out"), loom::Error);
}
