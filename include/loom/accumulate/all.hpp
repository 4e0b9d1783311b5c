// loom/accumulate/all.hpp — every public header of loom/accumulate/, in one include.
//
// Example:
//   #include <loom/accumulate/all.hpp>
//   loom::Accumulator acc(reducer, {.micro_batches_per_step = 4});
//
// Contents: Accumulator and its options (accumulator.hpp), LossScaler (loss_scaler.hpp).
// Guide: docs/reduce.md.
#pragma once

#include <loom/accumulate/accumulator.hpp>
#include <loom/accumulate/loss_scaler.hpp>
