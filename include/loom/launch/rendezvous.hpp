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
// The rank 0 that hosts the store writes whose it is under the unprefixed key "loom/store" (a tag of
// the job's secret, its world size, its host:pid); a client reads it before checking in, so a store
// of another job on MASTER_PORT is named as such at once. The client's connect and that read run on
// a helper thread bounded by the timeout: c10d's first request to a server that accepts and never
// answers waits far past it. A rank 0 that cannot listen on MASTER_PORT reads the same key there to
// say whose store holds the port (another job's, or this job's: a second process with RANK=0).
// Then every rank checks in ("loom/rdzv/<n>/..." keys, n counting the rendezvous of this process):
// it claims its rank (a second claimant is named), compares its world size with the first one
// posted (a disagreement is named, with both ranks' values), and counts itself; the call returns on
// all ranks only when all have arrived, and a mistake found by one rank reaches the others at once.
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
// Throws: loom::TimeoutError (collective "rendezvous") when rank 0's store cannot be reached, when
//         the server on MASTER_PORT answers no store request, or a rank does not arrive within
//         `timeout`; loom::ConfigError at once when the ranks disagree on WORLD_SIZE ("rank 1 says
//         WORLD_SIZE=3, rank 0 says WORLD_SIZE=2") or two processes claim one RANK ("two processes
//         claim RANK=0: host:pid and host:pid"); loom::CommError when rank 0 cannot listen on the port
//         (e.g. already in use) and when MASTER_ADDR:MASTER_PORT is held by another job's store (on
//         every rank of the job that finds it); loom::InvalidArgument for a bad Environment.
// Source: c10d's TCPStore and torch.distributed's env:// init method; torchrun's agent-store protocol
//         (torch/distributed/elastic/agent/server/local_elastic_agent.py).
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <netinet/in.h>
#include <optional>
#include <poll.h>
#include <string>
#include <string_view>
#include <sys/socket.h>
#include <thread>
#include <unistd.h>
#include <vector>

#include <c10/util/Exception.h>
#include <c10/util/hash.h>
#include <c10/util/intrusive_ptr.h>
#include <fmt/format.h>
#include <netdb.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <loom/detail/exception_text.hpp>
#include <loom/detail/host_and_pid.hpp>
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

/// The bytes of a store value as text, and back.
inline std::string store_text(const std::vector<std::uint8_t>& v) {
  return std::string(v.begin(), v.end());
}
inline std::vector<std::uint8_t> store_bytes(const std::string& s) {
  return std::vector<std::uint8_t>(s.begin(), s.end());
}

/// The value a check-in's outcome key holds when a rank found a launch mistake.
inline constexpr std::string_view kCheckInConflict = "conflict: ";

