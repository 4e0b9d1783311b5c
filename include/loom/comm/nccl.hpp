// loom/comm/nccl.hpp — NcclCommunicator: the GPU process group (NCCL), a model of
// loom::AsyncCommunicator.
//
// One NcclCommunicator per process and GPU. Ranks meet through a c10d::Store (the TCPStore the
// Gloo path uses, or any other): rank 0 creates the ncclUniqueId and publishes it, the others
// read it, and every rank calls ncclCommInitRankConfig. Collectives run on one CUDA stream per
// communicator (its own, or the caller's), ordered after the work that produced their input,
// and complete through CUDA events; wait() polls the event and ncclCommGetAsyncError until the
// timeout, then aborts the communicator (ncclCommAbort) and throws loom::TimeoutError naming the
// collective and the rank, so a dead peer never hangs the process.
//
// Threads: one thread at a time runs collectives, finalize() and destroy() (NCCL's own rule for
// a communicator). abort() is safe from any thread at any time, the tool of a watchdog: every
// NCCL call loom makes on the communicator holds one lock, so the abort waits for the call in
// progress (in non-blocking mode, a short one), frees the communicator, and the waiting thread's
// next poll throws loom::CommError naming the abort's reason (detail::BasicNcclState).
//
// Example:
//   auto env = loom::Environment::from_env();          // torchrun / mpirun / srun variables
//   loom::NcclCommunicator comm(env, {.timeout = std::chrono::seconds(60)});  // device: LOCAL_RANK
//   comm.all_reduce(grad, loom::ReduceOp::avg);         // grad: a CUDA tensor on that device
//   // or with a store of your own (any c10d::Store: TCPStore, FileStore, HashStore):
//   loom::NcclCommunicator comm2(store, rank, world_size, {.device = 0});
//   // without a CUDA LibTorch: raw device pointers, count, dtype and the producing stream
//   comm.all_reduce(ptr, n, at::kFloat, loom::ReduceOp::sum, my_stream);
//
// Flight recorder (NcclOptions::flight_recorder, on by default): every collective is recorded
//      (loom/trace/recorder.hpp) with the loom part, step and micro-batch that issued it, and every
//      CommError of a collective (timeout, abort, NCCL's asynchronous error) ends with the verdict of
//      loom/comm/detail/trace_exchange.hpp: each live rank writes its record file to
//      NcclOptions::trace_folder and the error names the first rank that went its own way. The
//      exchange needs the job's store: a communicator built from a unique id, or from a store it
//      does not own (the c10d::Store& constructor), writes this rank's record only. A collective
//      stuck longer than a twentieth of the timeout (1-5 s) while another rank's record holds a
//      different call under the same number aborts the communicator at once (the stuck-collective
//      probe). docs/debugging.md is the field guide.
// Shape: collectives take dense contiguous tensors (or buffers) of float32, float64, bfloat16,
//        float16, int32 or int64 on the communicator's device; all_gather returns world_size()
//        tensors of the input's shape.
// Units: counts are elements (not bytes); timeouts are std::chrono::milliseconds.
// Throws: loom::InvalidArgument (CPU tensor or a tensor on another GPU, naming its device;
//         bad dtype, rank, root); loom::NcclError (a CommError) naming the NCCL call, file:line,
//         the code's text, ncclGetLastError, the NCCL version, rank and world size;
//         loom::CudaError from CUDA calls; loom::TimeoutError from init, waits and finalize.
// Source: the ncclUniqueId-through-a-store rendezvous, stream/event completion, non-blocking
//         init and abort-on-timeout of torch.distributed's ProcessGroupNCCL (NCCLUtils.hpp),
//         written on NCCL's public API (docs.nvidia.com/deeplearning/nccl, "Fault tolerance").
#pragma once

#include <loom/config.hpp>

#if !LOOM_HAS_NCCL
#error \
    "loom/comm/nccl.hpp needs NCCL and the CUDA runtime, but this build has LOOM_HAS_NCCL=0: install NCCL (nccl.h and libnccl under the CUDA toolkit, or pass -Dnccl_dir=<root>) and reconfigure; for CPU training use loom/comm/gloo.hpp or loom/comm/local.hpp."
