// loom/comm/detail/gloo_work.hpp — GlooWork, the handle of a pending Gloo collective that
// GlooCommunicator's calls return: its wait, which watches this rank's Gloo connections while Gloo
// waits (a peer gone ends the wait with a CommError naming it, not at the timeout), and the loom
// error a Gloo failure becomes, with the flight recorder's verdict. Not a public header:
// loom/comm/gloo.hpp is (its header comment describes timeouts, closed connections and the verdict),
// and GlooWork is named loom::GlooWork like the communicator's other types.
//
// Example: `auto w = comm.all_reduce_async(t, loom::ReduceOp::sum); ...; w.wait();`
// Throws (wait): loom::TimeoutError naming collective, rank and seconds; loom::CommError.
// Source: c10d's Work (copies share one pending state); gloo/transport/tcp/pair.cc for what Gloo
//         fails by itself when a connection ends.
#pragma once

#include <loom/config.hpp>

#if LOOM_HAS_GLOO && defined(USE_C10D_GLOO)

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>

#include <c10/util/intrusive_ptr.h>
#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <loom/comm/detail/gloo_connect.hpp>
#include <loom/comm/detail/gloo_group.hpp>
#include <loom/comm/detail/gloo_peers.hpp>
#include <loom/comm/detail/trace_exchange.hpp>
#include <loom/detail/exception_text.hpp>
#include <loom/detail/host_and_pid.hpp>
#include <loom/error.hpp>
#include <loom/launch/detail/check_in.hpp>

namespace loom {

class GlooCommunicator;

/// A pending Gloo collective; `wait()` finishes it (and applies avg's division / bfloat16's
/// copy-back). Models WorkHandle. Copies share one pending state (like c10d::Work), so waiting on
/// two copies finishes the collective once; after a failure every wait() rethrows the same error.
///
/// Example: `auto w = comm.all_reduce_async(t, loom::ReduceOp::sum); ...; w.wait();`
/// Throws (wait): loom::TimeoutError naming collective, rank and seconds; loom::CommError.
class GlooWork {
 public:
  /// An empty handle: already complete.
  GlooWork() = default;

  /// Blocks until the collective finished; idempotent.
  void wait() {
    if (!state_) return;
    State& s = *state_;
    if (s.error) std::rethrow_exception(s.error);
    if (s.done) return;
    const auto start = std::chrono::steady_clock::now();
    const std::shared_ptr<detail::TraceExchange> trace = s.trace.lock();  // null once the communicator is gone
    if (trace) trace->recorder().waiting(s.seq);
    // Gloo enforces the timeout itself; the margin only guards against a stuck worker thread.
    const auto deadline = start + s.timeout + std::chrono::seconds(5);
    std::string lost;
    try {
      lost = wait_watching_connections(s, deadline);
    } catch (const std::exception&) {
      // (allocation failures) Gloo's own wait below still ends the collective.
    }
    if (!lost.empty()) fail(s, lost, start, trace);
    try {
      s.work->wait(
          std::max(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()),
                   std::chrono::milliseconds(1)));
      s.done = true;
      if (trace && s.completes_entry) trace->recorder().complete(s.seq);
      if (s.finish) s.finish();
    } catch (const std::exception& e) {
      fail(s, detail::exception_text(e), start, trace);
    }
  }

  /// Whether wait() would return at once.
  [[nodiscard]] bool is_completed() const {
    return !state_ || state_->done || state_->error || state_->work->isCompleted();
  }

 private:
  friend class GlooCommunicator;

  struct State {
    c10::intrusive_ptr<c10d::Work> work;
    std::string collective;
    int rank = 0;
    int world_size = 1;
    std::chrono::milliseconds timeout{0};
    std::function<void()> finish;
    std::shared_ptr<const detail::GlooPeerTable> peers;
    std::shared_ptr<detail::GlooGroupState> group;  ///< the communicator's failure flag and running count
    std::weak_ptr<detail::TraceExchange> trace;     ///< the communicator's flight recorder and dump
    std::int64_t seq = -1;                          ///< this collective's flight-record entry
    bool completes_entry = true;                    ///< false for the metadata check's gather
    std::chrono::steady_clock::time_point issued{};
    bool done = false;
    std::exception_ptr error;
  };

  GlooWork(c10::intrusive_ptr<c10d::Work> work, std::string collective, int rank, int world_size,
           std::chrono::milliseconds timeout, std::function<void()> finish,
           std::shared_ptr<const detail::GlooPeerTable> peers, std::shared_ptr<detail::GlooGroupState> group,
           std::shared_ptr<detail::TraceExchange> trace, std::int64_t seq)
      : state_(std::make_shared<State>(State{std::move(work), std::move(collective), rank, world_size, timeout,
                                             std::move(finish), std::move(peers), std::move(group), std::move(trace),
                                             seq, true, std::chrono::steady_clock::now(), false, nullptr})) {}

  /// How often a wait looks at the connections; how long a collective may still end by itself
  /// once one of them was closed.
  static constexpr auto kWatchInterval = std::chrono::milliseconds(50);
  static constexpr auto kClosedGrace = std::chrono::milliseconds(1000);

