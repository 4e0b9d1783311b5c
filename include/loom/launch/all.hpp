// loom/launch/all.hpp — how a rank learns its place and meets the others, in one include: the
// launcher's environment (torchrun, Open MPI, Slurm), rendezvous at the job's TCPStore, the rank's
// GPU, and spawn (N ranks on this machine). Below comm/: communicators are built from these.
//
// Example:
//   #include <loom/launch/all.hpp>
//   const auto env = loom::Environment::from_env();   // RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ...
//   auto store = loom::rendezvous(env);                // every rank has arrived
//
// See docs/launching.md.
#pragma once

#include <loom/launch/environment.hpp>
#include <loom/launch/rank_device.hpp>
#include <loom/launch/rendezvous.hpp>
#include <loom/launch/spawn.hpp>
