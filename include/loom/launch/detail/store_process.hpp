// loom/launch/detail/store_process.hpp — spawn's store process (SpawnOptions::elastic): a process of
// spawn's own, forked before the ranks, that hosts the job's c10d TCPStore on MASTER_PORT, so the
// store outlives every rank; how spawn starts it, waits until it serves, and ends it.
// Not a public header: loom/launch/spawn.hpp is.
//
// Example (what spawn's run_ranks does with SpawnOptions::elastic):
//   detail::StoreProcess store(nprocs, port, secret, options, parent, reserved_fd, hand_over);  // serving
//   ... fork the ranks and wait for them ...
//   store.end();   // SIGTERM, SIGKILL after SpawnOptions::kill_after, reaped (the destructor does it too)
//
// What the store process does: it gets rank 0's variables (prepare_child), so its MASTER_PORT,
// WORLD_SIZE and job secret are the ranks' (SpawnOptions::env included); it hosts the store on the
// listening MASTER_PORT socket spawn reserved (LibTorch 2.x; inherited across fork) or binds the port
// itself (LibTorch 1.13, which cannot take a socket over: kStoreTakesListenFd), writes whose store it
// is under kStoreIdentityKey (the job tag of the secret, the world size, its host:pid) so the ranks'
// identity check passes, says "ready" (or what failed) through a pipe, and then sleeps until spawn
// ends it. PR_SET_PDEATHSIG: it dies with spawn's process.
// Source: c10d's TCPStore server (TCPStoreOptions::masterListenFd); prctl(2), waitpid(2).
#pragma once

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>
#include <fcntl.h>
#include <optional>
#include <poll.h>
#include <signal.h>
#include <string>
#include <string_view>
#include <sys/types.h>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>

#include <c10/util/intrusive_ptr.h>
#include <fmt/format.h>
#include <string.h>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <loom/detail/exception_text.hpp>
#include <loom/detail/torch_api.hpp>
#include <loom/error.hpp>
#include <loom/launch/detail/check_in.hpp>
#include <loom/launch/detail/spawn_child.hpp>
#include <loom/launch/detail/store_identity.hpp>
#include <loom/launch/environment.hpp>
#include <loom/launch/spawn_options.hpp>

namespace loom::detail {

/// What the store process writes to its pipe once its store serves (anything else is what failed).
inline constexpr std::string_view kStoreProcessReady = "ready";

/// How a process ended, from its waitpid status: "exited with code 1", "was killed by signal SIGKILL (9)".
inline std::string describe_exit_status(int status) {
  if (WIFEXITED(status)) return fmt::format("exited with code {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    const char* name = sigabbrev_np(WTERMSIG(status));
    return fmt::format("was killed by signal SIG{} ({})", name ? name : "?", WTERMSIG(status));
  }
  return fmt::format("ended with status {}", status);
}

/// Body of the store process after prepare_child; never returns: hosts the store (on `listen_fd`, the
/// listening socket of `reserved_port`, when it is >= 0 and MASTER_PORT is that port), writes its
/// identity, reports through `ready_fd` (kStoreProcessReady, or the error's text and exit code 1),
/// then waits for spawn's SIGTERM (the store's threads serve the ranks meanwhile).
[[noreturn]] inline void run_store_process(int ready_fd, int listen_fd, std::uint16_t reserved_port) {
  // A reply to a rank that died fails with EPIPE instead of ending the store with SIGPIPE.
  ::signal(SIGPIPE, SIG_IGN);
  std::string failure;
  c10::intrusive_ptr<c10d::Store> store;
  try {
    const Environment env = Environment::from_env();
    c10d::TCPStoreOptions opts;
    opts.port = env.master_port;
    opts.isServer = true;
    opts.numWorkers = static_cast<std::size_t>(env.world_size);
    opts.waitWorkers = false;  // the ranks' check-in counts them
    opts.timeout = kDefaultTimeout;
    // LibTorch 2.x: the listening socket spawn reserved; none with 1.13 (c10d binds MASTER_PORT).
    if (listen_fd >= 0 && env.master_port == reserved_port) set_master_listen_fd(opts, listen_fd);
    store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, opts);
    store->set(kStoreIdentityKey, store_bytes(store_identity(env)));
  } catch (const std::exception& e) {
    failure = without_backtrace(exception_text(e));
    if (failure.empty()) failure = "an exception without a message";
  }
  if (!failure.empty()) {
    write_all(ready_fd, failure);
    finish_child(ready_fd, 1);
  }
  write_all(ready_fd, std::string(kStoreProcessReady));
  ::close(ready_fd);
  for (;;) ::pause();  // until SIGTERM from spawn, or SIGKILL when spawn's process dies
}

