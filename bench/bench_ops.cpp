// bench_ops — ATen operators loom dispatches per optimizer step beyond the plain LibTorch loop.
//
// On a GPU every dispatched operator is at least one kernel launch and some host work, so the
// operators loom adds to a step are its cost there even when the CPU hides them. This program
// counts them exactly, with a global at::RecordFunction callback (function scope, every operator
// the training thread dispatches, nested ones included), on the same batches for:
//   plain   `loss.backward(); opt.step(); opt.zero_grad();`, one rank, no loom
//   loom    loom::Trainer (one micro-batch per step, the batch mean loss) over the same model
// Models: L layers of torch::nn::Linear(32, 32), so 2L parameter tensors: 160, 320, 640, 1,280.
// Modes: the reducer's float mode (default) and ReducerOptions::deterministic, each on its CPU path
// (host loops, invisible to this count) and on its device path forced onto CPU tensors
// (loom::detail::DevicePathOnCpu: the ATen operators a GPU runs, each at least one kernel launch).
// World sizes: 1 (loom::LocalCommunicator) and 2 (two processes on loopback over Gloo, loom::spawn;
// the collectives' own operators, c10d::* and what they dispatch, are not counted: they are the
// all-reduce every data-parallel loop pays).
// Counted: the 20 steps after the first (the first builds buckets, the second rebuilds them);
// a step = next batch, forward, loss, loom's backward (reduction, optimizer step, zero_grad).
//
// Kernels: leaf operators (they dispatch no other operator: where the work runs) that move or
// compute elements; views, metadata and allocations are not (they cost host time only), nor is a
// composite operator (aten::to, aten::isfinite), whose leaves are counted instead.
// Host reads: per step, aten::_local_scalar_dense calls beyond the plain loop's (each .item(); on a
// GPU each waits for the stream) and the reducer's own reads (Reducer::host_reads(): the copies of
// its summary to the host).
// `bench_ops --cuda`: the same counts on the GPU (world size 1 over NCCL, no forced path: CUDA
// tensors take the device path), for scripts/device-check.sh; exit 77 without a GPU.
// Output: a table of operators per step, then one line per case that scripts read:
//   OPS <mode>/<path>/ws:<W>/params:<N> plain=<p> loom=<l> extra=<l - p> kernels_extra=<k>
//       kernels_fixed=<k - N> items_extra=<i> reducer_reads=<r> goal<=40 met|NOT-met
// The goal (issue 48) applies to extra, every operator. kernels_fixed leaves out one kernel per
// parameter tensor: autograd's AccumulateGrad adds each gradient into its bucket view (DDP's
// gradient_as_bucket_view does the same), where the plain loop's AccumulateGrad takes the
// gradient tensor without a kernel (its aten::detach calls are what make extra negative).
// `bench_ops --names` adds, per case, the operators loom dispatched more often than the plain loop
// (name: extra calls per step). Exact counts: they do not depend on the machine's load.
// Run: build-dir/bench/bench_ops [--cuda] [--names] [--params=160,320,...]
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <ATen/record_function.h>
#include <fmt/format.h>
#include <torch/torch.h>

#include <loom/comm/gloo.hpp>
#include <loom/config.hpp>
#if LOOM_HAS_NCCL && LOOM_TORCH_HAS_CUDA
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <loom/comm/nccl.hpp>
#include <loom/cuda/device.hpp>
#endif
#include <loom/comm/local.hpp>
#include <loom/launch/spawn.hpp>
#include <loom/reduce/detail/host_path.hpp>
#include <loom/reduce/module.hpp>
#include <loom/train/trainer.hpp>

namespace {

constexpr int64_t kWidth = 32;
constexpr int64_t kBatch = 8;
constexpr int64_t kCounted = 20;  // steps counted, after one uncounted step

// ---- the counter -------------------------------------------------------------------------------

/// Counts the operators the counting thread dispatches while it is on, by name, and the kernels:
/// operators that dispatch no operator themselves (leaves, where the work runs) and are not
/// host-only (is_host_only). Operators inside a c10d collective (c10d::*) are left out with it.
struct OpCounter {
  std::mutex mutex;
  std::map<std::string, int64_t> by_name;
  int64_t total = 0;
  int64_t kernels = 0;
  static std::atomic<bool> on;  // every thread: CUDA's backward runs on autograd's device thread
  static thread_local int in_collective;
  static thread_local std::vector<char> had_child;  // per open operator: whether it dispatched another

