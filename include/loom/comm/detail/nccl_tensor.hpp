// loom/comm/detail/nccl_tensor.hpp — what NCCL is told about a tensor: its ncclDataType_t, the
// ncclRedOp_t of a loom::ReduceOp, the check that it is a CUDA tensor on the communicator's device
// (or a non-null device pointer), and the streams around it: the one that produced it, and the
// communicator's, which LibTorch's caching allocator is told uses its memory (used by
// loom/comm/nccl.hpp).
//
// Example: `ncclAllReduce(p, p, n, to_nccl_dtype(t.scalar_type(), "all_reduce"), to_nccl_op(op), ...)`
// Throws: loom::InvalidArgument naming the dtype, the collective, the tensor's device or the null pointer.
#pragma once

#include <loom/config.hpp>

#if LOOM_HAS_NCCL

#include <cstddef>
#include <string>
#include <string_view>

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <fmt/format.h>
#include <nccl.h>

#include <loom/comm/communicator.hpp>
#include <loom/error.hpp>

#if LOOM_TORCH_HAS_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

namespace loom::detail {

/// The NCCL data type of a loom-supported dtype. Throws loom::InvalidArgument for the others.
inline ncclDataType_t to_nccl_dtype(c10::ScalarType dtype, std::string_view collective) {
  switch (dtype) {
    case c10::ScalarType::Float: return ncclFloat32;
    case c10::ScalarType::Double: return ncclFloat64;
    case c10::ScalarType::BFloat16: return ncclBfloat16;
    case c10::ScalarType::Half: return ncclFloat16;
    case c10::ScalarType::Int: return ncclInt32;
    case c10::ScalarType::Long: return ncclInt64;
    default:
      throw InvalidArgument(fmt::format(
          "{}: unsupported dtype {} for NCCL (supported: float32, float64, bfloat16, float16, int32, int64)",
          collective, c10::toString(dtype)));
  }
}

/// The NCCL reduction of a loom ReduceOp (avg is ncclAvg: sum / world size, on the GPU).
constexpr ncclRedOp_t to_nccl_op(ReduceOp op) noexcept {
  switch (op) {
    case ReduceOp::sum: return ncclSum;
    case ReduceOp::avg: return ncclAvg;
    case ReduceOp::min: return ncclMin;
    case ReduceOp::max: return ncclMax;
  }
  return ncclSum;
}

/// Validates a tensor for a collective on `device`: the checks every communicator makes, then
/// loom::InvalidArgument naming the tensor's device when it is not a CUDA tensor on `device`.
inline void check_nccl_tensor(const at::Tensor& t, int device, std::string_view collective) {
  check_collective_tensor(t, collective);
  if (!t.is_cuda())
    throw InvalidArgument(fmt::format("{}: NcclCommunicator needs a CUDA tensor on cuda:{}, got one on {}", collective,
                                      device, t.device().str()));
  if (t.device().index() != device)
    throw InvalidArgument(fmt::format("{}: the tensor is on {}, but this rank's NcclCommunicator uses cuda:{}",
                                      collective, t.device().str(), device));
}

/// Throws loom::InvalidArgument when device pointer `p` of `count` elements is null (and count > 0).
inline void check_nccl_pointer(const void* p, std::size_t count, std::string_view collective) {
  if (p == nullptr && count > 0)
    throw InvalidArgument(fmt::format("{}: null device pointer for {} elements", collective, count));
}

/// LibTorch's current stream on t's device (what produced t); `fallback` without a CUDA LibTorch, where
/// no CUDA tensor exists and check_nccl_tensor has thrown before this is reached.
[[nodiscard]] inline cudaStream_t producer_stream([[maybe_unused]] const at::Tensor& t,
                                                  [[maybe_unused]] cudaStream_t fallback) {
#if LOOM_TORCH_HAS_CUDA
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
#else
  return fallback;
#endif
}

/// Tells LibTorch's caching allocator that `stream` (the communicator's) uses t's memory.
inline void record_stream_use([[maybe_unused]] const at::Tensor& t, [[maybe_unused]] cudaStream_t stream) {
#if LOOM_TORCH_HAS_CUDA
  t.record_stream(c10::cuda::getStreamFromExternal(stream, t.device().index()).unwrap());
#endif
}

}  // namespace loom::detail

#endif  // LOOM_HAS_NCCL
