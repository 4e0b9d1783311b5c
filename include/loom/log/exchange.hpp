// loom/log/exchange.hpp — small collectives the logging parts build on: exchanging a string and
// a few float64 sums between all ranks of a Communicator.
//
// These are internals (namespace loom::detail) shared by Logger::sync, main_process_first,
// global_mean and Progress; every function is a collective: every rank calls it at the same point.
//
// Example:
//   auto texts = loom::detail::all_gather_strings(comm, "hello from " + std::to_string(comm.rank()));
//   // texts[r] == "hello from r" on every rank
//
// Shape: strings travel as int32 tensors of ceil(max_length / 4) elements (int32 is a dtype every
// loom communicator supports; uint8 is not), lengths as one int64 per rank. Sums travel as one
// float64 tensor of n elements. Tensors live on the communicator's device when it has a
// `device()` member (NcclCommunicator: a CUDA ordinal), else on the CPU.
#pragma once

#include <algorithm>
#include <concepts>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/core/Device.h>

#include <loom/comm/communicator.hpp>
#include <loom/error.hpp>

namespace loom::detail {

/// Every rank's `text`, indexed by rank. Two collectives (all_gather of lengths, then of bytes).
template <Communicator C>
[[nodiscard]] std::vector<std::string> all_gather_strings(C& comm, std::string_view text) {
  const auto device = comm.device();
  const auto cpu_long = at::TensorOptions().dtype(at::kLong);
  at::Tensor length = at::empty({1}, cpu_long);
  length.data_ptr<std::int64_t>()[0] = static_cast<std::int64_t>(text.size());
  std::vector<at::Tensor> lengths = comm.all_gather(length.to(device));
  LOOM_ASSERT(static_cast<int>(lengths.size()) == comm.world_size(), "all_gather returned a wrong count");

  std::vector<std::int64_t> sizes;
  sizes.reserve(lengths.size());
  for (const auto& l : lengths) sizes.push_back(l.to(c10::kCPU).data_ptr<std::int64_t>()[0]);
  const std::int64_t longest = *std::max_element(sizes.begin(), sizes.end());
  const std::int64_t words = std::max<std::int64_t>(1, (longest + 3) / 4);  // int32 words, at least one

  at::Tensor bytes = at::zeros({words}, at::TensorOptions().dtype(at::kInt));
  if (!text.empty()) std::memcpy(bytes.data_ptr<std::int32_t>(), text.data(), text.size());
  std::vector<at::Tensor> all = comm.all_gather(bytes.to(device));
  LOOM_ASSERT(all.size() == sizes.size(), "all_gather returned a wrong count");

  std::vector<std::string> out;
  out.reserve(all.size());
  for (std::size_t r = 0; r < all.size(); ++r) {
    at::Tensor host = all[r].to(c10::kCPU).contiguous();
    LOOM_ASSERT(sizes[r] >= 0 && sizes[r] <= host.numel() * 4, "string length exceeds the gathered buffer");
    out.emplace_back(reinterpret_cast<const char*>(host.data_ptr<std::int32_t>()), static_cast<std::size_t>(sizes[r]));
  }
  return out;
}

/// Sums `values` element-wise over all ranks, in float64, with one all_reduce.
template <Communicator C>
[[nodiscard]] std::vector<double> all_reduce_sums(C& comm, std::span<const double> values) {
  at::Tensor t = at::empty({static_cast<std::int64_t>(values.size())}, at::TensorOptions().dtype(at::kDouble));
  if (!values.empty()) std::memcpy(t.data_ptr<double>(), values.data(), values.size() * sizeof(double));
  const auto device = comm.device();
  if (device.is_cpu()) {
    comm.all_reduce(t, ReduceOp::sum);
  } else {
    at::Tensor d = t.to(device);
    comm.all_reduce(d, ReduceOp::sum);
    t = d.to(c10::kCPU);
  }
  const double* p = t.data_ptr<double>();
  return std::vector<double>(p, p + values.size());
}

}  // namespace loom::detail
