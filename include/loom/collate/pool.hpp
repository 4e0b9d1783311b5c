// loom/collate/pool.hpp — batch storage: the allocation hook and a pool of reusable buffers.
//
// Example:
//   auto pool = std::make_shared<loom::BufferPool>();                   // pageable host memory
//   auto batches = samples | loom::views::bucket_by_shape({.max_samples = 64, .pool = pool});
//   for (loom::Batch& b : batches) step(b);   // b's buffer returns to the pool when b is dropped
//   loom::BufferPoolOptions pinned{.allocate = loom::cuda::pinned_empty};   // loom/cuda/pinned.hpp
//
// Reuse rule: a buffer is free when the pool holds the only reference to its storage; a batch, a
// view of it or a tensor sharing its storage (its targets too) keeps it busy. A non_blocking copy
// from a pooled buffer must complete before the last host tensor viewing it is dropped.
// Thread safety: a pool may be shared by collators on different threads (a mutex guards it);
// batches may be dropped on any thread.
// Guide: docs/collate.md#storage-read-on-arrival-reuse-buffers-loomcollatepoolhpp.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/ScalarType.h>
#include <c10/core/TensorImpl.h>
#include <c10/core/TensorOptions.h>
#include <c10/util/ArrayRef.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <loom/error.hpp>

