// bench_finetune — the main job four ways: fine-tune the icon model (examples/common/icons_task.hpp:
// Adwaita icons at 16, 24, 32 and 48 px, every icon at its own size) for the same number of epochs,
// and report training samples/s and final validation accuracy side by side, on 1 and 2 ranks.
//
//   one_at_a_time     batch size 1 (the naive answer to images of different sizes): an optimizer
//                     step per image
//   group_in_batch    random batches of 32 split into same-shape groups inside each batch, one
//                     forward per group, one optimizer step per batch of 32 (the "group by shape
//                     in collate_fn" recipe); the loss of each group is its mean, scaled by the
//                     group's share of the batch
//   accumulate_32     batch size 1 with gradient accumulation over 32 images (an optimizer step
//                     per 32 images, each image's loss divided by 32)
//   loom              loom::BatchLoader (exact-shape buckets of at most 32 samples under a pixel
//                     budget; as many batches per optimizer step as ranks, so a step holds about
//                     32 x ranks samples like the DDP runs) + loom::Trainer
// The three baselines run the way DDP runs them: torch's DistributedSampler shards the indices
// (padding by repeats), every rank steps with the gradient averaged over ranks (loom::Reducer with
// Average::world_size, DDP's convention). Every method: AdamW, lr 1.5e-3, weight decay 1e-4, the
// same initial weights, the same epochs (kEpochs), no pre-training.
//
// Method: Google Benchmark in this (parent) process; each run starts the ranks with loom::run
// (fork), which train and evaluate; rank 0 reports the training time (data decoding and
// evaluation excluded), the samples trained (over all ranks) and the validation accuracy through a
// file; the benchmark's manual time is that training time. Counters: samples_per_s, val_accuracy,
// steps (optimizer steps). Run: build-dir/bench/bench_finetune [--benchmark_filter=...].
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <numeric>
#include <string>
#include <vector>

#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <loom/accumulate/accumulator.hpp>
#include <loom/compat.hpp>
#include <loom/dist/run.hpp>
#include <loom/reduce/module.hpp>
#include <loom/reduce/reducer.hpp>
#include <loom/sample/distributed.hpp>
#include <loom/train/loader.hpp>
#include <loom/train/trainer.hpp>

#include "../examples/common/icons_task.hpp"

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int kEpochs = 3;
constexpr int kWidth = 32;
constexpr double kLr = 1.5e-3;
constexpr int64_t kBatch = 32;
constexpr int64_t kBatchPixels = 32 * 32 * 32;
const examples::IconTaskOptions kTask{};  // the example's defaults: sizes 16, 24, 32, 48; 4 channels

enum class Method { one_at_a_time, group_in_batch, accumulate_32, loom };

struct Result {
  double seconds = 0;   // training time (rank 0)
  int64_t samples = 0;  // samples trained, all ranks
  int64_t steps = 0;    // optimizer steps
  double accuracy = 0;  // final validation accuracy
};

double since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

at::Tensor stack_samples(const examples::IconTask& task, const std::vector<int64_t>& subset,
                         const std::vector<int64_t>& js, std::vector<int64_t>& labels) {
  std::vector<at::Tensor> xs;
  for (int64_t j : js) {
    auto [x, y] = task.sample(subset, j);
    xs.push_back(x);
    labels.push_back(y);
  }
  return torch::stack(xs);
}

