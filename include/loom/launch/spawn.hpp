// loom/launch/spawn.hpp — run a function as N ranks on this machine, in N forked processes, the way
// torchrun would start them (tests, examples, single-node jobs).
//
// One sentence: `loom::spawn(nprocs, fn)` forks nprocs children with torchrun's variables set, runs
// `fn(rank)` (or `fn(env)`) in each, waits for all, and if one fails terminates the others and throws
// loom::SpawnError saying which rank failed and how (with SpawnOptions::elastic the others go on and
// the store outlives them: see "Elastic" below).
//
// Example:
//   loom::spawn(2, [](const loom::Environment& env) {
//     loom::GlooCommunicator comm(env);
//     auto t = torch::full({4}, float(env.rank));
//     comm.all_reduce(t, loom::ReduceOp::sum);          // [1, 1, 1, 1] on both ranks
//   });
//
// What each child gets (torchrun's names, so Environment::from_env() reads them):
//   RANK=r, WORLD_SIZE=n, LOCAL_RANK=r, LOCAL_WORLD_SIZE=n, GROUP_RANK=0, GROUP_WORLD_SIZE=1,
//   MASTER_ADDR=127.0.0.1, MASTER_PORT=<a free port spawn picked>, OMP_NUM_THREADS=<threads_per_rank>,
//   LOOM_RENDEZVOUS_SECRET=<128 random bits, new for every spawn call> (see loom/launch/rendezvous.hpp),
//   LOOM_LAUNCHER=spawn:<that MASTER_PORT> (Environment::launcher reads Launcher::spawn, not torchrun),
//   LOOM_MASTER_LISTEN_FD=<fd> in rank 0 with LibTorch 2.x, not with elastic (the listening
//   MASTER_PORT socket spawn reserved, which rank 0's rendezvous hosts its store on: the port is
//   never free in between), LOOM_STORE_HOST=spawn with SpawnOptions::elastic (every rank is a client
//   of spawn's store process: Environment::external_store; removed otherwise), then SpawnOptions::env
//   on top (it may override any of these). TORCHELASTIC_* variables inherited from the parent are
//   removed (a spawned job is not a torchrun job) unless SpawnOptions::env sets them.
//   Signals as after execve(2): the parent's handlers are reset to SIG_DFL, signals the parent
//   ignores stay ignored; the signal mask is emptied.
//
// Failure handling: a rank fails when fn throws (the exception's type and what() travel to the parent
// through a pipe), when it exits with a non-zero code (std::exit, abort), or when a signal kills it.
// Without elastic, the first failure starts a grace period (SpawnOptions::grace) in which the other ranks may finish on
// their own (typically they see the dead peer and throw loom::TimeoutError, which is reported too);
// ranks still running after it get SIGTERM, then SIGKILL. spawn then throws loom::SpawnError whose
// failures() lists every failed rank, the first one first. A child dies with its parent (PR_SET_PDEATHSIG).
//
// Elastic (SpawnOptions::elastic = true; for jobs whose survivors go on after a rank dies):
//   - the store lives in a store process of spawn's, forked before the ranks: it hosts the job's
//     TCPStore on MASTER_PORT (taking over the reserved socket with LibTorch 2.x, binding the port
//     with 1.13), writes the store's identity, and runs until spawn ends it (SIGTERM, then SIGKILL
//     after kill_after; it dies with spawn's process too). Every rank's rendezvous is a client of it,
//     so the store outlives any rank, rank 0 included (loom/launch/detail/store_process.hpp).
//   - a rank's death (a signal, a non-zero exit, fn throwing) starts no grace period and terminates
//     nobody: spawn waits until every rank has ended. Then it throws loom::SpawnError (listing the
//     failures) when a rank threw or exited non-zero, or when no rank succeeded; when ranks were only
//     killed by signals and the others succeeded, it prints one line per dead rank to stderr
//     ("loom: spawn: rank 1 was killed by signal SIGKILL (9); the other ranks went on (elastic)")
//     and returns. SpawnOptions::timeout still terminates all ranks (loom::TimeoutError).
//   - the store process is ended and reaped before spawn returns or throws, whatever happened.
//   Example:
//     loom::spawn(3, [](const loom::Environment& env) {
//       auto store = loom::rendezvous(env);            // a client of spawn's store process
//       if (env.rank == 0) std::raise(SIGKILL);        // ranks 1 and 2 still reach the store
//       ...
//     }, {.elastic = true});                           // returns; stderr names rank 0
//   spawn_command supports it the same way (the exec'd program's rendezvous reads LOOM_STORE_HOST);
//   the store process itself is forked, not exec'd, so the fork rule's point on other threads'
//   locks applies to spawn_command's caller then too.
//
// The fork rule (read this): fork() copies only the calling thread. LibTorch's intra-op pool is
// OpenMP (libgomp) in Debian's build, and libgomp is not fork-safe: a child that starts a parallel
// region after the parent has used the pool can hang forever. spawn therefore sets, in every child,
// at::set_num_threads(threads_per_rank) with threads_per_rank = 1 by default (torchrun also sets
// OMP_NUM_THREADS=1 for multi-process jobs), which keeps at::parallel_for on the calling thread.
// Asking for more than one thread per rank is safe only if the parent has not run a parallel ATen op
// yet (spawn before any tensor work, as examples do); otherwise keep 1. Also: do not call spawn while
// other threads of the parent hold locks the child needs (a running GlooCommunicator, a logger thread).
//
// Throws: loom::InvalidArgument (nprocs < 1), loom::SpawnError (a RemoteError: which rank failed, how),
//         loom::TimeoutError("spawn", ...) when SpawnOptions::timeout elapsed (all ranks terminated),
//         loom::CommError when the elastic store process cannot host the store (naming MASTER_PORT),
//         loom::Error when fork/pipe/socket fail.
// Source: torch.multiprocessing.spawn (fork start method; join raises ProcessRaisedException /
//         ProcessExitedException naming the rank) and torchrun's environment variables.
#pragma once

