// bench_reduce — gradient reduction over Gloo, 2 ranks on loopback, every variant in one run.
//
// reduce_resnet50/*: the 161 parameter tensors of torchvision's ResNet-50 (25,557,032 float32
//   elements, 102.2 MB; shapes listed below), gradients already computed:
//     per_tensor   one blocking all-reduce (and divide) per gradient tensor: the naive loop
//     flat         one all-reduce of one preallocated flat buffer of the same bytes: the limit
//     loom         loom::Reducer (25 MiB buckets, 1 MiB first; average = world_size on 2 ranks: each
//                  bucket divided with a range check before its all-reduce, see docs/reduce.md) on
//                  gradients marked ready by hand (mark_all_ready), so only the reduction is timed
//     loom_deterministic  the same with ReducerOptions::deterministic (grid sums on the int32
//                  wire, int64 for a bucket that does not fit it; its wire_bytes counter: the
//                  bytes its all-reduces carried per step, wide_buckets: buckets sent again as
//                  int64 per step)
//   the same gradients delivered by a backward pass (a custom autograd function whose backward
//   returns them), so that a reducer driven by autograd hooks can be compared:
//     backward_only  the backward alone (AccumulateGrad adds into .grad): subtract it
//     loom_hooks     loom::Reducer launched from its hooks during that backward
//     ddp            c10d::Reducer (DistributedDataParallel's reducer; 25 MiB / 1 MiB buckets,
//                    gradient_as_bucket_view) driven the way DDP's Python wrapper drives it
// overlap_cnn/*: a small CNN's forward + backward + reduce step (batch 16 of 3x32x32, ~5.3 M
//   parameters, 4 MiB buckets), reduction after backward (ReducerOptions::overlap = false) vs
//   launched from hooks while backward runs.
// *_no_recorder: loom_hooks and overlap_cnn/overlapped on a second communicator of the same ranks
//   built with GlooOptions::flight_recorder = false (no record, no fingerprint, no watcher thread):
//   the ratios recorder_cost_* (time without / time with; goal >= 0.99) are the recorder's cost.
// sweep/{flat,loom}/params:N: how cost grows with the model: N = 1 M, 10 M, 25 M, 100 M float32
//   parameters as 512 x 512 layers, loom (gradients marked ready) against one flat all-reduce of
//   the same bytes.
//
// Method (able to see a 5 % change on a noisy machine): loom::spawn starts 2 ranks; rank 0 runs
// Google Benchmark, and before each run broadcasts (variant, iterations) so rank 1 performs the
// same collectives; each variant is built once, on first use, in the same order on both ranks;
// every run starts with one untimed step. Defaults: 5 iterations per run, 11 repetitions, random
// interleaving (each repetition of each variant and size runs at a random point of the session,
// so a burst of load hits all of them alike). Rank 0 reports wall time, algbw = bytes / time and
// busbw = algbw x 2(n-1)/n like nccl-tests, and at the end one line per ratio:
//   RATIO <name> median=<m> min=<a> max=<b> n=<repetitions> goal>=<g> met|NOT-met
// where each of the n values is baseline time / loom time of repetition i (higher is better for
// loom), so the spread of the ratio itself is visible. `--benchmark_out=FILE.json
// --benchmark_out_format=json` also writes every repetition (scripts/plot_benchmarks.sh draws the
// sweep from it). One intra-op thread per rank. Run: build-dir/bench/bench_reduce.
//
// `bench_reduce --cuda` measures the reducer on a GPU at world size 1 over NCCL (see run_cuda).
// zero_resnet50/*: the loom variant's reduction and then Adam's step over the same parameters,
//   unsharded (adam) or ZeRO stage 1 (adam_zero1, loom::ShardedOptimizer), each with the Adam state
//   this rank holds (state_bytes); `bench_reduce --zero-memory` measures their peak memory per rank.
// `bench_reduce --overhead=loom|hand|trainer|lowlevel|recorder|norecorder` runs one of the training loops compared by
// instruction count in scripts/callgrind_overhead.sh (one process, no benchmark framework).
#include <algorithm>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <sys/resource.h>
#include <vector>

#include <benchmark/benchmark.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/torch.h>
#include <torch/version.h>

#include <loom/accumulate/accumulator.hpp>
#include <loom/comm/gloo.hpp>
#include <loom/comm/host_values.hpp>
#include <loom/comm/local.hpp>
#include <loom/compat.hpp>
#include <loom/config.hpp>
#if LOOM_HAS_NCCL && LOOM_TORCH_HAS_CUDA
#include <loom/comm/nccl.hpp>
#endif
#include <loom/launch/spawn.hpp>
#include <loom/optim/sharded_optimizer.hpp>
#include <loom/reduce/module.hpp>
#include <loom/reduce/reducer.hpp>
#include <loom/sample/global_batch.hpp>
#include <loom/train/loader.hpp>
#include <loom/train/trainer.hpp>

#include "ddp_reducer.hpp"

