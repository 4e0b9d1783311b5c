// loom/log/metrics.hpp — metrics averaged over ranks the right way: a weighted mean (e.g. loss
// weighted by samples) accumulated locally and reduced over all ranks with one collective.
//
// Example:
//   loom::WeightedMean loss;
//   for (auto& batch : loader) loss.add(batch_loss, batch.num_samples);   // local, no communication
//   double epoch_loss = loom::global_mean(comm, loss);                     // every rank, same point
//   log.info("epoch {} loss {:.7f}", epoch, epoch_loss);                   // printed by rank 0
//
// Collectives: global_mean / global_means are issued by every rank at the same point (one
// float64 all_reduce of 2 numbers per metric); never call them from rank 0 alone.
// Units: weights are counts (samples, tokens) or any non-negative float; sums exact up to 2^53.
// Guide (why weighted, the field cases): docs/log.md#weightedmean-and-global_mean-metricshpp.
// Source: the sample-weighted epoch metric of torchmetrics' MeanMetric / Keras' Mean with
//         sample_weight, reduced as (sum, count) pairs like torchmetrics' "sum" states.
#pragma once

#include <cmath>
#include <cstddef>
#include <span>
#include <vector>

#include <fmt/format.h>

#include <loom/comm/communicator.hpp>
#include <loom/comm/host_values.hpp>
#include <loom/error.hpp>
#include <loom/trace/recorder.hpp>

namespace loom {

/// A running weighted mean of per-batch values on one rank: sum(value * weight) / sum(weight).
///
/// Example:
///   loom::WeightedMean m;
///   m.add(0.7, 256); m.add(0.8, 256); m.add(0.9, 10);
///   m.local_mean();   // 393.0 / 522.0 = 0.7528736...
///
/// Units: `weight` in the caller's unit (samples); `value` is the mean over those samples.
/// Throws: loom::InvalidArgument for a negative or non-finite weight (naming it); a NaN value is
///         accepted and makes the mean NaN (a diverged loss should be seen, not hidden).
class WeightedMean {
 public:
  /// Adds a value observed over `weight` samples (default 1: an unweighted mean).
  void add(double value, double weight = 1.0) {
    if (!std::isfinite(weight) || weight < 0.0)
      throw InvalidArgument(
          fmt::format("WeightedMean::add: weight {} is negative or not finite (value {})", weight, value));
    weighted_sum_ += value * weight;
    weight_ += weight;
  }

  /// sum(value * weight) on this rank.
  [[nodiscard]] double weighted_sum() const noexcept { return weighted_sum_; }
  /// sum(weight) on this rank.
  [[nodiscard]] double weight() const noexcept { return weight_; }

  /// This rank's mean. Throws loom::InvalidArgument when no weight was added.
  [[nodiscard]] double local_mean() const {
    if (weight_ == 0.0) throw InvalidArgument("WeightedMean::local_mean: no weight was added (total weight 0)");
    return weighted_sum_ / weight_;
  }

  void reset() noexcept { weighted_sum_ = 0.0, weight_ = 0.0; }

 private:
  double weighted_sum_ = 0.0;
  double weight_ = 0.0;
};

/// The means over all ranks of several metrics, with one all_reduce of 2 * metrics.size() float64.
/// A collective: every rank passes the same number of metrics, in the same order.
///
/// Example:
///   std::array metrics{loss, accuracy};                 // two WeightedMean
///   auto means = loom::global_means(comm, metrics);     // means[0]: loss, means[1]: accuracy
/// Throws: loom::InvalidArgument naming the metric index when its total weight over all ranks is 0
///         (every rank sees the same totals, so every rank throws: nobody hangs); what the
///         communicator throws.
template <Communicator C>
[[nodiscard]] std::vector<double> global_means(C& comm, std::span<const WeightedMean> metrics) {
  if (metrics.empty()) return {};
  std::vector<double> packed;
  packed.reserve(2 * metrics.size());
  for (const auto& m : metrics) {
    packed.push_back(m.weighted_sum());
    packed.push_back(m.weight());
  }
  trace::Scope scope(comm, trace::Context::metrics);
  const std::vector<double> sums = detail::all_reduce_sums(comm, packed);
  std::vector<double> means(metrics.size());
  for (std::size_t i = 0; i < metrics.size(); ++i) {
    if (sums[2 * i + 1] == 0.0)
      throw InvalidArgument(
          fmt::format("global_means: metric {} has total weight 0 over {} rank(s)", i, comm.world_size()));
    means[i] = sums[2 * i] / sums[2 * i + 1];
  }
  return means;
}

/// The mean over all ranks of one metric: sum over ranks of weighted sums / sum of weights.
/// One all_reduce of two float64; a collective (every rank, same point).
///
/// Example (2 ranks): rank 0 adds (1.0, 3), rank 1 adds (1.0, 2) -> 1.0 on both ranks, exactly.
/// Throws: as global_means.
template <Communicator C>
[[nodiscard]] double global_mean(C& comm, const WeightedMean& metric) {
  return global_means(comm, std::span<const WeightedMean>(&metric, 1))[0];
}

}  // namespace loom
