// bench_gpu — host-to-device throughput of loom's transfer paths against the baseline: a plain
// cudaMemcpyAsync of the same bytes from a preallocated pinned buffer, then a stream sync.
//
// Every benchmark copies `bytes` per iteration and waits until the copy landed (so the numbers
// are throughput of complete transfers, not of enqueueing). Buffers are allocated and touched
// before the timed loop. Reported: time per iteration and bytes_per_second; ratios to the
// baseline are computed by scripts/device-check.sh (ratio = loom B/s / baseline B/s, goal >= 0.9).
//
//   h2d_baseline_pinned_memcpy/BYTES   plain cudaHostAlloc'd buffer -> cudaMemcpyAsync -> sync
//   h2d_loom_pool_copy_event/BYTES     PinnedPool block -> copy_h2d_async -> Event record/sync
//   h2d_cuda_transfer_pinned/BYTES     CudaTransfer start/finish of a Batch in pinned memory
//                                      (device tensor from the caching allocator), stream sync
//   h2d_cuda_transfer_staged/BYTES     same from pageable memory (+ staging memcpy into pinned)
//   h2d_scheduler_end_to_end/BYTES     GeneratorLoader<..., DefaultCollate<>, CudaTransfer>: 64 generators,
//                                      one step = merge (host copy) + staging + H2D; steady state
//   h2d_scheduler_pinned_merge/BYTES   GeneratorLoader<..., DefaultCollate into a pinned BufferPool,
//                                      CudaTransfer>: merge (host copy) + H2D, no staging
//
// Without a CUDA device every benchmark reports an error saying why (SkipWithError).
#include <loom/config.hpp>

#if !LOOM_HAS_CUDA
#include <cstdio>
int main() {
  std::puts("bench_gpu: skipped, this build has no CUDA runtime (LOOM_HAS_CUDA=0)");
  return 0;
}
#else

#include <cstring>
#include <functional>
#include <optional>
#include <string>

#include <ATen/ATen.h>
#include <benchmark/benchmark.h>

#include <loom/cuda/buffer.hpp>
#include <loom/cuda/device.hpp>
#include <loom/cuda/pinned.hpp>
#include <loom/cuda/stream.hpp>
#include <loom/cuda/transfer.hpp>
#if LOOM_TORCH_HAS_CUDA
#include <c10/cuda/CUDAStream.h>

#include <loom/schedule/generator_loader.hpp>
#endif

namespace {

bool have_device(benchmark::State& state) {
  static const auto probe = loom::cuda::probe_devices();
  if (probe.count > 0) return true;
  state.SkipWithError(("no CUDA device: " + probe.reason).c_str());
  return false;
}

// 1 MiB, 16 MiB, and one ImageNet-style batch: 64 x 3 x 224 x 224 float32 = 38,535,168 bytes.
void byte_sizes(benchmark::internal::Benchmark* b) {
  b->Arg(1 << 20)->Arg(16 << 20)->Arg(64 * 3 * 224 * 224 * 4);
  b->UseRealTime()->Unit(benchmark::kMillisecond)->MinWarmUpTime(0.2);
}

void BM_h2d_baseline_pinned_memcpy(benchmark::State& state) {
  if (!have_device(state)) return;
  const auto bytes = static_cast<std::size_t>(state.range(0));
  void* host = nullptr;
  LOOM_CUDA_CHECK(cudaHostAlloc(&host, bytes, cudaHostAllocPortable));
  std::memset(host, 1, bytes);
  loom::cuda::DeviceBuffer dev(0, bytes);
  auto stream = loom::cuda::Stream::create(0);
  for (auto _ : state) {
    LOOM_CUDA_CHECK(cudaMemcpyAsync(dev.get(), host, bytes, cudaMemcpyHostToDevice, stream.get()));
    LOOM_CUDA_CHECK(cudaStreamSynchronize(stream.get()));
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * bytes));
  LOOM_CUDA_CHECK(cudaFreeHost(host));
}
BENCHMARK(BM_h2d_baseline_pinned_memcpy)->Name("h2d_baseline_pinned_memcpy")->Apply(byte_sizes);

void BM_h2d_loom_pool_copy_event(benchmark::State& state) {
  if (!have_device(state)) return;
  const auto bytes = static_cast<std::size_t>(state.range(0));
  loom::cuda::PinnedPool pool;
  std::memset(pool.empty({static_cast<int64_t>(bytes)}, at::kByte).data_ptr(), 1, bytes);  // block cached, touched
  loom::cuda::DeviceBuffer dev(0, bytes);
  auto stream = loom::cuda::Stream::create(0);
  loom::cuda::Event done(0);
  for (auto _ : state) {
    at::Tensor block = pool.empty({static_cast<int64_t>(bytes)}, at::kByte);  // the cached block
    loom::cuda::copy_h2d_async(dev.get(), block.data_ptr(), bytes, stream.get());
    done.record(stream);
    done.synchronize();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * bytes));
  state.counters["host_allocs"] = static_cast<double>(pool.stats().host_allocs);
}
BENCHMARK(BM_h2d_loom_pool_copy_event)->Name("h2d_loom_pool_copy_event")->Apply(byte_sizes);

