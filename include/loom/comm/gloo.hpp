// loom/comm/gloo.hpp — GlooCommunicator: a loom communicator over c10d's ProcessGroupGloo (CPU
// tensors over TCP; also CUDA tensors, staged through host memory by Gloo).
//
// One sentence: construct one GlooCommunicator per rank from the launcher environment (or from a
// rendezvous store), then call in-place collectives that either finish or throw a loom error within
// the timeout.
//
// Example:
//   auto env = loom::Environment::from_env();                  // torchrun / mpirun / srun / spawn
//   loom::GlooCommunicator comm(env, {.timeout = std::chrono::seconds(60)});
//   auto t = torch::full({4}, float(comm.rank()));
//   comm.all_reduce(t, loom::ReduceOp::sum);                   // every rank: n(n-1)/2 in each element
//   auto handle = comm.all_reduce_async(t, loom::ReduceOp::avg);
//   handle.wait();
//
// Shape: any shape; every rank passes the same shape and dtype. Dtypes: float32, float64, bfloat16,
//        float16, int32, int64. ProcessGroupGloo rejects bfloat16 ("Invalid scalar type", LibTorch 1.13
//        and the 2.x releases, pytorch/pytorch#111131): loom all-reduces a bfloat16 tensor in a float32
//        copy and rounds back once (at least as accurate as a bfloat16 sum; costs a conversion and twice
//        the bytes on the wire), and broadcasts / all-gathers its bytes as float16 (no arithmetic).
// avg: Gloo has no AVG; loom sums, then divides by world_size (integers: truncating division, like
//      ncclAvg).
// Metadata check (GlooOptions::check_metadata, on by default for the blocking calls): before each
//      blocking collective the ranks all-gather a 13-integer record (collective, dtype, reduce op or
//      root, numel, shape), so a dtype/shape/op/root mismatch or two ranks calling different
//      collectives is a loom::CommError naming each rank's tensor, not garbage or a hang. Cost: one
//      extra small collective per call (one small all-reduce's latency: docs/benchmarks.md). The
//      async call skips it unless check_async_metadata is set (a gradient reducer's hot path).
//      Every rank must use the same settings.
// Timeouts: a collective not finished within `timeout()` (a peer never called it) throws
//      loom::TimeoutError naming the collective, the rank and the seconds waited. A peer that exited
//      or crashed closes its connection and the survivors get a loom::CommError at once, "all_reduce
//      failed on rank 0: peer rank 1 closed its connection ..." (the collective can never complete;
//      no timeout was waited for). Gloo fails at once what it has queued on a connection that
//      ended, but not a receive whose message it was in the middle of reading (that one waits for
//      the timeout), so a wait also looks at this rank's Gloo connections every 50 ms: when Gloo
//      closed one and the collective still waits 1 s later, loom throws that CommError itself
//      (the second lets a collective whose data had all arrived end by itself). While other
//      connections stay open it waits longer, until no data arrived on them for a tenth of the
//      timeout (at least 1 s; a broadcast: until its peers are gone): a peer that finished the
//      collective and exited leaves the others to end it. The message names the peer ("peer rank 2")
//      when Gloo's error names one of this rank's connections (a closed or reset socket), or when
//      there is only one peer; a plain timeout in a larger job names no peer (Gloo does not say which
//      one was silent).
//      To read Gloo's socket addresses, construction ends with two small all-to-alls (64 bytes per
//      socket of the group; see loom/comm/detail/gloo_peers.hpp).
//      After a TimeoutError or CommError the communicator is broken: destroy it (c10d behaves the same).
//      A collective that fails also shuts down every connection of the communicator on this rank, so
//      the peers' pending collectives fail at once with an error naming this rank, rather than at
//      their timeout (loom/comm/detail/gloo_peers.hpp).
//      Destroying a broken communicator (a collective failed, abort(), or Gloo closed one of its
//      connections) while Gloo still runs one of its collectives 200 ms later
//      (such a receive waits until the timeout) does not destroy its process group, whose destructor
//      would join that worker thread: the group is left to the process, with its threads, its sockets
//      and its store connection (on the rank that hosts the store, the store itself and MASTER_PORT)
//      until the process exits; a new rendezvous in the same process then needs another MASTER_PORT.
// Construction: the Gloo device's address follows GlooOptions::interface's rule (GLOO_SOCKET_IFNAME,
//      loopback masters, the local address that routes to MASTER_ADDR when this host's name resolves
//      to loopback; loom/comm/detail/gloo_device.hpp). A rank whose construction fails writes its
//      error to the store; the others, which connect on a helper thread and look for such a report
//      every 20 ms through a second store connection, throw loom::CommError at once naming that rank
//      (loom/comm/detail/gloo_join.hpp). A helper left behind that way ends by itself, at its timeout
//      at the latest.
// SIGPIPE: constructing a GlooCommunicator sets SIGPIPE to SIG_IGN for the whole process when its
//      disposition is still the default (a handler the program installed is kept). Gloo writes to its
//      sockets without MSG_NOSIGNAL, so a write to a dead peer would otherwise kill the rank with
//      SIGPIPE instead of ending in the CommError above; this holds however the rank was started
//      (torchrun, mpirun and srun leave SIGPIPE at its default in a C++ rank; loom::spawn's ranks
//      keep the parent's setting, as an exec'd process would).
//      Consequence: a write to a closed pipe (`./train | head`) fails with EPIPE instead of killing
//      the program, as in every Python program.
//
// Flight recorder (GlooOptions::flight_recorder, on by default): every public collective is recorded
//      (loom/trace/recorder.hpp) with the loom part, step and micro-batch that issued it, and every
//      error above ends with the verdict of loom/comm/detail/trace_exchange.hpp: each live rank writes
//      its record file to GlooOptions::trace_folder and the error names the first rank that went its
//      own way. It keeps a watcher thread and a second store connection per communicator (one store
//      check per 100 ms), and installs a std::terminate handler for the process (it posts the dying
//      rank's record, then calls the handler it replaced). docs/debugging.md is the field guide.
// Throws: loom::InvalidArgument (undefined / non-contiguous / unsupported-dtype tensor, bad root),
//         loom::ConfigError (a network interface this host does not have), loom::CommError (backend
//         failure, metadata mismatch, a peer that failed to join, a peer that closed its connection),
//         loom::TimeoutError (see above).
// Source: c10d ProcessGroupGloo (torch.distributed's "gloo" backend); avg as ncclAvg; metadata
//         check like torch.distributed's TORCH_DISTRIBUTED_DEBUG=DETAIL collective fingerprints.
#pragma once

