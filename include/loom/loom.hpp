// loom/loom.hpp — every portable loom component in one include.
//
// One sentence: include this in a LibTorch program to get the communicators, launcher support,
// collators, samplers, scheduler, accumulator, reducer and rank-aware logging; each component's
// own header (listed below) is the narrower choice when compile time matters.
//
// Example (the README's loop, examples/readme_loop.cpp):
//   loom::run([](loom::ProcessGroup& pg) {
//     loom::BatchLoader loader(pg, shapes, fetch, {.max_samples = 8, .batches_per_step = 2});
//     loom::Trainer trainer(pg, *model, opt);
//     for (loom::Batch& b : trainer.epoch(loader, epoch)) trainer.backward(loss_of(b), b);
//   }, {.nproc = 2});
//
// Included: error.hpp, config.hpp, comm/communicator.hpp, comm/local.hpp, comm/gloo.hpp (when
// LOOM_HAS_GLOO), dist.hpp (with the ProcessGroup, which includes comm/nccl.hpp when the build has
// NCCL and a CUDA LibTorch), collate/collate.hpp, sample/sample.hpp, schedule/all.hpp,
// accumulate/accumulator.hpp, reduce/reducer.hpp, reduce/module.hpp, log/all.hpp, train/loader.hpp,
// train/trainer.hpp.
// Not included (opt in): comm/nccl.hpp and cuda/ otherwise (need CUDA and NCCL at link time),
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

#include <loom/train/loader.hpp>
#include <loom/train/trainer.hpp>
