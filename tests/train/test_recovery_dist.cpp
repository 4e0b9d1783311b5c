// A rank dies and the job goes on (ProcessGroupOptions::elastic, loom::Trainer's recovery): real
// ranks over Gloo on loopback, one of them killed with SIGKILL at a chosen moment (in forward,
// during backward's all-reduce, inside the optimizer step, during a checkpoint save). The survivors
// finish the run; every training sample is trained exactly once per epoch (counted by index from
// every rank's log of the batches it passed to backward); in deterministic mode the final weights
// are bit-identical to the uninterrupted run's, in float mode equal to 1e-12 relative.
//
// Data and model: tests/train/trainer_fixture.hpp (29 sequences, a float64 MLP); 3 batches of at
// most 2 samples per step; SGD with momentum (state the survivors share).
#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <doctest/doctest.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>

#include <loom/dist/run.hpp>
#include <loom/train/checkpoint.hpp>
#include <loom/train/evaluate.hpp>

#include "support/temp_dir.hpp"
#include "trainer_fixture.hpp"

namespace test_recovery_dist {

namespace fs = std::filesystem;

namespace {

/// Where a rank kills itself: the first time it reaches `moment` in step `step` or later of `epoch`.
struct Kill {
  enum class Moment { forward, all_reduce, optimizer_step, checkpoint, evaluation };
  int victim = -1;  ///< launch rank
  Moment moment = Moment::forward;
  int64_t epoch = 0;
  int64_t step = 0;
};

struct Run {
  int nproc = 3;
  int min_ranks = 1;
  bool deterministic = true;
  int64_t epochs = 2;
  std::vector<Kill> kills{};
  bool elastic = true;
  int64_t checkpoint_every = 0;  // > 0: TrainerOptions::checkpoint in the run's folder, every N steps
  int attempt = 0;               // a rerun of the same job logs its batches as attempt 1
  bool evaluate = false;         // loom::evaluate over the training set after each epoch
};

// 3 batches of at most 2 samples per step (5 steps an epoch): every rank of 3 has a batch in most steps.
const loom::GlobalBatchOptions kPlan{.seed = 3, .max_samples = 2, .batches_per_step = 3};

bool reached(const Kill& k, int launch, Kill::Moment moment, int64_t epoch, int64_t step) {
  return k.victim == launch && k.moment == moment && (epoch > k.epoch || (epoch == k.epoch && step >= k.step));
}

/// Trains `run` in `dir`: every rank logs "epoch step generation index..." per batch to
/// batches-<launch rank>.txt and the final parameters to params-<launch rank>.txt.
void train(const Run& run, const fs::path& dir) {
  loom::run(
      [&](loom::ProcessGroup& pg) {
        const int me = pg.launch_rank();
        auto check_kill = [&](Kill::Moment moment, int64_t epoch, int64_t step) {
          for (const Kill& k : run.kills)
            if (reached(k, me, moment, epoch, step)) std::raise(SIGKILL);
        };
        loom::test::Mlp model(at::kDouble);
        torch::optim::SGD sgd(model.params, torch::optim::SGDOptions(0.05).momentum(0.9));
        loom::BatchLoader loader(pg, loom::test::trainer_shapes(), loom::test::trainer_fetch(), kPlan);
        std::optional<loom::CheckpointOptions> checkpoint;
        if (run.checkpoint_every > 0)
          checkpoint = loom::CheckpointOptions{.file = dir / "auto.ckpt", .every_steps = run.checkpoint_every};
        loom::Trainer trainer(pg, model.list(), sgd,
                              {.reducer = {.deterministic = run.deterministic}, .checkpoint = checkpoint});
        std::FILE* log = std::fopen((dir / fmt::format("batches-{}.txt", me)).c_str(), "a");
        int64_t epoch = 0, step = 0;
        bool arm_all_reduce = false;
        // w1's gradient is the last one backward computes: the other ranks are in the all-reduce.
        model.params[0].register_hook([&](const at::Tensor& g) {
          if (arm_all_reduce) std::raise(SIGKILL);
          return g;
        });
        trainer.before_step([&](const loom::SyncResult&) { check_kill(Kill::Moment::optimizer_step, epoch, step); });
        // Every 4th step (counted alike on every rank; `step` is this rank's last batch's) saves.
        trainer.on_step([&](const loom::SyncResult&) {
          if (trainer.steps() % 4 != 0) return;
          check_kill(Kill::Moment::checkpoint, epoch, step);
          loom::save_checkpoint(dir / "run.ckpt", trainer, loader);
        });
        for (epoch = 0; epoch < run.epochs; ++epoch) {
          for (loom::Batch& b : trainer.epoch(loader, epoch)) {
            step = b.step;
            check_kill(Kill::Moment::forward, epoch, step);
            std::fprintf(log, "%lld %lld %d", static_cast<long long>(epoch), static_cast<long long>(b.step),
                         100 * run.attempt + pg.generation());
            for (int64_t i : b.indices) std::fprintf(log, " %lld", static_cast<long long>(i));
            std::fprintf(log, "\n");
            std::fflush(log);
            arm_all_reduce = false;
            for (const Kill& k : run.kills)
              arm_all_reduce = arm_all_reduce || (b.step_end && reached(k, me, Kill::Moment::all_reduce, epoch, step));
            trainer.backward(loom::test::mean_loss(model, b), b);
            arm_all_reduce = false;
          }
          if (run.evaluate) {
            loom::BatchLoader val(pg, loom::test::trainer_shapes(), loom::test::trainer_fetch(),
                                  {.shuffle = false, .max_samples = 4, .batches_per_step = 3});
            (void)loom::evaluate(pg, val, [&](loom::Batch& b) {
              check_kill(Kill::Moment::evaluation, epoch, 0);
              return model.forward(b.data.mean(1));
            });
          }
        }
        std::fclose(log);
        loom::test::write_values((dir / fmt::format("params-{}.txt", me)).string(), model.params);
        std::ofstream((dir / fmt::format("recoveries-{}.txt", me)).string()) << trainer.recoveries().size();
      },
      {.nproc = run.nproc,
       .group = {.backend = loom::Backend::gloo,
                 .timeout = std::chrono::seconds(30),
                 .elastic =
                     run.elastic ? std::optional(loom::ElasticOptions{.min_ranks = run.min_ranks}) : std::nullopt},
       .spawn = {.timeout = std::chrono::seconds(120), .grace = std::chrono::seconds(100)}});
}

/// Every epoch's samples counted from the batch logs: for each step, the batches of the last
/// generation that ran it (an interrupted attempt is replaced by the survivors' re-run).
std::map<int64_t, std::map<int64_t, int>> trained_counts(const fs::path& dir, int nproc) {
  struct Line {
    int generation;
    std::vector<int64_t> indices;
  };
  std::map<std::pair<int64_t, int64_t>, std::vector<Line>> by_step;
  for (int r = 0; r < nproc; ++r) {
    std::ifstream in(dir / fmt::format("batches-{}.txt", r));
    std::string text;
    while (std::getline(in, text)) {
      std::istringstream fields(text);
      int64_t epoch = 0, step = 0;
      Line line{};
      fields >> epoch >> step >> line.generation;
      for (int64_t i = 0; fields >> i;) line.indices.push_back(i);
      by_step[{epoch, step}].push_back(line);
    }
  }
  std::map<int64_t, std::map<int64_t, int>> counts;
  for (const auto& [key, lines] : by_step) {
    int last = 0;
    for (const Line& l : lines) last = std::max(last, l.generation);
    for (const Line& l : lines)
      if (l.generation == last)
        for (int64_t i : l.indices) ++counts[key.first][i];
  }
  return counts;
}

void check_each_sample_once(const fs::path& dir, const Run& run) {
  const auto counts = trained_counts(dir, run.nproc);
  REQUIRE(static_cast<int64_t>(counts.size()) == run.epochs);
  for (const auto& [epoch, per_sample] : counts) {
    CAPTURE(epoch);
    CHECK(static_cast<int64_t>(per_sample.size()) == loom::test::kTrainerSamples);
    for (const auto& [index, n] : per_sample) {
      CAPTURE(index);
      CHECK(n == 1);
    }
  }
}

/// Runs `run` (survivors must end without an error; spawn reports only the killed ranks) and
/// returns each survivor's final parameters by launch rank.
std::map<int, std::vector<double>> survivors_params(const Run& run, const fs::path& dir) {
  std::set<int> victims;
  for (const Kill& k : run.kills) victims.insert(k.victim);
  try {
    train(run, dir);
  } catch (const loom::SpawnError& e) {
    for (const auto& f : e.failures()) {
      CAPTURE(e.what());
      CHECK(f.kind == loom::RankFailure::Kind::signal);
      CHECK(victims.count(f.rank) == 1);
    }
  }
  std::map<int, std::vector<double>> out;
  for (int r = 0; r < run.nproc; ++r)
    if (!victims.count(r)) {
      out[r] = loom::test::read_values((dir / fmt::format("params-{}.txt", r)).string());
      std::ifstream in(dir / fmt::format("recoveries-{}.txt", r));
      int recoveries = -1;
      in >> recoveries;
      CHECK(recoveries == static_cast<int>(victims.size()));
    }
  return out;
}

std::vector<double> uninterrupted(const Run& like) {
  static std::map<std::pair<int, bool>, std::vector<double>> cache;
  const auto key = std::make_pair(like.nproc, like.deterministic);
  if (auto it = cache.find(key); it != cache.end()) return it->second;
  loom::test::TempDir dir("loom-recovery-ref");
  Run run = like;
  run.kills.clear();
  train(run, dir.path);
  check_each_sample_once(dir.path, run);
  auto params = loom::test::read_values((dir.path / "params-0.txt").string());
  cache[key] = params;
  return params;
}

void check_recovered(const Run& run) {
  const std::vector<double> reference = uninterrupted(run);
  loom::test::TempDir dir("loom-recovery");
  const auto survivors = survivors_params(run, dir.path);
  if (std::getenv("LOOM_TEST_DEBUG"))
    for (int r = 0; r < run.nproc; ++r) MESSAGE(loom::test::read_file(dir.path / fmt::format("batches-{}.txt", r)));
  check_each_sample_once(dir.path, run);
  REQUIRE_FALSE(survivors.empty());
  for (const auto& [rank, params] : survivors) {
    CAPTURE(rank);
    REQUIRE(params.size() == reference.size());
    if (run.deterministic)
      CHECK(params == reference);  // bit for bit: the values are written with 17 significant digits
    else
      CHECK(loom::test::max_relative_difference(params, reference) < 1e-12);
  }
}

using Moment = Kill::Moment;

/// A run that ended with `e`: `victim` killed by a signal, every other rank failed with a loom
/// exception whose text `check(message)` reads; returns how many others failed.
template <class Check>
int check_failures(const loom::SpawnError& e, int victim, Check check) {
  CAPTURE(e.what());
  int others = 0;
  for (const auto& f : e.failures()) {
    if (f.rank == victim) {
      CHECK(f.kind == loom::RankFailure::Kind::signal);
      continue;
    }
    CHECK(f.kind == loom::RankFailure::Kind::exception);
    check(f.message);
    ++others;
  }
  return others;
}

}  // namespace

TEST_SUITE("recovery") {
  TEST_CASE(
      "deterministic, 3 ranks: a rank killed in forward, in the all-reduce, in the optimizer step or in a "
      "checkpoint save; the survivors end with the uninterrupted run's weights, every sample once") {
    SUBCASE("rank 1 in forward, step 2") {
      check_recovered({.kills = {{1, Moment::forward, 0, 2}}});
    }
    SUBCASE("rank 2 in the all-reduce, step 4") {
      check_recovered({.kills = {{2, Moment::all_reduce, 0, 4}}});
    }
    SUBCASE("rank 1 in the optimizer step, epoch 1 step 3") {
      check_recovered({.kills = {{1, Moment::optimizer_step, 1, 3}}});
    }
    SUBCASE("rank 0 (the store is spawn's) in the all-reduce, step 2") {
      check_recovered({.kills = {{0, Moment::all_reduce, 0, 2}}});
    }
    SUBCASE("rank 2 before a checkpoint save, step 3") {
      check_recovered({.kills = {{2, Moment::checkpoint, 0, 3}}});
    }
  }

  TEST_CASE("float mode, 3 ranks: rank 2 killed in the all-reduce; every sample once, weights equal to 1e-12") {
    check_recovered({.deterministic = false, .kills = {{2, Moment::all_reduce, 0, 4}}});
  }

  TEST_CASE("deterministic, 4 ranks: two ranks killed one after the other") {
    check_recovered({.nproc = 4, .kills = {{2, Moment::forward, 0, 3}, {1, Moment::all_reduce, 1, 2}}});
  }

  TEST_CASE(
      "the restart path: a job with TrainerOptions::checkpoint dies (not elastic), the same program rerun on "
      "2 ranks resumes by itself; every sample once, the uninterrupted run's weights") {
    const std::vector<double> reference = uninterrupted(Run{});
    loom::test::TempDir dir("loom-recovery-restart");
    Run first{.kills = {{1, Moment::forward, 1, 2}}, .elastic = false, .checkpoint_every = 2};
    CHECK_THROWS_AS(train(first, dir.path), loom::SpawnError);  // rank 1 killed, the others' CommErrors
    REQUIRE(std::filesystem::exists(dir.path / "auto.ckpt"));
    Run second{.nproc = 2, .elastic = false, .checkpoint_every = 2, .attempt = 1};
    train(second, dir.path);
    check_each_sample_once(dir.path, first);
    for (int r = 0; r < 2; ++r) {
      CAPTURE(r);
      CHECK(loom::test::read_values((dir.path / fmt::format("params-{}.txt", r)).string()) == reference);
    }
  }

  TEST_CASE("a rank killed in loom::evaluate (outside the Trainer): the others end with a loom error, none hangs") {
    loom::test::TempDir dir("loom-recovery-eval");
    const auto start = std::chrono::steady_clock::now();
    try {
      train({.kills = {{2, Moment::evaluation, 0, 0}}, .evaluate = true}, dir.path);
      FAIL("the run should have failed");
    } catch (const loom::SpawnError& e) {
      CHECK(check_failures(e, 2, [](const std::string& message) {
              CHECK(message.find("loom::CommError") != std::string::npos);
              // The peer named is rank 2, or a survivor whose own failure closed its connections first.
              CHECK(message.find("closed its connection") != std::string::npos);
            }) == 2);
    }
    CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(30));
  }

  TEST_CASE("below the minimum: every survivor ends with a loom error naming who died") {
    loom::test::TempDir dir("loom-recovery-min");
    Run run{.min_ranks = 3, .kills = {{1, Moment::forward, 0, 2}}, .checkpoint_every = 1};
    try {
      train(run, dir.path);
      FAIL("the run should have failed");
    } catch (const loom::SpawnError& e) {
      const std::string file = (dir.path / "auto.ckpt").string();
      CHECK(check_failures(e, 1, [&](const std::string& message) {
              CHECK(message.find("launch rank(s) 1 died") != std::string::npos);
              CHECK(message.find("fewer than ElasticOptions::min_ranks = 3") != std::string::npos);
              CHECK(message.find(fmt::format("this Trainer's last checkpoint: {}", file)) != std::string::npos);
            }) == 2);
    }
  }
}

}  // namespace test_recovery_dist
