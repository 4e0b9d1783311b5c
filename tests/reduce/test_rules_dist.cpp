// The reducer's rules on real ranks (Gloo on loopback): buffers broadcast at every step, a
// gradient arriving twice, the parameter set changed by module->to(dtype), the float16 wire, the
// loss divisor (equal, different, and taken by a rank whose window is empty).
#include <cmath>
#include <cstdint>
#include <vector>

#include <doctest/doctest.h>
#include <fmt/format.h>
#include <torch/torch.h>

#include <loom/accumulate/accumulator.hpp>
#include <loom/compat.hpp>
#include <loom/reduce/module.hpp>
#include <loom/reduce/reducer.hpp>

#include "reference/grad_reference.hpp"
#include "support/models.hpp"
#include "support/ranks.hpp"

using loom::test::run_ranks;

namespace {

/// Whether `t` is bit-identical on every rank.
bool same_everywhere(loom::GlooCommunicator& comm, const at::Tensor& t) {
  auto all = comm.all_gather(t.detach().contiguous());
  for (const auto& other : all)
    if (!torch::equal(other, all[0])) return false;
  return true;
}

/// A model with BatchNorm: its running statistics follow each rank's own data.
torch::nn::Sequential bn_model() {
  torch::manual_seed(7);
  auto net = torch::nn::Sequential(torch::nn::Linear(3, 4), torch::nn::BatchNorm1d(4), torch::nn::Linear(4, 1));
  net->to(torch::kDouble);
  return net;
}

}  // namespace

