// loom/comm/communicator.hpp — the Communicator concept ladder, reduce operations, and the
// checks every communicator applies to the tensors it is given.
//
// A communicator is a process group: `world_size()` processes numbered 0..world_size()-1, each
// holding one communicator object, that meet at collectives. All collectives act *in place* on
// one dense tensor, must be called by every rank in the same order with tensors of the same
// shape and dtype, and give up after `timeout()` with loom::TimeoutError instead of hanging.
//
// Example:
//   loom::LocalCommunicator comm;                  // world size 1
//   auto t = torch::ones({4});
//   comm.all_reduce(t, loom::ReduceOp::sum);       // t == [1, 1, 1, 1]
//
// Concept ladder (each rung adds one capability):
//   Communicator       rank, world size, timeout, blocking all_reduce / broadcast / all_gather / barrier
//   AsyncCommunicator  + all_reduce_async returning a WorkHandle (used by the reducer to overlap backward)
//
// Models: LocalCommunicator (comm/local.hpp), GlooCommunicator (comm/gloo.hpp),
//         NcclCommunicator (comm/nccl.hpp).
//
// Source: the operation set and semantics follow torch.distributed / c10d (ReduceOp, Work::wait);
// "avg" divides the sum by world_size as in ncclAvg (integer dtypes: truncating division).
#pragma once

#include <chrono>
#include <concepts>
#include <string_view>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <loom/error.hpp>

namespace loom {

/// Element-wise reduction applied by all_reduce. `avg` = sum / world_size.
enum class ReduceOp { sum, avg, min, max };

/// Name of a ReduceOp ("sum", "avg", "min", "max"), for messages.
constexpr std::string_view to_string(ReduceOp op) noexcept {
  switch (op) {
    case ReduceOp::sum: return "sum";
    case ReduceOp::avg: return "avg";
    case ReduceOp::min: return "min";
    case ReduceOp::max: return "max";
  }
  return "?";
}

/// A handle to an asynchronous collective.
///
/// Requirements:
///  1. `w.wait()` blocks until the collective finished; throws loom::TimeoutError (naming the
///     collective, rank and seconds waited) when it does not finish within the communicator's
///     timeout, loom::CommError on a backend failure. Reason: a hung peer must surface as an error.
///  2. `w.is_completed()` returns whether wait() would return at once, without blocking.
///     Reason: lets a caller poll without stalling the training thread.
/// Not required: copyability (handles may own backend state), cancellation.
template <class W>
concept WorkHandle = requires(W& w) {
  w.wait();
  { w.is_completed() } -> std::convertible_to<bool>;
};

/// A process group that can run blocking collectives on dense tensors.
///
/// Requirements:
///  1. `rank()` in [0, world_size()), `world_size()` >= 1. Reason: components shard by rank.
///  2. `timeout()`: a std::chrono::milliseconds bound on every blocking call. Reason: no hangs.
///  3. `all_reduce(t, op)`: in place, every rank ends with the reduction over ranks of `t`.
///  4. `broadcast(t, root)`: in place, every rank ends with root's `t`.
///  5. `all_gather(t)`: returns world_size() tensors, entry r is rank r's `t` (same shape on all ranks).
///  6. `barrier()`: returns once every rank has entered it.
///  7. `device()`: the c10::Device every tensor handed to the collectives lives on (the CPU for
///     LocalCommunicator and GlooCommunicator, the rank's CUDA device for NcclCommunicator).
///     Reason: loom's parts allocate their own small collective tensors (sample counts, flags,
///     norms, metrics, sampler checks) and must put them where the backend takes them; NCCL takes
///     device memory only.
/// Tensors must be defined, contiguous, of a supported dtype (float32, float64, bfloat16,
/// float16, int32, int64); otherwise loom::InvalidArgument (see detail::check_collective_tensor).
/// Not required: thread safety (one thread issues a communicator's collectives), async forms.
template <class C>
concept Communicator = requires(C& c, const C& cc, at::Tensor& t, const at::Tensor& ct, ReduceOp op, int root) {
  { cc.rank() } -> std::convertible_to<int>;
  { cc.world_size() } -> std::convertible_to<int>;
  { cc.timeout() } -> std::convertible_to<std::chrono::milliseconds>;
  { cc.device() } -> std::same_as<c10::Device>;
  c.all_reduce(t, op);
  c.broadcast(t, root);
  { c.all_gather(ct) } -> std::same_as<std::vector<at::Tensor>>;
  c.barrier();
};

/// A Communicator that can also start an all-reduce and return at once.
///
/// Requirements (in addition to Communicator):
///  1. `all_reduce_async(t, op)` returns a WorkHandle; `t` must stay alive and unmodified until
///     wait() returned. Reason: the reducer launches bucket k while backward still fills bucket k+1.
///  2. Collectives complete in the order they were issued on every rank.
template <class C>
concept AsyncCommunicator = Communicator<C> && requires(C& c, at::Tensor& t, ReduceOp op) {
  { c.all_reduce_async(t, op) } -> WorkHandle;
};

/// True for the dtypes every loom communicator supports.
inline bool is_supported_dtype(c10::ScalarType dtype) noexcept {
  switch (dtype) {
    case c10::ScalarType::Float:
    case c10::ScalarType::Double:
    case c10::ScalarType::BFloat16:
    case c10::ScalarType::Half:
    case c10::ScalarType::Int:
    case c10::ScalarType::Long: return true;
    default: return false;
  }
}

namespace detail {
/// Validates a tensor handed to a collective. Throws loom::InvalidArgument naming the collective
/// and what is wrong: undefined, non-contiguous (with its strides), or an unsupported dtype.
inline void check_collective_tensor(const at::Tensor& t, std::string_view collective) {
  if (!t.defined()) throw InvalidArgument(fmt::format("{}: the tensor is undefined", collective));
  if (!t.is_contiguous())
    throw InvalidArgument(
        fmt::format("{}: the tensor is not contiguous (sizes {}, strides {}); call .contiguous() first", collective,
                    fmt::join(t.sizes(), "x"), fmt::join(t.strides(), ",")));
  if (!is_supported_dtype(t.scalar_type()))
    throw InvalidArgument(
        fmt::format("{}: unsupported dtype {} (supported: float32, float64, bfloat16, float16, int32, int64)",
                    collective, c10::toString(t.scalar_type())));
}

/// Validates a root rank. Throws loom::InvalidArgument naming the root and the world size.
inline void check_root(int root, int world_size, std::string_view collective) {
  if (root < 0 || root >= world_size)
    throw InvalidArgument(fmt::format("{}: root {} is outside [0, {})", collective, root, world_size));
}
}  // namespace detail

}  // namespace loom
