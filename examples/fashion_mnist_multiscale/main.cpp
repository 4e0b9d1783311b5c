// examples/fashion_mnist_multiscale — a ground-truth check: Fashion-MNIST with every image
// randomly resized to one of several sizes each epoch (multi-scale training), shape-bucketed so a
// batch holds one size, on 2 ranks by default. A small CNN of this kind is known to reach about
// 0.88-0.91 test accuracy on Fashion-MNIST at 28 px; the multi-scale run should land there too.
//
// Data: Debian's dataset-fashion-mnist (gzipped IDX files in /usr/share/datasets/fashion-mnist),
// read with loom::data::read_fashion_mnist (zlib, no unpacking).
// Loop, assembled from loom's public parts: loom::spawn (or a launcher's variables) ->
// loom::GlooCommunicator -> per epoch, a size drawn per image (seeded by seed, epoch, index) and a
// loom::DistributedBucketBatchSampler over those shapes (exact-shape buckets, whole batches per
// rank, the same step count everywhere) -> loom::collate_sampled -> loom::Accumulator +
// loom::Reducer -> loom::Logger / loom::Progress. Test: loom::DistributedSampler shards the test
// set, loom::gather_results brings every prediction back once, in dataset order.
//
// Run:   build/examples/fashion_mnist_multiscale                 (2 ranks, defaults)
// Output (rank 0): one line per epoch with test accuracy at each size, then
//        result: test_accuracy=A baseline=B epochs=E seconds=S
// (A: mean over the evaluated sizes; B: the majority-class baseline, 0.1 on the balanced test set).
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>

#include <loom/accumulate/accumulator.hpp>
#include <loom/comm/gloo.hpp>
#include <loom/comm/local.hpp>
#include <loom/data/idx.hpp>
#include <loom/dist/environment.hpp>
#include <loom/dist/spawn.hpp>
#include <loom/log/all.hpp>
#include <loom/reduce/module.hpp>
#include <loom/reduce/reducer.hpp>
#include <loom/sample/sample.hpp>

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

struct Options {
  int nproc = 2;
  fs::path data = loom::data::kDebianFashionMnistDir;
  std::vector<int> sizes = {20, 28, 36};
  int64_t train_subset = 0;  // first N training images (0: all 60,000)
  int64_t test_subset = 0;   // first N test images (0: all 10,000)
  int epochs = 2;
  double lr = 2e-3;
  int width = 32;
  int64_t max_batch = 64;
  int64_t accumulate = 1;
  uint64_t seed = 1;
  int threads = 1;
  std::string device = "auto";  // auto | cpu | cuda
};

// ------------------------------------------------------------------------------------------------
// Model: conv blocks then adaptive average pooling to 3 x 3, so any input size >= 12 works.
// Shape: in N x 1 x S x S float32 in [0, 1]; out N x 10 logits.
// ------------------------------------------------------------------------------------------------
torch::nn::Sequential make_cnn(int w) {
  using namespace torch::nn;
  return Sequential(Conv2d(Conv2dOptions(1, w, 3).padding(1)), GroupNorm(8, w), ReLU(), MaxPool2d(2),
                    Conv2d(Conv2dOptions(w, 2 * w, 3).padding(1)), GroupNorm(8, 2 * w), ReLU(), MaxPool2d(2),
                    Conv2d(Conv2dOptions(2 * w, 2 * w, 3).padding(1)), GroupNorm(8, 2 * w), ReLU(),
                    AdaptiveAvgPool2d(AdaptiveAvgPool2dOptions({3, 3})), Flatten(), Linear(18 * w, 10));
}

/// Image `i` as 1 x s x s float32 in [0, 1] (bilinear resize from 28 x 28 when s != 28).
torch::Tensor image_at(const torch::Tensor& images, int64_t i, int64_t s) {
  torch::Tensor x = images[i].to(torch::kFloat).div_(255.0).unsqueeze(0);  // 1 x 28 x 28
  if (s == x.size(1)) return x;
  namespace F = torch::nn::functional;
  return F::interpolate(x.unsqueeze(0), F::InterpolateFuncOptions()
                                            .size(std::vector<int64_t>{s, s})
                                            .mode(torch::kBilinear)
                                            .align_corners(false))
      .squeeze(0);
}

/// The size of training image `i` in epoch `epoch`: one of `sizes`, the same on every rank.
int64_t size_of(const std::vector<int>& sizes, uint64_t seed, int64_t epoch, int64_t i) {
  uint64_t z = seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(epoch) * 0xBF58476D1CE4E5B9ull + static_cast<uint64_t>(i);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;  // splitmix64 finalizer
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return sizes[static_cast<std::size_t>(z % sizes.size())];
}

