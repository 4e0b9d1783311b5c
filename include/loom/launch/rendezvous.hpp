// loom/launch/rendezvous.hpp — meet the other ranks at a c10d TCPStore (the key-value store every
// communicator uses to exchange addresses).
//
// One sentence: `loom::rendezvous(env)` returns a store shared by all ranks of the job once every
// rank has connected, or throws loom::TimeoutError("rendezvous", ...) naming who waited how long.
//
// Example:
//   auto env = loom::Environment::from_env();
//   auto store = loom::rendezvous(env, {.timeout = std::chrono::seconds(30)});
//   loom::GlooCommunicator comm(store, env.rank, env.world_size);
//
// Two modes, chosen from the environment:
//   - default: rank 0 hosts a TCPStore on MASTER_ADDR:MASTER_PORT (listening on every interface);
//     the other ranks connect to it as clients. Under loom::spawn with LibTorch 2.x rank 0 hosts it
//     on the listening socket spawn reserved the port with (LOOM_MASTER_LISTEN_FD), taken over once
//     per process; a client that connects before the store runs waits in that socket's backlog.
//   - torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE=True, torchrun's default rendezvous):
//     the torchrun agent already hosts the store at MASTER_ADDR:MASTER_PORT, so every rank, rank 0
//     included, is a client; keys live under "/worker/attempt_<TORCHELASTIC_RESTART_COUNT>", the
//     prefix torchrun's own workers use, so each restart attempt starts from fresh keys.
//   - world size 1 without an agent: an in-memory c10d HashStore, no port is opened.
// Then every rank checks in ("loom/rdzv/<n>/..." keys, n counting the rendezvous of this process),
// so the call returns on all ranks only when all have arrived.
//
// The job's secret (Environment::rendezvous_secret, from LOOM_RENDEZVOUS_SECRET): rank 0's TCPStore
// listens on every interface and anyone who reaches its port may read and write keys. With a secret,
// the returned store keeps every key under "loom/job/<secret>/", so the check-in, Gloo's addresses and
// NCCL's unique id live under names a stranger cannot guess: what a stranger writes elsewhere is
// never read, and the store protocol has no request that lists keys (c10d's TCPStore: set, get, add,
// check, wait, compare-set, delete, key count). loom::spawn gives its ranks a fresh 128-bit secret;
// with a launcher, export the same random value on every rank (torchrun and srun pass the
// environment on, mpirun needs `-x LOOM_RENDEZVOUS_SECRET`). Without one, keys are used as they are
// (unprotected) and rank 0 prints one warning line to stderr. The secret travels in clear text inside
// key names: it keeps out whoever can reach the port, not whoever can read the traffic.
//
// Throws: loom::TimeoutError (collective "rendezvous") when rank 0's store cannot be reached or a rank
//         does not arrive within `timeout`; loom::CommError when rank 0 cannot listen on the port
//         (e.g. already in use); loom::InvalidArgument for a bad Environment.
// Source: c10d's TCPStore and torch.distributed's env:// init method; torchrun's agent-store protocol
//         (torch/distributed/elastic/agent/server/local_elastic_agent.py).
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <netinet/in.h>
#include <poll.h>
#include <string>
#include <sys/socket.h>
#include <thread>
#include <unistd.h>
#include <vector>

#include <c10/util/Exception.h>
#include <c10/util/intrusive_ptr.h>
#include <fmt/format.h>
#include <netdb.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <loom/detail/exception_text.hpp>
#include <loom/detail/process_counter.hpp>
#include <loom/detail/torch_api.hpp>
#include <loom/error.hpp>
#include <loom/launch/environment.hpp>

