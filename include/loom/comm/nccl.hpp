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
#error "loom/comm/nccl.hpp needs NCCL and the CUDA runtime, but this build has LOOM_HAS_NCCL=0: install NCCL (nccl.h and libnccl under the CUDA toolkit, or pass -Dnccl_dir=<root>) and reconfigure; for CPU training use loom/comm/gloo.hpp or loom/comm/local.hpp."
#endif

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <nccl.h>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/ScalarType.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <loom/comm/communicator.hpp>
#include <loom/cuda/buffer.hpp>
#include <loom/cuda/device.hpp>
#include <loom/cuda/error.hpp>
#include <loom/cuda/stream.hpp>
#include <loom/dist/environment.hpp>
#include <loom/dist/rendezvous.hpp>

#if LOOM_TORCH_HAS_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

namespace loom {

/// An NCCL call failed. `code()` is its ncclResult_t; `what()` says which call, where, and why.
class NcclError : public CommError {
 public:
  NcclError(ncclResult_t code, const std::string& message) : CommError(message), code_(code) {}
  [[nodiscard]] ncclResult_t code() const noexcept { return code_; }

 private:
  ncclResult_t code_;
};

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
};

namespace detail {

/// Where an NCCL call ran, for messages (-1: unknown).
struct NcclSite {
  int rank = -1;
  int world_size = -1;
  int device = -1;
};

/// "ncclInvalidUsage" etc.: the enumerator's name of an ncclResult_t.
constexpr std::string_view nccl_result_name(ncclResult_t r) noexcept {
  switch (r) {
    case ncclSuccess: return "ncclSuccess";
    case ncclUnhandledCudaError: return "ncclUnhandledCudaError";
    case ncclSystemError: return "ncclSystemError";
    case ncclInternalError: return "ncclInternalError";
    case ncclInvalidArgument: return "ncclInvalidArgument";
    case ncclInvalidUsage: return "ncclInvalidUsage";
    case ncclRemoteError: return "ncclRemoteError";
    case ncclInProgress: return "ncclInProgress";
    default: return "ncclResult?";
  }
}

/// "2.28.9" from an NCCL version code (ncclGetVersion / NCCL_VERSION_CODE); both encodings.
inline std::string nccl_version_text(int code) {
  if (code >= 10000) return fmt::format("{}.{}.{}", code / 10000, (code % 10000) / 100, code % 100);
  return fmt::format("{}.{}.{}", code / 1000, (code % 1000) / 100, code % 100);
}

/// The NCCL library's version ("2.28.9"), or the header's when the library cannot say.
inline std::string nccl_runtime_version() {
  int v = 0;
  if (ncclGetVersion(&v) != ncclSuccess || v == 0) v = NCCL_VERSION_CODE;
  return nccl_version_text(v);
}

/// The message of a failed NCCL call. Pure (testable without a GPU): `last_error` is what
/// ncclGetLastError said, `version` the NCCL version text.
inline std::string format_nccl_error(ncclResult_t code, std::string_view call, std::string_view file, int line,
                                     std::string_view last_error, std::string_view version, const NcclSite& site) {
  std::string msg = fmt::format("NCCL call {} failed at {}:{}: {} ({})", call, cuda::detail::short_file(file), line,
                                nccl_result_name(code), ncclGetErrorString(code));
  if (!last_error.empty()) msg += fmt::format("; NCCL says: {}", last_error);
  msg += fmt::format("; NCCL {}", version);
  if (site.rank >= 0) msg += fmt::format(", rank {} of {}", site.rank, site.world_size);
  if (site.device >= 0) msg += fmt::format(", device {}", site.device);
  return msg;
}

/// Throws loom::NcclError for `code` with the live NCCL state (last error of `comm`, version).
[[noreturn]] inline void throw_nccl_error(ncclResult_t code, const char* call, const char* file, int line,
                                          ncclComm_t comm, const NcclSite& site) {
  const char* last = ncclGetLastError(comm);
  throw NcclError(code, format_nccl_error(code, call, file, line, last != nullptr ? last : "", nccl_runtime_version(), site));
}

/// The NCCL data type of a loom-supported dtype. Throws loom::InvalidArgument for the others.
inline ncclDataType_t to_nccl_dtype(c10::ScalarType dtype, std::string_view collective) {
  switch (dtype) {
    case c10::ScalarType::Float: return ncclFloat32;
    case c10::ScalarType::Double: return ncclFloat64;
    case c10::ScalarType::BFloat16: return ncclBfloat16;
    case c10::ScalarType::Half: return ncclFloat16;
    case c10::ScalarType::Int: return ncclInt32;
    case c10::ScalarType::Long: return ncclInt64;
    default:
      throw InvalidArgument(fmt::format("{}: unsupported dtype {} for NCCL (supported: float32, float64, bfloat16, float16, int32, int64)",
                                        collective, c10::toString(dtype)));
  }
}

/// The NCCL reduction of a loom ReduceOp (avg is ncclAvg: sum / world size, on the GPU).
constexpr ncclRedOp_t to_nccl_op(ReduceOp op) noexcept {
  switch (op) {
    case ReduceOp::sum: return ncclSum;
    case ReduceOp::avg: return ncclAvg;
    case ReduceOp::min: return ncclMin;
    case ReduceOp::max: return ncclMax;
  }
  return ncclSum;
}

/// Validates a tensor for a collective on `device`: the checks every communicator makes, then
/// loom::InvalidArgument naming the tensor's device when it is not a CUDA tensor on `device`.
inline void check_nccl_tensor(const at::Tensor& t, int device, std::string_view collective) {
  check_collective_tensor(t, collective);
  if (!t.is_cuda())
    throw InvalidArgument(fmt::format("{}: NcclCommunicator needs a CUDA tensor on cuda:{}, got one on {}", collective, device,
                                      t.device().str()));
  if (t.device().index() != device)
    throw InvalidArgument(fmt::format("{}: the tensor is on {}, but this rank's NcclCommunicator uses cuda:{}", collective,
                                      t.device().str(), device));
}

/// The unique id as store bytes (NCCL_UNIQUE_ID_BYTES of them).
inline std::vector<uint8_t> unique_id_bytes(const ncclUniqueId& id) {
  const auto* p = reinterpret_cast<const uint8_t*>(id.internal);
  return {p, p + NCCL_UNIQUE_ID_BYTES};
}

/// The unique id from store bytes; loom::CommError naming `key` if the size is wrong.
inline ncclUniqueId unique_id_from_bytes(const std::vector<uint8_t>& bytes, std::string_view key) {
  if (bytes.size() != NCCL_UNIQUE_ID_BYTES)
    throw CommError(fmt::format("NCCL unique id at store key '{}' has {} bytes, expected {} (is another program using this key?)",
                                key, bytes.size(), NCCL_UNIQUE_ID_BYTES));
  ncclUniqueId id{};
  std::copy(bytes.begin(), bytes.end(), reinterpret_cast<uint8_t*>(id.internal));
  return id;
}

/// Rank 0 publishes `id` at `key`.
inline void publish_unique_id(c10d::Store& store, const std::string& key, const ncclUniqueId& id) {
  store.set(key, unique_id_bytes(id));
}

/// Waits up to `timeout` for `key` and reads the unique id. loom::TimeoutError ("nccl_unique_id",
/// naming the key and rank) when rank 0 never published it.
inline ncclUniqueId fetch_unique_id(c10d::Store& store, const std::string& key, int rank, std::chrono::milliseconds timeout) {
  const auto start = std::chrono::steady_clock::now();
  try {
    store.wait({key}, timeout);
  } catch (const std::exception& e) {
    const std::chrono::duration<double> waited = std::chrono::steady_clock::now() - start;
    throw TimeoutError("nccl_unique_id", rank, waited.count(),
                       fmt::format("rank 0 did not publish store key '{}' (store says: {})", key, e.what()));
  }
  return unique_id_from_bytes(store.get(key), key);
}

/// Per-process count of NcclCommunicators created, so that the n-th communicator uses the same
/// store key on every rank (ranks create communicators in the same order).
inline std::atomic<std::uint64_t>& nccl_comm_sequence() noexcept {
  static std::atomic<std::uint64_t> n{0};
  return n;
}

/// The NCCL calls the communicator's lifecycle makes, as static functions: the seam through which
/// tests drive BasicNcclState's state machine without a GPU (tests/gpu/test_gpu_host.cpp).
struct NcclApi {
  using DeviceGuard = cuda::DeviceGuard;
  static ncclResult_t get_async_error(ncclComm_t comm, ncclResult_t* state) { return ncclCommGetAsyncError(comm, state); }
  static ncclResult_t abort(ncclComm_t comm) { return ncclCommAbort(comm); }
  static ncclResult_t finalize(ncclComm_t comm) { return ncclCommFinalize(comm); }
  static ncclResult_t destroy(ncclComm_t comm) { return ncclCommDestroy(comm); }
  static const char* last_error(ncclComm_t comm) { return ncclGetLastError(comm); }
};

/// Shared state of a communicator and its work handles (a handle may outlive the communicator
/// object; the NCCL communicator lives until the last of them is gone).
///
/// Thread safety (abort() is a watchdog's tool, called from another thread while a collective
/// waits):
///  - `mutex` guards `comm` and `abort_reason`; `phase` changes only under `mutex` and may be read
///    without it. Every NCCL call that takes `comm` is made with `mutex` held, so at most one
///    thread is inside NCCL on this communicator at a time (NCCL's rule: one thread operates a
///    communicator at a time) and no call ever gets a communicator that ncclCommAbort freed.
///  - Waits and polls (a collective's completion event, a non-blocking call in progress) hold the
///    lock for one poll at a time. An abort() from another thread takes it between two polls; the
///    waiting thread's next poll throws loom::CommError naming the abort's reason. A collective
///    not waited for before the abort reports that error too, even if its kernel had finished:
///    after ncclCommAbort a finished event no longer shows that the data is complete.
///  - abort() is idempotent: the first call runs ncclCommAbort and keeps its reason; later calls,
///    and calls after destroy(), change nothing.
///  - In NCCL's non-blocking mode (NcclOptions::nonblocking, the default) every NCCL call other
///    than ncclCommAbort and ncclCommDestroy returns at once, so abort() waits at most for one
///    short call. In blocking mode a call may block for long (connection setup, finalize) and an
///    abort() from another thread waits for it to return: a watchdog needs the non-blocking mode.
/// Api is the seam for the NCCL calls (NcclApi in production, a fake in the host tests).
template <class Api>
struct BasicNcclState {
  enum class Phase { live, finalized, destroyed, aborted };