template <class Comm>
void train(Comm& comm, const loom::Environment& env, const Options& o, torch::Device device, Clock::time_point start) {
  const loom::RankInfo me = loom::rank_info(env);
  loom::Logger log{loom::StreamSink{stdout}, me};
  auto train_set = loom::data::read_fashion_mnist(o.data, loom::data::MnistSplit::train);
  auto test_set = loom::data::read_fashion_mnist(o.data, loom::data::MnistSplit::test);
  const int64_t n_train = o.train_subset > 0 ? std::min<int64_t>(o.train_subset, train_set.images.size(0)) : train_set.images.size(0);
  const int64_t n_test = o.test_subset > 0 ? std::min<int64_t>(o.test_subset, test_set.images.size(0)) : test_set.images.size(0);
  const torch::Tensor test_labels = test_set.labels.slice(0, 0, n_test);
  const double baseline = torch::bincount(test_labels).max().item<double>() / static_cast<double>(n_test);
  log.info("fashion_mnist_multiscale: {} rank(s), {} training and {} test images, sizes {} px, baseline (majority class) {:.4f}",
           env.world_size, n_train, n_test, fmt::join(o.sizes, ","), baseline);

  torch::manual_seed(o.seed);
  auto model = make_cnn(o.width);
  model->to(device);
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(o.lr).weight_decay(1e-4));
  loom::Reducer reducer(comm, loom::parameters_of(*model));
  loom::Accumulator acc(reducer, {.micro_batches_per_step = o.accumulate});

  auto evaluate = [&](int64_t s) {
    torch::NoGradGuard no_grad;
    model->eval();
    loom::DistributedSampler sampler({.dataset_size = n_test, .num_replicas = env.world_size, .rank = env.rank, .shuffle = false});
    std::vector<int64_t> seen;
    std::vector<torch::Tensor> preds;
    std::vector<torch::Tensor> xs;
    auto flush = [&] {
      if (xs.empty()) return;
      preds.push_back(model->forward(torch::stack(xs).to(device)).argmax(1).cpu());
      xs.clear();
    };
    while (auto i = sampler.next()) {
      seen.push_back(*i);
      xs.push_back(image_at(test_set.images, *i, s));
      if (static_cast<int64_t>(xs.size()) == 256) flush();
    }
    flush();
    const torch::Tensor mine = preds.empty() ? torch::empty({0}, torch::kLong) : torch::cat(preds);
    const auto all = loom::gather_results(comm, seen, mine.unsqueeze(1), {.dataset_size = n_test});
    model->train();
    const torch::Tensor predicted = all.values.squeeze(1);
    return predicted.eq(test_labels).to(torch::kDouble).mean().item<double>();
  };

  double accuracy = 0;
  for (int64_t epoch = 0; epoch < o.epochs; ++epoch) {
    const auto t0 = Clock::now();
    std::vector<std::vector<int64_t>> shapes(static_cast<std::size_t>(n_train));
    for (int64_t i = 0; i < n_train; ++i) {
      const int64_t s = size_of(o.sizes, o.seed, epoch, i);
      shapes[static_cast<std::size_t>(i)] = {1, s, s};
    }
    loom::DistributedBucketBatchSampler sampler(std::move(shapes), {.num_replicas = env.world_size, .rank = env.rank,
                                                                    .seed = o.seed, .max_samples = o.max_batch});
    sampler.set_epoch(epoch);
    loom::Progress progress{loom::StreamSink{stdout}, me, {.total = n_train, .label = fmt::format("epoch {}", epoch + 1), .sync_every = 16}};
    loom::WeightedMean loss_mean;
    while (auto planned = sampler.next()) {
      loom::Batch b = loom::collate_sampled(*planned, [&](int64_t i) {
        return std::pair<torch::Tensor, int64_t>(image_at(train_set.images, i, planned->padded_shape[1]),
                                                 train_set.labels[i].item<int64_t>());
      });
      auto mb = acc.micro_batch(b);  // 0 samples for a repeated (weight-0) batch
      const torch::Tensor loss = torch::nn::functional::cross_entropy(
                                     model->forward(b.data.to(device)), b.targets.to(device),
                                     torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum)) *
                                 b.weight;
      mb.scale(loss).backward();
      if (const loom::SyncResult step = mb.finish(); step.boundary) {
        if (step) opt.step();
        opt.zero_grad();
      }
      if (b.weight > 0) loss_mean.add(loss.item<double>() / static_cast<double>(b.num_samples), static_cast<double>(b.num_samples));
      progress.step(comm, b.weight > 0 ? b.num_samples : 0);
    }
    while (auto step = acc.end_epoch()) {
      if (*step) opt.step();
      opt.zero_grad();
    }
    progress.finish(comm);
    const double train_loss = loom::global_mean(comm, loss_mean);
    std::vector<std::string> per_size;
    accuracy = 0;
    for (int s : o.sizes) {
      const double a = evaluate(s);
      accuracy += a / static_cast<double>(o.sizes.size());
      per_size.push_back(fmt::format("{}px={:.4f}", s, a));
    }
    log.info("epoch {}/{}: train_loss={:.4f} test_accuracy={:.4f} ({}) baseline={:.4f} seconds={:.1f}", epoch + 1, o.epochs,
             train_loss, accuracy, fmt::join(per_size, " "), baseline, std::chrono::duration<double>(Clock::now() - t0).count());
  }
  log.info("result: test_accuracy={:.4f} baseline={:.4f} epochs={} seconds={:.1f}", accuracy, baseline, o.epochs,
           std::chrono::duration<double>(Clock::now() - start).count());
}