  void reset() {
    std::lock_guard lk(mutex);
    by_name.clear();
    total = 0;
    kernels = 0;
  }
};
std::atomic<bool> OpCounter::on{false};
thread_local int OpCounter::in_collective = 0;
thread_local std::vector<char> OpCounter::had_child;

OpCounter& counter() {
  static OpCounter c;
  return c;
}

/// Whether operator `name` launches no kernel on a GPU (see the file comment).
bool is_host_only(const std::string& name) {
  static const std::set<std::string> host_only{"aten::view",
                                               "aten::reshape",
                                               "aten::_reshape_alias",
                                               "aten::as_strided",
                                               "aten::narrow",
                                               "aten::slice",
                                               "aten::select",
                                               "aten::detach",
                                               "detach",
                                               "aten::alias",
                                               "aten::set_",
                                               "aten::empty",
                                               "aten::empty_strided",
                                               "aten::empty_like",
                                               "aten::t",
                                               "aten::transpose",
                                               "aten::expand",
                                               "aten::unsqueeze",
                                               "aten::squeeze",
                                               "aten::permute",
                                               "aten::is_same_size",
                                               "aten::resize_",
                                               "aten::to",
                                               "aten::lift_fresh",
                                               "aten::_unsafe_view",
                                               "aten::view_as",
                                               "aten::contiguous",
                                               "aten::numpy_T",
                                               "aten::flatten",
                                               "aten::result_type",
                                               "aten::_has_compatible_shallow_copy_type",
                                               "aten::requires_grad_",
                                               "aten::expand_as"};
  return host_only.count(name) > 0 || name.rfind("autograd::", 0) == 0;
}

bool is_collective(const char* name) {
  return std::string_view(name).rfind("c10d::", 0) == 0;
}

/// Marks an open operator on the counting thread (the stack pairs each enter with its exit).
struct OpenOp : at::ObserverContext {};

std::unique_ptr<at::ObserverContext> on_enter(const at::RecordFunction& fn) {
  if (!OpCounter::on) return nullptr;
  const char* name = fn.name();
  if (is_collective(name)) {
    ++OpCounter::in_collective;
    return nullptr;
  }
  if (OpCounter::in_collective > 0) return nullptr;
  if (!OpCounter::had_child.empty()) OpCounter::had_child.back() = 1;
  OpCounter::had_child.push_back(0);
  auto& c = counter();
  std::lock_guard lk(c.mutex);
  ++c.by_name[name];
  ++c.total;
  return std::make_unique<OpenOp>();
}

void on_exit(const at::RecordFunction& fn, at::ObserverContext* ctx) {
  if (is_collective(fn.name())) {
    if (OpCounter::in_collective > 0) --OpCounter::in_collective;
    return;
  }
  if (ctx == nullptr || OpCounter::had_child.empty()) return;  // not counted on entry
  const bool leaf = OpCounter::had_child.back() == 0;
  OpCounter::had_child.pop_back();
  if (leaf && !is_host_only(fn.name())) {
    auto& c = counter();
    std::lock_guard lk(c.mutex);
    ++c.kernels;
  }
}

void install_counter() {
  static const bool installed = [] {
    at::addGlobalCallback(at::RecordFunctionCallback(on_enter, on_exit).scopes({at::RecordScope::FUNCTION}));
    return true;
  }();
  (void)installed;
}

// ---- model and data ----------------------------------------------------------------------------

struct Net : torch::nn::Module {
  std::vector<torch::nn::Linear> layers;
  explicit Net(int64_t n) {
    for (int64_t i = 0; i < n; ++i)
      layers.push_back(register_module(fmt::format("l{}", i), torch::nn::Linear(kWidth, kWidth)));
  }
  at::Tensor forward(at::Tensor x) {
    for (auto& l : layers) x = l->forward(x);
    return x;
  }
};

/// Where models and batches live: the CPU, or cuda:0 (--cuda).
c10::Device g_device = c10::kCPU;

struct Data {
  std::vector<at::Tensor> x, y;
  explicit Data(int64_t steps, int rank) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(11 + rank);
    for (int64_t k = 0; k < steps; ++k) {
      x.push_back(at::randn({kBatch, kWidth}, gen).mul(0.1).to(g_device));
      y.push_back(at::randn({kBatch, kWidth}, gen).mul(0.1).to(g_device));
    }
  }
};

/// One batch per step, each the last of its step (a BatchSource).
struct StepSource {
  const Data* data;
  int64_t k = 0;
  void begin_epoch(int64_t /*epoch*/) { k = 0; }
  std::optional<loom::Batch> next() {
    if (k >= static_cast<int64_t>(data->x.size())) return std::nullopt;
    loom::Batch b;
    b.data = data->x[static_cast<std::size_t>(k)];
    b.targets = data->y[static_cast<std::size_t>(k)];
    b.indices.resize(kBatch);
    b.num_samples = kBatch;
    b.step_end = true;
    b.step = k++;
    return b;
  }
};

