// bench_loader — BatchLoader's background loading (LoaderOptions::num_workers) against the same
// training with the data already in memory, in one run.
//
//   loader/in_memory             fetch returns a tensor held in memory (a copy of it): the floor.
//   loader/workers:N             fetch waits a fixed time per sample first (--fetch_us, default
//                                2000 us: reading a file, a decode outside this process), N = 0 (fetch
//                                and collate on the training thread), 1, 2, 4, 8.
// Each iteration is one epoch of loom::Trainer over 512 samples of 3 x 32 x 32 and 3 x 40 x 40
// (float32, 10 classes), batches of 16, one batch per step: a two-layer convolutional network's
// forward, backward and SGD step, on one intra-op thread (at::set_num_threads(1)), so the step
// uses one core and the other is left to the workers on a 2-core machine. Time per step =
// iteration time / 32 steps. Model and data are built once, outside the timed loop; the loader
// (and its workers) lives across iterations; one untimed epoch warms up first.
//
// Summary: one line per worker count that scripts read:
//   RATIO loader_workers:N_vs_in_memory median=<m> min=<a> max=<b> n=<repetitions> goal>=0.91 met|NOT-met
// (in-memory time / workers:N time of repetition i of each, so 1 is as fast as data in memory; the
// goal, a step within 1.1x of the in-memory step, applies with enough workers: fetch time per batch
// / workers below the step time). Run with --benchmark_repetitions=5
// --benchmark_enable_random_interleaving=true on a quiet machine (load under 1.5).
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <benchmark/benchmark.h>
#include <fmt/format.h>
#include <torch/torch.h>

#include <loom/comm/local.hpp>
#include <loom/train/loader.hpp>
#include <loom/train/trainer.hpp>

namespace {

constexpr int64_t kSamples = 512;
constexpr int64_t kBatch = 16;
int64_t g_fetch_us = 2000;  // --fetch_us

struct Data {
  std::vector<std::pair<at::Tensor, int64_t>> samples;
  std::vector<std::vector<int64_t>> shapes;
  Data() {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
    for (int64_t i = 0; i < kSamples; ++i) {
      const int64_t side = i % 2 == 0 ? 32 : 40;
      samples.emplace_back(at::randn({3, side, side}, gen), i % 10);
      shapes.push_back({3, side, side});
    }
  }
};

const Data& data() {
  static const Data d;
  return d;
}

struct NetImpl : torch::nn::Module {
  torch::nn::Conv2d c1{torch::nn::Conv2dOptions(3, 32, 3).padding(1)};
  torch::nn::Conv2d c2{torch::nn::Conv2dOptions(32, 32, 3).padding(1)};
  torch::nn::Linear head{32, 10};
  NetImpl() {
    register_module("c1", c1);
    register_module("c2", c2);
    register_module("head", head);
  }
  at::Tensor forward(const at::Tensor& x) { return head(torch::relu(c2(torch::relu(c1(x)))).mean({2, 3})); }
};
TORCH_MODULE(Net);

// One epoch per iteration, fetching through `fetch` with `workers` loader threads.
template <class Fetch>
void train_epochs(benchmark::State& state, Fetch fetch, int workers) {
  torch::manual_seed(0);
  loom::LocalCommunicator comm;
  Net net;
  torch::optim::SGD sgd(net->parameters(), 0.01);
  loom::BatchLoader loader(comm, data().shapes, std::move(fetch),
                           {.seed = 1, .max_samples = kBatch, .batches_per_step = 1}, {.num_workers = workers});
  loom::Trainer trainer(comm, *net, sgd);
  int64_t epoch = 0, steps = 0;
  auto run_epoch = [&] {
    for (loom::Batch& b : trainer.epoch(loader, epoch))
      trainer.backward(torch::cross_entropy_loss(net->forward(b.data), b.targets), b);
    ++epoch;
  };
  run_epoch();  // warm-up, untimed: allocator, worker threads, first plans
  for (auto _ : state) {
    run_epoch();
    steps += loader.sampler().num_steps();
  }
  state.counters["s_per_step"] =
      benchmark::Counter(static_cast<double>(steps), benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}

void BM_in_memory(benchmark::State& state) {
  train_epochs(
      state,
      [](int64_t i) {
        return std::make_pair(data().samples[static_cast<std::size_t>(i)].first.clone(),
                              data().samples[static_cast<std::size_t>(i)].second);
      },
      0);
}

void BM_workers(benchmark::State& state) {
  train_epochs(
      state,
      [](int64_t i) {
        std::this_thread::sleep_for(std::chrono::microseconds(g_fetch_us));
        return std::make_pair(data().samples[static_cast<std::size_t>(i)].first.clone(),
                              data().samples[static_cast<std::size_t>(i)].second);
      },
      static_cast<int>(state.range(0)));
}

// Prints the RATIO lines (see the file comment) after the console output.
class RatioReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& r : runs)
      if (r.run_type == Run::RT_Iteration) reps_[r.run_name.str()].push_back(r.GetAdjustedRealTime());
  }
  void Finalize() override {
    ConsoleReporter::Finalize();
    auto& out = GetOutputStream();
    out << fmt::format("\nSummary: in-memory time / loader time per repetition (fetch {} us per sample)\n", g_fetch_us);
    const auto* base = find("loader/in_memory");
    if (base == nullptr) return;
    for (const auto& [name, times] : reps_) {
      if (name.rfind("loader/workers", 0) != 0) continue;
      std::vector<double> r;
      for (std::size_t i = 0; i < std::min(base->size(), times.size()); ++i) r.push_back((*base)[i] / times[i]);
      if (r.empty()) continue;
      std::sort(r.begin(), r.end());
      const std::size_t m = r.size();
      const double med = m % 2 == 1 ? r[m / 2] : 0.5 * (r[m / 2 - 1] + r[m / 2]);
      const std::string workers = name.substr(name.find(':') + 1, name.find('/', name.find(':')) - name.find(':') - 1);
      out << fmt::format(
          "RATIO loader_workers:{}_vs_in_memory{:<8} median={:.3f} min={:.3f} max={:.3f} n={} "
          "goal>=0.91 {}\n",
          workers, "", med, r.front(), r.back(), m, med >= 0.91 ? "met" : "NOT-met");
    }
  }

 private:
  const std::vector<double>* find(const std::string& prefix) const {
    for (const auto& [k, v] : reps_)
      if (k == prefix || k.rfind(prefix + "/", 0) == 0) return &v;
    return nullptr;
  }
  std::map<std::string, std::vector<double>> reps_;  // run name -> real time of each repetition
};

void timed(benchmark::internal::Benchmark* b) {
  b->UseRealTime()->Unit(benchmark::kMillisecond)->Iterations(3);
}

}  // namespace

BENCHMARK(BM_in_memory)->Name("loader/in_memory")->Apply(timed);
BENCHMARK(BM_workers)->Name("loader/workers")->ArgName("workers")->Arg(0)->Arg(1)->Arg(2)->Arg(4)->Arg(8)->Apply(timed);

int main(int argc, char** argv) {
  at::set_num_threads(1);  // the step on one core (see the file comment)
  for (int k = 1; k < argc; ++k) {
    const std::string a = argv[k];
    if (a.rfind("--fetch_us=", 0) == 0) {
      g_fetch_us = std::stoll(a.substr(11));
      std::copy(argv + k + 1, argv + argc + 1, argv + k);  // drop it (argv[argc] is null)
      --argc;
      --k;
    }
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  RatioReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();
  return 0;
}
