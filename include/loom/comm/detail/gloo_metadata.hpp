// loom/comm/detail/gloo_metadata.hpp — the fingerprint of one collective call that GlooCommunicator's
// metadata check (GlooOptions::check_metadata) all-gathers before the call itself, and its text for
// the error that names every rank's view. Not a public header: loom/comm/gloo.hpp is.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <loom/comm/communicator.hpp>

namespace loom::detail {

/// The collectives the metadata check tells apart (their codes travel in the fingerprint).
enum class GlooCollective : std::int64_t { all_reduce = 1, broadcast = 2, all_gather = 3 };

/// Sizes of the first kMetaDims - 1 dimensions travel as they are; the rest as one hash.
inline constexpr std::size_t kMetaDims = 8;

/// "all_reduce", "broadcast", "all_gather".
inline const char* collective_name(GlooCollective collective) noexcept {
  switch (collective) {
    case GlooCollective::all_reduce: return "all_reduce";
    case GlooCollective::broadcast: return "broadcast";
    case GlooCollective::all_gather: return "all_gather";
  }
  return "?";
}

/// One rank's call as 5 + kMetaDims int64 values: collective, dtype, `arg` (the ReduceOp of an
/// all-reduce, the root of a broadcast, 0), numel, ndim, the first 7 sizes, a hash of the others.
/// Shape: [13], int64, on the CPU.
inline at::Tensor encode_collective_meta(const at::Tensor& t, GlooCollective collective, std::int64_t arg) {
  constexpr std::size_t kLen = 5 + kMetaDims;
  auto meta = at::zeros({static_cast<std::int64_t>(kLen)}, at::kLong);
  auto* m = meta.data_ptr<std::int64_t>();
  m[0] = static_cast<std::int64_t>(collective);
  m[1] = static_cast<std::int64_t>(t.scalar_type());
  m[2] = arg;
  m[3] = t.numel();
  m[4] = t.dim();
  std::int64_t tail_hash = 0;
  for (std::int64_t d = 0; d < t.dim(); ++d) {
    if (static_cast<std::size_t>(d) < kMetaDims - 1)
      m[5 + d] = t.size(d);
    else
      tail_hash = tail_hash * 1000003 + t.size(d) + 1;
  }
  m[5 + kMetaDims - 1] = tail_hash;
  return meta;
}

/// A fingerprint as text, e.g. "all_reduce op=sum Float [4x3]" or "broadcast root=1 Long [2x...]".
inline std::string describe_collective_meta(const at::Tensor& meta) {
  const auto* m = meta.data_ptr<std::int64_t>();
  const bool known = m[0] >= 1 && m[0] <= 3;
  const auto collective = static_cast<GlooCollective>(m[0]);
  std::vector<std::int64_t> sizes;
  for (std::int64_t d = 0; d < std::min<std::int64_t>(m[4], kMetaDims - 1); ++d) sizes.push_back(m[5 + d]);
  std::string arg = !known ? std::string()
                    : collective == GlooCollective::all_reduce
                        ? fmt::format(" op={}", to_string(static_cast<ReduceOp>(m[2])))
                    : collective == GlooCollective::broadcast ? fmt::format(" root={}", m[2])
                                                              : std::string();
  return fmt::format("{}{} {} [{}{}]", known ? collective_name(collective) : "?", arg,
                     c10::toString(static_cast<c10::ScalarType>(m[1])), fmt::join(sizes, "x"),
                     m[4] >= static_cast<std::int64_t>(kMetaDims) ? "x..." : "");
}

}  // namespace loom::detail
