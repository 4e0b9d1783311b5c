// examples/fashion_mnist_multiscale — a ground-truth check: Fashion-MNIST with every image
// randomly resized to one of several sizes each epoch (multi-scale training), shape-bucketed so a
// batch holds one size, on 2 ranks by default. A small CNN of this kind is known to reach about
// 0.88-0.91 test accuracy on Fashion-MNIST at 28 px; the multi-scale run should land there too.
//
// Data: Debian's dataset-fashion-mnist (gzipped IDX files in /usr/share/datasets/fashion-mnist),
// read with examples::data::read_fashion_mnist (zlib, no unpacking).
// Loop, on loom's short path: loom::run (spawns --nproc ranks, or joins torchrun / mpirun / srun)
// -> loom::ProcessGroup (NCCL on a GPU, Gloo on the CPU) -> per epoch, a size drawn per image
// (loom::sample_seed of seed, epoch, index: the same on any world size) and a loom::BatchLoader
// over those shapes (exact-shape buckets; --batches-per-step batches per optimizer step, dealt to
// the ranks) -> loom::Trainer -> loom::Metrics, loom::Progress (through Trainer::on_step), loom::Logger.
// Test: a loom::BatchLoader over the test set and loom::evaluate bring every prediction back once,
// in dataset order, from every rank.
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

#include <loom/dist/run.hpp>
#include <loom/log/all.hpp>
#include <loom/sample/all.hpp>
#include <loom/train/evaluate.hpp>
#include <loom/train/loader.hpp>
#include <loom/train/trainer.hpp>

#include "../common/data/idx.hpp"
#include "../common/placement.hpp"

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

struct Options {
  int nproc = 2;
  fs::path data = examples::data::kDebianFashionMnistDir;
  std::vector<int> sizes = {20, 28, 36};
  int64_t train_subset = 0;  // first N training images (0: all 60,000)
  int64_t test_subset = 0;   // first N test images (0: all 10,000)
  int epochs = 2;
  double lr = 2e-3;
  int width = 32;
  int64_t max_batch = 64;
  int64_t batches_per_step = 2;  // batches per optimizer step, of the whole job (the same steps on any world size)
  uint64_t seed = 1;
  int threads = 1;
  std::string device = "auto";   // auto | cpu | cuda
  std::string backend = "auto";  // auto | gloo | nccl
  double timeout = 0;            // seconds: rendezvous and every collective (0: LOOM_TIMEOUT or 300)
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
  return F::interpolate(
             x.unsqueeze(0),
             F::InterpolateFuncOptions().size(std::vector<int64_t>{s, s}).mode(torch::kBilinear).align_corners(false))
      .squeeze(0);
}

/// The size of training image `i` in epoch `epoch`: one of `sizes`, the same on every rank and world size.
int64_t size_of(const std::vector<int>& sizes, uint64_t seed, int64_t epoch, int64_t i) {
  return sizes[static_cast<std::size_t>(loom::sample_seed(seed, epoch, i) % sizes.size())];
}