  mutable std::mutex mutex;
  ncclComm_t comm = nullptr;                // guarded by mutex
  std::atomic<Phase> phase{Phase::live};    // written with mutex held
  std::string abort_reason;                 // guarded by mutex
  // Set before the state is shared, constant afterwards:
  NcclSite site;
  std::chrono::milliseconds timeout{};
  std::chrono::microseconds poll_interval{};
  std::optional<cuda::Stream> stream;
  std::optional<cuda::Event> ready;       // re-recorded on the producer stream before each collective (one calling thread)
  std::optional<cuda::DeviceBuffer> barrier_word;
  std::string name;                       // kept alive for ncclConfig_t::commName
  c10::intrusive_ptr<c10d::Store> store;  // the rendezvous store, when the communicator owns a handle

  BasicNcclState() = default;
  BasicNcclState(const BasicNcclState&) = delete;
  BasicNcclState& operator=(const BasicNcclState&) = delete;

  /// Runs `call(comm)`, one NCCL call on this communicator (e.g. an enqueue), with the lock held,
  /// after checking that the communicator is live. A failure aborts and throws loom::NcclError;
  /// ncclInProgress (non-blocking mode) is polled by poll_in_progress. `what` names the
  /// operation in errors, `start` is when it began (the timeout counts from there).
  template <class Call>
  void run(Call&& call, const char* text, const char* file, int line, std::string_view what,
           std::chrono::steady_clock::time_point start) {
    ncclResult_t rc = ncclSuccess;
    {
      std::lock_guard lk(mutex);
      ensure_live_locked(what);
      rc = call(comm);
      if (rc != ncclSuccess && rc != ncclInProgress) fail_locked(rc, text, file, line);
    }
    if (rc == ncclInProgress) poll_in_progress(text, file, line, what, start);
  }

