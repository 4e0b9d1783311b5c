// examples/generators_to_devices — 16 real time series, each a generator that yields one window
// at a time, scheduled onto 8 devices (2 generators per device), one small forecaster trained on
// every device's collated batch with gradients reduced across devices, weighted exactly by samples.
//
// Data: CSV files of Debian's python3-vega-datasets (read with examples::data::read_csv): hourly
// temperatures (Seattle, San Francisco), daily Seattle weather, monthly stock prices (5 symbols)
// and monthly US employment (6 sectors): 16 series of 68 to 8,759 values, z-scored with the mean
// and deviation of their first 80 % (the training part); the last 20 % is held out.
// Generator g walks its series' training part in time order and yields (window of the last
// --window values, next value) pairs, one at a time (batch size 1), scaled by the window's typical
// step so one model fits every series (see window_at); short series end early.
// Loop:
//   loom::run starts the ranks (--devices of them on this machine, or joins the job of torchrun,
//   mpirun or srun) and hands each a loom::ProcessGroup (Gloo for a CPU model, NCCL for a GPU
//   one; see examples/common/placement.hpp).
//   --mode ranks (default), the short path: loom::GeneratorSource makes each epoch's generators and
//     gives rank r generators 2r and 2r+1 (a loom::RankGeneratorLoader), their k-th windows
//     collated into one 2-row batch (loom::DefaultCollate); every rank runs the same number of
//     steps (EndPolicy::drain: a rank whose series ended joins the remaining steps without a
//     batch). loom::Trainer trains it as it trains a dataset: backward of the batch mean, the
//     gradients all-reduced over the process group and weighted by the step's global rows, the
//     optimizer step, the epoch's end.
//   --mode in-process, the low-level layer (Reducer + Accumulator): one process (a process group
//     of world size 1) drives --devices logical devices with loom::GeneratorLoader (a prefetching
//     worker per generator); each device's batch is a micro-batch of one accumulation window, so
//     the step's gradient is again the mean over all devices' samples.
// Evaluation: every held-out window of every series, model vs the naive last-value forecast
// (mean squared error in z-score units), summed over ranks.
//
// Run:   build/examples/generators_to_devices                   (8 local ranks)
//        build/examples/generators_to_devices --mode in-process  (one process, 8 logical devices)
//        torchrun --nproc-per-node 8 build/examples/generators_to_devices   (torchrun's ranks)
// Output (rank 0): one line per epoch, then per-series errors and
//        result: model_mse=M naive_mse=N ratio=R windows=W epochs=E seconds=S
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>

#include <loom/accumulate/accumulator.hpp>
#include <loom/compat.hpp>
#include <loom/dist/run.hpp>
#include <loom/log/all.hpp>
#include <loom/reduce/module.hpp>
#include <loom/reduce/reducer.hpp>
#include <loom/schedule/generator_loader.hpp>
#include <loom/schedule/rank_generator_loader.hpp>
#include <loom/train/generator_source.hpp>
#include <loom/train/trainer.hpp>

#include "../common/data/csv.hpp"
#include "../common/placement.hpp"

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

struct Options {
  std::string mode = "ranks";  // ranks | in-process
  int devices = 8;
  std::string data;           // vega-datasets folder; empty: examples::data::find_vega_datasets()
  int window = 24;            // input values per sample
  int64_t max_windows = 256;  // training windows per series and epoch (long series are strided)
  double holdout = 0.2;       // last fraction of each series held out
  int epochs = 6;
  double lr = 2e-3;
  int hidden = 64;
  uint64_t seed = 1;
  std::string backend = "auto";  // auto | gloo | nccl (examples/common/placement.hpp)
  std::string device = "auto";   // auto | cpu | cuda
  double timeout = 0;            // seconds (--timeout; 0: LOOM_TIMEOUT, else loom::kDefaultTimeout)
};

// ------------------------------------------------------------------------------------------------
// The 16 series.
// ------------------------------------------------------------------------------------------------
struct Series {
  std::string name;
  std::vector<float> z;   // z-scored values (train-part mean and deviation)
  int64_t train_end = 0;  // values [0, train_end) are the training part
};