namespace loom {

/// Options of rendezvous().
///
/// Units: `timeout` is the wall-clock bound on connecting and on waiting for every rank.
struct RendezvousOptions {
  std::chrono::milliseconds timeout = kDefaultTimeout;  ///< bound on connect + check-in
};

namespace detail {

/// True when a backend message says the operation timed out.
inline bool mentions_timeout(const std::string& text) {
  return text.find("imed out") != std::string::npos || text.find("imeout") != std::string::npos;
}

/// Seconds since `start`.
inline double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

/// Waits until every rank of `world_size` added itself under `prefix`; throws TimeoutError naming
/// how many arrived.
inline void store_check_in(c10d::Store& store, const std::string& prefix, int rank, int world_size,
                           std::chrono::milliseconds timeout, std::chrono::steady_clock::time_point start) {
  const std::string count_key = prefix + "/arrived";
  const std::string done_key = prefix + "/all";
  try {
    auto arrived = store.add(count_key, 1);
    if (arrived == world_size) store.set(done_key, std::vector<std::uint8_t>{1});
    auto left =
        timeout - std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start);
    if (left < std::chrono::milliseconds(1)) left = std::chrono::milliseconds(1);
    store.wait({done_key}, left);
  } catch (const std::exception& e) {
    std::int64_t arrived = -1;
    try {
      arrived = store.add(count_key, 0);
    } catch (...) {
    }
    throw TimeoutError(
        "rendezvous", rank, seconds_since(start),
        fmt::format("{} of {} ranks arrived at the store ({})",
                    arrived < 0 ? std::string("?") : std::to_string(arrived), world_size, exception_text(e)));
  }
}

/// Whether a TCP connection to host:port succeeds within `timeout` (retried every 50 ms while it is
/// refused). A plain connect, closed at once: the rendezvous's millisecond-exact wait for the store.
inline bool port_answers(const std::string& host, std::uint16_t port, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  for (;;) {
    addrinfo* res = nullptr;
    if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) == 0) {
      for (auto* p = res; p != nullptr; p = p->ai_next) {
        const int fd = ::socket(p->ai_family, p->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, p->ai_protocol);
        if (fd < 0) continue;
        bool ok = ::connect(fd, p->ai_addr, p->ai_addrlen) == 0;
        if (!ok && errno == EINPROGRESS) {
          const auto left =
              std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
          pollfd pfd{fd, POLLOUT, 0};
          int err = 0;
          socklen_t len = sizeof(err);
          ok = left.count() > 0 && ::poll(&pfd, 1, static_cast<int>(left.count())) == 1 &&
               ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0 && err == 0;
        }
        ::close(fd);
        if (ok) {
          ::freeaddrinfo(res);
          return true;
        }
      }
      ::freeaddrinfo(res);
    }
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) return false;
    std::this_thread::sleep_for(
        std::min<std::chrono::steady_clock::duration>(std::chrono::milliseconds(50), deadline - now));
  }
}

/// The listening MASTER_PORT socket loom::spawn handed to this process (LOOM_MASTER_LISTEN_FD), or
/// -1: none was handed over, it was taken already (once per process: the store that took it closes
/// it), or the descriptor is not a listening socket on `port` (a variable inherited by another program).
inline int take_spawned_listen_fd(std::uint16_t port) {
  static std::atomic<bool> taken{false};
  const char* text = std::getenv("LOOM_MASTER_LISTEN_FD");
  if (text == nullptr || taken.load()) return -1;
  char* end = nullptr;
  const long fd = std::strtol(text, &end, 10);
  if (end == text || *end != '\0' || fd < 0 || fd > 1 << 20) return -1;
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  int listening = 0;
  socklen_t opt_len = sizeof(listening);
  if (::getsockname(static_cast<int>(fd), reinterpret_cast<sockaddr*>(&addr), &len) != 0 || addr.ss_family != AF_INET ||
      ntohs(reinterpret_cast<const sockaddr_in*>(&addr)->sin_port) != port ||
      ::getsockopt(static_cast<int>(fd), SOL_SOCKET, SO_ACCEPTCONN, &listening, &opt_len) != 0 || listening == 0)
    return -1;
  if (taken.exchange(true)) return -1;
  return static_cast<int>(fd);
}

/// Rank 0's one line about a job without LOOM_RENDEZVOUS_SECRET (once per process).
inline void warn_once_without_secret(const Environment& env) {
  static std::atomic<bool> warned{false};
  if (warned.exchange(true)) return;
  std::fprintf(stderr,
               "loom: warning: LOOM_RENDEZVOUS_SECRET is not set, so anyone who can reach %s:%u can read and write "
               "this job's rendezvous keys; export the same random value on every rank (openssl rand -hex 16)\n",
               env.master_addr.c_str(), static_cast<unsigned>(env.master_port));
  std::fflush(stderr);
}

}  // namespace detail

