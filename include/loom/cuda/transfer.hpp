// loom/cuda/transfer.hpp — non-blocking host-to-device copies on a copy stream, completed by an
// event the consumer waits on: copy_h2d_async (raw pointers, any LibTorch), and, with a CUDA
// LibTorch (LOOM_TORCH_HAS_CUDA), transfer_batch -> InFlightBatch and CudaTransfer.
//
// Example (by hand):
//   auto copy = loom::cuda::Stream::create(device);
//   loom::cuda::InFlightBatch t = loom::cuda::transfer_batch(host_batch, device, copy);
//   t.wait();                                                // current stream waits for the copy
//   auto out = model->forward(t.batch.data);
//
// Units: bytes for copy_h2d_async.
// Throws: loom::CudaError (naming the call) from every CUDA call; loom::InvalidArgument when a
//         host tensor is already on a GPU, or `bytes` > 0 with a null pointer.
// Guide: docs/gpu.md#streams-and-ordering.
// Source: the pin_memory + non_blocking=True + stream/event hand-off that PyTorch's DataLoader
//         users write by hand (see "CUDA semantics: streams" in the PyTorch docs), with the
//         record_stream rule from the same page.
#pragma once

#include <cstddef>
#include <cstring>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include <loom/config.hpp>
#include <loom/cuda/buffer.hpp>
#include <loom/cuda/stream.hpp>

#if LOOM_TORCH_HAS_CUDA
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <loom/collate/batch.hpp>
#include <loom/collate/pool.hpp>
#include <loom/collate/transfer.hpp>
#include <loom/cuda/pinned.hpp>
#endif

namespace loom::cuda {

/// Queues a copy of `bytes` from host `src` to device `dst` on `stream` and returns at once
/// (cudaMemcpyAsync). Asynchronous only when `src` is pinned; `src` must stay valid and
/// unmodified until the copy finished (record an Event after it).
inline void copy_h2d_async(void* dst, const void* src, std::size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return;
  if (dst == nullptr || src == nullptr)
    throw InvalidArgument(
        fmt::format("copy_h2d_async: null {} pointer for {} bytes", dst == nullptr ? "destination" : "source", bytes));
  LOOM_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream));
}

#if LOOM_TORCH_HAS_CUDA

namespace detail {
/// Releases host tensors that a copy may still read, after that copy completed (blocking only
/// if it has not: normally the consumer has long used the batch by then).
inline void release_after(std::optional<Event>& done, std::vector<at::Tensor>& host) noexcept {
  if (host.empty()) return;
  if (done && done->get() != nullptr) LOOM_CUDA_CHECK_NOEXCEPT(cudaEventSynchronize(done->get()));
  host.clear();
}

/// Queues the copy of host tensor `*field` to `device` on `stream` (LibTorch's current stream
/// there, so the caching allocator ties the new memory to it) and replaces `*field` by the
/// device tensor. Pageable tensors are first copied into pinned blocks of `staging` when given
/// (else CUDA copies them synchronously). Host memory the copy reads is appended to `keep`.
inline void copy_field_h2d(at::Tensor* field, int device, cudaStream_t stream, const char* name,
                           const PinnedPool* staging, std::vector<at::Tensor>& keep) {
  if (!field->defined()) return;
  if (field->is_cuda())
    throw InvalidArgument(fmt::format("host-to-device transfer: batch.{} is already on {}; pass host tensors", name,
                                      field->device().str()));
  at::Tensor src = field->is_contiguous() ? *field : field->contiguous();
  if (staging != nullptr && !is_pinned(src.data_ptr())) {
    at::Tensor staged = staging->empty(src.sizes(), src.scalar_type());
    if (src.nbytes() > 0) std::memcpy(staged.data_ptr(), src.data_ptr(), src.nbytes());
    src = std::move(staged);
  }
  at::Tensor dst =
      at::empty(src.sizes(), src.options().device(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device))));
  copy_h2d_async(dst.data_ptr(), src.data_ptr(), src.nbytes(), stream);
  keep.push_back(std::move(src));
  *field = std::move(dst);
}

/// Makes `consumer` wait for `done` and records the batch's device memory as used by `consumer`.
inline void consume(Batch& b, const Event& done, cudaStream_t consumer) {
  done.block(consumer);
  const auto stream = c10::cuda::getStreamFromExternal(consumer, static_cast<c10::DeviceIndex>(done.device()));
  for (at::Tensor* t : {&b.data, &b.targets, &b.mask})
    if (t->defined() && t->is_cuda()) t->record_stream(stream.unwrap());
}
}  // namespace detail

