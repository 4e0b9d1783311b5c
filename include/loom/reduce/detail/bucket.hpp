// loom/reduce/detail/bucket.hpp — a reducer's memory: flat buckets whose slots are the
// parameters' gradients, and per-gradient bookkeeping.
//
// Shape: a bucket's `flat` is [gradients | one used-flag per gradient], one
//        dtype and device; each slot is a tensor sharing `flat`'s storage with its parameter's shape.
//        A float32-accumulated bucket (`main`) holds float16/bfloat16 parameters' gradients in float32.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include <ATen/ATen.h>

namespace loom::detail {

/// A tensor that shares `flat`'s storage from element `offset`, shaped like `like` (its strides when
/// `like` is dense, else row-major). Built with set_() rather than a view op, so autograd does not
/// treat it as a view (LibTorch's Optimizer::zero_grad calls detach_(), which views refuse).
inline at::Tensor alias_into(const at::Tensor& flat, std::int64_t offset, const at::Tensor& like) {
  std::vector<std::int64_t> strides;
  if (like.is_non_overlapping_and_dense()) {
    strides = like.strides().vec();
  } else {
    strides.assign(static_cast<std::size_t>(like.dim()), 1);
    for (std::int64_t d = like.dim() - 2; d >= 0; --d)
      strides[static_cast<std::size_t>(d)] =
          strides[static_cast<std::size_t>(d) + 1] * std::max<std::int64_t>(like.size(d + 1), 1);
  }
  auto t = at::empty({0}, flat.options());
  t.set_(flat.storage(), flat.storage_offset() + offset, like.sizes(), strides);
  return t;
}

/// Whether `g` is exactly the slot `view` (same memory, shape, strides, dtype).
inline bool aliases(const at::Tensor& g, const at::Tensor& view) {
  return g.defined() && g.data_ptr() == view.data_ptr() && g.scalar_type() == view.scalar_type() &&
         g.sizes() == view.sizes() && g.strides() == view.strides();
}

struct GradSlot {
  std::size_t param = 0;        // index into ParameterList::params
  std::size_t bucket = 0;       // bucket holding the gradient
  std::int64_t offset = 0;      // first element in the bucket
  std::size_t flag = 0;         // position among the bucket's used-flags
  at::Tensor view;              // the gradient's memory in the bucket
  at::Tensor saved;             // pre-window gradient of a locally unused parameter (restored if unused everywhere)
  std::int64_t ready_pos = -1;  // order of its first gradient while recording (bucket rebuild)
  bool used = false;            // a gradient arrived during the current window
  bool fired = false;           // a gradient arrived during the current sync backward
  bool was_undefined = false;   // its .grad() was undefined when the window began
};

struct GradBucket {
  at::Tensor flat;    // [head: the gradients | tail: one used-flag per gradient]
  bool main = false;  // float32 slots for 16-bit parameters: .grad() is moved into the slot, never a view of it
  c10::ScalarType param_dtype = c10::ScalarType::Float;  // the dtype of the bucket's parameters
  at::Tensor head;
  at::Tensor tail;
  at::Tensor wire;  // compressed copy of flat (wire_dtype), or undefined
  at::Tensor wire_head;
  at::Tensor wire_tail;
  at::Tensor wire_div;    // float32 [1]: the world size, the pre-division of a compressed bucket
  at::Tensor bad;         // float32 [1] on the bucket's device: inf/NaN in the reduced bucket (device path)
  bool bad_host = false;  // the same verdict, computed on the host (CPU path)
  at::Tensor flags_host;  // pinned staging for the used-flags of a bucket on a GPU
  std::vector<std::size_t> slots;
  std::size_t pending = 0;
  bool ready = false;
  bool launched = false;
};

}  // namespace loom::detail