/// spawn's store process: forked and serving once constructed, ended and reaped by end() or by the
/// destructor, so no way out of spawn (return, SpawnError, TimeoutError, a failed fork) leaves it.
class StoreProcess {
 public:
  /// Forks the store process (prepare_child with rank 0's variables; `reserved_fd`, when >= 0, is the
  /// socket spawn reserved `port` with: its store takes it over when `take_over`, else it is closed
  /// there) and waits until it serves, at most `options.timeout` (kDefaultTimeout when 0).
  /// Throws: loom::CommError naming MASTER_PORT when it cannot host the store (the port is taken, a
  ///         bad SpawnOptions::env) or does not say so in time; loom::Error when pipe or fork fail.
  StoreProcess(int nprocs, std::uint16_t port, const std::string& secret, const SpawnOptions& options, pid_t parent,
               int reserved_fd, bool take_over)
      : kill_after_(options.kill_after) {
    int pipefd[2];
    if (::pipe2(pipefd, O_CLOEXEC) != 0)
      throw Error(fmt::format("spawn: pipe() for the store process failed: {}", std::strerror(errno)));
    pid_ = ::fork();
    if (pid_ < 0) {
      const int err = errno;
      ::close(pipefd[0]);
      ::close(pipefd[1]);
      throw Error(fmt::format("spawn: fork() of the store process failed: {}", std::strerror(err)));
    }
    if (pid_ == 0) {
      ::close(pipefd[0]);
      if (reserved_fd >= 0 && !take_over) ::close(reserved_fd);
      try {
        prepare_child(0, nprocs, port, secret, options, parent, -1);
      } catch (const std::exception& e) {
        write_all(pipefd[1], exception_text(e));
        finish_child(pipefd[1], 1);  // never unwinds into spawn's frame in this copy
      } catch (...) {
        finish_child(pipefd[1], 1);
      }
      run_store_process(pipefd[1], take_over ? reserved_fd : -1, port);
    }
    ::close(pipefd[1]);
    const auto wait = options.timeout.count() > 0 ? options.timeout : kDefaultTimeout;
    pollfd pfd{pipefd[0], POLLIN, 0};
    const auto deadline = std::chrono::steady_clock::now() + wait;
    int ready = 0;
    for (;;) {
      const auto left =
          std::chrono::ceil<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count();
      ready = ::poll(&pfd, 1, static_cast<int>(std::max<long long>(left, 0)));
      if (!(ready < 0 && errno == EINTR)) break;
    }
    // The store process writes one short text and then closes the pipe or exits: read to the end.
    const std::string said = ready > 0 ? read_all(pipefd[0]) : std::string();
    ::close(pipefd[0]);
    if (said == kStoreProcessReady) return;
    const pid_t pid = pid_;
    const auto status = end();
    const std::string how = status ? describe_exit_status(*status) : std::string("ended");
    const std::string where = fmt::format("{}:{} (MASTER_PORT)", options.master_addr, port);
    if (ready <= 0)
      throw CommError(fmt::format("spawn: the store process (pid {}) did not serve the store on {} within {:.3f} s",
                                  pid, where, std::chrono::duration<double>(wait).count()));
    throw CommError(fmt::format("spawn: the store process (pid {}) could not host the store on {}: {}", pid, where,
                                said.empty() ? "it " + how + " without saying why" : said));
  }
  StoreProcess(const StoreProcess&) = delete;
  StoreProcess& operator=(const StoreProcess&) = delete;
  ~StoreProcess() { (void)end(); }

  /// When the store process ended on its own (reaped here), how: "was killed by signal SIGKILL (9)";
  /// nothing while it runs. Polled by spawn while the ranks run.
  std::optional<std::string> ended_early() {
    if (pid_ <= 0) return std::nullopt;
    int status = 0;
    pid_t w = ::waitpid(pid_, &status, WNOHANG);
    if (w == 0 || (w < 0 && errno == EINTR)) return std::nullopt;
    pid_ = -1;
    return w < 0 ? std::string("was reaped elsewhere") : describe_exit_status(status);
  }

  /// Ends the store process: SIGTERM, then SIGKILL when it still runs after SpawnOptions::kill_after;
  /// reaps it. Returns its waitpid status (nothing when it was reaped before). A second call does nothing.
  std::optional<int> end() noexcept {
    if (pid_ <= 0) return std::nullopt;
    const pid_t pid = pid_;
    pid_ = -1;
    ::kill(pid, SIGTERM);
    const auto deadline = std::chrono::steady_clock::now() + kill_after_;
    int status = 0;
    for (;;) {
      const pid_t w = ::waitpid(pid, &status, WNOHANG);
      if (w == pid) break;
      if (w < 0 && errno != EINTR) return std::nullopt;
      if (w == 0 && std::chrono::steady_clock::now() >= deadline) {
        ::kill(pid, SIGKILL);
        while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
        }
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return status;
  }

 private:
  pid_t pid_ = -1;
  std::chrono::milliseconds kill_after_;
};

}  // namespace loom::detail