#endif

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/ScalarType.h>
#include <fmt/format.h>
#include <nccl.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <loom/comm/communicator.hpp>
#include <loom/comm/detail/nccl_error.hpp>
#include <loom/comm/detail/nccl_state.hpp>
#include <loom/comm/detail/nccl_tensor.hpp>
#include <loom/comm/detail/nccl_trace.hpp>
#include <loom/comm/detail/nccl_unique_id.hpp>
#include <loom/comm/detail/nccl_work.hpp>
#include <loom/comm/detail/trace_exchange.hpp>
#include <loom/cuda/device.hpp>
#include <loom/cuda/stream.hpp>
#include <loom/detail/process_counter.hpp>
#include <loom/error.hpp>
#include <loom/launch/environment.hpp>
#include <loom/launch/rendezvous.hpp>
#include <loom/trace/recorder.hpp>

namespace loom {

/// Options of an NcclCommunicator; an aggregate used with designated initializers.
///
/// Example: `loom::NcclOptions{.device = local_rank, .timeout = std::chrono::seconds(60)}`
struct NcclOptions {
  /// CUDA device ordinal of this rank; -1: the calling thread's current device.
  int device = -1;
  /// Bound on init, every wait(), finalize() and the unique-id exchange.
  std::chrono::milliseconds timeout = kDefaultTimeout;
  /// Stream the collectives run on; nullptr: the communicator creates its own non-blocking
  /// stream. A caller's stream must live on `device` and outlive the communicator.
  cudaStream_t stream = nullptr;
  /// Non-blocking NCCL communicator (ncclConfig_t::blocking = 0): init, enqueue and finalize
  /// return at once and are polled, so each of them can time out. true: NCCL's blocking mode
  /// (init and connection setup cannot be interrupted).
  bool nonblocking = true;
  /// Store key prefix of the unique id; communicators created in the same order on every rank
  /// get distinct keys "<prefix>/<n>/unique_id" (n counts communicators in this process).
  std::string store_prefix = "loom/nccl";
  /// Name shown in NCCL's logs (ncclConfig_t::commName); empty: none.
  std::string name{};
  /// Sleep between polls once a wait has spun for a while.
  std::chrono::microseconds poll_interval{50};
  /// Keep a flight recorder (docs/debugging.md); false: no record, no fingerprint in the reducer's
  /// window, no watcher thread.
  bool flight_recorder = true;
  /// Flight-record entries kept (the last collectives; 64 bytes each).
  std::size_t trace_capacity = trace::FlightRecorder::kDefaultCapacity;
  /// Where a failure writes the record files; empty: LOOM_TRACE_DIR, else "loom-trace" in the working
  /// folder (docs/debugging.md).
  std::string trace_folder{};
};

/// A process group of one GPU per rank over NCCL. Models loom::AsyncCommunicator. Move-only. Its
/// async calls return an NcclWork (loom/comm/detail/nccl_work.hpp).
///
/// Lifecycle: usable after construction; abort() stops it at once, from any thread (outstanding
/// collectives are cancelled, their waits throw CommError, peers see an error); finalize() waits
/// (bounded) for outstanding collectives;
/// destroy() finalizes then frees the NCCL communicator. The destructor does destroy() (abort()
/// when an exception is in flight or destroy fails) and never throws.
///
/// Example: see the file comment.
/// Throws: see the file comment.
class NcclCommunicator {
 public:
  /// Joins the job `env` describes (torchrun, mpirun, Slurm): meets the other ranks at
  /// loom::rendezvous (rank 0 hosts a TCPStore on MASTER_ADDR:MASTER_PORT) and uses CUDA device
  /// `options.device`, or env.local_rank when that is -1.
  explicit NcclCommunicator(const Environment& env, NcclOptions options = {})
      : NcclCommunicator(rendezvous(env, {.timeout = options.timeout}), env.rank, env.world_size,
                         with_default_device(std::move(options), env.local_rank)) {}

  /// Joins the group through a shared store handle (kept alive by the communicator; the flight
  /// recorder's exchange runs over it too). Throws loom::InvalidArgument when `store` is null.
  NcclCommunicator(c10::intrusive_ptr<c10d::Store> store, int rank, int world_size, NcclOptions options = {})
      : NcclCommunicator(exchange_id(checked(store), rank, world_size, options), rank, world_size, options, store) {}

  /// Joins the group `rank` of `world_size` through `store` (the unique id is exchanged there). The
  /// communicator does not own `store`, so its flight recorder writes this rank's record only.
  NcclCommunicator(c10d::Store& store, int rank, int world_size, NcclOptions options = {})
      : NcclCommunicator(exchange_id(store, rank, world_size, options), rank, world_size, options, {}) {}

  /// Joins the group with a unique id the caller distributed itself (e.g. over MPI); without a
  /// store, the flight recorder writes this rank's record only.
  NcclCommunicator(const ncclUniqueId& id, int rank, int world_size, NcclOptions options = {})
      : NcclCommunicator(Joined{id, -1}, rank, world_size, std::move(options), {}) {}

