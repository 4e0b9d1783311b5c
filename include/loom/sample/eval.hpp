// loom/sample/eval.hpp — gather per-sample evaluation results from every rank, in dataset order.
//
// Distributed evaluation runs each rank on its DistributedSampler share; without drop_last the
// sampler pads the index list by repeating its beginning, so a few samples are evaluated twice,
// and a metric averaged naively counts them twice. gather_results collects (dataset index, result
// row) pairs from every rank over any loom::Communicator, drops the duplicates, and returns the
// rows sorted by dataset index, each sample exactly once.
//
// Example:
//   loom::DistributedSampler s({.dataset_size = n, .num_replicas = w, .rank = r, .shuffle = false});
//   std::vector<int64_t> seen; std::vector<at::Tensor> rows;
//   while (auto i = s.next()) { seen.push_back(*i); rows.push_back(model(input(*i))); }   // 1 x C each
//   auto all = loom::gather_results(comm, seen, torch::cat(rows), {.dataset_size = n});
//   // all.values: n x C, row i = sample i; all.duplicates_dropped == s.total_size() - n
//
// Protocol (every rank calls it, with any number of rows, 0 included; a rank with no indices may
// pass an undefined values tensor and adopts the dtype and trailing shape of the first rank that
// passed one):
//   1. all_gather a fixed-size int64 header: error code, row count, dtype, trailing shape. Every
//      rank checks every header, so a bad input on one rank makes *all* ranks throw the same
//      loom::InvalidArgument (no rank is left waiting in the next collective).
//   2. all_gather the indices and the rows, each padded to the largest row count (indices with -1).
//   3. Walk the rows in the samplers' global order (row j of every rank, rank 0 first, then row
//      j + 1): the first occurrence of an index is kept, later ones are the padding duplicates.
// The tensors are exchanged on the communicator's device (comm.device(): NCCL a GPU, Gloo the CPU).
//
// Shape: indices has n entries; values is n x (trailing shape), the same trailing shape and dtype
//        on every rank (at most 6 trailing dimensions), a dtype the communicator supports (float32,
//        float64, bfloat16, float16, int32, int64). Result: values m x (trailing shape) on the CPU,
//        indices ascending (m distinct indices; m = dataset_size when given).
// Throws: loom::InvalidArgument on every rank, naming the rank and the value, for: indices and
//         values of different lengths, an undefined values tensor with indices, a 0-dimensional
//         values tensor, an unsupported
//         dtype, more than 6 trailing dimensions, trailing shapes or dtypes that differ between
//         ranks, an index outside [0, dataset_size), and (with dataset_size) an index that no rank
//         evaluated. loom::CommError / loom::TimeoutError from the communicator.
// Source: the gather-then-deduplicate recipe of torchvision's reference evaluate() / torchmetrics'
//         dist_sync, with sizes gathered first because all_gather needs equal shapes.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <loom/comm/communicator.hpp>
#include <loom/comm/host_values.hpp>
#include <loom/error.hpp>
#include <loom/trace/recorder.hpp>

