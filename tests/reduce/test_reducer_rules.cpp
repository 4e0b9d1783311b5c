// loom::Reducer driven by loom::Accumulator in one process: the rules a user cannot see go wrong —
// a gradient that arrives twice, a parameter set that changed after construction, float16
// gradients and losses near the dtype's limits, the float16 wire across magnitudes, host reads.
// Multi-rank twins: test_rules_dist.cpp. The LossScaler's dtype promotion and a failed collective
// in end_epoch: tests/accumulate/test_accumulator.cpp.
#include <cmath>
#include <limits>
#include <stdexcept>

#include <doctest/doctest.h>
#include <fmt/format.h>
#include <torch/torch.h>

#include <loom/accumulate/accumulator.hpp>
#include <loom/comm/local.hpp>
#include <loom/reduce/module.hpp>
#include <loom/reduce/reducer.hpp>

#include "reference/grad_reference.hpp"
#include "support/models.hpp"
#include "support/recording_communicator.hpp"

namespace test_reducer_rules {

namespace {

at::Tensor scalar_param(double v, at::ScalarType dtype = at::kDouble) {
  return torch::tensor({v}, torch::kDouble).to(dtype).requires_grad_();
}

double value(const at::Tensor& t) {
  return t.item<double>();
}

}  // namespace

TEST_CASE("Reducer: a gradient arriving twice before its bucket left is averaged as one sum: (x + y) / N") {
  // a and b share one bucket; the first backward produces only a's gradient (x = 1), so the bucket
  // waits for b; the second produces a again (y = 2) and b (4). N = 4 samples in the window.
  SUBCASE("two backward passes in the synchronising micro-batch") {
    for (bool overlap : {true, false}) {
      auto a = scalar_param(1.0), b = scalar_param(1.0);
      loom::LocalCommunicator comm;
      loom::Reducer reducer(comm, {.names = {"a", "b"}, .params = {a, b}}, {.overlap = overlap});
      REQUIRE(reducer.bucket_params().size() == 1);
      reducer.prepare_backward({.sync = true, .window_samples = 4});
      (a * 1.0).sum().backward();
      (a * 2.0 + b * 4.0).sum().backward();
      auto r = reducer.finish_window();
      REQUIRE(r.reduced);
      CHECK(value(a.grad()) == 0.75);  // (1 + 2) / 4, not 1 / 4 + 2 = 2.25
      CHECK(value(b.grad()) == 1.0);
    }
  }
  SUBCASE("a gradient written by hand, marked ready, then added to and marked again") {
    auto a = scalar_param(1.0), b = scalar_param(1.0);
    loom::LocalCommunicator comm;
    loom::Reducer reducer(comm, {.names = {"a", "b"}, .params = {a, b}});
    reducer.prepare_backward({.sync = true, .window_samples = 4});
    a.mutable_grad().fill_(1.0);
    reducer.mark_ready(0);
    a.mutable_grad().add_(2.0);
    reducer.mark_ready(0);
    b.mutable_grad().fill_(4.0);
    reducer.mark_ready(1);
    reducer.finish_window();
    CHECK(value(a.grad()) == 0.75);
    CHECK(value(b.grad()) == 1.0);
  }
  SUBCASE("with a loss scale: (x + y) * (1 / scale) / N") {
    auto a = scalar_param(1.0), b = scalar_param(1.0);
    loom::LocalCommunicator comm;
    loom::Reducer reducer(comm, {.names = {"a", "b"}, .params = {a, b}});
    reducer.prepare_backward({.sync = true, .window_samples = 4, .grad_scale = 0.5});
    (a * 1.0).sum().backward();
    (a * 2.0 + b * 4.0).sum().backward();
    reducer.finish_window();
    CHECK(value(a.grad()) == 0.375);
    CHECK(value(b.grad()) == 0.5);
  }
}

TEST_CASE("Reducer: a second gradient after the bucket left names the parameter") {
  auto a = scalar_param(1.0);
  loom::LocalCommunicator comm;
  loom::Reducer reducer(comm, {.names = {"a"}, .params = {a}});
  reducer.prepare_backward({.sync = true, .window_samples = 1});
  auto y = (a * 3.0).sum();
  y.backward({}, /*retain_graph=*/true);  // the only member of the bucket: it leaves at once
  CHECK_THROWS_WITH_AS(y.backward(), doctest::Contains("parameter 0 ('a') received a second gradient"),
                       loom::InvalidArgument);
}

TEST_CASE("Reducer: the parameter set changing after construction is a loom error at the next window") {
  SUBCASE("a frozen parameter made trainable") {
    auto w = scalar_param(1.0);
    auto frozen = torch::tensor({3.0}, torch::kDouble);
    loom::LocalCommunicator comm;
    loom::Reducer reducer(comm, {.names = {"w", "head"}, .params = {w, frozen}});
    loom::Accumulator acc(reducer);
    REQUIRE(acc.run(1, [&] { (w * 2.0).sum().backward(); }).apply);
    frozen.requires_grad_(true);
    CHECK_THROWS_WITH_AS((void)acc.micro_batch(1), doctest::Contains("parameter 1 ('head')"), loom::InvalidArgument);
  }
  SUBCASE("a trainable parameter frozen") {
    auto w = scalar_param(1.0), v = scalar_param(1.0);
    loom::LocalCommunicator comm;
    loom::Reducer reducer(comm, {.names = {"w", "v"}, .params = {w, v}});
    reducer.prepare_backward({.sync = true, .window_samples = 1});
    (w * v).sum().backward();
    reducer.finish_window();
    v.requires_grad_(false);
    CHECK_THROWS_WITH_AS(reducer.prepare_backward({.sync = false}), doctest::Contains("parameter 1 ('v')"),
                         loom::InvalidArgument);
  }
  SUBCASE("module->to(torch::kDouble) replaces the gradient accumulators the hooks hang on") {
    torch::manual_seed(3);
    auto net = torch::nn::Linear(3, 2);
    loom::LocalCommunicator comm;
    loom::Reducer reducer(comm, loom::parameters_of(*net));
    loom::Accumulator acc(reducer);
    REQUIRE(acc.run(2, [&] { net->forward(torch::ones({2, 3})).sum().backward(); }).apply);
    net->to(torch::kDouble);
    CHECK_THROWS_WITH_AS((void)acc.micro_batch(2), doctest::Contains("('weight')"), loom::InvalidArgument);
  }
  SUBCASE("module->to(torch::kDouble) before the first window") {
    auto net = torch::nn::Linear(3, 2);
    loom::LocalCommunicator comm;
    loom::Reducer reducer(comm, loom::parameters_of(*net));
    net->to(torch::kDouble);
    CHECK_THROWS_WITH_AS(reducer.prepare_backward({.sync = true, .window_samples = 1}), doctest::Contains("Double"),
                         loom::InvalidArgument);
  }
}

TEST_CASE(
    "Reducer: float16 and bfloat16 micro-batch gradients sum in float32 (float32_accumulation), or in their dtype") {
  // A gradient of 1, then 64 micro-batches of `small` each, summed over one window (Average::none).
  // In the parameter's dtype every addition rounds back to 1 (small is a quarter of the spacing at 1:
  // bfloat16 2^-7, float16 2^-10); in float32 the sum is 1 + 64 small, which the dtype represents.
  for (auto [dtype, small] :
       {std::pair{at::kBFloat16, std::ldexp(1.0, -9)}, std::pair{at::kHalf, std::ldexp(1.0, -12)}}) {
    for (const bool in_float32 : {true, false}) {
      CAPTURE(c10::toString(dtype));
      CAPTURE(in_float32);
      auto w = torch::zeros({3}, dtype).requires_grad_();
      loom::LocalCommunicator comm;
      loom::Reducer reducer(comm, {.names = {"w"}, .params = {w}},
                            {.average = loom::Average::none, .float32_accumulation = in_float32});
      CHECK((reducer.bucket_tensors()[0].scalar_type() == (in_float32 ? at::kFloat : dtype)));
      reducer.prepare_backward({.sync = false});
      w.sum().backward();
      for (int i = 0; i < 64; ++i) {
        reducer.prepare_backward({.sync = i == 63, .window_samples = 1});
        (w * small).sum().backward();
      }
      const loom::Reduction r = reducer.finish_window();
      CHECK_FALSE(r.non_finite);
      CHECK((w.grad().scalar_type() == dtype));
      CHECK(torch::equal(w.grad(), torch::full({3}, in_float32 ? 1.0 + 64 * small : 1.0, dtype)));
      // The next window starts from the gradient the parameter holds (not zeroed here: it adds up).
      reducer.prepare_backward({.sync = true, .window_samples = 1});
      (w * small).sum().backward();
      reducer.finish_window();
      CHECK(torch::equal(w.grad(), torch::full({3}, in_float32 ? 1.0 + 65 * small : 1.0, dtype)));
    }
  }
}

TEST_CASE("Reducer: mark_all_ready with float32 slots: a gradient assigned by hand adds; no gradient is unused") {
  auto a = torch::zeros({2}, torch::kBFloat16).requires_grad_();
  auto b = torch::zeros({2}, torch::kBFloat16).requires_grad_();
  loom::LocalCommunicator comm;
  loom::Reducer reducer(comm, {.names = {"a", "b"}, .params = {a, b}}, {.average = loom::Average::none});
  reducer.prepare_backward({.sync = false});
  a.mutable_grad() = torch::full({2}, 1.0, torch::kBFloat16);
  reducer.mark_all_ready();  // moves a's gradient into its slot; b has none: not an error
  CHECK_FALSE(a.grad().defined());
  reducer.prepare_backward({.sync = true, .window_samples = 1});
  a.mutable_grad() = torch::full({2}, 0.5, torch::kBFloat16);
  reducer.mark_all_ready();
  reducer.finish_window();
  CHECK(torch::equal(a.grad(), torch::full({2}, 1.5, torch::kBFloat16)));
  CHECK_FALSE(b.grad().defined());  // unused everywhere: it keeps the gradient it had (none)
}

TEST_CASE("Reducer: a float32-accumulated average outside float16's range is non-finite, not inf in the step") {
  // Two micro-batches of 40000 each: a finite float32 sum (80000) that float16 cannot hold.
  auto w = torch::zeros({2}, torch::kHalf).requires_grad_();
  loom::LocalCommunicator comm;
  loom::Reducer reducer(comm, {.names = {"w"}, .params = {w}}, {.average = loom::Average::none});
  reducer.prepare_backward({.sync = false});
  (w * 40000.0).sum().backward();
  reducer.prepare_backward({.sync = true, .window_samples = 2});
  (w * 40000.0).sum().backward();
  const loom::Reduction r = reducer.finish_window();
  CHECK(r.non_finite);
  CHECK(torch::equal(w.grad(), torch::zeros({2}, torch::kHalf)));
}

TEST_CASE("Reducer: loss_divisor is multiplied back; out of range is named") {
  // Gradients x = 1, 2, 3, 4 of 4 samples: mean 2.5, whatever the losses were divided by.
  for (const std::int64_t divisor : {1, 2, 4, 7}) {
    CAPTURE(divisor);
    auto w = torch::zeros({1}, torch::kDouble).requires_grad_();
    loom::LocalCommunicator comm;
    loom::Reducer reducer(comm, {.names = {"w"}, .params = {w}});
    reducer.prepare_backward({.sync = true, .window_samples = 4, .loss_divisor = divisor});
    (w * torch::tensor({1.0, 2.0, 3.0, 4.0}, torch::kDouble)).sum().div(static_cast<double>(divisor)).backward();
    reducer.finish_window();
    CHECK(w.grad().item<double>() == doctest::Approx(2.5).epsilon(1e-15));
  }
  auto w = torch::zeros({1}).requires_grad_();
  loom::LocalCommunicator comm;
  loom::Reducer reducer(comm, {.names = {"w"}, .params = {w}});
  for (const std::int64_t bad : {std::int64_t{-1}, std::int64_t{-3}, loom::kMaxLossDivisor + 1})
    CHECK_THROWS_WITH_AS(reducer.prepare_backward({.sync = true, .window_samples = 1, .loss_divisor = bad}),
                         doctest::Contains(fmt::format("loss_divisor = {}", bad).c_str()), loom::InvalidArgument);
}

TEST_CASE("Reducer: float16 gradients whose sum or norm exceeds 65504 are finite, and the norm is right") {
  // 4096 elements of 1100: every element is a finite float16, their sum (4.5e6) and L2 norm
  // (1100 * 64 = 70400) are not representable in float16.
  auto w = torch::zeros({4096}, torch::kHalf).requires_grad_();
  loom::LocalCommunicator comm;
  {
    loom::Reducer reducer(comm, {.names = {"w"}, .params = {w}}, {.average = loom::Average::none});
    reducer.prepare_backward({.sync = true, .window_samples = 1});
    w.mutable_grad() = torch::full({4096}, 1100.0, torch::kHalf);
    reducer.mark_all_ready();
    auto r = reducer.finish_window();
    CHECK_FALSE(r.non_finite);
    CHECK(torch::equal(w.grad(), torch::full({4096}, 1100.0, torch::kHalf)));
  }
  {
    w.mutable_grad().reset();
    loom::Reducer reducer(comm, {.names = {"w"}, .params = {w}},
                          {.average = loom::Average::none, .max_grad_norm = 1.0});
    reducer.prepare_backward({.sync = true, .window_samples = 1});
    w.mutable_grad() = torch::full({4096}, 1100.0, torch::kHalf);
    reducer.mark_all_ready();
    auto r = reducer.finish_window();
    CHECK_FALSE(r.non_finite);
    CHECK(r.grad_norm == doctest::Approx(70400.0).epsilon(1e-3));
    CHECK(r.clip_coef == doctest::Approx(1.0 / 70400.0).epsilon(1e-3));
    CHECK(value(w.grad()[0].to(torch::kDouble)) == doctest::Approx(1.0 / 64.0).epsilon(1e-3));
  }
}

TEST_CASE(
    "Reducer: float16 wire across magnitudes — within the stated bound, realistic gradients not flushed to zero") {
  // One process, N = 64 samples. The exact gradient of element i is m_i (the mean over the
  // window), so each element's summed gradient is 64 m_i. m spans 1e-10 .. 1e2: float16's normal
  // range, its subnormal range, and below it.
  constexpr std::int64_t kN = 64;
  const auto exponents = torch::linspace(-10, 2, 1201, torch::kDouble);
  const auto mean = torch::pow(10.0, exponents);
  auto w = torch::zeros({1201}).requires_grad_();
  loom::LocalCommunicator comm;
  loom::Reducer reducer(comm, {.names = {"w"}, .params = {w}}, {.wire_dtype = at::kHalf});
  reducer.prepare_backward({.sync = true, .window_samples = kN});
  w.mutable_grad().copy_((mean * kN).to(torch::kFloat));
  reducer.mark_all_ready();
  REQUIRE_FALSE(reducer.finish_window().non_finite);
  const auto exact = (mean * kN).to(torch::kFloat).to(torch::kDouble) / kN;  // the float32 reduction's answer
  const auto got = w.grad().to(torch::kDouble);
  const auto err = (got - exact).abs();
  // The documented bound (docs/reduce.md): per element, with W ranks and share
  // s = local sum / W on the wire, |error| <= (count / W)^-1 ... expressed here for W = 1:
  // |error| <= 2^-11 |exact| + 2^-25 * 64 / 64 (one rounding to float16 of the share 64 m, then / 64),
  // plus float32's own rounding.
  const auto bound = exact.abs() * (std::ldexp(1.0, -11) + std::ldexp(1.0, -22)) + std::ldexp(1.0, -25) / kN;
  const auto over = (err > bound);
  if (over.any().item<bool>()) {
    const auto i = over.nonzero()[0][0].item<std::int64_t>();
    FAIL_CHECK(fmt::format("m = {:.3g}: got {:.6g}, exact {:.6g}, error {:.3g} > bound {:.3g}", mean[i].item<double>(),
                           got[i].item<double>(), exact[i].item<double>(), err[i].item<double>(),
                           bound[i].item<double>()));
  }
  // A realistic small gradient (mean 1e-7 per sample, summed over 64 samples) survives within 1 %.
  const auto small = (mean - 1e-7).abs().argmin().item<std::int64_t>();
  CHECK(err[small].item<double>() / exact[small].item<double>() < 0.01);
  // Below float16's subnormal range even after the sum (64 m < 2^-25): flushed to zero, as stated.
  CHECK(got[0].item<double>() == 0.0);
}

TEST_CASE("Reducer: a float16 wire never narrows a bfloat16 parameter's gradient below bfloat16's range") {
  // A bfloat16 parameter accumulates in float32 and its bucket is compressed by wire_dtype; a
  // gradient of 1e5 is legal in bfloat16 but above float16's largest value (65504). Asked for a
  // float16 wire, the bucket goes on a bfloat16 wire: the step is not skipped and the gradient is
  // 1e5 rounded to bfloat16 (99840: 1e5 = 0b1.1000011010100000 x 2^16, 8 significant bits).
  auto w = torch::zeros({2}, torch::kBFloat16).requires_grad_();
  loom::LocalCommunicator comm;
  loom::Reducer reducer(comm, {.names = {"w"}, .params = {w}}, {.wire_dtype = at::kHalf});
  reducer.prepare_backward({.sync = true, .window_samples = 1});
  (w.to(torch::kFloat) * torch::tensor({1e5, 2.0})).sum().backward();
  const loom::Reduction r = reducer.finish_window();
  CHECK_FALSE(r.non_finite);
  REQUIRE(w.grad().defined());
  CHECK((w.grad().scalar_type() == torch::kBFloat16));
  CHECK(value(w.grad()[0].to(torch::kDouble)) == 99840.0);
  CHECK(value(w.grad()[1].to(torch::kDouble)) == 2.0);
  // A float32 parameter keeps the float16 wire it asked for: 1e5 overflows it (documented).
  auto v = torch::zeros({1}).requires_grad_();
  loom::Reducer narrow(comm, {.names = {"v"}, .params = {v}}, {.wire_dtype = at::kHalf});
  narrow.prepare_backward({.sync = true, .window_samples = 1});
  (v * 1e5).sum().backward();
  CHECK(narrow.finish_window().non_finite);
}

TEST_CASE(
    "Reducer: one verdict per window (apply, skip_non_finite, skip_no_samples, not_reduced) and the Accumulator reads "
    "it") {
  loom::LocalCommunicator comm;
  auto w = torch::zeros({2}, torch::kDouble).requires_grad_();
  loom::Reducer reducer(comm, {.names = {"w"}, .params = {w}});
  auto window = [&](int64_t samples, double g, bool final = false) {
    reducer.prepare_backward({.sync = true, .final = final, .window_samples = samples});
    if (!final) (w * g).sum().backward();
    const loom::Reduction r = reducer.finish_window();
    w.mutable_grad().reset();
    return r.verdict;
  };
  CHECK(window(2, 1.0) == loom::StepVerdict::apply);
  CHECK(window(2, std::numeric_limits<double>::quiet_NaN()) == loom::StepVerdict::skip_non_finite);
  CHECK(window(0, 1.0) == loom::StepVerdict::skip_no_samples);
  CHECK(window(0, 0.0, /*final=*/true) == loom::StepVerdict::not_reduced);
  CHECK(loom::to_string(loom::StepVerdict::skip_grid_overflow) == "skip_grid_overflow");
  // The Accumulator's apply and skipped_non_finite are the verdict's.
  loom::Accumulator acc(reducer, {.micro_batches_per_step = 1});
  const loom::SyncResult bad = acc.run(2, [&] { (w * std::numeric_limits<double>::quiet_NaN()).sum().backward(); });
  CHECK(bad.verdict == loom::StepVerdict::skip_non_finite);
  CHECK_FALSE(bad.apply);
  CHECK(bad.skipped_non_finite);
  const loom::SyncResult good = acc.run(2, [&] { (w * 3.0).sum().backward(); });
  CHECK(good.verdict == loom::StepVerdict::apply);
  CHECK(good.apply);
}

TEST_CASE("Reducer: at most one host read per step, none inside autograd hooks") {
  loom::test::Mlp model(at::kFloat);
  loom::test::AsyncRecordingCommunicator comm;
  loom::Reducer reducer(comm, model.list(),
                        {.bucket_cap_bytes = 4, .first_bucket_cap_bytes = 4, .max_grad_norm = 10.0});
  loom::Accumulator acc(reducer, {.micro_batches_per_step = 2});
  std::int64_t first = 0;
  int steps = 0;
  for (int i = 0; i < 7; ++i) {
    auto step = acc.run(3, [&] {
      model.loss_sum(loom::test::batch_x(first, 3, at::kFloat), loom::test::batch_y(first, 3, at::kFloat)).backward();
      CHECK(reducer.host_reads().in_hooks == 0);
    });
    first += 3;
    if (step.boundary) ++steps;
    CHECK(reducer.host_reads().total == steps);
  }
  REQUIRE(steps == 3);
  // The remainder (one micro-batch) and the join: a final flush reads the window's count first.
  int flushes = 0;
  while (auto s = acc.end_epoch()) ++flushes;
  CHECK(flushes == 1);
  CHECK(reducer.host_reads().in_hooks == 0);
  CHECK(reducer.host_reads().total <= steps + 2 * (flushes + 1));
}

}  // namespace test_reducer_rules