/// One rank: the device (`--device cuda`: GPU local_rank, ranks still talk through Gloo), then training.
void run_rank(const loom::Environment& env, const Options& o, Clock::time_point start) {
  at::set_num_threads(o.threads);
  const bool cuda = torch::cuda::is_available();
  if (o.device == "cuda" && !cuda)
    throw loom::ConfigError("--device cuda: this LibTorch or machine has no CUDA device; use --device cpu");
  const torch::Device device = (o.device == "cuda" || (o.device == "auto" && cuda))
                                   ? torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(env.local_rank))
                                   : torch::Device(torch::kCPU);
  if (env.world_size == 1) {
    loom::LocalCommunicator comm;
    train(comm, env, o, device, start);
  } else {
    loom::GlooCommunicator comm(env);
    train(comm, env, o, device, start);
  }
}

int main(int argc, char** argv) {
  const auto start = Clock::now();
  Options o;
  CLI::App app{"Fashion-MNIST at several sizes per epoch, shape-bucketed, over several ranks."};
  app.add_option("--nproc", o.nproc, "ranks to spawn on this machine (ignored under torchrun/mpirun/srun)")->check(CLI::Range(1, 64));
  app.add_option("--data", o.data, "folder of the (gzipped) IDX files");
  app.add_option("--sizes", o.sizes, "image sizes to draw from, px (>= 12)")->delimiter(',')->check(CLI::Range(12, 256));
  app.add_option("--train-subset", o.train_subset, "use the first N training images (0: all)");
  app.add_option("--test-subset", o.test_subset, "use the first N test images (0: all)");
  app.add_option("--epochs", o.epochs, "epochs")->check(CLI::PositiveNumber);
  app.add_option("--lr", o.lr, "AdamW learning rate");
  app.add_option("--width", o.width, "channels of the first conv layer; a multiple of 8");
  app.add_option("--max-batch", o.max_batch, "samples per micro-batch")->check(CLI::PositiveNumber);
  app.add_option("--accumulate", o.accumulate, "micro-batches per optimizer step")->check(CLI::PositiveNumber);
  app.add_option("--seed", o.seed, "seed of the weights, the sizes and the shuffles");
  app.add_option("--threads", o.threads, "intra-op threads per rank")->check(CLI::PositiveNumber);
  app.add_option("--device", o.device, "auto | cpu | cuda (GPU local_rank; ranks talk through Gloo)")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  CLI11_PARSE(app, argc, argv);
  if (o.width % 8 != 0) {
    fmt::print(stderr, "--width {} must be a multiple of 8 (GroupNorm groups)\n", o.width);
    return 2;
  }
  try {
    const loom::Environment env = loom::Environment::from_env();
    if (env.launcher == loom::Launcher::none && o.nproc > 1)
      loom::spawn(o.nproc, [&](const loom::Environment& child) { run_rank(child, o, start); }, {.threads_per_rank = o.threads});
    else
      run_rank(env, o, start);
  } catch (const loom::Error& e) {
    fmt::print(stderr, "fashion_mnist_multiscale: {}\n", e.what());
    return 1;
  }
  return 0;
}
