// bench_finetune — the main job four ways, as time to accuracy: fine-tune the icon model
// (examples/common/icons_task.hpp: Adwaita icons at 16, 24, 32 and 48 px, every icon at its own
// size) from the same initial weights with the same optimizer until the validation accuracy reaches
// a target (or a cap of epochs), and report the training seconds to the target, the epochs, the
// final accuracy and the samples/s, on 1 and 2 ranks, several runs of each (interleaved).
//
// Every way but the first trains kGlobalBatch (32) samples per optimizer step, summed over ranks:
//   one_at_a_time     the seed's loop: batch size 1 per rank, an optimizer step per image on each
//                     rank (so a step holds `ranks` samples), DDP's averaging
//   group_in_batch    random batches of 32 / ranks per rank split into same-shape groups, one
//                     forward per group, one optimizer step per global batch of 32 (the "group by
//                     shape in collate_fn" recipe); each group's mean loss is scaled by its share of
//                     the rank's batch, DDP averages the ranks
//   accumulate_32     batch size 1 per rank, gradient accumulation over 32 / ranks images per rank
//                     (each image's loss divided by that count), DDP's averaging
//   loom              loom::BatchLoader with GlobalBatchOptions::global_batch_size = 32 (each step's
//                     32 samples as same-shape micro-batches, the same steps on any number of ranks,
//                     the gradient weighted by samples) + loom::Trainer
//   loom_deterministic  the same with ReducerOptions::deterministic (bit-identical on any number of
//                     ranks): not one of the "other ways" of the ratio; its own RATIO line
//                     throughput_deterministic_vs_float/ranks:N (samples/s over loom's, goal >= 1/1.3)
//   loom_no_recorder  loom with ProcessGroupOptions::flight_recorder = false: its own RATIO line
//                     throughput_recorder_vs_none/ranks:N (loom's samples/s over this one's, goal >= 0.99)
// Every way trains the same samples in the same steps: the DDP-style ways shard the permutation
// loom's plan draws (seed + epoch) the way torch's DistributedSampler shards its own (interleaved,
// padded by repeats), so a rank's i-th batch of 32 / ranks samples holds its share of loom's step
// i; runs then differ in speed, not in the luck of the data order. Every rank steps with the
// gradient averaged over ranks (loom::Reducer with Average::world_size, DDP's convention).
// Every way: AdamW, lr 1.5e-3, weight decay 1e-4, the same initial weights, no pre-training; one
// intra-op thread per rank.
//
// Method: Google Benchmark in this (parent) process, repetitions interleaved at random; run r of
// every way draws its data order from seed 1 + 1000 r (the same initial weights); each run starts the
// ranks with loom::run (fork), which train and evaluate the validation split every --eval-every
// samples trained (over all ranks; at the first optimizer step boundary past each mark, inside
// on_step for loom) until the accuracy reaches the target or --max-epochs end; rank 0 reports
// through a file. The manual time is the training seconds (evaluations and decoding excluded) up
// to the evaluation that first reached the target (all of them when none did: counter reached =
// 0). Counters: epochs (begun), val_accuracy (at the stop), samples_per_s, steps. After the table,
// one line per number of ranks:
//   RATIO time_to_accuracy_loom_vs_best/ranks:N median=... min=... max=... n=... goal>=1.2 met|NOT-met
// (per run: the fastest other way's seconds to the target over loom's; a way that did not reach the
// target counts as infinitely slow).
//
// Run: build-dir/bench/bench_finetune [--runs=3] [--target=0.48] [--eval-every=640] [--max-epochs=10] [--ranks=1,2]
//      [--device=cpu|cuda] [--data=DIR] [--curve=FILE.csv] [Google Benchmark flags]
//   --device=cuda: NCCL, one rank per GPU (ranks must not exceed the GPUs); --curve writes every
//   evaluation's (way, ranks, run, samples, seconds, accuracy) for the time-to-accuracy figure.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <numeric>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <loom/accumulate/accumulator.hpp>
#include <loom/compat.hpp>
#include <loom/dist/run.hpp>
#include <loom/reduce/module.hpp>
#include <loom/reduce/reducer.hpp>
#include <loom/sample/sample_seed.hpp>
#include <loom/train/loader.hpp>
#include <loom/train/trainer.hpp>

