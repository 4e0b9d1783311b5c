// loom/launch/detail/spawn_posix.hpp — spawn's machinery on POSIX, the parent's side: the reserved
// MASTER_PORT, the job secret, forking the ranks (what each child does first is in spawn_child.hpp),
// the store process with SpawnOptions::elastic (store_process.hpp), and supervising the ranks (grace,
// SIGTERM, SIGKILL, the whole-job timeout; with elastic, waiting for every rank) and reporting how
// they ended. Not a public header: loom/launch/spawn.hpp is.
#pragma once

#include <algorithm>
#include <arpa/inet.h>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fcntl.h>
#include <iostream>
#include <netinet/in.h>
#include <optional>
#include <signal.h>
#include <string>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <loom/detail/torch_api.hpp>
#include <loom/error.hpp>
#include <loom/launch/detail/spawn_child.hpp>
#include <loom/launch/detail/store_process.hpp>
#include <loom/launch/spawn_options.hpp>

namespace loom {

namespace detail {

/// Binds an IPv4 TCP socket to a free port on every interface with SO_REUSEADDR (bound, not
/// listening), so no other process's ephemeral port search picks the port. spawn keeps it while the
/// ranks are forked and then either hands it to the store's host (rank 0, or the store process with
/// SpawnOptions::elastic; LibTorch 2.x) or closes it (see run_ranks). Returns {fd, port}.
inline std::pair<int, std::uint16_t> reserve_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) throw Error(fmt::format("spawn: socket() failed: {}", std::strerror(errno)));
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    int err = errno;
    ::close(fd);
    throw Error(fmt::format("spawn: could not bind a free port: {}", std::strerror(err)));
  }
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  return {fd, ntohs(addr.sin_port)};
}

