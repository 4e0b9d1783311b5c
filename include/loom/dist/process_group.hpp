// loom/dist/process_group.hpp — ProcessGroup: the communicator a training loop asks for, with the
// backend picked from the device: NCCL on a GPU, Gloo on the CPU, any world size (1 included).
//
// Example:
//   loom::ProcessGroup pg(loom::Environment::from_env());   // or loom::run gives you one
//   auto t = torch::ones({4}, torch::TensorOptions().device(pg.device()));
//   pg.all_reduce(t, loom::ReduceOp::sum);                  // world_size() in every element
//
// Tensors handed to its collectives live on pg.device() (NCCL: the rank's GPU; else the CPU).
// Guide: docs/gpu.md#which-backend; launchers and timeouts: docs/launching.md.
// Source: torch.distributed.init_process_group(backend=...) and its "cuda:nccl,cpu:gloo" device
//         mapping; torchrun's LOCAL_RANK device convention.
#pragma once

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include <c10/core/Device.h>
#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <loom/comm/communicator.hpp>
#include <loom/comm/local.hpp>
#include <loom/config.hpp>
#include <loom/dist/elastic.hpp>
#include <loom/error.hpp>
#include <loom/launch/environment.hpp>
#include <loom/launch/rank_device.hpp>
#include <loom/launch/rendezvous.hpp>
#include <loom/trace/recorder.hpp>

#if LOOM_HAS_GLOO
#include <loom/comm/gloo.hpp>
#endif
#if LOOM_HAS_NCCL && LOOM_TORCH_HAS_CUDA
#define LOOM_PROCESS_GROUP_HAS_NCCL 1
#include <loom/comm/nccl.hpp>
#include <loom/cuda/device.hpp>
#else
#define LOOM_PROCESS_GROUP_HAS_NCCL 0
#endif

namespace loom {

/// Which communicator a ProcessGroup holds.
enum class Backend {
  automatic,  ///< NCCL on a GPU, else Gloo, else local (docs/gpu.md#which-backend)
  gloo,       ///< GlooCommunicator (CPU tensors over TCP)
  nccl,       ///< NcclCommunicator (one GPU per rank)
  local,      ///< LocalCommunicator (world size 1 only)
};

/// "automatic", "gloo", "nccl" or "local".
constexpr std::string_view to_string(Backend b) noexcept {
  switch (b) {
    case Backend::automatic: return "automatic";
    case Backend::gloo: return "gloo";
    case Backend::nccl: return "nccl";
    case Backend::local: return "local";
  }
  return "?";
}

/// Parses "auto" / "automatic", "gloo", "nccl", "local". Throws loom::ConfigError naming the text.
inline Backend parse_backend(std::string_view text) {
  if (text == "auto" || text == "automatic") return Backend::automatic;
  if (text == "gloo") return Backend::gloo;
  if (text == "nccl") return Backend::nccl;
  if (text == "local") return Backend::local;
  throw ConfigError(fmt::format("backend '{}' is not one of auto, gloo, nccl, local", text));
}

/// Options of ProcessGroup; use with designated initializers.
///
/// Example: `loom::ProcessGroupOptions{.backend = loom::Backend::gloo, .timeout = std::chrono::seconds(30)}`.
/// Units: timeout is wall-clock, per collective and for the rendezvous.
struct ProcessGroupOptions {
  Backend backend = Backend::automatic;  ///< which communicator (automatic: from the device)
  /// Bound on the rendezvous and every collective; unset: the environment variable LOOM_TIMEOUT
  /// (seconds, e.g. 600 or 2.5), else loom::kDefaultTimeout (300 s). See process_group_timeout.
  std::optional<std::chrono::milliseconds> timeout{};
  std::string interface {};  ///< Gloo: network interface (GlooOptions::interface)
  bool flight_recorder =
      true;  ///< keep a flight recorder (GlooOptions / NcclOptions::flight_recorder, docs/debugging.md)
  /// Set: the job goes on when ranks die (recover(), loom/dist/elastic.hpp, docs/elastic.md); the
  /// store must outlive every rank (loom::run / loom::spawn host it in a process of their own).
  std::optional<ElasticOptions> elastic{};
};

/// The timeout a ProcessGroup with `options` uses: options.timeout when set, else LOOM_TIMEOUT
/// (seconds, a number > 0; `env_value` stands for the variable, null when unset), else
/// loom::kDefaultTimeout.
/// Throws: loom::ConfigError naming LOOM_TIMEOUT's value when it is not a number of seconds > 0.
inline std::chrono::milliseconds process_group_timeout(const ProcessGroupOptions& options, const char* env_value) {
  if (options.timeout) return *options.timeout;
  if (env_value == nullptr || *env_value == '\0') return kDefaultTimeout;
  char* end = nullptr;
  errno = 0;
  const double seconds = std::strtod(env_value, &end);
  if (end == env_value || *end != '\0' || errno != 0 || !std::isfinite(seconds) || !(seconds > 0) ||
      seconds * 1000 > 1e15)
    throw ConfigError(
        fmt::format("LOOM_TIMEOUT='{}' is not a number of seconds > 0 (e.g. 600 or 2.5); it bounds the "
                    "rendezvous and every collective",
                    env_value));
  return std::chrono::milliseconds(static_cast<int64_t>(std::ceil(seconds * 1000)));
}

namespace detail {

/// `env` in a group rebuilt over survivors: rank `new_rank` of `nodes.size()` (nodes[i]: member i's
/// node), the local rank and size counted among the members on this node, the nodes renumbered
/// in order (a node whose ranks all died leaves no gap).
inline Environment environment_after(Environment env, int new_rank, const std::vector<int>& nodes) {
  const int mine = nodes[static_cast<std::size_t>(new_rank)];
  std::vector<int> distinct(nodes);
  std::sort(distinct.begin(), distinct.end());
  distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
  env.rank = new_rank;
  env.world_size = static_cast<int>(nodes.size());
  env.local_rank = static_cast<int>(std::count(nodes.begin(), nodes.begin() + new_rank, mine));
  env.local_world_size = static_cast<int>(std::count(nodes.begin(), nodes.end(), mine));
  env.node_rank = static_cast<int>(std::lower_bound(distinct.begin(), distinct.end(), mine) - distinct.begin());
  env.num_nodes = static_cast<int>(distinct.size());
  return env;
}

}  // namespace detail

/// A pending collective of any backend; models WorkHandle.
class ProcessGroupWork {
 public:
  using Variant = std::variant<CompletedWork
#if LOOM_HAS_GLOO
                               ,
                               GlooWork
#endif
#if LOOM_PROCESS_GROUP_HAS_NCCL
                               ,
                               NcclWork
#endif
                               >;
  explicit ProcessGroupWork(Variant w) : w_(std::move(w)) {}
  /// Blocks until the collective finished. Throws: the backend's TimeoutError / CommError.
  void wait() {
    std::visit([](auto& w) { w.wait(); }, w_);
  }
  [[nodiscard]] bool is_completed() const {
    return std::visit([](const auto& w) { return static_cast<bool>(w.is_completed()); }, w_);
  }

