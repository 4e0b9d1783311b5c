// bench_recovery — a rank dies mid-run: how long until training is back where it was, and how many
// optimizer steps run again, for an elastic job (ProcessGroupOptions::elastic: the survivors go on)
// next to a restart from the last checkpoint on the same job (the job ends, a new one of 3 ranks
// resumes from the checkpoint written every 4 steps).
//
// The job: 3 spawned ranks over Gloo, an MLP (64 -> 256 -> 256 -> 10) on 600 synthetic samples,
// batches of 16, 3 per optimizer step (13 steps an epoch), SGD with momentum, 2 epochs. Launch
// rank 1 kills itself (SIGKILL) when 6 steps are committed, in the loop body (forward of step 6).
// Every rank writes the monotonic time of each step boundary to a file; the kill time too.
//
// Counters: kill_to_step_s — from the kill to the end of step 6 (the step the rank died in) on the
//   survivors, i.e. back to where the job was (the manual time); steps_lost — committed steps run
//   again (0 elastic; the steps since the last checkpoint for the restart); step_ms — a step's time
//   before the kill. Run: build/bench/bench_recovery (about 40 s).
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <benchmark/benchmark.h>
#include <fmt/format.h>
#include <torch/torch.h>

#include <loom/dist/run.hpp>
#include <loom/train/checkpoint.hpp>
#include <loom/train/loader.hpp>

namespace {

namespace fs = std::filesystem;

constexpr int kRanks = 3;
constexpr int kVictim = 1;
constexpr int64_t kKillAt = 6;           // committed steps when the victim dies
constexpr int64_t kCheckpointEvery = 4;  // the restart's checkpoints
constexpr int64_t kSamples = 600;

double now_s() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);  // one clock for every process of this machine
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

struct Net : torch::nn::Module {
  torch::nn::Linear a{nullptr}, b{nullptr}, c{nullptr};
  Net() {
    a = register_module("a", torch::nn::Linear(64, 256));
    b = register_module("b", torch::nn::Linear(256, 256));
    c = register_module("c", torch::nn::Linear(256, 10));
  }
  torch::Tensor forward(const torch::Tensor& x) { return c(torch::relu(b(torch::relu(a(x))))); }
};

std::pair<torch::Tensor, int64_t> sample(int64_t i) {
  auto x = torch::arange(64, torch::kFloat).mul(0.01F * static_cast<float>(i % 37)).sin();
  return {x, i % 10};
}

struct Job {
  bool elastic = true;
  bool kill = true;
  bool resume = false;  // start from the checkpoint file
};

/// One job of 3 ranks; every rank appends "steps time" per step boundary to steps-<launch>.txt.
void run_job(const Job& job, const fs::path& dir) {
  std::optional<loom::ElasticOptions> elastic;
  if (job.elastic) elastic = loom::ElasticOptions{.min_ranks = 2};
  loom::run(
      [&](loom::ProcessGroup& pg) {
        torch::manual_seed(1);
        auto net = std::make_shared<Net>();
        torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
        const std::vector<std::vector<int64_t>> shapes(kSamples, std::vector<int64_t>{64});
        loom::BatchLoader loader(pg, shapes, sample, {.seed = 5, .max_samples = 16, .batches_per_step = 3});
        loom::Trainer trainer(pg, *net, sgd);
        trainer.on_recovery([](const loom::Recovery&) {});  // quiet
        const fs::path checkpoint = dir / "run.ckpt";
        int64_t first_epoch = 0;
        if (job.resume) first_epoch = loom::load_checkpoint(checkpoint, trainer, loader).cursor.epoch;
        std::ofstream times(dir / fmt::format("steps-{}-{}.txt", pg.launch_rank(), job.resume ? "b" : "a"));
        trainer.on_step([&](const loom::SyncResult&) {
          times << trainer.steps() << " " << fmt::format("{:.6f}", now_s()) << std::endl;
          if (!job.elastic && trainer.steps() % kCheckpointEvery == 0)
            loom::save_checkpoint(checkpoint, trainer, loader);
        });
        for (int64_t e = first_epoch; e < 2; ++e)
          for (loom::Batch& b : trainer.epoch(loader, e)) {
            if (job.kill && pg.launch_rank() == kVictim && trainer.steps() == kKillAt) {
              std::ofstream(dir / "kill.txt") << fmt::format("{:.6f}", now_s()) << std::endl;
              std::raise(SIGKILL);
            }
            trainer.backward(torch::nn::functional::cross_entropy(net->forward(b.data), b.targets), b);
          }
      },
      {.nproc = kRanks,
       .group = {.backend = loom::Backend::gloo, .timeout = std::chrono::seconds(30), .elastic = elastic},
       .spawn = {.timeout = std::chrono::seconds(300), .grace = std::chrono::seconds(120)}});
}

