// loom/launch/detail/spawn_posix.hpp — spawn's machinery on POSIX: the reserved MASTER_PORT, the
// job secret, forking and preparing each child (torchrun's variables, signals, the parent-death
// signal), running the rank function in it, and supervising the children (grace, SIGTERM, SIGKILL,
// the whole-job timeout). Not a public header: loom/launch/spawn.hpp is.
#pragma once

#include <algorithm>
#include <arpa/inet.h>
#include <cerrno>
#include <chrono>
#include <concepts>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fcntl.h>
#include <iostream>
#include <map>
#include <memory>
#include <netinet/in.h>
#include <signal.h>
#include <string>
#include <sys/prctl.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <thread>
#include <typeinfo>
#include <unistd.h>
#include <utility>
#include <vector>

#include <ATen/Parallel.h>
#include <cxxabi.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <loom/detail/exception_text.hpp>
#include <loom/detail/torch_api.hpp>
#include <loom/error.hpp>
#include <loom/launch/environment.hpp>
#include <loom/launch/spawn_options.hpp>

namespace loom {

namespace detail {

inline std::string demangled_type_name(const std::type_info& ti) {
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> p(abi::__cxa_demangle(ti.name(), nullptr, nullptr, &status), std::free);
  return status == 0 && p ? std::string(p.get()) : std::string(ti.name());
}

/// Binds an IPv4 TCP socket to a free port on every interface with SO_REUSEADDR (bound, not
/// listening), so no other process's ephemeral port search picks the port. spawn keeps it while the
/// ranks are forked and then either hands it to rank 0's store (LibTorch 2.x) or closes it (see
/// run_ranks). Returns {fd, port}.
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

/// Writes all of `text` (at most 16 KiB, well below a pipe's buffer) to `fd`.
inline void write_all(int fd, std::string text) {
  if (text.size() > 16384) text.resize(16384);
  const char* p = text.data();
  std::size_t left = text.size();
  while (left > 0) {
    ssize_t w = ::write(fd, p, left);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return;
    p += w;
    left -= static_cast<std::size_t>(w);
  }
}

inline std::string read_all(int fd) {
  std::string out;
  char buf[4096];
  for (;;) {
    ssize_t r = ::read(fd, buf, sizeof(buf));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) break;
    out.append(buf, static_cast<std::size_t>(r));
  }
  return out;
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

/// The variable that tells rank 0's rendezvous which inherited descriptor is the listening MASTER_PORT
/// socket spawn reserved (loom/launch/rendezvous.hpp takes it over once; other processes never see it).
inline constexpr const char* kMasterListenFdVariable = "LOOM_MASTER_LISTEN_FD";

/// Sets torchrun's variables (and SpawnOptions::env) in a freshly forked child, and its thread count.
/// `listen_fd` >= 0 (rank 0 only): the reserved MASTER_PORT socket, kept open across exec and named
/// in LOOM_MASTER_LISTEN_FD; otherwise that variable is removed.
inline void prepare_child(int rank, int nprocs, std::uint16_t port, const std::string& secret,
                          const SpawnOptions& options, pid_t parent, int listen_fd) {
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != parent) ::_exit(111);  // the parent died between fork and prctl
  // Signal dispositions as an exec'd rank would have them: handlers installed by the parent (a test
  // framework's crash reporter, an application's SIGTERM handler) belong to the parent and become
  // SIG_DFL; signals the parent ignores (SIGPIPE under a Python launcher, SIGHUP under nohup) stay
  // ignored, as execve(2) keeps them.
  for (int sig = 1; sig < NSIG; ++sig) {
    if (sig == SIGKILL || sig == SIGSTOP) continue;
    struct sigaction current {};
    if (::sigaction(sig, nullptr, &current) != 0) continue;
    if ((current.sa_flags & SA_SIGINFO) == 0 && current.sa_handler == SIG_IGN) continue;
    ::signal(sig, SIG_DFL);
  }
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);
  for (const char* v : {"TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID",
                        "TORCHELASTIC_MAX_RESTARTS"})
    ::unsetenv(v);
  auto set = [](const std::string& k, const std::string& v) { ::setenv(k.c_str(), v.c_str(), 1); };
  set("RANK", std::to_string(rank));
  set("WORLD_SIZE", std::to_string(nprocs));
  set("LOCAL_RANK", std::to_string(rank));
  set("LOCAL_WORLD_SIZE", std::to_string(nprocs));
  set("GROUP_RANK", "0");
  set("GROUP_WORLD_SIZE", "1");
  set("MASTER_ADDR", options.master_addr);
  set("MASTER_PORT", std::to_string(port));
  set("LOOM_RENDEZVOUS_SECRET", secret);
  set("LOOM_LAUNCHER", "spawn:" + std::to_string(port));  // the mark names this job's MASTER_PORT
  if (listen_fd >= 0) {
    ::fcntl(listen_fd, F_SETFD, ::fcntl(listen_fd, F_GETFD) & ~FD_CLOEXEC);  // spawn_command's exec keeps it
    set(kMasterListenFdVariable, std::to_string(listen_fd));
  } else {
    ::unsetenv(kMasterListenFdVariable);
  }
  if (options.threads_per_rank > 0) set("OMP_NUM_THREADS", std::to_string(options.threads_per_rank));
  for (const auto& [k, v] : options.env) set(k, v);
}

