// loom/schedule/all.hpp — every header of loom/schedule: generators onto devices.
//
// Example:
//   #include <loom/schedule/all.hpp>
//   loom::GeneratorLoader sched(std::move(generators), {.num_devices = 8});   // in-process mode
//   loom::RankGeneratorLoader per_rank(comm, 16, make_generator);            // per-rank mode
//
// See docs/schedule.md for the guide.
#pragma once

#include <loom/schedule/assign.hpp>
#include <loom/schedule/core.hpp>
#include <loom/schedule/generator.hpp>
#include <loom/schedule/collate_fn.hpp>
#include <loom/schedule/rank_generator_loader.hpp>
#include <loom/schedule/generator_loader.hpp>
#include <loom/schedule/transfer.hpp>
