// GPU path on a device: loom's Reducer and Accumulator on CUDA parameters over NCCL (world
// size 1), checked against a float64 reference (relative error <= 1e-6 in float64, <= 1e-5 in
// float32). The reducer is given the NcclCommunicator itself: NCCL refuses host tensors
// (InvalidArgument naming the device), so any small collective tensor the reducer kept on the CPU
// (its sample count, the parameter check, the summary) fails this test. The host-read budget is
// checked too (one read per step, none in hooks). Built only with a LibTorch that has CUDA;
// gpu_main.cpp skips without a device.
#include <chrono>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include <doctest/doctest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/torch.h>

#include <loom/config.hpp>

#if LOOM_TORCH_HAS_CUDA
#include <loom/accumulate/accumulator.hpp>
#include <loom/comm/local.hpp>
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

TEST_CASE("deterministic Reducer on CUDA tensors over NCCL: the CPU loops' bytes and grid exponents, at most 3 reads") {
  // Two parameters in two buckets (tiny caps), 3 windows of 3 micro-batches whose gradients are
  // given exactly (loss = sum(p * G): dL/dp = G on any device, so autograd's own arithmetic does
  // not differ between the runs); the same run on CPU tensors (loom::LocalCommunicator, the host
  // loops) gives the reference bytes: the device path puts whole buckets on the grid with ATen
  // operators in the same float64 arithmetic.
  auto store = c10::make_intrusive<c10d::HashStore>();
  loom::NcclCommunicator comm(*store, 0, 1, {.device = 0, .timeout = 60s});
  auto given = [](int64_t n, int m, int window, double scale) {
    return ((torch::arange(n, torch::kDouble).remainder(7) - 3) * 0.37 * (m + 1) * (1 + window * window) * scale)
        .to(at::kFloat);
  };
  auto run = [&](auto& communicator, c10::Device device) {
    const auto opts = torch::TensorOptions().dtype(at::kFloat).device(device);
    auto w = torch::full({3, 8}, 0.5, opts).requires_grad_();
    auto b = torch::full({3}, -0.25, opts).requires_grad_();
    loom::Reducer reducer(communicator, {.names = {"w", "b"}, .params = {w, b}},
                          {.bucket_cap_bytes = 64, .first_bucket_cap_bytes = 16, .deterministic = true});
    loom::Accumulator acc(reducer, {.micro_batches_per_step = 3});
    std::vector<at::Tensor> grads;
    std::vector<std::vector<int>> exponents;
    for (int window = 0; window < 3; ++window) {
      loom::SyncResult step;
      for (int m = 0; m < 3; ++m)
        step = acc.run(m + 2, [&] {
          const auto gw = given(24, m, window, 1e-3).view({3, 8}).to(device);
          const auto gb = given(3, m, window, 1e2).to(device);
          ((w * gw).sum() + (b * gb).sum()).backward();
        });
      REQUIRE(step.apply);
      grads.push_back(w.grad().cpu().clone());
      grads.push_back(b.grad().cpu().clone());
      exponents.push_back(reducer.grid_exponents());
      w.mutable_grad() = at::Tensor();
      b.mutable_grad() = at::Tensor();
    }
    return std::make_tuple(grads, exponents, reducer.host_reads());
  };
  loom::LocalCommunicator local;
  const auto [cpu_grads, cpu_exponents, cpu_reads] = run(local, c10::Device(c10::kCPU));
  const auto [gpu_grads, gpu_exponents, gpu_reads] = run(comm, c10::Device(c10::kCUDA, 0));
  REQUIRE(cpu_grads.size() == 6);
  for (std::size_t k = 0; k < cpu_grads.size(); ++k) CHECK(torch::equal(gpu_grads[k], cpu_grads[k]));
  CHECK(gpu_exponents == cpu_exponents);
  CHECK_FALSE(torch::equal(cpu_grads[0], cpu_grads[2]));  // the windows differ (not a comparison of zeros)
  CHECK(cpu_reads.total == 0);                            // CPU buckets: read in host memory
  CHECK(gpu_reads.in_hooks == 0);
  CHECK(gpu_reads.total <= 3 * 3);  // up to 3 per window (docs/gpu.md)
}
TEST_SUITE_END();
#endif  // LOOM_TORCH_HAS_CUDA
