// loom::save_checkpoint / load_checkpoint in one process: a run saved mid-epoch and resumed equals
// the uninterrupted run bit for bit (the optimizer's momentum, the cursor and the step count come
// back); a SIGKILL during a save leaves the previous checkpoint whole; every bad file or misfit is
// a loom error naming the file and what is wrong. Multi-rank (2 -> 3 ranks): test_checkpoint_dist.cpp.
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <signal.h>
#include <string>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>
#include <vector>

#include <doctest/doctest.h>
#include <fmt/format.h>
#include <torch/torch.h>

#include <loom/comm/local.hpp>
#include <loom/train/checkpoint.hpp>

#include "trainer_fixture.hpp"

namespace test_checkpoint {

namespace fs = std::filesystem;

namespace {

fs::path temp_file(const std::string& name) {
  const fs::path dir = fs::temp_directory_path() / fmt::format("loom-checkpoint-{}", ::getpid());
  fs::create_directories(dir);
  return dir / name;
}

struct Run {
  loom::LocalCommunicator comm;
  loom::test::Mlp model{at::kDouble};
  torch::optim::SGD sgd{model.params, torch::optim::SGDOptions(0.05).momentum(0.9)};
  loom::BatchLoader<decltype(loom::test::trainer_fetch())> loader{
      comm, loom::test::trainer_shapes(), loom::test::trainer_fetch(), loom::test::kTrainerPlan};
  loom::Trainer<loom::LocalCommunicator, torch::optim::SGD> trainer{comm, model.list(), sgd};

  void epoch(int64_t e) {
    for (loom::Batch& b : trainer.epoch(loader, e)) trainer.backward(loom::test::mean_loss(model, b), b);
  }
};

/// Run with ReducerOptions::deterministic.
struct DeterministicRun {
  loom::LocalCommunicator comm;
  loom::test::Mlp model{at::kDouble};
  torch::optim::SGD sgd{model.params, torch::optim::SGDOptions(0.05).momentum(0.9)};
  loom::BatchLoader<decltype(loom::test::trainer_fetch())> loader{
      comm, loom::test::trainer_shapes(), loom::test::trainer_fetch(), loom::test::kTrainerPlan};
  loom::Trainer<loom::LocalCommunicator, torch::optim::SGD> trainer{
      comm, model.list(), sgd, loom::TrainerOptions{.reducer = {.deterministic = true}}};

  void epoch(int64_t e) {
    for (loom::Batch& b : trainer.epoch(loader, e)) trainer.backward(loom::test::mean_loss(model, b), b);
  }
};

bool equal_params(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t k = 0; k < a.size(); ++k)
    if (!torch::equal(a[k], b[k])) return false;
  return true;
}

}  // namespace

TEST_CASE("checkpoint: saved mid-epoch, resumed in a new run, equals the uninterrupted run bit for bit") {
  const fs::path file = temp_file("mid-epoch.pt");
  Run full;
  full.epoch(0);
  full.epoch(1);

  {
    Run first;
    first.trainer.on_step([&](const loom::SyncResult&) {
      if (first.trainer.steps() == 3) {
        loom::save_checkpoint(file, first.trainer, first.loader, {{"run", "first"}, {"seconds", "12.5"}});
        first.trainer.stop();
      }
    });
    first.epoch(0);
    REQUIRE(first.trainer.stopped());
  }
  REQUIRE(fs::exists(file));
  CHECK_FALSE(fs::exists(file.string() + ".loom-tmp"));

  Run second;  // fresh parameters, no momentum, at step 0
  CHECK_FALSE(equal_params(second.model.params, full.model.params));
  const loom::CheckpointInfo info = loom::load_checkpoint(file, second.trainer, second.loader);
  CHECK(info.cursor.epoch == 0);
  CHECK(info.cursor.step == 3);
  CHECK(info.trainer.steps == 3);
  CHECK(second.trainer.steps() == 3);
  CHECK(info.user == std::map<std::string, std::string>{{"run", "first"}, {"seconds", "12.5"}});
  for (int64_t e = info.cursor.epoch; e < 2; ++e) second.epoch(e);
  CHECK(equal_params(second.model.params, full.model.params));
  CHECK(second.trainer.steps() == full.trainer.steps());

  // Without the optimizer's momentum the resumed run would differ: the test can fail.
  Run no_momentum;
  (void)loom::load_checkpoint(file, no_momentum.trainer, no_momentum.loader);
  no_momentum.sgd.state().clear();
  for (int64_t e = 0; e < 2; ++e) no_momentum.epoch(e);
  CHECK_FALSE(equal_params(no_momentum.model.params, full.model.params));

  // Saved after an epoch loop: resumes at the next epoch's first step.
  const fs::path end_file = temp_file("epoch-end.pt");
  loom::save_checkpoint(end_file, full.trainer, full.loader);
  Run third;
  const auto at_end = loom::load_checkpoint(end_file, third.trainer, third.loader);
  CHECK(at_end.cursor.epoch == 2);
  CHECK(at_end.cursor.step == 0);
  CHECK(at_end.user.empty());
  CHECK(equal_params(third.model.params, full.model.params));

  // Inside an epoch loop: refused before anything changes; the epoch then runs in full.
  Run fourth;
  bool refused = false;
  for (loom::Batch& b : fourth.trainer.epoch(fourth.loader, 0)) {
    if (!refused) {
      CHECK_THROWS_WITH_AS((void)loom::load_checkpoint(file, fourth.trainer, fourth.loader),
                           doctest::Contains("an epoch loop is running"), loom::Error);
      refused = true;
    }
    fourth.trainer.backward(loom::test::mean_loss(fourth.model, b), b);
  }
  CHECK(refused);
  CHECK(fourth.trainer.steps() == static_cast<int64_t>(fourth.loader.sampler().plan().steps.size()));
  fs::remove_all(file.parent_path());
}

