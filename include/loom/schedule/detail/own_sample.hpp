// loom/schedule/detail/own_sample.hpp — a sample's tensors made its own when it arrives from a
// generator, so a generator that reuses its output tensors cannot change samples the loader holds.
//
// The loaders hold a sample from the moment its generator returns it until its step is collated
// (up to prefetch_depth steps later), while the generator runs on. A generator that decodes into
// one output buffer and returns it (or a view of it) would overwrite the held samples. So on
// arrival, on the worker thread and before the generator is called again, every tensor loom reads
// from the sample (loom::DefaultProjection's reading: a bare tensor, the tensors of a (tensor,
// target) pair or 2-tuple, a struct's .data and tensor .target) is replaced by a copy unless it
// already owns its memory: the only handle of the only tensor referring to its storage,
// allocated by a tensor allocator (not memory wrapped with from_blob). A generator that makes a fresh tensor per
// sample pays nothing; one that returns a reused buffer, a cached tensor or an element of an
// in-memory dataset pays one copy of that tensor per sample.
// With DefaultCollate (no padding, no mask, DefaultProjection) the loaders copy the data tensor
// into its row of the step's pooled batch buffer instead (DeviceWindow::stage_sample, using
// data_tensor() below) and call own_sample for the rest of the sample.
#pragma once

#include <concepts>
#include <tuple>
#include <type_traits>

#include <ATen/core/Tensor.h>

#include <loom/collate/sample.hpp>

namespace loom::detail {

/// True when nothing but `t` can write its elements: no other handle shares t's TensorImpl (a
/// generator's buffer returned as is), no other TensorImpl shares its storage (a view of a
/// buffer), and the storage came from a tensor allocator (a from_blob tensor wraps memory someone
/// else owns and reuses).
inline bool owns_its_memory(const at::Tensor& t) {
  if (!t.has_storage() || t.use_count() != 1) return false;
  const c10::Storage& storage = t.storage();
  return storage.use_count() == 1 && storage.allocator() != nullptr;
}

/// Replaces each tensor loom reads from `sample` that does not own its memory by a copy (see the
/// file comment), except `*skip` (a tensor of the sample already copied elsewhere, or null).
/// Sample types DefaultProjection does not read are left as they are.
/// Throws: what at::Tensor::clone throws (out of memory).
template <class S>
void own_sample(S& sample, const at::Tensor* skip = nullptr) {
  for_each_read_tensor(sample, [skip](at::Tensor& t) {
    if (&t != skip && t.defined() && !owns_its_memory(t)) t = t.clone();
  });
}

/// The sample's data tensor as DefaultProjection reads it (a bare tensor, the first of a pair or
/// 2-tuple, a struct's .data), when the sample holds it as a modifiable at::Tensor; else null.
template <class S>
at::Tensor* data_tensor(S& sample) {
  at::Tensor* first = nullptr;
  if constexpr (std::same_as<S, at::Tensor>) {
    first = &sample;
  } else if constexpr (HasDataMember<S>) {
    if constexpr (std::same_as<decltype(sample.data), at::Tensor>) first = &sample.data;
  } else if constexpr (TensorTuple<S>) {
    if constexpr (std::same_as<std::remove_reference_t<decltype(std::get<0>(sample))>, at::Tensor>)
      first = &std::get<0>(sample);
  }
  return first;
}

}  // namespace loom::detail