std::vector<Series> load_series(const Options& o) {
  const fs::path dir = o.data.empty() ? examples::data::find_vega_datasets({LOOM_SOURCE_ROOT}) : fs::path(o.data);
  std::vector<std::pair<std::string, std::vector<double>>> raw;
  auto add = [&](std::string name, std::vector<double> v) { raw.emplace_back(std::move(name), std::move(v)); };
  add("seattle-temps/temp", examples::data::read_csv(dir / "seattle-temps.csv").numeric_column("temp"));
  add("sf-temps/temp", examples::data::read_csv(dir / "sf-temps.csv").numeric_column("temp"));
  const auto weather = examples::data::read_csv(dir / "seattle-weather.csv");
  for (const char* c : {"temp_max", "temp_min", "wind"})
    add(fmt::format("seattle-weather/{}", c), weather.numeric_column(c));
  for (auto& [symbol, prices] : examples::data::read_csv(dir / "stocks.csv").numeric_columns_by("symbol", "price"))
    add("stocks/" + symbol, std::move(prices));
  const auto jobs = examples::data::read_csv(dir / "us-employment.csv");
  for (const char* c : {"nonfarm", "private", "goods_producing", "service_providing", "construction", "manufacturing"})
    add(fmt::format("us-employment/{}", c), jobs.numeric_column(c));

  std::vector<Series> out;
  for (auto& [name, v] : raw) {
    const auto n = static_cast<int64_t>(v.size());
    const auto train_end = static_cast<int64_t>(std::floor(static_cast<double>(n) * (1.0 - o.holdout)));
    if (train_end <= o.window + 1 || n - train_end < 1)
      throw loom::DataError(fmt::format("series {} has {} values: too short for --window {} and --holdout {}", name, n,
                                        o.window, o.holdout));
    double mean = 0, sq = 0;
    for (int64_t i = 0; i < train_end; ++i) mean += v[static_cast<std::size_t>(i)];
    mean /= static_cast<double>(train_end);
    for (int64_t i = 0; i < train_end; ++i) sq += std::pow(v[static_cast<std::size_t>(i)] - mean, 2);
    const double sd = std::sqrt(sq / static_cast<double>(train_end));
    if (!(sd > 0)) throw loom::DataError(fmt::format("series {} is constant over its training part", name));
    Series s{name, {}, train_end};
    s.z.reserve(v.size());
    for (double x : v) s.z.push_back(static_cast<float>((x - mean) / sd));
    out.push_back(std::move(s));
  }
  if (out.size() != 16)
    throw loom::DataError(fmt::format("{}: expected 16 series, found {}", dir.string(), out.size()));
  return out;
}

/// The model's view of the window ending before position t, made scale-free so one forecaster
/// serves hourly temperatures and monthly payrolls alike: the last `w` values minus the last one,
/// divided by the window's typical step `scale` (mean absolute first difference); the target is
/// (x[t] - last) / scale. A forecast of the next value is last + scale x model output; the naive
/// last-value forecast is an output of 0.
/// Shape: input {w} float32, target {1} float32; `scale` in the series' z-score units.
struct Window {
  torch::Tensor input;
  torch::Tensor target;
  float scale = 1;
  float change = 0;  // x[t] - last, z-score units
};

Window window_at(const Series& s, int64_t t, int w) {
  const float* z = s.z.data() + (t - w);  // z[0..w-1]: the window; z[w]: the value to forecast
  const float last = z[w - 1];
  float steps = 0;
  for (int i = 1; i < w; ++i) steps += std::abs(z[i] - z[i - 1]);
  const float scale = std::max(steps / static_cast<float>(w - 1), 1e-3f);
  Window out{torch::empty({w}, torch::kFloat), torch::empty({1}, torch::kFloat), scale, z[w] - last};
  auto* p = out.input.data_ptr<float>();
  for (int i = 0; i < w; ++i) p[i] = (z[i] - last) / scale;
  out.target.fill_(out.change / scale);
  return out;
}

/// A SampleGenerator (callable form): the training windows of one series in time order, strided
/// so that at most `max_windows` come out per epoch; the start offset changes with the epoch.
struct WindowGenerator {
  const Series* series;
  int window;
  int64_t t;  // next target position
  int64_t stride;

  WindowGenerator(const Series& s, int w, int64_t max_windows, int64_t epoch, uint64_t seed) : series(&s), window(w) {
    const int64_t first = w, count = s.train_end - first;  // targets in [w, train_end)
    stride = std::max<int64_t>(1, (count + max_windows - 1) / max_windows);
    t = first + static_cast<int64_t>((seed + static_cast<uint64_t>(epoch)) % static_cast<uint64_t>(stride));
  }

