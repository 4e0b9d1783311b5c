// loom/comm/detail/gloo_connect.hpp — how GlooCommunicator joins its peers: the prefixed store, the
// join watch (a peer that fails to join says so, and every other rank stops at once instead of
// waiting out the timeout; gloo_join.hpp), the Gloo device (gloo_device.hpp), the c10d
// ProcessGroupGloo built on a helper thread while this rank watches for a peer's failure report,
// the peer table (gloo_peers.hpp), and the errors that name what went wrong and where.
// Not a public header: loom/comm/gloo.hpp is.
#pragma once

#include <loom/config.hpp>

#if LOOM_HAS_GLOO && defined(USE_C10D_GLOO)

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <c10/util/intrusive_ptr.h>
#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/version.h>

#include <loom/comm/detail/gloo_device.hpp>
#include <loom/comm/detail/gloo_join.hpp>
#include <loom/comm/detail/gloo_peers.hpp>
#include <loom/detail/exception_text.hpp>
#include <loom/detail/host_and_pid.hpp>
#include <loom/detail/process_counter.hpp>
#include <loom/error.hpp>
#include <loom/launch/detail/check_in.hpp>

namespace loom::detail {

/// True when a Gloo message says a peer's socket went away.
inline bool mentions_peer_gone(const std::string& text) {
  for (const char* s : {"closed by peer", "reset by peer", "Broken pipe", "Connection refused", "EOF"})
    if (text.find(s) != std::string::npos) return true;
  return false;
}

/// What connect_gloo hands to the communicator.
struct GlooConnection {
  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg;  ///< the connected process group
  std::shared_ptr<const GlooPeerTable> peers;     ///< which peer rank each Gloo socket belongs to
  std::string device;                             ///< the device's address and why (GlooDeviceChoice)
  c10::intrusive_ptr<c10d::Store> store;          ///< the communicator's prefixed store
  c10::intrusive_ptr<c10d::Store> side;           ///< a second connection to it (or `store` itself)
  int index = 0;                                  ///< n of the prefix "loom/gloo/<n>"
};

/// Connects this rank's Gloo process group to its `world_size - 1` peers through `store` (prefixed
/// "loom/gloo/<n>", n counting the communicators of this process). `interface`, `threads` and
/// `timeout` are GlooOptions' fields; `master_addr` feeds the device rule.
/// Throws: loom::ConfigError (an interface this host does not have), loom::CommError (the device
///         could not be created; a peer reported that it failed to join, at once, naming it; a
///         backend failure; a peer that closed its connection while connecting),
///         loom::TimeoutError("connect", ...) when a peer does not connect within `timeout`. Every failure is reported to the peers through the join watch before it is thrown.
inline GlooConnection connect_gloo(c10::intrusive_ptr<c10d::Store> store, int rank, int world_size,
                                   const std::string& interface, int threads, std::chrono::milliseconds timeout,
                                   const std::string& master_addr) {
  GlooConnection connection;
  const auto start = std::chrono::steady_clock::now();
  connection.index = static_cast<int>(next_in_process(Counted::gloo_communicator));
  const auto prefixed =
      c10::make_intrusive<c10d::PrefixStore>(fmt::format("loom/gloo/{}", connection.index), std::move(store));
  c10::intrusive_ptr<c10d::Store> side = prefixed;
  if (world_size > 1) {
    try {
      side = second_connection(prefixed, timeout);
    } catch (const std::exception&) {
      side = prefixed;  // no second connection: failures are still seen, once Gloo's waits end
    }
  }
  JoinWatch watch(prefixed, side, world_size);
  const auto report_wait = std::min<std::chrono::milliseconds>(timeout, std::chrono::seconds(2));
  const std::string me = fmt::format("rank {} ({})", rank, host_and_pid());

  // The device: which address this rank listens on and advertises (loom/comm/detail/gloo_device.hpp).
  // The sockets this process has before Gloo makes its own: the peer table is the difference.
  auto sockets_before = std::make_shared<const std::vector<GlooProcessSocket>>(GlooPeerTable::snapshot());
  auto pg_options = c10d::ProcessGroupGloo::Options::create(timeout);
  pg_options->threads = threads;
  try {
    const auto choice = choose_gloo_device(interface, std::getenv("GLOO_SOCKET_IFNAME"), master_addr);
    connection.device = choice.describe();
    try {
      pg_options->devices = make_gloo_devices(choice);
    } catch (const std::exception& e) {
      throw CommError(fmt::format("GlooCommunicator: rank {}/{} could not create its Gloo device on {} ({}): {}", rank,
                                  world_size, connection.device, host_and_pid(), exception_text(e)));
    }
  } catch (const Error& e) {
    watch.report_failure(fmt::format("{} failed to join: {}", me, e.what()), report_wait);
    throw;
  }

  // Connect. Other ranks connect on a helper thread while this one looks for a peer's failure report.
  struct Job {
    std::mutex m;
    std::condition_variable cv;
    bool done = false;
    std::exception_ptr error;
    c10::intrusive_ptr<c10d::ProcessGroupGloo> pg;
    std::shared_ptr<const GlooPeerTable> peers;
  };
  auto job = std::make_shared<Job>();
  auto connect = [job, prefixed, rank, world_size, pg_options, sockets_before, timeout]() {
    c10::intrusive_ptr<c10d::ProcessGroupGloo> pg;
    std::shared_ptr<const GlooPeerTable> peers;
    std::exception_ptr error;
    try {
      pg = c10::make_intrusive<c10d::ProcessGroupGloo>(prefixed, rank, world_size, pg_options);
      peers = std::make_shared<const GlooPeerTable>(GlooPeerTable::build(
          *pg, *prefixed, static_cast<int>(pg_options->devices.size()), *sockets_before, rank, world_size, timeout));
    } catch (...) {
      error = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lock(job->m);
      job->pg = std::move(pg);
      job->peers = std::move(peers);
      job->error = error;
      job->done = true;
    }
    job->cv.notify_all();
  };
  auto peer_failed = [&](const std::string& line, const std::string& own) {
    return CommError(
        fmt::format("GlooCommunicator: rank {}/{} stopped waiting for its peers after {:.3f} s because "
                    "{}{}{}",
                    rank, world_size, seconds_since(start), line, own.empty() ? "" : "; this rank's own error: ", own));
  };
  if (world_size == 1) {
    connect();
  } else {
    std::thread helper(connect);
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(job->m);
        if (job->cv.wait_for(lock, JoinWatch::kPollInterval, [&] { return job->done; })) break;
      }
      if (auto line = watch.failure()) {
        // The helper may wait in Gloo until its own timeout; it owns what it uses and ends by itself.
        helper.detach();
        watch.linger(report_wait);
        throw peer_failed(*line, "");
      }
    }
    helper.join();
  }
  if (job->error) {
    const std::string text = exception_text(job->error);
    // A peer that failed first explains this rank's failure better than the symptom seen here.
    if (auto line = watch.failure()) {
      watch.linger(report_wait);
      throw peer_failed(*line, text);
    }
    const double waited = seconds_since(start);
    const std::string advertised = fmt::format("this rank's Gloo address: {}", connection.device);
    if (mentions_timeout(text)) {
      TimeoutError error("connect", rank, waited,
                         fmt::format("Gloo could not connect all {} ranks (rank {} on {}; {}): {}", world_size, rank,
                                     host_and_pid(), advertised, text));
      watch.report_failure(fmt::format("{} failed to join: {}", me, error.what()), report_wait);
      throw error;
    }
    if (mentions_peer_gone(text)) {
      CommError error(fmt::format(
          "GlooCommunicator: rank {}/{} could not connect: a peer closed its connection while Gloo connected after "
          "{:.3f} s (it exited, crashed or gave up) ({}; {}): {}",
          rank, world_size, waited, host_and_pid(), advertised, text));
      watch.report_failure(fmt::format("{} failed to join: {}", me, error.what()), report_wait);
      throw error;
    }
    CommError error(
        fmt::format("GlooCommunicator: creating the Gloo process group failed on rank {}/{} ({}, LibTorch {}; {}): {}",
                    rank, world_size, host_and_pid(), TORCH_VERSION, advertised, text));
    watch.report_failure(fmt::format("{} failed to join: {}", me, error.what()), report_wait);
    throw error;
  }
  connection.pg = job->pg;
  connection.peers = job->peers;
  connection.store = prefixed;
  connection.side = side;
  return connection;
}

}  // namespace loom::detail

#endif  // LOOM_HAS_GLOO && USE_C10D_GLOO