#include "../examples/common/icons_task.hpp"

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int kWidth = 32;
constexpr double kLr = 1.5e-3;
constexpr int64_t kGlobalBatch = 32;
constexpr int64_t kBatchPixels = 32 * 32 * 32;

struct Settings {
  int runs = 3;
  double target = 0.48;
  int max_epochs = 10;
  int64_t eval_every = 640;  // samples trained between evaluations (20 steps of 32)
  std::vector<int> ranks = {1, 2};
  bool cuda = false;
  fs::path curve;
  examples::IconTaskOptions task{};  // the example's defaults: sizes 16, 24, 32, 48; 4 channels
};
Settings g_settings;

enum class Method { one_at_a_time, group_in_batch, accumulate_32, loom, loom_deterministic, loom_no_recorder };

struct Result {
  double seconds = 0;   // training seconds to the target (or of all epochs)
  int reached = 0;      // 1: the target was reached
  int epochs = 0;       // epochs trained
  int64_t samples = 0;  // samples trained, all ranks, up to the stop
  int64_t steps = 0;    // optimizer steps
  double accuracy = 0;  // validation accuracy at the stop
  std::string curve;    // "epoch seconds accuracy" lines
};

double since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

at::Tensor stack_samples(const examples::IconTask& task, const std::vector<int64_t>& subset,
                         const std::vector<int64_t>& js, std::vector<int64_t>& labels, torch::Device device) {
  std::vector<at::Tensor> xs;
  for (int64_t j : js) {
    auto [x, y] = task.sample(subset, j);
    xs.push_back(x);
    labels.push_back(y);
  }
  return torch::stack(xs).to(device);
}

/// Rank `rank`'s indices of epoch `epoch` for the DDP-style ways: the permutation loom's plan draws
/// (randperm of n from loom::generator64(seed + epoch), as GlobalBatchOptions::global_batch_size
/// cuts it into steps), sharded the way torch's DistributedSampler shards its own: padded by
/// repeats to a multiple of the world size, rank r taking positions r, r + W, r + 2W, ... So a
/// rank's i-th batch of 32 / W samples comes from positions [32 i, 32 i + 32): the samples of
/// loom's step i.
std::vector<int64_t> shard_of_plan_order(int64_t n, uint64_t seed, int64_t epoch, int world, int rank) {
  at::Generator gen = loom::generator64(seed + static_cast<uint64_t>(epoch));
  const at::Tensor p = at::randperm(n, gen, at::TensorOptions(at::kLong));
  const int64_t* perm = p.data_ptr<int64_t>();
  const int64_t total = (n + world - 1) / world * world;
  std::vector<int64_t> mine;
  for (int64_t k = rank; k < total; k += world) mine.push_back(perm[k % n]);
  return mine;
}