  std::optional<std::pair<torch::Tensor, torch::Tensor>> operator()() {
    if (t >= series->train_end) return std::nullopt;
    Window sample = window_at(*series, t, window);
    t += stride;
    return std::pair<torch::Tensor, torch::Tensor>(std::move(sample.input), std::move(sample.target));
  }
};

// ------------------------------------------------------------------------------------------------
// Model: an MLP forecaster of the next change, in units of the window's typical step.
// Shape: in N x w float32, out N x 1 float32. Trained with the squared error of that scaled change.
// ------------------------------------------------------------------------------------------------
torch::nn::Sequential make_forecaster(int w, int hidden) {
  return torch::nn::Sequential(torch::nn::Linear(w, hidden), torch::nn::Tanh(), torch::nn::Linear(hidden, hidden),
                               torch::nn::Tanh(), torch::nn::Linear(hidden, 1));
}

/// Squared errors of the model and of the naive forecast on the held-out windows of `series`,
/// summed over every rank's series: a 16 x 3 float64 CPU tensor [sum model, sum naive, count].
/// The model lives on `device`; the sums are all-reduced on the process group's device.
torch::Tensor holdout_errors(torch::nn::Sequential& model, torch::Device device, loom::ProcessGroup& pg,
                             const std::vector<Series>& series, const std::vector<int>& mine, int w) {
  torch::NoGradGuard no_grad;
  model->eval();
  torch::Tensor out = torch::zeros({static_cast<int64_t>(series.size()), 3}, torch::kDouble);
  for (int g : mine) {
    const Series& s = series[static_cast<std::size_t>(g)];
    std::vector<torch::Tensor> xs;
    std::vector<float> scales, changes;
    for (auto t = static_cast<int64_t>(s.z.size()) - 1; t >= s.train_end; --t) {
      Window win = window_at(s, t, w);
      xs.push_back(std::move(win.input));
      scales.push_back(win.scale);
      changes.push_back(win.change);
    }
    const auto n = static_cast<int64_t>(xs.size());
    const torch::Tensor change = torch::from_blob(changes.data(), {n, 1}, torch::kFloat).clone();
    const torch::Tensor scale = torch::from_blob(scales.data(), {n, 1}, torch::kFloat).clone();
    const torch::Tensor pred =
        model->forward(torch::stack(xs).to(device)).cpu() * scale;  // forecast change, z-score units
    out[g][0] = (pred - change).pow(2).sum().item<double>();
    out[g][1] = change.pow(2).sum().item<double>();
    out[g][2] = static_cast<double>(n);
  }
  model->train();
  torch::Tensor total = out.to(pg.device());
  pg.all_reduce(total, loom::ReduceOp::sum);
  return total.cpu();
}

template <class Log>
void report(Log& log, const std::vector<Series>& series, const torch::Tensor& errors, int epochs, double seconds) {
  for (std::size_t g = 0; g < series.size(); ++g) {
    const auto e = errors[static_cast<int64_t>(g)];
    const double n = e[2].item<double>();
    log.info("  {:<32} held-out windows {:5.0f}  model_mse={:.4f}  naive_mse={:.4f}", series[g].name, n,
             e[0].item<double>() / n, e[1].item<double>() / n);
  }
  const torch::Tensor total = errors.sum(0);
  const double n = total[2].item<double>();
  const double model_mse = total[0].item<double>() / n, naive_mse = total[1].item<double>() / n;
  log.info("result: model_mse={:.5f} naive_mse={:.5f} ratio={:.4f} windows={:.0f} epochs={} seconds={:.1f}", model_mse,
           naive_mse, naive_mse / model_mse, n, epochs, seconds);
}

/// Forward and mean squared error of one batch on `device` (the batch mean, what loom::Trainer takes).
torch::Tensor mse_step(torch::nn::Sequential& model, torch::Device device, const loom::Batch& b) {
  return torch::nn::functional::mse_loss(model->forward(b.data.to(device)), b.targets.to(device));
}

/// Mean squared errors of the model and of the naive forecast over every held-out window.
std::pair<double, double> holdout_mse(const torch::Tensor& errors) {
  const torch::Tensor total = errors.sum(0);
  return {(total[0] / total[2]).item<double>(), (total[1] / total[2]).item<double>()};
}

