// GPU path on a device: loom's Reducer and Accumulator on CUDA parameters over NCCL (world
// size 1), checked against a float64 reference (relative error <= 1e-6 in float64, <= 1e-5 in
// float32). Built only with a LibTorch that has CUDA; gpu_main.cpp skips without a device.
#include <chrono>
#include <optional>
#include <utility>
#include <vector>

#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <loom/config.hpp>

#if LOOM_TORCH_HAS_CUDA
#include <loom/accumulate/accumulator.hpp>
#include <loom/comm/nccl.hpp>
#include <loom/reduce/reducer.hpp>

using namespace std::chrono_literals;

namespace {
/// NcclCommunicator for the reducer's small host-side tensors too: CPU tensors (the reducer's
/// sample-count word, the parameter-summary all_gather) are staged through cuda:0; CUDA tensors
/// (the gradient buckets) go to NCCL directly. NCCL itself accepts device memory only.
struct HostStagingNccl {
  loom::NcclCommunicator& comm;
  struct Work {
    std::optional<loom::NcclWork> work;
    void wait() {
      if (work) work->wait();
    }
    [[nodiscard]] bool is_completed() const { return !work || work->is_completed(); }
  };
  [[nodiscard]] int rank() const { return comm.rank(); }
  [[nodiscard]] int world_size() const { return comm.world_size(); }
  [[nodiscard]] std::chrono::milliseconds timeout() const { return comm.timeout(); }
  static at::Tensor on_device(const at::Tensor& t) { return t.to(at::Device(at::kCUDA, 0)); }
  void all_reduce(at::Tensor& t, loom::ReduceOp op) { all_reduce_async(t, op).wait(); }
  Work all_reduce_async(at::Tensor& t, loom::ReduceOp op) {
    if (t.is_cuda()) return {comm.all_reduce_async(t, op)};
    auto d = on_device(t);
    comm.all_reduce(d, op);
    t.copy_(d.cpu());
    return {};
  }
  void broadcast(at::Tensor& t, int root) {
    if (t.is_cuda()) return comm.broadcast(t, root);
    auto d = on_device(t);
    comm.broadcast(d, root);
    t.copy_(d.cpu());
  }
  std::vector<at::Tensor> all_gather(const at::Tensor& t) {
    if (t.is_cuda()) return comm.all_gather(t);
    auto out = comm.all_gather(on_device(t));
    for (auto& o : out) o = o.cpu();
    return out;
  }
  void barrier() { comm.barrier(); }
};
static_assert(loom::AsyncCommunicator<HostStagingNccl>);
}  // namespace

TEST_SUITE_BEGIN("torch_cuda");  // see test_gpu_device.cpp: skipped where LibTorch has no CUDA
TEST_CASE("Reducer + Accumulator over NCCL on CUDA tensors: sample-weighted gradients equal the float64 reference") {
  auto store = c10::make_intrusive<c10d::HashStore>();
  loom::NcclCommunicator nccl(*store, 0, 1, {.device = 0, .timeout = 60s});
  HostStagingNccl comm{nccl};
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
    loom::Reducer<HostStagingNccl> reducer(comm, {.names = {"w", "b"}, .params = {w, b}},
                                           {.bucket_cap_bytes = 64, .first_bucket_cap_bytes = 16});
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
