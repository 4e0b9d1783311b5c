// bench_reduce — gradient reduction over Gloo, 2 ranks on loopback, every variant in one run.
//
// reduce_resnet50/*: the 161 parameter tensors of torchvision's ResNet-50 (25,557,032 float32
//   elements, 102.2 MB; shapes listed below), gradients already computed:
//     per_tensor   one blocking all-reduce (and divide) per gradient tensor: the naive loop
//     flat         one all-reduce of one preallocated flat buffer of the same bytes: the limit
//     loom         loom::Reducer (25 MiB buckets, 1 MiB first, averaging + inf/NaN scan) on
//                  gradients marked ready by hand (mark_all_ready), so only the reduction is timed
//   the same gradients delivered by a backward pass (a custom autograd function whose backward
//   returns them), so that a reducer driven by autograd hooks can be compared:
//     backward_only  the backward alone (AccumulateGrad adds into .grad): subtract it
//     loom_hooks     loom::Reducer launched from its hooks during that backward
//     ddp            c10d::Reducer (DistributedDataParallel's reducer; 25 MiB / 1 MiB buckets,
//                    gradient_as_bucket_view) driven the way DDP's Python wrapper drives it
// overlap_cnn/*: a small CNN's forward + backward + reduce step (batch 16 of 3x32x32, ~5.3 M
//   parameters, 4 MiB buckets), reduction after backward (ReducerOptions::overlap = false) vs
//   launched from hooks while backward runs.
//
// Method: loom::spawn starts 2 ranks; both run every benchmark with the same fixed iteration and
// repetition counts (the collectives must match), after one untimed warm-up step; rank 0
// reports wall time (real_time), algbw = bytes / time and busbw = algbw * 2(n-1)/n like
// nccl-tests, and a ratio table at the end. Nothing is allocated in the timed loops except what the
// variant itself allocates. One intra-op thread per rank. Run: build-dir/bench/bench_reduce.
//
// `bench_reduce --overhead=loom|hand` runs one of the two training loops compared by instruction
// count in scripts/callgrind_overhead.sh (one process, no benchmark framework).
#include <benchmark/benchmark.h>

#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/reducer.hpp>

#include <loom/accumulate/accumulator.hpp>
#include <loom/comm/gloo.hpp>
#include <loom/comm/local.hpp>
#include <loom/dist/spawn.hpp>
#include <loom/reduce/module.hpp>
#include <loom/reduce/reducer.hpp>
#include <loom/sample/global_batch.hpp>
#include <loom/train/loader.hpp>
#include <loom/train/trainer.hpp>

