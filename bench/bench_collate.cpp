// bench_collate — loom's collators against memcpy of the same bytes and the usual hand-written
// collate, all in one run; and the padding fraction of automatic boundaries vs rounding up to 32
// on the Adwaita icon sizes.
//
//   collate_224/{memcpy,naive,loom}    64 float32 samples of 3x224x224 into one batch, repeated.
//       memcpy: each sample's bytes into one preallocated, reused buffer (the floor);
//       naive:  torch::stack into a new tensor each time;
//       loom:   BucketCollator (exact shapes, max_samples 64) with a BufferPool.
//   collate_mixed/{memcpy,naive,loom}  4096 float32 samples of 3 x h x w, 8 distinct (h, w) in
//       [24, 40], shuffled, batch size 64.
//       memcpy: every sample's bytes into its slot of one of 8 reused 64-sample buffers (the
//               floor of any collator: same bytes, same write footprint, no bookkeeping);
//       naive:  std::map keyed by shape of vectors of tensors, torch::stack per full group and a
//               targets tensor (leftover groups stacked at the end);
//       loom:   `samples | loom::views::bucket_by_shape({.max_samples = 64, .pool = pool})`,
//               batches dropped as they come.
//   collate_padded/{memcpy,naive,loom}  4096 float32 sequences of L x 32 (L uniform in [8, 64]),
//       shuffled, padded to the longest of each batch of 64 (pad-to-max: the padded shape is known
//       only when the batch closes, so loom copies each sample on arrival into a staging buffer
//       and from there into the batch).
//       memcpy: every sample's bytes into its row of one of 8 reused 64 x 64 x 32 batch buffers
//               (padding not written);
//       naive:  per batch, a zero-filled new tensor of the batch's longest length and one
//               narrow().copy_() per sample (the usual hand-written pad collate);
//       loom:   `samples | loom::views::bucket_padded({.pad = {{.dim = 0}}, .max_samples = 64,
//               .pool = pool})`.
//   collate_padding/{round_up_32,auto_boundaries}: padding fraction counters on the icon sizes
//       (same number of buckets); the timed part is computing the boundaries.
//   sweep/{memcpy,loom}/batch:N  how cost grows with the batch size: collate_mixed's 4096 samples
//       with batches of N = 8, 32, 128, 512 (memcpy: N-slot reused buffers, one per shape).
//   sweep/tensors/batch:N  sweep/memcpy plus what every batch of LibTorch tensors costs at least:
//       each target written, and per batch its data and targets tensors made over the buffers and
//       dropped (the floor for a collator returning tensors; reported beside the memcpy goal).
//
// Method: inputs are built once, outside the timed loop; every variant touches the same source
// bytes; warm-up runs apart (MinWarmUpTime); real time. Speeds are bytes of sample data per
// second. After the run, a summary prints the ratios loom/memcpy and loom/naive per suite (from
// medians when --benchmark_repetitions is given), and one line per ratio that scripts read:
//   RATIO <name> median=<m> min=<a> max=<b> n=<repetitions> goal>=<g> met|NOT-met
// (baseline time / loom time of repetition i of each). On a shared machine run with
// --benchmark_repetitions=10 --benchmark_enable_random_interleaving=true (repetitions of the
// variants interleaved, so load drifts hit them alike); --benchmark_out=FILE.json
// --benchmark_out_format=json feeds scripts/plot_benchmarks.sh.
#include <algorithm>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <vector>

#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <loom/collate/all.hpp>

#include "../tests/reference/collate_reference.hpp"

