// loom::Trainer, BatchLoader, Metrics and run() in one process: the short path equals the
// hand-written low-level loop bit for bit, and each protocol step a loop could forget is a loom
// error naming it (or does not compile). Multi-rank twins: test_trainer_dist.cpp.
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <iterator>
#include <memory>
#include <optional>
#include <ranges>
#include <stdexcept>
#include <string>

#include <doctest/doctest.h>
#include <torch/torch.h>

#include <loom/comm/local.hpp>
#include <loom/dist/run.hpp>
#include <loom/log/named_metrics.hpp>

#include "support/stderr_capture.hpp"
#include "trainer_fixture.hpp"

namespace test_trainer {

namespace {

bool equal_lists(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t k = 0; k < a.size(); ++k)
    if (!torch::equal(a[k], b[k])) return false;
  return true;
}

struct Setup {
  loom::LocalCommunicator comm;
  loom::test::Mlp model{at::kDouble};
  torch::optim::SGD sgd{model.params, torch::optim::SGDOptions(0.05)};
  loom::BatchLoader<decltype(loom::test::trainer_fetch())> loader{
      comm, loom::test::trainer_shapes(), loom::test::trainer_fetch(), loom::test::kTrainerPlan};
  loom::Trainer<loom::LocalCommunicator, torch::optim::SGD> trainer{comm, model.list(), sgd};
  at::Tensor loss(const loom::Batch& b) const { return loom::test::mean_loss(model, b); }
};

using Loader = loom::BatchLoader<decltype(loom::test::trainer_fetch())>;

}  // namespace

TEST_CASE("Trainer: the short path's parameters equal the hand-written low-level loop's, bit for bit") {
  loom::LocalCommunicator comm;
  const auto short_path = loom::test::train_short(comm, 3);
  const auto by_hand = loom::test::train_by_hand(comm, 3);
  CHECK(equal_lists(short_path, by_hand));
  // And training moved them.
  loom::test::Mlp untouched(at::kDouble);
  CHECK_FALSE(torch::equal(short_path[0], untouched.params[0]));
}

TEST_CASE("Trainer: one epoch runs every planned batch once and steps once per planned step") {
  Setup s;
  int64_t batches = 0, samples = 0;
  for (loom::Batch& b : s.trainer.epoch(s.loader, 0)) {
    s.trainer.backward(s.loss(b), b);
    ++batches;
    samples += b.num_samples;
  }
  const auto& plan = s.loader.sampler().plan();
  CHECK(batches == static_cast<int64_t>(plan.batches.size()));
  CHECK(samples == loom::test::kTrainerSamples);
  CHECK(s.trainer.steps() == static_cast<int64_t>(plan.steps.size()));
}

TEST_CASE("Trainer: every forgotten or misplaced protocol step is a loom error naming it") {
  SUBCASE("a batch never passed to backward") {
    Setup s;
    auto run = [&] {
      int k = 0;
      for (loom::Batch& b : s.trainer.epoch(s.loader, 0))
        if (k++ != 1) s.trainer.backward(s.loss(b), b);  // batch 1 forgotten
    };
    CHECK_THROWS_WITH_AS(run(), doctest::Contains("was never passed to trainer.backward"), loom::Error);
  }
  SUBCASE("the last batch never passed to backward: caught when the loop ends") {
    Setup s;
    auto run = [&] {
      auto range = s.trainer.epoch(s.loader, 0);
      const auto total = static_cast<int64_t>(s.loader.sampler().plan().batches.size());
      int64_t k = 0;
      for (loom::Batch& b : range)
        if (++k < total) s.trainer.backward(s.loss(b), b);
    };
    CHECK_THROWS_WITH_AS(run(), doctest::Contains("was never passed to trainer.backward"), loom::Error);
  }
  SUBCASE("loss.backward() by hand instead of trainer.backward") {
    Setup s;
    auto run = [&] {
      int k = 0;
      for (loom::Batch& b : s.trainer.epoch(s.loader, 0)) {
        if (k++ == 2)
          s.loss(b).backward();
        else
          s.trainer.backward(s.loss(b), b);
      }
    };
    CHECK_THROWS_WITH_AS(run(), doctest::Contains("a backward ran outside trainer.backward"), loom::Error);
  }
  SUBCASE("loss.backward() by hand as well as trainer.backward") {
    Setup s;
    auto run = [&] {
      for (loom::Batch& b : s.trainer.epoch(s.loader, 0)) {
        auto loss = s.loss(b);
        s.trainer.backward(loss, b);
        s.loss(b).backward();
      }
    };
    CHECK_THROWS_WITH_AS(run(), doctest::Contains("a backward ran outside trainer.backward"), loom::Error);
  }
  SUBCASE("backward twice for one batch") {
    Setup s;
    auto run = [&] {
      for (loom::Batch& b : s.trainer.epoch(s.loader, 0)) {
        s.trainer.backward(s.loss(b), b);
        s.trainer.backward(s.loss(b), b);
      }
    };
    CHECK_THROWS_WITH_AS(run(), doctest::Contains("called twice"), loom::Error);
  }
  SUBCASE("backward for a batch the loop did not yield") {
    Setup s;
    auto run = [&] {
      for (loom::Batch& b : s.trainer.epoch(s.loader, 0)) {
        loom::Batch other = b;
        other.data = b.data.clone();
        s.trainer.backward(s.loss(other), other);
      }
    };
    CHECK_THROWS_WITH_AS(run(), doctest::Contains("not the one the epoch loop just yielded"), loom::Error);
  }
  SUBCASE("a break inside a step is an error at the break; the Trainer refuses further use") {
    Setup s;
    auto run = [&] {
      for (loom::Batch& b : s.trainer.epoch(s.loader, 0)) {
        s.trainer.backward(s.loss(b), b);
        break;  // the first step has 2 batches: the window is open
      }
    };
    CHECK_THROWS_WITH_AS(
        run(), doctest::Contains("was left before the epoch's end (a break or return after batch 1 of step 0)"),
        loom::Error);
    CHECK(s.trainer.steps() == 0);
    CHECK_THROWS_WITH_AS((void)s.trainer.epoch(s.loader, 1), doctest::Contains("refuses further use"), loom::Error);
  }
  SUBCASE("a break right after a step boundary is an error too (ranks see different boundaries), naming stop()") {
    Setup s;
    auto run = [&] {
      for (loom::Batch& b : s.trainer.epoch(s.loader, 0))
        if (s.trainer.backward(s.loss(b), b).boundary) break;
    };
    CHECK_THROWS_WITH_AS(run(), doctest::Contains("call trainer.stop() from on_step()"), loom::Error);
    CHECK(s.trainer.steps() == 1);  // the step before the break was applied; the leaving window was not
  }
  SUBCASE("a return from inside the loop is the same error") {
    Setup s;
    auto run = [&]() -> int {
      for (loom::Batch& b : s.trainer.epoch(s.loader, 0)) {
        s.trainer.backward(s.loss(b), b);
        return 1;
      }
      return 0;
    };
    CHECK_THROWS_WITH_AS((void)run(), doctest::Contains("was left before the epoch's end"), loom::Error);
  }
  SUBCASE("an exception out of the loop body is not turned into the leaving error") {
    Setup s;
    auto run = [&] {
      for (loom::Batch& b : s.trainer.epoch(s.loader, 0)) {
        s.trainer.backward(s.loss(b), b);
        throw std::runtime_error("user error");
      }
    };
    CHECK_THROWS_WITH_AS(run(), "user error", std::runtime_error);
    // The step it left open never closes: the Trainer refuses to go on with its partial gradients.
    CHECK_THROWS_WITH_AS((void)s.trainer.epoch(s.loader, 1),
                         doctest::Contains("an exception left the loop over epoch 0 inside step 0"), loom::Error);
  }
  SUBCASE("stop() from the loop body (it would stop this rank alone)") {
    Setup s;
    auto run = [&] {
      for (loom::Batch& b : s.trainer.epoch(s.loader, 0)) {
        s.trainer.backward(s.loss(b), b);
        s.trainer.stop();
      }
    };
    CHECK_THROWS_WITH_AS(run(), doctest::Contains("call it from on_step()"), loom::Error);
  }
  SUBCASE("a loss of the wrong kind") {
    Setup s;
    for (loom::Batch& b : s.trainer.epoch(s.loader, 0)) {
      auto per_sample = (s.model.forward(b.data.mean(1)) - b.targets).pow(2);  // N x 2: reduction none
      CHECK_THROWS_WITH_AS(s.trainer.backward(per_sample, b), doctest::Contains("pass one number per batch"),
                           loom::InvalidArgument);
      CHECK_THROWS_WITH_AS(s.trainer.backward(s.loss(b).detach(), b), doctest::Contains("does not require grad"),
                           loom::InvalidArgument);
      s.trainer.backward(s.loss(b), b);
    }
  }
  SUBCASE("a loader is not a range: the epoch loop must go through trainer.epoch (compile-time)") {
    static_assert(!std::ranges::range<Loader>);
    static_assert(
        std::ranges::input_range<loom::EpochRange<loom::Trainer<loom::LocalCommunicator, torch::optim::SGD>, Loader>>);
    static_assert(!loom::StepOptimizer<int>);
    static_assert(loom::StepOptimizer<loom::StepFunctions>);
  }
}