namespace {

struct Shape {
  const char* name;
  std::vector<std::int64_t> sizes;
};

// torchvision resnet50(): conv1, bn1, then bottleneck blocks [3, 4, 6, 3] of widths 64..512
// (conv1 1x1, conv2 3x3, conv3 1x1 expanding x4, a downsample in each layer's first block), fc.
const std::vector<Shape>& resnet50_shapes() {
  static const std::vector<Shape> shapes = {
    {"conv1.weight", {64, 3, 7, 7}}, {"bn1.weight", {64}}, {"bn1.bias", {64}},
    {"layer1.0.conv1.weight", {64, 64, 1, 1}}, {"layer1.0.bn1.weight", {64}}, {"layer1.0.bn1.bias", {64}},
    {"layer1.0.conv2.weight", {64, 64, 3, 3}}, {"layer1.0.bn2.weight", {64}}, {"layer1.0.bn2.bias", {64}},
    {"layer1.0.conv3.weight", {256, 64, 1, 1}}, {"layer1.0.bn3.weight", {256}}, {"layer1.0.bn3.bias", {256}},
    {"layer1.0.downsample.0.weight", {256, 64, 1, 1}}, {"layer1.0.downsample.1.weight", {256}}, {"layer1.0.downsample.1.bias", {256}},
    {"layer1.1.conv1.weight", {64, 256, 1, 1}}, {"layer1.1.bn1.weight", {64}}, {"layer1.1.bn1.bias", {64}},
    {"layer1.1.conv2.weight", {64, 64, 3, 3}}, {"layer1.1.bn2.weight", {64}}, {"layer1.1.bn2.bias", {64}},
    {"layer1.1.conv3.weight", {256, 64, 1, 1}}, {"layer1.1.bn3.weight", {256}}, {"layer1.1.bn3.bias", {256}},
    {"layer1.2.conv1.weight", {64, 256, 1, 1}}, {"layer1.2.bn1.weight", {64}}, {"layer1.2.bn1.bias", {64}},
    {"layer1.2.conv2.weight", {64, 64, 3, 3}}, {"layer1.2.bn2.weight", {64}}, {"layer1.2.bn2.bias", {64}},
    {"layer1.2.conv3.weight", {256, 64, 1, 1}}, {"layer1.2.bn3.weight", {256}}, {"layer1.2.bn3.bias", {256}},
    {"layer2.0.conv1.weight", {128, 256, 1, 1}}, {"layer2.0.bn1.weight", {128}}, {"layer2.0.bn1.bias", {128}},
    {"layer2.0.conv2.weight", {128, 128, 3, 3}}, {"layer2.0.bn2.weight", {128}}, {"layer2.0.bn2.bias", {128}},
    {"layer2.0.conv3.weight", {512, 128, 1, 1}}, {"layer2.0.bn3.weight", {512}}, {"layer2.0.bn3.bias", {512}},
    {"layer2.0.downsample.0.weight", {512, 256, 1, 1}}, {"layer2.0.downsample.1.weight", {512}}, {"layer2.0.downsample.1.bias", {512}},
    {"layer2.1.conv1.weight", {128, 512, 1, 1}}, {"layer2.1.bn1.weight", {128}}, {"layer2.1.bn1.bias", {128}},
    {"layer2.1.conv2.weight", {128, 128, 3, 3}}, {"layer2.1.bn2.weight", {128}}, {"layer2.1.bn2.bias", {128}},
    {"layer2.1.conv3.weight", {512, 128, 1, 1}}, {"layer2.1.bn3.weight", {512}}, {"layer2.1.bn3.bias", {512}},
    {"layer2.2.conv1.weight", {128, 512, 1, 1}}, {"layer2.2.bn1.weight", {128}}, {"layer2.2.bn1.bias", {128}},
    {"layer2.2.conv2.weight", {128, 128, 3, 3}}, {"layer2.2.bn2.weight", {128}}, {"layer2.2.bn2.bias", {128}},
    {"layer2.2.conv3.weight", {512, 128, 1, 1}}, {"layer2.2.bn3.weight", {512}}, {"layer2.2.bn3.bias", {512}},
    {"layer2.3.conv1.weight", {128, 512, 1, 1}}, {"layer2.3.bn1.weight", {128}}, {"layer2.3.bn1.bias", {128}},
    {"layer2.3.conv2.weight", {128, 128, 3, 3}}, {"layer2.3.bn2.weight", {128}}, {"layer2.3.bn2.bias", {128}},
    {"layer2.3.conv3.weight", {512, 128, 1, 1}}, {"layer2.3.bn3.weight", {512}}, {"layer2.3.bn3.bias", {512}},
    {"layer3.0.conv1.weight", {256, 512, 1, 1}}, {"layer3.0.bn1.weight", {256}}, {"layer3.0.bn1.bias", {256}},
    {"layer3.0.conv2.weight", {256, 256, 3, 3}}, {"layer3.0.bn2.weight", {256}}, {"layer3.0.bn2.bias", {256}},
    {"layer3.0.conv3.weight", {1024, 256, 1, 1}}, {"layer3.0.bn3.weight", {1024}}, {"layer3.0.bn3.bias", {1024}},
    {"layer3.0.downsample.0.weight", {1024, 512, 1, 1}}, {"layer3.0.downsample.1.weight", {1024}}, {"layer3.0.downsample.1.bias", {1024}},
    {"layer3.1.conv1.weight", {256, 1024, 1, 1}}, {"layer3.1.bn1.weight", {256}}, {"layer3.1.bn1.bias", {256}},
    {"layer3.1.conv2.weight", {256, 256, 3, 3}}, {"layer3.1.bn2.weight", {256}}, {"layer3.1.bn2.bias", {256}},
    {"layer3.1.conv3.weight", {1024, 256, 1, 1}}, {"layer3.1.bn3.weight", {1024}}, {"layer3.1.bn3.bias", {1024}},
    {"layer3.2.conv1.weight", {256, 1024, 1, 1}}, {"layer3.2.bn1.weight", {256}}, {"layer3.2.bn1.bias", {256}},
    {"layer3.2.conv2.weight", {256, 256, 3, 3}}, {"layer3.2.bn2.weight", {256}}, {"layer3.2.bn2.bias", {256}},
    {"layer3.2.conv3.weight", {1024, 256, 1, 1}}, {"layer3.2.bn3.weight", {1024}}, {"layer3.2.bn3.bias", {1024}},
    {"layer3.3.conv1.weight", {256, 1024, 1, 1}}, {"layer3.3.bn1.weight", {256}}, {"layer3.3.bn1.bias", {256}},
    {"layer3.3.conv2.weight", {256, 256, 3, 3}}, {"layer3.3.bn2.weight", {256}}, {"layer3.3.bn2.bias", {256}},
    {"layer3.3.conv3.weight", {1024, 256, 1, 1}}, {"layer3.3.bn3.weight", {1024}}, {"layer3.3.bn3.bias", {1024}},
    {"layer3.4.conv1.weight", {256, 1024, 1, 1}}, {"layer3.4.bn1.weight", {256}}, {"layer3.4.bn1.bias", {256}},
    {"layer3.4.conv2.weight", {256, 256, 3, 3}}, {"layer3.4.bn2.weight", {256}}, {"layer3.4.bn2.bias", {256}},
    {"layer3.4.conv3.weight", {1024, 256, 1, 1}}, {"layer3.4.bn3.weight", {1024}}, {"layer3.4.bn3.bias", {1024}},
    {"layer3.5.conv1.weight", {256, 1024, 1, 1}}, {"layer3.5.bn1.weight", {256}}, {"layer3.5.bn1.bias", {256}},
    {"layer3.5.conv2.weight", {256, 256, 3, 3}}, {"layer3.5.bn2.weight", {256}}, {"layer3.5.bn2.bias", {256}},
    {"layer3.5.conv3.weight", {1024, 256, 1, 1}}, {"layer3.5.bn3.weight", {1024}}, {"layer3.5.bn3.bias", {1024}},
    {"layer4.0.conv1.weight", {512, 1024, 1, 1}}, {"layer4.0.bn1.weight", {512}}, {"layer4.0.bn1.bias", {512}},
    {"layer4.0.conv2.weight", {512, 512, 3, 3}}, {"layer4.0.bn2.weight", {512}}, {"layer4.0.bn2.bias", {512}},
    {"layer4.0.conv3.weight", {2048, 512, 1, 1}}, {"layer4.0.bn3.weight", {2048}}, {"layer4.0.bn3.bias", {2048}},
    {"layer4.0.downsample.0.weight", {2048, 1024, 1, 1}}, {"layer4.0.downsample.1.weight", {2048}}, {"layer4.0.downsample.1.bias", {2048}},
    {"layer4.1.conv1.weight", {512, 2048, 1, 1}}, {"layer4.1.bn1.weight", {512}}, {"layer4.1.bn1.bias", {512}},
    {"layer4.1.conv2.weight", {512, 512, 3, 3}}, {"layer4.1.bn2.weight", {512}}, {"layer4.1.bn2.bias", {512}},
    {"layer4.1.conv3.weight", {2048, 512, 1, 1}}, {"layer4.1.bn3.weight", {2048}}, {"layer4.1.bn3.bias", {2048}},
    {"layer4.2.conv1.weight", {512, 2048, 1, 1}}, {"layer4.2.bn1.weight", {512}}, {"layer4.2.bn1.bias", {512}},
    {"layer4.2.conv2.weight", {512, 512, 3, 3}}, {"layer4.2.bn2.weight", {512}}, {"layer4.2.bn2.bias", {512}},
    {"layer4.2.conv3.weight", {2048, 512, 1, 1}}, {"layer4.2.bn3.weight", {2048}}, {"layer4.2.bn3.bias", {2048}},
    {"fc.weight", {1000, 2048}}, {"fc.bias", {1000}},
  };
  return shapes;
}

constexpr int kWorld = 2;
constexpr int kIterations = 5;
constexpr int kRepetitions = 3;
loom::GlooCommunicator* g_comm = nullptr;

std::vector<at::Tensor> make_tensors(bool requires_grad, float value) {
  std::vector<at::Tensor> out;
  for (const auto& s : resnet50_shapes()) {
    auto t = torch::full(s.sizes, value);
    out.push_back(requires_grad ? t.requires_grad_() : t);
  }
  return out;
}

std::int64_t resnet50_bytes() {
  std::int64_t n = 0;
  for (const auto& s : resnet50_shapes()) n += c10::multiply_integers(s.sizes);
  return n * 4;
}

void set_bandwidth(benchmark::State& state, std::int64_t bytes) {
  state.counters["bytes"] = static_cast<double>(bytes);
  state.counters["algbw_GBps"] = benchmark::Counter(static_cast<double>(bytes) * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["busbw_GBps"] = benchmark::Counter(static_cast<double>(bytes) * 1e-9 * 2.0 * (kWorld - 1) / kWorld,
                                                    benchmark::Counter::kIsIterationInvariantRate);
}

// ---- reduce_resnet50: gradients already computed -------------------------------------------

void per_tensor(benchmark::State& state) {
  auto grads = make_tensors(false, 1e-3f);
  auto step = [&] {
    for (auto& g : grads) {
      g_comm->all_reduce(g, loom::ReduceOp::sum);
      g.div_(kWorld);
    }
  };
  g_comm->barrier();
  step();
  for (auto _ : state) step();
  set_bandwidth(state, resnet50_bytes());
}

void flat(benchmark::State& state) {
  auto buffer = torch::full({resnet50_bytes() / 4}, 1e-3f);
  g_comm->barrier();
  g_comm->all_reduce(buffer, loom::ReduceOp::sum);
  for (auto _ : state) g_comm->all_reduce(buffer, loom::ReduceOp::sum);
  set_bandwidth(state, resnet50_bytes());
}

void loom_reducer(benchmark::State& state) {
  auto params = make_tensors(true, 0.5f);
  loom::Reducer reducer(*g_comm, {.params = params}, {.average = loom::Average::world_size});
  auto step = [&] {
    reducer.prepare_backward({.sync = true, .window_samples = 32});
    reducer.mark_all_ready();
    reducer.finish_window();
  };
  reducer.prepare_backward({.sync = false});  // gradients become bucket views
  for (auto& p : params) p.mutable_grad().fill_(1e-3f);
  g_comm->barrier();
  step();  // warm-up; also the one-time bucket rebuild
  step();
  for (auto _ : state) step();
  state.counters["buckets"] = static_cast<double>(reducer.bucket_params().size());
  set_bandwidth(state, resnet50_bytes());
}

// ---- the same gradients from a backward pass ---------------------------------------------------

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

void backward_only(benchmark::State& state) {
  auto params = make_tensors(true, 0.5f);
  auto grads = make_tensors(false, 1e-3f);
  g_source = &grads;
  auto step = [&] { GradSource::apply(at::TensorList(params)).backward(); };
  g_comm->barrier();
  step();
  for (auto _ : state) step();
  set_bandwidth(state, resnet50_bytes());
}

void loom_hooks(benchmark::State& state) {
  auto params = make_tensors(true, 0.5f);
  auto grads = make_tensors(false, 1e-3f);
  g_source = &grads;
  loom::Reducer reducer(*g_comm, {.params = params}, {.average = loom::Average::world_size});
  auto step = [&] {
    reducer.prepare_backward({.sync = true, .window_samples = 32});
    GradSource::apply(at::TensorList(params)).backward();
    reducer.finish_window();
  };
  g_comm->barrier();
  step();
  step();
  for (auto _ : state) step();
  set_bandwidth(state, resnet50_bytes());
}

void ddp(benchmark::State& state) {
  auto params = make_tensors(true, 0.5f);
  auto grads = make_tensors(false, 1e-3f);
  g_source = &grads;
  // As torch.nn.parallel.DistributedDataParallel (1.13) sets it up: assignment in parameter
  // order with [1 MiB, 25 MiB] caps, then buckets reversed.
  const std::vector<bool> sparse(params.size(), false);
  auto [indices, limits] = c10d::compute_bucket_assignment_by_size(params, {std::size_t{1} << 20, std::size_t{25} << 20}, sparse);
  std::reverse(indices.begin(), indices.end());
  std::reverse(limits.begin(), limits.end());
  std::unordered_map<std::size_t, std::string> names;
  for (std::size_t i = 0; i < params.size(); ++i) names[i] = resnet50_shapes()[i].name;
  auto reducer = std::make_unique<c10d::Reducer>(params, indices, limits, g_comm->process_group(), sparse,
                                                    /*bucket_bytes_cap=*/std::int64_t{25} << 20, /*find_unused_parameters=*/false,
                                                    /*gradient_as_bucket_view=*/true, names,
                                                    /*first_bucket_bytes_cap=*/std::int64_t{1} << 20);
  auto step = [&] {
    reducer->rebuild_buckets();
    reducer->prepare_for_forward();
    auto out = GradSource::apply(at::TensorList(params));
    reducer->prepare_for_backward({out});
    out.backward();  // DDP's hooks reduce; its end-of-backward callback waits for every bucket
  };
  g_comm->barrier();
  step();
  step();
  for (auto _ : state) step();
  set_bandwidth(state, resnet50_bytes());
}

// ---- overlap_cnn ------------------------------------------------------------------------------

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

void overlap_cnn(benchmark::State& state, bool overlap) {
  auto net = make_cnn();
  // 4 MiB buckets: fc1's 16 MiB gradient gets a bucket of its own that can leave before the
  // convolutions' gradients exist (with 25 MiB it would share one with them).
  loom::Reducer reducer(*g_comm, loom::parameters_of(*net), {.bucket_cap_bytes = 4 * loom::kMiB, .overlap = overlap});
  loom::Accumulator acc(reducer);
  auto x = torch::randn({16, 3, 32, 32});
  auto y = torch::randint(0, 10, {16});
  auto step = [&] {
    acc.run(16, [&] {
      torch::nn::functional::cross_entropy(net->forward(x), y, torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum))
          .backward();
    });
  };
  std::int64_t numel = 0;
  for (const auto& p : net->parameters()) numel += p.numel();
  g_comm->barrier();
  step();
  step();
  for (auto _ : state) step();
  state.counters["params"] = static_cast<double>(numel);
  state.counters["buckets"] = static_cast<double>(reducer.bucket_params().size());
}

// ---- reporting ----------------------------------------------------------------------------------

class NullReporter : public benchmark::BenchmarkReporter {
 public:
  bool ReportContext(const Context&) override { return true; }
  void ReportRuns(const std::vector<Run>&) override {}
};

// The console output plus the median real time (seconds per iteration) of each benchmark.
class RatioReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const auto& r : runs)
      if (r.run_type == Run::RT_Aggregate && r.aggregate_name == "median")
        median[r.run_name.function_name] = r.real_accumulated_time / static_cast<double>(r.iterations);
  }
  std::map<std::string, double> median;
};

