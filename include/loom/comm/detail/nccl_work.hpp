// loom/comm/detail/nccl_work.hpp — NcclWork, the handle of an asynchronous NCCL collective that
// NcclCommunicator's calls return: its completion event, the buffer it keeps alive, its wait (bounded
// by the communicator's timeout, then the communicator is aborted) and its flight-record entry; and
// the steps of issuing one (record it, order the communicator's stream after the producer's, make
// the handle; a CommError on the way carries the flight recorder's verdict).
// Not a public header: loom/comm/nccl.hpp is, and NcclWork is named loom::NcclWork like the
// communicator's other types.
//
// Example: `auto work = comm.all_reduce_async(bucket, loom::ReduceOp::sum); ...; work.wait();`
// Throws (wait): loom::TimeoutError naming the collective, rank and seconds waited; loom::NcclError.
// Source: the CUDA-event completion of torch.distributed's ProcessGroupNCCL work objects.
#pragma once

#include <loom/config.hpp>

#if LOOM_HAS_NCCL

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <string_view>
#include <utility>

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <loom/comm/detail/nccl_state.hpp>
#include <loom/comm/detail/nccl_trace.hpp>
#include <loom/comm/detail/trace_exchange.hpp>
#include <loom/cuda/stream.hpp>
#include <loom/error.hpp>
#include <loom/trace/recorder.hpp>

namespace loom {

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
  /// `trace`, `seq`: the communicator's flight recorder and this collective's entry in it (none:
  /// empty and -1).
  NcclWork(std::shared_ptr<detail::NcclState> state, cuda::Event done, std::string_view collective,
           std::chrono::steady_clock::time_point start, at::Tensor keep_alive = {},
           std::weak_ptr<detail::TraceExchange> trace = {}, std::int64_t seq = -1)
      : state_(std::move(state)),
        pending_(std::make_shared<Pending>(Pending{std::move(done), std::string(collective), start,
                                                   std::move(keep_alive), std::move(trace), seq, nullptr, false})) {}

  /// Blocks the host until the collective finished, at most the communicator's timeout after it
  /// was issued; then aborts the communicator and throws loom::TimeoutError (with the flight
  /// recorder's verdict, see the file comment).
  /// After a failure every wait() (on this handle or a copy) rethrows the same error.
  void wait() {
    if (pending_->finished) return;
    if (pending_->error) std::rethrow_exception(pending_->error);
    const std::shared_ptr<detail::TraceExchange> trace = pending_->trace.lock();  // null once the communicator is gone
    if (trace) trace->recorder().waiting(pending_->seq);
    try {
      try {
        state_->wait_event([this] { return pending_->done.query(); }, pending_->collective, pending_->start);
      } catch (const CommError&) {
        if (!trace) throw;
        detail::rethrow_with_flight_record(std::current_exception(), *trace, pending_->seq);
      }
    } catch (...) {
      pending_->error = std::current_exception();
      throw;
    }
    if (trace) trace->recorder().complete(pending_->seq);
    pending_->finished = true;
    pending_->keep = at::Tensor();
  }
  /// Whether the collective has finished (no blocking). After an abort it may be true for a
  /// collective whose wait() then throws CommError (the data is not known to be complete).
  /// A collective seen complete here is marked completed in the flight record too (a handle only
  /// polled, or only used through block(), is never waited for).
  [[nodiscard]] bool is_completed() const {
    if (pending_->finished) return true;
    if (!pending_->done.query()) return false;
    if (state_->phase.load() == detail::NcclState::Phase::live)
      if (const auto trace = pending_->trace.lock()) trace->recorder().complete(pending_->seq);
    return true;
  }
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
    at::Tensor keep;                             // the buffer the collective reads/writes, alive until it finished
    std::weak_ptr<detail::TraceExchange> trace;  // the communicator's flight recorder
    std::int64_t seq = -1;                       // this collective's flight-record entry
    std::exception_ptr error;                    // the first wait()'s error, rethrown by later waits
    bool finished = false;
  };
  std::shared_ptr<detail::NcclState> state_;
  std::shared_ptr<Pending> pending_;  // shared by copies: they all refer to the same collective
};

namespace detail {

/// The flight-record entry of a collective (-1 without a recorder, `trace` null).
inline std::int64_t record_collective(TraceExchange* trace, trace::Op op, c10::ScalarType dtype,
                                      std::size_t count) noexcept {
  return trace ? trace->recorder().issue(op, dtype, static_cast<std::int64_t>(count)) : -1;
}

/// Runs `start` (which enqueues collective `seq` and returns its handle); a CommError from it
/// (the communicator aborted earlier, NCCL refused the call, a non-blocking enqueue timed out)
/// marks the entry failed and carries the flight recorder's verdict (`trace`; null: none).
template <class Start>
NcclWork recorded(TraceExchange* trace, std::int64_t seq, Start&& start) {
  if (!trace) return start();
  try {
    return start();
  } catch (const CommError&) {
    rethrow_with_flight_record(std::current_exception(), *trace, seq);
  }
}

/// Checks the state and orders the communicator's stream after `after` (the caller holds a
/// DeviceGuard for the communicator's device); returns when the collective begins.
inline std::chrono::steady_clock::time_point begin_collective(NcclState& s, std::string_view collective,
                                                              cudaStream_t after) {
  s.ensure_live(collective);
  if (after != s.stream->get()) {
    s.ready->record(after);
    s.ready->block(s.stream->get());
  }
  return std::chrono::steady_clock::now();
}

/// The handle of collective `seq`, just enqueued on the communicator's stream: its completion event,
/// recorded there.
inline NcclWork finish_collective(const std::shared_ptr<NcclState>& state, const std::shared_ptr<TraceExchange>& trace,
                                  std::string_view collective, std::chrono::steady_clock::time_point start,
                                  at::Tensor keep_alive, std::int64_t seq) {
  cuda::Event done(state->site.device);
  done.record(state->stream->get());
  return NcclWork(state, std::move(done), collective, start, std::move(keep_alive), trace, seq);
}

}  // namespace detail

}  // namespace loom

#endif  // LOOM_HAS_NCCL
