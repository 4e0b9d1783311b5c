// loom::Accumulator over real processes (Gloo on loopback): multi-rank field cases with their
// numbers worked by hand — the synchronising micro-batch, uneven inputs, ranks without samples,
// unused parameters, loss scaling with a non-finite gradient on one rank.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include <doctest/doctest.h>
#include <torch/torch.h>

#include <loom/accumulate/accumulator.hpp>
#include <loom/compat.hpp>
#include <loom/reduce/reducer.hpp>

#include "support/ranks.hpp"

using loom::test::run_ranks;

TEST_SUITE("dist") {
  TEST_CASE(
      "field: K = 2, gradients rank 0 [1, 2], rank 1 [3, 5]: synchronise on the last micro-batch -> 5.5 on both") {
    run_ranks(2, [](loom::GlooCommunicator& comm) {
      const int rank = comm.rank();
      auto w = torch::ones({1}, torch::kDouble).requires_grad_();
      loom::Reducer reducer(comm, {.names = {"w"}, .params = {w}}, {.average = loom::Average::world_size});
      loom::Accumulator acc(reducer, {.micro_batches_per_step = 2});
      const std::vector<double> g = rank == 0 ? std::vector<double>{1, 2} : std::vector<double>{3, 5};
      auto first = acc.run(1, [&] { (w * g[0]).sum().backward(); });
      REQUIRE_FALSE(first.boundary);
      REQUIRE(w.grad().item<double>() == g[0]);  // nothing sent yet: the local value (4.0 / 7.0 would be the bug's)
      auto second = acc.run(1, [&] { (w * g[1]).sum().backward(); });
      REQUIRE(second.apply);
      REQUIRE(w.grad().item<double>() == 5.5);  // (1 + 2 + 3 + 5) / 2
    });
  }

  TEST_CASE("field: uneven inputs, 7 samples of gradient 2 and 6 of gradient 1 -> 20/13 on both (DDP's 1.5 shown)") {
    run_ranks(2, [](loom::GlooCommunicator& comm) {
      const int rank = comm.rank();
      const std::int64_t n = rank == 0 ? 7 : 6;
      const double per_sample = rank == 0 ? 2.0 : 1.0;
      {
        auto w = torch::ones({1}, torch::kDouble).requires_grad_();
        loom::Reducer reducer(comm, {.names = {"w"}, .params = {w}});
        loom::Accumulator acc(reducer);
        auto step = acc.run(n, [&] { (w * torch::full({n}, per_sample, torch::kDouble)).sum().backward(); });
        REQUIRE(step.global_samples == 13);
        REQUIRE(w.grad().item<double>() == doctest::Approx(20.0 / 13.0).epsilon(1e-15));
        REQUIRE(std::abs(w.grad().item<double>() - 1.5384615) < 1e-7);
      }
      {  // DDP's convention: local means averaged over ranks.
        auto w = torch::ones({1}, torch::kDouble).requires_grad_();
        loom::Reducer reducer(comm, {.names = {"w"}, .params = {w}}, {.average = loom::Average::world_size});
        loom::Accumulator acc(reducer);
        acc.run(n, [&] { (w * torch::full({n}, per_sample, torch::kDouble)).mean().backward(); });
        REQUIRE(w.grad().item<double>() == doctest::Approx(1.5).epsilon(1e-15));  // (2 + 1) / 2
      }
    });
  }

  TEST_CASE("field: 10 samples over 4 ranks, micro-batch 4 (4, 4, 2, 0): no NaN, no hang, the mean over the 10") {
    run_ranks(4, [](loom::GlooCommunicator& comm) {
      const int rank = comm.rank();
      // Sample i (0..9) has d loss / dw = i + 1: the mean is 5.5. Contiguous shards of 4.
      const std::int64_t first = std::min<std::int64_t>(4 * rank, 10), n = std::min<std::int64_t>(4, 10 - first);
      auto w = torch::ones({1}, torch::kDouble).requires_grad_();
      loom::Reducer reducer(comm, {.names = {"w"}, .params = {w}});
      loom::Accumulator acc(reducer);
      auto xs = torch::arange(first + 1, first + n + 1, torch::kDouble);
      // Epoch 1: the empty rank still runs a (0-sample) micro-batch.
      auto step = acc.run(n, [&] { (w * xs).sum().backward(); });
      REQUIRE(step.apply);
      REQUIRE(step.global_samples == 10);
      REQUIRE(w.grad().item<double>() == 5.5);
      REQUIRE_FALSE(acc.end_epoch().has_value());
      w.mutable_grad().zero_();
      // Epoch 2: the empty rank runs no micro-batch at all; it joins from end_epoch().
      int steps = 0;
      if (n > 0) {
        auto s = acc.run(n, [&] { (w * xs).sum().backward(); });
        REQUIRE(s.apply);
        ++steps;
      }
      while (auto s = acc.end_epoch()) {
        REQUIRE(s->apply);
        ++steps;
      }
      REQUIRE(steps == 1);
      REQUIRE(w.grad().item<double>() == 5.5);
      REQUIRE_FALSE(torch::isnan(w.grad()).any().item<bool>());
    });
  }

  TEST_CASE("field: unused parameters a, b, c on 2 ranks -> 3, 3, and c untouched (undefined stays, stale 7 stays)") {
    run_ranks(2, [](loom::GlooCommunicator& comm) {
      const int rank = comm.rank();
      auto a = torch::ones({1}, torch::kDouble).requires_grad_();
      auto b = torch::ones({1}, torch::kDouble).requires_grad_();
      auto c = torch::ones({1}, torch::kDouble).requires_grad_();
      loom::Reducer reducer(comm, {.names = {"a", "b", "c"}, .params = {a, b, c}});
      loom::Accumulator acc(reducer);
      auto loss = [&] {
        auto l = a * (rank == 0 ? 2.0 : 4.0);  // a: local gradients 2 and 4
        if (rank == 0) l = l + b * 6.0;        // b: used on rank 0 only
        return l.sum();                        // c: used nowhere
      };
      auto step = acc.run(1, [&] { loss().backward(); });
      REQUIRE(step.apply);
      REQUIRE(a.grad().item<double>() == 3.0);
      REQUIRE(b.grad().defined());  // on rank 1 too
      REQUIRE(b.grad().item<double>() == 3.0);
      REQUIRE_FALSE(c.grad().defined());
      torch::optim::SGD sgd({a, b, c}, torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(0.01));
      sgd.step();
      REQUIRE(c.item<double>() == 1.0);
      REQUIRE(a.item<double>() != 1.0);
      // A stale gradient of c stays as it was.
      loom::zero_grad(sgd, loom::GradReset::zero);
      c.mutable_grad() = torch::full({1}, 7.0, torch::kDouble);
      auto again = acc.run(1, [&] { loss().backward(); });
      REQUIRE(again.apply);
      REQUIRE(a.grad().item<double>() == 3.0);
      REQUIRE(b.grad().item<double>() == 3.0);
      REQUIRE(c.grad().item<double>() == 7.0);
    });
  }

  TEST_CASE(
      "field: loss scale 1024 on 2 ranks -> [0.6, 0.8]; inf on one rank skips every rank and halves the scale once") {
    run_ranks(2, [](loom::GlooCommunicator& comm) {
      const int rank = comm.rank();
      auto w = torch::zeros({2}).requires_grad_();
      loom::Reducer reducer(comm, {.names = {"w"}, .params = {w}},
                            {.average = loom::Average::world_size, .max_grad_norm = 1.0});
      loom::Accumulator acc(reducer,
                            {.micro_batches_per_step = 2, .loss_scaling = loom::LossScalerOptions{.init_scale = 1024}});
      torch::optim::SGD sgd({w}, torch::optim::SGDOptions(0.5));
      auto window = [&](const at::Tensor& second) {
        acc.run(1, [&](auto& mb) { mb.scale((w * torch::tensor({1.5f, 0.0f})).sum()).backward(); });
        return acc.run(1, [&](auto& mb) { mb.scale((w * second).sum()).backward(); });
      };
      auto ok = window(torch::tensor({1.5f, 4.0f}));
      REQUIRE(ok.apply);
      REQUIRE(std::abs(w.grad()[0].item<double>() - 0.6) < 1e-6);
      REQUIRE(std::abs(w.grad()[1].item<double>() - 0.8) < 1e-6);
      sgd.step();
      loom::zero_grad(sgd, loom::GradReset::zero);
      const auto before = w.detach().clone();
      auto second =
          rank == 1 ? torch::tensor({1.5f, std::numeric_limits<float>::infinity()}) : torch::tensor({1.5f, 4.0f});
      auto bad = window(second);
      REQUIRE(bad.skipped_non_finite);  // on rank 0 too, whose gradients were finite
      REQUIRE_FALSE(bad.apply);
      if (bad) sgd.step();
      REQUIRE(torch::equal(w.detach(), before));
      REQUIRE(torch::equal(w.grad(), torch::zeros({2})));
      REQUIRE(acc.loss_scale() == 512.0);
      auto after = window(torch::tensor({1.5f, 4.0f}));
      REQUIRE(after.apply);
      REQUIRE(std::abs(w.grad()[1].item<double>() - 0.8) < 1e-6);
      REQUIRE(acc.loss_scale() == 512.0);
    });
  }

}  // TEST_SUITE