TEST_SUITE("dist") {
  TEST_CASE("buffers: BatchNorm statistics equal rank 0's on every rank after every step (broadcast_buffers)") {
    run_ranks(2, [](loom::GlooCommunicator& comm) {
      const int rank = comm.rank();
      auto net = bn_model();
      auto bn = net[1]->as<torch::nn::BatchNorm1d>();
      loom::Reducer reducer(comm, loom::parameters_of(*net));
      REQUIRE(reducer.options().broadcast_buffers);
      loom::Accumulator acc(reducer, {.micro_batches_per_step = 2});
      torch::optim::SGD sgd(net->parameters(), 0.1);
      int steps = 0;
      for (int i = 0; i < 6; ++i) {
        // Different data on each rank: rank 1's inputs are shifted by 5.
        auto x = loom::test::batch_x(4 * i, 4) + 5.0 * rank;
        at::Tensor before_broadcast;
        auto step = acc.run(4, [&] {
          net->forward(x).sum().backward();
          before_broadcast = bn->running_mean.clone();
        });
        if (!step.boundary) continue;
        ++steps;
        REQUIRE(step.apply);
        sgd.step();
        loom::zero_grad(sgd, loom::GradReset::zero);
        // Rank 0's statistics, everywhere; and they were not equal before (the test can fail).
        REQUIRE(same_everywhere(comm, bn->running_mean));
        REQUIRE(same_everywhere(comm, bn->running_var));
        REQUIRE(same_everywhere(comm, bn->num_batches_tracked));
        REQUIRE_FALSE(same_everywhere(comm, before_broadcast));
        if (rank == 0) REQUIRE(torch::equal(bn->running_mean, before_broadcast));
      }
      REQUIRE(steps == 3);
    });
  }

  TEST_CASE("buffers: broadcast_buffers = false leaves each rank's statistics its own") {
    run_ranks(2, [](loom::GlooCommunicator& comm) {
      auto net = bn_model();
      auto bn = net[1]->as<torch::nn::BatchNorm1d>();
      loom::Reducer reducer(comm, loom::parameters_of(*net), {.broadcast_buffers = false});
      loom::Accumulator acc(reducer);
      auto x = loom::test::batch_x(0, 4) + 5.0 * comm.rank();
      REQUIRE(acc.run(4, [&] { net->forward(x).sum().backward(); }).apply);
      REQUIRE_FALSE(same_everywhere(comm, bn->running_mean));
    });
  }

  TEST_CASE("a gradient arriving twice before its bucket left, on 2 ranks: the global mean of the sums") {
    run_ranks(2, [](loom::GlooCommunicator& comm) {
      const double r = comm.rank();
      auto a = torch::tensor({1.0}, torch::kDouble).requires_grad_();
      auto b = torch::tensor({1.0}, torch::kDouble).requires_grad_();
      loom::Reducer reducer(comm, {.names = {"a", "b"}, .params = {a, b}});
      reducer.prepare_backward({.sync = true, .window_samples = 2 + comm.rank()});  // 2 + 3 = 5 samples
      (a * (1.0 + r)).sum().backward();
      (a * (2.0 + r) + b * 4.0).sum().backward();
      reducer.finish_window();
      // a: rank 0 gives 1 + 2, rank 1 gives 2 + 3: (3 + 5) / 5. b: (4 + 4) / 5.
      REQUIRE(a.grad().item<double>() == doctest::Approx(8.0 / 5.0).epsilon(1e-15));
      REQUIRE(b.grad().item<double>() == doctest::Approx(8.0 / 5.0).epsilon(1e-15));
    });
  }

  TEST_CASE(
      "Average::world_size on 2 ranks, gradients divided in their hooks: a second gradient, a gradient replaced and "
      "marked by hand, one marked by hand only, one from an earlier micro-batch only: exact means") {
    run_ranks(2, [](loom::GlooCommunicator& comm) {
      const double r = comm.rank();
      auto p = [] { return torch::tensor({1.0}, torch::kDouble).requires_grad_(); };
      auto a = p(), b = p(), c = p(), d = p(), e = p();
      loom::Reducer reducer(comm, {.names = {"a", "b", "c", "d", "e"}, .params = {a, b, c, d, e}},
                            {.average = loom::Average::world_size});
      REQUIRE(reducer.bucket_params().size() == 1);
      for (int step = 0; step < 2; ++step) {  // the second step runs on the rebuilt bucket
        for (auto* t : {&a, &b, &c, &d, &e}) t->mutable_grad() = torch::Tensor();
        reducer.prepare_backward({.sync = false});
        (c * (3.0 + r)).sum().backward();  // c: only in the earlier micro-batch
        reducer.prepare_backward({.sync = true, .window_samples = 1});
        (a * (1.0 + r)).sum().backward();
        (a * (2.0 + r) + b * 4.0 + e * 5.0).sum().backward();  // a: its second gradient
        d.mutable_grad().fill_(10.0 + 10.0 * r);
        reducer.mark_ready(3);                                         // d: by hand only
        e.mutable_grad() = torch::full({1}, 7.0 + r, torch::kDouble);  // e: replaced by hand after its hook
        reducer.mark_ready(4);
        const auto res = reducer.finish_window();
        REQUIRE(res.reduced);
        REQUIRE_FALSE(res.non_finite);
        // Means over the 2 ranks of each rank's sum (exact in float64):
        REQUIRE(a.grad().item<double>() == ((1.0 + 2.0) + (2.0 + 3.0)) / 2);  // 4
        REQUIRE(b.grad().item<double>() == 4.0);
        REQUIRE(c.grad().item<double>() == (3.0 + 4.0) / 2);
        REQUIRE(d.grad().item<double>() == (10.0 + 20.0) / 2);
        REQUIRE(e.grad().item<double>() == (7.0 + 8.0) / 2);
      }
    });
  }

  TEST_CASE("Average::world_size on 2 ranks: a gradient changed in place after its hook divided it is refused") {
    run_ranks(2, [](loom::GlooCommunicator& comm) {
      auto a = torch::tensor({1.0}, torch::kDouble).requires_grad_();
      auto b = torch::tensor({1.0}, torch::kDouble).requires_grad_();
      loom::Reducer reducer(comm, {.names = {"a", "b"}, .params = {a, b}}, {.average = loom::Average::world_size});
      REQUIRE(reducer.bucket_params().size() == 1);
      for (const bool by_hand : {true, false}) {  // refused by mark_ready, then by the next gradient
        a.mutable_grad() = torch::Tensor();
        b.mutable_grad() = torch::Tensor();
        reducer.prepare_backward({.sync = true, .window_samples = 1});
        (a * 3.0).sum().backward();
        REQUIRE(a.grad().item<double>() == 1.5);  // divided by the world size in its hook
        a.mutable_grad().add_(1.0);
        if (by_hand)
          REQUIRE_THROWS_WITH_AS(reducer.mark_ready(0),
                                 doctest::Contains("parameter 0 ('a')'s gradient was changed in place after autograd"),
                                 loom::InvalidArgument);
        else
          REQUIRE_THROWS_WITH_AS((a * 5.0).sum().backward(), doctest::Contains("divided by 2 then"),
                                 loom::InvalidArgument);
        (b * 1.0).sum().backward();
        reducer.finish_window();  // every rank closes the window the same way: no rank left waiting
      }
    });
  }

  TEST_CASE("Average::world_size on 2 ranks: gradients under the range bound that add up past it are still checked") {
    // Four gradients of 2^126 per rank: each divided by 2 stays under the bound ((largest float32) / 4,
    // a little under 2^126), the slot's sum 2^127 does not, and the ranks' sum 2^128 overflows float32.
    run_ranks(2, [](loom::GlooCommunicator& comm) {
      auto w = torch::zeros({4}, torch::kFloat).requires_grad_();
      auto v = torch::zeros({1}, torch::kFloat).requires_grad_();
      loom::Reducer reducer(comm, {.names = {"w", "v"}, .params = {w, v}}, {.average = loom::Average::world_size});
      REQUIRE(reducer.bucket_params().size() == 1);
      reducer.prepare_backward({.sync = true, .window_samples = 1});
      const float big = std::ldexp(1.0f, 126);
      for (int i = 0; i < 4; ++i) (w * big).sum().backward();
      (v * 1.0f).sum().backward();
      const auto res = reducer.finish_window();
      REQUIRE(res.non_finite);
      REQUIRE(torch::equal(w.grad(), torch::zeros({4})));  // a window with inf is zeroed
    });
  }

  TEST_CASE("module->to(torch::kDouble) after the reducer was built: every rank throws naming the parameter") {
    run_ranks(2, [](loom::GlooCommunicator& comm) {
      torch::manual_seed(1);
      auto net = torch::nn::Linear(3, 2);
      loom::Reducer reducer(comm, loom::parameters_of(*net));
      loom::Accumulator acc(reducer);
      REQUIRE(acc.run(2, [&] { net->forward(torch::ones({2, 3})).sum().backward(); }).apply);
      net->to(torch::kDouble);
      REQUIRE_THROWS_WITH_AS((void)acc.micro_batch(2), doctest::Contains("parameter 0 ('weight')"),
                             loom::InvalidArgument);
    });
  }

  TEST_CASE("float16 wire over 2 ranks across magnitudes: within the documented bound") {
    run_ranks(2, [](loom::GlooCommunicator& comm) {
      const int rank = comm.rank();
      // Rank r holds n_r = 24 + 40 r samples; element i's per-sample gradient is m_i on both ranks,
      // so the global mean is m_i and rank r's summed gradient is n_r m_i.
      const std::int64_t n = 24 + 40 * rank, total = 24 + 64;
      const auto mean = torch::pow(10.0, torch::linspace(-9, 2, 1101, torch::kDouble));
      auto w = torch::zeros({1101}).requires_grad_();
      loom::Reducer reducer(comm, {.names = {"w"}, .params = {w}}, {.wire_dtype = at::kHalf});
      reducer.prepare_backward({.sync = true, .window_samples = n});
      w.mutable_grad().copy_((mean * static_cast<double>(n)).to(torch::kFloat));
      reducer.mark_all_ready();
      REQUIRE_FALSE(reducer.finish_window().non_finite);
      const auto got = w.grad().to(torch::kDouble);
      const auto err = (got - mean).abs();
      // Bound (reducer.hpp, "Wire compression"): shares s_r = n_r m / 2 are rounded once each and
      // summed once in float16: |error| <= (2 / total) (3 * 2^-11 * (sum of |s_r|) + 3 * 2^-25), plus
      // float32's roundings of the input and the final multiply (2^-23 relative).
      const auto shares = mean * static_cast<double>(total) / 2.0;
      const auto bound =
          (2.0 / total) * (3 * std::ldexp(1.0, -11) * shares + 3 * std::ldexp(1.0, -25)) + mean * std::ldexp(1.0, -22);
      const auto over = err > bound;
      if (over.any().item<bool>()) {
        const auto i = over.nonzero()[0][0].item<std::int64_t>();
        throw std::runtime_error(fmt::format("m = {:.3g}: got {:.6g}, error {:.3g} > bound {:.3g}",
                                             mean[i].item<double>(), got[i].item<double>(), err[i].item<double>(),
                                             bound[i].item<double>()));
      }
      // Small gradients (mean >= 1e-6 per sample: shares of 1.2e-5 and 3.2e-5, float16 subnormals) within 1 %.
      const auto realistic = mean.ge(1e-6);
      REQUIRE(((err / mean).masked_select(realistic)).max().item<double>() < 0.01);
    });
  }

  TEST_CASE("loss_divisor: the same on 2 ranks is multiplied back; different divisors are an error on every rank") {
    run_ranks(2, [](loom::GlooCommunicator& comm) {
      const int rank = comm.rank();
      // Rank r: n_r = 1 + 2 r samples of gradient x = 3 + r each; global mean (1 * 3 + 3 * 4) / 4 = 3.75.
      const std::int64_t n = 1 + 2 * rank;
      const double x = 3.0 + rank;
      auto w = torch::zeros({2}, torch::kDouble).requires_grad_();
      loom::Reducer reducer(comm, {.names = {"w"}, .params = {w}});
      reducer.prepare_backward({.sync = true, .window_samples = n, .loss_divisor = 4});
      (w * (x * static_cast<double>(n) / 4.0)).sum().backward();  // the summed loss divided by 4
      const loom::Reduction r = reducer.finish_window();
      REQUIRE(r.global_samples == 4);
      REQUIRE(torch::equal(w.grad(), torch::full({2}, 3.75, torch::kDouble)));
      // Rank 0 divides by 2, rank 1 by 3: every rank throws, naming its own divisor; nothing is applied.
      w.mutable_grad().reset();
      reducer.prepare_backward({.sync = true, .window_samples = n, .loss_divisor = 2 + rank});
      (w * x).sum().backward();
      REQUIRE_THROWS_WITH_AS(
          reducer.finish_window(),
          doctest::Contains(fmt::format("this rank: {}; mean over the 2 ranks that gave one: 2.5", 2 + rank).c_str()),
          loom::InvalidArgument);
      REQUIRE(torch::equal(w.grad(), torch::zeros({2}, torch::kDouble)));
    });
  }

  TEST_CASE("loss_divisor with uneven ranks: a rank whose window is empty takes each step's divisor") {
    run_ranks(2, [](loom::GlooCommunicator& comm) {
      const int rank = comm.rank();
      // One micro-batch per step (K = 1). Step 1: rank 0 has 2 samples of gradient 1, rank 1 has 3
      // of gradient 2, both divide by 5 (mean 8 / 5). Step 2: only rank 0, 2 samples of gradient 1
      // divided by 2 (mean 1); rank 1 is in its end_epoch flush with an empty window.
      auto w = torch::zeros({1}, torch::kDouble).requires_grad_();
      loom::Reducer reducer(comm, {.names = {"w"}, .params = {w}});
      loom::Accumulator acc(reducer);
      std::vector<double> steps;
      auto micro_batch = [&](std::int64_t n, double x, std::int64_t d) {
        auto mb = acc.micro_batch(n, false, d);
        (w * (x * static_cast<double>(n) / static_cast<double>(d))).sum().backward();
        const loom::SyncResult s = mb.finish();
        if (s.boundary) steps.push_back(w.grad().item<double>());
        w.mutable_grad().reset();
      };
      if (rank == 0) {
        micro_batch(2, 1.0, 5);
        micro_batch(2, 1.0, 2);
      } else {
        micro_batch(3, 2.0, 5);
      }
      while (auto s = acc.end_epoch()) {
        steps.push_back(w.grad().item<double>());
        w.mutable_grad().reset();
      }
      REQUIRE(steps.size() == 2);
      REQUIRE(steps[0] == doctest::Approx(1.6).epsilon(1e-15));
      REQUIRE(steps[1] == doctest::Approx(1.0).epsilon(1e-15));
    });
  }

}  // TEST_SUITE