namespace {

struct Shape {
  const char* name;
  std::vector<std::int64_t> sizes;
};

// torchvision resnet50(): conv1, bn1, then bottleneck blocks [3, 4, 6, 3] of widths 64..512
// (conv1 1x1, conv2 3x3, conv3 1x1 expanding x4, a downsample in each layer's first block), fc.
const std::vector<Shape>& resnet50_shapes() {
  static const std::vector<Shape> shapes = {
      {"conv1.weight", {64, 3, 7, 7}},
      {"bn1.weight", {64}},
      {"bn1.bias", {64}},
      {"layer1.0.conv1.weight", {64, 64, 1, 1}},
      {"layer1.0.bn1.weight", {64}},
      {"layer1.0.bn1.bias", {64}},
      {"layer1.0.conv2.weight", {64, 64, 3, 3}},
      {"layer1.0.bn2.weight", {64}},
      {"layer1.0.bn2.bias", {64}},
      {"layer1.0.conv3.weight", {256, 64, 1, 1}},
      {"layer1.0.bn3.weight", {256}},
      {"layer1.0.bn3.bias", {256}},
      {"layer1.0.downsample.0.weight", {256, 64, 1, 1}},
      {"layer1.0.downsample.1.weight", {256}},
      {"layer1.0.downsample.1.bias", {256}},
      {"layer1.1.conv1.weight", {64, 256, 1, 1}},
      {"layer1.1.bn1.weight", {64}},
      {"layer1.1.bn1.bias", {64}},
      {"layer1.1.conv2.weight", {64, 64, 3, 3}},
      {"layer1.1.bn2.weight", {64}},
      {"layer1.1.bn2.bias", {64}},
      {"layer1.1.conv3.weight", {256, 64, 1, 1}},
      {"layer1.1.bn3.weight", {256}},
      {"layer1.1.bn3.bias", {256}},
      {"layer1.2.conv1.weight", {64, 256, 1, 1}},
      {"layer1.2.bn1.weight", {64}},
      {"layer1.2.bn1.bias", {64}},
      {"layer1.2.conv2.weight", {64, 64, 3, 3}},
      {"layer1.2.bn2.weight", {64}},
      {"layer1.2.bn2.bias", {64}},
      {"layer1.2.conv3.weight", {256, 64, 1, 1}},
      {"layer1.2.bn3.weight", {256}},
      {"layer1.2.bn3.bias", {256}},
      {"layer2.0.conv1.weight", {128, 256, 1, 1}},
      {"layer2.0.bn1.weight", {128}},
      {"layer2.0.bn1.bias", {128}},
      {"layer2.0.conv2.weight", {128, 128, 3, 3}},
      {"layer2.0.bn2.weight", {128}},
      {"layer2.0.bn2.bias", {128}},
      {"layer2.0.conv3.weight", {512, 128, 1, 1}},
      {"layer2.0.bn3.weight", {512}},
      {"layer2.0.bn3.bias", {512}},
      {"layer2.0.downsample.0.weight", {512, 256, 1, 1}},
      {"layer2.0.downsample.1.weight", {512}},
      {"layer2.0.downsample.1.bias", {512}},
      {"layer2.1.conv1.weight", {128, 512, 1, 1}},
      {"layer2.1.bn1.weight", {128}},
      {"layer2.1.bn1.bias", {128}},
      {"layer2.1.conv2.weight", {128, 128, 3, 3}},
      {"layer2.1.bn2.weight", {128}},
      {"layer2.1.bn2.bias", {128}},
      {"layer2.1.conv3.weight", {512, 128, 1, 1}},
      {"layer2.1.bn3.weight", {512}},
      {"layer2.1.bn3.bias", {512}},
      {"layer2.2.conv1.weight", {128, 512, 1, 1}},
      {"layer2.2.bn1.weight", {128}},
      {"layer2.2.bn1.bias", {128}},
      {"layer2.2.conv2.weight", {128, 128, 3, 3}},
      {"layer2.2.bn2.weight", {128}},
      {"layer2.2.bn2.bias", {128}},
      {"layer2.2.conv3.weight", {512, 128, 1, 1}},
      {"layer2.2.bn3.weight", {512}},
      {"layer2.2.bn3.bias", {512}},
      {"layer2.3.conv1.weight", {128, 512, 1, 1}},
      {"layer2.3.bn1.weight", {128}},
      {"layer2.3.bn1.bias", {128}},
      {"layer2.3.conv2.weight", {128, 128, 3, 3}},
      {"layer2.3.bn2.weight", {128}},
      {"layer2.3.bn2.bias", {128}},
      {"layer2.3.conv3.weight", {512, 128, 1, 1}},
      {"layer2.3.bn3.weight", {512}},
      {"layer2.3.bn3.bias", {512}},
      {"layer3.0.conv1.weight", {256, 512, 1, 1}},
      {"layer3.0.bn1.weight", {256}},
      {"layer3.0.bn1.bias", {256}},
      {"layer3.0.conv2.weight", {256, 256, 3, 3}},
      {"layer3.0.bn2.weight", {256}},
      {"layer3.0.bn2.bias", {256}},
      {"layer3.0.conv3.weight", {1024, 256, 1, 1}},
      {"layer3.0.bn3.weight", {1024}},
      {"layer3.0.bn3.bias", {1024}},
      {"layer3.0.downsample.0.weight", {1024, 512, 1, 1}},
      {"layer3.0.downsample.1.weight", {1024}},
      {"layer3.0.downsample.1.bias", {1024}},
      {"layer3.1.conv1.weight", {256, 1024, 1, 1}},
      {"layer3.1.bn1.weight", {256}},
      {"layer3.1.bn1.bias", {256}},
      {"layer3.1.conv2.weight", {256, 256, 3, 3}},
      {"layer3.1.bn2.weight", {256}},
      {"layer3.1.bn2.bias", {256}},
      {"layer3.1.conv3.weight", {1024, 256, 1, 1}},
      {"layer3.1.bn3.weight", {1024}},
      {"layer3.1.bn3.bias", {1024}},
      {"layer3.2.conv1.weight", {256, 1024, 1, 1}},
      {"layer3.2.bn1.weight", {256}},
      {"layer3.2.bn1.bias", {256}},
      {"layer3.2.conv2.weight", {256, 256, 3, 3}},
      {"layer3.2.bn2.weight", {256}},
      {"layer3.2.bn2.bias", {256}},
      {"layer3.2.conv3.weight", {1024, 256, 1, 1}},
      {"layer3.2.bn3.weight", {1024}},
      {"layer3.2.bn3.bias", {1024}},
      {"layer3.3.conv1.weight", {256, 1024, 1, 1}},
      {"layer3.3.bn1.weight", {256}},
      {"layer3.3.bn1.bias", {256}},
      {"layer3.3.conv2.weight", {256, 256, 3, 3}},
      {"layer3.3.bn2.weight", {256}},
      {"layer3.3.bn2.bias", {256}},
      {"layer3.3.conv3.weight", {1024, 256, 1, 1}},
      {"layer3.3.bn3.weight", {1024}},
      {"layer3.3.bn3.bias", {1024}},
      {"layer3.4.conv1.weight", {256, 1024, 1, 1}},
      {"layer3.4.bn1.weight", {256}},
      {"layer3.4.bn1.bias", {256}},
      {"layer3.4.conv2.weight", {256, 256, 3, 3}},
      {"layer3.4.bn2.weight", {256}},
      {"layer3.4.bn2.bias", {256}},
      {"layer3.4.conv3.weight", {1024, 256, 1, 1}},
      {"layer3.4.bn3.weight", {1024}},
      {"layer3.4.bn3.bias", {1024}},
      {"layer3.5.conv1.weight", {256, 1024, 1, 1}},
      {"layer3.5.bn1.weight", {256}},
      {"layer3.5.bn1.bias", {256}},
      {"layer3.5.conv2.weight", {256, 256, 3, 3}},
      {"layer3.5.bn2.weight", {256}},
      {"layer3.5.bn2.bias", {256}},
      {"layer3.5.conv3.weight", {1024, 256, 1, 1}},
      {"layer3.5.bn3.weight", {1024}},
      {"layer3.5.bn3.bias", {1024}},
      {"layer4.0.conv1.weight", {512, 1024, 1, 1}},
      {"layer4.0.bn1.weight", {512}},
      {"layer4.0.bn1.bias", {512}},
      {"layer4.0.conv2.weight", {512, 512, 3, 3}},
      {"layer4.0.bn2.weight", {512}},
      {"layer4.0.bn2.bias", {512}},
      {"layer4.0.conv3.weight", {2048, 512, 1, 1}},
      {"layer4.0.bn3.weight", {2048}},
      {"layer4.0.bn3.bias", {2048}},
      {"layer4.0.downsample.0.weight", {2048, 1024, 1, 1}},
      {"layer4.0.downsample.1.weight", {2048}},
      {"layer4.0.downsample.1.bias", {2048}},
      {"layer4.1.conv1.weight", {512, 2048, 1, 1}},
      {"layer4.1.bn1.weight", {512}},
      {"layer4.1.bn1.bias", {512}},
      {"layer4.1.conv2.weight", {512, 512, 3, 3}},
      {"layer4.1.bn2.weight", {512}},
      {"layer4.1.bn2.bias", {512}},
      {"layer4.1.conv3.weight", {2048, 512, 1, 1}},
      {"layer4.1.bn3.weight", {2048}},
      {"layer4.1.bn3.bias", {2048}},
      {"layer4.2.conv1.weight", {512, 2048, 1, 1}},
      {"layer4.2.bn1.weight", {512}},
      {"layer4.2.bn1.bias", {512}},
      {"layer4.2.conv2.weight", {512, 512, 3, 3}},
      {"layer4.2.bn2.weight", {512}},
      {"layer4.2.bn2.bias", {512}},
      {"layer4.2.conv3.weight", {2048, 512, 1, 1}},
      {"layer4.2.bn3.weight", {2048}},
      {"layer4.2.bn3.bias", {2048}},
      {"fc.weight", {1000, 2048}},
      {"fc.bias", {1000}},
  };
  return shapes;
}

constexpr int kWorld = 2;
constexpr int kIterations = 5;
loom::GlooCommunicator* g_comm = nullptr;
// The same two ranks joined a second time with GlooOptions::flight_recorder = false: the
// *_no_recorder variants run on it, to measure the flight recorder's and the fingerprint's cost.
loom::GlooCommunicator* g_comm_off = nullptr;

std::vector<at::Tensor> tensors_like(const std::vector<std::vector<std::int64_t>>& shapes, bool requires_grad,
                                     float value) {
  std::vector<at::Tensor> out;
  for (const auto& s : shapes) {
    auto t = torch::full(s, value);
    out.push_back(requires_grad ? t.requires_grad_() : t);
  }
  return out;
}

std::vector<std::vector<std::int64_t>> resnet50_sizes() {
  std::vector<std::vector<std::int64_t>> out;
  for (const auto& s : resnet50_shapes()) out.push_back(s.sizes);
  return out;
}

/// A model of about `params` float32 parameters as layers of a 512 x 512 weight and a 512 bias
/// (many tensors, like a real model), for the size sweep.
std::vector<std::vector<std::int64_t>> sweep_sizes(std::int64_t params) {
  std::vector<std::vector<std::int64_t>> out;
  const std::int64_t layer = 512 * 512 + 512;
  for (std::int64_t k = 0; k < std::max<std::int64_t>(1, params / layer); ++k) {
    out.push_back({512, 512});
    out.push_back({512});
  }
  return out;
}

std::int64_t bytes_of(const std::vector<std::vector<std::int64_t>>& shapes) {
  std::int64_t n = 0;
  for (const auto& s : shapes) n += c10::multiply_integers(s);
  return n * 4;
}

// ---- the variants: one step each; built lazily, in the same order on both ranks ----------------

struct Variant {
  virtual ~Variant() = default;
  virtual void step() = 0;
  virtual void finish() {}         // after the timed steps: fill in the counters below that need a look back
  std::int64_t bytes = 0;          // gradient bytes reduced per step (0: not a reduction benchmark)
  std::int64_t wire_bytes = 0;     // bytes one rank's all-reduces carry per step, when they differ from `bytes`
  std::int64_t wide_buckets = -1;  // deterministic reducer: buckets sent again as int64 in the last step
  std::int64_t state_bytes = -1;   // optimizer state this rank holds (an optimizer-step variant)
};

// One blocking all-reduce (and divide) per gradient tensor: the naive loop.
struct PerTensor : Variant {
  std::vector<at::Tensor> grads;
  explicit PerTensor(const std::vector<std::vector<std::int64_t>>& shapes) : grads(tensors_like(shapes, false, 1e-3f)) {
    bytes = bytes_of(shapes);
  }
  void step() override {
    for (auto& g : grads) {
      g_comm->all_reduce(g, loom::ReduceOp::sum);
      g.div_(kWorld);
    }
  }
};

// One all-reduce of one preallocated flat buffer of the same bytes: the limit.
struct Flat : Variant {
  at::Tensor buffer;
  explicit Flat(std::int64_t b) : buffer(torch::full({b / 4}, 1e-3f)) { bytes = b; }
  void step() override { g_comm->all_reduce(buffer, loom::ReduceOp::sum); }
};

// loom::Reducer on gradients marked ready by hand: only the reduction is timed. `deterministic`:
// ReducerOptions::deterministic (integer sums; it refuses average = world_size, so it averages by
// samples with one sample per rank, which divides by the same 2).
struct LoomMarked : Variant {
  std::vector<at::Tensor> params;
  bool deterministic = false;
  loom::Reducer<loom::GlooCommunicator> reducer;
  explicit LoomMarked(const std::vector<std::vector<std::int64_t>>& shapes, bool exact = false)
      : params(tensors_like(shapes, true, 0.5f)),
        deterministic(exact),
        reducer(*g_comm, {.params = params},
                {.average = exact ? loom::Average::samples : loom::Average::world_size, .deterministic = exact}) {
    bytes = bytes_of(shapes);
    reducer.prepare_backward({.sync = false});  // gradients become bucket views
    for (auto& p : params) p.mutable_grad().fill_(1e-3f);
    step();  // the one-time bucket rebuild happens at the next window
  }
  void step() override {
    reducer.prepare_backward({.sync = true, .window_samples = deterministic ? 1 : 32});
    reducer.mark_all_ready();
    const loom::Reduction r = reducer.finish_window();
    if (deterministic) wide_buckets = r.grid_wide_buckets;
  }
  void finish() override {
    if (!deterministic) return;
    // The bytes the last step's all-reduces carried (the window meta's small all-reduce left out):
    // each bucket's int32 wire [elements | tail of 4 n + 1 | wide flag], and, for the buckets sent
    // again (the largest ones counted, an upper bound), its int64 [elements | tail].
    std::int64_t narrow = 0;
    std::vector<std::int64_t> wide;
    for (const auto& b : reducer.bucket_params()) {
      std::int64_t elements = 0;
      for (std::size_t i : b) elements += params[i].numel();
      const auto n = static_cast<std::int64_t>(b.size());
      narrow += 4 * (elements + 4 * n + 2);
      wide.push_back(8 * (elements + 4 * n + 1));
    }
    std::sort(wide.rbegin(), wide.rend());
    wire_bytes = narrow;
    for (std::int64_t i = 0; i < wide_buckets && i < static_cast<std::int64_t>(wide.size()); ++i)
      wire_bytes += wide[static_cast<std::size_t>(i)];
  }
};

std::vector<at::Tensor>* g_source = nullptr;

// forward: a scalar that depends on every parameter; backward: hands out the precomputed gradients.
struct GradSource : torch::autograd::Function<GradSource> {
  static at::Tensor forward(torch::autograd::AutogradContext*, at::TensorList params) {
    return torch::zeros({}, params.front().options().requires_grad(false));
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*, torch::autograd::variable_list) {
    return *g_source;
  }
};

// The ResNet-50 gradients delivered by a backward pass (subtract it from the next two).
struct BackwardOnly : Variant {
  std::vector<at::Tensor> params = tensors_like(resnet50_sizes(), true, 0.5f),
                          grads = tensors_like(resnet50_sizes(), false, 1e-3f);
  BackwardOnly() { bytes = bytes_of(resnet50_sizes()); }
  void step() override {
    g_source = &grads;
    GradSource::apply(at::TensorList(params)).backward();
  }
};

// The reduction above and then Adam's step over the same parameters: unsharded (every rank steps
// every element) or ZeRO stage 1 (loom::ShardedOptimizer: this rank's shard, then one all_gather per
// 25 MiB bucket). The same gradients, the same bytes reduced; state_bytes: this rank's Adam state.
struct AdamStep : Variant {
  LoomMarked reduced;
  torch::optim::Adam adam;
  std::optional<loom::ShardedOptimizer<loom::GlooCommunicator>> sharded;
  AdamStep(const std::vector<std::vector<std::int64_t>>& shapes, bool zero1)
      : reduced(shapes), adam(reduced.params, torch::optim::AdamOptions(1e-4)) {
    if (zero1) sharded.emplace(*g_comm, adam);
    bytes = reduced.bytes;
  }
  void step() override {
    reduced.step();
    if (sharded)
      sharded->step();
    else
      adam.step();
  }
  void finish() override { state_bytes = sharded ? sharded->state_bytes() : loom::optimizer_state_bytes(adam); }
};

// loom::Reducer launched from its hooks during that backward.
struct LoomHooks : Variant {
  std::vector<at::Tensor> params = tensors_like(resnet50_sizes(), true, 0.5f),
                          grads = tensors_like(resnet50_sizes(), false, 1e-3f);
  loom::Reducer<loom::GlooCommunicator> reducer;
  explicit LoomHooks(loom::GlooCommunicator* comm = g_comm)
      : reducer(*comm, {.params = params}, {.average = loom::Average::world_size}) {
    bytes = bytes_of(resnet50_sizes());
  }
  void step() override {
    g_source = &grads;
    reducer.prepare_backward({.sync = true, .window_samples = 32});
    GradSource::apply(at::TensorList(params)).backward();
    reducer.finish_window();
  }
};

// c10d::Reducer (DistributedDataParallel's reducer; 25 MiB / 1 MiB buckets, gradient_as_bucket_view)
// driven the way DDP's Python wrapper drives it, on the same backward.
struct Ddp : Variant {
  std::vector<at::Tensor> params = tensors_like(resnet50_sizes(), true, 0.5f),
                          grads = tensors_like(resnet50_sizes(), false, 1e-3f);
  std::unique_ptr<c10d::Reducer> reducer;
  Ddp() {
    bytes = bytes_of(resnet50_sizes());
    std::unordered_map<std::size_t, std::string> names;
    for (std::size_t i = 0; i < params.size(); ++i) names[i] = resnet50_shapes()[i].name;
    reducer =
        bench::make_ddp_reducer(params, g_comm->process_group(), std::move(names),
                                /*bucket_bytes=*/std::int64_t{25} << 20, /*first_bucket_bytes=*/std::int64_t{1} << 20);
  }
  void step() override {
    g_source = &grads;
    reducer->rebuild_buckets();
    reducer->prepare_for_forward();
    auto out = GradSource::apply(at::TensorList(params));
    reducer->prepare_for_backward({out});
    out.backward();  // DDP's hooks reduce; its end-of-backward callback waits for every bucket
  }
};

// Small convolutions, large fully connected layers: ~5.3 M parameters (21 MB of gradients), whose
// largest gradients (fc) are ready first in backward while the convolutions' backward still runs.
torch::nn::Sequential make_cnn() {
  namespace nn = torch::nn;
  torch::manual_seed(0);
  return nn::Sequential(nn::Conv2d(nn::Conv2dOptions(3, 32, 3).padding(1)), nn::ReLU(), nn::MaxPool2d(2),   // 16x16
                        nn::Conv2d(nn::Conv2dOptions(32, 64, 3).padding(1)), nn::ReLU(), nn::MaxPool2d(2),  // 8x8
                        nn::Conv2d(nn::Conv2dOptions(64, 64, 3).padding(1)), nn::ReLU(),                    // 8x8
                        nn::Flatten(), nn::Linear(64 * 8 * 8, 1024), nn::ReLU(), nn::Linear(1024, 1024), nn::ReLU(),
                        nn::Linear(1024, 10));
}

// A small CNN's forward + backward + reduce step (batch 16 of 3x32x32), 4 MiB buckets: reduction
// after backward (overlap = false) or launched from hooks while backward runs.
struct OverlapCnn : Variant {
  torch::nn::Sequential net = make_cnn();
  loom::Reducer<loom::GlooCommunicator> reducer;
  loom::Accumulator<loom::Reducer<loom::GlooCommunicator>> acc;
  at::Tensor x = torch::randn({16, 3, 32, 32}), y = torch::randint(0, 10, {16});
  explicit OverlapCnn(bool overlap, loom::GlooCommunicator* comm = g_comm)
      : reducer(*comm, loom::parameters_of(*net), {.bucket_cap_bytes = 4 * loom::kMiB, .overlap = overlap}),
        acc(reducer) {}
  void step() override {
    acc.run(16, [&] {
      torch::nn::functional::cross_entropy(net->forward(x), y,
                                           torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum))
          .backward();
    });
  }
};