  /// Polls ncclCommGetAsyncError until the non-blocking call `text` completed (returns), failed
  /// (aborts, throws loom::NcclError), the communicator was aborted by another thread (throws
  /// loom::CommError naming the reason), or start + timeout passed (aborts, throws
  /// loom::TimeoutError naming `what`).
  void poll_in_progress(const char* text, const char* file, int line, std::string_view what,
                        std::chrono::steady_clock::time_point start) {
    const auto deadline = start + timeout;
    for (int spins = 0;; ++spins) {
      {
        std::lock_guard lk(mutex);
        if (phase != Phase::live)
          throw CommError(fmt::format("{} on rank {}: the NCCL communicator was aborted while {} was in progress ({})", what,
                                      site.rank, text, phase == Phase::aborted ? abort_reason : std::string("finalized/destroyed")));
        ncclResult_t state = ncclSuccess;
        const ncclResult_t q = Api::get_async_error(comm, &state);
        if (q != ncclSuccess) fail_locked(q, "ncclCommGetAsyncError(comm, &state)", file, line);
        if (state == ncclSuccess) return;
        if (state != ncclInProgress) fail_locked(state, text, file, line);
      }
      if (std::chrono::steady_clock::now() > deadline) time_out(what, start, fmt::format("{} still in progress", text));
      pause(spins);
    }
  }