/// The "steps time" lines of every survivor's files named steps-<rank>-<part>.txt.
std::vector<std::pair<int64_t, double>> boundaries(const fs::path& dir, const char* part) {
  std::vector<std::pair<int64_t, double>> out;
  for (int r = 0; r < kRanks; ++r) {
    std::ifstream in(dir / fmt::format("steps-{}-{}.txt", r, part));
    int64_t steps = 0;
    double t = 0;
    while (in >> steps >> t) out.emplace_back(steps, t);
  }
  return out;
}

double read_number(const fs::path& file) {
  std::ifstream in(file);
  double v = 0;
  in >> v;
  return v;
}

// Time of the first boundary with `steps` committed at or after `after`, the earliest over the ranks.
double first_time(const std::vector<std::pair<int64_t, double>>& b, int64_t steps, double after) {
  double best = 1e300;
  for (const auto& [s, t] : b)
    if (s == steps && t >= after) best = std::min(best, t);
  return best;
}

double step_ms(const std::vector<std::pair<int64_t, double>>& b) {
  const double t2 = first_time(b, 2, 0), t5 = first_time(b, 5, 0);
  return (t5 - t2) / 3 * 1000;
}

struct TempFolder {
  fs::path path;
  TempFolder() {
    std::string t = (fs::temp_directory_path() / "loom-bench-recovery-XXXXXX").string();
    path = ::mkdtemp(t.data());
  }
  ~TempFolder() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

void BM_elastic(benchmark::State& state) {
  for (auto _ : state) {
    TempFolder dir;
    try {
      run_job({.elastic = true}, dir.path);
    } catch (const loom::SpawnError&) {  // the victim's death, when spawn reports it
    }
    const double kill = read_number(dir.path / "kill.txt");
    const auto b = boundaries(dir.path, "a");
    const double back = first_time(b, kKillAt + 1, kill);
    state.SetIterationTime(back - kill);
    state.counters["kill_to_step_s"] = back - kill;
    state.counters["steps_lost"] = 0;  // the survivors continue from the committed steps
    state.counters["step_ms"] = step_ms(b);
  }
}

void BM_restart_from_checkpoint(benchmark::State& state) {
  for (auto _ : state) {
    TempFolder dir;
    try {
      run_job({.elastic = false}, dir.path);
    } catch (const loom::SpawnError&) {  // the job ends: a dead rank and the survivors' CommErrors
    }
    const double kill = read_number(dir.path / "kill.txt");
    run_job({.elastic = false, .kill = false, .resume = true}, dir.path);
    const auto b = boundaries(dir.path, "b");
    const double back = first_time(b, kKillAt + 1, kill);
    int64_t resumed_at = kKillAt;
    for (const auto& [s, t] : b) resumed_at = std::min(resumed_at, s - 1);
    state.SetIterationTime(back - kill);
    state.counters["kill_to_step_s"] = back - kill;
    state.counters["steps_lost"] = static_cast<double>(kKillAt - resumed_at);
    state.counters["step_ms"] = step_ms(boundaries(dir.path, "a"));
  }
}

}  // namespace

BENCHMARK(BM_elastic)->Iterations(1)->Repetitions(3)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_restart_from_checkpoint)->Iterations(1)->Repetitions(3)->UseManualTime()->Unit(benchmark::kMillisecond);

BENCHMARK_MAIN();