TEST_CASE("Trainer: optimizer calls left in the loop body (PyTorch habits) change nothing") {
  // The plan has 2 batches per step, so the body runs between two micro-batches of a step as well as
  // after a step boundary. SGD with momentum: a second step, even with zero gradients, would move
  // the parameters.
  loom::LocalCommunicator comm;
  const auto clean = loom::test::train_short(comm, 2);
  enum class Habit { zero_grad_zero, zero_grad_none, step_after_backward, both };
  for (const Habit habit : {Habit::zero_grad_zero, Habit::zero_grad_none, Habit::step_after_backward, Habit::both}) {
    CAPTURE(static_cast<int>(habit));
    loom::test::Mlp model(at::kDouble);
    torch::optim::SGD sgd(model.params, torch::optim::SGDOptions(0.05).momentum(0.9));
    loom::BatchLoader loader(comm, loom::test::trainer_shapes(), loom::test::trainer_fetch(), loom::test::kTrainerPlan);
    loom::Trainer trainer(comm, model.list(), sgd);
    for (int64_t e = 0; e < 2; ++e)
      for (loom::Batch& b : trainer.epoch(loader, e)) {
        if (habit == Habit::zero_grad_zero || habit == Habit::both) loom::zero_grad(sgd, loom::GradReset::zero);
        if (habit == Habit::zero_grad_none) loom::zero_grad(sgd, loom::GradReset::none);
        trainer.backward(loom::test::mean_loss(model, b), b);
        if (habit == Habit::step_after_backward || habit == Habit::both) sgd.step();
      }
    CHECK(equal_lists(model.params, clean));
    CHECK(trainer.steps() == 2 * static_cast<int64_t>(loader.sampler().plan().steps.size()));
  }
}

TEST_CASE("Trainer: parameters or gradients written in the loop body are loom errors; on_step may write") {
  SUBCASE("a parameter written in place in the loop body") {
    Setup s;
    auto run = [&] {
      for (loom::Batch& b : s.trainer.epoch(s.loader, 0)) {
        s.trainer.backward(s.loss(b), b);
        torch::NoGradGuard no_grad;
        s.model.params[2].clamp_(-0.5, 0.5);
      }
    };
    CHECK_THROWS_WITH_AS(run(), doctest::Contains("parameter 2 ('w2') was written in place outside the Trainer's"),
                         loom::Error);
    CHECK(s.trainer.steps() == 0);
  }
  SUBCASE("a gradient set by hand between two micro-batches") {
    Setup s;
    auto run = [&] {
      for (loom::Batch& b : s.trainer.epoch(s.loader, 0)) {
        s.model.params[1].mutable_grad() = torch::ones_like(s.model.params[1]);
        s.trainer.backward(s.loss(b), b);
      }
    };
    CHECK_THROWS_WITH_AS(run(), doctest::Contains("the gradient of parameter 1 ('b1') was set between two calls"),
                         loom::Error);
  }
  SUBCASE("on_step may write the parameters (per-step work), and so may code between epochs") {
    Setup s;
    s.trainer.on_step([&](const loom::SyncResult&) {
      torch::NoGradGuard no_grad;
      for (auto& p : s.model.params) p.clamp_(-10.0, 10.0);
    });
    for (int64_t e = 0; e < 2; ++e) {
      for (loom::Batch& b : s.trainer.epoch(s.loader, e)) s.trainer.backward(s.loss(b), b);
      torch::NoGradGuard no_grad;
      s.model.params[1].add_(0.0);  // e.g. a checkpoint loaded between epochs
    }
    CHECK(s.trainer.steps() == 2 * static_cast<int64_t>(s.loader.sampler().plan().steps.size()));
  }
}

