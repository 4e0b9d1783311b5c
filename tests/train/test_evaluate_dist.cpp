// loom::evaluate on real ranks over Gloo: the gathered rows on 2 and 3 ranks equal the 1-rank rows
// bit for bit (the plan's batches do not depend on the world size), on every rank; called between
// Trainer epochs on 3 ranks, it leaves training as it would be without it.
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <string>
#include <unistd.h>
#include <vector>

#include <doctest/doctest.h>
#include <fmt/format.h>
#include <torch/torch.h>

#include <loom/comm/gloo.hpp>
#include <loom/comm/local.hpp>
#include <loom/train/evaluate.hpp>

#include "support/ranks.hpp"
#include "trainer_fixture.hpp"

namespace test_evaluate_dist {

namespace fs = std::filesystem;

namespace {

const loom::GlobalBatchOptions kEvalPlan{.shuffle = false, .max_samples = 4, .batches_per_step = 2};

// The rows every rank gets: the model's outputs and each sample's squared error, N x 3 float64.
template <class Comm>
loom::GatheredResults evaluate_mlp(Comm& comm, const loom::test::Mlp& model) {
  loom::BatchLoader val(comm, loom::test::trainer_shapes(), loom::test::trainer_fetch(), kEvalPlan);
  return loom::evaluate(comm, val, [&](loom::Batch& b) {
    const at::Tensor out = model.forward(b.data.mean(1));
    return torch::cat({out, (out - b.targets).pow(2).sum(1, /*keepdim=*/true)}, 1);
  });
}

}  // namespace

TEST_SUITE("dist") {
  TEST_CASE("evaluate: rows on 2 and 3 ranks equal the 1-rank rows bit for bit, on every rank") {
    const fs::path dir = fs::temp_directory_path() / fmt::format("loom-evaluate-dist-{}", ::getpid());
    fs::create_directories(dir);
    loom::LocalCommunicator local;
    const loom::test::Mlp reference_model(at::kDouble);
    const loom::GatheredResults one = evaluate_mlp(local, reference_model);
    REQUIRE(one.values.size(0) == loom::test::kTrainerSamples);
    const std::vector<double> want = loom::test::flat_values({one.values});
    for (int world : {2, 3}) {
      loom::test::run_ranks(world,
                            [&](loom::GlooCommunicator& comm) {
                              const loom::test::Mlp model(at::kDouble);
                              const loom::GatheredResults r = evaluate_mlp(comm, model);
                              loom::test::write_values((dir / fmt::format("w{}-r{}.txt", world, comm.rank())).string(),
                                                       {r.values});
                            },
                            {.comm_timeout = std::chrono::seconds(30), .spawn_timeout = std::chrono::seconds(120)});
      for (int r = 0; r < world; ++r) {
        CAPTURE(world);
        CAPTURE(r);
        CHECK(loom::test::read_values((dir / fmt::format("w{}-r{}.txt", world, r)).string()) == want);
      }
    }
    fs::remove_all(dir);
  }

  TEST_CASE("evaluate: between Trainer epochs on 3 ranks, training ends where it ends without evaluation") {
    const fs::path dir = fs::temp_directory_path() / fmt::format("loom-evaluate-train-{}", ::getpid());
    fs::create_directories(dir);
    loom::LocalCommunicator local;
    const std::vector<at::Tensor> reference = loom::test::train_short(local, 2);
    loom::test::run_ranks(3,
                          [&](loom::GlooCommunicator& comm) {
                            loom::test::Mlp model(at::kDouble);
                            torch::optim::SGD sgd(model.params, torch::optim::SGDOptions(0.05).momentum(0.9));
                            loom::BatchLoader train(comm, loom::test::trainer_shapes(), loom::test::trainer_fetch(),
                                                    loom::test::kTrainerPlan);
                            loom::Trainer trainer(comm, model.list(), sgd);
                            std::vector<double> losses;
                            for (int64_t epoch = 0; epoch < 2; ++epoch) {
                              for (loom::Batch& b : trainer.epoch(train, epoch))
                                trainer.backward(loom::test::mean_loss(model, b), b);
                              losses.push_back(evaluate_mlp(comm, model).values.select(1, 2).mean().item<double>());
                            }
                            if (comm.rank() == 0) {
                              loom::test::write_values((dir / "params.txt").string(), model.params);
                              loom::test::write_values((dir / "losses.txt").string(),
                                                       {torch::tensor(losses, torch::kDouble)});
                            }
                          },
                          {.comm_timeout = std::chrono::seconds(30), .spawn_timeout = std::chrono::seconds(120)});
    const std::vector<double> params = loom::test::read_values((dir / "params.txt").string());
    CHECK(loom::test::max_relative_difference(loom::test::flat_values(reference), params) <= 1e-12);
    const std::vector<double> losses = loom::test::read_values((dir / "losses.txt").string());
    REQUIRE(losses.size() == 2);
    CHECK(losses[1] < losses[0]);
    fs::remove_all(dir);
  }
}

}  // namespace test_evaluate_dist
