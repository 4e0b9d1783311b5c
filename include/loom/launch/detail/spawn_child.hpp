// loom/launch/detail/spawn_child.hpp — the side of a process loom::spawn forks: its variables
// (torchrun's, the job secret, the listening MASTER_PORT socket, the store's host with
// SpawnOptions::elastic), its signals and parent-death signal, the rank function's run, how it reports
// to the parent (a pipe) and how it ends (_exit). Not a public header: loom/launch/spawn.hpp is.
//
// Example: in a forked child, `detail::prepare_child(rank, n, port, secret, options, parent, -1);`
//          then `detail::run_function_child(fn, rank, options, message_fd);` (never returns).
// Source: torchrun's environment variables; execve(2)'s rules for signal dispositions.
#pragma once

#include <cerrno>
#include <concepts>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fcntl.h>
#include <iostream>
#include <memory>
#include <signal.h>
#include <string>
#include <sys/prctl.h>
#include <sys/types.h>
#include <typeinfo>
#include <unistd.h>

#include <ATen/Parallel.h>
#include <cxxabi.h>
#include <fmt/format.h>

#include <loom/detail/exception_text.hpp>
#include <loom/launch/environment.hpp>
#include <loom/launch/spawn_options.hpp>

namespace loom::detail {

/// The name of a type as written in C++ ("std::out_of_range"), for the parent's SpawnError.
inline std::string demangled_type_name(const std::type_info& ti) {
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> p(abi::__cxa_demangle(ti.name(), nullptr, nullptr, &status), std::free);
  return status == 0 && p ? std::string(p.get()) : std::string(ti.name());
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

/// Reads `fd` to its end (until every writer closed it): what a child said through its pipe.
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

/// The variable that tells rank 0's rendezvous which inherited descriptor is the listening MASTER_PORT
/// socket spawn reserved (loom/launch/rendezvous.hpp takes it over once; other processes never see it;
/// with SpawnOptions::elastic no rank gets it: spawn's store process takes the socket over instead).
inline constexpr const char* kMasterListenFdVariable = "LOOM_MASTER_LISTEN_FD";

/// The variable that tells the ranks of an elastic spawn (SpawnOptions::elastic) that spawn's store
/// process hosts the store, so every rank is a client (Environment::external_store).
inline constexpr const char* kStoreHostVariable = "LOOM_STORE_HOST";

/// Sets torchrun's variables (and SpawnOptions::env) in a freshly forked child, and its thread count.
/// `listen_fd` >= 0 (rank 0 without SpawnOptions::elastic; the store process is handed the socket
/// directly): the reserved MASTER_PORT socket, kept open across exec and named in
/// LOOM_MASTER_LISTEN_FD; otherwise that variable is removed. With SpawnOptions::elastic,
/// LOOM_STORE_HOST=spawn; otherwise it is removed.
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
  if (options.elastic)
    set(kStoreHostVariable, "spawn");
  else
    ::unsetenv(kStoreHostVariable);
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

}  // namespace loom::detail
