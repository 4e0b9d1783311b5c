// GPU path on a device: the short path (loom::run, ProcessGroup, BatchLoader, Trainer) trains the
// same float32 model on the same GPU with NCCL (ProcessGroup's choice on a GPU) and with Gloo
// (which moves the CUDA tensors through host memory); the losses of every step and the final
// parameters agree within 1e-5 relative. World size 1 (NCCL refuses two ranks on one GPU). Built
// only with a LibTorch that has CUDA; gpu_main.cpp skips without a device.
#include <cmath>
#include <memory>
#include <utility>
#include <vector>

#include <doctest/doctest.h>
#include <torch/torch.h>

#include <loom/config.hpp>

#if LOOM_TORCH_HAS_CUDA
#include <loom/collate/pool.hpp>
#include <loom/comm/local.hpp>
#include <loom/cuda/transfer.hpp>
#include <loom/dist/process_group.hpp>
#include <loom/train/loader.hpp>
#include <loom/train/trainer.hpp>

namespace {

struct Run {
  std::vector<double> losses;
  std::vector<at::Tensor> params;
};

/// 96 sequences of lengths 8, 16, 24 (1 channel), 2 classes; a linear model on the mean; 2 epochs.
/// `zero_stage` 1: TrainerOptions::zero_stage (loom::ShardedOptimizer over the group's communicator);
/// `momentum`: SGD's (0: an optimizer without state).
Run train_on(loom::Backend backend, int zero_stage = 0, double momentum = 0.0) {
  const auto env = loom::Environment{};  // rank 0 of 1
  loom::ProcessGroup pg(env, {.backend = backend});
  const torch::Device device(torch::kCUDA, 0);
  torch::manual_seed(0);
  std::vector<std::pair<torch::Tensor, int64_t>> data;
  std::vector<std::vector<int64_t>> shapes;
  for (int64_t i = 0; i < 96; ++i) {
    const int64_t label = i % 2, length = 8 * (1 + i % 3);
    data.emplace_back(torch::randn({1, length}) + (label == 1 ? 0.5 : -0.5), label);
    shapes.push_back({1, length});
  }
  torch::nn::Linear model(1, 2);
  model->to(device);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.5).momentum(momentum));
  loom::BatchLoader loader(pg, shapes, [&](int64_t i) { return data[static_cast<std::size_t>(i)]; },
                           {.max_samples = 8, .batches_per_step = 2}, {.device = device});
  loom::Trainer trainer(pg, *model, opt, {.zero_stage = zero_stage});
  Run run;
  for (int64_t epoch = 0; epoch < 2; ++epoch)
    for (loom::Batch& b : trainer.epoch(loader, epoch)) {
      auto loss = torch::nn::functional::cross_entropy(model->forward(b.data.mean(-1)), b.targets);
      trainer.backward(loss, b);
      run.losses.push_back(loss.item<double>());
    }
  for (const auto& p : model->parameters()) run.params.push_back(p.detach().cpu().to(torch::kDouble));
  CHECK(trainer.reducer().host_reads().in_hooks == 0);
  return run;
}

}  // namespace

TEST_SUITE_BEGIN("torch_cuda");
TEST_CASE("Trainer on one GPU: NCCL and Gloo give the same losses and parameters within 1e-5") {
  const Run nccl = train_on(loom::Backend::nccl);
  const Run gloo = train_on(loom::Backend::gloo);
  REQUIRE(nccl.losses.size() == gloo.losses.size());
  REQUIRE_FALSE(nccl.losses.empty());
  double worst = 0;
  for (std::size_t k = 0; k < nccl.losses.size(); ++k)
    worst = std::max(worst, std::abs(nccl.losses[k] - gloo.losses[k]) / std::max(std::abs(gloo.losses[k]), 1e-12));
  MESSAGE("RESULT trainer_nccl_vs_gloo: max relative loss difference " << worst << " over " << nccl.losses.size()
                                                                       << " batches");
  CHECK(worst <= 1e-5);
  for (std::size_t k = 0; k < nccl.params.size(); ++k) {
    const double rel =
        (nccl.params[k] - gloo.params[k]).abs().max().item<double>() / gloo.params[k].abs().max().item<double>();
    CHECK(rel <= 1e-5);
  }
}

TEST_CASE("Trainer on one GPU: zero_stage 1 over NCCL gives stage 0's losses and parameters bit for bit") {
  const Run sharded = train_on(loom::Backend::nccl, 1, 0.9);
  const Run whole = train_on(loom::Backend::nccl, 0, 0.9);
  REQUIRE_FALSE(sharded.losses.empty());
  CHECK(sharded.losses == whole.losses);
  REQUIRE(sharded.params.size() == whole.params.size());
  for (std::size_t k = 0; k < whole.params.size(); ++k) CHECK(torch::equal(sharded.params[k], whole.params[k]));
}

