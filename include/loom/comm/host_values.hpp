// loom/comm/host_values.hpp — collectives of host values (integers, float64 sums, strings)
// over any Communicator: the values are packed on the host, moved to the communicator's device
// (comm.device(); the CPU for Gloo and LocalCommunicator), exchanged, and read back. Every check
// that compares ranks (plans, parameters, options, replicas), the logging parts and the failure
// reports use these instead of writing the round trip again.
//
// Example (every rank calls each function at the same point):
//   const std::int64_t mine[2] = {comm.rank(), 7};
//   auto rows = loom::detail::all_gather_int64(comm, mine);              // rows[r] == {r, 7}
//   auto texts = loom::detail::all_gather_strings(comm, "ready");        // texts[r] == "ready"
//   auto sums = loom::detail::all_reduce_sums(comm, std::vector<double>{1.0});  // {world size}
//   auto text = loom::detail::broadcast_string(comm, rank0_text);        // rank 0's text
// Shape: integers travel as one int64 tensor per rank, float64 sums as one tensor, strings as int32
// words (a dtype every loom communicator supports; uint8 is not) after an int64 length.
// Throws: the communicator's errors (loom::CommError, loom::TimeoutError); loom::Error when
//   all_gather_int64 finds ranks with different counts (use all_gather_int64_ragged for those).
#pragma once

#include <algorithm>
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
#include <fmt/format.h>

#include <loom/comm/communicator.hpp>
#include <loom/error.hpp>

namespace loom::detail {

/// Every rank's `values` (the same count on every rank), indexed by rank: one all_gather.
/// Throws: loom::Error when a rank sent another count; the communicator's errors.
template <Communicator C>
[[nodiscard]] std::vector<std::vector<std::int64_t>> all_gather_int64(C& comm, std::span<const std::int64_t> values) {
  at::Tensor t = at::empty({static_cast<std::int64_t>(values.size())}, at::TensorOptions().dtype(at::kLong));
  if (!values.empty()) std::memcpy(t.data_ptr<std::int64_t>(), values.data(), values.size() * sizeof(std::int64_t));
  const std::vector<at::Tensor> all = comm.all_gather(t.to(comm.device()));
  LOOM_ASSERT(static_cast<int>(all.size()) == comm.world_size(), "all_gather returned a wrong count");
  std::vector<std::vector<std::int64_t>> out;
  out.reserve(all.size());
  for (std::size_t r = 0; r < all.size(); ++r) {
    const at::Tensor host = all[r].to(c10::kCPU).contiguous();
    if (host.numel() != static_cast<std::int64_t>(values.size()))
      throw Error(
          fmt::format("all_gather_int64: rank {} sent {} values, this rank {}", r, host.numel(), values.size()));
    const auto* p = host.data_ptr<std::int64_t>();
    out.emplace_back(p, p + host.numel());
  }
  return out;
}

/// Every rank's `values`, of any count, indexed by rank: two all_gathers (the counts, then the
/// values padded to the longest).
template <Communicator C>
[[nodiscard]] std::vector<std::vector<std::int64_t>> all_gather_int64_ragged(C& comm,
                                                                             std::span<const std::int64_t> values) {
  const std::int64_t count = static_cast<std::int64_t>(values.size());
  const auto counts = all_gather_int64(comm, std::span<const std::int64_t>(&count, 1));
  std::int64_t longest = 0;
  for (const auto& c : counts) longest = std::max(longest, c[0]);
  std::vector<std::int64_t> padded(values.begin(), values.end());
  padded.resize(static_cast<std::size_t>(longest), 0);
  auto all = all_gather_int64(comm, std::span<const std::int64_t>(padded));
  for (std::size_t r = 0; r < all.size(); ++r) all[r].resize(static_cast<std::size_t>(counts[r][0]));
  return all;
}

/// Every rank's `text`, indexed by rank. Two collectives (all_gather of lengths, then of bytes).
template <Communicator C>
[[nodiscard]] std::vector<std::string> all_gather_strings(C& comm, std::string_view text) {
  const std::int64_t length = static_cast<std::int64_t>(text.size());
  const auto lengths = all_gather_int64(comm, std::span<const std::int64_t>(&length, 1));
  std::int64_t longest = 0;
  for (const auto& l : lengths) longest = std::max(longest, l[0]);
  const std::int64_t words = std::max<std::int64_t>(1, (longest + 3) / 4);  // int32 words, at least one
  at::Tensor bytes = at::zeros({words}, at::TensorOptions().dtype(at::kInt));
  if (!text.empty()) std::memcpy(bytes.data_ptr<std::int32_t>(), text.data(), text.size());
  const std::vector<at::Tensor> all = comm.all_gather(bytes.to(comm.device()));
  LOOM_ASSERT(all.size() == lengths.size(), "all_gather returned a wrong count");
  std::vector<std::string> out;
  out.reserve(all.size());
  for (std::size_t r = 0; r < all.size(); ++r) {
    const at::Tensor host = all[r].to(c10::kCPU).contiguous();
    const std::int64_t size = lengths[r][0];
    LOOM_ASSERT(size >= 0 && size <= host.numel() * 4, "string length exceeds the gathered buffer");
    out.emplace_back(reinterpret_cast<const char*>(host.data_ptr<std::int32_t>()), static_cast<std::size_t>(size));
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

/// Rank `root`'s `text` on every rank (the argument of the other ranks is ignored): two broadcasts,
/// its length, then its bytes as int32 words. Units: bytes.
/// Example: `broadcast_string(comm, comm.rank() == 0 ? "weights" : "")` == "weights" on every rank.
template <Communicator C>
[[nodiscard]] std::string broadcast_string(C& comm, std::string_view text, int root = 0) {
  const auto device = comm.device();
  at::Tensor length = at::empty({1}, at::TensorOptions().dtype(at::kLong));
  length.data_ptr<std::int64_t>()[0] = static_cast<std::int64_t>(text.size());
  length = length.to(device);
  comm.broadcast(length, root);
  const auto size = static_cast<std::size_t>(length.to(c10::kCPU).data_ptr<std::int64_t>()[0]);
  at::Tensor words = at::zeros({std::max<std::int64_t>(static_cast<std::int64_t>((size + 3) / 4), 1)},
                               at::TensorOptions().dtype(at::kInt));
  if (comm.rank() == root && size > 0) std::memcpy(words.data_ptr(), text.data(), size);
  words = words.to(device);
  comm.broadcast(words, root);
  words = words.to(c10::kCPU);
  return std::string(static_cast<const char*>(words.data_ptr()), size);
}

}  // namespace loom::detail