#include <cerrno>
#include <concepts>
#include <cstring>
#include <string>
#include <type_traits>
#include <unistd.h>
#include <vector>

#include <fmt/format.h>

#include <loom/error.hpp>
#include <loom/launch/detail/spawn_child.hpp>
#include <loom/launch/detail/spawn_posix.hpp>
#include <loom/launch/environment.hpp>
#include <loom/launch/spawn_options.hpp>

namespace loom {

/// What spawn can run: a callable taking the rank (int) or the rank's Environment.
///
/// Requirements:
///  1. Invocable as `f(int rank)` or as `f(const Environment& env)`. Reason: simple tests want the
///     rank; real programs want the full environment (the same one from_env() gives under torchrun).
///  2. Copy-free use: spawn calls it in the child only, on the forked copy. Reason: fork copies memory.
/// Not required: a return value (ignored), thread safety, copyability.
template <class F>
concept RankFunction = std::invocable<F&, int> || std::invocable<F&, const Environment&>;

/// Runs `fn` as ranks 0..nprocs-1 in nprocs forked processes and waits for all of them.
///
/// Example: `loom::spawn(2, [](int rank) { ... });`  (see the header comment)
///          `loom::spawn(3, fn, {.elastic = true});`  (the store outlives the ranks; a killed rank ends nothing)
/// Units: options' durations are wall-clock.
/// Throws: loom::InvalidArgument (nprocs < 1); loom::SpawnError naming the failed rank(s) and how (with
///         elastic: a rank threw or exited non-zero, or none succeeded); loom::TimeoutError("spawn", ...)
///         when options.timeout elapsed; loom::CommError when the elastic store process cannot host
///         the store; loom::Error when fork fails.
/// Source: torch.multiprocessing.spawn (fork start method).
template <class F>
void spawn(int nprocs, F&& fn, const SpawnOptions& options = {}) {
  static_assert(RankFunction<std::remove_cvref_t<F>>,
                "loom::spawn needs a callable taking (int rank) or (const loom::Environment&)");
  detail::run_ranks(nprocs, options,
                    [&](int rank, int message_fd) { detail::run_function_child(fn, rank, options, message_fd); });
}

/// Runs a program as ranks 0..nprocs-1 (fork + exec, like `torchrun --standalone --nproc-per-node`),
/// with the same variables, supervision and errors as spawn(). The exec-based mode: each rank is a
/// fresh process image, so none of the fork rule applies (any thread count is safe). The program
/// reads its place with Environment::from_env().
///
/// Example: `loom::spawn_command(2, {"./train", "--epochs", "3"});`
///          `loom::spawn_command(2, {"/proc/self/exe", "--worker"});`   // re-run this program as ranks
///          `loom::spawn_command(2, {"./train"}, {.elastic = true});`   // spawn's store process, as spawn()
/// Units: options' durations are wall-clock.
/// Throws: loom::InvalidArgument (nprocs < 1, empty argv); loom::SpawnError (a rank exited non-zero or
///         was killed; a program that cannot be executed is reported as an exception text);
///         loom::TimeoutError("spawn", ...).
/// Source: torchrun's standalone mode (one node, rendezvous on localhost).
inline void spawn_command(int nprocs, const std::vector<std::string>& argv, const SpawnOptions& options = {}) {
  if (argv.empty()) throw InvalidArgument("spawn_command: argv is empty");
  detail::run_ranks(nprocs, options, [&](int /*rank*/, int message_fd) {
    std::vector<char*> args;
    args.reserve(argv.size() + 1);
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    ::execvp(args[0], args.data());
    detail::write_all(message_fd, fmt::format("exec of '{}' failed: {}", argv[0], std::strerror(errno)));
    detail::finish_child(message_fd, 127);
  });
}

}  // namespace loom