 private:
  Variant w_;
};

/// The job's communicator, backend chosen from the device. Models AsyncCommunicator. Move-only.
///
/// Example: `loom::ProcessGroup pg(env, {.backend = loom::Backend::gloo});`
/// Throws: loom::ConfigError (an unavailable backend, too few GPUs for the node's ranks), and the
///         backend's rendezvous / connect errors (loom::TimeoutError, loom::CommError).
/// Source: torch.distributed.init_process_group.
class ProcessGroup {
  template <class F>
  decltype(auto) visit(F&& f) {
    return std::visit(std::forward<F>(f), comm_);
  }
  template <class F>
  decltype(auto) visit(F&& f) const {
    return std::visit(std::forward<F>(f), comm_);
  }

 public:
  using Variant = std::variant<LocalCommunicator
#if LOOM_HAS_GLOO
                               ,
                               GlooCommunicator
#endif
#if LOOM_PROCESS_GROUP_HAS_NCCL
                               ,
                               NcclCommunicator
#endif
                               >;

  /// Joins the job `env` describes (rendezvous at MASTER_ADDR:MASTER_PORT unless world size 1).
  /// Throws: as ProcessGroup; loom::ConfigError for a bad LOOM_TIMEOUT (process_group_timeout).
  explicit ProcessGroup(const Environment& env, ProcessGroupOptions options = {})
      : env_(env),
        launch_env_(env),
        options_(with_timeout(std::move(options))),
        backend_(resolve(env_, options_)),
        store_(elastic_store(env_, options_)),
        comm_(make(env_, options_, backend_, store_, env_)) {
    if (store_)
      membership_ = std::make_unique<detail::Membership>(store_, env_.rank, env_.world_size, *options_.elastic,
                                                         *options_.timeout);
  }