/// One rank of one method; rank 0 writes its Result to `out`. Run `run` draws its data order from
/// seed + 1000 run (the sampler's or the loader's seed); the initial weights are the same in every run.
void train_rank(loom::ProcessGroup& pg, Method method, int run, const fs::path& out) {
  at::set_num_threads(1);
  const auto& o = g_settings;
  const examples::IconTask task(o.task, [](std::string_view) {});
  const torch::Device device = o.cuda ? torch::Device(torch::kCUDA, pg.device().index()) : torch::Device(torch::kCPU);
  torch::manual_seed(o.task.seed);
  examples::IconNet model(o.task.channels, kWidth, task.classes());
  model->to(device);
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(kLr).weight_decay(1e-4));
  const auto& train = task.train();
  const auto n = static_cast<int64_t>(train.size());
  const int world = pg.world_size();
  const int64_t per_rank = kGlobalBatch / world;  // samples per rank per step (32 % world == 0)
  // Runs far apart: sampler seeds advance by the epoch (seed + epoch), so seeds 1 + r would share
  // epochs' orders between runs.
  const uint64_t order_seed = o.task.seed + 1000 * static_cast<uint64_t>(run);
  namespace F = torch::nn::functional;
  Result r;
  auto labels_of = [&](const std::vector<int64_t>& labels) { return torch::tensor(labels, torch::kLong).to(device); };
  // The clock runs while training; evaluations (every o.eval_every samples trained, over all
  // ranks, at the first optimizer step boundary past each mark, and after the last epoch) are
  // excluded. Every rank evaluates at the same step: the sample count is global.
  if (o.cuda) torch::cuda::synchronize();
  const auto run_start = Clock::now();
  double excluded = 0;
  int64_t next_eval = o.eval_every;
  auto training_seconds = [&] {
    if (o.cuda) torch::cuda::synchronize();
    return since(run_start) - excluded;
  };
  auto evaluate_now = [&] {
    const double seconds = training_seconds();
    const auto t0 = Clock::now();
    const examples::EvalResult ev = task.evaluate(pg, model, device, kGlobalBatch, kBatchPixels * o.task.channels);
    excluded += since(t0);
    r.accuracy = ev.accuracy;
    r.seconds = seconds;
    r.curve += fmt::format("{} {:.6f} {:.6f}\n", r.samples, seconds, ev.accuracy);
    if (ev.accuracy >= o.target) r.reached = 1;  // the same verdict on every rank: evaluate gathers every sample
  };
  // After an optimizer step (r.samples already counts it): true once the target is reached.
  auto after_step = [&] {
    if (r.samples >= next_eval) {
      while (next_eval <= r.samples) next_eval += o.eval_every;
      evaluate_now();
    }
    return r.reached != 0;
  };
  // Runs epochs until the target or the cap; train_epoch(e) returns false when it stopped early.
  auto run_epochs = [&](auto&& train_epoch) {
    for (int64_t e = 0; e < o.max_epochs && r.reached == 0; ++e) {
      r.epochs = static_cast<int>(e + 1);
      train_epoch(e);
    }
    if (r.reached == 0) evaluate_now();  // the cap: the accuracy at the end
  };
  if (method == Method::loom || method == Method::loom_deterministic || method == Method::loom_no_recorder) {
    loom::BatchLoader loader(pg, task.shapes_of(train), [&](int64_t j) { return task.sample(train, j); },
                             {.seed = order_seed,
                              .max_samples = kGlobalBatch,
                              .max_elements = kBatchPixels * o.task.channels,
                              .global_batch_size = kGlobalBatch});
    loom::Trainer trainer(pg, *model, opt, {.reducer = {.deterministic = method == Method::loom_deterministic}});
    trainer.on_step([&](const loom::SyncResult& s) {
      r.samples += s.global_samples;
      if (after_step()) trainer.stop();
    });
    run_epochs([&](int64_t e) {
      for (loom::Batch& b : trainer.epoch(loader, e))
        trainer.backward(F::cross_entropy(model->forward(b.data), b.targets), b);
    });
    r.steps = trainer.steps();
  } else {
    loom::Reducer reducer(pg, loom::parameters_of(*model), {.average = loom::Average::world_size});
    // group_in_batch: each group is a micro-batch (DDP: no_sync for all groups but the last), the
    // rank's batch's last group closes the step.
    const int64_t micro = method == Method::accumulate_32 ? per_rank : method == Method::one_at_a_time ? 1 : 0;
    loom::Accumulator acc(reducer, {.micro_batches_per_step = micro});
    run_epochs([&](int64_t e) {
      const std::vector<int64_t> shard = shard_of_plan_order(n, order_seed, e, world, pg.rank());
      std::vector<int64_t> pending;
      // Counts `samples` (over all ranks) at a step boundary; true once the target is reached.
      auto apply = [&](const loom::SyncResult& s, int64_t samples) {
        if (s.apply) {
          opt.step();
          ++r.steps;
        }
        if (s.boundary) loom::zero_grad(opt, loom::GradReset::zero);
        if (!s.boundary) return false;
        r.samples += samples;
        return after_step();
      };
      int64_t window = 0;  // samples (all ranks) since the last boundary
      for (const int64_t* j = shard.data(); j != shard.data() + shard.size(); ++j) {
        if (method != Method::group_in_batch) {  // one image per micro-batch
          std::vector<int64_t> labels;
          const at::Tensor x = stack_samples(task, train, {*j}, labels, device);
          const auto loss = F::cross_entropy(model->forward(x), labels_of(labels));
          auto mb = acc.micro_batch(1);
          (method == Method::accumulate_32 ? loss / static_cast<double>(per_rank) : loss).backward();
          window += world;
          const loom::SyncResult s = mb.finish();
          if (apply(s, s.boundary ? std::exchange(window, 0) : 0)) return;
          continue;
        }
        pending.push_back(*j);
        if (static_cast<int64_t>(pending.size()) < per_rank) continue;
        // A random batch of the rank, split into same-shape groups: one forward per group, loss =
        // sum of group means x group share (the batch mean), one step per batch.
        std::map<int64_t, std::vector<int64_t>> groups;
        for (int64_t i : pending)
          groups[task.icons().pixels(static_cast<std::size_t>(train[static_cast<std::size_t>(i)])).size(1)].push_back(
              i);
        std::size_t g = 0;
        for (auto& [side, js] : groups) {
          std::vector<int64_t> labels;
          const at::Tensor x = stack_samples(task, train, js, labels, device);
          const double share = static_cast<double>(js.size()) / static_cast<double>(pending.size());
          auto mb = acc.micro_batch(static_cast<int64_t>(js.size()), /*closes_step=*/++g == groups.size());
          (F::cross_entropy(model->forward(x), labels_of(labels)) * share).backward();
          const loom::SyncResult s = mb.finish();
          if (apply(s, s.boundary ? static_cast<int64_t>(pending.size()) * world : 0)) return;
        }
        pending.clear();
      }
      pending.clear();  // the recipe drops the last partial batch (drop_last)
      while (auto s = acc.end_epoch())
        if (apply(*s, std::exchange(window, 0))) return;
    });
  }
  if (pg.rank() == 0) {
    std::ofstream f(out);
    f << fmt::format("{:.17g} {} {} {} {} {:.17g}\n{}", r.seconds, r.reached, r.epochs, r.samples, r.steps, r.accuracy,
                     r.curve);
  }
}

