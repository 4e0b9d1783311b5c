// bench_plan — how evenly loom deals a step's batches to the ranks (GlobalBatchSampler,
// Dealing::balanced: longest-processing-time-first on padded elements) against round-robin
// dealing, on the shapes of Debian's Adwaita icons at the finetune_icons example's sizes (16, 24,
// 32, 48 px; 4 channels; buckets of at most 64 icons and 32 x 32 x 32 x 4 elements).
//
// For W = 2, 4, 8 ranks and a step of 4 x W (or 8 x W) batches, over 3 epochs' plans:
//   max_over_mean   the busiest rank's estimated cost (padded elements) / the mean rank's, per
//                   step, averaged over the full steps (goal <= 1.05 for balanced); and its worst
//                   step (max_over_mean_worst)
// Time: one epoch's plan_epoch + dealing of every step (what every rank computes per epoch).
// Granularity: with these options a batch costs one of two amounts (the pixel budget, or half of
// it for 16 px icons, whose batches stop at 64 samples), so a rank's load moves in half-batch
// units and no dealing can beat ceil-to-half(mean) / mean: about 1.03-1.07 with 4 batches per
// rank, half that with 8.
// Run: build-dir/bench/bench_plan. Needs adwaita-icon-theme (/usr/share/icons/Adwaita).
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <vector>

#include <benchmark/benchmark.h>

#include <loom/sample/global_batch.hpp>

#include "../examples/common/data/icons.hpp"

namespace {

const std::vector<std::vector<int64_t>>& icon_shapes() {
  static const std::vector<std::vector<int64_t>> shapes = [] {
    examples::data::IconFolder icons({.root = "/usr/share/icons/Adwaita",
                                      .sizes = {16, 24, 32, 48},
                                      .channels = 4,
                                      .on_corrupt = examples::data::OnCorrupt::skip,
                                      .warn = [](std::string_view) {}});
    std::vector<std::vector<int64_t>> s;
    for (std::size_t i = 0; i < icons.size(); ++i) {
      const auto sz = icons.pixels(i).sizes();
      s.emplace_back(sz.begin(), sz.end());
    }
    return s;
  }();
  return shapes;
}

loom::GlobalBatchOptions options(int world, int per_rank, loom::Dealing dealing) {
  return {.world_size = world,
          .seed = 1,
          .max_samples = 64,
          .max_elements = 32 * 32 * 32 * 4,
          .batches_per_step = per_rank * world,
          .dealing = dealing};
}

void BM_Deal(benchmark::State& state, loom::Dealing dealing) {
  const int world = static_cast<int>(state.range(0));
  const int per_rank = static_cast<int>(state.range(1));
  const auto& shapes = icon_shapes();
  double sum_ratio = 0, worst = 0;
  int64_t full_steps = 0;
  for (int64_t epoch = 0; epoch < 3; ++epoch) {
    loom::GlobalBatchSampler s(shapes, options(world, per_rank, dealing));
    s.set_epoch(epoch);
    for (int64_t k = 0; k < s.num_steps(); ++k) {
      if (s.plan().steps[static_cast<std::size_t>(k)].num_batches < per_rank * world)
        continue;  // the epoch's partial last step
      std::vector<double> load(static_cast<std::size_t>(world), 0.0);
      for (int r = 0; r < world; ++r)
        for (int64_t j : s.assignment(k, r))
          load[static_cast<std::size_t>(r)] +=
              static_cast<double>(s.plan().batches[static_cast<std::size_t>(j)].padded_elements);
      double mean = 0;
      for (double l : load) mean += l / world;
      const double ratio = *std::max_element(load.begin(), load.end()) / mean;
      sum_ratio += ratio;
      worst = std::max(worst, ratio);
      ++full_steps;
    }
  }
  for (auto _ : state) {
    auto plan = loom::plan_epoch(shapes, options(world, per_rank, dealing), 0);
    for (const auto& st : plan.steps) {
      std::vector<int64_t> costs;
      for (int64_t j = 0; j < st.num_batches; ++j)
        costs.push_back(plan.batches[static_cast<std::size_t>(st.first_batch + j)].padded_elements);
      benchmark::DoNotOptimize(loom::deal(costs, world, dealing));
    }
  }
  state.counters["max_over_mean"] = full_steps > 0 ? sum_ratio / static_cast<double>(full_steps) : 0.0;
  state.counters["max_over_mean_worst"] = worst;
  state.counters["steps"] = static_cast<double>(full_steps);
  state.counters["icons"] = static_cast<double>(shapes.size());
}

}  // namespace

int main(int argc, char** argv) {
  if (!std::filesystem::is_directory("/usr/share/icons/Adwaita")) {
    std::fprintf(stderr, "bench_plan: /usr/share/icons/Adwaita is missing (apt-get install adwaita-icon-theme)\n");
    return 1;
  }
  for (auto [name, d] :
       {std::pair{"deal/balanced", loom::Dealing::balanced}, std::pair{"deal/round_robin", loom::Dealing::round_robin}})
    benchmark::RegisterBenchmark(name, BM_Deal, d)
        ->ArgNames({"ranks", "batches_per_rank"})
        ->ArgsProduct({{2, 4, 8}, {4, 8}})
        ->Unit(benchmark::kMillisecond);
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