  ProcessGroup(ProcessGroup&&) noexcept = default;
  ProcessGroup& operator=(ProcessGroup&&) noexcept = default;
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  [[nodiscard]] int rank() const {
    return visit([](const auto& c) { return c.rank(); });
  }
  [[nodiscard]] int world_size() const {
    return visit([](const auto& c) { return c.world_size(); });
  }
  [[nodiscard]] std::chrono::milliseconds timeout() const {
    return visit([](const auto& c) { return c.timeout(); });
  }
  /// The device every tensor handed to this group's collectives must live on.
  [[nodiscard]] c10::Device device() const {
    return device_;
  }
  /// The backend in use (never Backend::automatic).
  [[nodiscard]] Backend backend() const noexcept {
    return backend_;
  }
  /// The job this group belongs to (rank, local rank, launcher, ...).
  [[nodiscard]] const Environment& environment() const noexcept {
    return env_;
  }
  /// The flight recorder of the held communicator (loom/trace/recorder.hpp), or nullptr when it keeps
  /// none (the one-process LocalCommunicator, or flight_recorder = false).
  [[nodiscard]] trace::FlightRecorder* flight_recorder() const noexcept {
    return visit([](auto& c) { return trace::recorder_of(c); });
  }
  /// Whether this group goes on when ranks die (ProcessGroupOptions::elastic, more than one rank).
  [[nodiscard]] bool elastic() const noexcept {
    return membership_ != nullptr;
  }
  /// The rank this process had when the job started (RANK); rank() is its rank in the current group.
  [[nodiscard]] int launch_rank() const noexcept {
    return launch_env_.rank;
  }
  /// How many times the group was rebuilt over survivors (0 before any recovery).
  [[nodiscard]] int generation() const noexcept {
    return membership_ ? membership_->generation() : 0;
  }

  /// After a collective failed: agrees with the other survivors on who is left (each passing its
  /// `progress`, see loom/dist/elastic.hpp), then replaces the broken communicator by one over the
  /// survivors (ranks renumbered in launch-rank order; a group whose rebuild fails agrees again).
  /// Every survivor calls it. `cause` is the error that brought it here (kept in the report).
  /// Example: `catch (const loom::CommError& e) { auto r = pg.recover(steps, e.what()); if (r.lost.empty()) throw; }`
  /// Throws: loom::Error when the group is not elastic; loom::CommError when fewer than
  ///         ElasticOptions::min_ranks are left (naming who died) or this rank was left out;
  ///         loom::TimeoutError when the agreement does not end within the timeout.
  Recovery recover(int64_t progress, const std::string& cause) {
    if (!membership_)
      throw Error(
          "ProcessGroup::recover: this group is not elastic (set ProcessGroupOptions::elastic, world size > 1)");
    const auto start = std::chrono::steady_clock::now();
    const std::vector<int> before = membership_->members();
    Recovery r;
    r.old_rank = rank();
    r.cause = cause.substr(0, cause.find('\n'));
    for (;;) {
      auto agreed = membership_->agree(progress, launch_env_.node_rank);
      const std::vector<int>& members = agreed.members;
      r.lost.clear();
      for (int m : before)
        if (std::find(members.begin(), members.end(), m) == members.end()) r.lost.push_back(m);
      r.members = members;
      r.progress = agreed.progress;
      r.nodes = agreed.nodes;
      r.generation = membership_->generation();
      const int min = membership_->options().min_ranks;
      if (static_cast<int>(members.size()) < min)
        throw CommError(fmt::format(
            "elastic: launch rank(s) {} died ({}); {} rank(s) are left, fewer than ElasticOptions::min_ranks = {}: "
            "the job ends here; resume it from its last checkpoint (loom::load_checkpoint)",
            detail::launch_ranks_text(r.lost), r.cause, members.size(), min));
      const int new_rank =
          static_cast<int>(std::find(members.begin(), members.end(), launch_env_.rank) - members.begin());
      const Environment next = detail::environment_after(env_, new_rank, agreed.nodes);
      try {
        auto prefixed =
            c10::make_intrusive<c10d::PrefixStore>(fmt::format("loom/elastic/comm/g{}", r.generation), store_);
        comm_ = make(next, options_, backend_, prefixed, launch_env_);
      } catch (const CommError&) {
        continue;  // a member died while the group was built: agree again (the same progress)
      }
      env_ = next;
      r.new_rank = new_rank;
      r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      return r;
    }
  }

  /// The communicator itself, for calls loom does not wrap: std::get<loom::GlooCommunicator>(pg.native()).
  [[nodiscard]] Variant& native() noexcept {
    return comm_;
  }

  void all_reduce(at::Tensor& t, ReduceOp op) {
    visit([&](auto& c) { c.all_reduce(t, op); });
  }
  [[nodiscard]] ProcessGroupWork all_reduce_async(at::Tensor& t, ReduceOp op) {
    return visit([&](auto& c) { return ProcessGroupWork(ProcessGroupWork::Variant(c.all_reduce_async(t, op))); });
  }
  void broadcast(at::Tensor& t, int root) {
    visit([&](auto& c) { c.broadcast(t, root); });
  }
  [[nodiscard]] std::vector<at::Tensor> all_gather(const at::Tensor& t) {
    return visit([&](auto& c) { return c.all_gather(t); });
  }
  void barrier() {
    visit([](auto& c) { c.barrier(); });
  }