const char* method_name(Method m) {
  switch (m) {
    case Method::one_at_a_time: return "one_at_a_time";
    case Method::group_in_batch: return "group_in_batch";
    case Method::accumulate_32: return "accumulate_32";
    case Method::loom: return "loom";
    case Method::loom_deterministic: return "loom_deterministic";
    case Method::loom_no_recorder: return "loom_no_recorder";
  }
  return "?";
}

// Per (method, ranks): each run's seconds to the target (infinity when not reached), in run order.
std::map<std::pair<Method, int>, std::vector<double>> g_times;
// Per (method, ranks): each run's training samples per second.
std::map<std::pair<Method, int>, std::vector<double>> g_rates;
std::ofstream g_curve;

void BM_Finetune(benchmark::State& state, Method method, int nproc) {
  const fs::path out = fs::temp_directory_path() / fmt::format("loom-bench-finetune-{}.txt", ::getpid());
  for (auto _ : state) {
    fs::remove(out);
    auto& runs = g_times[{method, nproc}];
    const int run = static_cast<int>(runs.size());
    loom::run([&](loom::ProcessGroup& pg) { train_rank(pg, method, run, out); },
              {.nproc = nproc,
               .group = {.backend = g_settings.cuda ? loom::Backend::nccl : loom::Backend::gloo,
                         .flight_recorder = method != Method::loom_no_recorder},
               .spawn = {.timeout = std::chrono::minutes(30)}});
    std::ifstream f(out);
    Result r;
    if (!(f >> r.seconds >> r.reached >> r.epochs >> r.samples >> r.steps >> r.accuracy)) {
      runs.push_back(std::numeric_limits<double>::infinity());  // keeps the runs' pairing and seeds
      state.SkipWithError("rank 0 wrote no result");
      return;
    }
    if (g_curve.is_open()) {
      int64_t samples = 0;
      double sec = 0, accuracy = 0;
      while (f >> samples >> sec >> accuracy)
        g_curve << fmt::format("{},{},{},{},{:.4f},{:.4f}\n", method_name(method), nproc, runs.size(), samples, sec,
                               accuracy);
      g_curve.flush();
    }
    runs.push_back(r.reached != 0 ? r.seconds : std::numeric_limits<double>::infinity());
    state.SetIterationTime(r.seconds);
    state.counters["reached"] = r.reached;
    state.counters["epochs"] = r.epochs;
    state.counters["val_accuracy"] = r.accuracy;
    state.counters["samples_per_s"] = static_cast<double>(r.samples) / r.seconds;
    g_rates[{method, nproc}].push_back(static_cast<double>(r.samples) / r.seconds);
    state.counters["steps"] = static_cast<double>(r.steps);
  }
  fs::remove(out);
}