  /// Aborts (if still possible) and throws NcclError for `rc`.
  [[noreturn]] void fail(ncclResult_t rc, const char* call, const char* file, int line) {
    std::lock_guard lk(mutex);
    fail_locked(rc, call, file, line);
  }

  /// Aborts and throws TimeoutError for `what` started at `start`.
  [[noreturn]] void time_out(std::string_view what, std::chrono::steady_clock::time_point start, const std::string& detail) {
    const std::chrono::duration<double> waited = std::chrono::steady_clock::now() - start;
    std::string d = fmt::format("{}; timeout {} ms, world size {}, device {}; the NCCL communicator was aborted (create a new one to continue)",
                                detail, timeout.count(), site.world_size, site.device);
    abort(fmt::format("{} timed out after {:.3f} s", what, waited.count()));
    throw TimeoutError(std::string(what), site.rank, waited.count(), d);
  }

  /// Polls `done()` (true once the collective's completion event fired; called with the lock
  /// held) until it is true; between polls checks for an abort, the communicator's asynchronous
  /// error and the deadline `start + timeout`.
  template <class Done>
  void wait_event(Done&& done, std::string_view what, std::chrono::steady_clock::time_point start) {
    const auto deadline = start + timeout;
    for (int spins = 0;; ++spins) {
      {
        std::lock_guard lk(mutex);
        if (phase == Phase::aborted)
          throw CommError(fmt::format("{} on rank {}: the NCCL communicator was aborted while this collective was pending ({})",
                                      what, site.rank, abort_reason));
        if (done()) return;
        if (phase == Phase::live) {
          ncclResult_t state = ncclSuccess;
          const ncclResult_t q = Api::get_async_error(comm, &state);
          if (q != ncclSuccess) fail_locked(q, "ncclCommGetAsyncError(comm, &state)", __FILE__, __LINE__);
          if (state != ncclSuccess && state != ncclInProgress)
            fail_locked(state, "<asynchronous error of the communicator>", __FILE__, __LINE__);
        }
      }
      if (std::chrono::steady_clock::now() > deadline) time_out(what, start, "its CUDA event did not complete");
      pause(spins);
    }
  }