void print_ratios(const std::map<std::string, double>& t) {
  auto get = [&](const char* name) {
    auto it = t.find(name);
    return it == t.end() ? 0.0 : it->second;
  };
  const double per = get("reduce_resnet50/per_tensor"), fl = get("reduce_resnet50/flat"), lo = get("reduce_resnet50/loom");
  const double bw = get("reduce_resnet50/backward_only"), hooks = get("reduce_resnet50/loom_hooks"), dd = get("reduce_resnet50/ddp");
  const double after = get("overlap_cnn/after_backward"), over = get("overlap_cnn/overlapped");
  std::printf("\nmedians (ms): per_tensor %.1f  flat %.1f  loom %.1f | backward_only %.1f  loom_hooks %.1f  ddp %.1f | cnn after %.1f  overlapped %.1f\n",
              per * 1e3, fl * 1e3, lo * 1e3, bw * 1e3, hooks * 1e3, dd * 1e3, after * 1e3, over * 1e3);
  if (lo > 0) {
    std::printf("loom speed-up over per_tensor      : %.2fx (goal >= 2)\n", per / lo);
    std::printf("loom speed relative to flat         : %.2fx (goal >= 0.9)\n", fl / lo);
  }
  if (hooks > 0) std::printf("loom_hooks speed relative to ddp    : %.2fx (goal >= 1; same backward in both)\n", dd / hooks);
  if (hooks > bw && dd > bw)
    std::printf("  reduction part (minus backward_only): loom %.1f ms, ddp %.1f ms -> %.2fx\n", (hooks - bw) * 1e3, (dd - bw) * 1e3,
                (dd - bw) / (hooks - bw));
  if (over > 0) std::printf("overlap_cnn: overlapped vs after_backward: %.2fx\n", after / over);
}

