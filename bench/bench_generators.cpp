// bench_generators — the generator loaders at the copy bound: generators that cost nothing, so a
// step costs what moving its bytes into batches costs, against a memcpy of the same bytes.
//
// Copy bound (issue 48): 64 generators, each returning one precomputed float32 sample (the same
// tensor every call: a cached sample, not owned by the loader, so the loader must copy it), onto
// 1 or 8 logical devices, prefetch depth 4, DefaultCollate and HostTransfer, 1 or 2 worker threads.
// A step is 1, 16 or 37 MiB (samples of 16 KiB, 256 KiB, 592 KiB).
//   memcpy/MiB:S                            the baseline: per step, the 64 samples memcpy'd into
//                                           the rows of one reused buffer of S MiB, on one thread.
//   generator_loader/MiB:S/devices:M/workers:W    loom::GeneratorLoader
//   rank_generator_loader/MiB:S/workers:W         loom::RankGeneratorLoader on a 1-rank
//                                                 loom::LocalCommunicator (1 device)
// The loaders are built (and run for a few warm-up steps) outside the timed loop; generators
// never end, and each iteration takes a fixed number of steps (256, 32, 16 for 1, 16, 37 MiB), so
// the time of an iteration is steps x time per step, the same count as the baseline's.
// Counters: GB_per_s (bytes per step x steps / time) and minflt_per_step (minor page faults per
// step over the timed loop, getrusage ru_minflt of the whole process: a fresh buffer per step
// shows up here).
//
// Seed: 16 generators of 4 KiB samples (1024 float32, the same cached tensor each call) onto 8
// devices, 2 per device, 512 steps per iteration.
//   seed/hand_loop      one thread: for each device, pull its 2 generators and torch::stack them.
//   seed/loom/workers:2 loom::GeneratorLoader, prefetch depth 4, 2 worker threads (the machine's
//                       cores: options.hpp's advice for CPU-bound generators).
//   seed/loom/workers:0 the same with the default num_workers (one thread per generator, 16).
// Counter: samples_per_s.
//
// Summary: one line per case that scripts read (ratio of repetition i's times, so 1 = as fast as
// the baseline):
//   RATIO <case>_vs_memcpy median=<m> min=<a> max=<b> n=<repetitions> goal>=<0.8 at 16 and 37 MiB, 0.5 at 1 MiB> met|NOT-met
//   RATIO seed_loom_workers:W_vs_hand_loop median=... goal>=1.00 met|NOT-met
// Each repetition is 4 iterations. The summary prints the load average at its end.
// Run (about 25 s on 2 cores; note the load beside the figures):
//   build-torch2/bench/bench_generators --benchmark_repetitions=5 --benchmark_enable_random_interleaving=true
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <sys/resource.h>
#include <utility>
#include <vector>

#include <ATen/ops/arange.h>
#include <ATen/ops/stack.h>
#include <benchmark/benchmark.h>
#include <fmt/format.h>

#include <loom/comm/local.hpp>
#include <loom/schedule/generator_loader.hpp>
#include <loom/schedule/rank_generator_loader.hpp>

namespace {

constexpr int kGenerators = 64;
constexpr int kDepth = 4;
constexpr int kWarmupSteps = 2 * kDepth + 2;

constexpr int kSeedGenerators = 16;
constexpr int kSeedDevices = 8;
constexpr int64_t kSeedFloats = 1024;  // 4 KiB
constexpr int kSeedSteps = 512;

// Bytes of one step and steps per iteration, by MiB per step.
int64_t step_bytes(int64_t mib) {
  return mib << 20;
}
int steps_per_iteration(int64_t mib) {
  return mib <= 1 ? 256 : mib <= 16 ? 32 : 16;
}

// Returns the same precomputed tensor on every call, forever (no generation cost; the loader does
// not own it, so it must copy it).
struct CachedGenerator {
  at::Tensor sample;
  std::optional<at::Tensor> operator()() const { return sample; }
};

std::vector<at::Tensor> samples_of(int n, int64_t floats) {
  std::vector<at::Tensor> s;
  for (int g = 0; g < n; ++g) s.push_back(at::arange(g * floats, (g + 1) * floats, at::TensorOptions(at::kFloat)));
  return s;
}

std::vector<CachedGenerator> generators_of(const std::vector<at::Tensor>& samples) {
  std::vector<CachedGenerator> g;
  for (const at::Tensor& s : samples) g.push_back({s});
  return g;
}

int64_t minor_faults() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_minflt;
}