  void pause(int spins) const {
    if (spins < 64) std::this_thread::yield();
    else std::this_thread::sleep_for(poll_interval);
  }

  /// Throws loom::CommError when the communicator can no longer run collectives.
  void ensure_live(std::string_view what) const {
    std::lock_guard lk(mutex);
    ensure_live_locked(what);
  }

  /// ncclCommAbort: stops outstanding work, frees resources, never blocks on peers. The first
  /// call's reason is kept; later calls and calls after destroy() do nothing.
  void abort(std::string reason) noexcept {
    std::lock_guard lk(mutex);
    abort_locked(std::move(reason));
  }

  /// ncclCommFinalize, polled up to the timeout (then abort + TimeoutError "nccl_finalize").
  void finalize() {
    {
      std::lock_guard lk(mutex);
      if (phase == Phase::finalized) return;
      ensure_live_locked("finalize");
    }
    const auto start = std::chrono::steady_clock::now();
    typename Api::DeviceGuard on(site.device);
    run([](ncclComm_t c) { return Api::finalize(c); }, "ncclCommFinalize(comm)", __FILE__, __LINE__, "nccl_finalize", start);
    std::lock_guard lk(mutex);
    if (phase == Phase::live) phase = Phase::finalized;  // unless an abort came in meanwhile
  }

  /// ncclCommDestroy after finalize() (so destroy never waits on peers without a bound).
  void destroy() {
    {
      std::lock_guard lk(mutex);
      if (phase == Phase::destroyed || phase == Phase::aborted) return;
    }
    finalize();
    typename Api::DeviceGuard on(site.device);
    ncclResult_t rc = ncclSuccess;
    {
      std::lock_guard lk(mutex);
      if (phase != Phase::finalized) return;  // aborted by another thread after finalize(): freed there
      rc = Api::destroy(comm);
      comm = nullptr;
      phase = Phase::destroyed;
    }
    if (rc != ncclSuccess) {
      const char* last = Api::last_error(nullptr);
      throw NcclError(rc, format_nccl_error(rc, "ncclCommDestroy(comm)", __FILE__, __LINE__, last != nullptr ? last : "",
                                            nccl_runtime_version(), site));
    }
  }

  // Only the last owner runs the destructor: no other thread can hold the state any more.
  ~BasicNcclState() {
    if (comm == nullptr) return;
    if (std::uncaught_exceptions() > 0) {  // unwinding from a failure: peers may be gone
      abort("destroyed during exception unwinding");
      return;
    }
    try {
      destroy();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "loom: warning: NcclCommunicator teardown on rank %d failed (%s); aborted instead\n", site.rank, e.what());
      abort(e.what());
    }
  }

 private:
  void ensure_live_locked(std::string_view what) const {
    switch (phase.load()) {
      case Phase::live: return;
      case Phase::aborted:
        throw CommError(fmt::format("{} on rank {}: the NCCL communicator was aborted earlier ({})", what, site.rank, abort_reason));
      case Phase::finalized:
      case Phase::destroyed:
        throw CommError(fmt::format("{} on rank {}: the NCCL communicator was finalized/destroyed", what, site.rank));
    }
  }

  void abort_locked(std::string reason) noexcept {
    const Phase p = phase.load();
    if (p == Phase::aborted || p == Phase::destroyed) return;
    if (comm != nullptr) (void)Api::abort(comm);
    comm = nullptr;
    abort_reason = std::move(reason);
    phase = Phase::aborted;
  }

  [[noreturn]] void fail_locked(ncclResult_t rc, const char* call, const char* file, int line) {
    const char* last = comm != nullptr ? Api::last_error(comm) : nullptr;
    std::string message = format_nccl_error(rc, call, file, line, last != nullptr ? last : "", nccl_runtime_version(), site);
    abort_locked(message);
    throw NcclError(rc, message + "; the communicator was aborted");
  }
};

