// loom::Reducer + loom::Accumulator over real processes (Gloo on loopback): exactness against the
// float64 single-process reference, generators, join of uneven ranks, construction-time check and
// broadcast, frozen parameters, clipping, TorchScript twin, rebuild agreement, wire compression.
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>

#include <doctest/doctest.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/script.h>

#include <loom/accumulate/accumulator.hpp>
#include <loom/compat.hpp>
#include <loom/reduce/jit.hpp>
#include <loom/reduce/module.hpp>
#include <loom/reduce/reducer.hpp>

#include "reference/grad_reference.hpp"
#include "reference/reduce_reference.hpp"
#include "support/models.hpp"
#include "support/ranks.hpp"

namespace test_reduce_dist {

using loom::test::run_ranks;

TEST_SUITE("dist") {
  TEST_CASE("exactness: 3 ranks, micro-batches [2, 3, 5] / [4, 1] / [7] give the 22-sample mean gradient to 1e-9") {
    run_ranks(3, [](loom::GlooCommunicator& comm) {
      const int rank = comm.rank();
      const std::vector<std::vector<std::int64_t>> sizes = {{2, 3, 5}, {4, 1}, {7}};
      const std::vector<std::int64_t> first_sample = {0, 10, 15};
      // Each rank starts from different weights; the reducer broadcasts rank 0's.
      loom::test::Mlp model(at::kDouble, /*seed=*/static_cast<double>(rank));
      loom::test::Mlp rank0(at::kDouble, 0.0);
      loom::Reducer reducer(comm, model.list(), {.bucket_cap_bytes = 64, .first_bucket_cap_bytes = 16});
      for (std::size_t k = 0; k < model.params.size(); ++k) REQUIRE(torch::equal(model.params[k], rank0.params[k]));
      REQUIRE(reducer.bucket_params().size() >= 3);
      loom::Accumulator acc(reducer, {.micro_batches_per_step = 0});  // one step per epoch: the flush
      std::int64_t first = first_sample[static_cast<std::size_t>(rank)];
      for (std::int64_t n : sizes[static_cast<std::size_t>(rank)]) {
        auto step = acc.run(
            n, [&] { model.loss_sum(loom::test::batch_x(first, n), loom::test::batch_y(first, n)).backward(); });
        REQUIRE_FALSE(step.boundary);
        first += n;
      }
      int steps = 0;
      while (auto step = acc.end_epoch()) {
        ++steps;
        REQUIRE(step->apply);
        REQUIRE(step->global_samples == 22);
      }
      REQUIRE(steps == 1);
      const auto p64 = rank0.clone64();
      const auto ref =
          loom::test::mean_gradient(p64, 22, [&](std::int64_t i) { return loom::test::sample_loss(p64, i); });
      const double err = loom::test::max_relative_error(model.grads(), ref);
      REQUIRE(err < 1e-9);
      // The naive per-tensor reduction agrees (it sums the same reduced gradients again: x 3 / 3).
      const auto again = loom::test::per_tensor_average(comm, model.grads(), 3.0);
      REQUIRE(loom::test::max_relative_error(again, ref) < 1e-9);
      // The mean of the 6 micro-batch means is a different number.
      std::vector<at::Tensor> mean_of_means;
      std::int64_t s = 0;
      for (const auto& ranks : sizes)
        for (std::int64_t n : ranks) {
          auto g =
              loom::test::mean_gradient(p64, n, [&](std::int64_t i) { return loom::test::sample_loss(p64, s + i); });
          if (mean_of_means.empty())
            mean_of_means = g;
          else
            for (std::size_t k = 0; k < g.size(); ++k) mean_of_means[k] += g[k];
          s += n;
        }
      for (auto& t : mean_of_means) t /= 6.0;
      const double wrong = loom::test::max_relative_error(mean_of_means, ref);
      REQUIRE(wrong > 1e-2);
      if (rank == 0)
        std::printf("[exactness] relative error %.3g; mean of micro-batch means is off by %.3g\n", err, wrong);
    });
  }

  TEST_CASE(
      "generators: 4 generators on 2 ranks, 2 merged per micro-batch, match the single-process gradient of the same "
      "samples") {
    run_ranks(2, [](loom::GlooCommunicator& comm) {
      const int rank = comm.rank();
      // Generator g yields, at step t, (g + t) % 3 + 1 samples; sample j of it has index 1000 g + 10 t + j.
      auto generate = [](int g, int t) {
        std::vector<std::int64_t> idx;
        for (int j = 0; j < (g + t) % 3 + 1; ++j) idx.push_back(1000 * g + 10 * t + j);
        return idx;
      };
      auto rows = [](const std::vector<std::int64_t>& idx, bool y) {
        std::vector<at::Tensor> r;
        for (auto i : idx) r.push_back(y ? loom::test::sample_y(i) : loom::test::sample_x(i));
        return torch::stack(r);
      };
      loom::test::Mlp model;
      loom::Reducer reducer(comm, model.list());
      loom::Accumulator acc(reducer);  // K = 1: every merged micro-batch is a step
      torch::optim::SGD sgd(model.params, torch::optim::SGDOptions(0.1));
      auto ref_params = model.clone64();
      for (int t = 0; t < 3; ++t) {
        std::vector<std::int64_t> mine;
        for (int g : {2 * rank, 2 * rank + 1})
          for (auto i : generate(g, t)) mine.push_back(i);
        auto step = acc.run(static_cast<std::int64_t>(mine.size()),
                            [&] { model.loss_sum(rows(mine, false), rows(mine, true)).backward(); });
        REQUIRE(step.apply);
        std::vector<std::int64_t> all;
        for (int g = 0; g < 4; ++g)
          for (auto i : generate(g, t)) all.push_back(i);
        REQUIRE(step.global_samples == static_cast<std::int64_t>(all.size()));
        const auto ref = loom::test::mean_gradient(
            ref_params, static_cast<std::int64_t>(all.size()),
            [&](std::int64_t k) { return loom::test::sample_loss(ref_params, all[static_cast<std::size_t>(k)]); });
        REQUIRE(loom::test::max_relative_error(model.grads(), ref) < 1e-9);
        sgd.step();
        loom::zero_grad(sgd, loom::GradReset::zero);
        torch::NoGradGuard no_grad;
        for (std::size_t k = 0; k < ref.size(); ++k) ref_params[k].sub_(0.1 * ref[k]);
      }
      for (std::size_t k = 0; k < ref_params.size(); ++k)
        REQUIRE(torch::allclose(model.params[k], ref_params[k], 1e-12, 1e-12));
    });
  }

  TEST_CASE("join: rank 0 has 10 micro-batches, rank 1 has 7, K = 4: three identical steps on both, exact weights") {
    run_ranks(2, [](loom::GlooCommunicator& comm) {
      const int rank = comm.rank();
      // Micro-batch m of rank r: n = 1 + m % 3 samples, each with d loss / dw = x = r + 1 + m.
      auto n_of = [](int m) { return 1 + m % 3; };
      auto x_of = [](int r, int m) { return static_cast<double>(r + 1 + m); };
      auto w = torch::ones({1}, torch::kDouble).requires_grad_();
      loom::Reducer reducer(comm, {.names = {"w"}, .params = {w}});
      loom::Accumulator acc(reducer, {.micro_batches_per_step = 4});
      std::vector<double> got;
      std::vector<std::int64_t> counts;
      auto record = [&](const loom::SyncResult& s) {
        REQUIRE(s.apply);
        got.push_back(w.grad().item<double>());
        counts.push_back(s.global_samples);
        w.mutable_grad().zero_();
      };
      const int mine = rank == 0 ? 10 : 7;
      for (int m = 0; m < mine; ++m) {
        auto s =
            acc.run(n_of(m), [&] { (w * torch::full({n_of(m)}, x_of(rank, m), torch::kDouble)).sum().backward(); });
        if (s.boundary) record(s);
      }
      while (auto s = acc.end_epoch()) record(*s);
      // Expected: step 1 = both ranks' m 0..3; step 2 = rank 0's 4..7 + rank 1's remainder 4..6;
      // step 3 = rank 0's remainder 8..9 (rank 1 joins with zeros).
      auto window = [&](std::vector<std::pair<int, std::pair<int, int>>> parts) {
        double sum = 0, n = 0;
        for (auto [r, range] : parts)
          for (int m = range.first; m < range.second; ++m) {
            sum += n_of(m) * x_of(r, m);
            n += n_of(m);
          }
        return std::pair{sum / n, static_cast<std::int64_t>(n)};
      };
      const std::vector<std::pair<double, std::int64_t>> expect = {
          window({{0, {0, 4}}, {1, {0, 4}}}), window({{0, {4, 8}}, {1, {4, 7}}}), window({{0, {8, 10}}})};
      REQUIRE(got.size() == 3);
      for (std::size_t k = 0; k < 3; ++k) {
        REQUIRE(got[k] == doctest::Approx(expect[k].first).epsilon(1e-15));
        REQUIRE(counts[k] == expect[k].second);
      }
    });
  }

  TEST_CASE("construction: parameters that differ across ranks are a loom error naming the first mismatch") {
    run_ranks(2, [](loom::GlooCommunicator& comm) {
      const int rank = comm.rank();
      auto make = [&](std::vector<std::int64_t> b1_shape, bool extra, at::ScalarType w2_dtype) {
        loom::test::Mlp m;
        m.params[1] = torch::zeros(b1_shape, torch::kDouble).requires_grad_();
        m.params[2] = m.params[2].detach().to(w2_dtype).requires_grad_();
        auto list = m.list();
        if (extra) {
          list.params.push_back(torch::zeros({3}).requires_grad_());
          list.names.push_back("extra");
        }
        return list;
      };
      auto expect_error = [&](const loom::ParameterList& list, const std::string& text) {
        try {
          loom::Reducer reducer(comm, list);
        } catch (const loom::InvalidArgument& e) {
          const std::string what = e.what();
          if (what.find(text) == std::string::npos)
            throw std::runtime_error("rank " + std::to_string(rank) + ": message '" + what + "' lacks '" + text + "'");
          return;
        }
        throw std::runtime_error("no loom::InvalidArgument for: " + text);
      };
      expect_error(make({rank == 0 ? 5 : 6}, false, at::kDouble),
                   "parameter 1 ('b1') is Double [5] on rank 0 but Double [6] on rank 1");
      expect_error(make({5}, rank == 1, at::kDouble), "rank 0 has 4 parameters and 0 buffers, rank 1 has 5 and 0");
      expect_error(make({5}, false, rank == 0 ? at::kDouble : at::kFloat),
                   "parameter 2 ('w2') is Double [2, 5] on rank 0 but Float [2, 5] on rank 1");
      // Same everything: no error, and the communicator is still in step.
      loom::Reducer ok(comm, make({5}, false, at::kDouble));
      comm.barrier();
    });
  }

  TEST_CASE(
      "construction: rank 0's parameters and buffers are broadcast; frozen parameters agree but are not reduced") {
    run_ranks(2, [](loom::GlooCommunicator& comm) {
      const int rank = comm.rank();
      torch::manual_seed(100 + rank);  // different initial weights on each rank
      auto net = torch::nn::Sequential(torch::nn::Linear(3, 4), torch::nn::BatchNorm1d(4), torch::nn::Linear(4, 1));
      net->to(torch::kDouble);
      auto bn = net[1]->as<torch::nn::BatchNorm1d>();
      bn->running_mean.fill_(static_cast<double>(rank + 1));
      auto first = net[0]->as<torch::nn::Linear>();
      first->weight.set_requires_grad(false);  // frozen
      loom::Reducer reducer(comm, loom::parameters_of(*net));
      // Everything equals rank 0's now: compare against rank 0 through an all-gather.
      for (const auto& t : loom::parameters_of(*net).params) {
        auto copy = t.detach().contiguous();
        auto all = comm.all_gather(copy);
        REQUIRE(torch::equal(all[0], all[1]));
      }
      REQUIRE(torch::equal(bn->running_mean, torch::full({4}, 1.0, torch::kDouble)));
      for (const auto& bucket : reducer.bucket_params())
        for (std::size_t i : bucket) REQUIRE(i != 0);  // "0.weight" is frozen: in no bucket
      loom::Accumulator acc(reducer);
      auto x = loom::test::batch_x(4 * rank, 4);
      auto step = acc.run(4, [&] { net->forward(x).sum().backward(); });
      REQUIRE(step.apply);
      REQUIRE_FALSE(first->weight.grad().defined());
      auto g = first->bias.grad().detach().contiguous();
      auto all = comm.all_gather(g);
      REQUIRE(torch::equal(all[0], all[1]));
    });
  }

  TEST_CASE("clipping: the global norm over 2 ranks equals the single-process clip of the full-batch gradient") {
    run_ranks(2, [](loom::GlooCommunicator& comm) {
      const int rank = comm.rank();
      loom::test::Mlp model;
      loom::Reducer reducer(comm, model.list(),
                            {.bucket_cap_bytes = 64, .first_bucket_cap_bytes = 16, .max_grad_norm = 0.25});
      loom::Accumulator acc(reducer, {.micro_batches_per_step = 2});
      // rank 0: samples 0..2 and 3..6; rank 1: samples 7..7 and 8..12.
      const std::vector<std::pair<std::int64_t, std::int64_t>> mbs =
          rank == 0 ? std::vector<std::pair<std::int64_t, std::int64_t>>{{0, 3}, {3, 4}}
                    : std::vector<std::pair<std::int64_t, std::int64_t>>{{7, 1}, {8, 5}};
      loom::SyncResult step;
      for (auto [f, n] : mbs)
        step = acc.run(n, [&] { model.loss_sum(loom::test::batch_x(f, n), loom::test::batch_y(f, n)).backward(); });
      REQUIRE(step.apply);
      REQUIRE(step.global_samples == 13);
      auto p64 = model.clone64();
      auto ref = loom::test::mean_gradient(p64, 13, [&](std::int64_t i) { return loom::test::sample_loss(p64, i); });
      REQUIRE(step.grad_norm == doctest::Approx(loom::test::global_norm(ref)).epsilon(1e-12));
      REQUIRE(step.clip_coef < 1.0);
      for (std::size_t k = 0; k < p64.size(); ++k) p64[k].mutable_grad() = ref[k].clone();
      torch::nn::utils::clip_grad_norm_(p64, 0.25);
      std::vector<at::Tensor> clipped;
      for (const auto& p : p64) clipped.push_back(p.grad());
      REQUIRE(loom::test::max_relative_error(model.grads(), clipped) < 1e-12);
    });
  }

  TEST_CASE("TorchScript: a module defined in C++, saved and loaded, gets the same gradients as its nn::Module twin") {
    const auto path = std::filesystem::temp_directory_path() / fmt::format("loom_twin_{}.pt", ::getpid());
    {
      torch::manual_seed(7);
      auto l1 = torch::nn::Linear(3, 5), l2 = torch::nn::Linear(5, 2);
      torch::jit::Module m("Twin");
      m.register_parameter("w1", l1->weight.detach().clone().requires_grad_(), false);
      m.register_parameter("b1", l1->bias.detach().clone().requires_grad_(), false);
      m.register_parameter("w2", l2->weight.detach().clone().requires_grad_(), false);
      m.register_parameter("b2", l2->bias.detach().clone().requires_grad_(), false);
      m.define(R"(
def forward(self, x, y):
    h = torch.tanh(x.matmul(self.w1.t()) + self.b1)
    out = h.matmul(self.w2.t()) + self.b2
    return (out - y).pow(2).sum()
)");
      m.save(path.string());
    }
    run_ranks(2, [&](loom::GlooCommunicator& comm) {
      const int rank = comm.rank();
      auto twin = torch::nn::Sequential(torch::nn::Linear(3, 5), torch::nn::Tanh(), torch::nn::Linear(5, 2));
      auto script = torch::jit::load(path.string());
      script.train();
      {  // the twin gets the script module's weights
        torch::NoGradGuard no_grad;
        auto pn = loom::parameters_of(*twin).params;
        auto pj = loom::parameters_of(script).params;
        for (std::size_t k = 0; k < pn.size(); ++k) pn[k].copy_(pj[k]);
      }
      loom::Reducer r_nn(comm, loom::parameters_of(*twin));
      loom::Reducer r_js(comm, loom::parameters_of(script));
      loom::Accumulator a_nn(r_nn), a_js(r_js);
      const std::int64_t n = 3 + rank, first = 10 * rank;
      auto x = loom::test::batch_x(first, n, at::kFloat), y = loom::test::batch_y(first, n, at::kFloat);
      REQUIRE(a_nn.run(n, [&] { (twin->forward(x) - y).pow(2).sum().backward(); }).apply);
      REQUIRE(a_js.run(n, [&] { script.forward({x, y}).toTensor().backward(); }).apply);
      auto pn = loom::parameters_of(*twin).params;
      auto pj = loom::parameters_of(script).params;
      REQUIRE(pn.size() == pj.size());
      for (std::size_t k = 0; k < pn.size(); ++k) {
        REQUIRE(pj[k].grad().defined());
        REQUIRE(torch::allclose(pn[k].grad(), pj[k].grad(), 1e-5, 1e-7));
      }
    });
    std::filesystem::remove(path);
  }

  TEST_CASE("rebuild: ranks with different gradient-ready orders adopt rank 0's order and stay exact") {
    run_ranks(2, [](loom::GlooCommunicator& comm) {
      const int rank = comm.rank();
      std::vector<at::Tensor> p;
      for (int k = 0; k < 4; ++k) p.push_back(torch::full({3}, 1.0 + k, torch::kDouble).requires_grad_());
      loom::Reducer reducer(comm, {.names = {"p0", "p1", "p2", "p3"}, .params = p},
                            {.bucket_cap_bytes = 1, .first_bucket_cap_bytes = 1});
      loom::Accumulator acc(reducer);
      // Independent terms: the engine runs the newest node first, so the ready order is the reverse
      // of the order the terms were built in; rank 1 builds them in the opposite order.
      auto loss = [&](double scale) {
        std::vector<int> order = rank == 0 ? std::vector<int>{0, 2, 1, 3} : std::vector<int>{3, 1, 2, 0};
        at::Tensor total;
        for (int k : order) {
          auto term = (p[static_cast<std::size_t>(k)] * (scale * (k + 1))).sum();
          total = total.defined() ? total + term : term;
        }
        return total;
      };
      REQUIRE(acc.run(1, [&] { loss(1.0).backward(); }).apply);
      for (auto& t : p) t.mutable_grad().zero_();
      auto step = acc.run(1, [&] { loss(2.0).backward(); });  // the rebuild happens as this window opens
      REQUIRE(step.apply);
      REQUIRE(reducer.rebuilt());
      auto layout = reducer.bucket_params();
      std::vector<std::int64_t> flat;
      for (const auto& b : layout) flat.insert(flat.end(), b.begin(), b.end());
      auto mine = torch::tensor(flat, torch::kLong);
      auto all = comm.all_gather(mine);
      REQUIRE(torch::equal(all[0], all[1]));
      REQUIRE_FALSE(torch::equal(
          all[0], torch::tensor(std::vector<std::int64_t>{3, 2, 1, 0}, torch::kLong)));  // not the initial order
      for (int k = 0; k < 4; ++k)
        REQUIRE(torch::equal(p[static_cast<std::size_t>(k)].grad(), torch::full({3}, 2.0 * (k + 1), torch::kDouble)));
      if (rank == 0)
        std::printf("[rebuild] launch order after the first step: %s\n",
                    fmt::format("{}", fmt::join(flat, " ")).c_str());
    });
  }

  TEST_CASE("wire compression over 2 ranks: float16 / bfloat16 error against the float32 reduction") {
    run_ranks(2, [](loom::GlooCommunicator& comm) {
      const int rank = comm.rank();
      // Same signs on both ranks (no cancellation), magnitudes in [e^-4, 1]. Bound: three roundings
      // to the wire dtype (each rank's cast, and the sum).
      const auto mag = torch::linspace(-4, 0, 8192, torch::kDouble).exp();
      const auto sign = torch::linspace(0, 60, 8192, torch::kDouble).sin().ge(0).to(torch::kDouble).mul(2).sub(1);
      const auto values = (mag * sign * (1.0 + 0.37 * rank)).to(torch::kFloat);
      for (auto [dtype, bound] :
           {std::pair{at::kHalf, 3 * std::ldexp(1.0, -11)}, std::pair{at::kBFloat16, 3 * std::ldexp(1.0, -8)}}) {
        auto exact = torch::zeros({8192}).requires_grad_();
        auto packed = torch::zeros({8192}).requires_grad_();
        loom::Reducer plain(comm, {.params = {exact}}, {.average = loom::Average::world_size});
        loom::Reducer wire(comm, {.params = {packed}}, {.average = loom::Average::world_size, .wire_dtype = dtype});
        plain.prepare_backward({.sync = true, .window_samples = 1});
        wire.prepare_backward({.sync = true, .window_samples = 1});
        exact.mutable_grad().copy_(values);
        packed.mutable_grad().copy_(values);
        plain.mark_all_ready();
        wire.mark_all_ready();
        plain.finish_window();
        wire.finish_window();
        auto e = exact.grad().to(torch::kDouble), c = packed.grad().to(torch::kDouble);
        const double worst = ((c - e).abs() / e.abs()).max().item<double>();
        const double mean = ((c - e).abs() / e.abs()).mean().item<double>();
        if (rank == 0)
          std::printf("[wire] %s: max relative error %.3g, mean %.3g (bound %.3g)\n", c10::toString(dtype), worst, mean,
                      bound);
        REQUIRE(worst > 0);
        REQUIRE(worst <= bound);
      }
    });
  }

  TEST_CASE(
      "average by world size on 2 and 4 ranks (divided before the all-reduce): the bits of the sum divided after it; "
      "a sum beyond float32's range whose mean is finite is averaged; inf/NaN on one rank is reported on every rank") {
    for (int world : {2, 4}) {
      run_ranks(world, [world](loom::GlooCommunicator& comm) {
        const int rank = comm.rank();
        constexpr std::int64_t n = 300001;  // several of the loop's blocks, and a tail
        // Rank r's gradient for window kind `k`, the same function on every rank (so each rank can
        // compute the reference from all ranks' gradients).
        auto gradient = [](int r, int k) {
          torch::manual_seed(1000 * k + r);
          if (k == 0) return torch::randn({n});  // any float32: for 2 ranks (a + b) / 2 has one rounding
          if (k == 1)
            return torch::randint(-1024, 1024, {n}).to(torch::kFloat).mul(std::ldexp(1.0, -10));  // exact sums
          return torch::full({n}, 1.5f * std::ldexp(1.0f, 127));  // the sum of 2 or 4 overflows, the mean is finite
        };
        auto w = torch::zeros({n}).requires_grad_();
        loom::Reducer reducer(comm, {.params = {w}}, {.average = loom::Average::world_size});
        for (int k = 0; k < 3; ++k) {
          if (k == 0 && world != 2) continue;
          reducer.prepare_backward({.sync = true, .window_samples = 1});
          (w * gradient(rank, k)).sum().backward();
          const loom::Reduction r = reducer.finish_window();
          REQUIRE_FALSE(r.non_finite);
          // The reference: the ranks' sum in float64 (exact for k = 1 and 2; for k = 0 on 2 ranks
          // a + b rounded once to float32, as Gloo's float32 sum does), then divided.
          at::Tensor sum = torch::zeros({n}, torch::kDouble);
          for (int q = 0; q < world; ++q) sum += gradient(q, k).to(torch::kDouble);
          const at::Tensor want = k == 0 ? (gradient(0, 0) + gradient(1, 0)) / 2 : (sum / world).to(torch::kFloat);
          REQUIRE(torch::equal(w.grad(), want));
          w.mutable_grad().zero_();
        }
        // inf on the last rank and NaN on rank 0 in other windows: every rank skips, gradient zero.
        for (float bad : {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
          reducer.prepare_backward({.sync = true, .window_samples = 1});
          auto g = torch::ones({n});
          if (rank == (std::isnan(bad) ? 0 : world - 1)) g[n - 1] = bad;
          (w * g).sum().backward();
          const loom::Reduction r = reducer.finish_window();
          REQUIRE(r.non_finite);
          REQUIRE(torch::equal(w.grad(), torch::zeros({n})));
        }
      });
    }
  }

}  // TEST_SUITE

}  // namespace test_reduce_dist