// ------------------------------------------------------------------------------------------------
// --mode ranks: one process per device; the steps are agreed over the ranks.
// ------------------------------------------------------------------------------------------------
void run_ranks(loom::ProcessGroup& pg, const Options& o, Clock::time_point start) {
  loom::Logger log(loom::StreamSink{stdout}, pg);
  const torch::Device device = examples::model_device(pg, o.device);
  const std::vector<Series> series = load_series(o);
  const int n = static_cast<int>(series.size());
  log.info(
      "generators_to_devices: {} series onto {} ranks ({} per rank), window {}, up to {} training windows per series "
      "(backend {}, model on {})",
      n, pg.world_size(), n / pg.world_size(), o.window, o.max_windows, loom::to_string(pg.backend()), device.str());

  torch::manual_seed(o.seed);
  auto model = make_forecaster(o.window, o.hidden);
  model->to(device);
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(o.lr));
  loom::Trainer trainer(pg, *model, opt);
  // Epoch e's generator g walks series g from an offset that depends on e (a fresh stream per epoch).
  loom::GeneratorSource source(pg, n,
                               [&](int g, int64_t epoch) {
                                 return WindowGenerator(series[static_cast<std::size_t>(g)], o.window, o.max_windows,
                                                        epoch, o.seed);
                               },
                               {.end = loom::EndPolicy::drain});
  const std::vector<int> mine = loom::generators_of(loom::Assignment::contiguous(), n, pg.world_size(), pg.rank());

  torch::Tensor errors = holdout_errors(model, device, pg, series, mine, o.window);
  const auto [model0, naive0] = holdout_mse(errors);
  log.info("before training: model_mse={:.5f} naive_mse={:.5f}", model0, naive0);
  for (int epoch = 0; epoch < o.epochs; ++epoch) {
    const auto t0 = Clock::now();
    loom::WeightedMean train_loss;
    int64_t steps = 0;
    trainer.on_step([&](const loom::SyncResult&) { ++steps; });  // every rank, every step (joined ones too)
    // b: this rank's 2 or 1 rows; a rank whose series ended joins the remaining steps (no batch here).
    for (loom::Batch& b : trainer.epoch(source, epoch)) {
      const torch::Tensor loss = mse_step(model, device, b);  // the batch mean
      train_loss.add(loss.item<double>(), static_cast<double>(b.num_samples));
      trainer.backward(loss, b);
    }
    const double loss = loom::global_mean(pg, train_loss);
    errors = holdout_errors(model, device, pg, series, mine, o.window);
    const auto [model_mse, naive_mse] = holdout_mse(errors);
    log.info("epoch {}/{}: steps={} train_loss={:.5f} holdout model_mse={:.5f} naive_mse={:.5f} seconds={:.1f}",
             epoch + 1, o.epochs, steps, loss, model_mse, naive_mse,
             std::chrono::duration<double>(Clock::now() - t0).count());
  }
  report(log, series, errors, o.epochs, std::chrono::duration<double>(Clock::now() - start).count());
}

