// loom/cuda/device.hpp — which CUDA devices exist, and a scope that selects one.
//
// Example:
//   auto probe = loom::cuda::probe_devices();
//   if (probe.count == 0) { std::cerr << "skipped: " << probe.reason << '\n'; return 77; }
//   {
//     loom::cuda::DeviceGuard on(1);   // cudaSetDevice(1) for this scope
//     ...                              // allocations, streams, NCCL calls land on device 1
//   }                                  // the previous device is current again
//
// Throws: loom::CudaError (DeviceGuard with a device that does not exist, or no device at all).
// Guide: docs/gpu.md#what-exists.
// Source: the scope-guard shape of c10::cuda::CUDAGuard, on the bare runtime API so that it also
//         serves programs whose LibTorch has no CUDA.
#pragma once

#include <string>

#include <loom/cuda/error.hpp>

namespace loom::cuda {

/// The result of probe_devices: how many devices the runtime sees, and if none, why.
struct DeviceProbe {
  int count = 0;       ///< visible CUDA devices (0 when the runtime or driver cannot be used)
  std::string reason;  ///< empty when count > 0; else the runtime's code and text
};

/// Counts the CUDA devices without throwing: on a machine without a GPU or driver, count is 0
/// and `reason` says why (e.g. "cudaGetDeviceCount: cudaErrorNoDevice (no CUDA-capable device
/// is detected)"). Use it to skip device tests (exit code 77) with a message.
inline DeviceProbe probe_devices() noexcept {
  DeviceProbe probe;
  int n = 0;
  const cudaError_t rc = cudaGetDeviceCount(&n);
  if (rc != cudaSuccess) {
    (void)cudaGetLastError();
    probe.reason = std::string("cudaGetDeviceCount: ") + cudaGetErrorName(rc) + " (" + cudaGetErrorString(rc) + ")";
    return probe;
  }
  probe.count = n;
  if (n == 0) probe.reason = "cudaGetDeviceCount: 0 devices";
  return probe;
}

/// The current device of the calling thread (cudaGetDevice). Throws loom::CudaError.
inline int current_device() {
  int d = -1;
  LOOM_CUDA_CHECK(cudaGetDevice(&d));
  return d;
}

/// Makes `device` current for the calling thread for its lifetime and restores the previous
/// device afterwards. Not copyable or movable (a scope, not a value).
class DeviceGuard {
 public:
  /// Throws loom::CudaError when `device` does not exist.
  explicit DeviceGuard(int device) : previous_(current_device()) {
    if (device != previous_) LOOM_CUDA_CHECK(cudaSetDevice(device));
    current_ = device;
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  ~DeviceGuard() {
    if (current_ != previous_) LOOM_CUDA_CHECK_NOEXCEPT(cudaSetDevice(previous_));
  }

 private:
  int previous_;
  int current_ = -1;
};

}  // namespace loom::cuda
