// loom/reduce/detail/window_summary.hpp — what the ranks tell each other about a synchronising
// window, decoded here:
// - the window meta (window_meta.hpp), one int64 row per rank, summed over the ranks in the first
//   bucket's all-reduce or (deterministic mode, or a first bucket too narrow) an all-reduce of its own;
// - the window summary, the one host read of finish_window: the summed meta, then per bucket its
//   used-flags (summed over ranks) and its inf/NaN verdict, then (clipping) the squared global norm.
//
// Shape: meta int64 [WindowMeta::kLength] on the communicator's device; summary float64 on the host.
// Units: samples; loss divisors are the BackwardPlan's (dimensionless integers).
// Errors: check_backward_plan throws loom::InvalidArgument naming the bad field and value.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <fmt/format.h>

#include <loom/error.hpp>
#include <loom/reduce/concepts.hpp>
#include <loom/reduce/detail/bucket.hpp>
#include <loom/reduce/detail/host_path.hpp>
#include <loom/reduce/detail/scale.hpp>
#include <loom/reduce/detail/window_meta.hpp>

namespace loom::detail {

/// 2^53: integers up to this are exact in a float64 (the summary is read as float64).
inline constexpr double kExactInDouble = 9007199254740992.0;

/// Throws loom::InvalidArgument for a plan no window may take on `world_size` ranks: final or leaving
/// without sync, negative samples, a grad_scale that is not finite and > 0, a loss divisor outside
/// [0, kMaxLossDivisor], or one whose square summed over the ranks would not stay exact.
inline void check_backward_plan(const BackwardPlan& plan, int world_size) {
  if (plan.final && !plan.sync) throw InvalidArgument("Reducer::prepare_backward: final = true needs sync = true");
  if (plan.leaving && !plan.sync) throw InvalidArgument("Reducer::prepare_backward: leaving = true needs sync = true");
  if (plan.window_samples < 0)
    throw InvalidArgument(
        fmt::format("Reducer::prepare_backward: window_samples = {} (must be >= 0)", plan.window_samples));
  if (!std::isfinite(plan.grad_scale) || plan.grad_scale <= 0)
    throw InvalidArgument(
        fmt::format("Reducer::prepare_backward: grad_scale = {} (must be finite and > 0)", plan.grad_scale));
  if (plan.loss_divisor < 0 || plan.loss_divisor > kMaxLossDivisor)
    throw InvalidArgument(fmt::format("Reducer::prepare_backward: loss_divisor = {} (must be in [0, {}])",
                                      plan.loss_divisor, kMaxLossDivisor));
  if (static_cast<double>(world_size) * static_cast<double>(plan.loss_divisor) *
          static_cast<double>(plan.loss_divisor) >
      kExactInDouble)
    throw InvalidArgument(fmt::format(
        "Reducer::prepare_backward: loss_divisor = {} on {} ranks: the check that every rank uses the same divisor "
        "sums their squares, which must stay below 2^53 (use a divisor <= {})",
        plan.loss_divisor, world_size, static_cast<std::int64_t>(std::sqrt(kExactInDouble / world_size))));
}

/// The window meta summed over the ranks, decoded.
struct WindowCounts {
  std::int64_t samples = 0;              ///< the window's samples on all ranks
  std::int64_t final_ranks = 0;          ///< ranks in their end-of-epoch flush
  std::int64_t leaving_ranks = 0;        ///< ranks leaving their loop
  std::int64_t divisor_sum = 0;          ///< sum of the voters' loss divisors
  std::int64_t divisor_squares = 0;      ///< sum of their squares
  std::int64_t voters = 0;               ///< ranks that gave a loss divisor
  std::int64_t fingerprint_sum = 0;      ///< sum of the ranks' fingerprints
  std::int64_t fingerprint_squares = 0;  ///< sum of their squares
  std::int64_t fingerprinted = 0;        ///< ranks that sent a fingerprint (a flight recorder)
  std::int64_t replica_sum = 0;          ///< sum of the ranks' replica fingerprints
  std::int64_t replica_squares = 0;      ///< sum of their squares
  std::int64_t replica_voters = 0;       ///< ranks that sent one (Reducer::compare_replicas)

  /// From the summed row (int64 or float64 values, exact).
  template <class T>
  static WindowCounts decode(const T* row) {
    auto at = [&](WindowMeta::Field f) { return static_cast<std::int64_t>(row[f]); };
    return {at(WindowMeta::samples),         at(WindowMeta::final_ranks),         at(WindowMeta::leaving_ranks),
            at(WindowMeta::divisor_sum),     at(WindowMeta::divisor_squares),     at(WindowMeta::voters),
            at(WindowMeta::fingerprint_sum), at(WindowMeta::fingerprint_squares), at(WindowMeta::fingerprinted),
            at(WindowMeta::replica_sum),     at(WindowMeta::replica_squares),     at(WindowMeta::replica_voters)};
  }

  /// Whether the ranks that sent a replica fingerprint sent different ones: n * sum g^2 - (sum g)^2
  /// is the sum over pairs of (g_r - g_s)^2, zero only when all are equal; the same verdict on
  /// every rank.
  [[nodiscard]] bool replicas_differ() const {
    __extension__ typedef __int128 Wide;
    return static_cast<Wide>(replica_voters) * static_cast<Wide>(replica_squares) !=
           static_cast<Wide>(replica_sum) * static_cast<Wide>(replica_sum);
  }

