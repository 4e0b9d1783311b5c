// loom/schedule/all.hpp — every public header of loom/schedule: generators onto devices.
//
// Example:
//   #include <loom/schedule/all.hpp>
//   loom::GeneratorLoader loader(std::move(generators), {.num_devices = 8});   // in-process mode
//   loom::RankGeneratorLoader per_rank(pg, 16, make_generator);               // per-rank mode
//
// Contents: SampleGenerator concepts (generator.hpp), Assignment / assign (assign.hpp),
// GeneratorLoaderOptions / EndPolicy / GeneratorLoaderState (options.hpp), DeviceBatch /
// GeneratorLoaderStep / reports / GeneratorError (results.hpp), CollateFunction / DefaultCollate
// (collate_fn.hpp), BatchTransfer / HostTransfer (loom/collate/transfer.hpp, the seam both loaders
// take), GeneratorLoader (generator_loader.hpp), RankGeneratorLoader (rank_generator_loader.hpp).
// Guide: docs/schedule.md.
#pragma once

#include <loom/collate/transfer.hpp>
#include <loom/schedule/assign.hpp>
#include <loom/schedule/collate_fn.hpp>
#include <loom/schedule/generator.hpp>
#include <loom/schedule/generator_loader.hpp>
#include <loom/schedule/options.hpp>
#include <loom/schedule/rank_generator_loader.hpp>
#include <loom/schedule/results.hpp>