TEST_CASE("Trainer: construction refuses what would make a silently different run") {
  loom::LocalCommunicator comm;
  SUBCASE("a second Trainer on a model whose first Trainer is alive; after it is gone, a new one trains as a first") {
    Setup s;
    torch::optim::SGD sgd(s.model.params, torch::optim::SGDOptions(0.05));
    CHECK_THROWS_WITH_AS((loom::Trainer<loom::LocalCommunicator, torch::optim::SGD>(comm, s.model.list(), sgd)),
                         doctest::Contains("parameter 0 ('w1') already belongs to another live loom::Reducer"),
                         loom::InvalidArgument);
    CHECK_THROWS_WITH_AS((loom::Reducer<loom::LocalCommunicator>(comm, s.model.list())),
                         doctest::Contains("already belongs to another live loom::Reducer"), loom::InvalidArgument);
    // One Trainer per phase, each destroyed before the next: the second trains exactly as a first one.
    loom::test::Mlp model(at::kDouble);
    torch::optim::SGD opt(model.params, torch::optim::SGDOptions(0.05).momentum(0.9));
    { loom::Trainer first(comm, model.list(), opt); }
    loom::BatchLoader loader(comm, loom::test::trainer_shapes(), loom::test::trainer_fetch(), loom::test::kTrainerPlan);
    loom::Trainer second(comm, model.list(), opt);
    for (loom::Batch& b : second.epoch(loader, 0)) second.backward(loom::test::mean_loss(model, b), b);
    CHECK(equal_lists(model.params, loom::test::train_short(comm, 1)));
  }
  SUBCASE("reducer options that contradict the Trainer's weighting") {
    loom::test::Mlp model(at::kDouble);
    torch::optim::SGD sgd(model.params, torch::optim::SGDOptions(0.05));
    for (const auto average : {loom::Average::world_size, loom::Average::none}) {
      const std::string expected =
          fmt::format("reducer.average = {} contradicts the Trainer's weighting", loom::to_string(average));
      CHECK_THROWS_WITH_AS(loom::Trainer(comm, model.list(), sgd, {.reducer = {.average = average}}),
                           doctest::Contains(expected.c_str()), loom::InvalidArgument);
    }
  }
  SUBCASE("an optimizer holding a tensor that is not the model's") {
    loom::test::Mlp model(at::kDouble);
    auto extra = torch::zeros({7, 2}, torch::kDouble).requires_grad_();
    auto params = model.params;
    params.push_back(extra);
    torch::optim::SGD sgd(params, torch::optim::SGDOptions(0.05));
    CHECK_THROWS_WITH_AS(loom::Trainer(comm, model.list(), sgd),
                         doctest::Contains("tensor 4 of the optimizer's parameter group 0 (Double [7, 2]) is not a "
                                           "parameter of the model"),
                         loom::InvalidArgument);
  }
  SUBCASE("an optimizer missing a trainable parameter; a frozen one may be missing") {
    loom::test::Mlp model(at::kDouble);
    torch::optim::SGD sgd(std::vector<at::Tensor>{model.params[0], model.params[1], model.params[3]},
                          torch::optim::SGDOptions(0.05));
    CHECK_THROWS_WITH_AS(loom::Trainer(comm, model.list(), sgd),
                         doctest::Contains("parameter 2 ('w2') is trainable but not in the optimizer"),
                         loom::InvalidArgument);
    model.params[2].requires_grad_(false);
    CHECK_NOTHROW(loom::Trainer(comm, model.list(), sgd));
  }
}

TEST_CASE("Trainer: a gradient left by a backward before the Trainer was built does not reach the first step") {
  loom::LocalCommunicator comm;
  auto run = [&](bool smoke_test) {
    loom::test::Mlp model(at::kDouble);
    torch::optim::SGD sgd(model.params, torch::optim::SGDOptions(0.05).momentum(0.9));
    if (smoke_test) {  // a forward and backward to check the model runs, before training
      model.loss_sum(torch::ones({4, loom::test::kIn}, torch::kDouble), torch::ones({4, 2}, torch::kDouble)).backward();
      REQUIRE(model.params[0].grad().abs().sum().item<double>() > 0);
    }
    loom::BatchLoader loader(comm, loom::test::trainer_shapes(), loom::test::trainer_fetch(), loom::test::kTrainerPlan);
    loom::Trainer trainer(comm, model.list(), sgd);
    for (loom::Batch& b : trainer.epoch(loader, 0)) trainer.backward(loom::test::mean_loss(model, b), b);
    return model.params;
  };
  const auto clean = run(false), after_smoke_test = run(true);
  CHECK(equal_lists(clean, after_smoke_test));
  CHECK(equal_lists(clean, loom::test::train_short(comm, 1)));
}

TEST_CASE("Trainer: stop() from on_step ends the loop at that step; the next epoch runs in full") {
  Setup s;
  int64_t calls = 0;
  s.trainer.on_step([&](const loom::SyncResult& r) {
    CHECK(r.boundary);
    if (++calls == 2) s.trainer.stop();
  });
  int64_t batches = 0;
  for (loom::Batch& b : s.trainer.epoch(s.loader, 0)) {
    s.trainer.backward(s.loss(b), b);
    ++batches;
  }
  CHECK(s.trainer.stopped());
  CHECK(s.trainer.steps() == 2);
  CHECK(calls == 2);
  CHECK(batches == 4);  // 2 steps of 2 batches
  int64_t more = 0;
  for (loom::Batch& b : s.trainer.epoch(s.loader, 1)) {
    s.trainer.backward(s.loss(b), b);
    ++more;
  }
  CHECK_FALSE(s.trainer.stopped());
  CHECK(more == static_cast<int64_t>(s.loader.sampler().plan().batches.size()));
}

TEST_CASE("Trainer: a loss summed over the batch (LossReduction::sum) gives the same step as its mean") {
  loom::LocalCommunicator comm;
  auto run = [&](loom::LossReduction r) {
    loom::test::Mlp model(at::kDouble);
    torch::optim::SGD sgd(model.params, torch::optim::SGDOptions(0.05));
    loom::BatchLoader loader(comm, loom::test::trainer_shapes(), loom::test::trainer_fetch(), loom::test::kTrainerPlan);
    loom::Trainer trainer(comm, model.list(), sgd, {.loss = r});
    for (loom::Batch& b : trainer.epoch(loader, 0)) {
      auto mean = loom::test::mean_loss(model, b);
      trainer.backward(r == loom::LossReduction::sum ? mean * static_cast<double>(b.num_samples) : mean, b);
    }
    return model.params;
  };
  const auto a = run(loom::LossReduction::mean), b = run(loom::LossReduction::sum);
  for (std::size_t k = 0; k < a.size(); ++k) CHECK(torch::allclose(a[k], b[k], 1e-13, 0));
}

TEST_CASE("Metrics: weighted by real samples, by name; misuse named") {
  loom::LocalCommunicator comm;
  loom::Metrics metrics(comm);
  loom::Batch big, small, repeated;
  big.data = torch::zeros({256, 1});
  big.num_samples = 256;
  small.data = torch::zeros({10, 1});
  small.num_samples = 10;
  repeated.data = torch::zeros({256, 1});
  repeated.num_samples = 256;
  repeated.weight = 0;
  metrics.add("loss", torch::tensor(0.7, torch::kDouble), big);
  metrics.add("acc", 0.5, 4);
  metrics.add("loss", torch::tensor(0.8, torch::kFloat), big);
  metrics.add("loss", torch::tensor(0.9, torch::kDouble), small);
  metrics.add("loss", torch::tensor(100.0, torch::kDouble), repeated);  // counts nothing
  // (0.7 * 256 + 0.8 * 256 + 0.9 * 10) / 522 = 393 / 522, not the mean of means 0.8.
  CHECK(metrics.mean("loss") == doctest::Approx(393.0 / 522.0).epsilon(1e-7));
  CHECK(metrics.weight("loss") == 522.0);
  CHECK(metrics.mean("acc") == 0.5);
  CHECK(metrics.means().size() == 2);
  CHECK_THROWS_WITH_AS((void)metrics.mean("nope"), doctest::Contains("no rank added a metric named 'nope'"),
                       loom::InvalidArgument);
  CHECK_THROWS_WITH_AS(metrics.add("loss", 1.0, 1), doctest::Contains("already reduced"), loom::Error);
  loom::Metrics other(comm, {.capacity = 1});
  other.add("a", 1.0, 1);
  CHECK_THROWS_WITH_AS(other.add("b", 1.0, 1), doctest::Contains("more than 1 names"), loom::InvalidArgument);
  CHECK_THROWS_WITH_AS(other.add("a", 1.0, -2), doctest::Contains("weight -2"), loom::InvalidArgument);
  CHECK_THROWS_WITH_AS(other.add("a", torch::ones({2}), big), doctest::Contains("one-element tensor"),
                       loom::InvalidArgument);
}

