// The reducer's rules on real ranks (Gloo on loopback): buffers broadcast at every step, a
// gradient arriving twice, the parameter set changed by module->to(dtype), the float16 wire, the
// loss divisor (equal, different, and taken by a rank whose window is empty).
#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include <doctest/doctest.h>
#include <fmt/format.h>
#include <torch/torch.h>

#include <loom/accumulate/accumulator.hpp>
#include <loom/comm/local.hpp>
#include <loom/compat.hpp>
#include <loom/reduce/module.hpp>
#include <loom/reduce/reducer.hpp>

#include "reference/grad_reference.hpp"
#include "support/models.hpp"
#include "support/ranks.hpp"
#include "support/stderr_capture.hpp"

namespace test_rules_dist {

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

  TEST_CASE("options that differ across ranks (deterministic on one rank only): an error on every rank naming it") {
    struct Case {
      loom::ReducerOptions rank1;
      const char* expected;
    };
    const Case cases[] = {
        {{.deterministic = true}, "deterministic is true on rank 1 but false on rank 0"},
        {{.wire_dtype = at::kBFloat16}, "wire_dtype is BFloat16 on rank 1 but unset on rank 0"},
        {{.max_grad_norm = 1.5}, "max_grad_norm is 1.5 on rank 1 but unset on rank 0"},
        {{.bucket_cap_bytes = 1024}, "bucket_cap_bytes is 1024 on rank 1 but 26214400 on rank 0"},
    };
    for (const Case& c : cases) {
      const std::string expected = c.expected;
      CAPTURE(expected);
      run_ranks(2, [&](loom::GlooCommunicator& comm) {
        auto w = torch::zeros({3}, torch::kFloat).requires_grad_();
        const loom::ReducerOptions options = comm.rank() == 1 ? c.rank1 : loom::ReducerOptions{};
        REQUIRE_THROWS_WITH_AS(loom::Reducer(comm, {.names = {"w"}, .params = {w}}, options),
                               doctest::Contains(expected.c_str()), loom::InvalidArgument);
      });
    }
    // overlap only moves when buckets leave: ranks may differ in it and still reduce alike.
    run_ranks(2, [](loom::GlooCommunicator& comm) {
      auto w = torch::zeros({2}, torch::kDouble).requires_grad_();
      loom::Reducer reducer(comm, {.names = {"w"}, .params = {w}}, {.overlap = comm.rank() == 0});
      reducer.prepare_backward({.sync = true, .window_samples = 1});
      (w * torch::tensor({1.0, 2.0}, torch::kDouble) * (comm.rank() + 1)).sum().backward();
      REQUIRE_FALSE(reducer.finish_window().non_finite);
      CHECK(w.grad()[0].item<double>() == 1.5);  // (1 + 2) / 2 samples
      CHECK(w.grad()[1].item<double>() == 3.0);
    });
  }

  TEST_CASE("deterministic mode in a process of 2 intra-op threads warns once, naming the count; 1 thread: silent") {
    for (int threads : {2, 1}) {
      CAPTURE(threads);
      loom::spawn(
          1,
          [threads](const loom::Environment&) {
            loom::test::StderrCapture capture;
            loom::LocalCommunicator comm;
            auto w = torch::zeros({2}, torch::kDouble).requires_grad_();
            loom::Reducer reducer(comm, {.names = {"w"}, .params = {w}}, {.deterministic = true});
            loom::Reducer again(comm, {.names = {"v"}, .params = {torch::zeros({1}).requires_grad_()}},
                                {.deterministic = true});
            const std::string text = capture.finish();
            const std::string line =
                "loom: warning: rank 0: ReducerOptions::deterministic promises the same bits on any world size only "
                "with one intra-op thread per rank, and this process runs 2 (at::get_num_threads())";
            const std::size_t at = text.find(line);
            if (threads == 2 && (at == std::string::npos || text.find(line, at + 1) != std::string::npos))
              throw std::runtime_error("expected the warning once, got: " + text);
            if (threads == 1 && text.find("loom: warning") != std::string::npos)
              throw std::runtime_error("expected no warning, got: " + text);
          },
          {.timeout = std::chrono::seconds(60), .threads_per_rank = threads});
    }
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

}  // namespace test_rules_dist