/// The RATIO line of one number of ranks: per run, the fastest other way's seconds over loom's.
void print_ratio(int nproc) {
  const auto mine = g_times.find({Method::loom, nproc});
  if (mine == g_times.end()) return;
  std::vector<double> ratios;
  for (std::size_t i = 0; i < mine->second.size(); ++i) {
    double best = std::numeric_limits<double>::infinity();
    bool any = false;
    for (Method m : {Method::one_at_a_time, Method::group_in_batch, Method::accumulate_32}) {
      const auto it = g_times.find({m, nproc});
      if (it == g_times.end() || i >= it->second.size()) continue;
      any = true;
      best = std::min(best, it->second[i]);
    }
    if (any) ratios.push_back(best / mine->second[i]);  // inf / inf is NaN: neither reached the target
  }
  if (ratios.empty()) return;
  std::vector<double> sorted = ratios;
  std::sort(sorted.begin(), sorted.end(), [](double a, double b) { return std::isnan(b) ? !std::isnan(a) : a < b; });
  const double med = sorted[sorted.size() / 2];
  std::printf("RATIO time_to_accuracy_loom_vs_best/ranks:%d median=%.3f min=%.3f max=%.3f n=%zu goal>=1.2 %s\n", nproc,
              med, sorted.front(), sorted.back(), sorted.size(), med >= 1.2 ? "met" : "NOT-met");
}

/// One RATIO line of throughputs: per run, `top`'s samples/s over `bottom`'s at `nproc` ranks.
void print_rate_ratio(const char* label, Method top, Method bottom, int nproc, double goal) {
  const auto t = g_rates.find({top, nproc});
  const auto b = g_rates.find({bottom, nproc});
  if (t == g_rates.end() || b == g_rates.end()) return;
  std::vector<double> ratios;
  for (std::size_t i = 0; i < std::min(t->second.size(), b->second.size()); ++i)
    ratios.push_back(t->second[i] / b->second[i]);
  if (ratios.empty()) return;
  std::sort(ratios.begin(), ratios.end());
  const double med = ratios[ratios.size() / 2];
  std::printf("RATIO %s/ranks:%d median=%.3f min=%.3f max=%.3f n=%zu goal>=%.2f %s\n", label, nproc, med,
              ratios.front(), ratios.back(), ratios.size(), goal, med >= goal ? "met" : "NOT-met");
}

/// The cost of ReducerOptions::deterministic: per run, its samples/s over floating loom's (goal:
/// at most 1.3x the step time, i.e. >= 1 / 1.3).
void print_deterministic_ratio(int nproc) {
  print_rate_ratio("throughput_deterministic_vs_float", Method::loom_deterministic, Method::loom, nproc, 1.0 / 1.3);
}

/// The flight recorder's cost: loom's samples/s over loom_no_recorder's, per run (goal >= 0.99).
void print_recorder_ratio(int nproc) {
  print_rate_ratio("throughput_recorder_vs_none", Method::loom, Method::loom_no_recorder, nproc, 0.99);
}