TEST_CASE(
    "BatchLoader with a pinned BufferPool of the user's: the next batch never overwrites a copy still in flight") {
  // 32 samples of 2^20 float32 each, sample i filled with i; batches of 16 (64 MiB). A pool hands
  // batch A's pinned buffer to batch B once A's host tensors are dropped (inside load()). The GPU is
  // kept busy first, so an asynchronous copy of A would still be queued while B is collated into
  // the same buffer: A on the device would then hold B's values.
  loom::LocalCommunicator local;
  const torch::Device device(torch::kCUDA, 0);
  std::vector<std::vector<int64_t>> shapes(32, std::vector<int64_t>{1 << 20});
  auto pinned = [](c10::IntArrayRef sizes, c10::ScalarType dtype) {
    return at::empty(sizes, at::TensorOptions(dtype).pinned_memory(true));
  };
  loom::LoaderOptions options{.device = device};
  options.collate.pool = std::make_shared<loom::BufferPool>(loom::BufferPoolOptions{.allocate = pinned});
  loom::BatchLoader loader(
      local, shapes, [](int64_t i) { return torch::full({1 << 20}, static_cast<double>(i)); },
      {.shuffle = false, .max_samples = 16, .batches_per_step = 1}, options);
  loader.begin_epoch(0);
  const auto item_a = loader.sampler().next();
  const auto item_b = loader.sampler().next();
  REQUIRE(item_a.has_value());
  REQUIRE(item_b.has_value());
  auto busy = torch::randn({4096, 4096}, device);
  for (int k = 0; k < 40; ++k) busy = busy.mm(busy).div_(4096);  // queued GPU work ahead of the copies
  const loom::Batch a = loader.load(*item_a);
  const loom::Batch b = loader.load(*item_b);
  CHECK(options.collate.pool->reuses() >= 1);  // B was collated into a buffer the pool had handed out before
  const auto expected_a = torch::tensor(item_a->indices, torch::kDouble);
  const auto expected_b = torch::tensor(item_b->indices, torch::kDouble);
  CHECK(torch::equal(a.data.select(1, 0).to(torch::kCPU, torch::kDouble), expected_a));
  CHECK(torch::equal(a.data.select(1, (1 << 20) - 1).to(torch::kCPU, torch::kDouble), expected_a));
  CHECK(torch::equal(b.data.select(1, 0).to(torch::kCPU, torch::kDouble), expected_b));
}
TEST_CASE("BatchLoader with CudaTransfer: the same batches on the GPU as the default transfer") {
  loom::LocalCommunicator local;
  const torch::Device device(torch::kCUDA, 0);
  std::vector<std::vector<int64_t>> shapes;
  for (int64_t i = 0; i < 24; ++i) shapes.push_back({1 + i % 3, 5});
  auto fetch = [](int64_t i) {
    return std::make_pair(torch::arange(5 * (1 + i % 3), torch::kFloat).reshape({1 + i % 3, 5}) + i, i % 2);
  };
  const loom::GlobalBatchOptions plan{.seed = 2, .max_samples = 4, .batches_per_step = 2};
  loom::BatchLoader plain(local, shapes, fetch, plan, {.device = device});
  loom::BatchLoader staged(local, shapes, fetch, plan, {.device = device}, loom::DefaultProjection{},
                           loom::cuda::CudaTransfer{});
  plain.begin_epoch(0);
  staged.begin_epoch(0);
  int64_t batches = 0;
  while (auto a = plain.next()) {
    auto b = staged.next();
    REQUIRE(b.has_value());
    REQUIRE(b->data.is_cuda());
    CHECK(torch::equal(a->data.cpu(), b->data.cpu()));
    CHECK(torch::equal(a->targets.cpu(), b->targets.cpu()));
    CHECK(a->indices == b->indices);
    ++batches;
  }
  CHECK(batches == static_cast<int64_t>(plain.sampler().plan().batches.size()));
}

TEST_CASE("BatchLoader with workers on the GPU: pinned batches collated on worker threads, the same as without") {
  loom::LocalCommunicator local;
  const torch::Device device(torch::kCUDA, 0);
  std::vector<std::vector<int64_t>> shapes;
  for (int64_t i = 0; i < 40; ++i) shapes.push_back({1 + i % 3, 5});
  auto fetch = [](int64_t i) {
    return std::make_pair(torch::arange(5 * (1 + i % 3), torch::kFloat).reshape({1 + i % 3, 5}) - i, i % 2);
  };
  const loom::GlobalBatchOptions plan{.seed = 4, .max_samples = 4, .batches_per_step = 2};
  loom::BatchLoader plain(local, shapes, fetch, plan, {.device = device});
  loom::BatchLoader workers(local, shapes, fetch, plan, {.device = device, .num_workers = 3});
  for (int64_t epoch = 0; epoch < 2; ++epoch) {
    plain.begin_epoch(epoch);
    workers.begin_epoch(epoch);
    int64_t batches = 0;
    while (auto a = plain.next()) {
      auto b = workers.next();
      REQUIRE(b.has_value());
      REQUIRE(b->data.device() == device);
      CHECK(torch::equal(a->data.cpu(), b->data.cpu()));
      CHECK(torch::equal(a->targets.cpu(), b->targets.cpu()));
      CHECK(a->indices == b->indices);
      ++batches;
    }
    CHECK_FALSE(workers.next().has_value());
    CHECK(batches == static_cast<int64_t>(plain.sampler().plan().batches.size()));
  }
}
TEST_SUITE_END();
#endif  // LOOM_TORCH_HAS_CUDA