  /// Whether some rank's fingerprint differs from `mine` on `world_size` ranks (see WindowMeta). Only
  /// checked when every rank sent one (a rank without a flight recorder makes the check moot). The
  /// sums are exact while world_size * 2^40 < 2^53 (world sizes up to 8192); larger jobs are not checked.
  [[nodiscard]] bool fingerprints_differ(std::int64_t mine, int world_size) const {
    if (world_size > 8192 || fingerprinted != world_size) return false;
    return fingerprint_squares - 2 * mine * fingerprint_sum + static_cast<std::int64_t>(world_size) * mine * mine != 0;
  }

  /// Whether the voters' loss divisors d_r differ: n * sum d^2 - (sum d)^2 = sum over pairs of
  /// (d_r - d_s)^2, zero only when all are equal.
  [[nodiscard]] bool divisors_differ() const {
    __extension__ typedef __int128 Wide;  // (sum d)^2 needs up to 66 bits
    return static_cast<Wide>(voters) * static_cast<Wide>(divisor_squares) !=
           static_cast<Wide>(divisor_sum) * static_cast<Wide>(divisor_sum);
  }

  /// The voters' mean loss divisor (1 when nobody voted).
  [[nodiscard]] double mean_divisor() const {
    return voters > 0 ? static_cast<double>(divisor_sum) / static_cast<double>(voters) : 1.0;
  }
};

/// The window summary: gathered on each rank by `gather` (one counted host read), decoded by `decode`.
struct WindowSummary {
  WindowCounts counts;
  std::vector<char> used;              ///< per slot: a gradient arrived on some rank
  bool non_finite = false;             ///< some reduced bucket holds inf/NaN
  std::optional<double> squared_norm;  ///< the squared global norm (clipping only)

  /// The summary's values as float64 on the host: a device-to-host copy of one small tensor, or
  /// direct reads of host memory when `meta` and every bucket live there. `clip`: append the squared
  /// global norm of the buckets' heads. `device`: where the communicator's collectives run.
  static std::vector<double> gather(const at::Tensor& meta, const std::vector<GradBucket>& buckets, bool clip,
                                    c10::Device device) {
    const bool host = on_host(meta) &&
                      std::all_of(buckets.begin(), buckets.end(), [](const GradBucket& b) { return on_host(b.flat); });
    std::vector<double> out;
    if (host) {
      const auto* m = meta.data_ptr<std::int64_t>();
      out.assign(m, m + WindowMeta::kLength);
      double sumsq = 0;
      for (const auto& b : buckets) {
        const at::Tensor& tail = b.wire.defined() ? b.wire_tail : b.tail;
        AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, tail.scalar_type(), "loom_read_tail", [&] {
          const auto* t = tail.data_ptr<scalar_t>();
          for (std::int64_t j = 0; j < tail.numel(); ++j) out.push_back(static_cast<double>(t[j]));
        });
        out.push_back(b.bad_host ? 1.0 : 0.0);
        if (clip) {
          const double norm = at::norm(b.head, 2, compute_dtype(b.head.scalar_type())).template item<double>();
          sumsq += norm * norm;
        }
      }
      if (clip) out.push_back(sumsq);
      return out;
    }
    std::vector<at::Tensor> pieces{meta.to(at::kDouble)};
    std::vector<at::Tensor> norms;
    for (const auto& b : buckets) {
      pieces.push_back((b.wire.defined() ? b.wire_tail : b.tail).to(device, at::kDouble));
      pieces.push_back(b.bad.to(device, at::kDouble));
      if (clip)
        norms.push_back(at::norm(b.head, 2, compute_dtype(b.head.scalar_type())).to(device, at::kDouble).reshape({1}));
    }
    if (clip) pieces.push_back(at::cat(norms).square().sum().reshape({1}));
    const at::Tensor summary = at::cat(pieces).to(at::kCPU);
    const auto* d = summary.data_ptr<double>();
    out.assign(d, d + summary.numel());
    return out;
  }

  /// Decodes `values` (from gather with the same `buckets` and `clip`) for `num_slots` gradient slots.
  static WindowSummary decode(const std::vector<double>& values, const std::vector<GradBucket>& buckets,
                              std::size_t num_slots, bool clip) {
    WindowSummary s;
    const double* v = values.data();
    s.counts = WindowCounts::decode(v);
    s.used.assign(num_slots, 0);
    std::size_t pos = WindowMeta::kLength;
    for (const auto& b : buckets) {
      for (std::size_t j = 0; j < b.slots.size(); ++j) s.used[b.slots[j]] = v[pos + j] > 0 ? 1 : 0;
      pos += b.slots.size();
      if (v[pos++] != 0) s.non_finite = true;  // the scan of the reduced bucket
    }
    if (clip) s.squared_norm = v[pos++];
    LOOM_ASSERT(pos == values.size(), "window summary of unexpected length");
    return s;
  }
};

}  // namespace loom::detail
