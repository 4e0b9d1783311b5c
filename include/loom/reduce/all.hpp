// loom/reduce/all.hpp — every portable public header of loom/reduce/, in one include.
//
// Example:
//   #include <loom/reduce/all.hpp>
//   loom::Reducer reducer(comm, loom::parameters_of(*model));
//
// Contents: GradientReducer (concepts.hpp), ReducerOptions / Average / HostReads (options.hpp),
// the bucket layout (buckets.hpp), ParameterList / check_same_parameters / broadcast_from_rank0
// (parameters.hpp), parameters_of for torch::nn::Module (module.hpp), Reducer (reducer.hpp).
// Not included (opt in): reduce/jit.hpp, parameters_of for TorchScript modules (it pulls in
// LibTorch's JIT headers). Guide: docs/reduce.md.
#pragma once

#include <loom/reduce/buckets.hpp>
#include <loom/reduce/concepts.hpp>
#include <loom/reduce/module.hpp>
#include <loom/reduce/options.hpp>
#include <loom/reduce/parameters.hpp>
#include <loom/reduce/reducer.hpp>