/// Connects to (rank 0: hosts) the job's TCPStore and waits for all ranks; see the header comment.
///
/// Example: `auto store = loom::rendezvous(loom::Environment::from_env());`
/// Units: `options.timeout` bounds the whole call.
/// Throws: loom::TimeoutError("rendezvous", rank, seconds) if the store is unreachable or a rank is
///         missing after the timeout; loom::CommError if rank 0 cannot listen on MASTER_PORT.
/// Source: torch.distributed env:// (rank 0 is the TCPStore server) and torchrun's agent store.
inline c10::intrusive_ptr<c10d::Store> rendezvous(const Environment& env, RendezvousOptions options = {}) {
  if (env.world_size < 1 || env.rank < 0 || env.rank >= env.world_size)
    throw InvalidArgument(fmt::format("rendezvous: rank {} is outside [0, world size {})", env.rank, env.world_size));
  // One process and no torchrun agent: nobody to meet, so no TCP port is taken (two single-process
  // runs on one machine never collide on MASTER_PORT); an in-memory store serves the same API.
  if (env.world_size == 1 && !env.use_agent_store) return c10::make_intrusive<c10d::HashStore>();
  const auto start = std::chrono::steady_clock::now();
  const bool host = env.rank == 0 && !env.use_agent_store;

  c10d::TCPStoreOptions opts;
  opts.port = env.master_port;
  opts.isServer = host;
  opts.timeout = options.timeout;
  if (!env.use_agent_store) {
    opts.numWorkers = static_cast<std::size_t>(env.world_size);
    opts.waitWorkers = false;  // loom's own check-in below gives the better error message
  }
  // Under loom::spawn with LibTorch 2.x, rank 0 hosts the store on the socket spawn reserved (already
  // listening, so early clients wait in its backlog and no other process can take the port).
  if (host) {
    const int fd = detail::take_spawned_listen_fd(env.master_port);
    if (fd >= 0) detail::set_master_listen_fd(opts, fd);
  }
  c10::intrusive_ptr<c10d::Store> store;
  // A client first waits, with a plain connect timed to the millisecond, until the store's port
  // answers, then lets c10d connect (an attempt gets the whole seconds left, at least 1 s), and tries
  // again until loom's own deadline. c10d's connect does not keep to a deadline: LibTorch 1.13 counts
  // its timeout in whole seconds and gives up as soon as its next 1 s back-off step would pass it
  // (measured: a refused connect with a 1.5 s timeout gave up after 0.3 s, so a rank started a little
  // before rank 0 would not find the store), and LibTorch 2.x's retries against an address nobody
  // has overshot a 3 s timeout by 2 s on a loaded machine.
  const auto deadline = start + options.timeout;
  for (;;) {
    try {
      const auto left = deadline - std::chrono::steady_clock::now();
      const auto whole = std::chrono::floor<std::chrono::seconds>(left);
      if (!host &&
          !detail::port_answers(env.master_addr, env.master_port, std::chrono::ceil<std::chrono::milliseconds>(left)))
        throw TimeoutError(
            "rendezvous", env.rank, detail::seconds_since(start),
            fmt::format("could not reach the store at {}:{}{} (no answer within the timeout)", env.master_addr,
                        env.master_port, env.use_agent_store ? " hosted by torchrun's agent" : " hosted by rank 0"));
      opts.timeout = host ? options.timeout : std::chrono::milliseconds(std::max(whole, std::chrono::seconds(1)));
      store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, opts);
      store->setTimeout(options.timeout);  // the bound of later gets and waits, not the attempt's
      break;
    } catch (const TimeoutError&) {
      throw;
    } catch (const std::exception& e) {
      std::string text = detail::exception_text(e);
      if (host && !detail::mentions_timeout(text))
        throw CommError(fmt::format("rendezvous: rank 0 could not host the store on port {} (MASTER_PORT): {}",
                                    env.master_port, text));
      const auto now = std::chrono::steady_clock::now();
      if (host || now >= deadline)
        throw TimeoutError(
            "rendezvous", env.rank, detail::seconds_since(start),
            fmt::format("could not reach the store at {}:{}{} ({})", env.master_addr, env.master_port,
                        env.use_agent_store ? " hosted by torchrun's agent" : " hosted by rank 0", text));
      std::this_thread::sleep_for(
          std::min<std::chrono::steady_clock::duration>(std::chrono::milliseconds(50), deadline - now));
    }
  }
  if (env.use_agent_store)
    store = c10::make_intrusive<c10d::PrefixStore>(fmt::format("/worker/attempt_{}", env.restart_count), store);
  if (!env.rendezvous_secret.empty())
    store = c10::make_intrusive<c10d::PrefixStore>(fmt::format("loom/job/{}", env.rendezvous_secret), store);
  else if (env.rank == 0)
    detail::warn_once_without_secret(env);

  const auto gen = detail::next_in_process(detail::Counted::rendezvous);
  detail::store_check_in(*store, fmt::format("loom/rdzv/{}", gen), env.rank, env.world_size, options.timeout, start);
  return store;
}

}  // namespace loom