 private:
  /// The unique id, and the communicator's number in this process (-1: not known, no store keys).
  struct Joined {
    ncclUniqueId id;
    std::int64_t n = -1;
  };

  NcclCommunicator(const Joined& joined, int rank, int world_size, NcclOptions options,
                   c10::intrusive_ptr<c10d::Store> store)
      : state_(std::make_shared<detail::NcclState>()) {
    const ncclUniqueId& id = joined.id;
    check_rank(rank, world_size);
    auto& s = *state_;
    s.site = {rank, world_size, options.device >= 0 ? options.device : cuda::current_device()};
    s.timeout = options.timeout;
    s.poll_interval = options.poll_interval;
    s.name = options.name;
    cuda::DeviceGuard on(s.site.device);
    detail::init_nccl_comm(s, id, options.stream, options.nonblocking);
    s.store = store;
    if (options.flight_recorder)
      trace_ = detail::start_nccl_flight_recorder(state_, options.store_prefix, options.timeout, options.trace_capacity,
                                                  options.trace_folder, std::move(store), joined.n);
  }

 public:
  NcclCommunicator(NcclCommunicator&&) noexcept = default;
  NcclCommunicator& operator=(NcclCommunicator&&) noexcept = default;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;
  ~NcclCommunicator() = default;  // NcclState's destructor tears the communicator down

  [[nodiscard]] int rank() const noexcept { return state_->site.rank; }
  [[nodiscard]] int world_size() const noexcept { return state_->site.world_size; }
  [[nodiscard]] std::chrono::milliseconds timeout() const noexcept { return state_->timeout; }
  /// The CUDA device of this rank: every tensor handed to a collective must live there.
  [[nodiscard]] c10::Device device() const noexcept {
    return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(state_->site.device));
  }
  /// The ordinal of device() (as the CUDA runtime counts, under CUDA_VISIBLE_DEVICES).
  [[nodiscard]] int device_index() const noexcept { return state_->site.device; }
  /// The stream the collectives run on.
  [[nodiscard]] cudaStream_t stream() const noexcept { return state_->stream->get(); }
  /// The raw NCCL communicator (nullptr after abort/destroy), for calls loom does not wrap. The
  /// handle is read under the state's lock, but using it is outside loom's locking: do not pass
  /// it to NCCL while another thread may call abort().
  [[nodiscard]] ncclComm_t native_handle() const {
    std::lock_guard lk(state_->mutex);
    return state_->comm;
  }
  /// This communicator's flight recorder: the last NcclOptions::trace_capacity collectives, written
  /// to the trace folder on a failure (loom/trace/recorder.hpp, docs/debugging.md). Null when moved
  /// from or built with NcclOptions::flight_recorder = false.
  [[nodiscard]] trace::FlightRecorder* flight_recorder() const noexcept {
    return trace_ ? &trace_->recorder() : nullptr;
  }
  /// Where a failure writes the record files (NcclOptions::trace_folder's rule).
  [[nodiscard]] std::string trace_folder() const { return trace_ ? trace_->folder() : std::string{}; }
  /// Changes it; empty: the default rule (e.g. `comm.set_trace_folder(run_dir + "/loom-trace")`).
  void set_trace_folder(std::string folder) {
    if (trace_) trace_->set_folder(std::move(folder));
  }
  /// True after abort() or after a timeout/failure aborted the communicator (any thread).
  [[nodiscard]] bool aborted() const noexcept { return state_->phase.load() == detail::NcclState::Phase::aborted; }

  // ---- tensors (CUDA tensors of a LibTorch built with CUDA) ---------------------------------

  /// In place; blocks until done (bounded by timeout()).
  void all_reduce(at::Tensor& t, ReduceOp op) { all_reduce_async(t, op).wait(); }

  /// Starts an in-place all-reduce of `t` after the work queued so far on LibTorch's current
  /// stream of t's device; `t` must stay alive and unmodified until wait() returned.
  NcclWork all_reduce_async(at::Tensor& t, ReduceOp op) {
    check_tensor(t, "all_reduce");
    NcclWork w = all_reduce_async(t.data_ptr(), static_cast<std::size_t>(t.numel()), t.scalar_type(), op,
                                  detail::producer_stream(t, stream()), t);
    detail::record_stream_use(t, stream());
    return w;
  }

  /// In place: every rank ends with root's `t`. Blocks until done.
  void broadcast(at::Tensor& t, int root) {
    check_tensor(t, "broadcast");
    detail::check_root(root, world_size(), "broadcast");
    NcclWork w = broadcast_async(t.data_ptr(), static_cast<std::size_t>(t.numel()), t.scalar_type(), root,
                                 detail::producer_stream(t, stream()), t);
    detail::record_stream_use(t, stream());
    w.wait();
  }