/// One rank of one method; rank 0 writes its Result to `out`.
void train_rank(loom::ProcessGroup& pg, Method method, const fs::path& out) {
  at::set_num_threads(1);
  const examples::IconTask task(kTask, [](std::string_view) {});
  torch::manual_seed(kTask.seed);
  examples::IconNet model(kTask.channels, kWidth, task.classes());
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(kLr).weight_decay(1e-4));
  const auto& train = task.train();
  const auto n = static_cast<int64_t>(train.size());
  namespace F = torch::nn::functional;
  Result r;
  double seconds = 0;
  if (method == Method::loom) {
    loom::BatchLoader loader(pg, task.shapes_of(train), [&](int64_t j) { return task.sample(train, j); },
                             {.seed = kTask.seed,
                              .max_samples = kBatch,
                              .max_elements = kBatchPixels * kTask.channels,
                              .batches_per_step = pg.world_size()});
    loom::Trainer trainer(pg, *model, opt);
    trainer.on_step([&](const loom::SyncResult& s) { r.samples += s.global_samples; });
    for (int64_t e = 0; e < kEpochs; ++e) {
      const auto t0 = Clock::now();
      for (loom::Batch& b : trainer.epoch(loader, e))
        trainer.backward(F::cross_entropy(model->forward(b.data), b.targets), b);
      seconds += since(t0);
    }
    r.steps = trainer.steps();
  } else {
    // DDP's way: indices sharded by DistributedSampler, gradients averaged over ranks at each step.
    loom::Reducer reducer(pg, loom::parameters_of(*model), {.average = loom::Average::world_size});
    // group_in_batch: each group is a micro-batch (DDP: no_sync for all groups but the last), the
    // batch's last group closes the step.
    const int64_t per_step = method == Method::accumulate_32 ? kBatch : method == Method::one_at_a_time ? 1 : 0;
    loom::Accumulator acc(reducer, {.micro_batches_per_step = per_step});
    loom::DistributedSampler sampler(
        {.dataset_size = n, .num_replicas = pg.world_size(), .rank = pg.rank(), .seed = kTask.seed});
    for (int64_t e = 0; e < kEpochs; ++e) {
      sampler.set_epoch(e);
      const auto t0 = Clock::now();
      std::vector<int64_t> pending;
      auto apply = [&](const loom::SyncResult& s) {
        if (s.apply) {
          opt.step();
          ++r.steps;
        }
        if (s.boundary) loom::zero_grad(opt, loom::GradReset::zero);
      };
      while (auto j = sampler.next()) {
        if (method != Method::group_in_batch) {  // one image per micro-batch
          std::vector<int64_t> labels;
          const at::Tensor x = stack_samples(task, train, {*j}, labels);
          const auto loss = F::cross_entropy(model->forward(x), torch::tensor(labels, torch::kLong));
          auto mb = acc.micro_batch(1);
          (method == Method::accumulate_32 ? loss / static_cast<double>(kBatch) : loss).backward();
          apply(mb.finish());
          r.samples += pg.world_size();
          continue;
        }
        pending.push_back(*j);
        if (static_cast<int64_t>(pending.size()) < kBatch) continue;
        // A random batch of 32, split into same-shape groups: one forward per group, loss = sum of
        // group means x group share (the batch mean), one step per batch.
        std::map<int64_t, std::vector<int64_t>> groups;
        for (int64_t i : pending)
          groups[task.icons().pixels(static_cast<std::size_t>(train[static_cast<std::size_t>(i)])).size(1)].push_back(
              i);
        std::size_t g = 0;
        for (auto& [side, js] : groups) {
          std::vector<int64_t> labels;
          const at::Tensor x = stack_samples(task, train, js, labels);
          const double share = static_cast<double>(js.size()) / static_cast<double>(pending.size());
          auto mb = acc.micro_batch(static_cast<int64_t>(js.size()), /*closes_step=*/++g == groups.size());
          (F::cross_entropy(model->forward(x), torch::tensor(labels, torch::kLong)) * share).backward();
          apply(mb.finish());
        }
        r.samples += static_cast<int64_t>(pending.size()) * pg.world_size();
        pending.clear();
      }
      if (!pending.empty()) pending.clear();  // the recipe drops the last partial batch (drop_last)
      while (auto s = acc.end_epoch()) apply(*s);
      seconds += since(t0);
    }
  }
  const examples::EvalResult ev =
      task.evaluate(pg, model, torch::Device(torch::kCPU), kBatch, kBatchPixels * kTask.channels);
  r.seconds = seconds;
  r.accuracy = ev.accuracy;
  if (pg.rank() == 0) {
    std::ofstream f(out);
    f << fmt::format("{:.17g} {} {} {:.17g}\n", r.seconds, r.samples, r.steps, r.accuracy);
  }
}

void BM_Finetune(benchmark::State& state, Method method, int nproc) {
  const fs::path out = fs::temp_directory_path() / fmt::format("loom-bench-finetune-{}.txt", ::getpid());
  for (auto _ : state) {
    fs::remove(out);
    loom::run(
        [&](loom::ProcessGroup& pg) { train_rank(pg, method, out); },
        {.nproc = nproc, .group = {.backend = loom::Backend::gloo}, .spawn = {.timeout = std::chrono::minutes(20)}});
    std::ifstream f(out);
    Result r;
    if (!(f >> r.seconds >> r.samples >> r.steps >> r.accuracy)) {
      state.SkipWithError("rank 0 wrote no result");
      return;
    }
    state.SetIterationTime(r.seconds);
    state.counters["samples_per_s"] = static_cast<double>(r.samples) / r.seconds;
    state.counters["val_accuracy"] = r.accuracy;
    state.counters["steps"] = static_cast<double>(r.steps);
  }
  fs::remove(out);
}

}  // namespace

int main(int argc, char** argv) {
  if (!fs::is_directory(kTask.data)) {
    std::fprintf(stderr, "bench_finetune: %s is missing (apt-get install adwaita-icon-theme)\n", kTask.data.c_str());
    return 1;
  }
  for (int nproc : {1, 2})
    for (auto [name, m] :
         {std::pair{"one_at_a_time", Method::one_at_a_time}, std::pair{"group_in_batch", Method::group_in_batch},
          std::pair{"accumulate_32", Method::accumulate_32}, std::pair{"loom", Method::loom}})
      benchmark::RegisterBenchmark(fmt::format("finetune/{}/ranks:{}", name, nproc).c_str(), BM_Finetune, m, nproc)
          ->Iterations(1)
          ->UseManualTime()
          ->Unit(benchmark::kSecond);
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
