// loom/reduce/detail/work.hpp — the handle type a reducer keeps per bucket: the communicator's own
// async work handle, or a stand-in when the communicator only blocks.
#pragma once

#include <type_traits>
#include <utility>

#include <ATen/core/Tensor.h>

#include <loom/comm/communicator.hpp>

namespace loom::detail {

/// Stand-in handle for a communicator without all_reduce_async (the call blocked already).
struct DoneWork {
  void wait() const noexcept {}
};

template <class Comm, bool = AsyncCommunicator<Comm>>
struct WorkOf {
  using type = DoneWork;
};
template <class Comm>
struct WorkOf<Comm, true> {
  using type =
      std::decay_t<decltype(std::declval<Comm&>().all_reduce_async(std::declval<at::Tensor&>(), ReduceOp::sum))>;
};

}  // namespace loom::detail
