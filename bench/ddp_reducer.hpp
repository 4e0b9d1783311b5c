// bench/ddp_reducer.hpp — c10d::Reducer (DistributedDataParallel's reducer) built the way
// torch.nn.parallel.DistributedDataParallel builds it, on LibTorch 1.13 and 2.13 / 2.14 (the versions
// built here; other 2.x releases changed this constructor more than once): bench_reduce's "ddp" baseline. The constructor is the one LibTorch API of the benchmark that differs between versions;
// this header is the only place that knows.
//
// - LibTorch 1.13: Reducer(params, bucket_indices, per_bucket_size_limits, ProcessGroup, ...): the
//   Gloo ProcessGroup itself.
// - LibTorch 2.13 and 2.14: ProcessGroupGloo is a c10d::Backend; the Reducer takes a c10d::ProcessGroup that
//   holds it (setBackend for the CPU, Gloo the default), no per-bucket size limits, and three more
//   arguments: skip_all_reduce_unused_params (false), use_python_reducer (false: the C++ reducer),
//   bucket_bytes_cap_list (empty: every bucket capped by bucket_bytes_cap, DDP's default).
// Buckets: DDP's assignment in parameter order with [first_bucket_bytes, bucket_bytes] caps, then
// reversed (gradients become ready roughly in reverse parameter order), gradient_as_bucket_view on.
// Not part of loom.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/reducer.hpp>
#include <torch/version.h>

namespace bench {

/// DDP's reducer over `gloo` for `params` (each requires grad), buckets of at most `bucket_bytes`
/// with a first bucket of at most `first_bucket_bytes`. `names[i]` names params[i] (DDP's error messages).
inline std::unique_ptr<c10d::Reducer> make_ddp_reducer(const std::vector<at::Tensor>& params,
                                                       const c10::intrusive_ptr<c10d::ProcessGroupGloo>& gloo,
                                                       std::unordered_map<std::size_t, std::string> names,
                                                       std::int64_t bucket_bytes, std::int64_t first_bucket_bytes) {
  const std::vector<bool> sparse(params.size(), false);
  auto [indices, limits] = c10d::compute_bucket_assignment_by_size(
      params, {static_cast<std::size_t>(first_bucket_bytes), static_cast<std::size_t>(bucket_bytes)}, sparse);
  std::reverse(indices.begin(), indices.end());
  std::reverse(limits.begin(), limits.end());
#if TORCH_VERSION_MAJOR >= 2
  (void)limits;
  auto group = c10::make_intrusive<c10d::ProcessGroup>(gloo->getRank(), gloo->getSize());
  group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO, gloo);
  group->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
  return std::make_unique<c10d::Reducer>(params, indices, group, sparse, bucket_bytes,
                                         /*find_unused_parameters=*/false, /*gradient_as_bucket_view=*/true,
                                         std::move(names), first_bucket_bytes,
                                         /*skip_all_reduce_unused_params=*/false, /*use_python_reducer=*/false,
                                         /*bucket_bytes_cap_list=*/std::vector<std::int64_t>{});
#else
  return std::make_unique<c10d::Reducer>(params, indices, limits, gloo, sparse, bucket_bytes,
                                         /*find_unused_parameters=*/false, /*gradient_as_bucket_view=*/true,
                                         std::move(names), first_bucket_bytes);
#endif
}

}  // namespace bench