// Counters of a copy-bound case.
void report(benchmark::State& state, int64_t mib, int steps, int64_t faults) {
  const double n = static_cast<double>(state.iterations()) * steps;
  state.counters["GB_per_s"] =
      benchmark::Counter(static_cast<double>(step_bytes(mib)) * n / 1e9, benchmark::Counter::kIsRate);
  state.counters["minflt_per_step"] = static_cast<double>(faults) / n;
}

void BM_memcpy(benchmark::State& state) {
  const int64_t mib = state.range(0);
  const int steps = steps_per_iteration(mib);
  const int64_t floats = step_bytes(mib) / kGenerators / 4;
  const auto samples = samples_of(kGenerators, floats);
  std::vector<char> buffer(static_cast<std::size_t>(step_bytes(mib)));
  const auto row = static_cast<std::size_t>(floats * 4);
  const int64_t f0 = minor_faults();
  for (auto _ : state) {
    for (int k = 0; k < steps; ++k) {
      for (std::size_t g = 0; g < samples.size(); ++g) std::memcpy(buffer.data() + g * row, samples[g].data_ptr(), row);
      benchmark::DoNotOptimize(buffer.data());
      benchmark::ClobberMemory();
    }
  }
  report(state, mib, steps, minor_faults() - f0);
}

// Takes `steps` steps of `loader` (GeneratorLoader: a step; RankGeneratorLoader: a DeviceBatch)
// and checks the first value of each batch (sample g's first float is g * floats).
template <class Loader, class Check>
void take(Loader& loader, int steps, Check check) {
  for (int k = 0; k < steps; ++k) {
    auto s = loader.next();
    if (!s) throw loom::Error("bench_generators: a loader ended");
    check(*s);
  }
}

void BM_generator_loader(benchmark::State& state) {
  const int64_t mib = state.range(0);
  const int devices = static_cast<int>(state.range(1));
  const int workers = static_cast<int>(state.range(2));
  const int steps = steps_per_iteration(mib);
  const int64_t floats = step_bytes(mib) / kGenerators / 4;
  loom::GeneratorLoader<CachedGenerator> loader(
      generators_of(samples_of(kGenerators, floats)),
      {.num_devices = devices, .prefetch_depth = kDepth, .num_workers = workers});
  bool ok = true;
  auto check = [&](const loom::GeneratorLoaderStep<loom::Batch>& s) {
    for (const auto& db : s.devices)
      ok = ok && db.batch.data.template data_ptr<float>()[0] == static_cast<float>(db.generators[0] * floats);
  };
  take(loader, kWarmupSteps, check);
  const int64_t f0 = minor_faults();
  for (auto _ : state) take(loader, steps, check);
  report(state, mib, steps, minor_faults() - f0);
  if (!ok) state.SkipWithError("a batch held the wrong values");
}

void BM_rank_generator_loader(benchmark::State& state) {
  const int64_t mib = state.range(0);
  const int workers = static_cast<int>(state.range(1));
  const int steps = steps_per_iteration(mib);
  const int64_t floats = step_bytes(mib) / kGenerators / 4;
  loom::LocalCommunicator comm;
  loom::RankGeneratorLoader<CachedGenerator, loom::LocalCommunicator> loader(
      comm, generators_of(samples_of(kGenerators, floats)), {.prefetch_depth = kDepth, .num_workers = workers});
  bool ok = true;
  auto check = [&](const loom::DeviceBatch<loom::Batch>& db) {
    ok = ok && db.batch.data.template data_ptr<float>()[0] == static_cast<float>(db.generators[0] * floats);
  };
  take(loader, kWarmupSteps, check);
  const int64_t f0 = minor_faults();
  for (auto _ : state) take(loader, steps, check);
  report(state, mib, steps, minor_faults() - f0);
  if (!ok) state.SkipWithError("a batch held the wrong values");
}

void BM_seed_hand_loop(benchmark::State& state) {
  auto gens = generators_of(samples_of(kSeedGenerators, kSeedFloats));
  const int per_device = kSeedGenerators / kSeedDevices;
  float sum = 0;
  for (auto _ : state) {
    for (int k = 0; k < kSeedSteps; ++k) {
      for (int d = 0; d < kSeedDevices; ++d) {
        std::vector<at::Tensor> rows;
        for (int p = 0; p < per_device; ++p) rows.push_back(*gens[static_cast<std::size_t>(d * per_device + p)]());
        at::Tensor b = at::stack(rows);
        sum += b.data_ptr<float>()[0];
      }
    }
  }
  benchmark::DoNotOptimize(sum);
  state.counters["samples_per_s"] = benchmark::Counter(
      static_cast<double>(state.iterations()) * kSeedSteps * kSeedGenerators, benchmark::Counter::kIsRate);
}

