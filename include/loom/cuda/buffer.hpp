// loom/cuda/buffer.hpp — DeviceBuffer: device memory from cudaMalloc with RAII.
//
// For programs, tests and benchmarks that work on raw device pointers (a LibTorch without CUDA
// cannot make CUDA tensors), and for small scratch words loom itself needs (NCCL barrier).
//
// Example:
//   loom::cuda::DeviceBuffer buf(0, 1024 * sizeof(float));   // 4 KiB on device 0
//   float* p = buf.as<float>();
//
// Units: bytes. Throws: loom::CudaError (no device, out of memory) naming the call and size.
// Guide: docs/gpu.md#what-exists.
#pragma once

#include <cstddef>
#include <utility>

#include <loom/cuda/device.hpp>

namespace loom::cuda {

/// Device memory from cudaMalloc on one device, freed with the object. Move-only.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  /// `bytes` on `device`. Throws loom::CudaError (e.g. out of memory, naming the size).
  DeviceBuffer(int device, std::size_t bytes) : device_(device), bytes_(bytes) {
    DeviceGuard on(device);
    const cudaError_t rc = cudaMalloc(&ptr_, bytes == 0 ? 1 : bytes);
    if (rc != cudaSuccess) {
      (void)cudaGetLastError();
      ptr_ = nullptr;
      throw CudaError(
          rc, fmt::format("CUDA call cudaMalloc(&p, {} bytes) on device {} failed at {}:{}: {} ({})", bytes, device,
                          detail::short_file(__FILE__), __LINE__, cudaGetErrorName(rc), cudaGetErrorString(rc)));
    }
  }
  DeviceBuffer(DeviceBuffer&& o) noexcept
      : ptr_(std::exchange(o.ptr_, nullptr)), device_(o.device_), bytes_(std::exchange(o.bytes_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      reset();
      ptr_ = std::exchange(o.ptr_, nullptr);
      device_ = o.device_;
      bytes_ = std::exchange(o.bytes_, 0);
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { reset(); }

  [[nodiscard]] void* get() const noexcept { return ptr_; }
  template <class T>
  [[nodiscard]] T* as() const noexcept {
    return static_cast<T*>(ptr_);
  }
  [[nodiscard]] std::size_t bytes() const noexcept { return bytes_; }
  [[nodiscard]] int device() const noexcept { return device_; }

 private:
  void reset() noexcept {
    if (ptr_ != nullptr) {
      int previous = -1;
      const bool switch_device = cudaGetDevice(&previous) == cudaSuccess && previous != device_;
      if (switch_device) (void)cudaSetDevice(device_);
      LOOM_CUDA_CHECK_NOEXCEPT(cudaFree(ptr_));
      if (switch_device) (void)cudaSetDevice(previous);
    }
    ptr_ = nullptr;
  }

  void* ptr_ = nullptr;
  int device_ = -1;
  std::size_t bytes_ = 0;
};

}  // namespace loom::cuda