#if LOOM_TORCH_HAS_CUDA
void transfer_loop(benchmark::State& state, bool pinned) {
  if (!have_device(state)) return;
  const auto bytes = static_cast<int64_t>(state.range(0));
  loom::cuda::PinnedPool pool;
  loom::Batch host;
  host.data = pinned ? pool.empty({bytes / 4}, at::kFloat) : at::empty({bytes / 4}, at::kFloat);
  host.data.fill_(1.0f);
  host.num_samples = 1;
  loom::cuda::CudaTransfer transfer;
  auto consumer = c10::cuda::getCurrentCUDAStream(0);
  for (auto _ : state) {
    loom::Batch b = host;  // shares the host tensor
    auto ticket = transfer.start(b, 0);
    transfer.finish(b, 0, ticket);
    consumer.synchronize();
  }
  state.SetBytesProcessed(state.iterations() * bytes);
}
void BM_h2d_cuda_transfer_pinned(benchmark::State& state) {
  transfer_loop(state, true);
}
void BM_h2d_cuda_transfer_staged(benchmark::State& state) {
  transfer_loop(state, false);
}
BENCHMARK(BM_h2d_cuda_transfer_pinned)->Name("h2d_cuda_transfer_pinned")->Apply(byte_sizes);
BENCHMARK(BM_h2d_cuda_transfer_staged)->Name("h2d_cuda_transfer_staged")->Apply(byte_sizes);

void BM_h2d_scheduler_end_to_end(benchmark::State& state) {
  if (!have_device(state)) return;
  const int64_t bytes = state.range(0);
  constexpr int kGenerators = 64;
  const int64_t per_sample = bytes / 4 / kGenerators;  // float32 elements per sample
  using Gen = std::function<std::optional<at::Tensor>()>;
  std::vector<Gen> gens;
  for (int g = 0; g < kGenerators; ++g) {
    at::Tensor sample = at::full({per_sample}, static_cast<float>(g));
    gens.emplace_back([sample]() -> std::optional<at::Tensor> { return sample; });  // endless, no generation cost
  }
  loom::GeneratorLoader<Gen, loom::DefaultCollate<>, loom::cuda::CudaTransfer> sched(
      std::move(gens), {.num_devices = 1, .prefetch_depth = 4, .num_workers = 1, .count_unread = false}, {},
      loom::cuda::CudaTransfer{});
  auto consumer = c10::cuda::getCurrentCUDAStream(0);
  for (auto _ : state) {
    auto step = sched.next();
    if (!step) {
      state.SkipWithError("scheduler ended");
      break;
    }
    consumer.synchronize();  // the step's batch has landed on the device
    benchmark::DoNotOptimize(step->devices[0].batch.data.data_ptr());
  }
  sched.stop();
  state.SetBytesProcessed(state.iterations() * per_sample * 4 * kGenerators);
}
BENCHMARK(BM_h2d_scheduler_end_to_end)->Name("h2d_scheduler_end_to_end")->Apply(byte_sizes);

void BM_h2d_scheduler_pinned_merge(benchmark::State& state) {
  if (!have_device(state)) return;
  const int64_t bytes = state.range(0);
  constexpr int kGenerators = 64;
  const int64_t per_sample = bytes / 4 / kGenerators;
  using Gen = std::function<std::optional<at::Tensor>()>;
  std::vector<Gen> gens;
  for (int g = 0; g < kGenerators; ++g) {
    at::Tensor sample = at::full({per_sample}, static_cast<float>(g));
    gens.emplace_back([sample]() -> std::optional<at::Tensor> { return sample; });
  }
  auto pinned = std::make_shared<loom::BufferPool>(loom::BufferPoolOptions{.allocate = loom::cuda::pinned_empty});
  loom::GeneratorLoader<Gen, loom::DefaultCollate<>, loom::cuda::CudaTransfer> sched(
      std::move(gens), {.num_devices = 1, .prefetch_depth = 4, .num_workers = 1, .count_unread = false},
      loom::DefaultCollate<>{.options = {.pool = pinned}}, loom::cuda::CudaTransfer{});
  auto consumer = c10::cuda::getCurrentCUDAStream(0);
  for (auto _ : state) {
    auto step = sched.next();
    if (!step) {
      state.SkipWithError("scheduler ended");
      break;
    }
    consumer.synchronize();
    benchmark::DoNotOptimize(step->devices[0].batch.data.data_ptr());
  }
  sched.stop();
  state.SetBytesProcessed(state.iterations() * per_sample * 4 * kGenerators);
  state.counters["pinned_buffers"] = static_cast<double>(pinned->allocations());
}
BENCHMARK(BM_h2d_scheduler_pinned_merge)->Name("h2d_scheduler_pinned_merge")->Apply(byte_sizes);
#endif

}  // namespace

BENCHMARK_MAIN();

#endif  // LOOM_HAS_CUDA
