// loom/reduce/module.hpp — parameters_of(torch::nn::Module&): a C++-frontend model as a
// loom::ParameterList for loom::Reducer.
//
// One sentence: takes the module's parameters (recursively, registration order, each shared tensor
// once) with their dotted names, and its buffers.
//
// Example:
//   auto model = torch::nn::Sequential(torch::nn::Linear(4, 8), torch::nn::ReLU(), torch::nn::Linear(8, 1));
//   loom::Reducer reducer(comm, loom::parameters_of(*model));
//   // names: "0.weight", "0.bias", "2.weight", "2.bias"
//
// Shape: the tensors are the module's own (no copies); frozen parameters are listed (the reducer
//        skips them). Throws: nothing of its own.
// Source: torch::nn::Module::named_parameters / buffers (like DDP's module.parameters()).
#pragma once

#include <unordered_set>

#include <torch/nn/module.h>

#include <loom/reduce/parameters.hpp>

namespace loom {

/// The parameters (dotted names, registration order, shared tensors once) and buffers of `module`.
///
/// Example: `loom::Reducer reducer(comm, loom::parameters_of(*model));`
inline ParameterList parameters_of(const torch::nn::Module& module) {
  ParameterList list;
  std::unordered_set<const void*> seen;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    if (!seen.insert(item.value().unsafeGetTensorImpl()).second) continue;
    list.names.push_back(item.key());
    list.params.push_back(item.value());
  }
  for (const auto& b : module.buffers(/*recurse=*/true))
    if (seen.insert(b.unsafeGetTensorImpl()).second) list.buffers.push_back(b);
  return list;
}

}  // namespace loom