/// The state NcclCommunicator uses: the real NCCL calls.
using NcclState = BasicNcclState<NcclApi>;

}  // namespace detail

/// The handle of an asynchronous NCCL collective; models loom::WorkHandle. Copies refer to the
/// same collective (like c10d::Work handles), so containers of handles work as with any value.
///
/// Example:
///   auto work = comm.all_reduce_async(bucket, loom::ReduceOp::sum);
///   ...                       // more backward work on the compute stream
///   work.wait();              // host waits (bounded by comm.timeout())
///
/// Throws (wait): loom::TimeoutError naming the collective, rank and seconds waited (the
/// communicator is aborted first); loom::NcclError for an asynchronous NCCL failure.
class NcclWork {
 public:
  NcclWork(std::shared_ptr<detail::NcclState> state, cuda::Event done, std::string_view collective,
           std::chrono::steady_clock::time_point start, at::Tensor keep_alive = {})
      : state_(std::move(state)),
        pending_(std::make_shared<Pending>(Pending{std::move(done), std::string(collective), start, std::move(keep_alive)})) {}

  /// Blocks the host until the collective finished, at most the communicator's timeout after it
  /// was issued; then aborts the communicator and throws loom::TimeoutError.
  void wait() {
    if (pending_->finished) return;
    state_->wait_event([this] { return pending_->done.query(); }, pending_->collective, pending_->start);
    pending_->finished = true;
    pending_->keep = at::Tensor();
  }
  /// Whether the collective has finished (no blocking). After an abort it may be true for a
  /// collective whose wait() then throws CommError (the data is not known to be complete).
  [[nodiscard]] bool is_completed() const { return pending_->finished || pending_->done.query(); }
  /// Makes `stream` wait for the collective on the GPU; the host does not block (no timeout:
  /// call wait() or is_completed() somewhere to notice a hang).
  void block(cudaStream_t stream) const { pending_->done.block(stream); }
  /// Name of the collective ("all_reduce", ...).
  [[nodiscard]] std::string_view collective() const noexcept { return pending_->collective; }
  /// The completion event (recorded on the communicator's stream).
  [[nodiscard]] const cuda::Event& event() const noexcept { return pending_->done; }

 private:
  struct Pending {
    cuda::Event done;
    std::string collective;
    std::chrono::steady_clock::time_point start;
    at::Tensor keep;  // the buffer the collective reads/writes, alive until it finished
    bool finished = false;
  };
  std::shared_ptr<detail::NcclState> state_;
  std::shared_ptr<Pending> pending_;  // shared by copies: they all refer to the same collective
};

