// GPU path on a device: loom's Reducer and Accumulator on CUDA parameters over NCCL (world
// size 1), checked against a float64 reference (relative error <= 1e-6 in float64, <= 1e-5 in
// float32). The reducer is given the NcclCommunicator itself: NCCL refuses host tensors
// (InvalidArgument naming the device), so any small collective tensor the reducer kept on the CPU
// (its sample count, the parameter check, the summary) fails this test. The host-read budget is
// checked too (one read per step, none in hooks). Built only with a LibTorch that has CUDA;
// gpu_main.cpp skips without a device.
#include <chrono>
#include <optional>
#include <utility>
#include <vector>

#include <doctest/doctest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/torch.h>

#include <loom/config.hpp>

#if LOOM_TORCH_HAS_CUDA
#include <loom/accumulate/accumulator.hpp>
#include <loom/comm/nccl.hpp>
#include <loom/reduce/reducer.hpp>

using namespace std::chrono_literals;

TEST_SUITE_BEGIN("torch_cuda");  // see test_gpu_device.cpp: skipped where LibTorch has no CUDA
TEST_CASE("Reducer + Accumulator over NCCL on CUDA tensors: sample-weighted gradients equal the float64 reference") {
  auto store = c10::make_intrusive<c10d::HashStore>();
  loom::NcclCommunicator comm(*store, 0, 1, {.device = 0, .timeout = 60s});
  // Linear 8 -> 3 with a squared-error loss summed over samples; 10 samples in micro-batches of
  // 4, 4 and 2 (one step); the reference is the float64 gradient of the mean loss over all 10.
  const auto x64 = ((torch::arange(80, torch::kDouble).remainder(7) - 3) / 2).view({10, 8});
  const auto y64 = (torch::arange(30, torch::kDouble).remainder(5) / 4).view({10, 3});
  const auto w0 = ((torch::arange(24, torch::kDouble).remainder(5) - 2) / 4).view({3, 8});
  const auto b0 = torch::arange(3, torch::kDouble) / 2;
  auto wr = w0.clone().requires_grad_();
  auto br = b0.clone().requires_grad_();
  ((x64.matmul(wr.t()) + br - y64).pow(2).sum() / 10).backward();

  for (auto dtype : {at::kDouble, at::kFloat}) {
    CAPTURE(c10::toString(dtype));
    const auto opts = torch::TensorOptions().dtype(dtype).device(torch::kCUDA, 0);
    auto w = w0.to(opts).requires_grad_();
    auto b = b0.to(opts).requires_grad_();
    // Tiny bucket caps: the two parameters travel in separate all-reduces.
    loom::Reducer<loom::NcclCommunicator> reducer(
        comm, {.names = {"w", "b"}, .params = {w, b}},
        {.bucket_cap_bytes = 64, .first_bucket_cap_bytes = 16, .max_grad_norm = 1e6});
    loom::Accumulator acc(reducer, {.micro_batches_per_step = 3});
    const auto x = x64.to(opts);
    const auto y = y64.to(opts);
    loom::SyncResult step;
    for (auto [begin, end] : {std::pair<int64_t, int64_t>{0, 4}, {4, 8}, {8, 10}}) {
      step = acc.run(end - begin, [&] {
        (x.slice(0, begin, end).matmul(w.t()) + b - y.slice(0, begin, end)).pow(2).sum().backward();
      });
    }
    REQUIRE(step.apply);
    CHECK(step.global_samples == 10);
    CHECK(reducer.host_reads().in_hooks == 0);
    CHECK(reducer.host_reads().total == 1);
    CHECK(w.grad().is_cuda());
    const double tol = dtype == at::kDouble ? 1e-6 : 1e-5;
    const auto rel = [](const at::Tensor& got, const at::Tensor& ref) {
      return (got.cpu().to(torch::kDouble) - ref).abs().max().item<double>() / ref.abs().max().item<double>();
    };
    CHECK(rel(w.grad(), wr.grad()) <= tol);
    CHECK(rel(b.grad(), br.grad()) <= tol);
  }
}
TEST_SUITE_END();
#endif  // LOOM_TORCH_HAS_CUDA