#include <loom/config.hpp>

// With no Gloo in the build, stop with one clear message (and compile nothing else, so no wall of
// errors follows it).
#if !LOOM_HAS_GLOO
#error \
    "loom/comm/gloo.hpp needs Gloo, but this build has LOOM_HAS_GLOO=0: install libgloo-dev (apt-get install libgloo-dev) and reconfigure (meson setup --reconfigure -Dgloo=enabled), or use loom::LocalCommunicator / NcclCommunicator instead."
#elif !defined(USE_C10D_GLOO)
#error \
    "loom/comm/gloo.hpp needs -DUSE_C10D_GLOO (LibTorch's c10d Gloo headers are empty without it); loom's Meson dependency adds it. Add -DUSE_DISTRIBUTED -DUSE_C10D_GLOO to your compile flags."
#else

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/intrusive_ptr.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <loom/comm/communicator.hpp>
#include <loom/comm/detail/gloo_connect.hpp>
#include <loom/comm/detail/gloo_group.hpp>
#include <loom/comm/detail/gloo_metadata.hpp>
#include <loom/comm/detail/gloo_peers.hpp>
#include <loom/comm/detail/gloo_work.hpp>
#include <loom/comm/detail/trace_exchange.hpp>
#include <loom/detail/exception_text.hpp>
#include <loom/detail/host_and_pid.hpp>
#include <loom/detail/process_counter.hpp>
#include <loom/error.hpp>
#include <loom/launch/environment.hpp>
#include <loom/launch/rendezvous.hpp>
#include <loom/trace/recorder.hpp>