void register_all() {
  auto add = [](const char* name, auto fn) {
    benchmark::RegisterBenchmark(name, fn)
        ->Iterations(kIterations)
        ->Repetitions(kRepetitions)
        ->ReportAggregatesOnly(true)
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
  };
  add("reduce_resnet50/per_tensor", per_tensor);
  add("reduce_resnet50/flat", flat);
  add("reduce_resnet50/loom", loom_reducer);
  add("reduce_resnet50/backward_only", backward_only);
  add("reduce_resnet50/loom_hooks", loom_hooks);
  add("reduce_resnet50/ddp", ddp);
  add("overlap_cnn/after_backward", [](benchmark::State& s) { overlap_cnn(s, false); });
  add("overlap_cnn/overlapped", [](benchmark::State& s) { overlap_cnn(s, true); });
}

// ---- composition overhead under callgrind (scripts/callgrind_overhead.sh) ------------------------
//
// Both loops train the same MLP (128 -> 256 -> 10, float32, cross-entropy summed over 32 samples)
// for 40 micro-batches, an optimizer step every 4, on one process. The hand-written loop does the
// same tensor work as loom: gradients are views into one flat buffer, and at each boundary the
// buffer is divided by the sample count and scanned for inf/NaN with the same kernel
// (loom::detail::scale_and_check); what it leaves out is loom itself (hooks, buckets and flags,
// the sample-count collective on a LocalCommunicator, the accumulator's bookkeeping and Step).

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
  return torch::nn::functional::cross_entropy(net->forward(x), y, torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum));
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
        samples.emplace_back(d.xs[static_cast<std::size_t>(b)][r].clone(), d.ys[static_cast<std::size_t>(b)][r].item<std::int64_t>());
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
      : sampler(comm, d.shapes, kOverheadPlan), reducer(comm, loom::parameters_of(*net)), acc(reducer, {.micro_batches_per_step = 0}) {}
};