// ---- the registry: ids, names, factories ---------------------------------------------------------

const std::vector<std::int64_t> kSweep = {1'000'000, 10'000'000, 25'000'000, 100'000'000};

struct Entry {
  std::string name;
  std::function<std::unique_ptr<Variant>()> make;
};

const std::vector<Entry>& entries() {
  static const std::vector<Entry> all = [] {
    std::vector<Entry> e;
    e.push_back({"reduce_resnet50/per_tensor", [] { return std::make_unique<PerTensor>(resnet50_sizes()); }});
    e.push_back({"reduce_resnet50/flat", [] { return std::make_unique<Flat>(bytes_of(resnet50_sizes())); }});
    e.push_back({"reduce_resnet50/loom", [] { return std::make_unique<LoomMarked>(resnet50_sizes()); }});
    e.push_back({"reduce_resnet50/loom_deterministic",
                 [] { return std::make_unique<LoomMarked>(resnet50_sizes(), /*exact=*/true); }});
    e.push_back({"reduce_resnet50/backward_only", [] { return std::make_unique<BackwardOnly>(); }});
    e.push_back({"reduce_resnet50/loom_hooks", [] { return std::make_unique<LoomHooks>(); }});
    e.push_back({"reduce_resnet50/ddp", [] { return std::make_unique<Ddp>(); }});
    e.push_back({"zero_resnet50/adam", [] { return std::make_unique<AdamStep>(resnet50_sizes(), false); }});
    e.push_back({"zero_resnet50/adam_zero1", [] { return std::make_unique<AdamStep>(resnet50_sizes(), true); }});
    e.push_back({"overlap_cnn/after_backward", [] { return std::make_unique<OverlapCnn>(false); }});
    e.push_back({"overlap_cnn/overlapped", [] { return std::make_unique<OverlapCnn>(true); }});
    e.push_back({"reduce_resnet50/loom_hooks_no_recorder", [] { return std::make_unique<LoomHooks>(g_comm_off); }});
    e.push_back({"overlap_cnn/overlapped_no_recorder", [] { return std::make_unique<OverlapCnn>(true, g_comm_off); }});
    for (std::int64_t n : kSweep) {
      const auto shapes = sweep_sizes(n);
      e.push_back(
          {fmt::format("sweep/flat/params:{}", n), [shapes] { return std::make_unique<Flat>(bytes_of(shapes)); }});
      e.push_back({fmt::format("sweep/loom/params:{}", n), [shapes] { return std::make_unique<LoomMarked>(shapes); }});
    }
    return e;
  }();
  return all;
}