/// A fresh job secret: 16 bytes from getrandom(2), as 32 hexadecimal digits.
inline std::string random_job_secret() {
  unsigned char bytes[16];
  std::size_t got = 0;
  while (got < sizeof(bytes)) {
    const ssize_t n = ::getrandom(bytes + got, sizeof(bytes) - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw Error(fmt::format("spawn: getrandom() failed: {}", std::strerror(errno)));
    got += static_cast<std::size_t>(n);
  }
  std::string out;
  for (unsigned char b : bytes) out += fmt::format("{:02x}", b);
  return out;
}

/// With SpawnOptions::elastic, after every rank ended (no timeout): throws SpawnError when a rank threw,
/// exited non-zero or was terminated, or when no rank succeeded; otherwise prints one line per rank a
/// signal killed ("loom: spawn: rank 1 was killed by signal SIGKILL (9); the other ranks went on
/// (elastic)") to stderr and returns.
inline void report_elastic_outcome(int nprocs, std::vector<RankFailure> failures) {
  const bool only_signals = std::all_of(failures.begin(), failures.end(),
                                        [](const RankFailure& f) { return f.kind == RankFailure::Kind::signal; });
  if (!only_signals || failures.size() >= static_cast<std::size_t>(nprocs))
    throw SpawnError(nprocs, std::move(failures));
  for (const auto& f : failures)
    std::fprintf(stderr, "loom: spawn: %s; the other ranks went on (elastic)\n", f.describe().c_str());
  std::fflush(stderr);
}

/// Forks nprocs children, runs `child(rank, message_fd)` (which must not return) in each after
/// prepare_child, and supervises them (see spawn's failure handling). With SpawnOptions::elastic, the
/// store process is forked first and ended last. Throws SpawnError/TimeoutError.
template <class Child>
void run_ranks(int nprocs, const SpawnOptions& options, Child&& child) {
  if (nprocs < 1) throw InvalidArgument(fmt::format("spawn: nprocs = {} (need >= 1)", nprocs));
  if (options.threads_per_rank < 0)
    throw InvalidArgument(fmt::format("spawn: threads_per_rank = {} (need >= 0)", options.threads_per_rank));

  const std::string secret = random_job_secret();
  int reserved_fd = -1;
  std::uint16_t port = options.master_port;
  if (port == 0) std::tie(reserved_fd, port) = reserve_port();
  // LibTorch 2.x: the reserved socket starts listening here and the store's host (rank 0, or the
  // store process with elastic) takes it over (TCPStoreOptions::masterListenFd), so the port is never
  // free between reservation and the store, and a rank that connects before the store runs waits in
  // the socket's backlog instead of being refused. IPv4 masters only (the socket is IPv4). LibTorch
  // 1.13 cannot take a socket over: the store's host binds the port next to the reservation
  // (SO_REUSEADDR on both, neither listening), which the parent closes once the host is started.
  in_addr ipv4{};
  const bool hand_over = reserved_fd >= 0 && kStoreTakesListenFd &&
                         ::inet_pton(AF_INET, options.master_addr.c_str(), &ipv4) == 1 &&
                         ::listen(reserved_fd, SOMAXCONN) == 0;

  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);  // nothing buffered in the parent is printed twice by the children

  const pid_t parent = ::getpid();
  // Elastic: the store process first, forked while this process has started nothing else of the job;
  // it serves once constructed, holds the port from then on, and is ended on every way out of here.
  std::optional<StoreProcess> store;
  if (options.elastic) {
    try {
      store.emplace(nprocs, port, secret, options, parent, reserved_fd, hand_over);
    } catch (...) {
      if (reserved_fd >= 0) ::close(reserved_fd);
      throw;
    }
    if (reserved_fd >= 0) {
      ::close(reserved_fd);  // the store process holds the port now
      reserved_fd = -1;
    }
  }
  std::vector<pid_t> pids(static_cast<std::size_t>(nprocs), -1);
  std::vector<int> fds(static_cast<std::size_t>(nprocs), -1);
  auto abandon = [&](const std::string& what) {
    for (pid_t p : pids)
      if (p > 0) ::kill(p, SIGKILL);
    for (pid_t p : pids)
      if (p > 0) ::waitpid(p, nullptr, 0);
    for (int fd : fds)
      if (fd >= 0) ::close(fd);
    if (reserved_fd >= 0) ::close(reserved_fd);
    if (store) store->end();
    throw Error(what);
  };
  for (int r = 0; r < nprocs; ++r) {
    int pipefd[2];
    if (::pipe2(pipefd, O_CLOEXEC) != 0) abandon(fmt::format("spawn: pipe() failed: {}", std::strerror(errno)));
    pid_t pid = ::fork();
    if (pid < 0) {
      int err = errno;
      ::close(pipefd[0]);
      ::close(pipefd[1]);
      abandon(fmt::format("spawn: fork() of rank {} failed: {}", r, std::strerror(err)));
    }
    if (pid == 0) {
      ::close(pipefd[0]);
      for (int fd : fds)
        if (fd >= 0) ::close(fd);
      const bool keep = hand_over && r == 0 && !options.elastic;
      if (reserved_fd >= 0 && !keep) ::close(reserved_fd);
      try {
        prepare_child(r, nprocs, port, secret, options, parent, keep ? reserved_fd : -1);
        child(r, pipefd[1]);
      } catch (...) {
        // Never unwinds into this copy of spawn's frame (whose store process is the parent's).
      }
      finish_child(pipefd[1], 112);  // child() must not return
    }
    ::close(pipefd[1]);
    pids[static_cast<std::size_t>(r)] = pid;
    fds[static_cast<std::size_t>(r)] = pipefd[0];
  }
  // Every rank is started: the parent's copy of the reserved socket goes (rank 0 holds the listening
  // socket when it was handed over; otherwise the port is free for rank 0's store to bind). With
  // elastic it went when the store process started.
  if (reserved_fd >= 0) {
    ::close(reserved_fd);
    reserved_fd = -1;
  }
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  std::vector<bool> running(static_cast<std::size_t>(nprocs), true);
  std::vector<RankFailure> failures;
  int alive = nprocs;
  clock::time_point first_failure{};
  clock::time_point term_sent{};
  bool terminating = false, killed = false, timed_out = false;
  std::vector<bool> signalled_by_us(static_cast<std::size_t>(nprocs), false);

  auto signal_running = [&](int sig) {
    for (int r = 0; r < nprocs; ++r)
      if (running[static_cast<std::size_t>(r)]) {
        ::kill(pids[static_cast<std::size_t>(r)], sig);
        signalled_by_us[static_cast<std::size_t>(r)] = true;
      }
  };

  while (alive > 0) {
    bool progressed = false;
    for (int r = 0; r < nprocs; ++r) {
      const auto i = static_cast<std::size_t>(r);
      if (!running[i]) continue;
      int status = 0;
      pid_t w = ::waitpid(pids[i], &status, WNOHANG);
      if (w == 0) continue;
      if (w < 0 && errno == EINTR) continue;
      running[i] = false;
      --alive;
      progressed = true;
      std::string message = detail::read_all(fds[i]);
      ::close(fds[i]);
      fds[i] = -1;
      RankFailure f{.rank = r};
      bool failed = true;
      if (w < 0) {
        f.kind = RankFailure::Kind::exit_code;
        f.code = -1;
      } else if (WIFEXITED(status)) {
        if (WEXITSTATUS(status) == 0) {
          failed = false;
        } else if (!message.empty()) {
          f.kind = RankFailure::Kind::exception;
          f.message = std::move(message);
        } else {
          f.kind = RankFailure::Kind::exit_code;
          f.code = WEXITSTATUS(status);
        }
      } else if (WIFSIGNALED(status)) {
        const int sig = WTERMSIG(status);
        f.kind = (signalled_by_us[i] && (sig == SIGTERM || sig == SIGKILL)) ? RankFailure::Kind::terminated
                                                                            : RankFailure::Kind::signal;
        f.code = sig;
      }
      if (failed) {
        failures.push_back(std::move(f));
        // Elastic: a failure starts no grace period; the others go on until they end.
        if (!options.elastic && first_failure == clock::time_point{}) first_failure = clock::now();
      }
    }
    if (store)
      if (auto how = store->ended_early()) {
        std::fprintf(stderr, "loom: spawn: the store process %s while %d of %d ranks were running (elastic)\n",
                     how->c_str(), alive, nprocs);
        std::fflush(stderr);
      }
    if (alive == 0) break;
    const auto now = clock::now();
    if (!timed_out && options.timeout.count() > 0 && now - start > options.timeout && !terminating) {
      timed_out = true;
      terminating = true;
      term_sent = now;
      signal_running(SIGTERM);
    }
    if (!terminating && first_failure != clock::time_point{} && now - first_failure >= options.grace) {
      terminating = true;
      term_sent = now;
      signal_running(SIGTERM);
    }
    if (terminating && !killed && now - term_sent >= options.kill_after) {
      killed = true;
      signal_running(SIGKILL);
    }
    if (!progressed) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  if (reserved_fd >= 0) ::close(reserved_fd);
  for (int fd : fds)
    if (fd >= 0) ::close(fd);
  if (store) store->end();

  // Report the cause first: failures in the order seen, ranks spawn terminated last.
  std::stable_partition(failures.begin(), failures.end(),
                        [](const RankFailure& f) { return f.kind != RankFailure::Kind::terminated; });
  if (timed_out) {
    std::vector<int> still;
    for (const auto& f : failures)
      if (f.kind == RankFailure::Kind::terminated) still.push_back(f.rank);
    std::sort(still.begin(), still.end());
    throw TimeoutError(
        "spawn", still.empty() ? 0 : still.front(), std::chrono::duration<double>(clock::now() - start).count(),
        fmt::format(
            "ranks [{}] of {} were still running after the {:.3f} s limit and were terminated{}",
            fmt::join(still, ", "), nprocs, options.timeout.count() / 1000.0,
            failures.size() > still.size() ? std::string("; ") + SpawnError(nprocs, failures).what() : std::string()));
  }
  if (options.elastic)
    report_elastic_outcome(nprocs, std::move(failures));
  else if (!failures.empty())
    throw SpawnError(nprocs, std::move(failures));
}

}  // namespace detail

}  // namespace loom
