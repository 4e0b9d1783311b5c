// loom/cuda/pinned.hpp — page-locked (pinned) host memory as at::Tensor, with a caching pool; with
// any LibTorch, CUDA-enabled or not.
//
// Example:
//   loom::cuda::PinnedPool pool;                                    // one per scheduler/collator
//   at::Tensor x = pool.empty({64, 3, 224, 224}, at::kFloat);      // pinned, 38.5 MB
//   ...                                                            // fill x, copy it to a GPU
//   x.reset();                                                     // block back into the pool
//   at::Tensor y = pool.empty({64, 3, 224, 224}, at::kFloat);      // same block, no cudaHostAlloc
//
// Shape: any sizes, any dtype; the tensors are contiguous, on device CPU.
// Units: bytes for every size in PinnedPool::Stats.
// Throws: loom::CudaError when cudaHostAlloc fails (no device, out of pinned memory), naming the
//         call and the byte count; loom::InvalidArgument for negative sizes.
// A block goes back to the pool when its tensor (and every view) is gone: a copy still reading it
// must keep the tensor alive. Guide: docs/gpu.md#pinned-host-memory.
// Source: the idea of PyTorch's CachingHostAllocator (pin_memory), minus its stream tracking.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/ops/from_blob.h>
#include <c10/core/ScalarType.h>
#include <c10/core/TensorOptions.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <loom/cuda/error.hpp>

namespace loom::cuda {

namespace detail {
/// Bytes of a contiguous tensor of `sizes` and `dtype`; InvalidArgument for a negative size.
inline std::size_t tensor_bytes(at::IntArrayRef sizes, at::ScalarType dtype) {
  std::size_t n = 1;
  for (auto s : sizes) {
    if (s < 0)
      throw InvalidArgument(
          fmt::format("pinned allocation: negative size {} in sizes [{}]", s, fmt::join(sizes, ", ")));
    n *= static_cast<std::size_t>(s);
  }
  return n * c10::elementSize(dtype);
}

/// cudaHostAlloc with a message that says how many bytes were asked for.
inline void* host_alloc(std::size_t bytes) {
  void* p = nullptr;
  const cudaError_t rc = cudaHostAlloc(&p, bytes == 0 ? 1 : bytes, cudaHostAllocPortable);
  if (rc != cudaSuccess) {
    (void)cudaGetLastError();
    int device = -1;
    if (cudaGetDevice(&device) != cudaSuccess) device = -1;
    (void)cudaGetLastError();
    throw CudaError(
        rc,
        fmt::format("CUDA call cudaHostAlloc(&p, {} bytes, cudaHostAllocPortable) failed at {}:{}: {} ({}); device {}",
                    bytes, short_file(__FILE__), __LINE__, cudaGetErrorName(rc), cudaGetErrorString(rc), device));
  }
  return p;
}
}  // namespace detail

/// True when `p` points into page-locked host memory (cudaHostAlloc / cudaHostRegister, any
/// device's context), false for ordinary pageable memory. Throws loom::CudaError.
inline bool is_pinned(const void* p) {
  if (p == nullptr) return false;
  cudaPointerAttributes attr{};
  LOOM_CUDA_CHECK(cudaPointerGetAttributes(&attr, p));
  return attr.type == cudaMemoryTypeHost;
}

/// A new pinned CPU tensor of `sizes` and `dtype` (uninitialised), freed with cudaFreeHost when
/// its last reference goes. One cudaHostAlloc per call (milliseconds for large sizes): for
/// batches, prefer PinnedPool.
inline at::Tensor pinned_empty(at::IntArrayRef sizes, at::ScalarType dtype) {
  void* p = detail::host_alloc(detail::tensor_bytes(sizes, dtype));
  return at::from_blob(
      p, sizes, [](void* q) { LOOM_CUDA_CHECK_NOEXCEPT(cudaFreeHost(q)); }, at::TensorOptions().dtype(dtype));
}

/// A thread-safe cache of pinned host blocks handed out as tensors. Copies share one cache.
///
/// A request takes the smallest cached block that holds it if that block is at most twice the
/// request (so a few batch shapes that repeat are served without cudaHostAlloc); otherwise it
/// allocates a new block. Blocks return to the cache when their tensor is released, and are
/// freed by release_cached() or when the pool and all its tensors are gone.
class PinnedPool {
 public:
  /// Counters, in bytes and calls.
  struct Stats {
    std::size_t host_allocs = 0;     ///< cudaHostAlloc calls made
    std::size_t reuses = 0;          ///< requests served from the cache
    std::size_t bytes_reserved = 0;  ///< pinned bytes held (in use + cached)
    std::size_t bytes_cached = 0;    ///< pinned bytes cached, not in use
  };