std::map<std::int64_t, std::unique_ptr<Variant>> g_variants;

Variant& variant(std::int64_t id) {
  auto& v = g_variants[id];
  if (!v) v = entries()[static_cast<std::size_t>(id)].make();
  return *v;
}

/// Rank 0 -> rank 1: [variant id (-1: stop), steps]. Returns the command as seen on this rank.
std::pair<std::int64_t, std::int64_t> exchange_command(std::int64_t id, std::int64_t steps) {
  auto t = at::tensor(std::vector<std::int64_t>{id, steps}, at::kLong);
  g_comm->broadcast(t, 0);
  return {t.data_ptr<std::int64_t>()[0], t.data_ptr<std::int64_t>()[1]};
}

void serve() {  // rank 1: run what rank 0 runs
  for (;;) {
    auto [id, steps] = exchange_command(-1, 0);
    if (id < 0) return;
    Variant& v = variant(id);
    v.step();  // untimed warm-up, as on rank 0
    for (std::int64_t i = 0; i < steps; ++i) v.step();
  }
}

void run_variant(benchmark::State& state, std::int64_t id) {
  const auto steps = static_cast<std::int64_t>(state.max_iterations);
  exchange_command(id, steps);
  Variant& v = variant(id);
  v.step();  // untimed warm-up
  for (auto _ : state) v.step();
  v.finish();
  if (v.wire_bytes > 0) state.counters["wire_bytes"] = static_cast<double>(v.wire_bytes);
  if (v.wide_buckets >= 0) state.counters["wide_buckets"] = static_cast<double>(v.wide_buckets);
  if (v.state_bytes >= 0) state.counters["state_bytes"] = static_cast<double>(v.state_bytes);
  if (v.bytes > 0) {
    state.counters["bytes"] = static_cast<double>(v.bytes);
    state.counters["algbw_GBps"] =
        benchmark::Counter(static_cast<double>(v.bytes) * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
    state.counters["busbw_GBps"] = benchmark::Counter(static_cast<double>(v.bytes) * 1e-9 * 2.0 * (kWorld - 1) / kWorld,
                                                      benchmark::Counter::kIsIterationInvariantRate);
  }
}

// ---- reporting ----------------------------------------------------------------------------------

class NullReporter : public benchmark::BenchmarkReporter {
 public:
  bool ReportContext(const Context&) override { return true; }
  void ReportRuns(const std::vector<Run>&) override {}
};

// The console output, plus every repetition's time (seconds per iteration) of each benchmark.
class RatioReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const auto& r : runs)
      if (r.run_type == Run::RT_Iteration)
        times[r.run_name.function_name].push_back(r.real_accumulated_time / static_cast<double>(r.iterations));
  }
  std::map<std::string, std::vector<double>> times;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const auto n = v.size();
  return n == 0 ? 0.0 : n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/// Prints one machine-readable line per ratio: baseline time / loom time for each repetition
