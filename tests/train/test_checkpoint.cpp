// loom::save_checkpoint / load_checkpoint in one process: a run saved mid-epoch and resumed equals
// the uninterrupted run bit for bit (the optimizer's momentum, the cursor and the step count come
// back, and every parameter group's options on every LibTorch); a SIGKILL or a failed write during a
// save leaves the previous checkpoint whole; every bad file (a flipped byte: the checksum) or misfit
// (a changed batching option, named) is a loom error naming the file, and a refused load changes
// nothing; set_epoch before trainer.epoch keeps a resume. Multi-rank (2 -> 3 ranks): test_checkpoint_dist.cpp.
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <signal.h>
#include <string>
#include <sys/resource.h>
#include <sys/stat.h>
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

  // A save that cannot be written (its folder would sit under a file): a loom error naming the
  // folder; no file appears.
  const fs::path nowhere = text / "sub" / "c.pt";
  CHECK_THROWS_WITH_AS(loom::save_checkpoint(nowhere, run.trainer, run.loader),
                       doctest::Contains(fmt::format("rank 0 could not save {}: cannot create the folder {}",
                                                     nowhere.string(), nowhere.parent_path().string())
                                             .c_str()),
                       loom::Error);
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

namespace {

std::string read_bytes(const fs::path& f) {
  std::ifstream in(f, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_bytes(const fs::path& f, const std::string& bytes) {
  std::ofstream(f, std::ios::binary | std::ios::trunc) << bytes;
}

/// A Run whose Trainer scales the loss (TrainerOptions::loss_scaling).
struct ScaledRun {
  loom::LocalCommunicator comm;
  loom::test::Mlp model{at::kDouble};
  torch::optim::SGD sgd{model.params, torch::optim::SGDOptions(0.05).momentum(0.9)};
  loom::BatchLoader<decltype(loom::test::trainer_fetch())> loader{
      comm, loom::test::trainer_shapes(), loom::test::trainer_fetch(), loom::test::kTrainerPlan};
  loom::Trainer<loom::LocalCommunicator, torch::optim::SGD> trainer{
      comm, model.list(), sgd, loom::TrainerOptions{.loss_scaling = loom::LossScalerOptions{.init_scale = 1024}}};

  void epoch(int64_t e) {
    for (loom::Batch& b : trainer.epoch(loader, e)) trainer.backward(loom::test::mean_loss(model, b), b);
  }
};

/// Saves `run` at step 3 of epoch 0 (the run stops there).
template <class R>
void save_at_step_3(R& run, const fs::path& file) {
  run.trainer.on_step([&](const loom::SyncResult&) {
    if (run.trainer.steps() == 3) {
      loom::save_checkpoint(file, run.trainer, run.loader);
      run.trainer.stop();
    }
  });
  run.epoch(0);
  REQUIRE(run.trainer.stopped());
  run.trainer.on_step(nullptr);
}

int64_t steps_of_epoch(int64_t epoch) {
  loom::GlobalBatchSampler s(loom::test::trainer_shapes(), loom::test::kTrainerPlan);
  s.set_epoch(epoch);
  return s.num_steps();
}

}  // namespace

TEST_CASE("checkpoint: bytes flipped inside a weight tensor are a DataError naming the file; format v1 is refused") {
  const fs::path file = temp_file("flipped.pt");
  Run run;
  run.epoch(0);
  loom::save_checkpoint(file, run.trainer, run.loader);
  const std::string bytes = read_bytes(file);
  // w1's 15 float64 values lie in the file as they are in memory (zip entries are stored).
  const at::Tensor w1 = run.model.params[0].detach().contiguous();
  const std::string pattern(static_cast<const char*>(w1.data_ptr()), static_cast<std::size_t>(w1.nbytes()));
  const std::size_t at = bytes.find(pattern);
  REQUIRE(at != std::string::npos);
  std::string damaged = bytes;
  for (std::size_t k = 40; k < 60; ++k) damaged[at + k] = static_cast<char>(~damaged[at + k]);
  const fs::path bad = temp_file("flipped-bad.pt");
  write_bytes(bad, damaged);

  Run fresh;
  CHECK_THROWS_WITH_AS((void)loom::load_checkpoint(bad, fresh.trainer, fresh.loader),
                       doctest::Contains(fmt::format("{}: the checksum", bad.string()).c_str()), loom::DataError);
  CHECK(fresh.trainer.steps() == 0);
  CHECK(equal_params(fresh.model.params, loom::test::Mlp(at::kDouble).params));
  // The intact file loads.
  (void)loom::load_checkpoint(file, fresh.trainer, fresh.loader);
  CHECK(equal_params(fresh.model.params, run.model.params));

  // One byte of the trailer changed: refused as well.
  std::string trailer_damaged = bytes;
  trailer_damaged[bytes.size() - 3] = trailer_damaged[bytes.size() - 3] == '0' ? '1' : '0';
  write_bytes(bad, trailer_damaged);
  Run other;
  CHECK_THROWS_WITH_AS((void)loom::load_checkpoint(bad, other.trainer, other.loader), doctest::Contains("the checksum"),
                       loom::DataError);

  // A file of format v1 (an archive without the trailer): refused, naming both formats.
  const fs::path v1 = temp_file("v1.pt");
  {
    torch::serialize::OutputArchive archive;
    archive.write("loom_checkpoint", c10::IValue(std::string("loom-checkpoint v1")));
    archive.save_to(v1.string());
  }
  CHECK_THROWS_WITH_AS((void)loom::load_checkpoint(v1, other.trainer, other.loader),
                       doctest::Contains(fmt::format("{} has format 'loom-checkpoint v1'", v1.string()).c_str()),
                       loom::DataError);
  fs::remove_all(file.parent_path());
}

namespace {

/// Saves a run of `Optim` (options `saved`, two parameter groups) and loads it into one of options
/// `fresh`; returns the loaded optimizer's groups' options. (LibTorch 2.x replaces a group's value
/// that equals the options type's default by the optimizer's default: the values avoid those.)
template <class Optim, class Options>
std::vector<Options> round_trip_options(const fs::path& file, std::vector<Options> saved, Options fresh) {
  loom::LocalCommunicator comm;
  auto make = [&](std::vector<Options> options) {
    auto model = std::make_unique<loom::test::Mlp>(at::kDouble);
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(std::vector<at::Tensor>{model->params[0], model->params[1]},
                        std::make_unique<Options>(options[0]));
    groups.emplace_back(std::vector<at::Tensor>{model->params[2], model->params[3]},
                        std::make_unique<Options>(options[1]));
    auto opt = std::make_unique<Optim>(groups, options[0]);
    return std::make_pair(std::move(model), std::move(opt));
  };
  {
    auto [model, opt] = make(saved);
    loom::BatchLoader loader(comm, loom::test::trainer_shapes(), loom::test::trainer_fetch(), loom::test::kTrainerPlan);
    loom::Trainer trainer(comm, model->list(), *opt);
    for (loom::Batch& b : trainer.epoch(loader, 0)) trainer.backward(loom::test::mean_loss(*model, b), b);
    loom::save_checkpoint(file, trainer, loader);
  }
  auto [model, opt] = make({fresh, fresh});
  loom::BatchLoader loader(comm, loom::test::trainer_shapes(), loom::test::trainer_fetch(), loom::test::kTrainerPlan);
  loom::Trainer trainer(comm, model->list(), *opt);
  (void)loom::load_checkpoint(file, trainer, loader);
  std::vector<Options> out;
  for (auto& g : opt->param_groups()) out.push_back(static_cast<Options&>(g.options()));
  return out;
}

}  // namespace

TEST_CASE("checkpoint: every parameter group's options come back (SGD, Adam, AdamW, RMSprop, Adagrad)") {
  namespace optim = torch::optim;
  const fs::path file = temp_file("options.pt");
  {
    const auto g =
        round_trip_options<optim::SGD>(file,
                                       {optim::SGDOptions(0.02).momentum(0.8).dampening(0.1).weight_decay(1e-3),
                                        optim::SGDOptions(0.005).momentum(0.7).nesterov(true).weight_decay(2e-3)},
                                       optim::SGDOptions(0.5));
    REQUIRE(g.size() == 2);
    CHECK(g[0].lr() == 0.02);
    CHECK(g[0].momentum() == 0.8);
    CHECK(g[0].dampening() == 0.1);
    CHECK(g[0].weight_decay() == 1e-3);
    CHECK_FALSE(g[0].nesterov());
    CHECK(g[1].lr() == 0.005);
    CHECK(g[1].momentum() == 0.7);
    CHECK(g[1].nesterov());
    CHECK(g[1].weight_decay() == 2e-3);
  }
  {
    const auto g =
        round_trip_options<optim::Adam>(file,
                                        {optim::AdamOptions(0.003).betas({0.8, 0.95}).eps(1e-6).weight_decay(0.01),
                                         optim::AdamOptions(0.0015).betas({0.85, 0.99}).eps(1e-7).amsgrad(true)},
                                        optim::AdamOptions(0.1));
    REQUIRE(g.size() == 2);
    CHECK(g[0].lr() == 0.003);
    CHECK(std::get<0>(g[0].betas()) == 0.8);
    CHECK(std::get<1>(g[0].betas()) == 0.95);
    CHECK(g[0].eps() == 1e-6);
    CHECK(g[0].weight_decay() == 0.01);
    CHECK(g[1].lr() == 0.0015);
    CHECK(std::get<0>(g[1].betas()) == 0.85);
    CHECK(g[1].eps() == 1e-7);
    CHECK(g[1].amsgrad());
  }
  {
    const auto g = round_trip_options<optim::AdamW>(
        file, {optim::AdamWOptions(0.004).weight_decay(0.05).eps(1e-5), optim::AdamWOptions(0.002).weight_decay(0.0)},
        optim::AdamWOptions(0.1));
    REQUIRE(g.size() == 2);
    CHECK(g[0].lr() == 0.004);
    CHECK(g[0].weight_decay() == 0.05);
    CHECK(g[0].eps() == 1e-5);
    CHECK(g[1].lr() == 0.002);
    CHECK(g[1].weight_decay() == 0.0);
  }
  {
    const auto g = round_trip_options<optim::RMSprop>(
        file, {optim::RMSpropOptions(0.006).alpha(0.9).momentum(0.5).centered(true), optim::RMSpropOptions(0.001)},
        optim::RMSpropOptions(0.1));
    REQUIRE(g.size() == 2);
    CHECK(g[0].lr() == 0.006);
    CHECK(g[0].alpha() == 0.9);
    CHECK(g[0].momentum() == 0.5);
    CHECK(g[0].centered());
    CHECK(g[1].lr() == 0.001);
  }
  {
    const auto g = round_trip_options<optim::Adagrad>(
        file, {optim::AdagradOptions(0.03).lr_decay(0.01).initial_accumulator_value(0.1), optim::AdagradOptions(0.02)},
        optim::AdagradOptions(0.5));
    REQUIRE(g.size() == 2);
    CHECK(g[0].lr() == 0.03);
    CHECK(g[0].lr_decay() == 0.01);
    CHECK(g[0].initial_accumulator_value() == 0.1);
    CHECK(g[1].lr() == 0.02);
  }
  fs::remove_all(file.parent_path());
}

namespace {

/// Options of the user's that cannot serialize themselves (no serialize() overrides).
struct PlainOptions : torch::optim::OptimizerCloneableOptions<PlainOptions> {
  double lr = 0.1;
};

/// A torch::optim::Optimizer of the user's with PlainOptions; its own save() / load() keep nothing.
struct PlainSgd : torch::optim::Optimizer {
  explicit PlainSgd(std::vector<at::Tensor> params)
      : Optimizer({torch::optim::OptimizerParamGroup(std::move(params))}, std::make_unique<PlainOptions>()) {}
  at::Tensor step(LossClosure = nullptr) override {
    const at::NoGradGuard no_grad;
    for (auto& g : param_groups())
      for (auto& p : g.params())
        if (p.grad().defined()) p.sub_(p.grad() * static_cast<PlainOptions&>(g.options()).lr);
    return {};
  }
  void save(torch::serialize::OutputArchive&) const override {}
  void load(torch::serialize::InputArchive&) override {}
};

}  // namespace

TEST_CASE("checkpoint: an optimizer whose options cannot serialize themselves is a loom error at the save") {
  const fs::path file = temp_file("plain.pt");
  loom::LocalCommunicator comm;
  loom::test::Mlp model(at::kDouble);
  PlainSgd opt(model.params);
  loom::BatchLoader loader(comm, loom::test::trainer_shapes(), loom::test::trainer_fetch(), loom::test::kTrainerPlan);
  loom::Trainer trainer(comm, model.list(), opt);
  for (loom::Batch& b : trainer.epoch(loader, 0)) trainer.backward(loom::test::mean_loss(model, b), b);
  CHECK_THROWS_WITH_AS(loom::save_checkpoint(file, trainer, loader),
                       doctest::Contains("parameter group 0's options (test_checkpoint::(anonymous namespace)::"
                                         "PlainOptions) cannot be stored"),
                       loom::Error);
  CHECK_FALSE(fs::exists(file));
  fs::remove_all(file.parent_path());
}

TEST_CASE(
    "checkpoint: a learning rate changed during the run is restored; the resumed run equals the uninterrupted one") {
  const fs::path file = temp_file("lr.pt");
  auto schedule = [](auto& run) {  // the rate halves after every step
    run.trainer.on_step([&](const loom::SyncResult&) {
      auto& o = static_cast<torch::optim::SGDOptions&>(run.sgd.param_groups()[0].options());
      o.lr(o.lr() * 0.5);
    });
  };
  Run full;
  schedule(full);
  full.epoch(0);
  full.epoch(1);
  {
    Run first;
    first.trainer.on_step([&](const loom::SyncResult&) {
      auto& o = static_cast<torch::optim::SGDOptions&>(first.sgd.param_groups()[0].options());
      o.lr(o.lr() * 0.5);
      if (first.trainer.steps() == 3) {
        loom::save_checkpoint(file, first.trainer, first.loader);
        first.trainer.stop();
      }
    });
    first.epoch(0);
  }
  Run second;
  const auto info = loom::load_checkpoint(file, second.trainer, second.loader);
  CHECK(static_cast<torch::optim::SGDOptions&>(second.sgd.param_groups()[0].options()).lr() == 0.05 / 8);
  schedule(second);
  for (int64_t e = info.cursor.epoch; e < 2; ++e) second.epoch(e);
  CHECK(equal_params(second.model.params, full.model.params));
  fs::remove_all(file.parent_path());
}

TEST_CASE("checkpoint: a checkpoint refused for its loss scaler changes nothing; the fresh start trains every step") {
  const fs::path plain = temp_file("plain.pt"), scaled = temp_file("scaled.pt");
  {
    Run run;
    save_at_step_3(run, plain);
    ScaledRun scaled_run;
    save_at_step_3(scaled_run, scaled);
  }
  const int64_t steps = steps_of_epoch(0);
  REQUIRE(steps > 3);

  // A checkpoint without a loss scaler state, into a Trainer that scales the loss.
  ScaledRun a;
  CHECK_THROWS_WITH_AS((void)loom::load_checkpoint(plain, a.trainer, a.loader),
                       doctest::Contains("scales the loss but the state has no loss scaler state"),
                       loom::InvalidArgument);
  CHECK(a.loader.sampler().cursor().step == 0);
  CHECK(a.trainer.steps() == 0);
  CHECK(equal_params(a.model.params, loom::test::Mlp(at::kDouble).params));
  a.epoch(0);  // starts afresh
  CHECK(a.trainer.steps() == steps);

  // A checkpoint with a loss scaler state, into a Trainer without one.
  Run b;
  CHECK_THROWS_AS((void)loom::load_checkpoint(scaled, b.trainer, b.loader), loom::InvalidArgument);
  CHECK(b.loader.sampler().cursor().step == 0);
  CHECK(b.trainer.steps() == 0);
  CHECK(equal_params(b.model.params, loom::test::Mlp(at::kDouble).params));
  b.epoch(0);
  CHECK(b.trainer.steps() == steps);
  Run reference;
  reference.epoch(0);
  CHECK(equal_params(b.model.params, reference.model.params));
  fs::remove_all(plain.parent_path());
}

TEST_CASE("checkpoint: a save whose writes fail (file size limit) is a loom error; the previous checkpoint stays") {
  const fs::path file = temp_file("full.pt");
  Run run;
  run.epoch(0);
  loom::save_checkpoint(file, run.trainer, run.loader, {{"generation", "1"}});
  const auto size = static_cast<rlim_t>(fs::file_size(file));
  run.epoch(1);

  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {  // writes beyond half the checkpoint's size fail with EFBIG (SIGXFSZ ignored)
    ::signal(SIGXFSZ, SIG_IGN);
    const rlimit limit{size / 2, size / 2};
    ::setrlimit(RLIMIT_FSIZE, &limit);
    int code = 3;
    try {
      loom::save_checkpoint(file, run.trainer, run.loader, {{"generation", "2"}});
      code = 1;
    } catch (const loom::Error& e) {
      const std::string what = e.what();
      code = what.find(fmt::format("rank 0 could not save {}", file.string())) != std::string::npos &&
                     what.find("File too large") != std::string::npos
                 ? 0
                 : 2;
    } catch (...) {
      code = 4;
    }
    ::_exit(code);
  }
  int status = 0;
  ::waitpid(child, &status, 0);
  CHECK_FALSE(WIFSIGNALED(status));
  if (WIFSIGNALED(status)) MESSAGE(fmt::format("the child died of signal {}", WTERMSIG(status)));
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  CHECK_FALSE(fs::exists(file.string() + ".loom-tmp"));

  Run resumed;
  const auto info = loom::load_checkpoint(file, resumed.trainer, resumed.loader);
  CHECK(info.user.at("generation") == "1");
  CHECK(info.cursor.epoch == 1);
  fs::remove_all(file.parent_path());
}

TEST_CASE("checkpoint: set_epoch(e) before trainer.epoch(loader, e) keeps a mid-epoch resume") {
  const fs::path file = temp_file("set-epoch.pt");
  Run full;
  full.epoch(0);
  full.epoch(1);
  {
    Run first;
    save_at_step_3(first, file);
  }
  Run second;
  const auto info = loom::load_checkpoint(file, second.trainer, second.loader);
  REQUIRE(info.cursor.step == 3);
  for (int64_t e = info.cursor.epoch; e < 2; ++e) {
    second.loader.sampler().set_epoch(e);  // the DDP habit
    second.loader.sampler().set_epoch(e);  // twice is as harmless
    second.epoch(e);
  }
  CHECK(second.trainer.steps() == full.trainer.steps());
  CHECK(equal_params(second.model.params, full.model.params));

  // The habit with another epoch than the resumed one stays an error naming both.
  Run third;
  (void)loom::load_checkpoint(file, third.trainer, third.loader);
  CHECK_THROWS_WITH_AS(third.loader.sampler().set_epoch(1), doctest::Contains("resumed at epoch 0, step 3"),
                       loom::InvalidArgument);
  fs::remove_all(file.parent_path());
}

TEST_CASE("checkpoint: missing folders are created; a changed batching option is named with both values") {
  const fs::path root = temp_file("folders");
  const fs::path file = root / "a" / "b" / "run.pt";
  Run run;
  save_at_step_3(run, file);
  REQUIRE(fs::exists(file));

  // max_samples changed between the runs: named, with both values.
  loom::LocalCommunicator comm;
  loom::test::Mlp model(at::kDouble);
  torch::optim::SGD sgd(model.params, torch::optim::SGDOptions(0.05));
  loom::Trainer trainer(comm, model.list(), sgd);
  loom::GlobalBatchOptions changed = loom::test::kTrainerPlan;
  changed.max_samples = 4;
  loom::BatchLoader loader(comm, loom::test::trainer_shapes(), loom::test::trainer_fetch(), changed);
  CHECK_THROWS_WITH_AS((void)loom::load_checkpoint(file, trainer, loader),
                       doctest::Contains("max_samples = 3 there, 4 here"), loom::InvalidArgument);
  changed = loom::test::kTrainerPlan;
  changed.batches_per_step = 0;
  changed.samples_per_step = 5;
  loom::BatchLoader loader2(comm, loom::test::trainer_shapes(), loom::test::trainer_fetch(), changed);
  CHECK_THROWS_WITH_AS((void)loom::load_checkpoint(file, trainer, loader2),
                       doctest::Contains("batches_per_step = 2 there, 0 here"), loom::InvalidArgument);
  // Other shapes: named as such, with the sample counts.
  auto shapes = loom::test::trainer_shapes();
  shapes[4] = {7, loom::test::kIn};
  loom::BatchLoader loader3(comm, shapes, loom::test::trainer_fetch(), loom::test::kTrainerPlan);
  CHECK_THROWS_WITH_AS((void)loom::load_checkpoint(file, trainer, loader3), doctest::Contains("the shapes differ"),
                       loom::InvalidArgument);
  CHECK(trainer.steps() == 0);
  fs::remove_all(root.parent_path());
}

}  // namespace test_checkpoint
