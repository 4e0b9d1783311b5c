// loom/loom.hpp — every portable loom component in one include.
//
// One sentence: include this in a LibTorch program to get the communicators, launcher support and
// process group, collation, samplers, generator loaders, accumulator, reducer, rank-aware logging
// and the short training path (BatchLoader, Trainer); each component's umbrella
// `<loom/<component>/all.hpp>` (or one header of it) is the narrower choice when compile time matters.
//
// Example (a sketch; the whole loop is the README's, examples/readme_loop.cpp):
//   loom::run([](loom::ProcessGroup& pg) {
//     loom::BatchLoader loader(pg, shapes, fetch, {.max_samples = 8, .batches_per_step = 2});
//     loom::Trainer trainer(pg, *model, opt);
//     for (loom::Batch& b : trainer.epoch(loader, epoch)) trainer.backward(loss_of(b), b);
//   }, {.nproc = 2});
//
// Included: error.hpp, config.hpp and the umbrellas comm/all.hpp (GlooCommunicator when
// LOOM_HAS_GLOO; NcclCommunicator when the build has NCCL and a CUDA LibTorch), launch/all.hpp,
// dist/all.hpp, collate/all.hpp, sample/all.hpp, schedule/all.hpp, accumulate/all.hpp,
// reduce/all.hpp, log/all.hpp, trace/all.hpp, train/all.hpp.
// Not included (opt in): comm/nccl.hpp in a build with NCCL but a CPU LibTorch, and cuda/ (cuda/all.hpp)
// (they need the CUDA runtime, and NCCL, at link time); reduce/jit.hpp (TorchScript modules).
#pragma once

#include <loom/accumulate/all.hpp>
#include <loom/collate/all.hpp>
#include <loom/comm/all.hpp>
#include <loom/compat.hpp>
#include <loom/config.hpp>
#include <loom/dist/all.hpp>
#include <loom/error.hpp>
#include <loom/launch/all.hpp>
#include <loom/log/all.hpp>
#include <loom/optim/all.hpp>
#include <loom/reduce/all.hpp>
#include <loom/sample/all.hpp>
#include <loom/schedule/all.hpp>
#include <loom/trace/all.hpp>
#include <loom/train/all.hpp>
