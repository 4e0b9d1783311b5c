// loom/reduce/parameters.hpp — a model's parameters and buffers as a reducer sees them
// (ParameterList), the construction-time check that every rank holds the same ones, and the
// broadcast that makes the replicas start identical.
//
// Example:
//   loom::ParameterList list{.names = {"w", "b"}, .params = {w, b}, .buffers = {running_mean}};
//   loom::check_same_parameters(comm, list);   // throws loom::InvalidArgument naming the first mismatch
//   loom::broadcast_from_rank0(comm, list);    // w, b, running_mean now equal rank 0's on every rank
//
// Shape: any shapes and strides; frozen parameters (requires_grad == false) are checked and
//        broadcast too (replicas must agree on them) but never reduced.
// Guide: docs/reduce.md#errors.
// Source: DDP's _verify_param_shape_across_processes + _sync_module_states (one coalesced
//         broadcast per dtype, ~250 MiB pieces, parameters then buffers, from rank 0).
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <loom/comm/communicator.hpp>
#include <loom/comm/host_values.hpp>
#include <loom/detail/hash.hpp>
#include <loom/error.hpp>

namespace loom {

/// A model's parameters (in registration order) and buffers, with parameter names for messages.
///
/// Example: `loom::ParameterList{.names = {"fc.weight"}, .params = {fc->weight}}`.
/// Shape: `names.size()` is 0 or `params.size()`; tensors keep the model's shapes. The tensors are
///        handles to the model's own storage: writing them writes the model.
struct ParameterList {
  std::vector<std::string> names{};   ///< name of params[i], or empty (then messages say "parameter i")
  std::vector<at::Tensor> params{};   ///< leaf tensors, registration order; frozen ones included
  std::vector<at::Tensor> buffers{};  ///< non-trainable state (BatchNorm statistics, ...), broadcast at start