at::Tensor loss_of(Net& net, const at::Tensor& x, const at::Tensor& y) {
  return (net.forward(x) - y).pow(2).mean();
}

struct Counts {
  double per_step = 0;
  double kernels_per_step = 0;
  double items_per_step = 0;          // aten::_local_scalar_dense
  double reducer_reads_per_step = 0;  // Reducer::host_reads().total
  std::map<std::string, int64_t> by_name;
};

Counts take_counts(int64_t reducer_reads = 0) {
  auto& c = counter();
  std::lock_guard lk(c.mutex);
  const int64_t kernels = c.kernels;
  const auto items = c.by_name.count("aten::_local_scalar_dense") ? c.by_name.at("aten::_local_scalar_dense") : 0;
  return {static_cast<double>(c.total) / kCounted, static_cast<double>(kernels) / kCounted,
          static_cast<double>(items) / kCounted, static_cast<double>(reducer_reads) / kCounted, c.by_name};
}

Counts count_plain(int64_t layers, int rank) {
  torch::manual_seed(5);
  Net net(layers);
  net.to(g_device);
  torch::optim::SGD opt(net.parameters(), torch::optim::SGDOptions(0.01));
  const Data data(kCounted + 1, rank);
  counter().reset();
  for (int64_t k = 0; k <= kCounted; ++k) {
    OpCounter::on = k >= 1;
    auto loss = loss_of(net, data.x[static_cast<std::size_t>(k)], data.y[static_cast<std::size_t>(k)]);
    loss.backward();
    opt.step();
    opt.zero_grad();
    OpCounter::on = false;
  }
  return take_counts();
}

template <class Comm>
Counts count_loom(Comm& comm, int64_t layers, bool deterministic, bool device_path) {
  std::optional<loom::detail::DevicePathOnCpu> forced;
  if (device_path) forced.emplace();
  torch::manual_seed(5);
  Net net(layers);
  net.to(g_device);
  torch::optim::SGD opt(net.parameters(), torch::optim::SGDOptions(0.01));
  const Data data(kCounted + 1, comm.rank());
  StepSource source{&data};
  loom::Trainer trainer(comm, net, opt, {.reducer = {.deterministic = deterministic}});
  counter().reset();
  int64_t reads_before = 0, reads_after = 0;
  for (loom::Batch& b : trainer.epoch(source, 0)) {
    OpCounter::on = b.step >= 1;
    if (b.step == 1) reads_before = trainer.reducer().host_reads().total;
    trainer.backward(loss_of(net, b.data, b.targets), b);
    if (b.step == kCounted) {
      OpCounter::on = false;
      reads_after = trainer.reducer().host_reads().total;
    }
  }
  OpCounter::on = false;
  return take_counts(reads_after - reads_before);
}

struct Row {
  std::string mode;
  int world = 1;
  int64_t params = 0;
  double plain = 0, loom = 0, plain_kernels = 0, loom_kernels = 0, items_extra = 0, reducer_reads = 0;
  std::map<std::string, double> extra_names;
};

struct Case {
  bool deterministic = false;
  bool device_path = false;
  [[nodiscard]] std::string name() const {
    return fmt::format("{}/{}", deterministic ? "deterministic" : "float", device_path ? "device_path" : "cpu_path");
  }
};

const std::vector<Case>& cases() {
  static const std::vector<Case> c{{false, false}, {false, true}, {true, false}, {true, true}};
  return c;
}

Row make_row(const std::string& mode, int world, int64_t params, const Counts& plain, const Counts& loom) {
  Row r{mode,
        world,
        params,
        plain.per_step,
        loom.per_step,
        plain.kernels_per_step,
        loom.kernels_per_step,
        loom.items_per_step - plain.items_per_step,
        loom.reducer_reads_per_step,
        {}};
  for (const auto& [name, n] : loom.by_name) {
    const auto it = plain.by_name.find(name);
    const int64_t p = it == plain.by_name.end() ? 0 : it->second;
    if (n != p) r.extra_names[name] = static_cast<double>(n - p) / kCounted;
  }
  for (const auto& [name, p] : plain.by_name)
    if (!loom.by_name.count(name)) r.extra_names[name] = -static_cast<double>(p) / kCounted;
  return r;
}