/// Ends a child: flushes stdio and leaves with _exit, so the child does not run the parent's atexit
/// handlers and static destructors (test frameworks, LibTorch's pools), which belong to the parent.
[[noreturn]] inline void finish_child(int message_fd, int code) {
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  ::close(message_fd);
  ::_exit(code);
}

/// Body of a forked child running `fn`; never returns.
template <class F>
[[noreturn]] void run_function_child(F& fn, int rank, const SpawnOptions& options, int message_fd) {
  int code = 0;
  try {
    if (options.threads_per_rank > 0) at::set_num_threads(options.threads_per_rank);
    if constexpr (std::invocable<F&, int>) {
      fn(rank);
    } else {
      const Environment env = Environment::from_env();
      fn(env);
    }
  } catch (const std::exception& e) {
    // LibTorch's errors without their C++ backtrace (what_without_backtrace, and any backtrace a
    // message quotes): the parent's SpawnError is read by a person.
    write_all(message_fd, fmt::format("{}: {}", demangled_type_name(typeid(e)), without_backtrace(exception_text(e))));
    code = 1;
  } catch (...) {
    auto* t = abi::__cxa_current_exception_type();
    write_all(message_fd, fmt::format("a non-std exception of type {}", t ? demangled_type_name(*t) : "?"));
    code = 1;
  }
  finish_child(message_fd, code);
}

/// Forks nprocs children, runs `child(rank, message_fd)` (which must not return) in each after
/// prepare_child, and supervises them (see spawn's failure handling). Throws SpawnError/TimeoutError.
template <class Child>
void run_ranks(int nprocs, const SpawnOptions& options, Child&& child) {
  if (nprocs < 1) throw InvalidArgument(fmt::format("spawn: nprocs = {} (need >= 1)", nprocs));
  if (options.threads_per_rank < 0)
    throw InvalidArgument(fmt::format("spawn: threads_per_rank = {} (need >= 0)", options.threads_per_rank));

  const std::string secret = random_job_secret();
  int reserved_fd = -1;
  std::uint16_t port = options.master_port;
  if (port == 0) std::tie(reserved_fd, port) = reserve_port();
  // LibTorch 2.x: the reserved socket starts listening here and rank 0's store takes it over
  // (TCPStoreOptions::masterListenFd), so the port is never free between reservation and the store,
  // and a rank that connects before rank 0's store runs waits in the socket's backlog instead of being
  // refused. IPv4 masters only (the socket is IPv4). LibTorch 1.13 cannot take a socket over: the
  // port is released once every rank is forked and rank 0 binds it again.
  in_addr ipv4{};
  const bool hand_over = reserved_fd >= 0 && kStoreTakesListenFd &&
                         ::inet_pton(AF_INET, options.master_addr.c_str(), &ipv4) == 1 &&
                         ::listen(reserved_fd, SOMAXCONN) == 0;

  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);  // nothing buffered in the parent is printed twice by the children

  const pid_t parent = ::getpid();
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
      const bool keep = hand_over && r == 0;
      if (reserved_fd >= 0 && !keep) ::close(reserved_fd);
      prepare_child(r, nprocs, port, secret, options, parent, keep ? reserved_fd : -1);
      child(r, pipefd[1]);
      finish_child(pipefd[1], 112);  // child() must not return
    }
    ::close(pipefd[1]);
    pids[static_cast<std::size_t>(r)] = pid;
    fds[static_cast<std::size_t>(r)] = pipefd[0];
  }
  // Every rank is started: the parent's copy of the reserved socket goes (rank 0 holds the listening
  // socket when it was handed over; otherwise the port is free for rank 0's store to bind).
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
        if (first_failure == clock::time_point{}) first_failure = clock::now();
      }
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
  if (!failures.empty()) throw SpawnError(nprocs, std::move(failures));
}

}  // namespace detail

}  // namespace loom
