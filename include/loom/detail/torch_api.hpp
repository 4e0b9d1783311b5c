// loom/detail/torch_api.hpp — the LibTorch API differences between the versions loom is built with
// (Debian's 1.13; pip's and the zip's 2.x), named once so that no other header needs a version #if.
//
// - LOOM_TORCH_VERSION: major * 10000 + minor * 100 + patch (Debian's 1.13 reports 1.13.0: 11300), from torch/version.h.
// - GradAccumulatorPtr: what torch::autograd::impl::grad_accumulator() returns, the owning pointer
//   to a leaf's AccumulateGrad node: std::shared_ptr<Node> on 1.13, c10::intrusive_ptr<Node> on 2.13
//   (both built by CI). loom holds it to keep its post-hooks alive and compares it with
//   try_get_grad_accumulator() to see whether a parameter was replaced.
// - kStoreTakesListenFd / set_master_listen_fd: whether c10d's TCPStore server can take over a
//   socket that is already bound and listening (TCPStoreOptions::masterListenFd, LibTorch 2.x; not
//   in 1.13). loom::spawn hands its reserved MASTER_PORT socket to rank 0 that way (loom/launch/spawn.hpp).
// The optimizer's zero_grad() difference is handled in loom/compat.hpp (loom::zero_grad).
#pragma once

#include <utility>

#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/version.h>

#define LOOM_TORCH_VERSION (TORCH_VERSION_MAJOR * 10000 + TORCH_VERSION_MINOR * 100 + TORCH_VERSION_PATCH)

namespace loom::detail {

/// The owning pointer type of a leaf tensor's gradient accumulator (see the header comment).
using GradAccumulatorPtr = decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));

/// Whether `O` (c10d::TCPStoreOptions) has masterListenFd, the already-listening socket a server takes over.
template <class O>
concept HasMasterListenFd = requires(O& o, int fd) {
  o.masterListenFd = fd;
};

/// Whether this LibTorch's TCPStore server can take over a listening socket (see the header comment).
inline constexpr bool kStoreTakesListenFd = HasMasterListenFd<c10d::TCPStoreOptions>;

/// Sets `options.masterListenFd = fd` where the field exists; returns whether it did.
template <class O>
bool set_master_listen_fd(O& options, int fd) {
  if constexpr (HasMasterListenFd<O>) {
    options.masterListenFd = fd;
    return true;
  } else {
    (void)options;
    (void)fd;
    return false;
  }
}

}  // namespace loom::detail
