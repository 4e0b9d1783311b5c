// loom/loom.hpp — every portable loom component in one include.
//
// One sentence: include this in a LibTorch program to get the communicators, launcher support,
// collators, samplers, scheduler, accumulator, reducer and rank-aware logging; each component's
// own header (listed below) is the narrower choice when compile time matters.
//
// Example (the README's loop, examples/readme_loop.cpp):
//   loom::spawn(2, [](const loom::Environment& env) {
//     loom::GlooCommunicator comm(env);
//     loom::Reducer reducer(comm, loom::parameters_of(*model));
//     loom::Accumulator acc(reducer, {.micro_batches_per_step = 2});
//     ...
//   });
//
// Included: error.hpp, config.hpp, comm/communicator.hpp, comm/local.hpp, comm/gloo.hpp (when
// LOOM_HAS_GLOO), dist.hpp, collate/collate.hpp, sample/sample.hpp, schedule/all.hpp,
// accumulate/accumulator.hpp, reduce/reducer.hpp, reduce/module.hpp, log/all.hpp.
// Not included (opt in): comm/nccl.hpp and cuda/ (need CUDA and NCCL at link time),
// reduce/jit.hpp (TorchScript modules), data/ (dataset readers; need libpng and zlib).
#pragma once

#include <loom/config.hpp>
#include <loom/error.hpp>

#include <loom/comm/communicator.hpp>
#include <loom/comm/local.hpp>
#if LOOM_HAS_GLOO
#include <loom/comm/gloo.hpp>
#endif
#include <loom/dist.hpp>

#include <loom/collate/collate.hpp>
#include <loom/sample/sample.hpp>
#include <loom/schedule/all.hpp>

#include <loom/accumulate/accumulator.hpp>
#include <loom/reduce/module.hpp>
#include <loom/reduce/reducer.hpp>

#include <loom/log/all.hpp>