// ------------------------------------------------------------------------------------------------
// --mode in-process: one process (world size 1), `devices` logical devices.
// ------------------------------------------------------------------------------------------------
void run_in_process(loom::ProcessGroup& pg, const Options& o, Clock::time_point start) {
  if (pg.world_size() != 1)
    throw loom::InvalidArgument(fmt::format(
        "--mode in-process runs in one process, but this job has {} ranks; use --mode ranks", pg.world_size()));
  loom::Logger log(loom::StreamSink{stdout}, pg);
  const torch::Device device = examples::model_device(pg, o.device);
  const std::vector<Series> series = load_series(o);
  const int n = static_cast<int>(series.size());
  log.info(
      "generators_to_devices: {} series onto {} logical devices in one process, window {}, up to {} training windows "
      "per "
      "series (model on {})",
      n, o.devices, o.window, o.max_windows, device.str());
  torch::manual_seed(o.seed);
  auto model = make_forecaster(o.window, o.hidden);
  model->to(device);
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(o.lr));
  loom::Reducer reducer(pg, loom::parameters_of(*model));
  // One window per step: every device's batch is one micro-batch.
  loom::Accumulator acc(reducer, {.micro_batches_per_step = o.devices});
  std::vector<int> all(static_cast<std::size_t>(n));
  for (int g = 0; g < n; ++g) all[static_cast<std::size_t>(g)] = g;

  torch::Tensor errors = holdout_errors(model, device, pg, series, all, o.window);
  const auto [model0, naive0] = holdout_mse(errors);
  log.info("before training: model_mse={:.5f} naive_mse={:.5f}", model0, naive0);
  for (int epoch = 0; epoch < o.epochs; ++epoch) {
    const auto t0 = Clock::now();
    std::vector<WindowGenerator> gens;
    for (int g = 0; g < n; ++g)
      gens.emplace_back(series[static_cast<std::size_t>(g)], o.window, o.max_windows, epoch, o.seed);
    loom::GeneratorLoader loader(std::move(gens), {.num_devices = o.devices, .end = loom::EndPolicy::drain});
    loom::WeightedMean train_loss;
    int64_t steps = 0;
    for (auto& step : loader) {
      for (auto& db : step.devices) {  // device d's collated batch: rows from its 2 generators
        const loom::Batch& b = db.batch;
        auto mb = acc.micro_batch(b);
        if (b.num_samples > 0) {  // the batch mean times its rows: the summed loss the accumulator weights
          const torch::Tensor loss = mse_step(model, device, b);
          train_loss.add(loss.item<double>(), static_cast<double>(b.num_samples));
          (loss * static_cast<double>(b.num_samples)).backward();
        }
        if (const loom::SyncResult s = mb.finish(); s.boundary) {  // after the last device of the step
          if (s) opt.step();
          loom::zero_grad(opt, loom::GradReset::zero);
        }
      }
      ++steps;
    }
    while (auto step = acc.end_epoch()) {
      if (*step) opt.step();
      loom::zero_grad(opt, loom::GradReset::zero);
    }
    errors = holdout_errors(model, device, pg, series, all, o.window);
    const auto [model_mse, naive_mse] = holdout_mse(errors);
    log.info("epoch {}/{}: steps={} train_loss={:.5f} holdout model_mse={:.5f} naive_mse={:.5f} seconds={:.1f}",
             epoch + 1, o.epochs, steps, train_loss.local_mean(), model_mse, naive_mse,
             std::chrono::duration<double>(Clock::now() - t0).count());
  }
  report(log, series, errors, o.epochs, std::chrono::duration<double>(Clock::now() - start).count());
}

int main(int argc, char** argv) {
  const auto start = Clock::now();
  Options o;
  CLI::App app{"16 time-series generators onto 8 devices: a forecaster trained on per-device collated batches."};
  app.add_option("--mode", o.mode, "ranks: one process per device; in-process: one process, logical devices")
      ->check(CLI::IsMember({"ranks", "in-process"}));
  app.add_option("--devices", o.devices,
                 "devices: local ranks to spawn (ignored under torchrun/mpirun/srun) or logical devices in-process; "
                 "must divide 16")
      ->check(CLI::IsMember({1, 2, 4, 8, 16}));
  app.add_option("--backend", o.backend,
                 "process group backend: auto (NCCL for a GPU model, Gloo for a CPU one), gloo, nccl")
      ->check(CLI::IsMember({"auto", "gloo", "nccl"}));
  app.add_option("--device", o.device, "model device: auto (a GPU when there is one), cpu, cuda")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  app.add_option("--data", o.data, "folder of the vega-datasets CSV files (default: found automatically)");
  app.add_option("--window", o.window, "past values per input")->check(CLI::Range(2, 64));
  app.add_option("--max-windows", o.max_windows, "training windows per series and epoch")->check(CLI::PositiveNumber);
  app.add_option("--holdout", o.holdout, "last fraction of each series held out")->check(CLI::Range(0.05, 0.5));
  app.add_option("--epochs", o.epochs, "epochs")->check(CLI::PositiveNumber);
  app.add_option("--lr", o.lr, "Adam learning rate");
  app.add_option("--hidden", o.hidden, "hidden units of the forecaster");
  app.add_option("--seed", o.seed, "seed of the initial weights and window offsets");
  app.add_option("--timeout", o.timeout,
                 "seconds a rank waits at rendezvous, connect and in any collective (default: LOOM_TIMEOUT, else 300)")
      ->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);

  try {
    const bool in_process = o.mode == "in-process";
    loom::run(
        [&](loom::ProcessGroup& pg) {
          at::set_num_threads(1);  // every mode alike (spawned ranks have one intra-op thread each)
          if (in_process)
            run_in_process(pg, o, start);
          else
            run_ranks(pg, o, start);
        },
        {.nproc = in_process ? 1 : o.devices,
         .group = {.backend = examples::group_backend(o.backend, o.device),
                   .timeout = examples::group_timeout(o.timeout)}});
  } catch (const loom::Error& e) {
    fmt::print(stderr, "generators_to_devices: {}\n", e.what());
    return 1;
  }
  return 0;
}