namespace loom {

/// Options of GlooCommunicator; use with designated initializers.
///
/// Example: `loom::GlooOptions{.timeout = std::chrono::seconds(10), .check_metadata = false}`.
/// Units: `timeout` is wall-clock per collective (and for the rendezvous and the connect when
/// constructed from an Environment).
/// Interface rule (when `interface` is empty), first match wins: GLOO_SOCKET_IFNAME (a comma-separated
/// list); 127.0.0.1 when MASTER_ADDR is a loopback address; the local address that routes to
/// MASTER_ADDR when this host's name resolves to loopback (Debian's "127.0.1.1 <hostname>"); else the
/// address of this host's name (Gloo's default). See docs/launching.md.
struct GlooOptions {
  std::chrono::milliseconds timeout = kDefaultTimeout;  ///< bound on every collective and on rendezvous
  bool check_metadata = true;         ///< blocking calls: all-gather dtype/shape/op first (see header)
  bool check_async_metadata = false;  ///< all_reduce_async: the same check (it then blocks briefly)
  std::string interface {};           ///< network interface(s) for Gloo: "eth0" or "eth0,eth1"; empty: the
                                      ///< rule of loom/comm/detail/gloo_device.hpp (GLOO_SOCKET_IFNAME, loopback
                                      ///< master, route to MASTER_ADDR when the host name is loopback, host name)
  int threads = 2;                    ///< Gloo worker threads (async collectives run on them)
  bool flight_recorder = true;        ///< keep a flight recorder (docs/debugging.md); false: no record, no
                                      ///< verdict in errors, no watcher thread (benchmarks measure its cost)
  std::size_t trace_capacity = trace::FlightRecorder::kDefaultCapacity;  ///< flight-record entries kept
  std::string trace_folder{};  ///< where a failure writes the record files; empty: LOOM_TRACE_DIR,
                               ///< else "loom-trace" in the working folder (docs/debugging.md)
};

/// A communicator over c10d's ProcessGroupGloo. Models AsyncCommunicator; all_reduce_async returns a GlooWork.
///
/// Example: see the header comment.
/// Shape: collectives take one contiguous tensor of the same shape and dtype on every rank.
/// Throws: see the header comment.
/// Source: torch.distributed's gloo backend.
class GlooCommunicator {
 public:
  /// Rendezvous through `env` (rank 0 or torchrun's agent hosts the TCPStore), then connect Gloo.
  /// Throws: loom::TimeoutError("rendezvous", ...), and what the store constructor below throws.
  explicit GlooCommunicator(const Environment& env, GlooOptions options = {})
      : GlooCommunicator(rendezvous(env, {.timeout = options.timeout}), env.rank, env.world_size, options,
                         env.master_addr) {}

  /// Connect Gloo through an existing store shared by `world_size` ranks (e.g. from loom::rendezvous).
  /// `master_addr` only feeds the device rule (loopback, or the local address routing to it) when
  /// options.interface and GLOO_SOCKET_IFNAME are empty.
  /// Several communicators may share one store: each uses the prefix "loom/gloo/<n>", n counting the
  /// communicators of this process (create them in the same order on every rank).
  /// Throws: loom::InvalidArgument (rank outside [0, world_size)), loom::ConfigError (a network
  ///         interface this host does not have), loom::TimeoutError("connect", ...) when a peer does not
  ///         connect within the timeout, loom::CommError (a peer reported that it failed to join: at
  ///         once, naming it; or a backend failure).
  GlooCommunicator(c10::intrusive_ptr<c10d::Store> store, int rank, int world_size, GlooOptions options = {},
                   const std::string& master_addr = "127.0.0.1")
      : rank_(rank), world_size_(world_size), options_(std::move(options)) {
    if (world_size < 1 || rank < 0 || rank >= world_size)
      throw InvalidArgument(fmt::format("GlooCommunicator: rank {} is outside [0, world size {})", rank, world_size));
    if (!store) throw InvalidArgument("GlooCommunicator: the store is null");
    if (options_.threads < 1)
      throw InvalidArgument(fmt::format("GlooCommunicator: threads = {} (need >= 1)", options_.threads));
    detail::ignore_sigpipe_if_default();  // before Gloo opens a socket; see the header comment
    auto connection = detail::connect_gloo(std::move(store), rank, world_size, options_.interface, options_.threads,
                                           options_.timeout, master_addr);
    pg_ = detail::GlooGroup(std::move(connection.pg), connection.peers);
    peers_ = std::move(connection.peers);
    device_ = std::move(connection.device);
    if (!options_.flight_recorder) return;
    auto recorder =
        std::make_shared<trace::FlightRecorder>(rank, world_size, detail::host_and_pid(), options_.trace_capacity);
    std::weak_ptr<const detail::GlooPeerTable> peers = peers_;
    trace_ = std::make_shared<detail::TraceExchange>(
        recorder, std::move(connection.store), std::move(connection.side), options_.timeout, options_.trace_folder,
        [peers] {
          if (auto p = peers.lock()) p->shutdown_connections();
        },
        static_cast<int>(detail::next_in_process(detail::Counted::flight_recorder)));
    trace_->start_watcher();
    std::weak_ptr<detail::TraceExchange> weak = trace_;
    recorder->set_failure_handler([weak](const std::string& error) {
      auto t = weak.lock();
      return t ? t->on_failure(error) : std::string{};
    });
  }