/// Checks this rank in under `prefix` and waits until every rank of `world_size` did:
///   1. claims "<prefix>/rank/<rank>" with compare-set (the first process keeps it): a second
///      claimant is a launch mistake, "two processes claim RANK=r: <host:pid> and <host:pid>";
///   2. compares its world size with the first one posted ("<prefix>/world_size"): "rank 1 says
///      WORLD_SIZE=3, rank 0 says WORLD_SIZE=2";
///   3. counts itself ("<prefix>/arrived"); the last to arrive sets "<prefix>/all".
/// A rank that finds a mistake sets "<prefix>/all" to "conflict: <what>" instead (compare-set: the
/// first outcome stays), so the ranks waiting for the others learn it at once. `hosts_store`: this
/// process hosts the store; after a mistake it stays until every process that checked in was told
/// (at most until the timeout), so that none loses the store in the middle of its requests.
/// `hint` ends a claim conflict's message (why it may be another job).
/// Throws: loom::ConfigError naming the mistake (on every rank that sees it, at once);
///         loom::TimeoutError naming how many ranks arrived when some never do.
inline void store_check_in(c10d::Store& store, const std::string& prefix, int rank, int world_size,
                           std::chrono::milliseconds timeout, std::chrono::steady_clock::time_point start,
                           std::string_view hint = {}, bool hosts_store = false) {
  const std::string count_key = prefix + "/arrived";
  const std::string done_key = prefix + "/all";
  const std::string seen_key = prefix + "/seen";
  const std::string told_key = prefix + "/told";
  const std::string me = host_and_pid();
  // A process that learnt of a mistake counts itself told; the one hosting the store keeps it until
  // every process that came has been told (within the timeout), so none loses the store mid-request.
  auto told = [&] {
    try {
      store.add(told_key, 1);
      while (hosts_store && store.add(told_key, 0) < store.add(seen_key, 0) &&
             std::chrono::steady_clock::now() < start + timeout)
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
    } catch (const std::exception&) {
    }
  };
  try {
    std::string conflict;
    store.add(seen_key, 1);
    const std::string claim =
        store_text(store.compareSet(fmt::format("{}/rank/{}", prefix, rank), {}, store_bytes(me)));
    if (claim != me) {
      conflict = fmt::format("two processes claim RANK={}: {} and {}; every process of a job needs a RANK of its own{}",
                             rank, claim, me, hint);
    } else {
      const std::string first =
          store_text(store.compareSet(prefix + "/world_size", {}, store_bytes(fmt::format("{} {}", world_size, rank))));
      int first_size = 0, first_rank = 0;
      if (std::sscanf(first.c_str(), "%d %d", &first_size, &first_rank) == 2 && first_size != world_size) {
        // The higher rank first, so every rank words the same disagreement the same way.
        const bool mine_first = rank > first_rank;
        conflict =
            fmt::format("the ranks disagree on WORLD_SIZE: rank {} says WORLD_SIZE={}, rank {} says WORLD_SIZE={}",
                        mine_first ? rank : first_rank, mine_first ? world_size : first_size,
                        mine_first ? first_rank : rank, mine_first ? first_size : world_size);
      }
    }
    if (!conflict.empty()) {
      (void)store.compareSet(done_key, {}, store_bytes(std::string(kCheckInConflict) + conflict));
      told();
      throw ConfigError(fmt::format("rendezvous: {} (seen by rank {} on {})", conflict, rank, me));
    }
    if (store.add(count_key, 1) == world_size) (void)store.compareSet(done_key, {}, store_bytes("all"));
    // Polled rather than waited for: LibTorch 1.13's store wakes no waiter for a compare-set.
    while (!store.check({done_key})) {
      if (std::chrono::steady_clock::now() >= start + timeout)
        throw std::runtime_error(fmt::format("no outcome within the {:.3f} s timeout", timeout.count() / 1000.0));
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    const std::string outcome = store_text(store.get(done_key));
    if (outcome.starts_with(kCheckInConflict)) {
      told();
      throw ConfigError(
          fmt::format("rendezvous: {} (reported to rank {} on {})", outcome.substr(kCheckInConflict.size()), rank, me));
    }
  } catch (const ConfigError&) {
    throw;
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

/// The unprefixed key under which the rank 0 that hosts a store says whose store it is.
inline constexpr const char* kStoreIdentityKey = "loom/store";

/// A job's tag in the store's identity: "none" without a secret, else the first 16 hexadecimal
/// digits of a SHA-1 of the secret (the secret itself never leaves the key names of its own job).
inline std::string job_tag(const std::string& secret) {
  if (secret.empty()) return "none";
  return c10::sha1("loom rendezvous job " + secret).str().substr(0, 16);
}

/// The value of kStoreIdentityKey rank 0 writes: "job <tag> world_size <n> host <host:pid>".
inline std::string store_identity(const Environment& env) {
  return fmt::format("job {} world_size {} host {}", job_tag(env.rendezvous_secret), env.world_size, host_and_pid());
}

/// The parts of a store identity.
struct StoreIdentity {
  std::string tag, host;
  int world_size = 0;
};

inline std::optional<StoreIdentity> parse_store_identity(const std::string& text) {
  char tag[65] = {}, host[257] = {};
  int world_size = 0;
  if (std::sscanf(text.c_str(), "job %64s world_size %d host %256s", tag, &world_size, host) != 3) return std::nullopt;
  return StoreIdentity{tag, host, world_size};
}

/// How a client's contact with the store at MASTER_ADDR:MASTER_PORT ended.
struct StoreContact {
  enum class Outcome {
    connected,  ///< `store` is connected; `identity` holds its owner's line (when asked for)
    failed,     ///< c10d threw `error` (refused, reset, timed out): worth another try
    silent,     ///< the deadline passed inside c10d's connect: the server never answered a request
    anonymous,  ///< a store answered but no loom rank 0 said it was theirs before the deadline
  };
  Outcome outcome = Outcome::failed;
  c10::intrusive_ptr<c10d::Store> store;
  std::string identity;
  std::string error;
};

/// Connects a c10d client to `addr` with `opts` and, when `identify`, waits for the store's
/// identity key; all of it on a helper thread, so that a server which accepts connections and never
/// answers (a program that is not a store) costs this rank no more than `deadline`. A helper left
/// waiting inside c10d owns what it uses and ends when c10d gives up.
inline StoreContact contact_store(const std::string& addr, c10d::TCPStoreOptions opts, bool identify,
                                  std::chrono::steady_clock::time_point deadline) {
  struct Shared {
    std::mutex m;
    std::condition_variable cv;
    bool done = false;
    bool connected = false;
    StoreContact contact;
  };
  auto shared = std::make_shared<Shared>();
  std::thread([shared, addr, opts, identify, deadline] {
    StoreContact c;
    try {
      auto store = c10::make_intrusive<c10d::TCPStore>(addr, opts);
      // The first request a store answers at once (LibTorch 1.13's connect sends none; a server
      // that never answers is still "connecting" at the deadline).
      const bool identified = store->check({kStoreIdentityKey});
      {
        std::lock_guard lock(shared->m);
        shared->connected = true;
      }
      c.store = store;
      c.outcome = StoreContact::Outcome::connected;
      if (identify) {
        try {
          // Polled: the rank 0 that hosts the store writes it right after starting it.
          bool there = identified;
          while (!there && std::chrono::steady_clock::now() < deadline) {
            std::this_thread::sleep_for(std::chrono::milliseconds(5));
            there = store->check({kStoreIdentityKey});
          }
          if (there)
            c.identity = store_text(store->get(kStoreIdentityKey));
          else
            c.outcome = StoreContact::Outcome::anonymous;
        } catch (const std::exception& e) {
          c.outcome = StoreContact::Outcome::anonymous;
          c.error = exception_text(e);
        }
      }
    } catch (const std::exception& e) {
      c.outcome = StoreContact::Outcome::failed;
      c.error = exception_text(e);
    }
    {
      std::lock_guard lock(shared->m);
      shared->contact = std::move(c);
      shared->done = true;
    }
    shared->cv.notify_all();
  }).detach();
  std::unique_lock lock(shared->m);
  if (!shared->cv.wait_until(lock, deadline, [&] { return shared->done; })) {
    StoreContact c;
    c.outcome = shared->connected ? StoreContact::Outcome::anonymous : StoreContact::Outcome::silent;
    return c;
  }
  return std::move(shared->contact);
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
/// Throws: loom::TimeoutError("rendezvous", rank, seconds) if the store is unreachable, never answers
///         or a rank is missing after the timeout; loom::ConfigError naming a WORLD_SIZE disagreement
///         or a RANK claimed twice; loom::CommError if rank 0 cannot listen on MASTER_PORT or the port
///         is held by another job's store (see the header comment).
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
  const std::string where = fmt::format("{}:{}", env.master_addr, env.master_port);
  const std::string hosted_by = env.use_agent_store ? " hosted by torchrun's agent" : " hosted by rank 0";
  const std::string tag = detail::job_tag(env.rendezvous_secret);
  // A client first waits, with a plain connect timed to the millisecond, until the store's port
  // answers, then lets c10d connect (an attempt gets the whole seconds left, at least 1 s), and tries
  // again until loom's own deadline. c10d's connect does not keep to a deadline: LibTorch 1.13 counts
  // its timeout in whole seconds and gives up as soon as its next 1 s back-off step would pass it
  // (measured: a refused connect with a 1.5 s timeout gave up after 0.3 s, so a rank started a little
  // before rank 0 would not find the store), and LibTorch 2.x's retries against an address nobody
  // has overshot a 3 s timeout by 2 s on a loaded machine; against a server that accepts and never
  // answers, its first request waits far past the timeout (measured: over 30 s with a 2 s timeout),
  // so the connect and the store's identity run on a helper thread bounded by the deadline
  // (detail::contact_store).
  // Then the client reads whose store it reached (kStoreIdentityKey, written by the rank 0 that
  // hosts it): another job's store is named as such at once.
  const auto deadline = start + options.timeout;
  auto other_job = [&](const detail::StoreIdentity& id) {
    return fmt::format(
        "MASTER_ADDR:MASTER_PORT {} is held by another job's store (hosted by {} for a job of {} ranks), not this "
        "job's: give each job its own MASTER_PORT",
        where, id.host, id.world_size);
  };
  // What the store a client reached says about its owner: "" (this job's, or one that cannot be told
  // apart: no secret on either side), or the error to throw.
  auto check_identity = [&](const detail::StoreContact& c) -> std::string {
    const auto id = detail::parse_store_identity(c.identity);
    if (!id)
      return fmt::format("{} answers as a store, but not as one hosted by a loom rank 0 ('{}')", where, c.identity);
    if (id->tag != tag) return other_job(*id);
    return {};
  };
  bool hosting = false;  // this process runs the store (a second RANK=0 continues as a client)
  for (;;) {
    try {
      const auto left = deadline - std::chrono::steady_clock::now();
      const auto whole = std::chrono::floor<std::chrono::seconds>(left);
      if (!host &&
          !detail::port_answers(env.master_addr, env.master_port, std::chrono::ceil<std::chrono::milliseconds>(left)))
        throw TimeoutError(
            "rendezvous", env.rank, detail::seconds_since(start),
            fmt::format("could not reach the store at {}{} (no answer within the timeout)", where, hosted_by));
      if (host) {
        opts.timeout = options.timeout;
        store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, opts);
        hosting = true;
        store->set(detail::kStoreIdentityKey, detail::store_bytes(detail::store_identity(env)));
        store->setTimeout(options.timeout);
        break;
      }
      opts.timeout = std::chrono::milliseconds(std::max(whole, std::chrono::seconds(1)));
      auto contact = detail::contact_store(env.master_addr, opts, !env.use_agent_store, deadline);
      using Outcome = detail::StoreContact::Outcome;
      if (contact.outcome == Outcome::silent)
        throw TimeoutError(
            "rendezvous", env.rank, detail::seconds_since(start),
            fmt::format("{} accepted the connection but answered no store request within the timeout: whatever "
                        "listens on MASTER_PORT is not a c10d store (another program holds the port?)",
                        where));
      if (contact.outcome == Outcome::anonymous)
        throw TimeoutError("rendezvous", env.rank, detail::seconds_since(start),
                           fmt::format("the store at {} never said whose it is (no rank 0 of a loom job wrote its "
                                       "identity there within the timeout{}{})",
                                       where, contact.error.empty() ? "" : ": ", contact.error));
      if (contact.outcome == Outcome::failed) throw std::runtime_error(contact.error);
      if (!env.use_agent_store)
        if (auto wrong = check_identity(contact); !wrong.empty()) throw CommError("rendezvous: " + wrong);
      store = contact.store;
      store->setTimeout(options.timeout);  // the bound of later gets and waits, not the attempt's
      break;
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      std::string text = detail::exception_text(e);
      if (host && !detail::mentions_timeout(text)) {
        // The port is taken: say by whom when a store answers there.
        std::string cause = text;
        if (detail::port_answers(env.master_addr, env.master_port, std::chrono::milliseconds(200))) {
          c10d::TCPStoreOptions probe;
          probe.port = env.master_port;
          probe.isServer = false;
          probe.waitWorkers = false;
          probe.timeout = std::chrono::seconds(1);
          auto contact = detail::contact_store(env.master_addr, probe, true, deadline);
          using Outcome = detail::StoreContact::Outcome;
          const auto id = detail::parse_store_identity(contact.identity);
          if (contact.outcome == Outcome::connected && id && id->tag == tag && id->host != detail::host_and_pid()) {
            // This job's store, hosted by another process: continue as a client, whose check-in
            // names the two claims of RANK=0 on both.
            store = contact.store;
            store->setTimeout(options.timeout);
            break;
          }
          if (contact.outcome == Outcome::connected && id && id->tag != tag)
            throw CommError(fmt::format("rendezvous: rank 0 could not host the store on port {} (MASTER_PORT): {}",
                                        env.master_port, other_job(*id)));
          if (contact.outcome == Outcome::connected && id)
            cause += "; this process hosts a store on that port already (an earlier rendezvous)";
          else if (contact.outcome == Outcome::silent)
            cause += "; the program listening there answers no store request (not a c10d store)";
        }
        throw CommError(fmt::format("rendezvous: rank 0 could not host the store on port {} (MASTER_PORT): {}",
                                    env.master_port, cause));
      }
      const auto now = std::chrono::steady_clock::now();
      if (host || now >= deadline)
        throw TimeoutError("rendezvous", env.rank, detail::seconds_since(start),
                           fmt::format("could not reach the store at {}{} ({})", where, hosted_by, text));
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
  detail::store_check_in(*store, fmt::format("loom/rdzv/{}", gen), env.rank, env.world_size, options.timeout, start,
                         env.rendezvous_secret.empty()
                             ? " (without LOOM_RENDEZVOUS_SECRET, a second job on the same MASTER_PORT looks the same: "
                               "give each job its own MASTER_PORT and secret)"
                             : "",
                         hosting);
  return store;
}

}  // namespace loom