  /// Waits until the collective finished (successfully or not: wait() then reads which) or `deadline`,
  /// and returns ""; or returns the text of the failure when Gloo closed one of this rank's
  /// connections and the collective did not end by itself: kClosedGrace later when no connection is
  /// left open (two ranks, or every peer gone), else only once no data arrived on the open ones for
  /// a tenth of the timeout (at least kClosedGrace; a broadcast: never): a peer that finished the
  /// collective and exited leaves the others to end it. Gloo fails the operations it has queued on
  /// a connection that ended, but not a receive whose message it was reading then
  /// (gloo/transport/tcp/pair.cc, signalException): that one would wait for the whole timeout.
  static std::string wait_watching_connections(State& s, std::chrono::steady_clock::time_point deadline) {
    if (!s.peers || s.peers->connections() == 0 || s.work->isCompleted()) return {};
    c10::intrusive_ptr<c10::ivalue::Future> future;
    try {
      future = s.work->getFuture();
    } catch (const std::exception&) {
      return {};  // a work without a future: Gloo's own wait alone
    }
    if (!future) return {};
    struct Done {
      std::mutex m;
      std::condition_variable cv;
      bool done = false;
    };
    auto done = std::make_shared<Done>();
    future->addCallback([done](c10::ivalue::Future&) {
      {
        std::lock_guard<std::mutex> lock(done->m);
        done->done = true;
      }
      done->cv.notify_all();
    });
    const auto quiet_needed = std::max<std::chrono::milliseconds>(kClosedGrace, s.timeout / 10);
    const bool broadcast = s.collective == "broadcast";
    std::optional<std::chrono::steady_clock::time_point> closed_at;
    std::unique_lock<std::mutex> lock(done->m);
    for (;;) {
      if (done->cv.wait_for(lock, kWatchInterval, [&] { return done->done; })) return {};
      lock.unlock();  // the completion callback must not wait for the checks
      const auto now = std::chrono::steady_clock::now();
      if (now >= deadline) return {};
      const auto connections = s.peers->now();
      lock.lock();
      if (!connections.closed) continue;
      if (!closed_at) closed_at = now;
      if (now - *closed_at < kClosedGrace) continue;
      // A broadcast's receivers may finish and exit before a slow one joined: with connections left,
      // only the peers gone can say it will not end.
      if (connections.open > 0 && (broadcast || std::chrono::milliseconds(connections.quiet_ms) < quiet_needed))
        continue;
      return fmt::format(
          "Connection closed by peer [{}]:{} (seen by loom: Gloo closed this rank's connection to it after an error "
          "{:.3f} s ago, and the collective still waits on it)",
          connections.closed->remote.ip, connections.closed->remote.port,
          std::chrono::duration<double>(now - *closed_at).count());
    }
  }

  /// Records the failure (text: Gloo's or loom's), ends every connection of this rank, and throws the
  /// loom error.
  [[noreturn]] static void fail(State& s, const std::string& text, std::chrono::steady_clock::time_point start,
                                const std::shared_ptr<detail::TraceExchange>& trace) {
    const double waited = detail::seconds_since(start);
    const double since_issue = detail::seconds_since(s.issued);
    // The communicator is broken now: end every connection, so the peers fail at once naming
    // this rank, and this rank's queued collectives do not wait for their timeouts.
    if (s.group) s.group->broken = true;
    if (s.peers) s.peers->shutdown_connections();
    std::string verdict;
    if (trace) {
      trace->recorder().fail(s.seq);
      verdict = trace->on_failure(what_of(error_for(s, text, waited, since_issue, "")));
    }
    s.error = error_for(s, text, waited, since_issue, verdict);
    std::rethrow_exception(s.error);
  }

  static std::string what_of(const std::exception_ptr& e) {
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& x) {
      return x.what();
    }
  }

  /// "peer rank p" when Gloo's message names one of this rank's connections or when there is only one
  /// peer; "a peer" otherwise.
  static std::string peer_of(const State& s, const std::string& text) {
    int peer = s.peers ? s.peers->rank_named_in(text) : -1;
    if (peer < 0 && s.world_size == 2) peer = 1 - s.rank;
    return peer >= 0 ? fmt::format("peer rank {}", peer) : std::string("a peer (Gloo's message names none)");
  }

  /// Turns a Gloo failure into loom's error: a timeout is a TimeoutError; a vanished peer (a closed or
  /// reset connection) is a CommError naming it, not a timeout: nobody waited for anything. `verdict`
  /// (the flight recorder's, or empty) ends the message.
  static std::exception_ptr error_for(const State& s, const std::string& text, double waited, double since_issue,
                                      const std::string& verdict) {
    const std::string where = fmt::format("rank {}/{} on {}", s.rank, s.world_size, detail::host_and_pid());
    if (detail::mentions_timeout(text))
      return std::make_exception_ptr(
          TimeoutError(s.collective, s.rank, since_issue,
                       fmt::format("no answer from {} within the {:.3f} s timeout ({}; Gloo: {}){}", peer_of(s, text),
                                   s.timeout.count() / 1000.0, where, text, verdict)));
    if (detail::mentions_peer_gone(text))
      return std::make_exception_ptr(CommError(
          fmt::format("{} failed on rank {}: {} closed its connection (it exited, crashed or gave up after an error "
                      "of its own), so the collective can never complete ({}; Gloo: {}){}",
                      s.collective, s.rank, peer_of(s, text), where, text, verdict)));
    return std::make_exception_ptr(CommError(fmt::format("{} failed on {} after {:.3f} s ({}): {}{}", s.collective,
                                                         where, waited, peer_of(s, text), text, verdict)));
  }

  std::shared_ptr<State> state_;
};

}  // namespace loom

#endif  // LOOM_HAS_GLOO && USE_C10D_GLOO