  /// world_size() tensors, entry r = rank r's `t`; views into one new buffer. Blocks until done.
  [[nodiscard]] std::vector<at::Tensor> all_gather(const at::Tensor& t) {
    check_tensor(t, "all_gather");
    const int64_t n = t.numel();
    at::Tensor flat = at::empty({world_size() * n}, t.options());
    NcclWork w = all_gather_async(t.data_ptr(), flat.data_ptr(), static_cast<std::size_t>(n), t.scalar_type(),
                                  detail::producer_stream(t, stream()), flat);
    detail::record_stream_use(t, stream());
    detail::record_stream_use(flat, stream());
    w.wait();
    std::vector<at::Tensor> out;
    out.reserve(static_cast<std::size_t>(world_size()));
    for (int r = 0; r < world_size(); ++r) out.push_back(flat.narrow(0, r * n, n).view(t.sizes()));
    return out;
  }

  /// Returns once every rank entered it (an all-reduce of one int32 on the device), bounded by
  /// timeout().
  void barrier() {
    auto& s = *state_;
    if (!s.barrier_word) s.barrier_word.emplace(s.site.device, sizeof(int32_t));
    all_reduce_async(s.barrier_word->get(), 1, c10::ScalarType::Int, ReduceOp::sum, stream(), {}, "barrier").wait();
  }

  // ---- raw device pointers (any LibTorch) ----------------------------------------------------

  /// In place all-reduce of `count` elements of `dtype` at device pointer `data`, ordered after
  /// the work queued so far on `after` (the stream that produced the data; nullptr is the legacy
  /// default stream). Blocks until done.
  void all_reduce(void* data, std::size_t count, c10::ScalarType dtype, ReduceOp op, cudaStream_t after) {
    all_reduce_async(data, count, dtype, op, after).wait();
  }

  /// Starts the all-reduce above; the buffer must stay valid until wait() returned.
  /// `keep_alive` (optional) is held by the handle until the collective finished.
  NcclWork all_reduce_async(void* data, std::size_t count, c10::ScalarType dtype, ReduceOp op, cudaStream_t after,
                            at::Tensor keep_alive = {}, std::string_view collective = "all_reduce") {
    auto& s = *state_;
    const ncclDataType_t type = detail::to_nccl_dtype(dtype, collective);
    detail::check_nccl_pointer(data, count, collective);
    cuda::DeviceGuard on(s.site.device);
    // The barrier is recorded as Gloo records it: no tensor of the caller's.
    const std::int64_t seq =
        collective == "barrier"
            ? detail::record_collective(trace_.get(), trace::Op::barrier, c10::ScalarType::Undefined, 0)
            : detail::record_collective(trace_.get(), trace::Op::all_reduce, dtype, count);
    return detail::recorded(trace_.get(), seq, [&] {
      auto start = detail::begin_collective(s, collective, after);
      s.run([&](ncclComm_t c) { return ncclAllReduce(data, data, count, type, detail::to_nccl_op(op), c, stream()); },
            "ncclAllReduce(data, data, count, dtype, op, comm, stream)", __FILE__, __LINE__, collective, start);
      return detail::finish_collective(state_, trace_, collective, start, std::move(keep_alive), seq);
    });
  }

  /// Broadcast of `count` elements at `data` from `root`, in place, after `after`. Blocks.
  void broadcast(void* data, std::size_t count, c10::ScalarType dtype, int root, cudaStream_t after) {
    detail::check_root(root, world_size(), "broadcast");
    broadcast_async(data, count, dtype, root, after).wait();
  }

  /// Starts the broadcast above.
  NcclWork broadcast_async(void* data, std::size_t count, c10::ScalarType dtype, int root, cudaStream_t after,
                           at::Tensor keep_alive = {}) {
    auto& s = *state_;
    const ncclDataType_t type = detail::to_nccl_dtype(dtype, "broadcast");
    detail::check_root(root, world_size(), "broadcast");
    detail::check_nccl_pointer(data, count, "broadcast");
    cuda::DeviceGuard on(s.site.device);
    const std::int64_t seq = detail::record_collective(trace_.get(), trace::Op::broadcast, dtype, count);
    return detail::recorded(trace_.get(), seq, [&] {
      auto start = detail::begin_collective(s, "broadcast", after);
      s.run([&](ncclComm_t c) { return ncclBroadcast(data, data, count, type, root, c, stream()); },
            "ncclBroadcast(data, data, count, dtype, root, comm, stream)", __FILE__, __LINE__, "broadcast", start);
      return detail::finish_collective(state_, trace_, "broadcast", start, std::move(keep_alive), seq);
    });
  }

