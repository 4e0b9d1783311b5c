// loom::Trainer, Metrics and run() on real ranks (Gloo on loopback).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <unistd.h>
#include <vector>

#include <doctest/doctest.h>
#include <fmt/format.h>
#include <torch/torch.h>

#include <loom/comm/gloo.hpp>
#include <loom/dist/run.hpp>
#include <loom/log/named_metrics.hpp>
#include <loom/log/progress.hpp>
#include <loom/log/sink.hpp>

#include "support/ranks.hpp"
#include "trainer_fixture.hpp"

namespace test_trainer_dist {

namespace {

void expect(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error("check failed: " + what);
}

}  // namespace

TEST_SUITE("dist") {
  TEST_CASE(
      "run with nproc 2: the same entry point spawns 2 ranks; the short path equals the hand-written loop bit for "
      "bit") {
    loom::run(
        [](loom::ProcessGroup& pg) {
          expect(pg.world_size() == 2, fmt::format("world size {}", pg.world_size()));
          expect(pg.backend() == loom::Backend::gloo, "Gloo on a CPU machine");
          const auto short_path = loom::test::train_short(pg, 2);
          const auto by_hand = loom::test::train_by_hand(pg, 2);
          for (std::size_t k = 0; k < short_path.size(); ++k)
            expect(torch::equal(short_path[k], by_hand[k]),
                   fmt::format("parameter {} differs on rank {}", k, pg.rank()));
          // Every rank holds the same parameters.
          for (const auto& p : short_path) {
            auto all = pg.all_gather(p.detach().contiguous());
            expect(torch::equal(all[0], all[1]), "replicas differ");
          }
        },
        {.nproc = 2, .group = {.timeout = std::chrono::seconds(30)}, .spawn = {.timeout = std::chrono::seconds(120)}});
  }

  TEST_CASE("run with nproc 1 and 2 train to the same parameters (world-size invariance through the short path)") {
    std::vector<double> one;
    loom::run([&](loom::ProcessGroup& pg) { one = loom::test::flat_values(loom::test::train_short(pg, 2)); });
    // The 2-rank run writes rank 0's parameters through a pipe-free channel: a file.
    const std::string path = fmt::format("/tmp/loom-trainer-{}.txt", ::getpid());
    loom::run(
        [&](loom::ProcessGroup& pg) {
          const auto params = loom::test::train_short(pg, 2);
          if (pg.rank() == 0) loom::test::write_values(path, params);
        },
        {.nproc = 2, .spawn = {.timeout = std::chrono::seconds(120)}});
    const std::vector<double> two = loom::test::read_values(path);
    std::remove(path.c_str());
    REQUIRE(one.size() == two.size());
    const double relative = loom::test::max_relative_difference(one, two);
    MESSAGE(fmt::format("nproc 1 vs 2: max relative difference {:.3g}", relative));
    CHECK(relative < 1e-12);
  }

  TEST_CASE("a loader with 2 workers on 2 and 3 ranks trains to the parameters of 1 rank loading on its own thread") {
    std::vector<double> one;
    loom::run([&](loom::ProcessGroup& pg) { one = loom::test::flat_values(loom::test::train_short(pg, 2)); });
    for (const int nproc : {2, 3}) {
      CAPTURE(nproc);
      const std::string path = fmt::format("/tmp/loom-trainer-workers-{}.txt", ::getpid());
      loom::run(
          [&](loom::ProcessGroup& pg) {
            const auto params = loom::test::train_short(pg, 2, {.num_workers = 2, .prefetch_factor = 1});
            if (pg.rank() == 0) loom::test::write_values(path, params);
          },
          {.nproc = nproc, .spawn = {.timeout = std::chrono::seconds(120)}});
      const std::vector<double> many = loom::test::read_values(path);
      std::remove(path.c_str());
      REQUIRE(one.size() == many.size());
      CHECK(loom::test::max_relative_difference(one, many) < 1e-12);
    }
  }

  TEST_CASE(
      "on_step runs equally often on every rank although the loop body does not; Progress::add_global needs no "
      "collective") {
    loom::run(
        [](loom::ProcessGroup& pg) {
          loom::test::Mlp model(at::kDouble);
          torch::optim::SGD sgd(model.params, torch::optim::SGDOptions(0.05));
          loom::BatchLoader loader(pg, loom::test::trainer_shapes(), loom::test::trainer_fetch(),
                                   loom::test::kTrainerPlan);
          loom::Trainer trainer(pg, model.list(), sgd);
          loom::MemorySink sink;
          loom::Progress progress{sink, loom::rank_info(pg), {.total = loom::test::kTrainerSamples, .label = "train"}};
          int64_t steps = 0, global = 0, bodies = 0;
          trainer.on_step([&](const loom::SyncResult& r) {
            ++steps;
            global += r.global_samples;
            progress.add_global(r.global_samples);
          });
          for (loom::Batch& b : trainer.epoch(loader, 0)) {
            trainer.backward(loom::test::mean_loss(model, b), b);
            ++bodies;
          }
          progress.finish(pg);
          const auto plan_steps = static_cast<int64_t>(loader.sampler().plan().steps.size());
          expect(steps == plan_steps,
                 fmt::format("rank {}: on_step ran {} times for {} steps", pg.rank(), steps, plan_steps));
          expect(global == loom::test::kTrainerSamples, fmt::format("rank {}: global samples {}", pg.rank(), global));
          expect(progress.global_samples() == loom::test::kTrainerSamples, "Progress counted every sample once");
          // The loop bodies differ between ranks (the dealing is uneven), which is why on_step exists.
          auto t = torch::tensor({static_cast<double>(bodies)}, torch::kDouble);
          auto all = pg.all_gather(t);
          expect(all[0].item<double>() + all[1].item<double>() ==
                     static_cast<double>(loader.sampler().plan().batches.size()),
                 "every batch ran once over the ranks");
        },
        {.nproc = 2, .spawn = {.timeout = std::chrono::seconds(120)}});
  }

  TEST_CASE(
      "a loop left early (break) on 3 ranks, some idle in every step: every rank stops with the loom error, none "
      "waits for a collective") {
    // 3 ranks and 2 batches per step: in every step at least one rank has no batch and takes the step's
    // boundary inside the range, so "right after a boundary" is a different step on different ranks.
    struct Case {
      const char* name;
      bool (*leaves)(int rank, bool boundary);
    };
    const Case cases[] = {
        {"every rank breaks right after its first step boundary", [](int, bool boundary) { return boundary; }},
        {"rank 1 alone breaks after its first batch", [](int rank, bool) { return rank == 1; }},
    };
    for (const Case& c : cases) {
      const std::string name = c.name;
      CAPTURE(name);
      const auto started = std::chrono::steady_clock::now();
      loom::test::run_ranks(
          3,
          [&](loom::GlooCommunicator& comm) {
            loom::test::Mlp model(at::kDouble);
            torch::optim::SGD sgd(model.params, torch::optim::SGDOptions(0.05));
            loom::BatchLoader loader(comm, loom::test::trainer_shapes(), loom::test::trainer_fetch(),
                                     loom::test::kTrainerPlan);
            loom::Trainer trainer(comm, model.list(), sgd);
            int64_t idle_steps = 0;
            for (const auto& st : loader.sampler().plan().steps) idle_steps += st.num_batches < 3 ? 1 : 0;
            expect(idle_steps == static_cast<int64_t>(loader.sampler().plan().steps.size()),
                   "some rank is idle in every step");
            std::string what = "(no error)";
            try {
              for (loom::Batch& b : trainer.epoch(loader, 0))
                if (c.leaves(comm.rank(), trainer.backward(loom::test::mean_loss(model, b), b).boundary)) break;
            } catch (const loom::Error& e) {
              what = e.what();
            }
            expect(what.find("call trainer.stop() from on_step()") != std::string::npos,
                   fmt::format("rank {}: {}", comm.rank(), what));
          },
          {.comm_timeout = std::chrono::seconds(30), .spawn_timeout = std::chrono::seconds(120)});
      // A rank left waiting would have failed with the 30 s collective timeout instead.
      CHECK(std::chrono::steady_clock::now() - started < std::chrono::seconds(25));
    }
  }

  TEST_CASE("a break right after the boundary at which stop() took effect is that stop, on 3 ranks idle in steps") {
    loom::test::run_ranks(
        3,
        [&](loom::GlooCommunicator& comm) {
          loom::test::Mlp model(at::kDouble);
          torch::optim::SGD sgd(model.params, torch::optim::SGDOptions(0.05));
          loom::BatchLoader loader(comm, loom::test::trainer_shapes(), loom::test::trainer_fetch(),
                                   loom::test::kTrainerPlan);
          loom::Trainer trainer(comm, model.list(), sgd);
          bool stopping = false;
          trainer.on_step([&](const loom::SyncResult&) {
            if (trainer.steps() == 2) {
              trainer.stop();
              stopping = true;
            }
          });
          for (loom::Batch& b : trainer.epoch(loader, 0))
            if (trainer.backward(loom::test::mean_loss(model, b), b).boundary && stopping) break;
          expect(trainer.stopped() && trainer.steps() == 2,
                 fmt::format("rank {}: stopped {} after {} steps", comm.rank(), trainer.stopped(), trainer.steps()));
          trainer.on_step(nullptr);
          for (loom::Batch& b : trainer.epoch(loader, 1)) trainer.backward(loom::test::mean_loss(model, b), b);
          for (const auto& p : model.params) {
            auto all = comm.all_gather(p.detach().contiguous());
            expect(torch::equal(all[0], all[1]) && torch::equal(all[0], all[2]), "replicas differ");
          }
        },
        {.comm_timeout = std::chrono::seconds(30), .spawn_timeout = std::chrono::seconds(120)});
  }

  TEST_CASE("a rank that cannot prepare the epoch (resumed into another epoch) stops every rank") {
    loom::GlobalCursor cursor;
    {
      loom::GlobalBatchSampler sampler(loom::test::trainer_shapes(), loom::test::kTrainerPlan);
      while (sampler.next()) {
      }
      cursor = sampler.cursor();  // epoch 1, step 0
    }
    loom::test::run_ranks(
        2,
        [&](loom::GlooCommunicator& comm) {
          loom::test::Mlp model(at::kDouble);
          torch::optim::SGD sgd(model.params, torch::optim::SGDOptions(0.05));
          loom::BatchLoader loader(comm, loom::test::trainer_shapes(), loom::test::trainer_fetch(),
                                   loom::test::kTrainerPlan);
          if (comm.rank() == 0) loader.resume(cursor);  // only rank 0 read the checkpoint
          loom::Trainer trainer(comm, model.list(), sgd);
          std::string what = "(no error)";
          try {
            (void)trainer.epoch(loader, 0);
          } catch (const loom::InvalidArgument& e) {
            what = e.what();
          }
          const char* expected = comm.rank() == 0 ? "start the epoch loop at the cursor's epoch (1"
                                                  : "Trainer::epoch(0): rank 0 could not prepare the epoch";
          expect(what.find(expected) != std::string::npos, fmt::format("rank {}: {}", comm.rank(), what));
        },
        {.comm_timeout = std::chrono::seconds(30), .spawn_timeout = std::chrono::seconds(120)});
  }

  TEST_CASE("ranks that plan differently are a loom error on every rank, naming the rank and what differs") {
    struct Case {
      const char* name;
      const char* expected;
      void (*change)(int rank, std::vector<std::vector<int64_t>>& shapes, loom::GlobalBatchOptions& plan);
    };
    const Case cases[] = {
        {"a seed taken from the rank", "rank 1 has seed 4, rank 0 has seed 3",
         [](int rank, std::vector<std::vector<int64_t>>&, loom::GlobalBatchOptions& plan) {
           plan.seed = 3 + static_cast<uint64_t>(rank);
         }},
        {"shapes listed in another order", "rank 1 has fingerprint (options and shapes)",
         [](int rank, std::vector<std::vector<int64_t>>& shapes, loom::GlobalBatchOptions&) {
           if (rank == 1) std::reverse(shapes.begin(), shapes.end());
         }},
        {"other batching options", "rank 1 has fingerprint (options and shapes)",
         [](int rank, std::vector<std::vector<int64_t>>&, loom::GlobalBatchOptions& plan) {
           if (rank == 1) plan.max_samples = 2;
         }},
    };
    for (const Case& c : cases) {
      const std::string name = c.name;
      CAPTURE(name);
      loom::test::run_ranks(
          2,
          [&](loom::GlooCommunicator& comm) {
            loom::test::Mlp model(at::kDouble);
            torch::optim::SGD sgd(model.params, torch::optim::SGDOptions(0.05));
            auto shapes = loom::test::trainer_shapes();
            auto plan = loom::test::kTrainerPlan;
            c.change(comm.rank(), shapes, plan);
            // The fetch follows the (possibly reordered) shapes, so only the plan check can object.
            auto fetch = [&shapes](int64_t i) {
              auto [x, y] = loom::test::trainer_sample(0);
              return std::make_pair(torch::zeros(shapes[static_cast<std::size_t>(i)], torch::kDouble), y);
            };
            loom::BatchLoader loader(comm, shapes, fetch, plan);
            loom::Trainer trainer(comm, model.list(), sgd);
            std::string what = "(no error)";
            try {
              (void)trainer.epoch(loader, 0);
            } catch (const loom::InvalidArgument& e) {
              what = e.what();
            }
            expect(what.find(c.expected) != std::string::npos, fmt::format("rank {}: {}", comm.rank(), what));
            expect(what.find("Trainer::epoch(0): the ranks plan different steps") != std::string::npos,
                   fmt::format("rank {}: {}", comm.rank(), what));
          },
          {.comm_timeout = std::chrono::seconds(30), .spawn_timeout = std::chrono::seconds(120)});
    }
  }

  TEST_CASE("replicas that drift apart are a loom error on every rank, naming the rank, the group and the option") {
    // The per-batch learning-rate habit: the loop body changes lr after every backward. Steps whose
    // batches are dealt unevenly run the body more often on one rank, so the next step's window
    // compares different options.
    loom::test::run_ranks(2,
                          [](loom::GlooCommunicator& comm) {
                            loom::test::TrainerSetup setup(comm);
                            auto& [model, sgd, loader, trainer] = setup;
                            std::string what = "(no error)";
                            int64_t body_runs = 0;
                            try {
                              for (loom::Batch& b : trainer.epoch(loader, 0)) {
                                trainer.backward(loom::test::mean_loss(model, b), b);
                                auto& options = sgd.param_groups()[0].options();
                                options.set_lr(options.get_lr() * 0.5);
                                ++body_runs;
                              }
                            } catch (const loom::Error& e) {
                              what = e.what();
                            }
                            // At the next step's window, or the epoch's last window when the last step was uneven.
                            expect(what.find("Trainer: the replicas differ ") != std::string::npos,
                                   fmt::format("rank {} (body ran {} times): {}", comm.rank(), body_runs, what));
                            expect(what.find("parameter group 0's option lr is") != std::string::npos, what);
                            expect(what.find("on rank 1 but") != std::string::npos, what);
                            expect(what.find("on_step()") != std::string::npos, what);
                            // The step that found it was not applied, and no replica went on alone.
                            for (const auto& p : model.params) {
                              auto all = comm.all_gather(p.detach().contiguous());
                              expect(torch::equal(all[0], all[1]), "replicas differ after the error");
                            }
                          },
                          {.comm_timeout = std::chrono::seconds(30), .spawn_timeout = std::chrono::seconds(120)});
  }

  TEST_CASE("the same schedule in on_step trains every replica alike; a parameter changed on one rank is named") {
    loom::test::run_ranks(
        2,
        [](loom::GlooCommunicator& comm) {
          loom::test::TrainerSetup setup(comm);
          auto& [model, sgd, loader, trainer] = setup;
          int calls = 0;
          trainer.on_step([&](const loom::SyncResult&) {
            auto& options = sgd.param_groups()[0].options();
            options.set_lr(options.get_lr() * 0.9);
            ++calls;
          });
          for (loom::Batch& b : trainer.epoch(loader, 0)) trainer.backward(loom::test::mean_loss(model, b), b);
          trainer.check_replicas();  // the same everywhere: no error
          const double lr = sgd.param_groups()[0].options().get_lr();
          expect(calls >= 4 && std::abs(lr - 0.05 * std::pow(0.9, calls)) < 1e-15,
                 fmt::format("lr {} after {} calls", lr, calls));
          // A write on rank 1 only, in on_step (where writes are allowed): found at the epoch's end.
          bool written = false;
          trainer.on_step([&](const loom::SyncResult& r) {
            if (comm.rank() == 1 && r.apply && !written) {
              written = true;
              torch::NoGradGuard no_grad;
              model.params[3].add_(1e-12);
            }
          });
          std::string what = "(no error)";
          try {
            for (loom::Batch& b : trainer.epoch(loader, 1)) trainer.backward(loom::test::mean_loss(model, b), b);
          } catch (const loom::Error& e) {
            what = e.what();
          }
          expect(what.find("the replicas differ at the end of epoch 1") != std::string::npos,
                 fmt::format("rank {}: {}", comm.rank(), what));
          expect(what.find("parameter 3 ('b2') holds other values on rank 1 than on rank 0") != std::string::npos,
                 what);
          // check_replicas names it too, at any point every rank reaches.
          what = "(no error)";
          try {
            trainer.check_replicas();
          } catch (const loom::Error& e) {
            what = e.what();
          }
          expect(what.find("Trainer::check_replicas: the replicas differ: parameter 3 ('b2')") != std::string::npos,
                 what);
        },
        {.comm_timeout = std::chrono::seconds(30), .spawn_timeout = std::chrono::seconds(120)});
  }

  TEST_CASE("TrainerOptions::reducer that differ across ranks (deterministic on one rank): named at construction") {
    loom::test::run_ranks(
        2,
        [](loom::GlooCommunicator& comm) {
          loom::test::Mlp model(at::kDouble);
          torch::optim::SGD sgd(model.params, torch::optim::SGDOptions(0.05));
          std::string what = "(no error)";
          try {
            loom::Trainer trainer(comm, model.list(), sgd, {.reducer = {.deterministic = comm.rank() == 1}});
          } catch (const loom::InvalidArgument& e) {
            what = e.what();
          }
          expect(what.find("deterministic is true on rank 1 but false on rank 0") != std::string::npos,
                 fmt::format("rank {}: {}", comm.rank(), what));
        },
        {.comm_timeout = std::chrono::seconds(30), .spawn_timeout = std::chrono::seconds(120)});
  }

  TEST_CASE("float16 parameters on 2 and 3 ranks, idle in a step: no overflow, every replica at the 1-rank value") {
    for (const int nproc : {2, 3}) {
      loom::run(
          [](loom::ProcessGroup& pg) {
            const auto [w, skipped] = loom::test::train_float16(pg);
            expect(skipped == 0, fmt::format("{} steps skipped on rank {}", skipped, pg.rank()));
            expect(w == -1.0, fmt::format("w = {} on rank {} (want -1)", w, pg.rank()));
          },
          {.nproc = nproc,
           .group = {.timeout = std::chrono::seconds(30)},
           .spawn = {.timeout = std::chrono::seconds(120)}});
    }
  }

  TEST_CASE("Metrics by name on 2 ranks: different orders, a name only one rank saw, one collective") {
    loom::test::run_ranks(2,
                          [](loom::GlooCommunicator& comm) {
                            loom::Metrics metrics(comm);
                            if (comm.rank() == 0) {
                              metrics.add("loss", 1.0, 3);
                              metrics.add("acc", 0.25, 4);
                            } else {
                              metrics.add("acc", 0.75, 4);
                              metrics.add("only_rank_1", 5.0, 2);
                              metrics.add("loss", 4.0, 1);
                            }
                            // loss: (1 x 3 + 4 x 1) / 4 = 1.75; acc: (0.25 x 4 + 0.75 x 4) / 8 = 0.5; by position it would mix them.
                            expect(metrics.mean("loss") == 1.75, fmt::format("loss {}", metrics.mean("loss")));
                            expect(metrics.mean("acc") == 0.5, fmt::format("acc {}", metrics.mean("acc")));
                            expect(metrics.mean("only_rank_1") == 5.0, "a name only rank 1 added, read on both ranks");
                            expect(metrics.weight("loss") == 4.0, "weights summed");
                          },
                          {.comm_timeout = std::chrono::seconds(30), .spawn_timeout = std::chrono::seconds(60)});
  }

}  // TEST_SUITE

}  // namespace test_trainer_dist