namespace loom {

/// Options of gather_results.
struct GatherOptions {
  /// When >= 0: every index must lie in [0, dataset_size) and each must be evaluated by some rank.
  int64_t dataset_size = -1;
};

/// The result of gather_results: distinct dataset indices ascending, and their rows.
struct GatheredResults {
  std::vector<int64_t> indices{};  ///< ascending, distinct
  at::Tensor values{};             ///< indices.size() x (trailing shape), CPU
  int64_t duplicates_dropped = 0;  ///< rows dropped because their index was already seen
};

namespace detail {
inline constexpr int64_t kGatherMaxTrailing = 6;
inline constexpr int64_t kGatherHeader = 4 + kGatherMaxTrailing;  // error, n, dtype, ndim, dims...
enum GatherErrorCode : int64_t {
  kGatherOk = 0,
  kGatherLength,
  kGatherUndefined,
  kGatherDtype,
  kGatherDims,
  kGatherRange
};
}  // namespace detail

/// Gathers (index, row) pairs from all ranks, drops duplicates, returns them in dataset order.
///
/// Example: see the file comment.
/// Shape: see the file comment.
/// Throws: see the file comment.
/// Source: see the file comment.
template <Communicator C>
GatheredResults gather_results(C& comm, std::span<const int64_t> indices, const at::Tensor& values,
                               GatherOptions o = {}) {
  using namespace detail;
  const int world = comm.world_size();
  // ---- 1. headers: validate locally, but throw only after everyone has seen every header ----
  std::array<int64_t, kGatherHeader> header{};
  int64_t bad_value = 0;
  // A rank that evaluated nothing may pass an undefined tensor: it has no row to take a dtype or a
  // trailing shape from, and adopts the first non-empty rank's.
  const bool empty_rank = indices.empty() && !values.defined();
  if (empty_rank) {
    header[2] = -1;
  } else if (!values.defined() || values.dim() == 0) {
    header[0] = kGatherUndefined;
  } else if (values.size(0) != static_cast<int64_t>(indices.size())) {
    header[0] = kGatherLength;
  } else if (!is_supported_dtype(values.scalar_type())) {
    header[0] = kGatherDtype;
  } else if (values.dim() - 1 > kGatherMaxTrailing) {
    header[0] = kGatherDims;
  } else {
    for (int64_t i : indices) {
      if (i < 0 || (o.dataset_size >= 0 && i >= o.dataset_size)) {
        header[0] = kGatherRange;
        bad_value = i;
        break;
      }
    }
  }
  header[1] = values.defined() && values.dim() > 0 ? values.size(0) : 0;
  header[2] = values.defined() ? static_cast<int64_t>(values.scalar_type()) : -1;  // -1: an empty rank
  header[3] = values.defined() ? std::max<int64_t>(values.dim() - 1, 0) : 0;
  if (header[0] == kGatherOk)
    for (int64_t d = 1; d < values.dim(); ++d) header[static_cast<std::size_t>(3 + d)] = values.size(d);
  if (header[0] == kGatherLength) {  // report both counts
    header[1] = static_cast<int64_t>(indices.size());
    header[4] = values.size(0);
  }
  if (header[0] == kGatherRange) header[4] = bad_value;
  const at::Device device = comm.device();  // where the communicator takes its tensors
  auto to_device = [&](const at::Tensor& t) { return device.is_cpu() ? t : t.to(device); };

  trace::Scope scope(comm, trace::Context::evaluation);
  const auto all = detail::all_gather_int64(comm, std::span<const std::int64_t>(header.data(), header.size()));
  for (int r = 0; r < world; ++r) {
    const auto& a = all[static_cast<std::size_t>(r)];
    switch (a[0]) {
      case kGatherOk: break;
      case kGatherUndefined:
        throw InvalidArgument(
            fmt::format("gather_results: rank {} passed an undefined or 0-dimensional values tensor", r));
      case kGatherLength:
        throw InvalidArgument(
            fmt::format("gather_results: rank {} passed {} indices but {} value rows", r, a[1], a[4]));
      case kGatherDtype:
        throw InvalidArgument(fmt::format("gather_results: rank {} passed values of unsupported dtype {}", r,
                                          c10::toString(static_cast<c10::ScalarType>(a[2]))));
      case kGatherDims:
        throw InvalidArgument(
            fmt::format("gather_results: rank {} passed values with {} trailing dimensions (at most {})", r, a[3],
                        kGatherMaxTrailing));
      case kGatherRange:
        throw InvalidArgument(fmt::format("gather_results: rank {} passed index {}, outside [0, {})", r, a[4],
                                          o.dataset_size >= 0 ? fmt::to_string(o.dataset_size) : std::string("inf")));
      default: throw CommError(fmt::format("gather_results: rank {} sent a corrupt header (code {})", r, a[0]));
    }
  }
  // The reference dtype and trailing shape: the first rank that passed a tensor (empty ranks adopt it).
  int ref = 0;
  while (ref < world && all[static_cast<std::size_t>(ref)][2] < 0) ++ref;
  for (int r = ref + 1; r < world; ++r) {
    const auto& a = all[static_cast<std::size_t>(r)];
    const auto& z = all[static_cast<std::size_t>(ref)];
    if (a[2] < 0) continue;
    if (a[2] != z[2] || a[3] != z[3] || !std::equal(a.begin() + 4, a.end(), z.begin() + 4))
      throw InvalidArgument(fmt::format(
          "gather_results: rank {} has values of dtype {} and trailing shape [{}], rank {} has {} and [{}]", r,
          c10::toString(static_cast<c10::ScalarType>(a[2])), fmt::join(a.begin() + 4, a.begin() + 4 + a[3], ", "), ref,
          c10::toString(static_cast<c10::ScalarType>(z[2])), fmt::join(z.begin() + 4, z.begin() + 4 + z[3], ", ")));
  }
  // ---- 2. padded all_gather of indices and rows ----
  int64_t max_n = 0;
  for (const auto& a : all) max_n = std::max(max_n, a[1]);
  std::vector<int64_t> trailing;
  c10::ScalarType dtype = at::kFloat;  // when no rank passed a tensor (and none has a row)
  if (ref < world) {
    const auto& z = all[static_cast<std::size_t>(ref)];
    trailing.assign(z.begin() + 4, z.begin() + 4 + z[3]);
    dtype = static_cast<c10::ScalarType>(z[2]);
  }
  int64_t row_numel = 1;
  for (int64_t d : trailing) row_numel *= d;
  const std::size_t row_bytes = static_cast<std::size_t>(row_numel) * c10::elementSize(dtype);
  std::vector<int64_t> out_shape{0};
  out_shape.insert(out_shape.end(), trailing.begin(), trailing.end());
  GatheredResults result;
  if (max_n == 0) {
    if (o.dataset_size > 0)
      throw InvalidArgument(fmt::format("gather_results: no rank evaluated any of the {} samples", o.dataset_size));
    result.values = at::empty(out_shape, at::TensorOptions(dtype));
    return result;
  }
  const auto n = static_cast<int64_t>(indices.size());
  at::Tensor idx = at::empty({max_n}, at::TensorOptions(at::kLong));
  auto* ip = static_cast<int64_t*>(idx.data_ptr());
  std::copy(indices.begin(), indices.end(), ip);
  std::fill(ip + n, ip + max_n, int64_t{-1});
  std::vector<int64_t> padded_shape{max_n};
  padded_shape.insert(padded_shape.end(), trailing.begin(), trailing.end());
  at::Tensor rows = at::empty(padded_shape, at::TensorOptions(dtype));
  const at::Tensor local = n > 0 ? values.cpu().contiguous() : at::Tensor();
  // A rank with no rows has a null data pointer, and memcpy from null is undefined even for 0 bytes.
  if (n > 0) std::memcpy(rows.data_ptr(), local.data_ptr(), static_cast<std::size_t>(n) * row_bytes);
  std::memset(static_cast<std::byte*>(rows.data_ptr()) + static_cast<std::size_t>(n) * row_bytes, 0,
              static_cast<std::size_t>(max_n - n) * row_bytes);
  std::vector<at::Tensor> all_idx = comm.all_gather(to_device(idx));
  std::vector<at::Tensor> all_rows = comm.all_gather(to_device(rows));
  for (auto& t : all_idx) t = t.cpu().contiguous();
  for (auto& t : all_rows) t = t.cpu().contiguous();
  // ---- 3. first occurrence in the samplers' global order wins ----
  struct Hit {
    int64_t index;
    int rank;
    int64_t row;
  };
  std::vector<Hit> hits;
  for (int64_t j = 0; j < max_n; ++j) {
    for (int r = 0; r < world; ++r) {
      if (j >= all[static_cast<std::size_t>(r)][1]) continue;
      hits.push_back({static_cast<const int64_t*>(all_idx[static_cast<std::size_t>(r)].data_ptr())[j], r, j});
    }
  }
  std::stable_sort(hits.begin(), hits.end(), [](const Hit& a, const Hit& b) { return a.index < b.index; });
  std::vector<Hit> kept;
  kept.reserve(hits.size());
  for (const Hit& hit : hits) {
    if (!kept.empty() && kept.back().index == hit.index)
      ++result.duplicates_dropped;
    else
      kept.push_back(hit);
  }
  if (o.dataset_size >= 0 && static_cast<int64_t>(kept.size()) != o.dataset_size) {
    int64_t missing = 0;
    for (const Hit& k : kept) {
      if (k.index != missing) break;
      ++missing;
    }
    throw InvalidArgument(fmt::format("gather_results: index {} (and {} in all) of [0, {}) was evaluated by no rank",
                                      missing, o.dataset_size - static_cast<int64_t>(kept.size()), o.dataset_size));
  }
  out_shape[0] = static_cast<int64_t>(kept.size());
  result.values = at::empty(out_shape, at::TensorOptions(dtype));
  auto* dst = static_cast<std::byte*>(result.values.data_ptr());
  result.indices.reserve(kept.size());
  for (std::size_t k = 0; k < kept.size(); ++k) {
    const auto* src = static_cast<const std::byte*>(all_rows[static_cast<std::size_t>(kept[k].rank)].data_ptr());
    std::memcpy(dst + k * row_bytes, src + static_cast<std::size_t>(kept[k].row) * row_bytes, row_bytes);
    result.indices.push_back(kept[k].index);
  }
  return result;
}

}  // namespace loom
