// loom/comm/detail/nccl_state.hpp — the lifecycle of one NCCL communicator (live, finalized,
// destroyed, aborted) shared by NcclCommunicator and its work handles, with its thread-safety
// rules, and the NcclApi seam through which the host tests drive it without a GPU (used by
// loom/comm/nccl.hpp).
//
// Example: `auto s = std::make_shared<loom::detail::NcclState>(); ... s->abort("watchdog");`
// Throws: see BasicNcclState's members (loom::TimeoutError, loom::CommError, loom::NcclError).
// Source: abort-on-timeout and the non-blocking init of torch.distributed's ProcessGroupNCCL,
//         on NCCL's public API ("Fault tolerance" in NCCL's documentation).
#pragma once

#include <loom/config.hpp>

#if LOOM_HAS_NCCL

#include <atomic>
#include <chrono>
#include <cstdio>
#include <exception>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>

#include <fmt/format.h>
#include <nccl.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <loom/comm/detail/nccl_error.hpp>
#include <loom/cuda/buffer.hpp>
#include <loom/cuda/device.hpp>
#include <loom/cuda/error.hpp>
#include <loom/cuda/stream.hpp>
#include <loom/error.hpp>

namespace loom::detail {

/// The NCCL calls the communicator's lifecycle makes, as static functions: the seam through which
/// tests drive BasicNcclState's state machine without a GPU (tests/gpu/test_gpu_host.cpp).
struct NcclApi {
  using DeviceGuard = cuda::DeviceGuard;
  static ncclResult_t get_async_error(ncclComm_t comm, ncclResult_t* state) {
    return ncclCommGetAsyncError(comm, state);
  }
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
  ncclComm_t comm = nullptr;              // guarded by mutex
  std::atomic<Phase> phase{Phase::live};  // written with mutex held
  std::string abort_reason;               // guarded by mutex
  // Set before the state is shared, constant afterwards:
  NcclSite site;
  std::chrono::milliseconds timeout{};
  std::chrono::microseconds poll_interval{};
  std::optional<cuda::Stream> stream;
  std::optional<cuda::Event> ready;  // re-recorded on the producer stream before each collective (one calling thread)
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
          throw CommError(fmt::format("{} on rank {}: the NCCL communicator was aborted while {} was in progress ({})",
                                      what, site.rank, text,
                                      phase == Phase::aborted ? abort_reason : std::string("finalized/destroyed")));
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
  [[noreturn]] void time_out(std::string_view what, std::chrono::steady_clock::time_point start,
                             const std::string& detail) {
    const std::chrono::duration<double> waited = std::chrono::steady_clock::now() - start;
    std::string d = fmt::format(
        "{}; timeout {} ms, world size {}, device {}; the NCCL communicator was aborted (create a new one to continue)",
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
          throw CommError(
              fmt::format("{} on rank {}: the NCCL communicator was aborted while this collective was pending ({})",
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
    if (spins < 64)
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(poll_interval);
  }

  /// Throws loom::CommError when the communicator can no longer run collectives.
  void ensure_live(std::string_view what) const {
    std::lock_guard lk(mutex);
    ensure_live_locked(what);
  }

  /// ncclCommAbort: stops outstanding work, frees resources, never blocks on peers. The first
  /// call's reason is kept; later calls and calls after destroy() do nothing. The state turns
  /// `aborted` (and `comm` null) under the lock, and ncclCommAbort runs after the lock is released:
  /// it can block until the device is idle (NCCL frees device memory), for example behind a stalled
  /// input stream, and a thread polling a pending collective must see the abort at once rather
  /// than wait for the device. No other thread calls NCCL on the communicator once it is aborted.
  void abort(std::string reason) noexcept {
    ncclComm_t doomed = nullptr;
    {
      std::lock_guard lk(mutex);
      const Phase p = phase.load();
      if (p == Phase::aborted || p == Phase::destroyed) return;
      doomed = comm;
      comm = nullptr;
      abort_reason = std::move(reason);
      phase = Phase::aborted;
    }
    if (doomed != nullptr) (void)Api::abort(doomed);
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
    run([](ncclComm_t c) { return Api::finalize(c); }, "ncclCommFinalize(comm)", __FILE__, __LINE__, "nccl_finalize",
        start);
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
      throw NcclError(rc, format_nccl_error(rc, "ncclCommDestroy(comm)", __FILE__, __LINE__,
                                            last != nullptr ? last : "", nccl_runtime_version(), site));
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
      std::fprintf(stderr, "loom: warning: NcclCommunicator teardown on rank %d failed (%s); aborted instead\n",
                   site.rank, e.what());
      abort(e.what());
    }
  }

 private:
  void ensure_live_locked(std::string_view what) const {
    switch (phase.load()) {
      case Phase::live: return;
      case Phase::aborted:
        throw CommError(fmt::format("{} on rank {}: the NCCL communicator was aborted earlier ({})", what, site.rank,
                                    abort_reason));
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
    std::string message =
        format_nccl_error(rc, call, file, line, last != nullptr ? last : "", nccl_runtime_version(), site);
    abort_locked(message);
    throw NcclError(rc, message + "; the communicator was aborted");
  }
};

/// The state NcclCommunicator uses: the real NCCL calls.
using NcclState = BasicNcclState<NcclApi>;

/// Gives `s` its stream (`stream`, the caller's, or a new non-blocking one on s.site.device) and its
/// ready event, and joins the NCCL communicator of `id` as s.site's rank (ncclCommInitRankConfig; in
/// non-blocking mode init is polled until done, at most s.timeout). The caller holds a DeviceGuard for
/// s.site.device and has set s.site, s.timeout, s.poll_interval and s.name.
/// Throws: loom::NcclError (init failed), loom::TimeoutError("nccl_init"), loom::CudaError.
inline void init_nccl_comm(NcclState& s, const ncclUniqueId& id, cudaStream_t stream, bool nonblocking) {
  s.stream = stream != nullptr ? cuda::Stream::borrow(stream, s.site.device) : cuda::Stream::create(s.site.device);
  s.ready.emplace(s.site.device);

  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = nonblocking ? 0 : 1;
  if (!s.name.empty()) config.commName = s.name.c_str();
  const auto start = std::chrono::steady_clock::now();
  // No other thread can see the state yet: init writes s.comm without the lock.
  const ncclResult_t rc = ncclCommInitRankConfig(&s.comm, s.site.world_size, id, s.site.rank, &config);
  if (rc != ncclSuccess && rc != ncclInProgress && s.comm == nullptr)
    throw_nccl_error(rc, "ncclCommInitRankConfig(&comm, world_size, id, rank, &config)", __FILE__, __LINE__, nullptr,
                     s.site);
  if (rc != ncclSuccess && rc != ncclInProgress)
    s.fail(rc, "ncclCommInitRankConfig(&comm, world_size, id, rank, &config)", __FILE__, __LINE__);
  // Non-blocking: init may still run in NCCL's threads even after ncclSuccess; poll its state.
  if (rc == ncclInProgress || nonblocking)
    s.poll_in_progress("ncclCommInitRankConfig(&comm, world_size, id, rank, &config)", __FILE__, __LINE__, "nccl_init",
                       start);
}

}  // namespace loom::detail

#endif  // LOOM_HAS_NCCL