  /// The backend `options.backend` resolves to for `env` on this machine (no connection made).
  /// Throws: loom::ConfigError when the backend asked for is not available.
  static Backend resolve(const Environment& env, const ProcessGroupOptions& options) {
    const bool gloo = LOOM_HAS_GLOO != 0;
    const bool nccl_built = LOOM_PROCESS_GROUP_HAS_NCCL != 0;
    switch (options.backend) {
      case Backend::automatic:
        if (nccl_built && cuda_device_count() > 0) return Backend::nccl;
        if (gloo) return Backend::gloo;
        if (env.world_size == 1) return Backend::local;
        throw ConfigError(
            fmt::format("ProcessGroup: world size {} needs Gloo or NCCL, and this build has neither "
                        "(install libgloo-dev and reconfigure)",
                        env.world_size));
      case Backend::gloo:
        if (!gloo)
          throw ConfigError("ProcessGroup: backend gloo asked for, but this build has no Gloo (install libgloo-dev)");
        return Backend::gloo;
      case Backend::nccl:
        if (!nccl_built)
          throw ConfigError(
              fmt::format("ProcessGroup: backend nccl asked for, but this build has {} (LOOM_HAS_NCCL={}, "
                          "LOOM_TORCH_HAS_CUDA={})",
                          LOOM_HAS_NCCL ? "a LibTorch without CUDA" : "no NCCL", LOOM_HAS_NCCL, LOOM_TORCH_HAS_CUDA));
        if (cuda_device_count() == 0)
          throw ConfigError("ProcessGroup: backend nccl asked for, but no CUDA device is visible");
        return Backend::nccl;
      case Backend::local:
        if (env.world_size != 1)
          throw ConfigError(fmt::format("ProcessGroup: backend local is for world size 1, not {}", env.world_size));
        return Backend::local;
    }
    return Backend::local;
  }

 private:
  static int cuda_device_count() {
#if LOOM_PROCESS_GROUP_HAS_NCCL
    return cuda::probe_devices().count;
#else
    return 0;
#endif
  }

  static ProcessGroupOptions with_timeout(ProcessGroupOptions o) {
    o.timeout = process_group_timeout(o, std::getenv("LOOM_TIMEOUT"));
    return o;
  }

  // An elastic group of more than one rank keeps the job's store (the agreement and each rebuilt
  // communicator use it); otherwise each communicator meets its peers by itself (null).
  static c10::intrusive_ptr<c10d::Store> elastic_store(const Environment& env, const ProcessGroupOptions& o) {
    if (!o.elastic || env.world_size == 1) return {};
    return rendezvous(env, {.timeout = *o.timeout});
  }

  // The communicator of backend `b` for `env`, through `store` when one is given; the GPU follows
  // `launch` (the job as it started: a rebuilt group keeps each rank's GPU).
  Variant make(const Environment& env, const ProcessGroupOptions& o, Backend b,
               const c10::intrusive_ptr<c10d::Store>& store, [[maybe_unused]] const Environment& launch) {
    switch (b) {
#if LOOM_HAS_GLOO
      case Backend::gloo: {
        device_ = c10::Device(c10::kCPU);
        GlooOptions gloo{.timeout = *o.timeout, .interface = o.interface, .flight_recorder = o.flight_recorder};
        if (store)
          return Variant(std::in_place_type<GlooCommunicator>, store, env.rank, env.world_size, gloo, env.master_addr);
        return Variant(std::in_place_type<GlooCommunicator>, env, gloo);
      }
#endif
#if LOOM_PROCESS_GROUP_HAS_NCCL
      case Backend::nccl: {
        const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
        const RankDevice d = rank_cuda_device(launch, cuda_device_count(), visible ? visible : "");
        device_ = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(d.ordinal));
        NcclOptions nccl{.device = d.ordinal, .timeout = *o.timeout, .flight_recorder = o.flight_recorder};
        if (store) return Variant(std::in_place_type<NcclCommunicator>, store, env.rank, env.world_size, nccl);
        return Variant(std::in_place_type<NcclCommunicator>, env, nccl);
      }
#endif
      default: device_ = c10::Device(c10::kCPU); return Variant(std::in_place_type<LocalCommunicator>, *o.timeout);
    }
  }

  Environment env_;         // the current group's (rank, world size, local rank, ... change after a recovery)
  Environment launch_env_;  // the job's as it started
  ProcessGroupOptions options_;
  Backend backend_;
  c10::Device device_{c10::kCPU};
  c10::intrusive_ptr<c10d::Store> store_;  // elastic only: the job's store
  Variant comm_;
  std::unique_ptr<detail::Membership> membership_;  // elastic only
};

static_assert(AsyncCommunicator<ProcessGroup>, "ProcessGroup must model loom::AsyncCommunicator");
static_assert(trace::TracedCommunicator<ProcessGroup>, "ProcessGroup must model loom::trace::TracedCommunicator");
static_assert(WorkHandle<ProcessGroupWork>);

}  // namespace loom
