// loom::Reducer in one process: LocalCommunicator and the recording archetypes. Multi-rank
// behaviour is in test_reduce_dist.cpp and tests/accumulate/test_field_dist.cpp (real processes over Gloo).
#include <cmath>
#include <optional>
#include <sstream>

#include <doctest/doctest.h>
#include <fmt/format.h>
#include <torch/script.h>

#include <loom/accumulate/accumulator.hpp>
#include <loom/comm/local.hpp>
#include <loom/compat.hpp>
#include <loom/reduce/jit.hpp>
#include <loom/reduce/module.hpp>
#include <loom/reduce/reducer.hpp>

#include "reference/grad_reference.hpp"
#include "support/models.hpp"
#include "support/recording_communicator.hpp"

namespace test_reducer {

namespace {

bool inside(const at::Tensor& view, const at::Tensor& bucket) {
  const auto* b = static_cast<const char*>(bucket.data_ptr());
  const auto* v = static_cast<const char*>(view.data_ptr());
  return v >= b && v + view.numel() * view.element_size() <= b + bucket.numel() * bucket.element_size();
}

int count(const loom::test::CallLog& log, const std::string& name) {
  return static_cast<int>(std::count_if(log.begin(), log.end(), [&](const auto& c) { return c.name == name; }));
}

}  // namespace

TEST_CASE("Reducer: buckets per dtype, reverse registration order, smaller first bucket; grads are views") {
  auto a = torch::zeros({100}).requires_grad_();                 // 400 bytes
  auto b = torch::zeros({200}).requires_grad_();                 // 800 bytes
  auto c = torch::zeros({50}, torch::kDouble).requires_grad_();  // 400 bytes
  auto d = torch::zeros({300}).requires_grad_();                 // 1200 bytes
  auto e = torch::zeros({10});                                   // frozen
  loom::LocalCommunicator comm;
  loom::Reducer reducer(comm, {.names = {"a", "b", "c", "d", "e"}, .params = {a, b, c, d, e}},
                        {.bucket_cap_bytes = 1000, .first_bucket_cap_bytes = 400});
  // reverse order d, c, b, a: d alone passes float32's 400-byte first cap, c fills float64's first
  // bucket, then b + a reach 1000 bytes. e is frozen: in no bucket.
  const auto buckets = reducer.bucket_params();
  REQUIRE(buckets.size() == 3);
  CHECK(buckets[0] == std::vector<std::size_t>{3});
  CHECK(buckets[1] == std::vector<std::size_t>{2});
  CHECK(buckets[2] == std::vector<std::size_t>{1, 0});

  reducer.prepare_backward({.sync = false});
  const auto flat = reducer.bucket_tensors();
  CHECK((flat[1].scalar_type() == torch::kDouble));
  CHECK(inside(d.grad(), flat[0]));
  CHECK(inside(c.grad(), flat[1]));
  CHECK(inside(b.grad(), flat[2]));
  CHECK(inside(a.grad(), flat[2]));
  CHECK_FALSE(e.grad().defined());
  // Writing a gradient writes the bucket (no copy in or out).
  a.mutable_grad().fill_(2.5);
  CHECK(flat[2].narrow(0, 200, 100).eq(2.5).all().item<bool>());
  CHECK(flat[2].sum().item<double>() == doctest::Approx(250.0));
  // The gradient has the parameter's strides, and is not an autograd view (Optimizer::zero_grad detaches).
  CHECK(a.grad().sizes() == a.sizes());
  CHECK_FALSE(a.grad().is_view());
}

TEST_CASE("Reducer + Accumulator in one process: micro-batches [2, 3, 5] give the float64 full-batch mean gradient") {
  for (std::size_t cap : {std::size_t{8}, std::size_t{25} << 20}) {  // one bucket per tensor, or one bucket
    loom::test::Mlp model;
    const auto p64 = model.clone64();
    loom::LocalCommunicator comm;
    loom::Reducer reducer(comm, model.list(), {.bucket_cap_bytes = cap, .first_bucket_cap_bytes = cap});
    loom::Accumulator acc(reducer, {.micro_batches_per_step = 3});
    std::int64_t first = 0;
    loom::SyncResult step;
    for (std::int64_t n : {2, 3, 5}) {
      step =
          acc.run(n, [&] { model.loss_sum(loom::test::batch_x(first, n), loom::test::batch_y(first, n)).backward(); });
      first += n;
    }
    REQUIRE(step.boundary);
    CHECK(step.apply);
    CHECK(step.global_samples == 10);
    CHECK(step.micro_batches == 3);
    const auto ref =
        loom::test::mean_gradient(p64, 10, [&](std::int64_t i) { return loom::test::sample_loss(p64, i); });
    CHECK(loom::test::max_relative_error(model.grads(), ref) < 1e-12);
  }
}

TEST_CASE("Reducer: no collective before the boundary; at the boundary one all-reduce per bucket, from hooks, as DDP") {
  loom::test::Mlp model(at::kFloat);
  loom::test::AsyncRecordingCommunicator comm;
  // Tiny caps: 4 buckets (b2, w2, b1, w1 in reverse registration order).
  loom::Reducer reducer(comm, model.list(), {.bucket_cap_bytes = 4, .first_bucket_cap_bytes = 4});
  CHECK(comm.calls().empty());  // world size 1: no check, no broadcast
  loom::Accumulator acc(reducer, {.micro_batches_per_step = 2});

  auto mb1 = acc.micro_batch(4);
  model.loss_sum(loom::test::batch_x(0, 4, at::kFloat), loom::test::batch_y(0, 4, at::kFloat)).backward();
  CHECK(comm.calls().empty());  // no_sync: nothing sent
  CHECK_FALSE(mb1.finish().boundary);

  auto mb2 = acc.micro_batch(4);
  REQUIRE(mb2.boundary());
  CHECK(comm.calls().empty());  // the window meta rides in the first bucket: nothing before backward
  model.loss_sum(loom::test::batch_x(4, 4, at::kFloat), loom::test::batch_y(4, 4, at::kFloat)).backward();
  // All four buckets were launched by the hooks, during backward, in bucket order. The first also
  // carries the window meta as float32 limbs of 24 bits on one rank: samples 3 limbs, final 1,
  // leaving 1, loss divisor 1, its square 2, vote 1, fingerprint 1, its square 2, has one 1, replica
  // fingerprint 1, its square 2, has one 1 = 17.
  // Each ends with its range flag (a CPU float32 bucket): 1.
  REQUIRE(comm.calls().size() == 4);
  const std::vector<std::int64_t> numels = {loom::test::kOut + 1 + 17 + 1,
                                            loom::test::kOut * loom::test::kHidden + 1 + 1, loom::test::kHidden + 1 + 1,
                                            loom::test::kHidden * loom::test::kIn + 1 + 1};
  for (std::size_t k = 0; k < 4; ++k) {
    CHECK(comm.calls()[k].name == "all_reduce_async");
    CHECK(comm.calls()[k].numel == numels[k]);  // gradient elements + one used-flag (+ the meta's limbs) + range flag
    CHECK((comm.calls()[k].dtype == torch::kFloat));
  }
  auto step = mb2.finish();
  CHECK(step.apply);
  CHECK(step.global_samples == 8);
  // finish_window: waits for the buckets in launch order.
  REQUIRE(comm.calls().size() == 8);
  for (std::size_t k = 0; k < 4; ++k) {
    CHECK(comm.calls()[4 + k].name == "wait");
    CHECK(comm.calls()[4 + k].id == comm.calls()[k].id);
  }
  CHECK(count(comm.calls(), "wait") == 4);
  CHECK(count(comm.calls(), "all_reduce_async") == 4);
}

TEST_CASE("Reducer: the window meta goes on its own where the first bucket's dtype has no room for it") {
  // bfloat16 (8 significand bits) on 512 ranks: a limb's sum would need 9 bits more than it has.
  // Deterministic mode sends it on its own too (its buckets are integers on a grid).
  loom::test::Mlp model(at::kBFloat16);
  loom::test::AsyncRecordingCommunicator comm(0, 512);
  loom::Reducer reducer(comm, model.list(),
                        {.bucket_cap_bytes = 4,
                         .first_bucket_cap_bytes = 4,
                         .float32_accumulation = false,
                         .check_parameters = false,
                         .broadcast_parameters = false});
  reducer.prepare_backward({.sync = true, .window_samples = 3});
  REQUIRE(comm.calls().size() == 1);  // the meta leaves before backward
  CHECK((comm.calls()[0].dtype == torch::kLong));
  CHECK(comm.calls()[0].numel == 12);  // [window samples, final, leaving, loss divisor, its square, its vote,
                                       //  fingerprint, its square, has a fingerprint, replica fingerprint,
                                       //  its square, has one]
  model.loss_sum(loom::test::batch_x(0, 3, at::kBFloat16), loom::test::batch_y(0, 3, at::kBFloat16)).backward();
  REQUIRE(comm.calls().size() == 5);
  CHECK(comm.calls()[1].numel == loom::test::kOut + 1);  // the first bucket: gradients + used-flags only
  CHECK((comm.calls()[1].dtype == torch::kBFloat16));
  auto r = reducer.finish_window();
  CHECK(r.reduced);
  CHECK(r.global_samples == 3 * 512);  // the recording communicator's other ranks hold the same values
}

TEST_CASE("Reducer: a final flush with nothing anywhere leaves every gradient as it was, after one all-reduce") {
  // The flush's verdict needs the window meta, which rides in the first bucket: that bucket goes
  // (its unused slots zeroed for the sum), the verdict is "nothing to do", and every slot gets back
  // the gradient it held before the window. The first bucket holds b2 (no gradient: it stays
  // without one) and w2 (a gradient); b1 and w1 are buckets of their own that never leave.
  struct Case {
    const char* name;
    at::ScalarType dtype;
    std::optional<c10::ScalarType> wire;
  };
  for (const Case& c : {Case{"float32", at::kFloat, std::nullopt}, Case{"float32, float16 wire", at::kFloat, at::kHalf},
                        Case{"bfloat16 in float32 slots", at::kBFloat16, std::nullopt}}) {
    INFO(c.name);
    loom::test::Mlp model(c.dtype);
    std::vector<at::Tensor> before;
    for (std::size_t k = 0; k < model.params.size(); ++k) {
      if (k == 3) continue;  // b2
      model.params[k].mutable_grad() = torch::full_like(model.params[k], 0.25 * static_cast<double>(k + 1));
    }
    for (const auto& p : model.params) before.push_back(p.grad().defined() ? p.grad().clone() : at::Tensor());
    loom::test::AsyncRecordingCommunicator comm;
    const std::size_t first_cap = 4 * (loom::test::kOut + loom::test::kOut * loom::test::kHidden);  // b2 + w2
    loom::Reducer reducer(comm, model.list(),
                          {.bucket_cap_bytes = 4, .first_bucket_cap_bytes = first_cap, .wire_dtype = c.wire});
    REQUIRE(reducer.bucket_params().size() == 3);
    REQUIRE(reducer.bucket_params()[0] == std::vector<std::size_t>{3, 2});
    reducer.prepare_backward({.sync = true, .final = true, .window_samples = 0});
    auto r = reducer.finish_window();
    CHECK(r.all_final);
    CHECK_FALSE(r.reduced);
    REQUIRE(comm.calls().size() == 2);  // the first bucket, and its wait
    CHECK(comm.calls()[0].name == "all_reduce_async");
    CHECK(comm.calls()[0].numel == loom::test::kOut + loom::test::kOut * loom::test::kHidden + 2 + (c.wire ? 29 : 17) +
                                       (!c.wire && c.dtype == at::kFloat ? 1 : 0));  // gradients + 2 used-flags +
    // the meta's limbs (+ the range flag of a bucket neither compressed nor float32-accumulated)
    CHECK(comm.calls()[1].name == "wait");
    for (std::size_t k = 0; k < model.params.size(); ++k) {
      INFO("parameter ", k);
      REQUIRE(model.params[k].grad().defined() == before[k].defined());
      if (before[k].defined()) CHECK(model.params[k].grad().equal(before[k]));
    }
  }
}

TEST_CASE("Reducer: deterministic mode sends the window meta as an int64 all-reduce of its own, before backward") {
  loom::test::Mlp model(at::kFloat);
  loom::test::AsyncRecordingCommunicator comm;
  loom::Reducer reducer(comm, model.list(), {.deterministic = true});
  reducer.prepare_backward({.sync = true, .window_samples = 3});
  REQUIRE(comm.calls().size() == 1);
  CHECK((comm.calls()[0].dtype == torch::kLong));
  CHECK(comm.calls()[0].numel == 12);
  model.loss_sum(loom::test::batch_x(0, 3, at::kFloat), loom::test::batch_y(0, 3, at::kFloat)).backward();
  auto r = reducer.finish_window();
  CHECK(r.reduced);
  CHECK(r.global_samples == 3);
  // After it only the bucket's integers: the int32 wire (plus, here, its int64 resend: this first
  // window's grid does not fit int32); the meta is never sent again.
  int metas = 0;
  for (const auto& call : comm.calls())
    if (call.name == "all_reduce_async" && call.dtype == torch::kLong && call.numel == 12) ++metas;
  CHECK(metas == 1);
  CHECK((comm.calls()[1].dtype == torch::kInt));
}

TEST_CASE("Reducer: overlap = false sends everything in finish_window; a blocking communicator works too") {
  loom::test::Mlp model(at::kFloat);
  loom::test::AsyncRecordingCommunicator comm;
  loom::Reducer reducer(comm, model.list(), {.bucket_cap_bytes = 4, .first_bucket_cap_bytes = 4, .overlap = false});
  reducer.prepare_backward({.sync = true, .window_samples = 3});
  model.loss_sum(loom::test::batch_x(0, 3, at::kFloat), loom::test::batch_y(0, 3, at::kFloat)).backward();
  CHECK(comm.calls().empty());  // nothing before finish_window
  auto r = reducer.finish_window();
  CHECK(r.reduced);
  CHECK(r.global_samples == 3);
  CHECK(count(comm.calls(), "all_reduce_async") == 4);

  loom::test::Mlp model2(at::kFloat);
  loom::test::RecordingCommunicator blocking;
  loom::Reducer r2(blocking, model2.list(), {.wire_dtype = at::kHalf});
  r2.prepare_backward({.sync = true, .window_samples = 3});
  model2.loss_sum(loom::test::batch_x(0, 3, at::kFloat), loom::test::batch_y(0, 3, at::kFloat)).backward();
  auto rr = r2.finish_window();
  CHECK(rr.reduced);
  CHECK(rr.global_samples == 3);
  REQUIRE(blocking.calls().size() == 1);
  CHECK(blocking.calls()[0].name == "all_reduce");
  CHECK((blocking.calls()[0].dtype == torch::kHalf));  // compressed on the wire, the meta with it
  // One bucket: 32 gradients + 4 used-flags + the meta as float16 limbs of 11 bits (samples 6,
  // final 1, leaving 1, divisor 2, its square 4, vote 1, fingerprint 2, its square 4, has one 1,
  // replica fingerprint 2, its square 4, has one 1).
  CHECK(blocking.calls()[0].numel == (5 * 3 + 5 + 2 * 5 + 2) + 4 + 29);
  // Same gradient as the uncompressed model, to float16 precision.
  CHECK(loom::test::max_relative_error(model2.grads(), model.grads()) < 1e-2);
}

TEST_CASE("Reducer: buckets are rebuilt once, after the first step, in the order gradients became ready") {
  // Registration order {w2, w3, w1}; backward of w3 * tanh(w2 * tanh(w1 * x)) produces w3, w2, w1.
  auto w1 = torch::full({4}, 0.5).requires_grad_();
  auto w2 = torch::full({4}, 0.25).requires_grad_();
  auto w3 = torch::full({4}, 2.0).requires_grad_();
  loom::LocalCommunicator comm;
  loom::Reducer reducer(comm, {.names = {"w2", "w3", "w1"}, .params = {w2, w3, w1}},
                        {.bucket_cap_bytes = 1, .first_bucket_cap_bytes = 1});
  const std::vector<std::vector<std::size_t>> registration_reversed = {{2}, {1}, {0}};
  CHECK(reducer.bucket_params() == registration_reversed);
  auto x = torch::arange(4, torch::kDouble).add(1.0);
  auto loss = [&] { return (w3 * torch::tanh(w2 * torch::tanh(w1 * x))).sum(); };
  reducer.prepare_backward({.sync = true, .window_samples = 1});
  loss().backward();
  reducer.finish_window();
  CHECK_FALSE(reducer.rebuilt());  // gradients are still in use by the caller
  const auto before = std::vector<at::Tensor>{w1.grad().clone(), w2.grad().clone(), w3.grad().clone()};
  reducer.prepare_backward({.sync = false});  // next window: rebuild
  CHECK(reducer.rebuilt());
  const std::vector<std::vector<std::size_t>> ready_order = {{1}, {0}, {2}};  // w3, w2, w1
  CHECK(reducer.bucket_params() == ready_order);
  // Gradients moved with their values, into the new buckets.
  CHECK(torch::equal(w1.grad(), before[0]));
  CHECK(torch::equal(w2.grad(), before[1]));
  CHECK(torch::equal(w3.grad(), before[2]));
  CHECK(inside(w3.grad(), reducer.bucket_tensors()[0]));
  CHECK(inside(w1.grad(), reducer.bucket_tensors()[2]));
  // Later steps keep the layout and stay exact.
  for (auto* p : {&w1, &w2, &w3}) p->mutable_grad().zero_();
  loss().backward();
  reducer.prepare_backward({.sync = true, .window_samples = 2});
  loss().backward();
  reducer.finish_window();
  CHECK(reducer.bucket_params() == ready_order);
  CHECK(torch::allclose(w1.grad(), before[0], 1e-12, 0));  // (g + g) / 2
}

TEST_CASE("Reducer: rebuild_buckets = false keeps the reverse registration order for good") {
  // The same model as above: the ready order (w3, w2, w1) differs from the reverse registration order.
  auto w1 = torch::full({4}, 0.5).requires_grad_();
  auto w2 = torch::full({4}, 0.25).requires_grad_();
  auto w3 = torch::full({4}, 2.0).requires_grad_();
  loom::LocalCommunicator comm;
  loom::Reducer reducer(comm, {.names = {"w2", "w3", "w1"}, .params = {w2, w3, w1}},
                        {.bucket_cap_bytes = 1, .first_bucket_cap_bytes = 1, .rebuild_buckets = false});
  const std::vector<std::vector<std::size_t>> registration_reversed = {{2}, {1}, {0}};
  auto x = torch::arange(4, torch::kDouble).add(1.0);
  for (int window = 0; window < 3; ++window) {
    reducer.prepare_backward({.sync = true, .window_samples = 1});
    (w3 * torch::tanh(w2 * torch::tanh(w1 * x))).sum().backward();
    reducer.finish_window();
    CHECK_FALSE(reducer.rebuilt());
    CHECK(reducer.bucket_params() == registration_reversed);
    // d/dw3 of sum(w3 * tanh(w2 * tanh(w1 * x))) = tanh(0.25 * tanh(0.5 * x)), x = 1..4, by hand in float64.
    for (int i = 0; i < 4; ++i)
      CHECK(w3.grad()[i].item<double>() == doctest::Approx(std::tanh(0.25 * std::tanh(0.5 * (i + 1)))).epsilon(1e-6));
    for (auto* p : {&w1, &w2, &w3}) p->mutable_grad().zero_();
  }
}

TEST_CASE("Reducer: a parameter used nowhere keeps its gradient (undefined stays undefined, stale 7 stays 7)") {
  auto a = torch::tensor({1.0}, torch::kDouble).requires_grad_();
  auto c = torch::tensor({1.0}, torch::kDouble).requires_grad_();
  auto d = torch::tensor({1.0}, torch::kDouble).requires_grad_();
  d.mutable_grad() = torch::tensor({7.0}, torch::kDouble);
  loom::LocalCommunicator comm;
  loom::Reducer reducer(comm, {.names = {"a", "c", "d"}, .params = {a, c, d}});
  loom::Accumulator acc(reducer);
  auto step = acc.run(1, [&] { (a * 2.0).sum().backward(); });
  REQUIRE(step.apply);
  CHECK(a.grad().item<double>() == 2.0);
  CHECK_FALSE(c.grad().defined());
  REQUIRE(d.grad().defined());
  CHECK(d.grad().item<double>() == 7.0);
  // SGD with momentum and weight decay skips c (undefined gradient): c unchanged.
  torch::optim::SGD sgd({a, c}, torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(0.5));
  sgd.step();
  CHECK(c.item<double>() == 1.0);
  CHECK(a.item<double>() == doctest::Approx(1.0 - 0.1 * (2.0 + 0.5)));
}

TEST_CASE("Reducer: LibTorch's Optimizer::zero_grad and set-to-none both work with bucket gradients") {
  loom::test::Mlp model;
  loom::LocalCommunicator comm;
  loom::Reducer reducer(comm, model.list());
  loom::Accumulator acc(reducer);
  torch::optim::SGD sgd(model.params, torch::optim::SGDOptions(0.05).momentum(0.9));
  const auto p64 = model.clone64();
  for (int step = 0; step < 3; ++step) {
    const std::int64_t first = 5 * step;
    auto s =
        acc.run(5, [&] { model.loss_sum(loom::test::batch_x(first, 5), loom::test::batch_y(first, 5)).backward(); });
    REQUIRE(s.apply);
    // Reference at the current weights.
    std::vector<at::Tensor> now;
    for (const auto& p : model.params) now.push_back(p.detach().clone().set_requires_grad(true));
    const auto ref =
        loom::test::mean_gradient(now, 5, [&](std::int64_t i) { return loom::test::sample_loss(now, first + i); });
    CHECK(loom::test::max_relative_error(model.grads(), ref) < 1e-12);
    sgd.step();
    if (step == 0) {
      loom::zero_grad(sgd, loom::GradReset::zero);  // detach_() + zero_() on every LibTorch
      CHECK(model.params[0].grad().abs().sum().item<double>() == 0.0);
    } else {
      loom::zero_grad(sgd, loom::GradReset::none);  // set_to_none
    }
  }
  (void)p64;
}

TEST_CASE("Reducer: frozen parameters are left out; gradients written by hand use mark_ready") {
  auto w = torch::tensor({1.0, 2.0}, torch::kDouble).requires_grad_();
  auto frozen = torch::tensor({3.0}, torch::kDouble);
  loom::LocalCommunicator comm;
  loom::Reducer reducer(comm, {.names = {"w", "frozen"}, .params = {w, frozen}});
  CHECK(reducer.bucket_params() == std::vector<std::vector<std::size_t>>{{0}});
  reducer.prepare_backward({.sync = true, .window_samples = 4});
  w.mutable_grad().copy_(torch::tensor({8.0, -4.0}, torch::kDouble));
  reducer.mark_ready(0);
  CHECK_THROWS_WITH_AS(reducer.mark_ready(1), doctest::Contains("parameter 1 ('frozen') is not a trainable"),
                       loom::InvalidArgument);
  auto r = reducer.finish_window();
  CHECK(r.global_samples == 4);
  CHECK(torch::equal(w.grad(), torch::tensor({2.0, -1.0}, torch::kDouble)));
  CHECK_FALSE(frozen.grad().defined());
}

TEST_CASE("Reducer: global-norm clipping equals LibTorch's clip_grad_norm_ on the full-batch gradient") {
  loom::test::Mlp model;
  loom::LocalCommunicator comm;
  loom::Reducer reducer(comm, model.list(), {.max_grad_norm = 0.5});
  loom::Accumulator acc(reducer, {.micro_batches_per_step = 2});
  acc.run(3, [&] { model.loss_sum(loom::test::batch_x(0, 3), loom::test::batch_y(0, 3)).backward(); });
  auto s = acc.run(4, [&] { model.loss_sum(loom::test::batch_x(3, 4), loom::test::batch_y(3, 4)).backward(); });
  REQUIRE(s.apply);
  auto p64 = model.clone64();
  auto ref = loom::test::mean_gradient(p64, 7, [&](std::int64_t i) { return loom::test::sample_loss(p64, i); });
  const double norm = loom::test::global_norm(ref);
  REQUIRE(norm > 0.5);  // the clip is active
  CHECK(s.grad_norm == doctest::Approx(norm).epsilon(1e-12));
  for (std::size_t k = 0; k < p64.size(); ++k) p64[k].mutable_grad() = ref[k].clone();
  torch::nn::utils::clip_grad_norm_(p64, 0.5);
  std::vector<at::Tensor> clipped;
  for (const auto& p : p64) clipped.push_back(p.grad());
  CHECK(loom::test::max_relative_error(model.grads(), clipped) < 1e-12);
  CHECK(loom::test::global_norm(model.grads()) == doctest::Approx(0.5).epsilon(1e-5));
}

TEST_CASE("Reducer: float16 / bfloat16 wire compression error, measured against the float32 reduction") {
  // Gradients spanning 4 decades; one process, so the error is the wire cast alone.
  // Magnitudes in [e^-4, 1] (normal numbers in float16 too), alternating signs.
  const auto values =
      torch::linspace(-4, 0, 4096, torch::kDouble)
          .exp()
          .mul(torch::linspace(0, 60, 4096, torch::kDouble).sin().ge(0).to(torch::kDouble).mul(2).sub(1));
  for (auto [dtype, bound] :
       {std::pair{at::kHalf, std::ldexp(1.0, -11)}, std::pair{at::kBFloat16, std::ldexp(1.0, -8)}}) {
    auto exact = torch::zeros({4096}).requires_grad_();
    auto packed = torch::zeros({4096}).requires_grad_();
    loom::LocalCommunicator comm;
    loom::Reducer plain(comm, {.params = {exact}}, {.average = loom::Average::none});
    loom::Reducer wire(comm, {.params = {packed}}, {.average = loom::Average::none, .wire_dtype = dtype});
    for (auto* r : {&plain, &wire}) r->prepare_backward({.sync = true, .window_samples = 1});
    exact.mutable_grad().copy_(values);
    packed.mutable_grad().copy_(values);
    plain.mark_all_ready();
    wire.mark_all_ready();
    plain.finish_window();
    wire.finish_window();
    const auto rel = ((packed.grad().to(torch::kDouble) - exact.grad().to(torch::kDouble)).abs() /
                      exact.grad().to(torch::kDouble).abs().clamp_min(1e-30));
    const double worst = rel.max().item<double>();
    MESSAGE(fmt::format("{}: max relative error {:.3g} (bound {:.3g})", c10::toString(dtype), worst, bound));
    CHECK(worst > 0);       // really compressed
    CHECK(worst <= bound);  // one rounding to the wire dtype
  }
}

TEST_CASE("Reducer: inf or NaN in a gradient reports non_finite and zeroes the window") {
  auto w = torch::tensor({1.0, 1.0}).requires_grad_();
  loom::LocalCommunicator comm;
  loom::Reducer reducer(comm, {.params = {w}});
  reducer.prepare_backward({.sync = true, .window_samples = 1});
  (w * torch::tensor({std::numeric_limits<float>::infinity(), 1.0f})).sum().backward();
  auto r = reducer.finish_window();
  CHECK(r.non_finite);
  CHECK(torch::equal(w.grad(), torch::zeros({2})));
}

TEST_CASE("Reducer: averaging by world size or not at all on 1 rank (checked before the all-reduce)") {
  // The bucket is checked when it is launched (WindowAverage::pre_divide) and no pass follows the
  // all-reduce: a finite gradient is left as it is, an inf or NaN one is reported and zeroed.
  for (auto average : {loom::Average::world_size, loom::Average::none}) {
    CAPTURE(static_cast<int>(average));
    for (auto dtype : {torch::kFloat, torch::kDouble}) {
      auto w = torch::zeros({1000}, dtype).requires_grad_();
      loom::LocalCommunicator comm;
      loom::Reducer reducer(comm, {.params = {w}}, {.average = average});
      const auto g = torch::linspace(-3e30, 3e30, 1000, dtype);
      reducer.prepare_backward({.sync = true, .window_samples = 7});
      (w * g).sum().backward();
      auto r = reducer.finish_window();
      CHECK_FALSE(r.non_finite);
      CHECK(torch::equal(w.grad(), g));
      for (double bad : {std::numeric_limits<double>::infinity(), std::numeric_limits<double>::quiet_NaN()}) {
        w.mutable_grad().zero_();
        auto b = g.clone();
        b[999] = bad;
        reducer.prepare_backward({.sync = true, .window_samples = 7});
        (w * b).sum().backward();
        r = reducer.finish_window();
        CHECK(r.non_finite);
        CHECK(torch::equal(w.grad(), torch::zeros({1000}, dtype)));
      }
      // With a loss scale the rest of the factor is applied after the all-reduce: 1 / 4 here.
      w.mutable_grad().zero_();
      reducer.prepare_backward({.sync = true, .window_samples = 7, .grad_scale = 0.25});
      (w * g).sum().backward();
      r = reducer.finish_window();
      CHECK_FALSE(r.non_finite);
      CHECK(torch::equal(w.grad(), g * 0.25));
    }
  }
}

TEST_CASE("detail::scale_span_fused: the range bound flags values above it, inf and NaN of either sign, not -0") {
  auto run = [](at::Tensor t, double bound) {
    return loom::detail::scale_span_fused(t, 0, t.numel(), 2.0, /*divide=*/true, /*check=*/true, bound);
  };
  for (auto dtype : {torch::kFloat, torch::kDouble}) {
    CAPTURE(dtype);
    const double bound = dtype == torch::kFloat ? static_cast<double>(std::numeric_limits<float>::max()) / 8
                                                : std::numeric_limits<double>::max() / 8;
    const double above =
        dtype == torch::kFloat
            ? static_cast<double>(std::nextafter(static_cast<float>(bound), std::numeric_limits<float>::infinity()))
            : std::nextafter(bound, std::numeric_limits<double>::infinity());
    // Results (after the division by 2) at the bound, just above it, and the special values; each
    // element in its own tensor of 131 (two loop blocks and a tail), at every 7th position.
    auto filled = [&](double result, std::int64_t at) {
      auto t = torch::ones({131}, dtype);
      t[at] = result * 2;
      return t;
    };
    for (std::int64_t at = 0; at < 131; at += 7) {
      CHECK_FALSE(run(filled(bound, at), bound));
      CHECK_FALSE(run(filled(-bound, at), bound));
      CHECK(run(filled(above, at), bound));
      CHECK(run(filled(-above, at), bound));
      CHECK(run(filled(std::numeric_limits<double>::infinity(), at), bound));
      CHECK(run(filled(-std::numeric_limits<double>::infinity(), at), bound));
      CHECK(run(filled(std::numeric_limits<double>::quiet_NaN(), at), bound));
      CHECK(run(filled(-std::numeric_limits<double>::quiet_NaN(), at), bound));
      CHECK_FALSE(run(filled(-0.0, at), bound));
      // No bound (infinite): only inf and NaN.
      CHECK_FALSE(run(filled(above, at), std::numeric_limits<double>::infinity()));
      CHECK(run(filled(-std::numeric_limits<double>::infinity(), at), std::numeric_limits<double>::infinity()));
    }
    auto t = torch::tensor({3.0, -5.0, 0.5}, dtype);
    CHECK_FALSE(run(t, bound));
    CHECK(torch::equal(t, torch::tensor({1.5, -2.5, 0.25}, dtype)));  // and the values were divided
  }
}

TEST_CASE("Reducer: a value above the range bound on 1 rank is checked after the all-reduce and kept when finite") {
  // World size 1, average = world_size: the bound is (largest finite) / 2. 0.75 x FLT_MAX is above
  // it, so the rank sets the range flag and the reduced bucket is scanned: finite, left as it is.
  auto w = torch::zeros({3}).requires_grad_();
  loom::LocalCommunicator comm;
  loom::Reducer reducer(comm, {.params = {w}}, {.average = loom::Average::world_size});
  const float big = 0.75f * std::numeric_limits<float>::max();
  reducer.prepare_backward({.sync = true, .window_samples = 1});
  (w * torch::tensor({big, -big, 1.0f})).sum().backward();
  auto r = reducer.finish_window();
  CHECK_FALSE(r.non_finite);
  CHECK(torch::equal(w.grad(), torch::tensor({big, -big, 1.0f})));
}

TEST_CASE("Reducer: an inf in a second gradient refused after its bucket left is reported by finish_window") {
  // average = world_size on 1 rank: the bucket was checked when it left, finite; the refused second
  // gradient was added to the slot all the same, so finish_window scans the bucket again.
  auto w = torch::ones({2}).requires_grad_();
  loom::LocalCommunicator comm;
  loom::Reducer reducer(comm, {.names = {"w"}, .params = {w}}, {.average = loom::Average::world_size});
  reducer.prepare_backward({.sync = true, .window_samples = 1});
  auto y = (w * torch::tensor({3.0f, std::numeric_limits<float>::infinity()})).sum();
  (w * 3.0f).sum().backward();
  CHECK_THROWS_WITH_AS(y.backward(), doctest::Contains("parameter 0 ('w') received a second gradient"),
                       loom::InvalidArgument);
  auto r = reducer.finish_window();
  CHECK(r.non_finite);
  CHECK(torch::equal(w.grad(), torch::zeros({2})));
}

TEST_CASE("Reducer: misuse throws loom errors naming the value") {
  loom::LocalCommunicator comm;
  auto w = torch::ones({2}).requires_grad_();
  loom::Reducer reducer(comm, {.names = {"w"}, .params = {w}});
  CHECK_THROWS_WITH_AS(reducer.finish_window(), doctest::Contains("no synchronising backward"), loom::Error);
  CHECK_THROWS_WITH_AS(reducer.prepare_backward({.sync = true, .window_samples = -3}),
                       doctest::Contains("window_samples = -3"), loom::InvalidArgument);
  CHECK_THROWS_AS(reducer.prepare_backward({.sync = false, .final = true}), loom::InvalidArgument);
  CHECK_THROWS_WITH_AS(reducer.prepare_backward({.sync = true, .window_samples = 1, .grad_scale = 0.0}),
                       doctest::Contains("grad_scale = 0"), loom::InvalidArgument);
  reducer.prepare_backward({.sync = true, .window_samples = 1});
  CHECK_THROWS_WITH_AS(reducer.prepare_backward({.sync = true}), doctest::Contains("not closed with finish_window"),
                       loom::Error);
  // A second gradient after the bucket was sent (two backward passes in the synchronising micro-batch).
  auto y = (w * 3.0).sum();
  y.backward({}, /*retain_graph=*/true);
  CHECK_THROWS_WITH_AS(y.backward(), doctest::Contains("parameter 0 ('w') received a second gradient"),
                       loom::InvalidArgument);
  reducer.finish_window();

  auto ints = torch::ones({2}, torch::kLong);
  auto leaf = torch::ones({2}).requires_grad_();
  auto nonleaf = leaf * 2;
  CHECK_THROWS_WITH_AS(loom::Reducer(comm, {.params = {nonleaf}}), doctest::Contains("not a leaf"),
                       loom::InvalidArgument);
  CHECK_THROWS_WITH_AS(loom::Reducer(comm, {.names = {"x", "y"}, .params = {leaf, leaf}}),
                       doctest::Contains("parameter 0 ('x') and parameter 1 ('y') are the same tensor"),
                       loom::InvalidArgument);
  auto l2 = torch::ones({2}).requires_grad_();
  CHECK_THROWS_WITH_AS(loom::Reducer(comm, {.params = {l2}}, {.wire_dtype = at::kInt}),
                       doctest::Contains("wire_dtype Int"), loom::InvalidArgument);
  CHECK_THROWS_WITH_AS(loom::Reducer(comm, {.params = {l2}}, {.bucket_cap_bytes = 0}),
                       doctest::Contains("bucket_cap_bytes = 0"), loom::InvalidArgument);
  CHECK_THROWS_WITH_AS(loom::Reducer(comm, {.params = {l2}}, {.max_grad_norm = -1.0}),
                       doctest::Contains("max_grad_norm = -1"), loom::InvalidArgument);
  (void)ints;
}

TEST_CASE("parameters_of: nn::Module names and buffers; TorchScript module built in C++, saved and loaded") {
  auto net = torch::nn::Sequential(torch::nn::Linear(3, 4), torch::nn::BatchNorm1d(4), torch::nn::Linear(4, 1));
  auto list = loom::parameters_of(*net);
  CHECK(list.names == std::vector<std::string>{"0.weight", "0.bias", "1.weight", "1.bias", "2.weight", "2.bias"});
  CHECK(list.buffers.size() == 3);  // running_mean, running_var, num_batches_tracked

  torch::jit::Module m("Twin");
  m.register_parameter("weight", torch::ones({2, 3}).requires_grad_(), false);
  m.register_parameter("bias", torch::zeros({2}).requires_grad_(), false);
  m.register_parameter("scale", torch::ones({1}), false);  // saved with requires_grad = false: frozen
  m.define("def forward(self, x):\n  return (x.matmul(self.weight.t()) + self.bias).tanh().mul(self.scale).sum()\n");
  std::stringstream file;
  m.save(file);
  auto loaded = torch::jit::load(file);
  auto jl = loom::parameters_of(loaded);
  CHECK(jl.names == std::vector<std::string>{"weight", "bias", "scale"});
  CHECK(jl.params[0].requires_grad());
  CHECK_FALSE(jl.params[2].requires_grad());
  loom::LocalCommunicator comm;
  loom::Reducer reducer(comm, jl);
  CHECK(reducer.bucket_params() == std::vector<std::vector<std::size_t>>{{1, 0}});
  reducer.prepare_backward({.sync = true, .window_samples = 2});
  auto x = torch::tensor({{0.1, 0.2, 0.3}, {-0.4, 0.5, 0.6}}, torch::kFloat);
  loaded.forward({x}).toTensor().backward();
  reducer.finish_window();
  // Hand-computed twin: d/dW sum tanh(xW^T + b) = (1 - tanh^2)^T x, averaged over 2 samples.
  auto z = (x.matmul(torch::ones({2, 3}).t())).tanh();
  auto dz = (1 - z * z);
  CHECK(torch::allclose(jl.params[0].grad(), dz.t().matmul(x) / 2, 1e-6, 1e-7));
  CHECK(torch::allclose(jl.params[1].grad(), dz.sum(0) / 2, 1e-6, 1e-7));
}

TEST_CASE("detail::scale_and_check: the one-pass average and inf/NaN scan matches ATen's div_ and isfinite") {
  for (auto dtype : {torch::kFloat, torch::kDouble}) {
    for (std::int64_t n : {0, 1, 63, 64, 65, 1000, 300001}) {
      auto t = torch::linspace(-3, 5, n, torch::kDouble).to(dtype);
      auto ref = t.clone();
      CHECK_FALSE(loom::detail::scale_and_check(t, 22.0, /*divide=*/true, /*check=*/true));
      CHECK(torch::equal(t, ref / 22.0));  // bit-identical to a division
      CHECK_FALSE(loom::detail::scale_and_check(t, 0.5, /*divide=*/false, true));
      CHECK(torch::equal(t, ref / 22.0 * 0.5));
      if (n == 0) continue;
      for (double bad : {std::numeric_limits<double>::infinity(), -std::numeric_limits<double>::infinity(),
                         std::numeric_limits<double>::quiet_NaN()}) {
        auto u = ref.clone();
        u[n - 1] = bad;  // in the scalar tail or the last block
        CHECK(loom::detail::scale_and_check(u, 3.0, true, true));
        CHECK_FALSE(loom::detail::scale_and_check(u, 3.0, true, /*check=*/false));
        auto v = ref.clone();
        v[n / 2] = bad;
        CHECK(loom::detail::scale_and_check(v, 1.0, false, true));
      }
    }
  }
  // Powers of two are multiplied by their reciprocal: still bit-identical to a division, for
  // normal, subnormal (results and inputs), signed-zero and huge values; the non-finite scan sees
  // every lane of both loop variants (default and AVX2, when the CPU has it).
  for (auto dtype : {torch::kFloat, torch::kDouble}) {
    torch::manual_seed(7);
    const double tiny = dtype == torch::kFloat ? 1e-38 : 1e-307;
    auto x = torch::cat({torch::randn({5000}, torch::kDouble).to(dtype),
                         (torch::randn({3000}, torch::kDouble) * tiny).to(dtype),  // subnormal results
                         torch::tensor({0.0, -0.0, tiny / 64, -tiny / 48}, torch::kDouble).to(dtype),  // subnormal
                         torch::randn({300001}, torch::kDouble).to(dtype),  // several parallel_for chunks of 2^18
                         (torch::randn({1000}, torch::kDouble) * (dtype == torch::kFloat ? 1e37 : 1e307)).to(dtype)});
    for (double d : {2.0, 4.0, 8.0, 1024.0, 0x1p40, 0x1p62}) {
      CHECK(loom::detail::is_power_of_two_divisor(d));
      auto t = x.clone();
      CHECK_FALSE(loom::detail::scale_and_check(t, d, /*divide=*/true, /*check=*/true));
      const auto ref = x / d;
      CHECK(torch::equal(t, ref));
      CHECK(torch::equal(torch::signbit(t), torch::signbit(ref)));
    }
    // Non-finite inputs on the reciprocal path: reported when checked, not when not; results as
    // a division gives them (inf stays inf, NaN stays NaN).
    for (bool check : {true, false}) {
      auto u = x.clone();
      u[7] = std::numeric_limits<double>::infinity();
      u[300000] = std::numeric_limits<double>::quiet_NaN();
      CHECK(loom::detail::scale_and_check(u, 4.0, /*divide=*/true, check) == check);
      CHECK(std::isinf(u[7].item<double>()));
      CHECK(std::isnan(u[300000].item<double>()));
      u[300000] = 0.0;
      auto want = x / 4.0;
      want[7] = std::numeric_limits<double>::infinity();
      want[300000] = 0.0;
      CHECK(torch::equal(u, want));
    }
  }
  for (double d : {0.0, 0.5, 3.0, 6.0, 0x1p63, std::numeric_limits<double>::infinity()})
    CHECK_FALSE(loom::detail::is_power_of_two_divisor(d));
  {
    std::vector<float> v(64 * 3 + 5, 1.0f);
    for (std::size_t lane = 0; lane < v.size(); ++lane) {
      auto w = v;
      w[lane] = std::numeric_limits<float>::infinity();
      CHECK(loom::detail::scale_block_loop_default<float, true>(w.data(), static_cast<std::int64_t>(w.size()), 3.0f));
      w = v;
      CHECK_FALSE(
          loom::detail::scale_block_loop_default<float, false>(w.data(), static_cast<std::int64_t>(w.size()), 0.5f));
      CHECK(w[lane] == 0.5f);
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
      if (loom::detail::cpu_has_avx2()) {
        w = v;
        w[lane] = std::numeric_limits<float>::quiet_NaN();
        CHECK(loom::detail::scale_block_loop_avx2<float, true>(w.data(), static_cast<std::int64_t>(w.size()), 3.0f));
        CHECK(w[0 == lane ? 1 : 0] == 1.0f / 3.0f);
      }
#endif
    }
  }
  // A finite value that overflows when scaled is reported too (the step must be skipped).
  auto big = torch::full({10}, 3e38f);
  CHECK(loom::detail::scale_and_check(big, 10.0, false, true));
  // Other layouts fall back to ATen ops.
  auto strided = torch::arange(12, torch::kFloat).reshape({3, 4}).t();
  CHECK_FALSE(loom::detail::scale_and_check(strided, 2.0, true, true));
  CHECK(torch::equal(strided, torch::arange(12, torch::kFloat).reshape({3, 4}).t() / 2));
}

}  // namespace test_reducer
