// loom/collate/all.hpp — every public header of loom/collate/, in one include.
//
// Example:
//   #include <loom/collate/all.hpp>
//   for (loom::Batch& b : samples | loom::views::bucket_by_shape({.max_samples = 64})) step(b);
//
// Contents: Batch (batch.hpp), SampleProjection / DefaultProjection (sample.hpp), BufferPool and
// BatchAllocator (pool.hpp), ShapeBucketOptions / PaddedBucketOptions / DimPadding / CollateStats
// (options.hpp), BucketPlanner / PlannedBatch (planner.hpp), BucketCollator (collator.hpp),
// collate() / CollateOptions (collate_list.hpp), auto_boundaries (boundaries.hpp),
// views::bucket_by_shape / bucket_padded (views.hpp), BatchTransfer / HostTransfer (transfer.hpp).
// Guide: docs/collate.md.
#pragma once

#include <loom/collate/batch.hpp>
#include <loom/collate/boundaries.hpp>
#include <loom/collate/collate_list.hpp>
#include <loom/collate/collator.hpp>
#include <loom/collate/options.hpp>
#include <loom/collate/planner.hpp>
#include <loom/collate/pool.hpp>
#include <loom/collate/sample.hpp>
#include <loom/collate/transfer.hpp>
#include <loom/collate/views.hpp>