  GlooCommunicator(GlooCommunicator&&) noexcept = default;
  GlooCommunicator& operator=(GlooCommunicator&&) noexcept = default;
  GlooCommunicator(const GlooCommunicator&) = delete;
  GlooCommunicator& operator=(const GlooCommunicator&) = delete;
  ~GlooCommunicator() = default;

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int world_size() const noexcept { return world_size_; }
  [[nodiscard]] std::chrono::milliseconds timeout() const noexcept { return options_.timeout; }
  [[nodiscard]] const GlooOptions& options() const noexcept { return options_; }
  /// Which address this rank's Gloo device uses and why (the rule of GlooOptions::interface), e.g.
  /// "198.18.0.2 (the local address that routes to MASTER_ADDR 198.18.0.1; ...)".
  [[nodiscard]] const std::string& device_description() const noexcept { return device_; }
  /// The CPU: where loom's parts allocate the tensors they hand to this communicator. (c10d's Gloo
  /// process group also accepts CUDA tensors when LibTorch was built with CUDA, staging them through
  /// host memory; Debian's LibTorch is CPU-only.)
  [[nodiscard]] c10::Device device() const noexcept { return c10::Device(c10::kCPU); }
  /// The underlying c10d process group (for c10d APIs loom does not wrap).
  [[nodiscard]] const c10::intrusive_ptr<c10d::ProcessGroupGloo>& process_group() const noexcept { return pg_.get(); }
  /// This communicator's flight recorder: the last GlooOptions::trace_capacity collectives, written
  /// to the trace folder on a failure (loom/trace/recorder.hpp, docs/debugging.md). Null when moved
  /// from or built with GlooOptions::flight_recorder = false.
  [[nodiscard]] trace::FlightRecorder* flight_recorder() const noexcept {
    return trace_ ? &trace_->recorder() : nullptr;
  }
  /// Where a failure writes the record files (GlooOptions::trace_folder's rule).
  [[nodiscard]] std::string trace_folder() const { return trace_ ? trace_->folder() : std::string{}; }
  /// Changes it; empty: the default rule (e.g. `comm.set_trace_folder(run_dir + "/loom-trace")`).
  void set_trace_folder(std::string folder) {
    if (trace_) trace_->set_folder(std::move(folder));
  }
  /// Which peer rank each of this rank's Gloo socket addresses belongs to (diagnostics, tests; see
  /// loom/comm/detail/gloo_peers.hpp). Empty (no connections) on a communicator of one rank.
  [[nodiscard]] const detail::GlooPeerTable* peer_table() const noexcept { return peers_.get(); }

  /// Breaks the communicator on purpose: shuts down every connection of this rank's Gloo process group,
  /// so every peer's pending and later collectives fail at once with a CommError naming this rank
  /// ("peer rank r closed its connection"), and this rank's own fail too. Safe from any thread at any
  /// time, e.g. from a watchdog or when this rank decides to stop (like NcclCommunicator::abort). A
  /// failing collective does the same by itself. Afterwards only destroying the communicator is legal.
  void abort() const noexcept {
    if (pg_) pg_.state()->broken = true;
    if (peers_) peers_->shutdown_connections();
  }

