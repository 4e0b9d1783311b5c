// loom/optim/all.hpp — every public header of loom/optim/, in one include.
//
// Example:
//   #include <loom/optim/all.hpp>
//   loom::ShardedOptimizer sharded(comm, adam);   // ZeRO stage 1: this rank's shard of Adam's state
//
// Contents: ShardedOptimizer, its options and optimizer_state_bytes (sharded_optimizer.hpp).
// Guide: docs/zero.md.
#pragma once

#include <loom/optim/sharded_optimizer.hpp>