TEST_CASE("run: nproc 1 without a launcher runs in this process as rank 0 of 1") {
  int calls = 0;
  loom::run([&](loom::ProcessGroup& pg) {
    ++calls;
    CHECK(pg.rank() == 0);
    CHECK(pg.world_size() == 1);
    CHECK(pg.device().is_cpu());
    CHECK(pg.backend() != loom::Backend::nccl);
    auto t = torch::ones({3});
    pg.all_reduce(t, loom::ReduceOp::sum);
    CHECK(torch::equal(t, torch::ones({3})));
    // The short path over the process group equals the hand-written loop here too.
    CHECK(equal_lists(loom::test::train_short(pg, 1), loom::test::train_by_hand(pg, 1)));
  });
  CHECK(calls == 1);
  CHECK_THROWS_WITH_AS(loom::run([](loom::ProcessGroup&) {}, {.nproc = 0}), doctest::Contains("nproc = 0"),
                       loom::InvalidArgument);
}

TEST_CASE("ProcessGroup timeout: the option, else LOOM_TIMEOUT in seconds, else 300 s; a bad LOOM_TIMEOUT is named") {
  using std::chrono::milliseconds;
  CHECK(loom::process_group_timeout({}, nullptr) == milliseconds(300'000));
  CHECK(loom::process_group_timeout({}, "") == milliseconds(300'000));
  CHECK(loom::process_group_timeout({}, "2.5") == milliseconds(2'500));
  CHECK(loom::process_group_timeout({}, "600") == milliseconds(600'000));
  CHECK(loom::process_group_timeout({.timeout = std::chrono::seconds(7)}, "600") == milliseconds(7'000));
  for (const char* bad : {"abc", "0", "-3", "5s", "inf", "nan", "1e300"})
    CHECK_THROWS_WITH_AS(
        (void)loom::process_group_timeout({}, bad),
        doctest::Contains(fmt::format("LOOM_TIMEOUT='{}' is not a number of seconds > 0", bad).c_str()),
        loom::ConfigError);
  // The variable reaches the process group's communicator.
  ::setenv("LOOM_TIMEOUT", "42", 1);
  int calls = 0;
  loom::run([&](loom::ProcessGroup& pg) {
    ++calls;
    CHECK(pg.timeout() == milliseconds(42'000));
  });
  loom::run([&](loom::ProcessGroup& pg) { CHECK(pg.timeout() == milliseconds(9'000)); },
            {.group = {.timeout = std::chrono::seconds(9)}});
  ::unsetenv("LOOM_TIMEOUT");
  CHECK(calls == 1);
}

TEST_CASE("rank_cuda_device: LOCAL_RANK among CUDA_VISIBLE_DEVICES; too few GPUs is an error on every rank") {
  auto env = [](int local_rank, int local_world) {
    return loom::Environment::from_map({{"RANK", std::to_string(local_rank)},
                                        {"WORLD_SIZE", std::to_string(local_world)},
                                        {"LOCAL_RANK", std::to_string(local_rank)},
                                        {"LOCAL_WORLD_SIZE", std::to_string(local_world)},
                                        {"MASTER_ADDR", "127.0.0.1"},
                                        {"MASTER_PORT", "29500"}});
  };
  auto d = loom::rank_cuda_device(env(1, 2), 2, "4,5");
  CHECK(d.ordinal == 1);
  CHECK(d.visible_as == "5");
  d = loom::rank_cuda_device(env(2, 3), 8, "");
  CHECK(d.ordinal == 2);
  CHECK(d.visible_as == "2");
  d = loom::rank_cuda_device(env(0, 2), 2, " GPU-aa , GPU-bb ");
  CHECK(d.visible_as == "GPU-aa");
  for (int r = 0; r < 4; ++r)  // every rank of the node throws, not only the ones without a GPU
    CHECK_THROWS_WITH_AS(
        loom::rank_cuda_device(env(r, 4), 2, "0,1"),
        doctest::Contains("4 ranks on this node (LOCAL_WORLD_SIZE=4) need one GPU each, but 2 are visible "
                          "(CUDA_VISIBLE_DEVICES '0,1')"),
        loom::ConfigError);
  CHECK_THROWS_WITH_AS(loom::rank_cuda_device(env(0, 1), 0, ""), doctest::Contains("CUDA_VISIBLE_DEVICES unset"),
                       loom::ConfigError);
  CHECK(loom::parse_visible_devices("0,,2") == std::vector<std::string>{"0", "2"});
  CHECK(loom::parse_backend("auto") == loom::Backend::automatic);
  CHECK_THROWS_WITH_AS(loom::parse_backend("mpi"), doctest::Contains("backend 'mpi'"), loom::ConfigError);
  // This build: no CUDA LibTorch (or no NCCL at all), so nccl is refused with the reason.
#if !LOOM_TORCH_HAS_CUDA
  CHECK_THROWS_WITH_AS(loom::ProcessGroup::resolve(env(0, 1), {.backend = loom::Backend::nccl}),
                       doctest::Contains(LOOM_HAS_NCCL ? "LibTorch without CUDA" : "this build has no NCCL"),
                       loom::ConfigError);
#endif
  CHECK_THROWS_WITH_AS(loom::ProcessGroup::resolve(env(0, 2), {.backend = loom::Backend::local}),
                       doctest::Contains("world size 1, not 2"), loom::ConfigError);
}

TEST_CASE("Trainer and BatchLoader: one resume path; the loop must start at the cursor's epoch") {
  loom::LocalCommunicator comm;
  // The cursor after 3 steps of epoch 1.
  loom::GlobalCursor cursor;
  {
    Setup s;
    for (loom::Batch& b : s.trainer.epoch(s.loader, 0)) s.trainer.backward(s.loss(b), b);
    s.trainer.on_step([&](const loom::SyncResult&) {
      if (s.trainer.steps() == s.loader.sampler().num_steps() + 3) {
        cursor = s.loader.sampler().cursor();
        s.trainer.stop();
      }
    });
    for (loom::Batch& b : s.trainer.epoch(s.loader, 1)) s.trainer.backward(s.loss(b), b);
    REQUIRE(s.trainer.stopped());
  }
  REQUIRE(cursor.epoch == 1);
  REQUIRE(cursor.step == 3);
  for (const bool through_sampler : {false, true}) {
    CAPTURE(through_sampler);
    Setup s;
    if (through_sampler)
      s.loader.sampler().resume(cursor);  // the form docs/elastic.md also offers
    else
      s.loader.resume(cursor);
    int64_t samples = 0;
    for (loom::Batch& b : s.trainer.epoch(s.loader, cursor.epoch)) {
      s.trainer.backward(s.loss(b), b);
      samples += b.num_samples;
    }
    CHECK(s.trainer.steps() == s.loader.sampler().num_steps() - 3);
    int64_t skipped = 0;
    for (int64_t k = 0; k < 3; ++k) skipped += s.loader.sampler().plan().steps[static_cast<std::size_t>(k)].num_samples;
    CHECK(samples == loom::test::kTrainerSamples - skipped);
  }
  SUBCASE("a loop that starts at another epoch than the cursor's") {
    Setup s;
    s.loader.resume(cursor);
    CHECK_THROWS_WITH_AS((void)s.trainer.epoch(s.loader, 0),
                         doctest::Contains("start the epoch loop at the cursor's epoch (1;"), loom::InvalidArgument);
  }
  SUBCASE("a cursor taken after an epoch's last step resumes at the next epoch's first step") {
    Setup s;
    loom::GlobalCursor end;
    for (loom::Batch& b : s.trainer.epoch(s.loader, 0)) s.trainer.backward(s.loss(b), b);
    end = s.loader.sampler().cursor();
    CHECK(end.epoch == 1);
    CHECK(end.step == 0);
    Setup t;
    t.loader.resume(end);
    loom::Metrics metrics(comm);
    for (int64_t e = end.epoch; e < 2; ++e)  // the natural loop
      for (loom::Batch& b : t.trainer.epoch(t.loader, e)) {
        auto loss = t.loss(b);
        t.trainer.backward(loss, b);
        metrics.add("loss", loss, b);
      }
    CHECK(metrics.weight("loss") == static_cast<double>(loom::test::kTrainerSamples));
    CHECK(t.trainer.steps() == t.loader.sampler().num_steps());
  }
}

TEST_CASE("BatchLoader: a sample of another shape than declared, and a target of another dtype, are named") {
  loom::LocalCommunicator comm;
  auto fetch = [](int64_t i) {
    auto [x, y] = loom::test::trainer_sample(i);
    if (i == 4) x = x.narrow(0, 0, 2);  // declared 3 x 3 (trainer_length(4) == 3)
    return std::make_pair(x, y);
  };
  loom::BatchLoader loader(comm, loom::test::trainer_shapes(), fetch, loom::test::kTrainerPlan);
  auto run = [&] {
    while (auto item = loader.sampler().next())
      if (!item->idle) (void)loader.load(*item);
  };
  CHECK_THROWS_WITH_AS(run(),
                       doctest::Contains("fetch(4) returned a sample of shape [2, 3], but its declared shape "
                                         "(shapes[4]) is [3, 3]"),
                       loom::InvalidArgument);
  const std::vector<std::pair<at::Tensor, at::Tensor>> mixed = {{torch::zeros({2}), torch::zeros({3}, torch::kDouble)},
                                                                {torch::zeros({2}), torch::zeros({3}, torch::kFloat)}};
  const std::vector<int64_t> ids = {7, 8};
  CHECK_THROWS_WITH_AS(loom::collate(mixed, ids),
                       doctest::Contains("sample 8: its target is a Float tensor [3], but sample 7's is a Double "
                                         "tensor [3]"),
                       loom::InvalidArgument);
}

TEST_CASE("BatchLoader: a plan that pads gives batches a mask, as padded buckets do") {
  loom::LocalCommunicator comm;
  loom::GlobalBatchOptions plan = loom::test::kTrainerPlan;
  plan.pad = {{.dim = 0, .multiple = 4}};  // lengths 2, 3, 5 pad to 4, 4, 8
  loom::BatchLoader loader(comm, loom::test::trainer_shapes(), loom::test::trainer_fetch(), plan);
  CHECK(loader.mask());
  int64_t batches = 0;
  while (auto item = loader.sampler().next()) {
    if (item->idle) continue;
    const loom::Batch b = loader.load(*item);
    REQUIRE(b.mask.defined());
    CHECK(b.mask.sizes() == b.data.sizes());
    // Real elements: each sample's own length times 3 features.
    int64_t real = 0;
    for (int64_t i : item->indices) real += loom::test::trainer_length(i) * loom::test::kIn;
    CHECK(b.mask.sum().item<int64_t>() == real);
    ++batches;
  }
  CHECK(batches == static_cast<int64_t>(loader.sampler().plan().batches.size()));
  loom::BatchLoader exact(comm, loom::test::trainer_shapes(), loom::test::trainer_fetch(), loom::test::kTrainerPlan);
  CHECK_FALSE(exact.mask());
}

namespace {
// A transfer that records its calls and doubles data, so a test sees that the loader's batches
// went through it.
struct RecordingTransfer {
  struct Ticket {
    int64_t call = 0;
  };
  std::shared_ptr<std::vector<std::string>> log = std::make_shared<std::vector<std::string>>();
  Ticket start(loom::Batch& b, int label) {
    log->push_back("start " + std::to_string(label));
    if (b.data.defined()) b.data = b.data * 2;
    return {static_cast<int64_t>(log->size())};
  }
  void finish(loom::Batch&, int label, Ticket& t) {
    log->push_back("finish " + std::to_string(label) + " of " + std::to_string(t.call));
  }
};
}  // namespace

TEST_CASE("BatchLoader: every batch goes through its transfer (start, then finish, label 0 on the CPU)") {
  loom::LocalCommunicator comm;
  RecordingTransfer transfer;
  loom::BatchLoader loader(comm, loom::test::trainer_shapes(), loom::test::trainer_fetch(), loom::test::kTrainerPlan,
                           {}, loom::DefaultProjection{}, transfer);
  loom::BatchLoader plain(comm, loom::test::trainer_shapes(), loom::test::trainer_fetch(), loom::test::kTrainerPlan);
  loader.begin_epoch(0);
  plain.begin_epoch(0);
  int64_t batches = 0;
  while (auto b = loader.next()) {
    auto p = plain.next();
    REQUIRE(p.has_value());
    CHECK(b->data.equal(p->data * 2));
    CHECK(b->targets.equal(p->targets));
    ++batches;
  }
  CHECK_FALSE(plain.next().has_value());
  REQUIRE(batches == static_cast<int64_t>(loader.sampler().plan().batches.size()));
  REQUIRE(transfer.log->size() == static_cast<std::size_t>(2 * batches));
  for (int64_t k = 0; k < batches; ++k) {
    CHECK((*transfer.log)[static_cast<std::size_t>(2 * k)] == "start 0");
    CHECK((*transfer.log)[static_cast<std::size_t>(2 * k + 1)] == "finish 0 of " + std::to_string(2 * k + 1));
  }

  // The default transfer goes to the loader's device: non-blocking, unless a user's pool owns the buffers.
  CHECK((plain.transfer().options().type == c10::kCPU));
  CHECK(plain.transfer().options().non_blocking);
  auto pool = std::make_shared<loom::BufferPool>();
  loom::BatchLoader pooled(comm, loom::test::trainer_shapes(), loom::test::trainer_fetch(), loom::test::kTrainerPlan,
                           {.collate = {.pool = pool}});
  CHECK_FALSE(pooled.transfer().options().non_blocking);
  // Another device (meta: shapes and dtypes only): the batches arrive there.
  loom::BatchLoader to_meta(comm, loom::test::trainer_shapes(), loom::test::trainer_fetch(), loom::test::kTrainerPlan,
                            {.device = c10::Device(c10::kMeta)});
  to_meta.begin_epoch(0);
  plain.begin_epoch(0);
  const auto first = to_meta.next();
  const auto host = plain.next();
  REQUIRE(first.has_value());
  CHECK(first->data.is_meta());
  CHECK(first->targets.is_meta());
  CHECK(first->data.sizes() == host->data.sizes());
  CHECK(first->indices == host->indices);
}

TEST_CASE("Trainer: float16 parameters: a legal mean gradient of 2048 over 48 samples is not an overflow") {
  // The batch losses are divided by the step's planned samples, not multiplied by their own: each
  // backward's gradient is its share of the step's mean (at most 2048), never 48 * 2048.
  loom::LocalCommunicator comm;
  const auto [w, skipped] = loom::test::train_float16(comm);
  CHECK(skipped == 0);
  CHECK(w == -1.0);  // two steps of -0.5
}

TEST_CASE("Trainer: the loss scaler's state resumes with the run") {
  // float32, a first scale of 2^200: losses times 2^200 and 2^150 overflow float32 (max ~2^128),
  // so the first two steps are skipped (backoff 2^-50 each); from 2^100 on every step is finite and
  // the scale doubles every 4 of them. Interrupted after epoch 0, a resumed
  // run equals the uninterrupted one only when the scaler's state comes back too.
  loom::LocalCommunicator comm;
  const loom::LossScalerOptions scaling{.init_scale = std::ldexp(1.0, 200),
                                        .growth_factor = 2.0,
                                        .backoff_factor = std::ldexp(1.0, -50),
                                        .growth_interval = 4};
  auto fetch = [](int64_t i) {
    auto [x, y] = loom::test::trainer_sample(i);
    return std::make_pair(x.to(torch::kFloat), y.to(torch::kFloat));
  };
  struct Run {
    std::vector<at::Tensor> params;
    int64_t steps = 0, skipped = 0;
    loom::LossScalerState scaler;
    loom::GlobalCursor cursor;
  };
  // Epochs [first, last) from `start` (parameters, or the Mlp's own), with the scaler's state when given.
  auto run = [&](int64_t first, int64_t last, const std::vector<at::Tensor>* start,
                 std::optional<loom::LossScalerState> state, std::optional<loom::GlobalCursor> cursor) {
    loom::test::Mlp model(at::kFloat);
    if (start) {
      torch::NoGradGuard no_grad;
      for (std::size_t k = 0; k < model.params.size(); ++k) model.params[k].copy_((*start)[k]);
    }
    torch::optim::SGD sgd(model.params, torch::optim::SGDOptions(0.05));
    loom::BatchLoader loader(comm, loom::test::trainer_shapes(), fetch, loom::test::kTrainerPlan);
    loom::Trainer trainer(comm, model.list(), sgd, {.loss_scaling = scaling});
    if (state) trainer.load_loss_scaler_state(*state);
    if (cursor) loader.resume(*cursor);
    for (int64_t e = first; e < last; ++e)
      for (loom::Batch& b : trainer.epoch(loader, e)) trainer.backward(loom::test::mean_loss(model, b), b);
    Run r;
    for (const auto& p : model.params) r.params.push_back(p.detach().clone());
    r.steps = trainer.steps();
    r.skipped = trainer.skipped_steps();
    r.scaler = *trainer.loss_scaler_state();
    r.cursor = loader.sampler().cursor();
    return r;
  };
  const Run whole = run(0, 2, nullptr, std::nullopt, std::nullopt);
  REQUIRE(whole.skipped == 2);
  REQUIRE(whole.scaler.scale > std::ldexp(1.0, 100));  // it grew after the skips
  const Run first = run(0, 1, nullptr, std::nullopt, std::nullopt);
  REQUIRE(first.cursor.epoch == 1);
  // The state travels as one line of text.
  const loom::LossScalerState saved = loom::parse_loss_scaler_state(loom::to_string(first.scaler) + "\n");
  CHECK(saved == first.scaler);
  const Run resumed = run(1, 2, &first.params, saved, first.cursor);
  CHECK(equal_lists(resumed.params, whole.params));
  CHECK(resumed.scaler == whole.scaler);
  CHECK(first.skipped + resumed.skipped == whole.skipped);
  // Without it, the resumed run starts at 2^200 again and skips 2 steps the whole run did not.
  const Run forgot = run(1, 2, &first.params, std::nullopt, first.cursor);
  CHECK(forgot.skipped == 2);
  CHECK_FALSE(equal_lists(forgot.params, whole.params));
  // Misuse is named.
  CHECK_THROWS_WITH_AS(loom::parse_loss_scaler_state("loom-loss-scaler v1 scale=1"), doctest::Contains("malformed"),
                       loom::InvalidArgument);
  Setup s;  // no loss scaling
  CHECK_FALSE(s.trainer.loss_scaler_state());
  CHECK_THROWS_WITH_AS(s.trainer.load_loss_scaler_state(saved), doctest::Contains("has no loss scaler"),
                       loom::InvalidArgument);
  loom::LossScaler scaler(scaling);
  CHECK_THROWS_WITH_AS(scaler.load_state({.scale = 1.0, .good_steps = 4}),
                       doctest::Contains("good_steps = 4 (must be in [0, 4))"), loom::InvalidArgument);
}

namespace {
/// A BatchSource by hand (no sampler, no plan): the batches of one epoch, in order.
struct VectorSource {
  std::vector<loom::Batch> batches;
  std::size_t position = 0;
  int64_t epochs_begun = 0;
  void begin_epoch(int64_t /*epoch*/) {
    position = 0;
    ++epochs_begun;
  }
  std::optional<loom::Batch> next() {
    if (position == batches.size()) return std::nullopt;
    return batches[position++];
  }
};

loom::Batch hand_batch(std::vector<double> x, int64_t step, bool step_end) {
  loom::Batch b;
  b.num_samples = static_cast<int64_t>(x.size());
  b.data = torch::tensor(x, torch::kDouble);
  for (int64_t i = 0; i < b.num_samples; ++i) b.indices.push_back(i);
  b.step = step;
  b.step_end = step_end;
  return b;
}
}  // namespace

static_assert(loom::BatchSource<VectorSource>);
static_assert(!loom::PlannedBatchSource<VectorSource>);
static_assert(loom::PlannedBatchSource<loom::BatchLoader<decltype(loom::test::trainer_fetch())>>);

TEST_CASE("Trainer::epoch takes any BatchSource: batches carry their step, idle steps are joined") {
  // w = 0, loss (w * x).mean() per batch, SGD lr 1. The step's gradient is the mean of x over its
  // samples (by hand): step 0 holds x = 1, 3 | 5 -> 3; step 1 holds x = 2, 4 -> 3; step 2 is idle
  // here (no samples anywhere: nothing to apply). So w = 0 - 3 - 3 = -6 exactly, after 2 steps.
  loom::LocalCommunicator local;
  auto w = torch::zeros({1}, torch::kDouble).requires_grad_();
  torch::optim::SGD sgd(std::vector<at::Tensor>{w}, torch::optim::SGDOptions(1.0));
  loom::Trainer trainer(local, loom::ParameterList{.names = {"w"}, .params = {w}}, sgd);
  VectorSource source;
  source.batches = {hand_batch({1, 3}, 0, false), hand_batch({5}, 0, true), hand_batch({2, 4}, 1, true)};
  loom::Batch idle;
  idle.idle = true;
  idle.weight = 0;
  idle.step = 2;
  idle.step_end = true;
  source.batches.push_back(idle);
  CHECK_THROWS_WITH_AS((void)trainer.next_batch(source), doctest::Contains("no epoch loop is running"), loom::Error);
  std::vector<int64_t> steps_seen;
  for (loom::Batch& b : trainer.epoch(source, 0)) {
    steps_seen.push_back(b.step);
    trainer.backward((w * b.data).mean(), b);
  }
  CHECK(source.epochs_begun == 1);
  CHECK(steps_seen == std::vector<int64_t>{0, 0, 1});
  CHECK(w.item<double>() == -6.0);
  CHECK(trainer.steps() == 2);
}

TEST_CASE("collate_sampled carries the item's step, step end and idle flag into the Batch") {
  auto fetch = [](int64_t i) { return std::make_pair(torch::full({2}, static_cast<double>(i)), int64_t{0}); };
  const loom::Batch b = loom::collate_sampled(
      loom::SampledBatch{.indices = {3, 1}, .padded_shape = {2}, .step = 4, .step_end = true}, fetch);
  CHECK(b.step == 4);
  CHECK(b.step_end);
  CHECK_FALSE(b.idle);
  CHECK(b.counted_samples() == 2);
  const loom::Batch i = loom::collate_sampled(
      loom::SampledBatch{.weight = 0.0, .idle = true, .step = 2, .batch_id = -1, .step_end = true}, fetch);
  CHECK(i.idle);
  CHECK(i.step == 2);
  CHECK(i.weight == 0.0);
  CHECK(i.counted_samples() == 0);
}

namespace {

using loom::test::StderrCapture;

/// The trainer fixture's data with sample `bad` full of NaN.
auto fetch_with_nan(int64_t bad) {
  return [bad](int64_t i) {
    auto [x, y] = loom::test::trainer_sample(i);
    if (i == bad) x = torch::full_like(x, std::numeric_limits<double>::quiet_NaN());
    return std::make_pair(x, y);
  };
}

/// The step of `plan` holding dataset index `index`, and that step's indices.
std::pair<int64_t, std::vector<int64_t>> step_of(const loom::EpochPlan& plan, int64_t index) {
  for (std::size_t s = 0; s < plan.steps.size(); ++s) {
    std::vector<int64_t> all;
    for (int64_t b = plan.steps[s].first_batch; b < plan.steps[s].first_batch + plan.steps[s].num_batches; ++b)
      for (int64_t i : plan.batches[static_cast<std::size_t>(b)].indices) all.push_back(i);
    if (std::find(all.begin(), all.end(), index) != all.end()) return {static_cast<int64_t>(s), all};
  }
  return {-1, {}};
}

}  // namespace

TEST_CASE("Trainer: a step skipped for NaN is reported on rank 0 with its epoch, step and samples, and counted") {
  loom::LocalCommunicator comm;
  loom::test::Mlp model(at::kDouble);
  torch::optim::SGD sgd(model.params, torch::optim::SGDOptions(0.05));
  loom::BatchLoader loader(comm, loom::test::trainer_shapes(), fetch_with_nan(7), loom::test::kTrainerPlan);
  loom::Trainer trainer(comm, model.list(), sgd);
  int64_t last_step = -1;
  for (int64_t epoch = 0; epoch < 2; ++epoch) {
    StderrCapture capture;
    for (loom::Batch& b : trainer.epoch(loader, epoch)) trainer.backward(loom::test::mean_loss(model, b), b);
    const auto [step, indices] = step_of(loader.sampler().plan(), 7);
    REQUIRE(step >= 0);
    last_step = step;
    CHECK(trainer.epoch_skipped_steps() == 1);
    const std::string text = capture.finish();
    INFO(text);
    std::string listed;
    for (std::size_t k = 0; k < indices.size(); ++k) listed += (k ? ", " : "") + std::to_string(indices[k]);
    CHECK(text.find(fmt::format("epoch {}, step {} was skipped on every rank (inf/NaN gradients", epoch, step)) !=
          std::string::npos);
    CHECK(text.find(fmt::format("its {} samples are dataset indices {}", indices.size(), listed)) != std::string::npos);
    CHECK(text.find(fmt::format("epoch {}: 1 of {} steps skipped", epoch, loader.sampler().plan().steps.size())) !=
          std::string::npos);
  }
  CHECK(trainer.skipped_steps() == 2);
  CHECK(last_step >= 0);
  // Every parameter stays finite: the step with the NaN sample never reached the optimizer.
  for (const auto& p : model.params) CHECK(torch::isfinite(p).all().item<bool>());
}

TEST_CASE(
    "Trainer: skipped_steps.error makes a skipped step a loom::Error; max_consecutive stops a run that never steps") {
  loom::LocalCommunicator comm;
  {
    loom::test::Mlp model(at::kDouble);
    torch::optim::SGD sgd(model.params, torch::optim::SGDOptions(0.05));
    loom::BatchLoader loader(comm, loom::test::trainer_shapes(), fetch_with_nan(7), loom::test::kTrainerPlan);
    loom::Trainer trainer(comm, model.list(), sgd, {.skipped_steps = {.error = true}});
    std::string what = "(no error)";
    try {
      for (loom::Batch& b : trainer.epoch(loader, 0)) trainer.backward(loom::test::mean_loss(model, b), b);
    } catch (const loom::Error& e) {
      what = e.what();
    }
    const auto [step, indices] = step_of(loader.sampler().plan(), 7);
    CHECK(what.find(fmt::format("epoch 0, step {} was skipped on every rank", step)) != std::string::npos);
    CHECK(what.find("skipped_steps.error is set") != std::string::npos);
    CHECK(trainer.steps() == step);  // every step before it applied
  }
  {
    // Every sample NaN: 3 steps in a row skipped with max_consecutive = 3.
    loom::test::Mlp model(at::kDouble);
    torch::optim::SGD sgd(model.params, torch::optim::SGDOptions(0.05));
    auto all_nan = [](int64_t i) {
      auto [x, y] = loom::test::trainer_sample(i);
      return std::make_pair(torch::full_like(x, std::numeric_limits<double>::quiet_NaN()), y);
    };
    loom::BatchLoader loader(comm, loom::test::trainer_shapes(), all_nan, loom::test::kTrainerPlan);
    loom::Trainer trainer(comm, model.list(), sgd, {.skipped_steps = {.max_consecutive = 3, .warn = false}});
    CHECK_THROWS_WITH_AS(
        [&] {
          for (loom::Batch& b : trainer.epoch(loader, 0)) trainer.backward(loom::test::mean_loss(model, b), b);
        }(),
        doctest::Contains("3 steps in a row were skipped, the last one epoch 0, step 2 was skipped"), loom::Error);
    CHECK(trainer.skipped_steps() == 3);
  }
}

TEST_CASE("Trainer: a step skipped on the float16 wire says the wire may have overflowed, not only inf/NaN") {
  // A float32 parameter with a finite gradient of 1e5 on a float16 wire (largest value 65504): the
  // step is skipped, and the report names the wire.
  loom::LocalCommunicator comm;
  auto w = torch::zeros({1}, torch::kDouble).to(torch::kFloat).requires_grad_();
  torch::optim::SGD sgd(std::vector<at::Tensor>{w}, torch::optim::SGDOptions(1e-5));
  const std::vector<std::vector<int64_t>> shapes(4, std::vector<int64_t>{1});
  auto fetch = [](int64_t) { return std::make_pair(torch::ones({1}), torch::zeros({1})); };
  loom::BatchLoader loader(comm, shapes, fetch, loom::GlobalBatchOptions{.seed = 1, .max_samples = 4});
  loom::Trainer trainer(comm, loom::ParameterList{.names = {"w"}, .params = {w}}, sgd,
                        {.reducer = {.wire_dtype = at::kHalf}, .skipped_steps = {.error = true}});
  CHECK_THROWS_WITH_AS(
      [&] {
        for (loom::Batch& b : trainer.epoch(loader, 0)) trainer.backward((w * b.data * 1e5).sum() / 4, b);
      }(),
      doctest::Contains("inf/NaN gradients, or a gradient above 65504 on the float16 wire"), loom::Error);
  CHECK(w.item<double>() == 0.0);
}

TEST_CASE("Trainer::before_step: the averaged gradients before optimizer.step(); clipping there equals the reducer's") {
  // clip_grad_norm_ in before_step with max norm 0.05 trains to the parameters of the reducer's own
  // global-norm clipping (ReducerOptions::max_grad_norm = 0.05): both scale every gradient by
  // min(1, 0.05 / (norm + 1e-6)).
  loom::LocalCommunicator comm;
  auto train = [&](bool by_hook) {
    loom::test::Mlp model(at::kDouble);
    torch::optim::SGD sgd(model.params, torch::optim::SGDOptions(0.05).momentum(0.9));
    loom::BatchLoader loader(comm, loom::test::trainer_shapes(), loom::test::trainer_fetch(), loom::test::kTrainerPlan);
    loom::TrainerOptions options;
    if (!by_hook) options.reducer.max_grad_norm = 0.05;
    loom::Trainer trainer(comm, model.list(), sgd, options);
    int64_t hooks = 0;
    if (by_hook)
      trainer.before_step([&](const loom::SyncResult& r) {
        CHECK(r.apply);
        for (const auto& p : model.params) CHECK(p.grad().defined());
        torch::nn::utils::clip_grad_norm_(model.params, 0.05);
        ++hooks;
      });
    for (int64_t epoch = 0; epoch < 2; ++epoch)
      for (loom::Batch& b : trainer.epoch(loader, epoch)) trainer.backward(loom::test::mean_loss(model, b), b);
    if (by_hook) CHECK(hooks == trainer.steps());
    return loom::test::flat_values(model.params);
  };
  const auto by_hook = train(true), by_reducer = train(false);
  CHECK(loom::test::max_relative_difference(by_hook, by_reducer) < 1e-12);
  // And clipping did something: without it the parameters end elsewhere.
  CHECK(loom::test::max_relative_difference(by_hook, loom::test::flat_values(loom::test::train_short(comm, 2))) > 1e-6);
}

TEST_CASE("Trainer: zero_stage 1 on one rank steps like stage 0, keeps the state in its shard; misuse is named") {
  auto run = [](int stage, int64_t* state_bytes) {
    loom::LocalCommunicator comm;
    loom::test::Mlp model{at::kDouble};
    torch::optim::Adam adam{model.params, torch::optim::AdamOptions(0.01)};
    Loader loader{comm, loom::test::trainer_shapes(), loom::test::trainer_fetch(), loom::test::kTrainerPlan};
    loom::Trainer trainer(comm, model.list(), adam, {.zero_stage = stage});
    for (loom::Batch& b : trainer.epoch(loader, 0)) trainer.backward(loom::test::mean_loss(model, b), b);
    REQUIRE((trainer.sharded_optimizer() != nullptr) == (stage == 1));
    *state_bytes = stage == 1 ? trainer.sharded_optimizer()->state_bytes() : loom::optimizer_state_bytes(adam);
    if (stage == 1) CHECK(adam.state().empty());  // the state lives in the shard's optimizer
    return model.params;
  };
  int64_t bytes0 = 0, bytes1 = 0;
  const auto whole = run(0, &bytes0);
  const auto sharded = run(1, &bytes1);
  CHECK(equal_lists(whole, sharded));
  int64_t elements = 0;
  for (const auto& p : whole) elements += p.numel();
  CHECK(bytes0 == 2 * 8 * elements);  // Adam: exp_avg and exp_avg_sq, float64
  CHECK(bytes1 == bytes0);            // one rank: its shard is everything

  loom::LocalCommunicator comm;
  loom::test::Mlp model{at::kDouble};
  SUBCASE("a stage loom does not have") {
    torch::optim::SGD sgd{model.params, 0.1};
    CHECK_THROWS_WITH_AS(loom::Trainer(comm, model.list(), sgd, {.zero_stage = 2}),
                         doctest::Contains("TrainerOptions::zero_stage = 2"), loom::InvalidArgument);
  }
  SUBCASE("an optimizer loom cannot shard") {
    loom::StepFunctions own{[] {}, [] {}};
    CHECK_THROWS_WITH_AS(loom::Trainer(comm, model.list(), own, {.zero_stage = 1}),
                         doctest::Contains("needs a torch::optim optimizer"), loom::InvalidArgument);
    struct OwnAdam : torch::optim::Adam {  // a subclass may change the update rule
      using torch::optim::Adam::Adam;
    };
    OwnAdam own_adam{model.params};
    CHECK_THROWS_WITH_AS(loom::Trainer(comm, model.list(), own_adam, {.zero_stage = 1}),
                         doctest::Contains("OwnAdam is not one of the optimizers it can shard"), loom::InvalidArgument);
  }
}

}  // namespace test_trainer