void train(loom::ProcessGroup& pg, const Options& o, Clock::time_point start) {
  at::set_num_threads(o.threads);
  const torch::Device device = examples::model_device(pg, o.device);
  loom::Logger log(loom::StreamSink{stdout}, pg);
  auto train_set = examples::data::read_fashion_mnist(o.data, examples::data::MnistSplit::train);
  auto test_set = examples::data::read_fashion_mnist(o.data, examples::data::MnistSplit::test);
  const int64_t n_train =
      o.train_subset > 0 ? std::min<int64_t>(o.train_subset, train_set.images.size(0)) : train_set.images.size(0);
  const int64_t n_test =
      o.test_subset > 0 ? std::min<int64_t>(o.test_subset, test_set.images.size(0)) : test_set.images.size(0);
  const torch::Tensor test_labels = test_set.labels.slice(0, 0, n_test);
  const double baseline = torch::bincount(test_labels).max().item<double>() / static_cast<double>(n_test);
  log.info(
      "fashion_mnist_multiscale: {} rank(s), backend {}, device {}; {} training and {} test images, sizes {} px, "
      "baseline (majority class) {:.4f}",
      pg.world_size(), loom::to_string(pg.backend()), device.str(), n_train, n_test, fmt::join(o.sizes, ","), baseline);

  torch::manual_seed(o.seed);
  auto model = make_cnn(o.width);
  model->to(device);
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(o.lr).weight_decay(1e-4));
  loom::Trainer trainer(pg, *model, opt);

  // Test accuracy at size s: a BatchLoader over the test set in order (one shape, batches of 256)
  // and loom::evaluate gathering each image's prediction from every rank, once, in dataset order.
  auto evaluate = [&](int64_t s) {
    loom::BatchLoader test(pg, std::vector<std::vector<int64_t>>(static_cast<std::size_t>(n_test), {1, s, s}),
                           [&](int64_t i) { return image_at(test_set.images, i, s); },
                           {.shuffle = false, .max_samples = 256, .batches_per_step = pg.world_size()},
                           {.device = device});
    model->eval();
    const auto all =
        loom::evaluate(pg, test, [&](loom::Batch& b) { return model->forward(b.data).argmax(1).unsqueeze(1); });
    model->train();
    return all.values.squeeze(1).eq(test_labels).to(torch::kDouble).mean().item<double>();
  };

  double accuracy = 0;
  for (int64_t epoch = 0; epoch < o.epochs; ++epoch) {
    const auto t0 = Clock::now();
    std::vector<std::vector<int64_t>> shapes(static_cast<std::size_t>(n_train));
    for (int64_t i = 0; i < n_train; ++i) {
      const int64_t s = size_of(o.sizes, o.seed, epoch, i);
      shapes[static_cast<std::size_t>(i)] = {1, s, s};
    }
    // This epoch's shapes: a loader of its own (the plan is a function of the shapes).
    loom::BatchLoader loader(pg, std::move(shapes),
                             [&](int64_t i) {
                               const int64_t s = size_of(o.sizes, o.seed, epoch, i);
                               return std::pair<torch::Tensor, int64_t>(image_at(train_set.images, i, s),
                                                                        train_set.labels[i].item<int64_t>());
                             },
                             {.seed = o.seed, .max_samples = o.max_batch, .batches_per_step = o.batches_per_step},
                             {.device = device});
    loom::Progress progress{
        loom::StreamSink{stdout}, loom::rank_info(pg), {.total = n_train, .label = fmt::format("epoch {}", epoch + 1)}};
    trainer.on_step([&](const loom::SyncResult& r) { progress.add_global(r.global_samples); });
    loom::Metrics metrics(pg);
    for (loom::Batch& b : trainer.epoch(loader, epoch)) {
      const torch::Tensor loss = torch::nn::functional::cross_entropy(model->forward(b.data), b.targets);
      trainer.backward(loss, b);
      metrics.add("loss", loss, b);
    }
    progress.finish(pg);
    const double train_loss = metrics.mean("loss");
    std::vector<std::string> per_size;
    accuracy = 0;
    for (int s : o.sizes) {
      const double a = evaluate(s);
      accuracy += a / static_cast<double>(o.sizes.size());
      per_size.push_back(fmt::format("{}px={:.4f}", s, a));
    }
    log.info("epoch {}/{}: train_loss={:.4f} test_accuracy={:.4f} ({}) baseline={:.4f} seconds={:.1f}", epoch + 1,
             o.epochs, train_loss, accuracy, fmt::join(per_size, " "), baseline,
             std::chrono::duration<double>(Clock::now() - t0).count());
  }
  log.info("result: test_accuracy={:.4f} baseline={:.4f} epochs={} seconds={:.1f}", accuracy, baseline, o.epochs,
           std::chrono::duration<double>(Clock::now() - start).count());
}

int main(int argc, char** argv) {
  const auto start = Clock::now();
  Options o;
  CLI::App app{"Fashion-MNIST at several sizes per epoch, shape-bucketed, over several ranks."};
  app.add_option("--nproc", o.nproc, "ranks to spawn on this machine (ignored under torchrun/mpirun/srun)")
      ->check(CLI::Range(1, 64));
  app.add_option("--data", o.data, "folder of the (gzipped) IDX files");
  app.add_option("--sizes", o.sizes, "image sizes to draw from, px (>= 12)")
      ->delimiter(',')
      ->check(CLI::Range(12, 256));
  app.add_option("--train-subset", o.train_subset, "use the first N training images (0: all)");
  app.add_option("--test-subset", o.test_subset, "use the first N test images (0: all)");
  app.add_option("--epochs", o.epochs, "epochs")->check(CLI::PositiveNumber);
  app.add_option("--lr", o.lr, "AdamW learning rate");
  app.add_option("--width", o.width, "channels of the first conv layer; a multiple of 8");
  app.add_option("--max-batch", o.max_batch, "samples per batch")->check(CLI::PositiveNumber);
  app.add_option(
         "--batches-per-step", o.batches_per_step,
         "batches per optimizer step, for the whole job (dealt to the ranks: the same steps on any number of ranks)")
      ->check(CLI::PositiveNumber);
  app.add_option("--seed", o.seed, "seed of the weights, the sizes and the shuffles");
  app.add_option("--threads", o.threads, "intra-op threads per rank")->check(CLI::PositiveNumber);
  app.add_option("--device", o.device,
                 "auto | cpu | cuda (the model's device; a GPU is LOCAL_RANK among CUDA_VISIBLE_DEVICES)")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  app.add_option("--backend", o.backend, "auto | gloo | nccl (auto: NCCL for a GPU model, Gloo for a CPU one)")
      ->check(CLI::IsMember({"auto", "gloo", "nccl"}));
  app.add_option("--timeout", o.timeout,
                 "seconds a rank waits at rendezvous and in any collective (default: LOOM_TIMEOUT, else 300)")
      ->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  if (o.width % 8 != 0) {
    fmt::print(stderr, "--width {} must be a multiple of 8 (GroupNorm groups)\n", o.width);
    return 2;
  }
  try {
    loom::run([&](loom::ProcessGroup& pg) { train(pg, o, start); },
              {.nproc = o.nproc,
               .group = {.backend = examples::group_backend(o.backend, o.device),
                         .timeout = examples::group_timeout(o.timeout)},
               .spawn = {.threads_per_rank = o.threads}});
  } catch (const loom::Error& e) {
    fmt::print(stderr, "fashion_mnist_multiscale: {}\n", e.what());
    return 1;
  }
  return 0;
}
