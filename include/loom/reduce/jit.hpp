// loom/reduce/jit.hpp — parameters_of(torch::jit::Module&): a TorchScript model (for example one
// exported from Python with torch.jit.script / torch.jit.save and loaded with torch::jit::load) as a
// loom::ParameterList, so it can be fine-tuned data-parallel with loom::Reducer.
//
// One sentence: takes the script module's parameters (recursively, in its slot order, each shared
// tensor once) with their dotted names, and its buffers.
//
// Example:
//   torch::jit::Module model = torch::jit::load("model.pt");
//   model.train();
//   loom::Reducer reducer(comm, loom::parameters_of(model));
//   auto loss = model.forward({x}).toTensor();                // sum over samples
//   ...
//
// Shape: the tensors are the module's own. A parameter saved with requires_grad = false is frozen
//        and left out of the reduction. Throws: nothing of its own.
// Source: torch::jit::Module::named_parameters / buffers.
#pragma once

#include <unordered_set>

#include <torch/csrc/jit/api/module.h>

#include <loom/reduce/parameters.hpp>

namespace loom {

/// The parameters (dotted names, slot order, shared tensors once) and buffers of a TorchScript module.
///
/// Example: `loom::Reducer reducer(comm, loom::parameters_of(script_module));`
inline ParameterList parameters_of(const torch::jit::Module& module) {
  ParameterList list;
  std::unordered_set<const void*> seen;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    if (!seen.insert(item.value.unsafeGetTensorImpl()).second) continue;
    list.names.push_back(item.name);
    list.params.push_back(item.value);
  }
  for (const auto& b : module.buffers(/*recurse=*/true))
    if (seen.insert(b.unsafeGetTensorImpl()).second) list.buffers.push_back(b);
  return list;
}

}  // namespace loom
