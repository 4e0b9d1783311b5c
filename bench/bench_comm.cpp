// bench_comm — Gloo all-reduce between 2 local ranks (loom::spawn, loopback), float32 buffers from
// 4 KiB to 64 MiB, reported as time per all-reduce plus the nccl-tests bandwidths:
//   algbw = bytes / time,   busbw = algbw * 2(n-1)/n   (n ranks; for n = 2, busbw == algbw).
//
// Three variants run in the same process pair, so their ratios are meaningful on a noisy machine:
//   raw_c10d      baseline: ProcessGroupGloo::allreduce + wait, no loom code in the loop
//   loom          GlooCommunicator::all_reduce with check_metadata = false (the reducer's hot path)
//   loom_checked  GlooCommunicator::all_reduce with the default cross-rank metadata check
// At the end rank 0 prints loom / raw_c10d time ratios per size.
//
// Method: rank 0 runs Google Benchmark; before each benchmark run it broadcasts (variant, bytes,
// iterations) so rank 1 performs the same collectives; one untimed all-reduce warms each buffer;
// buffers are allocated outside the timed loop and hold zeros (sums stay 0, no inf/denormals).
// Defaults: 5 repetitions, random interleaving, medians reported (flags on the command line win).
// Usage: bench_comm [--benchmark_filter=...] [--benchmark_min_time=...] [--benchmark_repetitions=...]
#include <map>
#include <string>
#include <utility>

#include <benchmark/benchmark.h>
#include <torch/version.h>

#include <loom/comm/gloo.hpp>
#include <loom/launch/spawn.hpp>

namespace {

enum Variant : std::int64_t { kStop = 0, kRaw = 1, kLoom = 2, kLoomChecked = 3 };
constexpr int kRanks = 2;

struct Comms {
  loom::GlooCommunicator fast;     // check_metadata = false
  loom::GlooCommunicator checked;  // default check
};

/// One all-reduce of `buf` in the given variant (on either rank).
void run_once(Comms& c, Variant v, at::Tensor& buf) {
  switch (v) {
    case kRaw: {
      std::vector<at::Tensor> ts{buf};
      c.fast.process_group()->allreduce(ts)->wait();
      break;
    }
    case kLoom: c.fast.all_reduce(buf, loom::ReduceOp::sum); break;
    case kLoomChecked: c.checked.all_reduce(buf, loom::ReduceOp::sum); break;
    case kStop: break;
  }
}

/// Rank 0 -> rank 1: what to run next. Returns the command as seen on this rank.
std::array<std::int64_t, 3> exchange_command(Comms& c, std::array<std::int64_t, 3> cmd) {
  auto t = at::tensor(std::vector<std::int64_t>(cmd.begin(), cmd.end()), at::kLong);
  c.fast.broadcast(t, 0);
  auto* p = t.data_ptr<std::int64_t>();
  return {p[0], p[1], p[2]};
}

at::Tensor& buffer_for(std::map<std::int64_t, at::Tensor>& cache, std::int64_t bytes) {
  auto it = cache.find(bytes);
  if (it == cache.end()) it = cache.emplace(bytes, at::zeros({bytes / 4}, at::kFloat)).first;
  return it->second;
}

void serve(Comms& c) {  // rank 1
  std::map<std::int64_t, at::Tensor> cache;
  for (;;) {
    auto [variant, bytes, iters] = exchange_command(c, {0, 0, 0});
    if (variant == kStop) return;
    auto& buf = buffer_for(cache, bytes);
    run_once(c, static_cast<Variant>(variant), buf);  // warm-up
    for (std::int64_t i = 0; i < iters; ++i) run_once(c, static_cast<Variant>(variant), buf);
  }
}

Comms* g_comms = nullptr;
std::map<std::int64_t, at::Tensor> g_cache;

void BM_AllReduce(benchmark::State& state, Variant variant) {
  const std::int64_t bytes = state.range(0);
  const auto iters = static_cast<std::int64_t>(state.max_iterations);
  exchange_command(*g_comms, {variant, bytes, iters});
  auto& buf = buffer_for(g_cache, bytes);
  run_once(*g_comms, variant, buf);  // warm-up, untimed
  for (auto _ : state) run_once(*g_comms, variant, buf);
  const double n = kRanks;
  state.counters["bytes"] = static_cast<double>(bytes);
  state.counters["algbw"] =
      benchmark::Counter(static_cast<double>(bytes), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["busbw"] =
      benchmark::Counter(static_cast<double>(bytes) * 2.0 * (n - 1) / n, benchmark::Counter::kIsIterationInvariantRate);
}

/// Console output plus a final table of loom / raw_c10d time ratios.
class RatioReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const auto& r : runs) {
      if (r.error_occurred) continue;
      const std::pair key{r.run_name.function_name, std::stoll(r.run_name.args)};
      if (r.run_type == Run::RT_Aggregate && r.aggregate_name == "median") {
        medians_[key] = r.GetAdjustedRealTime();
      } else if (r.run_type == Run::RT_Iteration) {
        times_[key] = r.GetAdjustedRealTime();  // the last repetition; replaced by the median if there is one
      }
    }
  }
  void Finalize() override {
    ConsoleReporter::Finalize();
    std::map<long long, std::map<std::string, double>> by_size;  // bytes -> variant -> time
    for (const auto& [key, t] : times_) by_size[key.second][key.first] = t;
    for (const auto& [key, t] : medians_) by_size[key.second][key.first] = t;
    fmt::print("\nratio of time per all-reduce to the raw c10d baseline ({}; 1.00 = no overhead)\n",
               medians_.empty() ? "single runs" : "medians of the repetitions");
    fmt::print("{:>10}  {:>8}  {:>12}\n", "bytes", "loom", "loom_checked");
    for (const auto& [bytes, m] : by_size) {
      auto raw = m.find("allreduce/raw_c10d");
      if (raw == m.end()) continue;
      auto ratio = [&](const char* name) {
        auto it = m.find(name);
        return it == m.end() ? std::string("-") : fmt::format("{:.2f}", it->second / raw->second);
      };
      fmt::print("{:>10}  {:>8}  {:>12}\n", bytes, ratio("allreduce/loom"), ratio("allreduce/loom_checked"));
    }
  }

 private:
  std::map<std::pair<std::string, long long>, double> times_, medians_;
};

}  // namespace