void lowlevel_epoch(torch::nn::Sequential& net, LowLevel& l, const OverheadSamples& d, torch::optim::SGD& sgd, std::int64_t epoch) {
  auto fetch = overhead_fetch(d);
  l.sampler.set_epoch(epoch);
  while (auto item = l.sampler.next()) {
    loom::Batch b = loom::collate_sampled(*item, fetch);
    auto mb = l.acc.micro_batch(b);
    mb.scale(mlp_mean_loss(net, b).reshape({}) * static_cast<double>(b.num_samples)).backward();
    const loom::Step step = mb.finish();
    if (step.apply) sgd.step();
    if (step.boundary) sgd.zero_grad();
  }
  while (auto s = l.acc.end_epoch()) {
    if (*s) sgd.step();
    sgd.zero_grad();
  }
}

}  // namespace

extern "C" __attribute__((noinline)) void loom_overhead_trainer_loop(torch::nn::Sequential& net, OverheadTrainer& trainer,
                                                                      OverheadLoader& loader) {
  trainer_epoch(net, trainer, loader, 1);
}

extern "C" __attribute__((noinline)) void loom_overhead_lowlevel_loop(torch::nn::Sequential& net, LowLevel& l,
                                                                       const OverheadSamples& d, torch::optim::SGD& sgd) {
  lowlevel_epoch(net, l, d, sgd, 1);
}