namespace {

using Sample = std::pair<torch::Tensor, int64_t>;

struct Inputs224 {
  std::vector<Sample> samples;
  int64_t bytes = 0;
  Inputs224() {
    for (int64_t i = 0; i < 64; ++i) {
      samples.emplace_back(torch::randn({3, 224, 224}), i % 10);
      bytes += samples.back().first.nbytes();
    }
  }
};
const Inputs224& inputs224() {
  static const Inputs224 in;
  return in;
}

struct InputsMixed {
  std::vector<Sample> samples;
  int64_t bytes = 0;
  InputsMixed() {
    const std::vector<std::pair<int64_t, int64_t>> shapes{{24, 24}, {24, 40}, {28, 32}, {32, 32},
                                                          {32, 40}, {36, 28}, {40, 24}, {40, 40}};
    std::mt19937 rng(1234);
    std::vector<int> which(4096);
    for (std::size_t i = 0; i < which.size(); ++i) which[i] = static_cast<int>(i % shapes.size());
    std::shuffle(which.begin(), which.end(), rng);
    for (std::size_t i = 0; i < which.size(); ++i) {
      const auto [h, w] = shapes[static_cast<std::size_t>(which[i])];
      samples.emplace_back(torch::randn({3, h, w}), static_cast<int64_t>(i % 10));
      bytes += samples.back().first.nbytes();
    }
  }
};
const InputsMixed& inputs_mixed() {
  static const InputsMixed in;
  return in;
}

struct InputsPadded {
  std::vector<Sample> samples;
  int64_t bytes = 0;
  static constexpr int64_t kBatch = 64, kMaxLen = 64, kWidth = 32;
  InputsPadded() {
    std::mt19937 rng(4321);
    std::uniform_int_distribution<int64_t> len(8, kMaxLen);
    for (int64_t i = 0; i < 4096; ++i) {
      samples.emplace_back(torch::randn({len(rng), kWidth}), i % 10);
      bytes += samples.back().first.nbytes();
    }
  }
};
const InputsPadded& inputs_padded() {
  static const InputsPadded in;
  return in;
}

void memcpy_all(benchmark::State& state, const Inputs224& in) {
  std::vector<char> dst(static_cast<std::size_t>(in.bytes));
  std::memset(dst.data(), 0, dst.size());  // fault the pages in before timing
  for (auto _ : state) {
    std::size_t off = 0;
    for (const auto& s : in.samples) {
      std::memcpy(dst.data() + off, s.first.data_ptr(), s.first.nbytes());
      off += s.first.nbytes();
    }
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * in.bytes);
}

// The floor: the same bytes into one preallocated, reused batch buffer.
void BM_collate_224_memcpy(benchmark::State& state) {
  memcpy_all(state, inputs224());
}

void BM_collate_224_naive(benchmark::State& state) {
  const auto& in = inputs224();
  std::vector<torch::Tensor> ts;
  for (const auto& s : in.samples) ts.push_back(s.first);
  benchmark::DoNotOptimize(torch::stack(ts).data_ptr());  // untimed, like the others' first batch
  for (auto _ : state) {
    torch::Tensor batch = torch::stack(ts);
    benchmark::DoNotOptimize(batch.data_ptr());
  }
  state.SetBytesProcessed(state.iterations() * in.bytes);
}

void BM_collate_224_loom(benchmark::State& state) {
  const auto& in = inputs224();
  auto pool = std::make_shared<loom::BufferPool>();
  loom::BucketCollator<> c(loom::ShapeBucketOptions{.max_samples = 64, .pool = pool});
  int64_t index = 0;
  {  // one untimed batch maps the pool's buffer, as memcpy's destination is faulted in before timing
    for (const auto& s : in.samples) c.push(index++, s);
    benchmark::DoNotOptimize(c.pop().data.data_ptr());
  }
  for (auto _ : state) {
    for (const auto& s : in.samples) c.push(index++, s);
    loom::Batch b = c.pop();
    benchmark::DoNotOptimize(b.data.data_ptr());
  }
  state.SetBytesProcessed(state.iterations() * in.bytes);
  state.counters["pool_reuses"] = static_cast<double>(pool->reuses());
}

// The floor of any collator for this input: each sample copied to its slot in one of 8 reused
// batch buffers (one per shape, 64 slots, slot = running count mod 64). Destinations are computed
// before timing, so the timed loop is memcpy only, with the same write footprint as a collator.
void BM_collate_mixed_memcpy(benchmark::State& state) {
  const auto& in = inputs_mixed();
  std::map<std::vector<int64_t>, std::pair<std::vector<char>, int64_t>> groups;  // buffer, running count
  std::vector<char*> dst;
  for (const auto& s : in.samples) {
    auto& [buf, count] = groups[s.first.sizes().vec()];
    if (buf.empty()) buf.assign(64 * s.first.nbytes(), 0);  // faulted in before timing
    dst.push_back(buf.data() + (count++ % 64) * s.first.nbytes());
  }
  for (auto _ : state) {
    for (std::size_t i = 0; i < in.samples.size(); ++i)
      std::memcpy(dst[i], in.samples[i].first.data_ptr(), in.samples[i].first.nbytes());
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * in.bytes);
}

void BM_collate_mixed_naive(benchmark::State& state) {
  const auto& in = inputs_mixed();
  for (auto _ : state) {
    std::map<std::vector<int64_t>, std::pair<std::vector<torch::Tensor>, std::vector<int64_t>>> groups;
    auto emit = [](std::pair<std::vector<torch::Tensor>, std::vector<int64_t>>& g) {
      torch::Tensor data = torch::stack(g.first);
      torch::Tensor targets = torch::tensor(g.second, torch::kLong);
      benchmark::DoNotOptimize(data.data_ptr());
      benchmark::DoNotOptimize(targets.data_ptr());
      g.first.clear();
      g.second.clear();
    };
    for (const auto& s : in.samples) {
      auto& g = groups[s.first.sizes().vec()];
      g.first.push_back(s.first);
      g.second.push_back(s.second);
      if (g.first.size() == 64) emit(g);
    }
    for (auto& [key, g] : groups)
      if (!g.first.empty()) emit(g);
  }
  state.SetBytesProcessed(state.iterations() * in.bytes);
}

void BM_collate_mixed_loom(benchmark::State& state) {
  const auto& in = inputs_mixed();
  auto pool = std::make_shared<loom::BufferPool>();
  int64_t batches = 0;
  auto pass = [&] {
    for (loom::Batch& b : in.samples | loom::views::bucket_by_shape({.max_samples = 64, .pool = pool})) {
      benchmark::DoNotOptimize(b.data.data_ptr());
      ++batches;
    }
  };
  pass();  // untimed: maps the pool's buffers (memcpy's destination is faulted in before timing too)
  batches = 0;
  for (auto _ : state) pass();
  state.SetBytesProcessed(state.iterations() * in.bytes);
  state.counters["batches_per_pass"] = static_cast<double>(batches) / static_cast<double>(state.iterations());
}

// ---- sweep over the batch size (collate_mixed's samples) ----
void BM_sweep_memcpy(benchmark::State& state) {
  const auto& in = inputs_mixed();
  const int64_t n = state.range(0);
  std::map<std::vector<int64_t>, std::pair<std::vector<char>, int64_t>> groups;  // buffer, running count
  std::vector<char*> dst;
  for (const auto& s : in.samples) {
    auto& [buf, count] = groups[s.first.sizes().vec()];
    if (buf.empty()) buf.assign(static_cast<std::size_t>(n) * s.first.nbytes(), 0);  // faulted in before timing
    dst.push_back(buf.data() + (count++ % n) * static_cast<int64_t>(s.first.nbytes()));
  }
  for (auto _ : state) {
    for (std::size_t i = 0; i < in.samples.size(); ++i)
      std::memcpy(dst[i], in.samples[i].first.data_ptr(), in.samples[i].first.nbytes());
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * in.bytes);
}

// The floor of any collator that returns LibTorch tensors: sweep/memcpy's copies, each sample's
// int64 target written to its row of a reused targets buffer, and per batch the two tensors a batch
// carries (data: N x 3 x h x w float32, targets: N int64) made over those buffers the cheapest way
// LibTorch has (a TensorImpl over an existing Storage, sizes set contiguous) and dropped: what is
// left of loom's time above this is its own bookkeeping.
void BM_sweep_tensors(benchmark::State& state) {
  const auto& in = inputs_mixed();
  const int64_t n = state.range(0);
  struct Group {
    at::Tensor data, targets;  // uint8 buffers: n samples of one shape, n int64 targets
    std::vector<int64_t> sizes;
    int64_t count = 0;
  };
  std::map<std::vector<int64_t>, Group> groups;
  struct Slot {
    char* data;
    int64_t* target;
    Group* group;
    bool last;  // the sample that completes its group's batch
  };
  std::vector<Slot> slots;
  for (const auto& s : in.samples) {
    auto& g = groups[s.first.sizes().vec()];
    if (!g.data.defined()) {
      g.data = torch::zeros({n * static_cast<int64_t>(s.first.nbytes())}, torch::kUInt8);  // faulted in
      g.targets = torch::zeros({n * 8}, torch::kUInt8);
      g.sizes = s.first.sizes().vec();
      g.sizes.insert(g.sizes.begin(), n);
    }
    const int64_t row = g.count++ % n;
    slots.push_back({static_cast<char*>(g.data.data_ptr()) + row * static_cast<int64_t>(s.first.nbytes()),
                     static_cast<int64_t*>(g.targets.data_ptr()) + row, &g, row == n - 1});
  }
  const int64_t tsizes[1] = {n};
  auto tensor = [](const at::Tensor& buffer, c10::ScalarType dtype, c10::IntArrayRef sizes) {
    at::Tensor t = at::detail::make_tensor<c10::TensorImpl>(
        c10::Storage(buffer.storage()), c10::DispatchKeySet(c10::DispatchKey::CPU), c10::scalarTypeToTypeMeta(dtype));
    t.unsafeGetTensorImpl()->set_sizes_contiguous(sizes);
    return t;
  };
  for (auto _ : state) {
    for (std::size_t i = 0; i < in.samples.size(); ++i) {
      const Slot& slot = slots[i];
      std::memcpy(slot.data, in.samples[i].first.data_ptr(), in.samples[i].first.nbytes());
      *slot.target = in.samples[i].second;
      if (slot.last) {
        at::Tensor data = tensor(slot.group->data, at::kFloat, slot.group->sizes);
        at::Tensor targets = tensor(slot.group->targets, at::kLong, tsizes);
        benchmark::DoNotOptimize(data.unsafeGetTensorImpl());
        benchmark::DoNotOptimize(targets.unsafeGetTensorImpl());
      }
    }
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * in.bytes);
}

void BM_sweep_loom(benchmark::State& state) {
  const auto& in = inputs_mixed();
  auto pool = std::make_shared<loom::BufferPool>();
  auto pass = [&] {
    for (loom::Batch& b : in.samples | loom::views::bucket_by_shape({.max_samples = state.range(0), .pool = pool}))
      benchmark::DoNotOptimize(b.data.data_ptr());
  };
  pass();  // untimed: maps the pool's buffers
  for (auto _ : state) pass();
  state.SetBytesProcessed(state.iterations() * in.bytes);
  state.counters["pool_buffers"] = static_cast<double>(pool->size());
  state.counters["pool_allocations"] = static_cast<double>(pool->allocations());
}

// The floor for pad-to-max: each sample's bytes into its row of one of 8 reused batch buffers
// (64 rows of the longest possible length); padding is not written.
void BM_collate_padded_memcpy(benchmark::State& state) {
  const auto& in = inputs_padded();
  constexpr int64_t kRowBytes = InputsPadded::kMaxLen * InputsPadded::kWidth * 4;
  std::vector<std::vector<char>> buffers(8, std::vector<char>(InputsPadded::kBatch * kRowBytes, 0));
  std::vector<char*> dst;
  for (std::size_t i = 0; i < in.samples.size(); ++i)
    dst.push_back(buffers[(i / InputsPadded::kBatch) % 8].data() + (i % InputsPadded::kBatch) * kRowBytes);
  for (auto _ : state) {
    for (std::size_t i = 0; i < in.samples.size(); ++i)
      std::memcpy(dst[i], in.samples[i].first.data_ptr(), in.samples[i].first.nbytes());
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * in.bytes);
}

void BM_collate_padded_naive(benchmark::State& state) {
  const auto& in = inputs_padded();
  for (auto _ : state) {
    for (std::size_t first = 0; first < in.samples.size(); first += InputsPadded::kBatch) {
      const std::size_t last = std::min(in.samples.size(), first + InputsPadded::kBatch);
      int64_t longest = 0;
      for (std::size_t i = first; i < last; ++i) longest = std::max(longest, in.samples[i].first.size(0));
      torch::Tensor batch = torch::zeros({static_cast<int64_t>(last - first), longest, InputsPadded::kWidth});
      std::vector<int64_t> targets;
      for (std::size_t i = first; i < last; ++i) {
        batch[static_cast<int64_t>(i - first)].narrow(0, 0, in.samples[i].first.size(0)).copy_(in.samples[i].first);
        targets.push_back(in.samples[i].second);
      }
      torch::Tensor t = torch::tensor(targets, torch::kLong);
      benchmark::DoNotOptimize(batch.data_ptr());
      benchmark::DoNotOptimize(t.data_ptr());
    }
  }
  state.SetBytesProcessed(state.iterations() * in.bytes);
}

void BM_collate_padded_loom(benchmark::State& state) {
  const auto& in = inputs_padded();
  auto pool = std::make_shared<loom::BufferPool>();
  int64_t batches = 0;
  auto pass = [&] {
    for (loom::Batch& b : in.samples | loom::views::bucket_padded(
                                           {.pad = {{.dim = 0}}, .max_samples = InputsPadded::kBatch, .pool = pool})) {
      benchmark::DoNotOptimize(b.data.data_ptr());
      ++batches;
    }
  };
  pass();  // untimed: maps the pool's buffers
  batches = 0;
  for (auto _ : state) pass();
  state.SetBytesProcessed(state.iterations() * in.bytes);
  state.counters["batches_per_pass"] = static_cast<double>(batches) / static_cast<double>(state.iterations());
}

// ---- padding fraction on the Adwaita icon sizes ----
std::map<int64_t, int64_t> icon_histogram() {
  std::map<int64_t, int64_t> hist;
  for (const auto& [h, w] : loom_ref::png_sizes("/usr/share/icons/Adwaita")) ++hist[std::max(h, w)];
  return hist;
}

void BM_collate_padding_round_up_32(benchmark::State& state) {
  const auto hist = icon_histogram();
  if (hist.empty()) {
    state.SkipWithError("no PNG under /usr/share/icons/Adwaita (install adwaita-icon-theme)");
    return;
  }
  loom::BoundaryPlan plan;
  for (auto _ : state) {
    plan = loom::evaluate_boundaries(hist, loom::round_up_boundaries(hist, 32), 2);
    benchmark::DoNotOptimize(plan.padded_elements);
  }
  state.counters["padding_fraction"] = plan.padding_fraction();
  state.counters["buckets"] = static_cast<double>(plan.boundaries.size());
}

void BM_collate_padding_auto_boundaries(benchmark::State& state) {
  const auto hist = icon_histogram();
  if (hist.empty()) {
    state.SkipWithError("no PNG under /usr/share/icons/Adwaita (install adwaita-icon-theme)");
    return;
  }
  const auto k = static_cast<int64_t>(loom::round_up_boundaries(hist, 32).size());  // same bucket count
  loom::BoundaryPlan plan;
  for (auto _ : state) {
    plan = loom::auto_boundaries(hist, k, 2);
    benchmark::DoNotOptimize(plan.padded_elements);
  }
  state.counters["padding_fraction"] = plan.padding_fraction();
  state.counters["buckets"] = static_cast<double>(plan.boundaries.size());
}

constexpr double kWarmUp = 0.3;  // seconds

// ---- a reporter that also prints the ratios ----
// Speed ratio = time of the baseline / time of loom (the variants of a suite move the same bytes).
// Printed for real time and for CPU time: on a loaded machine CPU time is the steadier of the two.
class RatioReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& r : runs) {
      const std::string name = r.run_name.function_name;
      if (r.run_type == Run::RT_Aggregate) {
        if (r.aggregate_name != "median") continue;
        median_seen_.insert(name);
      } else if (median_seen_.count(name)) {
        continue;
      }
      times_[name] = {r.GetAdjustedRealTime(), r.GetAdjustedCPUTime()};
    }
    for (const Run& r : runs)
      if (r.run_type == Run::RT_Iteration) reps_[r.run_name.str()].push_back(r.GetAdjustedRealTime());
  }
  void Finalize() override {
    ConsoleReporter::Finalize();
    auto& out = GetOutputStream();
    out << "\nSummary: speed ratios (baseline time / loom time; medians when repeated)\n";
    for (const std::string suite : {"collate_224", "collate_mixed", "collate_padded"}) {
      const auto mem = times_[suite + "/memcpy"], naive = times_[suite + "/naive"], mine = times_[suite + "/loom"];
      if (mem.first > 0 && naive.first > 0 && mine.first > 0)
        out << fmt::format(
            "  {:<14} real time: loom/memcpy = {:.2f}  loom/naive = {:.2f}   CPU time: loom/memcpy = {:.2f}  "
            "loom/naive = {:.2f}\n",
            suite, mem.first / mine.first, naive.first / mine.first, mem.second / mine.second,
            naive.second / mine.second);
    }
    out << "\n";
    ratio_line(out, "collate_224_loom_vs_memcpy", "collate_224/memcpy", "collate_224/loom", 0.95);
    ratio_line(out, "collate_mixed_loom_vs_memcpy", "collate_mixed/memcpy", "collate_mixed/loom", 0.9);
    ratio_line(out, "collate_padded_loom_vs_memcpy", "collate_padded/memcpy", "collate_padded/loom", 0.0);
    for (int n : {8, 32, 128, 512})
      ratio_line(out, fmt::format("sweep_loom_vs_memcpy/batch:{}", n), fmt::format("sweep/memcpy/batch:{}", n),
                 fmt::format("sweep/loom/batch:{}", n), 0.9);
    for (int n : {8, 32, 128, 512})
      ratio_line(out, fmt::format("sweep_loom_vs_tensors/batch:{}", n), fmt::format("sweep/tensors/batch:{}", n),
                 fmt::format("sweep/loom/batch:{}", n), 0.0);
  }

  /// baseline time / loom time of repetition i of each: median, min, max.
  void ratio_line(std::ostream& out, const std::string& label, const std::string& base, const std::string& mine,
                  double goal) {
    auto find = [&](const std::string& name) -> const std::vector<double>* {
      for (const auto& [k, v] : reps_)
        if (k == name || k.rfind(name + "/", 0) == 0) return &v;
      return nullptr;
    };
    const auto *b = find(base), *l = find(mine);
    if (b == nullptr || l == nullptr) return;
    std::vector<double> r;
    for (std::size_t i = 0; i < std::min(b->size(), l->size()); ++i) r.push_back((*b)[i] / (*l)[i]);
    if (r.empty()) return;
    std::vector<double> sorted = r;
    std::sort(sorted.begin(), sorted.end());
    const std::size_t m = sorted.size();
    const double med = m % 2 == 1 ? sorted[m / 2] : 0.5 * (sorted[m / 2 - 1] + sorted[m / 2]);
    out << fmt::format("RATIO {:<34} median={:.3f} min={:.3f} max={:.3f} n={} goal>={:.2f} {}\n", label, med,
                       sorted.front(), sorted.back(), m, goal, med >= goal ? "met" : "NOT-met");
  }

 private:
  std::map<std::string, std::pair<double, double>> times_;  // name -> (real, cpu) time per iteration
  std::set<std::string> median_seen_;
  std::map<std::string, std::vector<double>> reps_;  // full run name -> real time of each repetition
};

}  // namespace

