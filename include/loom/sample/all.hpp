// loom/sample/all.hpp — everything in loom/sample/, in one include.
//
// Example:
//   #include <loom/sample/all.hpp>
//   loom::DistributedSampler s({.dataset_size = n, .num_replicas = comm.world_size(), .rank = comm.rank()});
//
// Contents: Sampler / ResumableSampler concepts and SamplerState (concepts.hpp), DistributedSampler
// (distributed.hpp), DistributedBucketBatchSampler (bucket_batch.hpp), SampledBatch / collate_sampled
// (sampled_batch.hpp),
// GlobalBatchSampler / GlobalCursor (global_batch.hpp), plan_epoch / deal (global_plan.hpp),
// sample_seed (sample_seed.hpp), gather_results (eval.hpp). Guide: docs/sample.md.
#pragma once

#include <loom/sample/bucket_batch.hpp>
#include <loom/sample/concepts.hpp>
#include <loom/sample/distributed.hpp>
#include <loom/sample/eval.hpp>
#include <loom/sample/global_batch.hpp>
#include <loom/sample/global_plan.hpp>
#include <loom/sample/sample_seed.hpp>
#include <loom/sample/sampled_batch.hpp>