extern "C" __attribute__((noinline)) void loom_overhead_loom_loop(torch::nn::Sequential& net, OverheadData& data,
                                                                   loom::Accumulator<loom::Reducer<loom::LocalCommunicator>>& acc,
                                                                   torch::optim::SGD& sgd) {
  for (int i = kOverheadFirst; i < kOverheadFirst + kOverheadMicroBatches; ++i) {
    auto step = acc.run(32, [&] { mlp_loss(net, data.xs[i], data.ys[i]).backward(); });
    if (step) sgd.step();
    if (step.boundary) sgd.zero_grad();
  }
}

extern "C" __attribute__((noinline)) void loom_overhead_hand_loop(torch::nn::Sequential& net, OverheadData& data, at::Tensor& flat,
                                                                   torch::optim::SGD& sgd) {
  std::int64_t samples = 0;
  for (int i = kOverheadFirst; i < kOverheadFirst + kOverheadMicroBatches; ++i) {
    mlp_loss(net, data.xs[i], data.ys[i]).backward();
    samples += 32;
    if ((i + 1) % kOverheadK == 0) {
      const bool bad = loom::detail::scale_and_check(flat, static_cast<double>(samples), /*divide=*/true, /*check=*/true);
      if (!bad) sgd.step();
      sgd.zero_grad();
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
      if (step.boundary) sgd.zero_grad();
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
        sgd.zero_grad();
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
  } else {
    std::fprintf(stderr, "bench_reduce: --overhead=loom, hand, trainer or lowlevel\n");
    return 2;
  }
  for (const auto& p : net->parameters()) checksum += p.sum().item<double>();
  std::printf("overhead loop '%s' done; parameter checksum %.9g\n", which.c_str(), checksum);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv, argv + argc);
  if (argc == 2 && args[1].rfind("--overhead=", 0) == 0) return run_overhead(args[1].substr(11));
  loom::spawn(kWorld, [&](const loom::Environment& env) {
    std::vector<char*> argv_copy;
    for (auto& a : args) argv_copy.push_back(a.data());
    int argc_copy = static_cast<int>(argv_copy.size());
    benchmark::Initialize(&argc_copy, argv_copy.data());
    loom::GlooCommunicator comm(env, {.timeout = std::chrono::seconds(120), .check_metadata = false});
    g_comm = &comm;
    register_all();
    if (env.rank == 0) {
      RatioReporter reporter;
      benchmark::RunSpecifiedBenchmarks(&reporter);
      print_ratios(reporter.median);
    } else {
      NullReporter quiet;
      benchmark::RunSpecifiedBenchmarks(&quiet);
    }
    comm.barrier();
    g_comm = nullptr;
  }, {.timeout = std::chrono::minutes(20)});
  return 0;
}