  /// "parameter 3 ('fc.weight')" or "parameter 3".
  [[nodiscard]] std::string describe(std::size_t i) const {
    if (i < names.size() && !names[i].empty()) return fmt::format("parameter {} ('{}')", i, names[i]);
    return fmt::format("parameter {}", i);
  }
};

namespace detail {

inline constexpr std::int64_t kDescriptorLen = 10;  // kind, dtype, requires_grad, ndim, 6 sizes
inline constexpr std::int64_t kMaxDescribedDims = 6;

/// Fixed-length description of one tensor: kind (0 parameter, 1 buffer), dtype, requires_grad,
/// ndim, sizes[0..4], and sizes[5] or a hash of sizes[5..] when ndim > 6.
inline void describe_tensor(const at::Tensor& t, std::int64_t kind, std::int64_t* out) {
  out[0] = kind;
  out[1] = static_cast<std::int64_t>(t.scalar_type());
  out[2] = t.requires_grad() ? 1 : 0;
  out[3] = t.dim();
  for (std::int64_t d = 0; d < kMaxDescribedDims; ++d) out[4 + d] = -1;
  for (std::int64_t d = 0; d < std::min<std::int64_t>(t.dim(), kMaxDescribedDims - 1); ++d) out[4 + d] = t.size(d);
  if (t.dim() == kMaxDescribedDims) {
    out[4 + kMaxDescribedDims - 1] = t.size(kMaxDescribedDims - 1);
  } else if (t.dim() > kMaxDescribedDims) {
    Fnv1a f;
    for (std::int64_t d = kMaxDescribedDims - 1; d < t.dim(); ++d) f.add(static_cast<std::uint64_t>(t.size(d)));
    out[4 + kMaxDescribedDims - 1] = static_cast<std::int64_t>(f.value() >> 1);
  }
}

inline std::string descriptor_text(const std::int64_t* d) {
  const auto dtype = static_cast<c10::ScalarType>(d[1]);
  std::vector<std::int64_t> sizes;
  const std::int64_t shown = d[3] > kMaxDescribedDims ? kMaxDescribedDims - 1 : d[3];
  for (std::int64_t k = 0; k < shown; ++k) sizes.push_back(d[4 + k]);
  return fmt::format("{} [{}]{}{}", c10::toString(dtype), fmt::join(sizes, ", "),
                     d[3] > kMaxDescribedDims ? ", ..." : "", d[0] == 0 ? (d[2] ? "" : " (frozen)") : "");
}

/// Descriptor stream of a list: params then buffers, kDescriptorLen integers each.
inline std::vector<std::int64_t> descriptors(const ParameterList& list) {
  std::vector<std::int64_t> out((list.params.size() + list.buffers.size()) * kDescriptorLen);
  std::size_t k = 0;
  for (const auto& p : list.params) describe_tensor(p, 0, out.data() + kDescriptorLen * k++);
  for (const auto& b : list.buffers) describe_tensor(b, 1, out.data() + kDescriptorLen * k++);
  return out;
}

inline std::int64_t hash_descriptors(const std::vector<std::int64_t>& v) {
  Fnv1a f;
  for (std::int64_t x : v) f.add(static_cast<std::uint64_t>(x));
  return static_cast<std::int64_t>(f.value() >> 1);
}

inline std::string entry_name(const ParameterList& list, std::size_t k) {
  if (k < list.params.size()) return list.describe(k);
  return fmt::format("buffer {}", k - list.params.size());
}

}  // namespace detail

/// Checks that every rank holds the same parameters and buffers (count, dtypes, shapes,
/// requires_grad, in order). One all-gather of 3 integers when they agree; when they do not,
/// every rank sees it and a second all-gather fetches the descriptions to name the first mismatch.
///
/// Example: `loom::check_same_parameters(comm, loom::parameters_of(*model));`
/// Throws: loom::InvalidArgument on every rank, naming the first differing entry, e.g.
///         "parameters differ across ranks: parameter 1 ('fc.bias') is Float [10] on rank 0 but
///         Float [11] on rank 1"; communicator errors (loom::CommError, loom::TimeoutError).
/// Source: DDP's _verify_param_shape_across_processes (which all-gathers shapes on every start).
template <Communicator Comm>
void check_same_parameters(Comm& comm, const ParameterList& list) {
  if (comm.world_size() == 1) return;
  const auto desc = detail::descriptors(list);
  const std::int64_t summary[3] = {static_cast<std::int64_t>(list.params.size()),
                                   static_cast<std::int64_t>(list.buffers.size()), detail::hash_descriptors(desc)};
  const auto all = detail::all_gather_int64(comm, std::span<const std::int64_t>(summary, 3));
  bool same = true;
  std::int64_t max_entries = 0;
  for (const auto& r : all) {
    same = same && r == all[0];
    max_entries = std::max(max_entries, r[0] + r[1]);
  }
  if (same) return;

  // Every rank saw the difference: fetch all descriptions (padded to the longest list).
  std::vector<std::int64_t> mine(static_cast<std::size_t>(max_entries * detail::kDescriptorLen), -2);
  std::copy(desc.begin(), desc.end(), mine.begin());
  const auto streams = detail::all_gather_int64(comm, std::span<const std::int64_t>(mine));
  const auto* ref = streams[0].data();
  const auto* ref_counts = all[0].data();
  for (std::size_t r = 1; r < streams.size(); ++r) {
    const auto* other = streams[r].data();
    const auto* counts = all[r].data();
    if (ref_counts[0] != counts[0] || ref_counts[1] != counts[1])
      throw InvalidArgument(
          fmt::format("parameters differ across ranks: rank 0 has {} parameters and {} buffers, rank {} has {} and {} "
                      "(seen from rank {})",
                      ref_counts[0], ref_counts[1], r, counts[0], counts[1], comm.rank()));
    for (std::int64_t k = 0; k < max_entries; ++k) {
      const auto* a = ref + k * detail::kDescriptorLen;
      const auto* b = other + k * detail::kDescriptorLen;
      if (std::equal(a, a + detail::kDescriptorLen, b)) continue;
      throw InvalidArgument(
          fmt::format("parameters differ across ranks: {} is {} on rank 0 but {} on rank {} (seen from rank {})",
                      detail::entry_name(list, static_cast<std::size_t>(k)), detail::descriptor_text(a),
                      detail::descriptor_text(b), r, comm.rank()));
    }
  }
  throw InvalidArgument(
      fmt::format("parameters differ across ranks (summary hashes differ; seen from rank {})", comm.rank()));
}

/// Copies rank 0's parameters and buffers into every rank, coalesced: one broadcast per dtype and
/// device per ~256 MiB. Dtypes the communicator cannot move (bool, uint8, int8, int16) travel as int64.
/// The coalesced buffers live on the communicator's device (NcclCommunicator: its GPU) and are
/// copied back to each tensor's own device.
///
/// Example: `loom::broadcast_from_rank0(comm, list);`
/// Throws: communicator errors; loom::InvalidArgument for an undefined tensor.
/// Source: DDP's _sync_module_states / _broadcast_coalesced (250 MiB pieces).
template <Communicator Comm>
void broadcast_from_rank0(Comm& comm, const ParameterList& list, std::size_t piece_bytes = std::size_t{256} << 20) {
  if (comm.world_size() == 1) return;
  at::NoGradGuard no_grad;
  const auto device = comm.device();
  std::vector<at::Tensor> all;
  all.reserve(list.params.size() + list.buffers.size());
  for (std::size_t i = 0; i < list.params.size(); ++i) {
    if (!list.params[i].defined())
      throw InvalidArgument(fmt::format("broadcast_from_rank0: {} is undefined", list.describe(i)));
    all.push_back(list.params[i]);
  }
  for (std::size_t i = 0; i < list.buffers.size(); ++i) {
    if (!list.buffers[i].defined()) continue;  // an optional buffer left unset is the same on every rank
    all.push_back(list.buffers[i]);
  }
  // Stable groups by (wire dtype, device), in first-appearance order (identical on every rank).
  struct Group {
    c10::ScalarType wire;
    c10::Device device;
    std::vector<std::size_t> members;
  };
  std::vector<Group> groups;
  for (std::size_t i = 0; i < all.size(); ++i) {
    const auto dt = is_supported_dtype(all[i].scalar_type()) ? all[i].scalar_type() : c10::ScalarType::Long;
    auto it = std::find_if(groups.begin(), groups.end(),
                           [&](const Group& g) { return g.wire == dt && g.device == all[i].device(); });
    if (it == groups.end())
      groups.push_back({dt, all[i].device(), {i}});
    else
      it->members.push_back(i);
  }
  for (const auto& g : groups) {
    std::size_t begin = 0;
    while (begin < g.members.size()) {
      std::size_t end = begin;
      std::size_t bytes = 0;
      while (end < g.members.size() && (end == begin || bytes < piece_bytes)) {
        bytes += static_cast<std::size_t>(all[g.members[end]].numel()) * c10::elementSize(g.wire);
        ++end;
      }
      std::vector<at::Tensor> flat;
      for (std::size_t k = begin; k < end; ++k) flat.push_back(all[g.members[k]].reshape({-1}).to(device, g.wire));
      auto buffer = at::cat(flat);
      comm.broadcast(buffer, 0);
      std::int64_t offset = 0;
      for (std::size_t k = begin; k < end; ++k) {
        auto& t = all[g.members[k]];
        t.copy_(buffer.narrow(0, offset, t.numel()).view(t.sizes()));
        offset += t.numel();
      }
      begin = end;
    }
  }
}

}  // namespace loom
