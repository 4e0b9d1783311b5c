// loom/reduce/detail/host_path.hpp — which of its two paths the reducer takes for a tensor: its own
// loops over host memory (a CPU tensor) or ATen operators (a GPU tensor, the path that launches
// kernels), and a switch that sends CPU tensors down the ATen path so that tests and benchmarks
// run, count and compare the path a GPU takes on a machine without one.
//
// Example:
//   loom::detail::DevicePathOnCpu device_path;           // before the Reducer is built
//   loom::Reducer reducer(comm, loom::parameters_of(*model));
//   // ... every bucket is divided, scanned and flagged with ATen operators, as on a GPU
//
// Rule: the switch must not change during a reducer's life (its buckets are laid out for one path
// at construction); keep the guard alive from before the reducer is built until after it is gone.
// Pinned host staging is allocated only for CUDA tensors, so the forced path runs on any LibTorch.
#pragma once

#include <atomic>

#include <ATen/core/Tensor.h>

namespace loom::detail {

/// Whether CPU tensors take the ATen path (DevicePathOnCpu alive).
inline std::atomic<bool>& device_path_forced() noexcept {
  static std::atomic<bool> forced{false};
  return forced;
}

/// Whether the reducer works on `t` with its host loops: `t` is a CPU tensor and no
/// DevicePathOnCpu is alive.
inline bool on_host(const at::Tensor& t) {
  return t.is_cpu() && !device_path_forced().load(std::memory_order_relaxed);
}

/// While alive, CPU tensors take the reducer's ATen path (see the file comment). Not nestable
/// across threads; one at a time.
class DevicePathOnCpu {
 public:
  DevicePathOnCpu() noexcept : previous_(device_path_forced().exchange(true)) {}
  ~DevicePathOnCpu() { device_path_forced().store(previous_); }
  DevicePathOnCpu(const DevicePathOnCpu&) = delete;
  DevicePathOnCpu& operator=(const DevicePathOnCpu&) = delete;

 private:
  bool previous_;
};

}  // namespace loom::detail