/// (repetition i of each, in the random interleaving), their median, min and max.
// goal < 0: a ratio reported for information ("no-goal").
void print_ratio(const std::map<std::string, std::vector<double>>& t, const std::string& label, const std::string& base,
                 const std::string& loom, double goal) {
  auto b = t.find(base), l = t.find(loom);
  if (b == t.end() || l == t.end()) return;
  std::vector<double> r;
  for (std::size_t i = 0; i < std::min(b->second.size(), l->second.size()); ++i)
    r.push_back(b->second[i] / l->second[i]);
  if (r.empty()) return;
  const double med = median(r);
  if (goal < 0) {  // reported for information: no goal
    std::printf("RATIO %-34s median=%.3f min=%.3f max=%.3f n=%zu no-goal\n", label.c_str(), med,
                *std::min_element(r.begin(), r.end()), *std::max_element(r.begin(), r.end()), r.size());
    return;
  }
  std::printf("RATIO %-34s median=%.3f min=%.3f max=%.3f n=%zu goal>=%.2f %s\n", label.c_str(), med,
              *std::min_element(r.begin(), r.end()), *std::max_element(r.begin(), r.end()), r.size(), goal,
              med >= goal ? "met" : "NOT-met");
}

void print_ratios(const std::map<std::string, std::vector<double>>& t) {
  std::printf("\n");
  print_ratio(t, "loom_vs_flat", "reduce_resnet50/flat", "reduce_resnet50/loom", 0.95);
  print_ratio(t, "loom_vs_per_tensor", "reduce_resnet50/per_tensor", "reduce_resnet50/loom", 2.5);
  print_ratio(t, "loom_hooks_vs_ddp", "reduce_resnet50/ddp", "reduce_resnet50/loom_hooks", 1.05);
  // Deterministic mode's cost: floating loom's time over deterministic loom's (goal: at most 1.3x
  // slower, i.e. a ratio >= 1 / 1.3).
  print_ratio(t, "float_vs_deterministic", "reduce_resnet50/loom", "reduce_resnet50/loom_deterministic", 1.0 / 1.3);
  // ZeRO stage 1's step against the unsharded step after the same reduction (goal: at most 5 % slower).
  print_ratio(t, "zero1_vs_allreduce_step", "zero_resnet50/adam", "zero_resnet50/adam_zero1", 0.95);
  print_ratio(t, "overlapped_vs_after_backward", "overlap_cnn/after_backward", "overlap_cnn/overlapped", 1.0);
  // The flight recorder and the fingerprint: time without them over time with them (goal: at most
  // 1 % slower, a ratio >= 0.99).
  print_ratio(t, "recorder_cost_cnn", "overlap_cnn/overlapped_no_recorder", "overlap_cnn/overlapped", 0.99);
  print_ratio(t, "recorder_cost_resnet50_hooks", "reduce_resnet50/loom_hooks_no_recorder", "reduce_resnet50/loom_hooks",
              0.99);
  for (std::int64_t n : kSweep)
    print_ratio(t, fmt::format("sweep_loom_vs_flat/params:{}", n), fmt::format("sweep/flat/params:{}", n),
                fmt::format("sweep/loom/params:{}", n), 0.9);
  auto get = [&](const char* name) {
    auto it = t.find(name);
    return it == t.end() ? 0.0 : median(it->second);
  };
  const double bw = get("reduce_resnet50/backward_only"), hooks = get("reduce_resnet50/loom_hooks"),
               dd = get("reduce_resnet50/ddp");
  if (hooks > bw && dd > bw)
    std::printf(
        "reduction part of loom_hooks / ddp (medians minus backward_only): loom %.1f ms, ddp %.1f ms -> %.2fx\n",
        (hooks - bw) * 1e3, (dd - bw) * 1e3, (dd - bw) / (hooks - bw));
}

void register_all() {
  for (std::size_t id = 0; id < entries().size(); ++id)
    benchmark::RegisterBenchmark(entries()[id].name.c_str(), run_variant, static_cast<std::int64_t>(id))
        ->Iterations(kIterations)
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
}

// ---- composition overhead under callgrind (scripts/callgrind_overhead.sh) ------------------------
//
// Both loops train the same MLP (128 -> 256 -> 10, float32, cross-entropy summed over 32 samples)
// for 40 micro-batches, an optimizer step every 4, on one process. The hand-written loop does the
// same tensor work as loom: gradients are views into one flat buffer, and at each boundary the
// buffer is divided by the sample count and scanned for inf/NaN with the same kernel
// (loom::detail::scale_and_check); what it leaves out is loom itself (hooks, buckets and flags,
// the sample-count collective on a LocalCommunicator, the accumulator's bookkeeping and SyncResult).

struct OverheadData {
  std::vector<at::Tensor> xs, ys;
  OverheadData() {
    torch::manual_seed(1);
    for (int i = 0; i < 48; ++i) {
      xs.push_back(torch::randn({32, 128}));
      ys.push_back(torch::randint(0, 10, {32}));
    }
  }
};