/// A batch copied (or being copied) to a device, and the event that completes when the copy did.
/// Move-only. Keeps the host memory the copy reads alive until the copy is known to be complete,
/// so pooled pinned blocks are never recycled while a copy still reads them.
class InFlightBatch {
 public:
  InFlightBatch(Batch device_batch, std::vector<at::Tensor> host, Event done)
      : batch(std::move(device_batch)), host_(std::move(host)), done_(std::move(done)) {}
  InFlightBatch(InFlightBatch&&) noexcept = default;
  InFlightBatch& operator=(InFlightBatch&& o) noexcept {
    if (this != &o) {
      detail::release_after(done_, host_);
      batch = std::move(o.batch);
      host_ = std::move(o.host_);
      done_ = std::move(o.done_);
    }
    return *this;
  }
  InFlightBatch(const InFlightBatch&) = delete;
  InFlightBatch& operator=(const InFlightBatch&) = delete;
  /// If the copy may still run, blocks until it finished, then releases the host memory.
  ~InFlightBatch() { detail::release_after(done_, host_); }

  /// The batch on the device. Use it only on a stream that waited for the copy (wait()).
  Batch batch;

  /// Makes `consumer` (a stream on the batch's device) wait for the copy on the GPU and records
  /// the batch's memory as used by `consumer` (so the caching allocator does not hand it out
  /// again while `consumer` may still read it). The host does not block.
  void wait(cudaStream_t consumer) { detail::consume(batch, *done_, consumer); }
  /// wait() on LibTorch's current stream of the batch's device (what forward() will run on).
  void wait() { wait(c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(done_->device())).stream()); }
  /// True when the copy has finished.
  [[nodiscard]] bool ready() const { return done_->query(); }
  /// Blocks the host until the copy has finished.
  void synchronize() const { done_->synchronize(); }
  /// The completion event (recorded on the copy stream after the last copy).
  [[nodiscard]] const Event& event() const noexcept { return *done_; }

 private:
  std::vector<at::Tensor> host_;
  std::optional<Event> done_;
};

/// Copies `host`'s tensors to `device` on `stream` without blocking the host and returns the
/// device batch with its completion event. Pinned host tensors (PinnedPool) make the copy truly
/// asynchronous; pageable ones make the host wait for the copy (CUDA's rule).
///
/// Shape: the host batch's shapes and dtypes; indices, num_samples, weight are copied as they are.
/// Throws: loom::CudaError, loom::InvalidArgument (tensor already on a GPU).
inline InFlightBatch transfer_batch(const Batch& host, int device, const Stream& stream) {
  DeviceGuard on(device);
  const c10::cuda::CUDAStreamGuard current(
      c10::cuda::getStreamFromExternal(stream.get(), static_cast<c10::DeviceIndex>(device)));
  Batch out = host;
  std::vector<at::Tensor> keep;
  detail::copy_field_h2d(&out.data, device, stream.get(), "data", nullptr, keep);
  detail::copy_field_h2d(&out.targets, device, stream.get(), "targets", nullptr, keep);
  detail::copy_field_h2d(&out.mask, device, stream.get(), "mask", nullptr, keep);
  Event done(device);
  done.record(stream);
  return InFlightBatch(std::move(out), std::move(keep), std::move(done));
}

/// Options of CudaTransfer; an aggregate used with designated initializers.
struct CudaTransferOptions {
  /// CUDA device of each scheduler device label (label d -> cuda_devices[d]); empty: label d is
  /// CUDA device d.
  std::vector<int> cuda_devices{};
  /// Copy pageable host tensors into pinned staging blocks first, so the device copy is
  /// asynchronous (one extra host memcpy); false: pageable tensors are copied synchronously.
  bool stage_pageable = true;
};