/// Reads --runs= --target= --max-epochs= --ranks= --device= --data= --curve= and removes them from argv.
bool parse_settings(int& argc, char** argv) {
  int kept = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&](std::string_view key) -> std::optional<std::string> {
      if (a.rfind(key, 0) == 0) return a.substr(key.size());
      return std::nullopt;
    };
    try {
      if (auto v = value("--runs=")) {
        g_settings.runs = std::stoi(*v);
      } else if (auto v = value("--target=")) {
        g_settings.target = std::stod(*v);
      } else if (auto v = value("--eval-every=")) {
        g_settings.eval_every = std::stoll(*v);
      } else if (auto v = value("--max-epochs=")) {
        g_settings.max_epochs = std::stoi(*v);
      } else if (auto v = value("--ranks=")) {
        g_settings.ranks.clear();
        std::stringstream ss(*v);
        for (std::string part; std::getline(ss, part, ',');) g_settings.ranks.push_back(std::stoi(part));
      } else if (auto v = value("--device=")) {
        if (*v != "cpu" && *v != "cuda") throw std::invalid_argument("--device must be cpu or cuda");
        g_settings.cuda = *v == "cuda";
      } else if (auto v = value("--data=")) {
        g_settings.task.data = *v;
      } else if (auto v = value("--curve=")) {
        g_settings.curve = *v;
      } else {
        argv[kept++] = argv[i];
      }
    } catch (const std::exception& e) {
      std::fprintf(stderr, "bench_finetune: bad argument %s (%s)\n", a.c_str(), e.what());
      return false;
    }
  }
  argc = kept;
  for (int r : g_settings.ranks)
    if (r < 1 || kGlobalBatch % r != 0) {
      std::fprintf(stderr, "bench_finetune: --ranks %d must divide the global batch %lld\n", r,
                   static_cast<long long>(kGlobalBatch));
      return false;
    }
  if (g_settings.runs < 1 || g_settings.max_epochs < 1 || g_settings.eval_every < 1) {
    std::fprintf(stderr, "bench_finetune: --runs %d, --max-epochs %d and --eval-every %lld must be >= 1\n",
                 g_settings.runs, g_settings.max_epochs, static_cast<long long>(g_settings.eval_every));
    return false;
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  if (!parse_settings(argc, argv)) return 2;
  if (!fs::is_directory(g_settings.task.data)) {
    std::fprintf(stderr, "bench_finetune: %s is missing (apt-get install adwaita-icon-theme, or --data=DIR)\n",
                 g_settings.task.data.c_str());
    return 1;
  }
  if (!g_settings.curve.empty()) {
    g_curve.open(g_settings.curve);
    g_curve << "way,ranks,run,samples,seconds,accuracy\n";
  }
  for (int nproc : g_settings.ranks)
    for (Method m : {Method::one_at_a_time, Method::group_in_batch, Method::accumulate_32, Method::loom,
                     Method::loom_deterministic, Method::loom_no_recorder})
      benchmark::RegisterBenchmark(fmt::format("finetune/{}/ranks:{}", method_name(m), nproc).c_str(), BM_Finetune, m,
                                   nproc)
          ->Iterations(1)
          ->Repetitions(g_settings.runs)
          ->UseManualTime()
          ->Unit(benchmark::kSecond);
  std::vector<char*> args(argv, argv + argc);
  std::string interleave = "--benchmark_enable_random_interleaving=true";
  args.push_back(interleave.data());
  int ac = static_cast<int>(args.size());
  benchmark::Initialize(&ac, args.data());
  benchmark::AddCustomContext("target_accuracy", fmt::format("{}", g_settings.target));
  benchmark::AddCustomContext("samples_per_step", fmt::format("{}", kGlobalBatch));
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  std::printf("\n");
  for (int nproc : g_settings.ranks) print_ratio(nproc);
  for (int nproc : g_settings.ranks) print_deterministic_ratio(nproc);
  for (int nproc : g_settings.ranks) print_recorder_ratio(nproc);
  return 0;
}