torch::nn::Sequential make_mlp() {
  torch::manual_seed(0);
  return torch::nn::Sequential(torch::nn::Linear(128, 256), torch::nn::ReLU(), torch::nn::Linear(256, 10));
}

at::Tensor mlp_loss(torch::nn::Sequential& net, const at::Tensor& x, const at::Tensor& y) {
  return torch::nn::functional::cross_entropy(net->forward(x), y,
                                              torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum));
}

constexpr int kOverheadFirst = 8, kOverheadMicroBatches = 40, kOverheadK = 4;

// The short path against the same protocol written over the low-level layer: 48 x 32 samples of
// 128 features (one shape), batches of 32, 4 batches per step; the first 2 steps warm up. Both
// loops fetch, collate, run the same loss and the same optimizer; what differs is loom::Trainer.
struct OverheadSamples {
  std::vector<std::pair<at::Tensor, std::int64_t>> samples;
  std::vector<std::vector<std::int64_t>> shapes;
  OverheadSamples() {
    OverheadData d;
    for (int b = 0; b < 48; ++b)
      for (int r = 0; r < 32; ++r) {
        samples.emplace_back(d.xs[static_cast<std::size_t>(b)][r].clone(),
                             d.ys[static_cast<std::size_t>(b)][r].item<std::int64_t>());
        shapes.push_back({128});
      }
  }
};

const loom::GlobalBatchOptions kOverheadPlan{.shuffle = false, .max_samples = 32, .batches_per_step = kOverheadK};

at::Tensor mlp_mean_loss(torch::nn::Sequential& net, const loom::Batch& b) {
  return torch::nn::functional::cross_entropy(net->forward(b.data), b.targets);
}

auto overhead_fetch(const OverheadSamples& d) {
  return [&d](std::int64_t i) { return d.samples[static_cast<std::size_t>(i)]; };
}
using OverheadLoader = loom::BatchLoader<decltype(overhead_fetch(std::declval<const OverheadSamples&>()))>;
using OverheadTrainer = loom::Trainer<loom::LocalCommunicator, torch::optim::SGD>;

void trainer_epoch(torch::nn::Sequential& net, OverheadTrainer& trainer, OverheadLoader& loader, std::int64_t epoch) {
  for (loom::Batch& b : trainer.epoch(loader, epoch)) trainer.backward(mlp_mean_loss(net, b), b);
}

/// The same protocol over Reducer + Accumulator + GlobalBatchSampler, written by hand.
struct LowLevel {
  loom::GlobalBatchSampler sampler;
  loom::Reducer<loom::LocalCommunicator> reducer;
  loom::Accumulator<loom::Reducer<loom::LocalCommunicator>> acc;
  LowLevel(loom::LocalCommunicator& comm, const OverheadSamples& d, torch::nn::Sequential& net)
      : sampler(comm, d.shapes, kOverheadPlan),
        reducer(comm, loom::parameters_of(*net)),
        acc(reducer, {.micro_batches_per_step = 0}) {}
};

void lowlevel_epoch(torch::nn::Sequential& net, LowLevel& l, const OverheadSamples& d, torch::optim::SGD& sgd,
                    std::int64_t epoch) {
  auto fetch = overhead_fetch(d);
  l.sampler.set_epoch(epoch);
  while (auto item = l.sampler.next()) {
    loom::Batch b = loom::collate_sampled(*item, fetch);
    auto mb = l.acc.micro_batch(b);
    mb.scale(mlp_mean_loss(net, b).reshape({}) * static_cast<double>(b.num_samples)).backward();
    const loom::SyncResult step = mb.finish();
    if (step.apply) sgd.step();
    if (step.boundary) loom::zero_grad(sgd, loom::GradReset::zero);
  }
  while (auto s = l.acc.end_epoch()) {
    if (*s) sgd.step();
    loom::zero_grad(sgd, loom::GradReset::zero);
  }
}

}  // namespace

extern "C" __attribute__((noinline)) void loom_overhead_trainer_loop(torch::nn::Sequential& net,
                                                                     OverheadTrainer& trainer, OverheadLoader& loader) {
  trainer_epoch(net, trainer, loader, 1);
}

using GlooOverheadTrainer = loom::Trainer<loom::GlooCommunicator, torch::optim::SGD>;

/// The flight recorder's cost: the Trainer loop above over a GlooCommunicator of one rank (its
/// collectives go through c10d's Gloo process group, and the recorder sees every one of them),
/// with GlooOptions::flight_recorder on or off. Only the calling thread's instructions are counted
/// (callgrind counts per thread), which is where the recorder does its work (issue, waiting,
/// complete, the fingerprint); one rank has no watcher thread to count.
extern "C" __attribute__((noinline)) void loom_overhead_recorder_loop(torch::nn::Sequential& net,
                                                                      GlooOverheadTrainer& trainer,
                                                                      OverheadLoader& loader) {
  for (loom::Batch& b : trainer.epoch(loader, 1)) trainer.backward(mlp_mean_loss(net, b), b);
}

extern "C" __attribute__((noinline)) void loom_overhead_norecorder_loop(torch::nn::Sequential& net,
                                                                        GlooOverheadTrainer& trainer,
                                                                        OverheadLoader& loader) {
  for (loom::Batch& b : trainer.epoch(loader, 1)) trainer.backward(mlp_mean_loss(net, b), b);
}

extern "C" __attribute__((noinline)) void loom_overhead_lowlevel_loop(torch::nn::Sequential& net, LowLevel& l,
                                                                      const OverheadSamples& d,
                                                                      torch::optim::SGD& sgd) {
  lowlevel_epoch(net, l, d, sgd, 1);
}

extern "C" __attribute__((noinline)) void loom_overhead_loom_loop(
    torch::nn::Sequential& net, OverheadData& data, loom::Accumulator<loom::Reducer<loom::LocalCommunicator>>& acc,
    torch::optim::SGD& sgd) {
  for (int i = kOverheadFirst; i < kOverheadFirst + kOverheadMicroBatches; ++i) {
    auto step = acc.run(32, [&] { mlp_loss(net, data.xs[i], data.ys[i]).backward(); });
    if (step) sgd.step();
    if (step.boundary) loom::zero_grad(sgd, loom::GradReset::zero);
  }
}

extern "C" __attribute__((noinline)) void loom_overhead_hand_loop(torch::nn::Sequential& net, OverheadData& data,
                                                                  at::Tensor& flat, torch::optim::SGD& sgd) {
  std::int64_t samples = 0;
  for (int i = kOverheadFirst; i < kOverheadFirst + kOverheadMicroBatches; ++i) {
    mlp_loss(net, data.xs[i], data.ys[i]).backward();
    samples += 32;
    if ((i + 1) % kOverheadK == 0) {
      const bool bad =
          loom::detail::scale_and_check(flat, static_cast<double>(samples), /*divide=*/true, /*check=*/true);
      if (!bad) sgd.step();
      loom::zero_grad(sgd, loom::GradReset::zero);
      samples = 0;
    }
  }
}

