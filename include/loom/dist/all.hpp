// loom/dist/all.hpp — the process group and run() in one include, with what they are built on
// (loom/launch/: environment, rendezvous, rank device, spawn).
//
// Example:
//   #include <loom/dist/all.hpp>
//   loom::run([](loom::ProcessGroup& pg) { /* one rank */ }, {.nproc = 2});
//
// Guide: docs/launching.md (the backend and device: docs/gpu.md#which-backend).
#pragma once

#include <loom/dist/process_group.hpp>
#include <loom/dist/run.hpp>
#include <loom/launch/all.hpp>