  /// In place: every rank ends with the reduction of `t` over ranks.
  /// Shape: same shape and dtype on every rank. Throws: see header.
  void all_reduce(at::Tensor& t, ReduceOp op) {
    detail::check_collective_tensor(t, "all_reduce");
    const std::int64_t seq = record(trace::Op::all_reduce, t);
    if (options_.check_metadata)
      check_metadata(t, detail::GlooCollective::all_reduce, static_cast<std::int64_t>(op), seq);
    start_all_reduce(t, op, seq).wait();
  }

  /// Starts an in-place all-reduce; `t` must stay alive and untouched until wait() returned.
  /// Throws (here): loom::InvalidArgument; (in wait) loom::TimeoutError / CommError.
  [[nodiscard]] GlooWork all_reduce_async(at::Tensor& t, ReduceOp op) {
    detail::check_collective_tensor(t, "all_reduce");
    const std::int64_t seq = record(trace::Op::all_reduce, t);
    if (options_.check_async_metadata)
      check_metadata(t, detail::GlooCollective::all_reduce, static_cast<std::int64_t>(op), seq);
    return start_all_reduce(t, op, seq);
  }

  /// In place: every rank ends with root's `t`. Throws: loom::InvalidArgument for a bad root.
  void broadcast(at::Tensor& t, int root) {
    detail::check_collective_tensor(t, "broadcast");
    detail::check_root(root, world_size_, "broadcast");
    const std::int64_t seq = record(trace::Op::broadcast, t);
    if (options_.check_metadata) check_metadata(t, detail::GlooCollective::broadcast, root, seq);
    // Broadcast moves bytes: a bfloat16 tensor Gloo does not know travels as float16 of the same size.
    std::vector<at::Tensor> tensors{detail::gloo_supports_dtype(t.scalar_type()) ? t : t.view(at::kHalf)};
    c10d::BroadcastOptions opts;
    opts.rootRank = root;
    opts.timeout = options_.timeout;
    make_work("broadcast", issue([&] { return pg_->broadcast(tensors, opts); }, "broadcast", seq), {}, seq).wait();
  }

  /// Returns world_size() tensors; entry r is rank r's `t`. Shape: each like `t`.
  [[nodiscard]] std::vector<at::Tensor> all_gather(const at::Tensor& t) {
    detail::check_collective_tensor(t, "all_gather");
    const std::int64_t seq = record(trace::Op::all_gather, t);
    if (options_.check_metadata) check_metadata(t, detail::GlooCollective::all_gather, 0, seq);
    return gather_unchecked(t, "all_gather", seq, true);
  }

  /// Returns once every rank entered the barrier. Throws: loom::TimeoutError.
  void barrier() {
    c10d::BarrierOptions opts;
    opts.timeout = options_.timeout;
    const std::int64_t seq = record(trace::Op::barrier, at::Tensor());
    make_work("barrier", issue([&] { return pg_->barrier(opts); }, "barrier", seq), {}, seq).wait();
  }

 private:
  /// The flight-record entry of a public call (-1 without a recorder).
  std::int64_t record(trace::Op op, const at::Tensor& t) noexcept {
    return trace_ ? trace_->recorder().issue(op, t) : -1;
  }

  /// Marks entry `seq` failed and returns the flight recorder's text for `message` (ends the error).
  std::string failure_text(std::int64_t seq, const std::string& message) {
    if (!trace_) return {};
    trace_->recorder().fail(seq);
    return trace_->on_failure(message);
  }

  template <class F>
  c10::intrusive_ptr<c10d::Work> issue(F&& f, const char* collective, std::int64_t seq) {
    if (!pg_) throw CommError(fmt::format("{}: the communicator was moved from", collective));
    try {
      return f();
    } catch (const std::exception& e) {
      const std::string message = fmt::format("{} could not start on rank {}/{}: {}", collective, rank_, world_size_,
                                              detail::exception_text(e));
      throw CommError(message + failure_text(seq, message));
    }
  }

  GlooWork make_work(const char* collective, c10::intrusive_ptr<c10d::Work> work, std::function<void()> finish,
                     std::int64_t seq, bool completes_entry = true) {
    if (pg_) detail::track_running(pg_.state(), work);
    GlooWork w(std::move(work), collective, rank_, world_size_, options_.timeout, std::move(finish), peers_,
               pg_ ? pg_.state() : nullptr, trace_, seq);
    w.state_->completes_entry = completes_entry;
    return w;
  }

