// loom/comm/detail/nccl_trace.hpp — NcclCommunicator's flight recorder: the recorder and its
// exchange over the job's store, whose stuck-collective probe aborts the communicator, and a
// collective's error with the recorder's verdict appended (used by loom/comm/nccl.hpp and NcclWork;
// its header comment describes what the recorder does for NCCL).
//
// Example: `trace_ = detail::start_nccl_flight_recorder(state_, "loom/nccl", timeout, 4096, "", store, n);`
// Throws: rethrow_with_flight_record rethrows the error it is given (with the verdict appended).
// Source: PyTorch's NCCL flight recorder (a per-rank ring of collectives dumped on failure).
#pragma once

#include <loom/config.hpp>

#if LOOM_HAS_NCCL

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <utility>

#include <c10/util/intrusive_ptr.h>
#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <loom/comm/detail/nccl_error.hpp>
#include <loom/comm/detail/nccl_state.hpp>
#include <loom/comm/detail/store_side.hpp>
#include <loom/comm/detail/trace_exchange.hpp>
#include <loom/cuda/error.hpp>
#include <loom/detail/host_and_pid.hpp>
#include <loom/detail/process_counter.hpp>
#include <loom/error.hpp>
#include <loom/trace/recorder.hpp>

namespace loom::detail {

/// Rethrows the CommError `error` of flight-record entry `seq` with the flight recorder's verdict
/// appended (TimeoutError stays a TimeoutError, NcclError and CudaError keep their codes); any other exception
/// propagates unchanged.
[[noreturn]] inline void rethrow_with_flight_record(const std::exception_ptr& error, TraceExchange& trace,
                                                    std::int64_t seq) {
  try {
    std::rethrow_exception(error);
  } catch (const TimeoutError& e) {
    trace.recorder().fail(seq);
    const std::string text = e.what();
    const std::string verdict = trace.on_failure(text);
    // TimeoutError's message is "<collective> timed out on rank <r> after <s> s: <detail>".
    const std::string head = TimeoutError(e.collective(), e.rank(), e.seconds_waited()).what();
    std::string detail = text.size() > head.size() + 2 ? text.substr(head.size() + 2) : std::string{};
    detail += detail.empty() && verdict.rfind("; ", 0) == 0 ? verdict.substr(2) : verdict;
    throw TimeoutError(e.collective(), e.rank(), e.seconds_waited(), detail);
  } catch (const NcclError& e) {
    trace.recorder().fail(seq);
    throw NcclError(e.code(), e.what() + trace.on_failure(e.what()));
  } catch (const CudaError& e) {
    trace.recorder().fail(seq);
    throw CudaError(e.code(), e.what() + trace.on_failure(e.what()));
  } catch (const CommError& e) {
    trace.recorder().fail(seq);
    throw CommError(e.what() + trace.on_failure(e.what()));
  }
}

/// The flight recorder of the communicator whose state is `nccl`, and its exchange; the exchange's
/// keys live under "<store_prefix>/<n>/" in `store` (none without a store: then a failure writes this
/// rank's record only). `timeout`, `capacity` and `folder` are NcclOptions' timeout, trace_capacity and
/// trace_folder.
inline std::shared_ptr<TraceExchange> start_nccl_flight_recorder(
    const std::shared_ptr<NcclState>& nccl, const std::string& store_prefix, std::chrono::milliseconds timeout,
    std::size_t capacity, const std::string& folder, c10::intrusive_ptr<c10d::Store> store, std::int64_t n) {
  const NcclSite& site = nccl->site;
  c10::intrusive_ptr<c10d::Store> prefixed;
  c10::intrusive_ptr<c10d::Store> side;
  if (store && n >= 0) {
    prefixed = c10::make_intrusive<c10d::PrefixStore>(fmt::format("{}/{}", store_prefix, n), std::move(store));
    try {
      side = second_connection(prefixed, timeout);
    } catch (const std::exception&) {
      side = prefixed;  // no second connection: the watcher shares the first (NCCL does not wait on it)
    }
  }
  auto recorder = std::make_shared<trace::FlightRecorder>(site.rank, site.world_size, host_and_pid(), capacity);
  std::weak_ptr<NcclState> state = nccl;
  auto trace = std::make_shared<TraceExchange>(
      recorder, std::move(prefixed), std::move(side), timeout, folder,
      [state] {
        if (auto s = state.lock())
          s->abort("the flight recorder found that the ranks issued different collectives under one number");
      },
      static_cast<int>(next_in_process(Counted::flight_recorder)));
  trace->start_watcher();
  std::weak_ptr<TraceExchange> weak = trace;
  recorder->set_failure_handler([weak](const std::string& error) {
    auto t = weak.lock();
    return t ? t->on_failure(error) : std::string{};
  });
  return trace;
}

}  // namespace loom::detail

#endif  // LOOM_HAS_NCCL
