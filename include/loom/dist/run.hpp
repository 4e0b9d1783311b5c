// loom/dist/run.hpp — one entry point for "run this function as my rank": inside a job started by
// torchrun, mpirun or srun it joins that job (fn(group) once); started by hand it forks `nproc`
// local ranks (loom::spawn, with torchrun's variables) and calls fn(group) in each.
//
// Example:
//   int main(int argc, char** argv) try {
//     loom::run([](loom::ProcessGroup& pg) {
//       loom::Logger log(loom::StreamSink{stdout}, pg);
//       log.info("rank {} of {} on {}", pg.rank(), pg.world_size(), pg.device().str());
//     }, {.nproc = 2});
//   } catch (const loom::Error& e) { std::fprintf(stderr, "%s\n", e.what()); return 1; }
//   //   ./train                       -> 2 local ranks (spawned)
//   //   torchrun --nproc-per-node 4 ./train, mpirun -np 4 ./train, srun -n 4 ./train -> joins as one rank
//
// nproc == 1 without a launcher runs fn in this process (rank 0 of 1, no fork, no port); with a
// launcher nproc is ignored. Spawned ranks follow spawn's fork rule (one intra-op thread each).
// Guide: docs/launching.md#loomspawn-ranks-on-this-machine.
// Source: torch.multiprocessing.spawn and torch.distributed.run's environment, folded into one call
//         as Accelerate's `notebook_launcher` / `accelerate launch`.
#pragma once

#include <concepts>
#include <utility>

#include <fmt/format.h>

#include <loom/dist/process_group.hpp>
#include <loom/error.hpp>
#include <loom/launch/environment.hpp>
#include <loom/launch/spawn.hpp>

namespace loom {

/// Options of run(); use with designated initializers.
///
/// Example: `loom::RunOptions{.nproc = 4, .group = {.backend = loom::Backend::gloo}}`.
struct RunOptions {
  int nproc = 1;                ///< local ranks to spawn when no launcher variables are set
  ProcessGroupOptions group{};  ///< backend and timeout of each rank's ProcessGroup
  SpawnOptions spawn{};         ///< supervision of spawned ranks (timeout, grace, environment);
                                ///< with group.elastic, spawn.elastic is set (the store in spawn's process)
};

/// Runs `fn(ProcessGroup&)` as this process's rank, or as `options.nproc` spawned local ranks.
///
/// Example: `loom::run([](loom::ProcessGroup& pg) { train(pg); }, {.nproc = 2});`
/// Throws: loom::InvalidArgument (nproc < 1); loom::ConfigError (bad launcher variables); the
///         ProcessGroup's errors; loom::SpawnError naming the rank that failed when spawning.
template <class F>
requires std::invocable<F&, ProcessGroup&>
void run(F&& fn, const RunOptions& options = {}) {
  if (options.nproc < 1) throw InvalidArgument(fmt::format("run: nproc = {} (need >= 1)", options.nproc));
  const Environment env = Environment::from_env();
  if (env.launcher != Launcher::none || options.nproc == 1) {
    ProcessGroup group(env, options.group);
    fn(group);
    return;
  }
  SpawnOptions spawning = options.spawn;
  // An elastic group needs a store that outlives every rank, and ranks whose death ends nothing.
  if (options.group.elastic) spawning.elastic = true;
  spawn(
      options.nproc,
      [&](const Environment& rank_env) {
        ProcessGroup group(rank_env, options.group);
        fn(group);
      },
      spawning);
}

}  // namespace loom