  PinnedPool() : state_(std::make_shared<State>()) {}

  /// An uninitialised pinned CPU tensor of `sizes` and `dtype`. Throws loom::CudaError.
  [[nodiscard]] at::Tensor empty(at::IntArrayRef sizes, at::ScalarType dtype) const {
    const std::size_t bytes = round_up(detail::tensor_bytes(sizes, dtype));
    void* p = nullptr;
    std::size_t block = 0;
    {
      std::lock_guard lock(state_->mutex);
      auto it = state_->free.lower_bound(bytes);
      if (it != state_->free.end() && it->first <= 2 * bytes) {
        block = it->first;
        p = it->second;
        state_->free.erase(it);
        state_->stats.bytes_cached -= block;
        ++state_->stats.reuses;
      }
    }
    if (p == nullptr) {
      p = detail::host_alloc(bytes);
      block = bytes;
      std::lock_guard lock(state_->mutex);
      ++state_->stats.host_allocs;
      state_->stats.bytes_reserved += block;
    }
    std::shared_ptr<State> state = state_;
    return at::from_blob(
        p, sizes,
        [state = std::move(state), block](void* q) {
          std::lock_guard lock(state->mutex);
          state->free.emplace(block, q);
          state->stats.bytes_cached += block;
        },
        at::TensorOptions().dtype(dtype));
  }
  /// Same as empty(sizes, options.dtype()); other options are ignored (the tensor is on CPU).
  [[nodiscard]] at::Tensor empty(at::IntArrayRef sizes, const at::TensorOptions& options) const {
    return empty(sizes, c10::typeMetaToScalarType(options.dtype()));
  }

  /// Frees every cached block (cudaFreeHost); blocks in use are unaffected.
  void release_cached() const {
    std::multimap<std::size_t, void*> blocks;
    {
      std::lock_guard lock(state_->mutex);
      blocks.swap(state_->free);
      state_->stats.bytes_reserved -= state_->stats.bytes_cached;
      state_->stats.bytes_cached = 0;
    }
    for (auto& [bytes, p] : blocks) LOOM_CUDA_CHECK(cudaFreeHost(p));
  }

  [[nodiscard]] Stats stats() const {
    std::lock_guard lock(state_->mutex);
    return state_->stats;
  }

 private:
  struct State {
    std::mutex mutex;
    std::multimap<std::size_t, void*> free;  // block bytes -> block
    Stats stats;
    ~State() {
      for (auto& [bytes, p] : free) LOOM_CUDA_CHECK_NOEXCEPT(cudaFreeHost(p));
    }
  };
  static constexpr std::size_t kGranule = 4096;  // bytes; one page
  static std::size_t round_up(std::size_t bytes) noexcept {
    return bytes == 0 ? kGranule : (bytes + kGranule - 1) / kGranule * kGranule;
  }

  std::shared_ptr<State> state_;
};

/// An allocator function object for collators: `alloc(sizes, dtype)` returns pinned storage from
/// a shared PinnedPool. Copies share the pool.
///
/// Example: `loom::cuda::PinnedAllocator alloc; at::Tensor t = alloc({8, 16}, at::kFloat);`
struct PinnedAllocator {
  PinnedPool pool;
  [[nodiscard]] at::Tensor operator()(at::IntArrayRef sizes, at::ScalarType dtype) const {
    return pool.empty(sizes, dtype);
  }
  [[nodiscard]] at::Tensor operator()(at::IntArrayRef sizes, const at::TensorOptions& options) const {
    return pool.empty(sizes, options);
  }
};

}  // namespace loom::cuda