namespace loom {

namespace detail {

/// Bytes a batch's tensors are carved from: `bytes` bytes of `storage` from byte `offset` on (a
/// pooled buffer's storage, or an allocator's uint8 tensor's). Holding it holds the storage, so a
/// pooled buffer stays busy while a ByteBlock of it lives.
struct ByteBlock {
  c10::Storage storage;
  int64_t offset = 0;  ///< in bytes, from the start of the storage
  int64_t bytes = 0;
};

/// The first byte of `storage`, writable: Storage::mutable_data() on LibTorch 2.x, Storage::data()
/// (not const there) on 1.13.
/// (A template, so that the branch a version lacks is not compiled.)
template <class S = c10::Storage>
void* writable_bytes(const S& storage) {
  if constexpr (requires(const S& s) { s.mutable_data(); })
    return storage.mutable_data();
  else
    return const_cast<void*>(static_cast<const void*>(storage.data()));
}

/// The ByteBlock of a contiguous 1-D uint8 tensor.
inline ByteBlock byte_block(const at::Tensor& block) {
  LOOM_ASSERT(block.defined() && block.dim() == 1 && block.scalar_type() == at::kByte && block.is_contiguous(),
              "a batch buffer is a contiguous 1-D uint8 tensor");
  return {.storage = block.storage(), .offset = block.storage_offset(), .bytes = block.numel()};
}

/// A contiguous tensor of `sizes` and `dtype` over the bytes of `block` from `offset_bytes` on,
/// sharing its storage: what `block.narrow(0, offset_bytes, n).view(dtype).view(sizes)` gives for a
/// uint8 tensor (a normal tensor, also under InferenceMode, as a view of a normal tensor is), built
/// directly instead of through three dispatched ATen calls (a batch's fixed cost at small batch
/// sizes); unlike a view it has its own version counter. Under InferenceMode it turns the mode off
/// while the tensor is made (a guard that costs two thread-local writes, so only then). Throws
/// loom::Error when the start is not aligned to dtype's size (an allocator's block at an odd
/// storage offset) or the bytes run past the block.
inline at::Tensor carve(const ByteBlock& block, int64_t offset_bytes, c10::ScalarType dtype, c10::IntArrayRef sizes) {
  const auto item = static_cast<int64_t>(c10::elementSize(dtype));
  int64_t numel = 1;
  for (int64_t s : sizes) numel *= s;
  if (!block.storage) throw Error("batch storage: carve from an empty ByteBlock (no storage)");
  const int64_t start = block.offset + offset_bytes;
  if (start % item != 0 || offset_bytes < 0 || offset_bytes + numel * item > block.bytes)
    throw Error(
        fmt::format("batch storage: {} bytes of {} at byte {} of a {}-byte buffer at storage offset {} "
                    "(the allocator's buffers must start aligned to the element size)",
                    numel * item, c10::toString(dtype), offset_bytes, block.bytes, block.offset));
  std::optional<c10::InferenceMode> normal_tensor;
  if (c10::InferenceMode::is_enabled()) normal_tensor.emplace(false);
  at::Tensor t = at::detail::make_tensor<c10::TensorImpl>(
      c10::Storage(block.storage),
      c10::DispatchKeySet(c10::computeDispatchKey(dtype, at::kStrided, block.storage.device())),
      c10::scalarTypeToTypeMeta(dtype));
  t.unsafeGetTensorImpl()->set_storage_offset(start / item);
  t.unsafeGetTensorImpl()->set_sizes_contiguous(sizes);
  return t;
}

/// carve over the bytes of `block`, a contiguous 1-D uint8 tensor.
inline at::Tensor carve(const at::Tensor& block, int64_t offset_bytes, c10::ScalarType dtype, c10::IntArrayRef sizes) {
  return carve(byte_block(block), offset_bytes, dtype, sizes);
}

}  // namespace detail

/// Allocates batch storage: returns a contiguous CPU tensor of the given sizes and dtype.
///
/// Example: `loom::BatchAllocator a = [](c10::IntArrayRef s, c10::ScalarType t) { return at::empty(s, t); };`
/// Shape: `sizes` in elements; the result must be contiguous, on the CPU, with exactly these
///        sizes and dtype (a pinned-memory tensor qualifies).
/// An empty BatchAllocator means `at::empty(sizes, dtype)` (pageable host memory).
/// Collators call it once per batch (one uint8 buffer of {bytes} that holds the batch's data,
/// mask and targets, each at a 64-byte boundary), never per sample, so std::function's
/// indirection costs nothing measurable.
using BatchAllocator = std::function<at::Tensor(c10::IntArrayRef sizes, c10::ScalarType dtype)>;

namespace detail {
/// Calls `allocate` (or at::empty when it is empty) and checks the result's contract.
inline at::Tensor allocate_checked(const BatchAllocator& allocate, c10::IntArrayRef sizes, c10::ScalarType dtype) {
  at::Tensor t = allocate ? allocate(sizes, dtype) : at::empty(sizes, at::TensorOptions(dtype));
  if (!t.defined() || t.sizes() != sizes || t.scalar_type() != dtype || !t.is_contiguous() || !t.device().is_cpu())
    throw InvalidArgument(fmt::format(
        "BatchAllocator returned {} for a request of sizes [{}] and dtype {}; it must return a contiguous CPU "
        "tensor of exactly these sizes and dtype",
        t.defined() ? fmt::format("a tensor of sizes [{}], dtype {}, device {}", fmt::join(t.sizes(), ", "),
                                  c10::toString(t.scalar_type()), t.device().str())
                    : std::string("an undefined tensor"),
        fmt::join(sizes, ", "), c10::toString(dtype)));
  return t;
}
}  // namespace detail

/// Settings of a BufferPool. Use with designated initializers.
struct BufferPoolOptions {
  /// Allocates new buffers (called with sizes {bytes} and dtype uint8). Empty: at::empty.
  BatchAllocator allocate{};
  /// Most buffers the pool keeps; a request beyond it while all are busy gets an unpooled buffer.
  std::size_t max_buffers = 64;
};

/// A pool of reusable byte buffers from which collators carve their batch tensors.
///
/// Example: `auto t = pool.acquire({64, 3, 224, 224}, at::kFloat);  // reuses a free buffer if any`
/// Shape: acquire returns a contiguous tensor of the requested sizes and dtype (a view of a pooled
///        uint8 buffer of at least that many bytes, rounded up to 64 bytes).
/// Units: buffer sizes in bytes.
/// Throws: loom::InvalidArgument when the allocator breaks its contract.
/// Source: the reuse-when-unreferenced rule is the caching allocators' idea (PyTorch's
///         CachingHostAllocator), applied to whole batches.
class BufferPool {
 public:
  BufferPool() = default;
  explicit BufferPool(BufferPoolOptions options) : options_(std::move(options)) {}
  BufferPool(const BufferPool&) = delete;
  BufferPool& operator=(const BufferPool&) = delete;