/// A process group of one GPU per rank over NCCL. Models loom::AsyncCommunicator. Move-only.
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

  /// Joins the group through a shared store handle (kept alive by the communicator).
  NcclCommunicator(c10::intrusive_ptr<c10d::Store> store, int rank, int world_size, NcclOptions options = {})
      : NcclCommunicator(*store, rank, world_size, std::move(options)) {
    state_->store = std::move(store);
  }

  /// Joins the group `rank` of `world_size` through `store` (the unique id is exchanged there).
  NcclCommunicator(c10d::Store& store, int rank, int world_size, NcclOptions options = {})
      : NcclCommunicator(exchange_id(store, rank, world_size, options), rank, world_size, options) {}

  /// Joins the group with a unique id the caller distributed itself (e.g. over MPI).
  NcclCommunicator(const ncclUniqueId& id, int rank, int world_size, NcclOptions options = {})
      : state_(std::make_shared<detail::NcclState>()) {
    check_rank(rank, world_size);
    auto& s = *state_;
    s.site = {rank, world_size, options.device >= 0 ? options.device : cuda::current_device()};
    s.timeout = options.timeout;
    s.poll_interval = options.poll_interval;
    s.name = options.name;
    cuda::DeviceGuard on(s.site.device);
    s.stream = options.stream != nullptr ? cuda::Stream::borrow(options.stream, s.site.device)
                                         : cuda::Stream::create(s.site.device);
    s.ready.emplace(s.site.device);

    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = options.nonblocking ? 0 : 1;
    if (!s.name.empty()) config.commName = s.name.c_str();
    const auto start = std::chrono::steady_clock::now();
    // No other thread can see the state yet: init writes s.comm without the lock.
    const ncclResult_t rc = ncclCommInitRankConfig(&s.comm, world_size, id, rank, &config);
    if (rc != ncclSuccess && rc != ncclInProgress && s.comm == nullptr)
      detail::throw_nccl_error(rc, "ncclCommInitRankConfig(&comm, world_size, id, rank, &config)", __FILE__, __LINE__, nullptr, s.site);
    if (rc != ncclSuccess && rc != ncclInProgress)
      s.fail(rc, "ncclCommInitRankConfig(&comm, world_size, id, rank, &config)", __FILE__, __LINE__);
    // Non-blocking: init may still run in NCCL's threads even after ncclSuccess; poll its state.
    if (rc == ncclInProgress || options.nonblocking)
      s.poll_in_progress("ncclCommInitRankConfig(&comm, world_size, id, rank, &config)", __FILE__, __LINE__, "nccl_init", start);
  }

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
  /// True after abort() or after a timeout/failure aborted the communicator (any thread).
  [[nodiscard]] bool aborted() const noexcept { return state_->phase.load() == detail::NcclState::Phase::aborted; }

  // ---- tensors (CUDA tensors of a LibTorch built with CUDA) ---------------------------------

  /// In place; blocks until done (bounded by timeout()).
  void all_reduce(at::Tensor& t, ReduceOp op) { all_reduce_async(t, op).wait(); }

  /// Starts an in-place all-reduce of `t` after the work queued so far on LibTorch's current
  /// stream of t's device; `t` must stay alive and unmodified until wait() returned.
  NcclWork all_reduce_async(at::Tensor& t, ReduceOp op) {
    check_tensor(t, "all_reduce");
    NcclWork w = all_reduce_async(t.data_ptr(), static_cast<std::size_t>(t.numel()), t.scalar_type(), op, producer_stream(t), t);
    record_use(t);
    return w;
  }

  /// In place: every rank ends with root's `t`. Blocks until done.
  void broadcast(at::Tensor& t, int root) {
    check_tensor(t, "broadcast");
    detail::check_root(root, world_size(), "broadcast");
    NcclWork w = broadcast_async(t.data_ptr(), static_cast<std::size_t>(t.numel()), t.scalar_type(), root, producer_stream(t), t);
    record_use(t);
    w.wait();
  }

  /// world_size() tensors, entry r = rank r's `t`; views into one new buffer. Blocks until done.
  [[nodiscard]] std::vector<at::Tensor> all_gather(const at::Tensor& t) {
    check_tensor(t, "all_gather");
    const int64_t n = t.numel();
    at::Tensor flat = at::empty({world_size() * n}, t.options());
    NcclWork w = all_gather_async(t.data_ptr(), flat.data_ptr(), static_cast<std::size_t>(n), t.scalar_type(), producer_stream(t), flat);
    record_use(t);
    record_use(flat);
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
    s.ensure_live("barrier");
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
    check_pointer(data, count, collective);
    cuda::DeviceGuard on(s.site.device);
    auto start = begin(collective, after);
    s.run([&](ncclComm_t c) { return ncclAllReduce(data, data, count, type, detail::to_nccl_op(op), c, stream()); },
          "ncclAllReduce(data, data, count, dtype, op, comm, stream)", __FILE__, __LINE__, collective, start);
    return finish(collective, start, std::move(keep_alive));
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
    check_pointer(data, count, "broadcast");
    cuda::DeviceGuard on(s.site.device);
    auto start = begin("broadcast", after);
    s.run([&](ncclComm_t c) { return ncclBroadcast(data, data, count, type, root, c, stream()); },
          "ncclBroadcast(data, data, count, dtype, root, comm, stream)", __FILE__, __LINE__, "broadcast", start);
    return finish("broadcast", start, std::move(keep_alive));
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
    check_pointer(send, count, "all_gather");
    check_pointer(recv, count, "all_gather");
    cuda::DeviceGuard on(s.site.device);
    auto start = begin("all_gather", after);
    s.run([&](ncclComm_t c) { return ncclAllGather(send, recv, count, type, c, stream()); },
          "ncclAllGather(send, recv, count, dtype, comm, stream)", __FILE__, __LINE__, "all_gather", start);
    return finish("all_gather", start, std::move(keep_alive));
  }

  // ---- lifecycle ------------------------------------------------------------------------------

  /// ncclCommAbort now: outstanding collectives are cancelled; later calls throw CommError.
  /// Thread-safe: a watchdog thread may call it while another thread waits in a collective (that
  /// wait then throws CommError "aborted while this collective was pending"); see
  /// detail::BasicNcclState for the locking. Idempotent.
  void abort() noexcept { state_->abort("abort() called"); }
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

  static ncclUniqueId exchange_id(c10d::Store& store, int rank, int world_size, const NcclOptions& options) {
    check_rank(rank, world_size);
    const auto n = detail::nccl_comm_sequence().fetch_add(1);
    const std::string key = fmt::format("{}/{}/unique_id", options.store_prefix, n);
    if (rank == 0) {
      ncclUniqueId id{};
      const ncclResult_t rc = ncclGetUniqueId(&id);
      if (rc != ncclSuccess)
        detail::throw_nccl_error(rc, "ncclGetUniqueId(&id)", __FILE__, __LINE__, nullptr, {rank, world_size, options.device});
      detail::publish_unique_id(store, key, id);
      return id;
    }
    return detail::fetch_unique_id(store, key, rank, options.timeout);
  }

  void check_tensor(const at::Tensor& t, std::string_view collective) const { detail::check_nccl_tensor(t, device_index(), collective); }

  static void check_pointer(const void* p, std::size_t count, std::string_view collective) {
    if (p == nullptr && count > 0)
      throw InvalidArgument(fmt::format("{}: null device pointer for {} elements", collective, count));
  }

  /// LibTorch's current stream on t's device (what produced t); without a CUDA LibTorch no CUDA
  /// tensor exists and check_tensor has thrown before this is reached.
  [[nodiscard]] cudaStream_t producer_stream([[maybe_unused]] const at::Tensor& t) const {
#if LOOM_TORCH_HAS_CUDA
    return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
#else
    return stream();
#endif
  }

  /// Tells LibTorch's caching allocator that the communicator's stream uses t's memory.
  void record_use([[maybe_unused]] const at::Tensor& t) const {
#if LOOM_TORCH_HAS_CUDA
    t.record_stream(c10::cuda::getStreamFromExternal(stream(), t.device().index()).unwrap());
#endif
  }

  /// Checks the state and orders the communicator's stream after `after` (the caller holds a
  /// DeviceGuard for the communicator's device).
  std::chrono::steady_clock::time_point begin(std::string_view collective, cudaStream_t after) {
    auto& s = *state_;
    s.ensure_live(collective);
    if (after != stream()) {
      s.ready->record(after);
      s.ready->block(stream());
    }
    return std::chrono::steady_clock::now();
  }

  NcclWork finish(std::string_view collective, std::chrono::steady_clock::time_point start, at::Tensor keep_alive) {
    cuda::Event done(state_->site.device);
    done.record(stream());
    return NcclWork(state_, std::move(done), collective, start, std::move(keep_alive));
  }

  std::shared_ptr<detail::NcclState> state_;
};

static_assert(AsyncCommunicator<NcclCommunicator>, "NcclCommunicator must model loom::AsyncCommunicator");
static_assert(WorkHandle<NcclWork>, "NcclWork must model loom::WorkHandle");

}  // namespace loom