namespace {

int run_overhead(const std::string& which) {
  at::set_num_threads(1);
  OverheadData data;
  auto net = make_mlp();
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.01));
  double checksum = 0;
  if (which == "loom") {
    loom::LocalCommunicator comm;
    loom::Reducer reducer(comm, loom::parameters_of(*net));
    loom::Accumulator acc(reducer, {.micro_batches_per_step = kOverheadK});
    for (int i = 0; i < kOverheadFirst; ++i) {  // warm-up (and the one-time bucket rebuild)
      auto step = acc.run(32, [&] { mlp_loss(net, data.xs[i], data.ys[i]).backward(); });
      if (step) sgd.step();
      if (step.boundary) loom::zero_grad(sgd, loom::GradReset::zero);
    }
    loom_overhead_loom_loop(net, data, acc, sgd);
  } else if (which == "hand") {
    std::int64_t total = 0;
    for (const auto& p : net->parameters()) total += p.numel();
    auto flat = torch::zeros({total});
    std::int64_t offset = 0;
    for (auto& p : net->parameters()) {
      p.mutable_grad() = torch::empty({0}).set_(flat.storage(), offset, p.sizes(), p.strides());
      offset += p.numel();
    }
    std::int64_t samples = 0;
    for (int i = 0; i < kOverheadFirst; ++i) {  // warm-up
      mlp_loss(net, data.xs[i], data.ys[i]).backward();
      samples += 32;
      if ((i + 1) % kOverheadK == 0) {
        if (!loom::detail::scale_and_check(flat, static_cast<double>(samples), true, true)) sgd.step();
        loom::zero_grad(sgd, loom::GradReset::zero);
        samples = 0;
      }
    }
    loom_overhead_hand_loop(net, data, flat, sgd);
  } else if (which == "trainer") {  // epoch 0 warms up (and rebuilds the buckets); epoch 1 is measured
    OverheadSamples d;
    loom::LocalCommunicator comm;
    OverheadLoader loader(comm, d.shapes, overhead_fetch(d), kOverheadPlan);
    OverheadTrainer trainer(comm, *net, sgd);
    trainer_epoch(net, trainer, loader, 0);
    loom_overhead_trainer_loop(net, trainer, loader);
  } else if (which == "lowlevel") {
    OverheadSamples d;
    loom::LocalCommunicator comm;
    LowLevel l(comm, d, net);
    lowlevel_epoch(net, l, d, sgd, 0);
    loom_overhead_lowlevel_loop(net, l, d, sgd);
  } else if (which == "recorder" || which == "norecorder") {  // epoch 0 warms up; epoch 1 is measured
    OverheadSamples d;
    loom::GlooCommunicator comm(c10::make_intrusive<c10d::HashStore>(), 0, 1, {.flight_recorder = which == "recorder"});
    OverheadLoader loader(comm, d.shapes, overhead_fetch(d), kOverheadPlan);
    GlooOverheadTrainer trainer(comm, *net, sgd);
    for (loom::Batch& b : trainer.epoch(loader, 0)) trainer.backward(mlp_mean_loss(net, b), b);
    if (which == "recorder")
      loom_overhead_recorder_loop(net, trainer, loader);
    else
      loom_overhead_norecorder_loop(net, trainer, loader);
    const loom::trace::FlightRecorder* r = comm.flight_recorder();
    std::printf("collectives recorded: %lld\n",
                r != nullptr ? static_cast<long long>(r->snapshot("count").issued_total) : -1LL);
  } else {
    std::fprintf(stderr, "bench_reduce: --overhead=loom, hand, trainer, lowlevel, recorder or norecorder\n");
    return 2;
  }
  for (const auto& p : net->parameters()) checksum += p.sum().item<double>();
  std::printf("overhead loop '%s' done; parameter checksum %.9g\n", which.c_str(), checksum);
  return 0;
}

}  // namespace

// ---- ZeRO stage 1's memory: `bench_reduce --zero-memory` -----------------------------------------
//
// On 2 and 4 ranks, stage 0 then stage 1, each a job of its own (so that each peak is its own): every
// rank builds the ResNet-50 parameters, the reducer and Adam (AdamStep above), runs 3 steps, and
// rank 0 prints the largest state and peak resident memory (getrusage's ru_maxrss) over the ranks:
//   ZERO_MEMORY ranks=W stage=S state_MB=<this stage's Adam state per rank> peak_rss_MB=<peak per rank>
namespace {

int run_zero_memory() {
  for (int world : {2, 4})
    for (int stage : {0, 1})
      loom::spawn(world,
                  [&](const loom::Environment& env) {
                    auto store = loom::rendezvous(env, {.timeout = std::chrono::seconds(300)});
                    loom::GlooCommunicator comm(store, env.rank, env.world_size,
                                                {.timeout = std::chrono::seconds(300), .check_metadata = false},
                                                env.master_addr);
                    g_comm = &comm;
                    std::int64_t state = 0;
                    {
                      AdamStep v(resnet50_sizes(), stage == 1);
                      for (int s = 0; s < 3; ++s) v.step();
                      v.finish();
                      state = v.state_bytes;
                    }
                    g_comm = nullptr;
                    rusage usage{};
                    getrusage(RUSAGE_SELF, &usage);
                    const std::vector<std::int64_t> mine{state, static_cast<std::int64_t>(usage.ru_maxrss)};
                    const auto all = loom::detail::all_gather_int64(comm, mine);
                    std::int64_t max_state = 0, max_rss_kib = 0;
                    for (const auto& r : all) {
                      max_state = std::max(max_state, r[0]);
                      max_rss_kib = std::max(max_rss_kib, r[1]);
                    }
                    if (env.rank == 0)
                      std::printf("ZERO_MEMORY ranks=%d stage=%d state_MB=%.1f peak_rss_MB=%.0f\n", world, stage,
                                  static_cast<double>(max_state) / 1e6, static_cast<double>(max_rss_kib) * 1024 / 1e6);
                  },
                  {.timeout = std::chrono::minutes(20)});
  return 0;
}

}  // namespace

// ---- on a GPU: `bench_reduce --cuda` ------------------------------------------------------------
//
// World size 1 over NCCL (NCCL refuses two ranks on one GPU), the ResNet-50 gradients as CUDA
// float32 tensors: flat (one NcclCommunicator all-reduce of a flat buffer of the same bytes),
// flat_checked (the same, divided by the world size, with an inf/NaN verdict on the host: the
// work loom's step does), loom (Reducer<NcclCommunicator>, gradients marked ready), backward_only and loom_hooks (the same
// gradients from a backward pass). Each step ends when the host has seen the result (the reducer's
// finish_window waits; flat waits for its work). RATIO lines as on the CPU. c10d's DDP reducer is
// left out here: it needs ProcessGroupNCCL's headers, which Debian's LibTorch does not ship.

