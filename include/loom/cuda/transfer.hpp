// loom/cuda/transfer.hpp — non-blocking host-to-device copies on a copy stream, completed by an
// event the consumer waits on.
//
// Two levels:
//  * copy_h2d_async(dst, src, bytes, stream): raw pointers, any LibTorch (see also DeviceBuffer).
//  * transfer_batch(host_batch, device, stream) -> BatchTransfer (LibTorch with CUDA only,
//    LOOM_TORCH_HAS_CUDA): copies a loom::Batch's tensors to `device` on `stream`, returns the
//    device batch and an event; BatchTransfer::wait() makes the consumer's stream wait for the
//    copy on the GPU (the host does not block) and tells LibTorch's caching allocator that the
//    consumer stream uses the memory.
//
// Example (a scheduler's per-device worker and the training thread):
//   auto copy = loom::cuda::Stream::create(device);
//   loom::cuda::BatchTransfer t = loom::cuda::transfer_batch(host_batch, device, copy);
//   queue.push(std::move(t));                                // worker thread
//   ...
//   auto t = queue.pop();                                    // training thread
//   t.wait();                                                // current stream waits for the copy
//   auto out = model->forward(t.batch.data);
//
// Shape: the device batch has the host batch's shapes and dtypes; indices, num_samples, weight
//        are copied as they are.
// Units: bytes for copy_h2d_async.
// Throws: loom::CudaError (naming the call) from every CUDA call; loom::InvalidArgument when a
//         host tensor is already on a GPU, or `bytes` > 0 with a null pointer.
// Source: the pin_memory + non_blocking=True + stream/event hand-off that PyTorch's DataLoader
//         users write by hand (see "CUDA semantics: streams" in the PyTorch docs), with the
//         record_stream rule from the same page.
#pragma once

#include <cstddef>
#include <utility>

#include <loom/config.hpp>
#include <loom/cuda/buffer.hpp>
#include <loom/cuda/stream.hpp>

#if LOOM_TORCH_HAS_CUDA
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <loom/collate/batch.hpp>
#endif

namespace loom::cuda {

/// Queues a copy of `bytes` from host `src` to device `dst` on `stream` and returns at once
/// (cudaMemcpyAsync). Asynchronous only when `src` is pinned; `src` must stay valid and
/// unmodified until the copy finished (record an Event after it).
inline void copy_h2d_async(void* dst, const void* src, std::size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return;
  if (dst == nullptr || src == nullptr)
    throw InvalidArgument(fmt::format("copy_h2d_async: null {} pointer for {} bytes", dst == nullptr ? "destination" : "source", bytes));
  LOOM_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream));
}

#if LOOM_TORCH_HAS_CUDA

/// A batch copied (or being copied) to a device, and the event that completes when the copy did.
/// Move-only. Keeps the host batch alive until the copy is known to be complete, so pinned
/// blocks are never recycled while a copy still reads them.
class BatchTransfer {
 public:
  BatchTransfer(Batch device_batch, Batch source, Event done)
      : batch(std::move(device_batch)), source_(std::move(source)), done_(std::move(done)) {}
  BatchTransfer(BatchTransfer&&) noexcept = default;
  BatchTransfer& operator=(BatchTransfer&& o) noexcept {
    if (this != &o) {
      release_source();
      batch = std::move(o.batch);
      source_ = std::move(o.source_);
      done_ = std::move(o.done_);
    }
    return *this;
  }
  BatchTransfer(const BatchTransfer&) = delete;
  BatchTransfer& operator=(const BatchTransfer&) = delete;
  /// If the copy may still run, blocks until it finished, then releases the host batch.
  ~BatchTransfer() { release_source(); }

  /// The batch on the device. Use it only on a stream that waited for the copy (wait()).
  Batch batch;

  /// Makes `consumer` (a stream on the batch's device) wait for the copy on the GPU and records
  /// the batch's memory as used by `consumer` (so the caching allocator does not hand it out
  /// again while `consumer` may still read it). The host does not block.
  void wait(cudaStream_t consumer) {
    done_.block(consumer);
    const auto stream = c10::cuda::getStreamFromExternal(consumer, static_cast<c10::DeviceIndex>(done_.device()));
    for (at::Tensor* t : {&batch.data, &batch.targets, &batch.mask})
      if (t->defined() && t->is_cuda()) t->record_stream(stream.unwrap());
  }
  /// wait() on LibTorch's current stream of the batch's device (what forward() will run on).
  void wait() { wait(c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(done_.device())).stream()); }
  /// True when the copy has finished.
  [[nodiscard]] bool ready() const { return done_.query(); }
  /// Blocks the host until the copy has finished.
  void synchronize() const { done_.synchronize(); }
  /// The completion event (recorded on the copy stream after the last copy).
  [[nodiscard]] const Event& event() const noexcept { return done_; }

 private:
  void release_source() noexcept {
    if (!source_.data.defined() && !source_.targets.defined() && !source_.mask.defined()) return;
    if (done_.get() != nullptr) LOOM_CUDA_CHECK_NOEXCEPT(cudaEventSynchronize(done_.get()));
    source_ = Batch{};
  }

  Batch source_;
  Event done_;
};

namespace detail {
/// A device copy of contiguous host tensor `host`, queued on `stream` (current for LibTorch, so
/// the caching allocator associates the new memory with the copy stream).
inline at::Tensor copy_tensor_h2d(const at::Tensor& host, int device, cudaStream_t stream, const char* field) {
  if (!host.defined()) return {};
  if (host.is_cuda())
    throw InvalidArgument(fmt::format("transfer_batch: batch.{} is already on {}; pass host tensors", field, host.device().str()));
  const at::Tensor src = host.is_contiguous() ? host : host.contiguous();
  at::Tensor dst = at::empty(src.sizes(), src.options().device(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device))));
  copy_h2d_async(dst.data_ptr(), src.data_ptr(), src.nbytes(), stream);
  return dst;
}
}  // namespace detail

/// Copies `host`'s tensors to `device` on `stream` without blocking the host and returns the
/// device batch with its completion event. Pinned host tensors (PinnedPool) make the copy truly
/// asynchronous; pageable ones make the host wait for the copy (CUDA's rule).
///
/// Shape: unchanged. Throws: loom::CudaError, loom::InvalidArgument (tensor already on a GPU).
inline BatchTransfer transfer_batch(const Batch& host, int device, const Stream& stream) {
  DeviceGuard on(device);
  const c10::cuda::CUDAStreamGuard current(
      c10::cuda::getStreamFromExternal(stream.get(), static_cast<c10::DeviceIndex>(device)));
  Batch out;
  out.data = detail::copy_tensor_h2d(host.data, device, stream.get(), "data");
  out.targets = detail::copy_tensor_h2d(host.targets, device, stream.get(), "targets");
  out.mask = detail::copy_tensor_h2d(host.mask, device, stream.get(), "mask");
  out.indices = host.indices;
  out.num_samples = host.num_samples;
  out.weight = host.weight;
  Event done(device);
  done.record(stream);
  return BatchTransfer(std::move(out), host, std::move(done));
}

#endif  // LOOM_TORCH_HAS_CUDA

}  // namespace loom::cuda