void print(const std::vector<Row>& rows, bool names) {
  std::printf("%-26s %5s %7s %10s %10s %8s %14s %12s %14s\n", "mode/path", "world", "params", "plain/step", "loom/step",
              "extra", "kernels_extra", "items_extra", "reducer_reads");
  for (const auto& r : rows)
    std::printf("%-26s %5d %7lld %10.1f %10.1f %8.1f %14.1f %12.2f %14.2f\n", r.mode.c_str(), r.world,
                static_cast<long long>(r.params), r.plain, r.loom, r.loom - r.plain, r.loom_kernels - r.plain_kernels,
                r.items_extra, r.reducer_reads);
  std::printf("\n");
  for (const auto& r : rows) {
    const double extra = r.loom - r.plain;
    std::printf(
        "OPS %s/ws:%d/params:%lld plain=%.1f loom=%.1f extra=%.1f kernels_extra=%.1f kernels_fixed=%.1f "
        "items_extra=%.2f reducer_reads=%.2f goal<=40 %s\n",
        r.mode.c_str(), r.world, static_cast<long long>(r.params), r.plain, r.loom, extra,
        r.loom_kernels - r.plain_kernels, r.loom_kernels - r.plain_kernels - static_cast<double>(r.params),
        r.items_extra, r.reducer_reads, extra <= 40.0 ? "met" : "NOT-met");
    if (names)
      for (const auto& [name, n] : r.extra_names) std::printf("    %-48s %+8.2f\n", name.c_str(), n);
  }
}

std::vector<int64_t> parse_params(const std::string& s) {
  std::vector<int64_t> v;
  std::size_t pos = 0;
  while (pos < s.size()) {
    const std::size_t end = s.find(',', pos);
    v.push_back(std::stoll(s.substr(pos, end == std::string::npos ? std::string::npos : end - pos)));
    if (end == std::string::npos) break;
    pos = end + 1;
  }
  for (int64_t p : v)
    if (p < 2 || p % 2 != 0)
      throw std::invalid_argument(fmt::format("bench_ops: --params {} is not an even count >= 2", p));
  return v;
}

}  // namespace

#if LOOM_HAS_NCCL && LOOM_TORCH_HAS_CUDA
/// --cuda: world size 1 over NCCL on cuda:0, float and deterministic.
int run_cuda(const std::vector<int64_t>& params, bool names) {
  const auto probe = loom::cuda::probe_devices();
  if (probe.count == 0) {
    std::fprintf(stderr, "bench_ops --cuda: no CUDA device (%s)\n", probe.reason.c_str());
    return 77;
  }
  g_device = c10::Device(c10::kCUDA, 0);
  auto store = c10::make_intrusive<c10d::HashStore>();
  loom::NcclCommunicator comm(*store, 0, 1, {.device = 0, .timeout = std::chrono::seconds(120)});
  std::vector<Row> rows;
  for (const bool det : {false, true})
    for (int64_t p : params)
      rows.push_back(make_row(fmt::format("{}/cuda", det ? "deterministic" : "float"), 1, p, count_plain(p / 2, 0),
                              count_loom(comm, p / 2, det, /*device_path=*/false)));
  print(rows, names);
  return 0;
}
#endif

int main(int argc, char** argv) {
  bool names = false;
  bool cuda = false;
  std::vector<int64_t> params{160, 320, 640, 1280};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--names")
      names = true;
    else if (a == "--cuda")
      cuda = true;
    else if (a.rfind("--params=", 0) == 0)
      params = parse_params(a.substr(9));
    else {
      std::fprintf(stderr, "usage: bench_ops [--cuda] [--names] [--params=160,320,640,1280]\n");
      return 2;
    }
  }
  at::set_num_threads(1);
  install_counter();
  if (cuda) {
#if LOOM_HAS_NCCL && LOOM_TORCH_HAS_CUDA
    return run_cuda(params, names);
#else
    std::fprintf(stderr, "bench_ops --cuda: this build has no NCCL with a CUDA LibTorch\n");
    return 77;
#endif
  }
  std::vector<Row> rows;
  loom::LocalCommunicator local;
  for (const Case& c : cases())
    for (int64_t p : params)
      rows.push_back(
          make_row(c.name(), 1, p, count_plain(p / 2, 0), count_loom(local, p / 2, c.deterministic, c.device_path)));
  // World size 2: rank 0 counts and reports; both ranks run the same loops.
  std::vector<Row> dist_rows;
  std::mutex rows_mutex;
  loom::spawn(2, [&](const loom::Environment& env) {
    at::set_num_threads(1);
    install_counter();
    loom::GlooCommunicator comm(env, {.timeout = std::chrono::seconds(120)});
    for (const Case& c : cases())
      for (int64_t p : params) {
        const Counts plain = count_plain(p / 2, env.rank);
        const Counts loom_counts = count_loom(comm, p / 2, c.deterministic, c.device_path);
        if (env.rank == 0) {
          std::lock_guard lk(rows_mutex);
          dist_rows.push_back(make_row(c.name(), 2, p, plain, loom_counts));
        }
      }
    if (env.rank == 0) {
      rows.insert(rows.end(), dist_rows.begin(), dist_rows.end());
      print(rows, names);
    }
  });
  return 0;
}