TEST_CASE("checkpoint: a SIGKILL during a save leaves the previous checkpoint whole") {
  const fs::path file = temp_file("killed.pt");
  // 2^23 float64 values (64 MiB): a save takes long enough to be caught in the middle.
  auto w = torch::full({1 << 23}, 1.0, torch::kDouble).requires_grad_();
  loom::LocalCommunicator comm;
  torch::optim::SGD sgd(std::vector<at::Tensor>{w}, torch::optim::SGDOptions(0.1));
  const std::vector<std::vector<int64_t>> shapes(8, std::vector<int64_t>{1});
  auto fetch = [](int64_t) {
    return std::make_pair(torch::ones({1}, torch::kDouble), torch::zeros({1}, torch::kDouble));
  };
  loom::BatchLoader loader(comm, shapes, fetch, {.seed = 1, .max_samples = 4, .batches_per_step = 1});
  loom::Trainer trainer(comm, loom::ParameterList{.names = {"w"}, .params = {w}, .buffers = {}}, sgd);
  loom::save_checkpoint(file, trainer, loader, {{"generation", "1"}});

  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {  // saves again and again until killed (no parallel ATen op here: OpenMP after fork hangs)
    for (int k = 0; k < 1000; ++k) loom::save_checkpoint(file, trainer, loader, {{"generation", "2"}});
    ::_exit(0);
  }
  const fs::path tmp = file.string() + ".loom-tmp";
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!(fs::exists(tmp) && fs::file_size(tmp) > (1u << 20)) && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  ::kill(child, SIGKILL);
  int status = 0;
  ::waitpid(child, &status, 0);
  REQUIRE(WIFSIGNALED(status));
  REQUIRE(WTERMSIG(status) == SIGKILL);

  REQUIRE(fs::exists(tmp));  // the kill came while a save was under way

  // The file is a whole checkpoint: the first one, or (if a later save had finished) a later one.
  auto v = torch::zeros({1 << 23}, torch::kDouble).requires_grad_();
  torch::optim::SGD sgd2(std::vector<at::Tensor>{v}, torch::optim::SGDOptions(0.1));
  loom::BatchLoader loader2(comm, shapes, fetch, {.seed = 1, .max_samples = 4, .batches_per_step = 1});
  loom::Trainer trainer2(comm, loom::ParameterList{.names = {"w"}, .params = {v}, .buffers = {}}, sgd2);
  const auto info = loom::load_checkpoint(file, trainer2, loader2);
  const std::string generation = info.user.at("generation");
  CHECK((generation == "1" || generation == "2"));
  CHECK(v.min().item<double>() == 1.0);
  CHECK(v.max().item<double>() == 1.0);
  fs::remove_all(file.parent_path());
}