  GlooWork start_all_reduce(at::Tensor& t, ReduceOp op, std::int64_t seq) {
    c10d::AllreduceOptions opts;
    opts.reduceOp = detail::to_c10d(op);
    opts.timeout = options_.timeout;
    at::Tensor target = t;
    bool staged = !detail::gloo_supports_dtype(t.scalar_type());
    if (staged) target = t.to(at::kFloat);
    std::vector<at::Tensor> tensors{target};
    auto work = issue([&] { return pg_->allreduce(tensors, opts); }, "all_reduce", seq);
    std::function<void()> finish;
    const int n = world_size_;
    if (op == ReduceOp::avg || staged) {
      finish = [t, target, staged, op, n]() mutable {
        if (op == ReduceOp::avg) {
          if (at::isIntegralType(target.scalar_type(), /*includeBool=*/false))
            target.div_(n, "trunc");
          else
            target.div_(n);
        }
        if (staged) t.copy_(target);
      };
    }
    return make_work("all_reduce", std::move(work), std::move(finish), seq);
  }

  /// All-gather without the metadata check; errors name `collective` (the user's call) and belong to
  /// flight-record entry `seq`, which its completion marks completed when `completes_entry`.
  std::vector<at::Tensor> gather_unchecked(const at::Tensor& t, const char* collective, std::int64_t seq,
                                           bool completes_entry) {
    // All-gather moves bytes: a bfloat16 tensor Gloo does not know travels as float16 of the same size.
    const bool as_half = !detail::gloo_supports_dtype(t.scalar_type());
    at::Tensor wire = as_half ? t.view(at::kHalf) : t;
    std::vector<std::vector<at::Tensor>> outputs(1);
    outputs[0].reserve(static_cast<std::size_t>(world_size_));
    for (int r = 0; r < world_size_; ++r) outputs[0].push_back(at::empty_like(wire));
    std::vector<at::Tensor> inputs{wire};
    c10d::AllgatherOptions opts;
    opts.timeout = options_.timeout;
    make_work(collective, issue([&] { return pg_->allgather(outputs, inputs, opts); }, collective, seq), {}, seq,
              completes_entry)
        .wait();
    if (as_half)
      for (auto& o : outputs[0]) o = o.view(t.scalar_type());
    return std::move(outputs[0]);
  }

  /// All-gathers this rank's call (detail::encode_collective_meta) and throws CommError on any
  /// difference, naming every rank's view.
  void check_metadata(const at::Tensor& t, detail::GlooCollective collective, std::int64_t arg, std::int64_t seq) {
    const auto meta = detail::encode_collective_meta(t, collective, arg);
    const char* name = detail::collective_name(collective);
    auto all = gather_unchecked(meta, name, seq, false);  // a timeout here names the user's collective
    bool same = true;
    for (const auto& other : all) same = same && at::equal(other, meta);
    if (same) return;
    std::vector<std::string> views;
    for (int r = 0; r < world_size_; ++r)
      views.push_back(fmt::format("rank {}: {}", r, detail::describe_collective_meta(all[r])));
    const std::string message =
        fmt::format("{}: the ranks disagree on the collective or its tensor (seen from rank {}): {}", name, rank_,
                    fmt::join(views, "; "));
    throw CommError(message + failure_text(seq, message));
  }

  int rank_ = 0;
  int world_size_ = 1;
  GlooOptions options_;
  detail::GlooGroup pg_;  ///< the process group (left to the process when broken with a collective still running)
  std::shared_ptr<const detail::GlooPeerTable> peers_;  ///< which peer a Gloo error's socket address is
  std::string device_;                                  ///< device_description()
  std::shared_ptr<detail::TraceExchange> trace_;        ///< the flight recorder and its dump on failure
};

static_assert(WorkHandle<GlooWork>, "GlooWork must model loom::WorkHandle");
static_assert(AsyncCommunicator<GlooCommunicator>, "GlooCommunicator must model loom::AsyncCommunicator");
static_assert(trace::TracedCommunicator<GlooCommunicator>,
              "GlooCommunicator must model loom::trace::TracedCommunicator");

}  // namespace loom

#endif  // LOOM_HAS_GLOO && USE_C10D_GLOO