int main(int argc, char** argv) {
  loom::spawn(
      kRanks,
      [&](const loom::Environment& env) {
        const auto timeout = std::chrono::seconds(300);
        auto store = loom::rendezvous(env, {.timeout = timeout});
        Comms comms{
            loom::GlooCommunicator(store, env.rank, env.world_size, {.timeout = timeout, .check_metadata = false}),
            loom::GlooCommunicator(store, env.rank, env.world_size, {.timeout = timeout})};
        if (env.rank != 0) {
          serve(comms);
          return;
        }
        g_comms = &comms;
        for (auto [name, variant] : {std::pair{"allreduce/raw_c10d", kRaw}, std::pair{"allreduce/loom", kLoom},
                                     std::pair{"allreduce/loom_checked", kLoomChecked}}) {
          benchmark::RegisterBenchmark(name, BM_AllReduce, variant)
              ->RangeMultiplier(4)
              ->Range(4 << 10, 64 << 20)
              ->UseRealTime()
              ->Unit(benchmark::kMicrosecond);
        }
        // Defaults for a noisy shared machine: 5 repetitions in random interleaving (variants and sizes
        // alternate, so a burst of load hits all of them) and medians; command-line flags override them.
        std::vector<char*> args(argv, argv + argc);
        std::string reps = "--benchmark_repetitions=5", interleave = "--benchmark_enable_random_interleaving=true",
                    aggregates = "--benchmark_report_aggregates_only=true", min_time = "--benchmark_min_time=0.2";
        for (auto* flag : {&reps, &interleave, &aggregates, &min_time}) {
          const std::string name = flag->substr(0, flag->find('='));
          bool given = false;
          for (int i = 1; i < argc; ++i) given = given || std::string(argv[i]).rfind(name, 0) == 0;
          if (!given) args.insert(args.begin() + 1, flag->data());
        }
        int ac = static_cast<int>(args.size());
        benchmark::Initialize(&ac, args.data());
        benchmark::AddCustomContext("libtorch", TORCH_VERSION);  // which LibTorch the anchors ran on
        RatioReporter reporter;
        benchmark::RunSpecifiedBenchmarks(&reporter);
        benchmark::Shutdown();
        exchange_command(comms, {kStop, 0, 0});
        g_comms = nullptr;
        g_cache.clear();
      },
      {.timeout = std::chrono::hours(1)});
  return 0;
}