TEST_CASE("checkpoint: a missing, truncated, foreign or misfit file is a loom error naming it") {
  const fs::path file = temp_file("good.pt");
  {
    Run run;
    run.epoch(0);
    loom::save_checkpoint(file, run.trainer, run.loader);
  }
  Run run;
  auto load = [&](const fs::path& f) { (void)loom::load_checkpoint(f, run.trainer, run.loader); };

  const fs::path missing = temp_file("missing.pt");
  CHECK_THROWS_WITH_AS(load(missing), doctest::Contains((missing.string() + ": no such file").c_str()),
                       loom::DataError);

  std::string bytes;
  {
    std::ifstream in(file, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  const fs::path half = temp_file("half.pt");
  std::ofstream(half, std::ios::binary) << bytes.substr(0, bytes.size() / 2);
  CHECK_THROWS_WITH_AS(
      load(half),
      doctest::Contains(
          fmt::format("{} ({} bytes) is truncated or not a LibTorch archive", half.string(), bytes.size() / 2).c_str()),
      loom::DataError);

  const fs::path text = temp_file("notes.txt");
  std::ofstream(text) << "epoch 3, loss 0.2\n";
  CHECK_THROWS_WITH_AS(load(text), doctest::Contains("is truncated or not a LibTorch archive"), loom::DataError);

  const fs::path empty = temp_file("empty.pt");
  std::ofstream{empty};
  CHECK_THROWS_WITH_AS(load(empty), doctest::Contains((empty.string() + " is empty").c_str()), loom::DataError);

  const fs::path foreign = temp_file("tensor.pt");
  torch::save(torch::ones({3}), foreign.string());
  CHECK_THROWS_WITH_AS(load(foreign), doctest::Contains("is a LibTorch archive but not a loom checkpoint"),
                       loom::DataError);

  // Nothing of the run changed by the failed loads.
  CHECK(run.trainer.steps() == 0);
  CHECK(equal_params(run.model.params, loom::test::Mlp(at::kDouble).params));

  // Another model: named, and nothing loaded.
  auto w = torch::zeros({4}, torch::kDouble).requires_grad_();
  torch::optim::SGD sgd(std::vector<at::Tensor>{w}, torch::optim::SGDOptions(0.1));
  loom::Trainer other(run.comm, loom::ParameterList{.names = {"w"}, .params = {w}, .buffers = {}}, sgd);
  CHECK_THROWS_WITH_AS((void)loom::load_checkpoint(file, other, run.loader),
                       doctest::Contains("holds 4 parameters and 0 buffers, but the Trainer's model has 1 and 0"),
                       loom::InvalidArgument);
  loom::test::Mlp renamed_model(at::kDouble);
  torch::optim::SGD renamed_sgd(renamed_model.params, torch::optim::SGDOptions(0.1));
  auto list = renamed_model.list();
  list.names[2] = "head.weight";
  loom::Trainer renamed(run.comm, list, renamed_sgd);
  CHECK_THROWS_WITH_AS((void)loom::load_checkpoint(file, renamed, run.loader),
                       doctest::Contains("parameter 2 is 'w2' there but 'head.weight' in this model"),
                       loom::InvalidArgument);
  loom::test::Mlp float_model(at::kFloat);
  torch::optim::SGD float_sgd(float_model.params, torch::optim::SGDOptions(0.1));
  loom::Trainer floats(run.comm, float_model.list(), float_sgd);
  CHECK_THROWS_WITH_AS((void)loom::load_checkpoint(file, floats, run.loader),
                       doctest::Contains("parameter 0 ('w1') is Double [5, 3] there but Float [5, 3] in this model"),
                       loom::InvalidArgument);

  // A save that cannot be written: a loom error naming the file; no file appears.
  const fs::path nowhere = file.parent_path() / "no-such-folder" / "c.pt";
  CHECK_THROWS_WITH_AS(
      loom::save_checkpoint(nowhere, run.trainer, run.loader),
      doctest::Contains(fmt::format("rank 0 could not save {}: cannot create", nowhere.string()).c_str()), loom::Error);
  CHECK_FALSE(fs::exists(nowhere));
  fs::remove_all(file.parent_path());
}

TEST_CASE("checkpoint: a deterministic run keeps its grid exponents across a resume and ends bit for bit equal") {
  const fs::path file = temp_file("deterministic.pt");
  DeterministicRun full;
  full.epoch(0);
  full.epoch(1);
  std::vector<int> saved;
  {
    DeterministicRun first;
    first.trainer.on_step([&](const loom::SyncResult&) {
      if (first.trainer.steps() == 3) {
        saved = first.trainer.reducer().grid_exponents();
        loom::save_checkpoint(file, first.trainer, first.loader);
        first.trainer.stop();
      }
    });
    first.epoch(0);
  }
  REQUIRE(saved.size() == 4);
  const std::vector<int> initial(4, 32);
  REQUIRE(saved != initial);  // 3 steps moved the grids
  DeterministicRun second;
  CHECK(second.trainer.reducer().grid_exponents() == initial);
  const auto info = loom::load_checkpoint(file, second.trainer, second.loader);
  CHECK(info.trainer.grid_exponents == saved);
  CHECK(second.trainer.reducer().grid_exponents() == saved);
  for (int64_t e = info.cursor.epoch; e < 2; ++e) second.epoch(e);
  CHECK(equal_params(second.model.params, full.model.params));

  // Resumed on the initial grids instead, the run differs: the exponents are part of the state.
  DeterministicRun third;
  (void)loom::load_checkpoint(file, third.trainer, third.loader);
  third.trainer.reducer().load_grid_exponents(initial);
  for (int64_t e = 0; e < 2; ++e) third.epoch(e);
  CHECK_FALSE(equal_params(third.model.params, full.model.params));

  // A checkpoint of a floating run resumes a deterministic one on the initial grids.
  const fs::path floating = temp_file("floating.pt");
  Run plain;
  plain.epoch(0);
  loom::save_checkpoint(floating, plain.trainer, plain.loader);
  DeterministicRun fourth;
  CHECK(loom::load_checkpoint(floating, fourth.trainer, fourth.loader).trainer.grid_exponents.empty());
  CHECK(fourth.trainer.reducer().grid_exponents() == initial);
  fs::remove_all(file.parent_path());
}

}  // namespace test_checkpoint