  /// A contiguous tensor of `sizes` and `dtype` backed by a free pooled buffer (the smallest that
  /// fits), or by a new one. The contents are whatever the buffer last held.
  [[nodiscard]] at::Tensor acquire(c10::IntArrayRef sizes, c10::ScalarType dtype) {
    int64_t numel = 1;
    for (int64_t s : sizes) numel *= s;
    const auto bytes = static_cast<int64_t>(static_cast<std::size_t>(numel) * c10::elementSize(dtype));
    return detail::carve(acquire_bytes(bytes), 0, dtype, sizes);
  }

  /// A 1-D uint8 tensor of `bytes` bytes (at the start of a pooled buffer, so 64-byte aligned when
  /// the allocator's memory is).
  [[nodiscard]] at::Tensor acquire_bytes(int64_t bytes) {
    return detail::carve(acquire_block(bytes), 0, at::kByte, {bytes});
  }

  /// The first `bytes` bytes of a free pooled buffer (the smallest that fits, at most 4x + 4 KiB
  /// larger), or of a new one: what acquire_bytes returns, without a tensor of its own. Collators
  /// carve a batch's data, mask and targets from one of these. The buffer is busy while the block
  /// or any tensor carved from it lives.
  [[nodiscard]] detail::ByteBlock acquire_block(int64_t bytes) {
    const int64_t rounded = std::max<int64_t>(64, (bytes + 63) / 64 * 64);
    // The block is made under the lock: it holds the buffer's storage, so no other thread's
    // acquire can take the same buffer in between.
    std::lock_guard<std::mutex> lock(mutex_);
    const at::Tensor* best = nullptr;
    for (const at::Tensor& b : blocks_) {
      if (b.storage().use_count() != 1) continue;  // someone still views it
      const int64_t cap = b.numel();
      if (cap < rounded || cap > 4 * rounded + 4096) continue;  // too small, or wastefully large
      if (best == nullptr || cap < best->numel()) best = &b;
    }
    if (best != nullptr) {
      ++reuses_;
      return {.storage = best->storage(), .offset = best->storage_offset(), .bytes = bytes};
    }
    const at::Tensor block = detail::allocate_checked(options_.allocate, {rounded}, c10::ScalarType::Byte);
    ++allocations_;
    if (blocks_.size() < options_.max_buffers) {
      blocks_.push_back(block);
    } else {
      // Full of busy buffers: evict a free one, if any, so the pool follows the workload.
      auto free_it = std::find_if(blocks_.begin(), blocks_.end(),
                                  [](const at::Tensor& b) { return b.storage().use_count() == 1; });
      if (free_it != blocks_.end()) *free_it = block;
    }
    return {.storage = block.storage(), .offset = block.storage_offset(), .bytes = bytes};
  }

  /// Releases every free buffer (busy ones stay until their batches are dropped).
  void trim() {
    std::lock_guard<std::mutex> lock(mutex_);
    std::erase_if(blocks_, [](const at::Tensor& b) { return b.storage().use_count() == 1; });
  }

  /// Buffers the pool currently keeps (free and busy).
  [[nodiscard]] std::size_t size() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return blocks_.size();
  }
  /// Requests served by reusing a buffer.
  [[nodiscard]] int64_t reuses() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return reuses_;
  }
  /// Requests that allocated a new buffer.
  [[nodiscard]] int64_t allocations() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return allocations_;
  }

 private:
  BufferPoolOptions options_{};
  mutable std::mutex mutex_;
  std::vector<at::Tensor> blocks_;  // 1-D uint8 tensors, one per buffer
  int64_t reuses_ = 0;
  int64_t allocations_ = 0;
};

}  // namespace loom