// Every timed variant: wall time in milliseconds after the warm-up (see the file comment).
void timed(benchmark::internal::Benchmark* b) {
  b->UseRealTime()->Unit(benchmark::kMillisecond)->MinWarmUpTime(kWarmUp);
}

BENCHMARK(BM_collate_224_memcpy)->Name("collate_224/memcpy")->Apply(timed);
BENCHMARK(BM_collate_224_naive)->Name("collate_224/naive")->Apply(timed);
BENCHMARK(BM_collate_224_loom)->Name("collate_224/loom")->Apply(timed);
BENCHMARK(BM_collate_mixed_memcpy)->Name("collate_mixed/memcpy")->Apply(timed);
BENCHMARK(BM_collate_mixed_naive)->Name("collate_mixed/naive")->Apply(timed);
BENCHMARK(BM_collate_mixed_loom)->Name("collate_mixed/loom")->Apply(timed);
BENCHMARK(BM_collate_padded_memcpy)->Name("collate_padded/memcpy")->Apply(timed);
BENCHMARK(BM_collate_padded_naive)->Name("collate_padded/naive")->Apply(timed);
BENCHMARK(BM_collate_padded_loom)->Name("collate_padded/loom")->Apply(timed);
BENCHMARK(BM_sweep_memcpy)->Name("sweep/memcpy")->ArgName("batch")->Arg(8)->Arg(32)->Arg(128)->Arg(512)->Apply(timed);
BENCHMARK(BM_sweep_tensors)->Name("sweep/tensors")->ArgName("batch")->Arg(8)->Arg(32)->Arg(128)->Arg(512)->Apply(timed);
BENCHMARK(BM_sweep_loom)->Name("sweep/loom")->ArgName("batch")->Arg(8)->Arg(32)->Arg(128)->Arg(512)->Apply(timed);
BENCHMARK(BM_collate_padding_round_up_32)->Name("collate_padding/round_up_32")->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_collate_padding_auto_boundaries)->Name("collate_padding/auto_boundaries")->Unit(benchmark::kMicrosecond);

int main(int argc, char** argv) {
  at::set_num_threads(1);  // one core for every variant: torch::stack would otherwise use the intra-op pool
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  RatioReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();
  return 0;
}