#if LOOM_HAS_NCCL && LOOM_TORCH_HAS_CUDA
namespace {

loom::NcclCommunicator* g_nccl = nullptr;

std::vector<at::Tensor> cuda_tensors(bool requires_grad, float value) {
  std::vector<at::Tensor> out;
  for (const auto& s : resnet50_sizes()) {
    auto t = torch::full(s, value, torch::TensorOptions().device(torch::kCUDA, 0));
    out.push_back(requires_grad ? t.requires_grad_() : t);
  }
  return out;
}

void cuda_flat(benchmark::State& state) {
  auto buffer = torch::full({bytes_of(resnet50_sizes()) / 4}, 1e-3f, torch::TensorOptions().device(torch::kCUDA, 0));
  g_nccl->all_reduce(buffer, loom::ReduceOp::sum);
  for (auto _ : state) g_nccl->all_reduce(buffer, loom::ReduceOp::sum);
}

// What loom's step produces, by hand: the flat buffer all-reduced, divided by the world size, and an
// inf/NaN verdict read on the host. At world size 1 NCCL's in-place all-reduce moves no data, so
// `flat` alone times only a launch and a wait; this is the baseline that does the same work.
void cuda_flat_checked(benchmark::State& state) {
  auto buffer = torch::full({bytes_of(resnet50_sizes()) / 4}, 1e-3f, torch::TensorOptions().device(torch::kCUDA, 0));
  const double world = g_nccl->world_size();
  auto step = [&] {
    g_nccl->all_reduce(buffer, loom::ReduceOp::sum);
    buffer.div_(world);
    if (!at::isfinite(buffer).all().item<bool>()) state.SkipWithError("non-finite gradient");
  };
  step();
  for (auto _ : state) step();
}

void cuda_loom(benchmark::State& state) {
  auto params = cuda_tensors(true, 0.5f);
  loom::Reducer reducer(*g_nccl, {.params = params}, {.average = loom::Average::world_size});
  reducer.prepare_backward({.sync = false});
  for (auto& p : params) p.mutable_grad().fill_(1e-3f);
  auto step = [&] {
    reducer.prepare_backward({.sync = true, .window_samples = 32});
    reducer.mark_all_ready();
    reducer.finish_window();
  };
  step();
  step();
  for (auto _ : state) step();
}

void cuda_backward_only(benchmark::State& state) {
  auto params = cuda_tensors(true, 0.5f), grads = cuda_tensors(false, 1e-3f);
  g_source = &grads;
  auto step = [&] {
    GradSource::apply(at::TensorList(params)).backward();
    torch::cuda::synchronize();
  };
  step();
  for (auto _ : state) step();
}

void cuda_loom_hooks(benchmark::State& state) {
  auto params = cuda_tensors(true, 0.5f), grads = cuda_tensors(false, 1e-3f);
  g_source = &grads;
  loom::Reducer reducer(*g_nccl, {.params = params}, {.average = loom::Average::world_size});
  auto step = [&] {
    reducer.prepare_backward({.sync = true, .window_samples = 32});
    GradSource::apply(at::TensorList(params)).backward();
    reducer.finish_window();
  };
  step();
  step();
  for (auto _ : state) step();
}

int run_cuda(int argc, char** argv) {
  // Without a usable GPU there is nothing to measure: say why and exit 77 (skipped).
  const auto probe = loom::cuda::probe_devices();
  if (probe.count == 0) {
    std::fprintf(stderr, "bench_reduce --cuda: no CUDA device (%s)\n", probe.reason.c_str());
    return 77;
  }
  auto store = c10::make_intrusive<c10d::HashStore>();
  loom::NcclCommunicator comm(*store, 0, 1, {.device = 0, .timeout = std::chrono::seconds(120)});
  g_nccl = &comm;
  using Fn = void (*)(benchmark::State&);
  const std::vector<std::pair<const char*, Fn>> all = {{"cuda_resnet50/flat", &cuda_flat},
                                                       {"cuda_resnet50/flat_checked", &cuda_flat_checked},
                                                       {"cuda_resnet50/loom", &cuda_loom},
                                                       {"cuda_resnet50/backward_only", &cuda_backward_only},
                                                       {"cuda_resnet50/loom_hooks", &cuda_loom_hooks}};
  for (const auto& [name, fn] : all)
    benchmark::RegisterBenchmark(name, fn)->Iterations(20)->Repetitions(7)->UseRealTime()->Unit(
        benchmark::kMillisecond);
  std::vector<char*> cargs{argv[0]};
  for (int i = 2; i < argc; ++i) cargs.push_back(argv[i]);
  std::string interleave = "--benchmark_enable_random_interleaving=true";
  cargs.push_back(interleave.data());
  int ac = static_cast<int>(cargs.size());
  benchmark::Initialize(&ac, cargs.data());
  benchmark::AddCustomContext("libtorch", TORCH_VERSION);  // which LibTorch the anchors ran on
  RatioReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();
  std::printf("\n");
  // At world size 1 `flat` moves no data (see cuda_flat_checked): its ratio is reported without a goal.
  print_ratio(reporter.times, "cuda_loom_vs_flat_checked", "cuda_resnet50/flat_checked", "cuda_resnet50/loom", 0.9);
  print_ratio(reporter.times, "cuda_loom_vs_flat", "cuda_resnet50/flat", "cuda_resnet50/loom", -1);
  print_ratio(reporter.times, "cuda_hooks_time_over_backward", "cuda_resnet50/loom_hooks",
              "cuda_resnet50/backward_only", -1);
  g_nccl = nullptr;
  return 0;
}

}  // namespace
#endif

int main(int argc, char** argv) {
  std::vector<std::string> args(argv, argv + argc);
  if (argc == 2 && args[1].rfind("--overhead=", 0) == 0) return run_overhead(args[1].substr(11));
  if (argc == 2 && args[1] == "--zero-memory") return run_zero_memory();
  if (argc >= 2 && args[1] == "--cuda") {
#if LOOM_HAS_NCCL && LOOM_TORCH_HAS_CUDA
    return run_cuda(argc, argv);
#else
    std::fprintf(stderr, "bench_reduce --cuda: this build has no NCCL with a CUDA LibTorch\n");
    return 77;
#endif
  }
  loom::spawn(
      kWorld,
      [&](const loom::Environment& env) {
        auto store = loom::rendezvous(env, {.timeout = std::chrono::seconds(300)});
        loom::GlooCommunicator comm(store, env.rank, env.world_size,
                                    {.timeout = std::chrono::seconds(300), .check_metadata = false}, env.master_addr);
        loom::GlooCommunicator comm_off(
            store, env.rank, env.world_size,
            {.timeout = std::chrono::seconds(300), .check_metadata = false, .flight_recorder = false}, env.master_addr);
        g_comm = &comm;
        g_comm_off = &comm_off;
        if (env.rank == 0) {
          // Defaults for a noisy machine: 11 repetitions in random interleaving (every variant and size
          // alternates, so a burst of load hits all of them); the ratios pair repetition i of each.
          std::vector<char*> cargs;
          for (auto& a : args) cargs.push_back(a.data());
          std::string reps = "--benchmark_repetitions=11", interleave = "--benchmark_enable_random_interleaving=true";
          for (auto* flag : {&reps, &interleave}) {
            const std::string name = flag->substr(0, flag->find('='));
            bool given = false;
            for (const auto& a : args) given = given || a.rfind(name, 0) == 0;
            if (!given) cargs.insert(cargs.begin() + 1, flag->data());
          }
          int ac = static_cast<int>(cargs.size());
          benchmark::Initialize(&ac, cargs.data());
          benchmark::AddCustomContext("libtorch", TORCH_VERSION);  // which LibTorch the anchors ran on
          register_all();
          RatioReporter reporter;
          benchmark::RunSpecifiedBenchmarks(&reporter);
          benchmark::Shutdown();
          exchange_command(-1, 0);
          print_ratios(reporter.times);
        } else {
          serve();
        }
        g_variants.clear();
        g_comm = nullptr;
        g_comm_off = nullptr;
      },
      {.timeout = std::chrono::hours(2)});
  return 0;
}
