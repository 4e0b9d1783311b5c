// loom/dist/all.hpp — launcher environments, rendezvous, spawn, the process group and run() in one include.
//
// Example:
//   #include <loom/dist/all.hpp>
//   loom::run([](loom::ProcessGroup& pg) { /* one rank */ }, {.nproc = 2});
//
// See docs/launching.md.
#pragma once

#include <loom/dist/environment.hpp>
#include <loom/dist/process_group.hpp>
#include <loom/dist/rank_device.hpp>
#include <loom/dist/rendezvous.hpp>
#include <loom/dist/run.hpp>
#include <loom/dist/spawn.hpp>