  /// Gathers `count` elements at `send` from every rank into `recv` (world_size() * count
  /// elements, rank r's at offset r * count), after `after`. Blocks.
  void all_gather(const void* send, void* recv, std::size_t count, c10::ScalarType dtype, cudaStream_t after) {
    all_gather_async(send, recv, count, dtype, after).wait();
  }

  /// Starts the all-gather above.
  NcclWork all_gather_async(const void* send, void* recv, std::size_t count, c10::ScalarType dtype, cudaStream_t after,
                            at::Tensor keep_alive = {}) {
    auto& s = *state_;
    const ncclDataType_t type = detail::to_nccl_dtype(dtype, "all_gather");
    detail::check_nccl_pointer(send, count, "all_gather");
    detail::check_nccl_pointer(recv, count, "all_gather");
    cuda::DeviceGuard on(s.site.device);
    const std::int64_t seq = detail::record_collective(trace_.get(), trace::Op::all_gather, dtype, count);
    return detail::recorded(trace_.get(), seq, [&] {
      auto start = detail::begin_collective(s, "all_gather", after);
      s.run([&](ncclComm_t c) { return ncclAllGather(send, recv, count, type, c, stream()); },
            "ncclAllGather(send, recv, count, dtype, comm, stream)", __FILE__, __LINE__, "all_gather", start);
      return detail::finish_collective(state_, trace_, "all_gather", start, std::move(keep_alive), seq);
    });
  }

  // ---- lifecycle ------------------------------------------------------------------------------

  /// ncclCommAbort now: outstanding collectives are cancelled; later calls throw CommError.
  /// Thread-safe: a watchdog thread may call it while another thread waits in a collective (that
  /// wait then throws CommError "aborted while this collective was pending"); see
  /// detail::BasicNcclState for the locking. Idempotent.
  void abort() noexcept {
    // A copy of the state: ncclCommAbort runs outside the state's lock and may outlast a waiter
    // that sees the abort and drops the communicator; the state (streams, events) lives until it
    // returns.
    const std::shared_ptr<detail::NcclState> state = state_;
    state->abort("abort() called");
  }
  /// Waits (up to timeout()) for outstanding collectives with ncclCommFinalize; collectives are
  /// no longer allowed afterwards. Throws loom::TimeoutError (after aborting) or NcclError.
  void finalize() { state_->finalize(); }
  /// finalize() if not done yet, then ncclCommDestroy. Throws like finalize().
  void destroy() { state_->destroy(); }

 private:
  static NcclOptions with_default_device(NcclOptions options, int device) {
    if (options.device < 0) options.device = device;
    return options;
  }

  static void check_rank(int rank, int world_size) {
    if (world_size < 1) throw InvalidArgument(fmt::format("NcclCommunicator: world_size {} must be >= 1", world_size));
    if (rank < 0 || rank >= world_size)
      throw InvalidArgument(fmt::format("NcclCommunicator: rank {} is outside [0, {})", rank, world_size));
  }

  static c10d::Store& checked(const c10::intrusive_ptr<c10d::Store>& store) {
    if (!store) throw InvalidArgument("NcclCommunicator: the store is null");
    return *store;
  }

  static Joined exchange_id(c10d::Store& store, int rank, int world_size, const NcclOptions& options) {
    check_rank(rank, world_size);
    const auto n = static_cast<std::int64_t>(detail::next_in_process(detail::Counted::nccl_communicator));
    const std::string key = fmt::format("{}/{}/unique_id", options.store_prefix, n);
    return {detail::exchange_unique_id(store, key, {rank, world_size, options.device}, options.timeout), n};
  }

  void check_tensor(const at::Tensor& t, std::string_view collective) const {
    detail::check_nccl_tensor(t, device_index(), collective);
  }

  std::shared_ptr<detail::NcclState> state_;
  std::shared_ptr<detail::TraceExchange> trace_;  // the flight recorder and its dump on failure (null: none)
};

static_assert(AsyncCommunicator<NcclCommunicator>, "NcclCommunicator must model loom::AsyncCommunicator");
static_assert(trace::TracedCommunicator<NcclCommunicator>,
              "NcclCommunicator must model loom::trace::TracedCommunicator");
static_assert(WorkHandle<NcclWork>, "NcclWork must model loom::WorkHandle");

}  // namespace loom