void BM_seed_loom(benchmark::State& state) {
  loom::GeneratorLoader<CachedGenerator> loader(
      generators_of(samples_of(kSeedGenerators, kSeedFloats)),
      {.num_devices = kSeedDevices, .prefetch_depth = kDepth, .num_workers = static_cast<int>(state.range(0))});
  float sum = 0;
  auto check = [&](const loom::GeneratorLoaderStep<loom::Batch>& s) {
    for (const auto& db : s.devices) sum += db.batch.data.data_ptr<float>()[0];
  };
  take(loader, kWarmupSteps, check);
  for (auto _ : state) take(loader, kSeedSteps, check);
  benchmark::DoNotOptimize(sum);
  state.counters["samples_per_s"] = benchmark::Counter(
      static_cast<double>(state.iterations()) * kSeedSteps * kSeedGenerators, benchmark::Counter::kIsRate);
}

// Prints the RATIO lines (see the file comment) after the console output.
class RatioReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& r : runs)
      if (r.run_type == Run::RT_Iteration && !r.error_occurred) {
        std::string name = r.run_name.function_name;
        if (!r.run_name.args.empty()) name += "/" + r.run_name.args;
        reps_[name].push_back(r.GetAdjustedRealTime());
      }
  }
  void Finalize() override {
    ConsoleReporter::Finalize();
    auto& out = GetOutputStream();
    double load[3] = {0, 0, 0};
    getloadavg(load, 3);  // the machine's load while the suite ran (not quiet: ratios move)
    out << fmt::format("\nSummary: baseline time / loom time per repetition (load average {:.2f} {:.2f} {:.2f})\n",
                       load[0], load[1], load[2]);
    for (const auto& [name, times] : reps_) {
      if (name.rfind("memcpy", 0) == 0 || name.rfind("seed", 0) == 0) continue;
      const std::string mib =
          name.substr(name.find("MiB:") + 4, name.find('/', name.find("MiB:")) - name.find("MiB:") - 4);
      const double goal = mib == "1" ? 0.5 : 0.8;
      line(out, name + "_vs_memcpy", "memcpy/MiB:" + mib, name, goal);
    }
    for (const char* w : {"2", "0"})
      line(out, fmt::format("seed_loom_workers:{}_vs_hand_loop", w), "seed/hand_loop",
           fmt::format("seed/loom/workers:{}", w), 1.0);
  }

 private:
  void line(std::ostream& out, const std::string& label, const std::string& base, const std::string& name,
            double goal) {
    const auto b = reps_.find(base);
    const auto t = reps_.find(name);
    if (b == reps_.end() || t == reps_.end()) return;
    std::vector<double> r;
    for (std::size_t i = 0; i < std::min(b->second.size(), t->second.size()); ++i)
      r.push_back(b->second[i] / t->second[i]);
    if (r.empty()) return;
    std::sort(r.begin(), r.end());
    const std::size_t m = r.size();
    const double med = m % 2 == 1 ? r[m / 2] : 0.5 * (r[m / 2 - 1] + r[m / 2]);
    out << fmt::format("RATIO {:<60} median={:.3f} min={:.3f} max={:.3f} n={} goal>={:.2f} {}\n", label, med, r.front(),
                       r.back(), m, goal, med >= goal ? "met" : "NOT-met");
  }
  std::map<std::string, std::vector<double>> reps_;  // run name -> real time of each repetition
};

void timed(benchmark::internal::Benchmark* b) {
  b->UseRealTime()->Unit(benchmark::kMillisecond)->Iterations(4);
}

}  // namespace

BENCHMARK(BM_memcpy)->Name("memcpy")->ArgName("MiB")->Arg(1)->Arg(16)->Arg(37)->Apply(timed);
BENCHMARK(BM_generator_loader)
    ->Name("generator_loader")
    ->ArgNames({"MiB", "devices", "workers"})
    ->ArgsProduct({{1, 16, 37}, {1, 8}, {1, 2}})
    ->Apply(timed);
BENCHMARK(BM_rank_generator_loader)
    ->Name("rank_generator_loader")
    ->ArgNames({"MiB", "workers"})
    ->ArgsProduct({{1, 16, 37}, {1, 2}})
    ->Apply(timed);
BENCHMARK(BM_seed_hand_loop)->Name("seed/hand_loop")->Apply(timed);
BENCHMARK(BM_seed_loom)->Name("seed/loom")->ArgName("workers")->Arg(2)->Arg(0)->Apply(timed);

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  RatioReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();
  return 0;
}
