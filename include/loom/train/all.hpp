// loom/train/all.hpp — the short training path in one include: BatchLoader and Trainer.
//
// Example:
//   #include <loom/train/all.hpp>
//   loom::BatchLoader loader(pg, shapes, fetch, {.max_samples = 8, .batches_per_step = 2});
//   loom::Trainer trainer(pg, *model, opt);
//   for (loom::Batch& b : trainer.epoch(loader, epoch)) trainer.backward(loss_of(b), b);
//
// Contents: BatchLoader / LoaderOptions (loader.hpp), Trainer (trainer.hpp), TrainerOptions /
// StepOptimizer / StepFunctions (options.hpp), EpochRange (epoch_range.hpp), BatchSource /
// PlannedBatchSource (batch_source.hpp), save_checkpoint / load_checkpoint (checkpoint.hpp), evaluate
// (evaluate.hpp). Guide:
// docs/loop.md.
#pragma once

#include <loom/train/batch_source.hpp>
#include <loom/train/checkpoint.hpp>
#include <loom/train/epoch_range.hpp>
#include <loom/train/evaluate.hpp>
#include <loom/train/loader.hpp>
#include <loom/train/options.hpp>
#include <loom/train/trainer.hpp>