/// The scheduler's host-to-device step on CUDA: models loom::BatchTransfer<CudaTransfer, Batch>.
///
/// start(b, d) (worker thread of device d): pageable tensors are staged into pinned blocks (a
/// PinnedPool shared by all copies of this object), every tensor of b is copied to its CUDA
/// device on that worker's own copy stream (created on first use) and replaced by the device
/// tensor; an event is recorded. finish(b, d, ticket) (consumer thread): LibTorch's current
/// stream of the device waits on the event (no host blocking, no device-wide synchronisation)
/// and the batch's memory is recorded as used on that stream. The ticket keeps the host
/// memory alive until the copy completed.
///
/// Example (a generator loader whose batches arrive on the GPUs):
///   loom::GeneratorLoader<Gen, loom::DefaultCollate<>, loom::cuda::CudaTransfer> loader(
///       std::move(gens), {.num_devices = 2}, {}, loom::cuda::CudaTransfer{});
///   for (auto& step : loader)
///     for (auto& db : step.devices) model[db.device]->forward(db.batch.data);  // on cuda:db.device
/// Throws: loom::CudaError; loom::InvalidArgument (batch tensor already on a GPU, bad label).
class CudaTransfer {
 public:
  /// The event and host memory of one batch in flight.
  struct Ticket {
    std::optional<Event> done;
    std::vector<at::Tensor> host;
    Ticket() = default;
    Ticket(Ticket&&) noexcept = default;
    Ticket& operator=(Ticket&& o) noexcept {
      if (this != &o) {
        detail::release_after(done, host);
        done = std::move(o.done);
        host = std::move(o.host);
      }
      return *this;
    }
    Ticket(const Ticket&) = delete;
    Ticket& operator=(const Ticket&) = delete;
    ~Ticket() { detail::release_after(done, host); }
  };

  CudaTransfer() = default;
  explicit CudaTransfer(CudaTransferOptions options) : options_(std::move(options)) {}

  Ticket start(Batch& b, int device) {
    const int dev = cuda_device(device);
    if (!stream_ || stream_->device() != dev) stream_ = std::make_shared<Stream>(Stream::create(dev));
    DeviceGuard on(dev);
    const c10::cuda::CUDAStreamGuard current(
        c10::cuda::getStreamFromExternal(stream_->get(), static_cast<c10::DeviceIndex>(dev)));
    Ticket t;
    const PinnedPool* staging = options_.stage_pageable ? &staging_ : nullptr;
    detail::copy_field_h2d(&b.data, dev, stream_->get(), "data", staging, t.host);
    detail::copy_field_h2d(&b.targets, dev, stream_->get(), "targets", staging, t.host);
    detail::copy_field_h2d(&b.mask, dev, stream_->get(), "mask", staging, t.host);
    t.done.emplace(dev);
    t.done->record(*stream_);
    return t;
  }

  void finish(Batch& b, int device, Ticket& t) const {
    if (!t.done) return;
    const int dev = cuda_device(device);
    detail::consume(b, *t.done, c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(dev)).stream());
  }

  /// The allocator of host batch buffers that this transfer copies without staging: pinned
  /// memory (pinned_empty, cudaHostAlloc). The generator loaders allocate their pooled batch
  /// buffers with it (loom/schedule/detail/device_window.hpp), so start() finds the batch pinned
  /// and copies it straight from its pooled buffer; the ticket keeps that buffer busy until the
  /// copy completed.
  /// Example: `loom::BufferPool pool({.allocate = loom::cuda::CudaTransfer{}.batch_allocator()});`
  [[nodiscard]] BatchAllocator batch_allocator() const { return pinned_empty; }

  /// The pinned staging pool (shared by the copies of this object): its stats say how many
  /// cudaHostAlloc calls staging needed.
  [[nodiscard]] const PinnedPool& staging() const noexcept { return staging_; }

 private:
  [[nodiscard]] int cuda_device(int label) const {
    if (options_.cuda_devices.empty()) return label;
    if (label < 0 || static_cast<std::size_t>(label) >= options_.cuda_devices.size())
      throw InvalidArgument(fmt::format("CudaTransfer: device label {} has no entry in cuda_devices (size {})", label,
                                        options_.cuda_devices.size()));
    return options_.cuda_devices[static_cast<std::size_t>(label)];
  }

  CudaTransferOptions options_{};
  PinnedPool staging_{};
  std::shared_ptr<Stream> stream_;  // this copy's (this worker's) copy stream, created on first start()
};

static_assert(loom::BatchTransfer<CudaTransfer, Batch>, "CudaTransfer must model loom::BatchTransfer");
#endif  // LOOM_TORCH_HAS_CUDA

}  // namespace loom::cuda
