// loom/comm/device.hpp — where a communicator's collectives take their tensors.
//
// One sentence: `loom::detail::collective_device(comm)` is the device every tensor a loom part
// hands to `comm` must live on, so components allocate their small collective tensors (counts,
// flags, metrics) there instead of on the CPU.
//
// Example:
//   auto count = at::zeros({1}, at::TensorOptions().dtype(at::kLong).device(loom::detail::collective_device(comm)));
//   comm.all_reduce(count, loom::ReduceOp::sum);
//
// Rule: `comm.device()` when it returns a c10::Device; a CUDA device of that ordinal when it
// returns an integer (NcclCommunicator::device()); else the CPU (LocalCommunicator,
// GlooCommunicator, test doubles without the member).
#pragma once

#include <concepts>

#include <c10/core/Device.h>

namespace loom::detail {

/// The device a communicator's collective tensors must live on (see the file comment).
template <class C>
[[nodiscard]] c10::Device collective_device(const C& comm) {
  if constexpr (requires {
                  { comm.device() } -> std::same_as<c10::Device>;
                }) {
    return comm.device();
  } else if constexpr (requires {
                         { comm.device() } -> std::integral;
                       }) {
    return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(comm.device()));
  } else {
    (void)comm;
    return c10::Device(c10::kCPU);
  }
}

}  // namespace loom::detail
