// loom::save_checkpoint / load_checkpoint on real ranks: a run saved on 2 ranks mid-epoch and
// resumed on 3 ends where the uninterrupted run does (relative 1e-12, the tolerance of the
// world-size invariance tests); a save rank 0 cannot write is an error on every rank.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <unistd.h>
#include <vector>

#include <doctest/doctest.h>
#include <fmt/format.h>
#include <torch/torch.h>

#include <loom/comm/gloo.hpp>
#include <loom/comm/local.hpp>
#include <loom/train/checkpoint.hpp>

#include "support/ranks.hpp"
#include "trainer_fixture.hpp"

namespace test_checkpoint_dist {

namespace fs = std::filesystem;

TEST_SUITE("dist") {
  TEST_CASE("checkpoint: saved on 2 ranks at step 3, resumed on 3 ranks, ends where the uninterrupted run does") {
    const fs::path dir = fs::temp_directory_path() / fmt::format("loom-checkpoint-dist-{}", ::getpid());
    fs::create_directories(dir);
    const fs::path file = dir / "run.pt", result = dir / "params.txt";

    loom::LocalCommunicator local;
    const std::vector<at::Tensor> reference = loom::test::train_short(local, 2);

    loom::test::run_ranks(2,
                          [&](loom::GlooCommunicator& comm) {
                            loom::test::Mlp model(at::kDouble);
                            torch::optim::SGD sgd(model.params, torch::optim::SGDOptions(0.05).momentum(0.9));
                            loom::BatchLoader loader(comm, loom::test::trainer_shapes(), loom::test::trainer_fetch(),
                                                     loom::test::kTrainerPlan);
                            loom::Trainer trainer(comm, model.list(), sgd);
                            trainer.on_step([&](const loom::SyncResult&) {
                              if (trainer.steps() == 3) {
                                loom::save_checkpoint(file, trainer, loader);
                                trainer.stop();
                              }
                            });
                            for (loom::Batch& b : trainer.epoch(loader, 0))
                              trainer.backward(loom::test::mean_loss(model, b), b);
                            if (!trainer.stopped()) throw std::runtime_error("the run did not stop at step 3");
                          },
                          {.comm_timeout = std::chrono::seconds(30), .spawn_timeout = std::chrono::seconds(120)});

    loom::test::run_ranks(
        3,
        [&](loom::GlooCommunicator& comm) {
          loom::test::Mlp model(at::kDouble, /*seed=*/5.0);  // other values: the checkpoint must replace them
          torch::optim::SGD sgd(model.params, torch::optim::SGDOptions(0.05).momentum(0.9));
          loom::BatchLoader loader(comm, loom::test::trainer_shapes(), loom::test::trainer_fetch(),
                                   loom::test::kTrainerPlan);
          loom::Trainer trainer(comm, model.list(), sgd);
          const auto info = loom::load_checkpoint(file, trainer, loader);
          if (info.cursor.epoch != 0 || info.cursor.step != 3 || trainer.steps() != 3)
            throw std::runtime_error(fmt::format("rank {}: resumed at epoch {} step {} with {} steps", comm.rank(),
                                                 info.cursor.epoch, info.cursor.step, trainer.steps()));
          for (int64_t e = info.cursor.epoch; e < 2; ++e)
            for (loom::Batch& b : trainer.epoch(loader, e)) trainer.backward(loom::test::mean_loss(model, b), b);
          if (comm.rank() == 0) loom::test::write_values(result.string(), model.params);
        },
        {.comm_timeout = std::chrono::seconds(30), .spawn_timeout = std::chrono::seconds(120)});

    const std::vector<double> expected = loom::test::flat_values(reference);
    const std::vector<double> resumed = loom::test::read_values(result.string());
    REQUIRE(resumed.size() == expected.size());
    const double relative = loom::test::max_relative_difference(expected, resumed);
    MESSAGE(fmt::format("2 -> 3 ranks resumed vs uninterrupted: max relative difference {:.3g}", relative));
    CHECK(relative < 1e-12);
    fs::remove_all(dir);
  }

  TEST_CASE("zero_stage 1: saved on 2 ranks at step 3, resumed on 3, the uninterrupted unsharded run's bytes") {
    // Deterministic reducer and Adam: the sharded state is gathered into the file and scattered on
    // another world size; every parameter equals the 1-rank stage-0 run's, bit for bit.
    const fs::path dir = fs::temp_directory_path() / fmt::format("loom-zero-dist-{}", ::getpid());
    fs::create_directories(dir);
    const fs::path file = dir / "run.pt", result = dir / "params.txt";
    const loom::TrainerOptions sharded{.reducer = {.deterministic = true}, .zero_stage = 1};
    auto adam = [](loom::test::Mlp& m) { return torch::optim::Adam(m.params, torch::optim::AdamOptions(0.01)); };

    loom::LocalCommunicator local;
    loom::test::Mlp whole(at::kDouble);
    auto whole_adam = adam(whole);
    {
      loom::BatchLoader loader(local, loom::test::trainer_shapes(), loom::test::trainer_fetch(),
                               loom::test::kTrainerPlan);
      loom::Trainer trainer(local, whole.list(), whole_adam, {.reducer = {.deterministic = true}});
      for (int64_t e = 0; e < 2; ++e)
        for (loom::Batch& b : trainer.epoch(loader, e)) trainer.backward(loom::test::mean_loss(whole, b), b);
    }

    loom::test::run_ranks(2,
                          [&](loom::GlooCommunicator& comm) {
                            loom::test::Mlp model(at::kDouble);
                            auto opt = adam(model);
                            loom::BatchLoader loader(comm, loom::test::trainer_shapes(), loom::test::trainer_fetch(),
                                                     loom::test::kTrainerPlan);
                            loom::Trainer trainer(comm, model.list(), opt, sharded);
                            trainer.on_step([&](const loom::SyncResult&) {
                              if (trainer.steps() == 3) {
                                loom::save_checkpoint(file, trainer, loader);
                                trainer.stop();
                              }
                            });
                            for (loom::Batch& b : trainer.epoch(loader, 0))
                              trainer.backward(loom::test::mean_loss(model, b), b);
                            if (!trainer.stopped()) throw std::runtime_error("the run did not stop at step 3");
                            if (!opt.state().empty()) throw std::runtime_error("the optimizer passed in kept state");
                          },
                          {.comm_timeout = std::chrono::seconds(30), .spawn_timeout = std::chrono::seconds(120)});

    loom::test::run_ranks(3,
                          [&](loom::GlooCommunicator& comm) {
                            loom::test::Mlp model(at::kDouble, /*seed=*/5.0);
                            auto opt = adam(model);
                            loom::BatchLoader loader(comm, loom::test::trainer_shapes(), loom::test::trainer_fetch(),
                                                     loom::test::kTrainerPlan);
                            loom::Trainer trainer(comm, model.list(), opt, sharded);
                            const auto info = loom::load_checkpoint(file, trainer, loader);
                            for (int64_t e = info.cursor.epoch; e < 2; ++e)
                              for (loom::Batch& b : trainer.epoch(loader, e))
                                trainer.backward(loom::test::mean_loss(model, b), b);
                            if (comm.rank() == 0) loom::test::write_values(result.string(), model.params);
                          },
                          {.comm_timeout = std::chrono::seconds(30), .spawn_timeout = std::chrono::seconds(120)});

    const std::vector<double> expected = loom::test::flat_values(whole.params);
    const std::vector<double> resumed = loom::test::read_values(result.string());
    REQUIRE(resumed.size() == expected.size());
    CHECK(loom::test::max_relative_difference(expected, resumed) == 0.0);
    fs::remove_all(dir);
  }

  TEST_CASE("zero_stage: ranks that set different stages get a loom error naming each rank's") {
    const fs::path dir = fs::temp_directory_path() / fmt::format("loom-zero-stage-{}", ::getpid());
    fs::create_directories(dir);
    loom::test::run_ranks(2,
                          [&](loom::GlooCommunicator& comm) {
                            loom::test::Mlp model(at::kDouble);
                            torch::optim::SGD sgd(model.params, 0.1);
                            try {
                              loom::Trainer trainer(comm, model.list(), sgd, {.zero_stage = comm.rank() == 0 ? 1 : 0});
                            } catch (const loom::InvalidArgument& e) {
                              std::ofstream(dir / fmt::format("error-{}.txt", comm.rank())) << e.what();
                            }
                          },
                          {.comm_timeout = std::chrono::seconds(30), .spawn_timeout = std::chrono::seconds(120)});
    for (int r = 0; r < 2; ++r) {
      std::ifstream in(dir / fmt::format("error-{}.txt", r));
      const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      CAPTURE(r);
      CHECK(text.find("different TrainerOptions::zero_stage values (by rank: 1, 0)") != std::string::npos);
    }
    fs::remove_all(dir);
  }

  TEST_CASE("checkpoint: a save rank 0 cannot write is a loom error on every rank") {
    // The folder would sit under a regular file: it cannot be created.
    const fs::path blocker = fs::temp_directory_path() / fmt::format("loom-blocker-{}", ::getpid());
    std::ofstream(blocker) << "a file, not a folder\n";
    const fs::path nowhere = blocker / "sub" / "c.pt";
    loom::test::run_ranks(2,
                          [&](loom::GlooCommunicator& comm) {
                            loom::test::TrainerSetup run(comm);
                            std::string what = "(no error)";
                            try {
                              loom::save_checkpoint(nowhere, run.trainer, run.loader);
                            } catch (const loom::Error& e) {
                              what = e.what();
                            }
                            if (what.find("rank 0 could not save " + nowhere.string() + ": cannot create the folder " +
                                          nowhere.parent_path().string()) == std::string::npos)
                              throw std::runtime_error(fmt::format("rank {}: {}", comm.rank(), what));
                          },
                          {.comm_timeout = std::chrono::seconds(30), .spawn_timeout = std::chrono::seconds(120)});
    fs::remove(blocker);
  }
}

}  // namespace test_checkpoint_dist
