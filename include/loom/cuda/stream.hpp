// loom/cuda/stream.hpp — RAII CUDA streams and events.
//
// A Stream owns a cudaStream_t (created non-blocking, so it never synchronises implicitly with
// the legacy default stream) or borrows one the caller owns; an Event owns a cudaEvent_t. Both
// remember their device and make it current for every runtime call they make.
//
// Example:
//   auto copy = loom::cuda::Stream::create(0);        // device 0, owned, non-blocking
//   loom::cuda::Event ready(0);                        // timing disabled: cheapest to record
//   LOOM_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, copy.get()));
//   ready.record(copy);                                // completes when the copy has
//   ready.block(compute_stream);                       // compute waits on the GPU, host does not
//
// Throws: loom::CudaError from every call that can fail; destructors never throw.
// Guide: docs/gpu.md#streams-and-ordering.
// Source: the ownership model of c10::cuda::CUDAStream / at::cuda::CUDAEvent (owned vs. external
//         streams, events created lazily per device), written on the bare runtime API.
#pragma once

#include <utility>

#include <loom/cuda/device.hpp>

namespace loom::cuda {

/// A CUDA stream on one device, owned (destroyed with the object) or borrowed. Move-only.
class Stream {
 public:
  /// Creates an owned, non-blocking stream on `device` with `priority` (lower = higher
  /// priority, see cudaDeviceGetStreamPriorityRange; 0 is the default).
  static Stream create(int device, int priority = 0) {
    DeviceGuard on(device);
    cudaStream_t s = nullptr;
    LOOM_CUDA_CHECK(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, priority));
    return Stream(s, device, true);
  }
  /// Borrows `stream` (which lives on `device`); the caller keeps it alive longer than this object.
  /// nullptr is the legacy default stream of `device`.
  static Stream borrow(cudaStream_t stream, int device) noexcept { return Stream(stream, device, false); }

  Stream(Stream&& o) noexcept : stream_(o.stream_), device_(o.device_), owned_(std::exchange(o.owned_, false)) {}
  Stream& operator=(Stream&& o) noexcept {
    if (this != &o) {
      reset();
      stream_ = o.stream_;
      device_ = o.device_;
      owned_ = std::exchange(o.owned_, false);
    }
    return *this;
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  ~Stream() { reset(); }

  /// The raw handle, for CUDA, NCCL and LibTorch calls.
  [[nodiscard]] cudaStream_t get() const noexcept { return stream_; }
  /// The device the stream belongs to.
  [[nodiscard]] int device() const noexcept { return device_; }
  /// Whether this object destroys the stream.
  [[nodiscard]] bool owned() const noexcept { return owned_; }

  /// True when all work queued so far has finished (cudaStreamQuery). Throws loom::CudaError.
  [[nodiscard]] bool query() const {
    DeviceGuard on(device_);
    const cudaError_t rc = cudaStreamQuery(stream_);
    if (rc == cudaErrorNotReady) {
      (void)cudaGetLastError();
      return false;
    }
    LOOM_CUDA_CHECK(rc);
    return true;
  }
  /// Blocks the host until all work queued so far has finished. Throws loom::CudaError.
  void synchronize() const {
    DeviceGuard on(device_);
    LOOM_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }

 private:
  Stream(cudaStream_t s, int device, bool owned) noexcept : stream_(s), device_(device), owned_(owned) {}
  void reset() noexcept {
    if (owned_ && stream_ != nullptr) LOOM_CUDA_CHECK_NOEXCEPT(cudaStreamDestroy(stream_));
    owned_ = false;
    stream_ = nullptr;
  }

  cudaStream_t stream_ = nullptr;
  int device_ = -1;
  bool owned_ = false;
};

/// A CUDA event on one device: a point in a stream that the host or other streams can wait for.
/// Move-only; the event is destroyed with the object (destroying a recorded but incomplete event
/// is allowed by CUDA: its resources are released once it completes).
class Event {
 public:
  /// Creates an event on `device`. `timing` enables elapsed_ms (slightly costlier to record).
  explicit Event(int device, bool timing = false) : device_(device) {
    DeviceGuard on(device);
    LOOM_CUDA_CHECK(cudaEventCreateWithFlags(&event_, timing ? cudaEventDefault : cudaEventDisableTiming));
  }
  Event(Event&& o) noexcept : event_(std::exchange(o.event_, nullptr)), device_(o.device_), recorded_(o.recorded_) {}
  Event& operator=(Event&& o) noexcept {
    if (this != &o) {
      reset();
      event_ = std::exchange(o.event_, nullptr);
      device_ = o.device_;
      recorded_ = o.recorded_;
    }
    return *this;
  }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  ~Event() { reset(); }

  [[nodiscard]] cudaEvent_t get() const noexcept { return event_; }
  [[nodiscard]] int device() const noexcept { return device_; }
  /// Whether record() was called (an unrecorded event counts as complete, as in CUDA).
  [[nodiscard]] bool recorded() const noexcept { return recorded_; }

  /// Captures the work queued on `stream` so far. Throws loom::CudaError.
  void record(cudaStream_t stream) {
    DeviceGuard on(device_);
    LOOM_CUDA_CHECK(cudaEventRecord(event_, stream));
    recorded_ = true;
  }
  void record(const Stream& stream) { record(stream.get()); }

  /// Makes `stream` wait (on the GPU) for the captured work; the host does not block.
  void block(cudaStream_t stream) const {
    DeviceGuard on(device_);
    LOOM_CUDA_CHECK(cudaStreamWaitEvent(stream, event_, 0));
  }
  void block(const Stream& stream) const { block(stream.get()); }

  /// True when the captured work has finished (cudaEventQuery). Throws loom::CudaError when the
  /// captured work failed.
  [[nodiscard]] bool query() const {
    DeviceGuard on(device_);
    const cudaError_t rc = cudaEventQuery(event_);
    if (rc == cudaErrorNotReady) {
      (void)cudaGetLastError();
      return false;
    }
    LOOM_CUDA_CHECK(rc);
    return true;
  }
  /// Blocks the host until the captured work has finished (no timeout: prefer query() in a loop
  /// where a hang is possible, as NcclWork::wait does).
  void synchronize() const {
    DeviceGuard on(device_);
    LOOM_CUDA_CHECK(cudaEventSynchronize(event_));
  }
  /// Milliseconds from `start` to this event; both need timing enabled and must have completed.
  [[nodiscard]] float elapsed_ms(const Event& start) const {
    float ms = 0.0f;
    LOOM_CUDA_CHECK(cudaEventElapsedTime(&ms, start.event_, event_));
    return ms;
  }

 private:
  void reset() noexcept {
    if (event_ != nullptr) LOOM_CUDA_CHECK_NOEXCEPT(cudaEventDestroy(event_));
    event_ = nullptr;
  }

  cudaEvent_t event_ = nullptr;
  int device_ = -1;
  bool recorded_ = false;
};

}  // namespace loom::cuda
