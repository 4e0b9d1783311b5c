// loom/log/named_metrics.hpp — Metrics: sample-weighted means by name, reduced over ranks with one
// collective for all names, whatever order (or subset) of names each rank added.
//
// Example:
//   loom::Metrics metrics(pg);
//   metrics.add("loss", loss, batch);             // the batch's mean loss, weighted by its samples
//   metrics.add("accuracy", correct / n, n);      // doubles: a mean and its weight
//   double epoch_loss = metrics.mean("loss");     // every rank, after the loop: one all_gather
//
// Collective: the first mean()/means()/weight(), on every rank at the same point (after the loop,
// never in its body): one all_gather of capacity x 4 float64 numbers, one host read.
// Guide: docs/log.md#metrics-sample-weighted-means-by-name-named_metricshpp.
// Source: torchmetrics' MeanMetric (sum and weight states) keyed by name, like a
//         MetricCollection; weights as Keras' sample_weight.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <loom/collate/batch.hpp>
#include <loom/comm/communicator.hpp>
#include <loom/detail/hash.hpp>
#include <loom/error.hpp>
#include <loom/trace/recorder.hpp>

namespace loom {

/// Options of Metrics.
struct MetricsOptions {
  std::size_t capacity = 64;  ///< names one rank may add (the size of the exchanged table)
};

/// Sample-weighted means by name over all ranks, matched by a 64-bit hash of the name; one Metrics
/// covers one period (an epoch).
///
/// Example: `metrics.add("loss", loss, batch); ... double l = metrics.mean("loss");`
/// Shape: values are one-element tensors (the batch mean) or doubles. Units: weights in samples.
/// Throws: loom::InvalidArgument for more names than MetricsOptions::capacity on one rank, two names
///         with the same hash on one rank, a name no rank added, a negative or non-finite weight,
///         a value that is not a one-element tensor; loom::Error for add() after the reduction;
///         the communicator's errors.
/// Source: torchmetrics' MeanMetric keyed by name, like a MetricCollection.
template <Communicator Comm>
class Metrics {
 public:
  explicit Metrics(Comm& comm, MetricsOptions options = {}) : comm_(&comm), options_(options) {
    if (options_.capacity == 0) throw InvalidArgument("Metrics: capacity = 0 (need room for at least one name)");
  }

  /// Adds `mean_value` (the mean over `weight` samples) to metric `name`. Throws: loom::InvalidArgument
  /// for a negative or non-finite weight, loom::Error after the reduction.
  void add(std::string_view name, double mean_value, double weight) {
    Entry& e = entry(name, weight);
    e.host_sum += mean_value * weight;
    e.weight += weight;
  }

  /// Adds a batch's mean value (a one-element tensor, e.g. the loss) weighted by the batch's real
  /// samples (0 for a repeated batch). The sum stays on the tensor's device: no host read here.
  void add(std::string_view name, const at::Tensor& mean_value, const Batch& batch) {
    if (!mean_value.defined() || mean_value.numel() != 1)
      throw InvalidArgument(
          fmt::format("Metrics::add('{}'): the value must be a one-element tensor (the batch mean), got {}", name,
                      mean_value.defined() ? fmt::format("{} elements", mean_value.numel()) : "an undefined tensor"));
    const auto weight = static_cast<double>(batch.counted_samples());
    Entry& e = entry(name, weight);
    at::Tensor term = mean_value.detach().reshape({1}).to(at::kDouble) * weight;
    e.device_sum = e.device_sum.defined() ? e.device_sum + term : term;
    e.weight += weight;
  }

  /// The mean of `name` over every rank's samples. The first call of mean/means/weight reduces
  /// (a collective: every rank calls it at the same point). Throws: loom::InvalidArgument when no
  /// rank added `name`.
  [[nodiscard]] double mean(std::string_view name) {
    const Total& t = total(name);
    return t.weight == 0 ? std::numeric_limits<double>::quiet_NaN() : t.sum / t.weight;
  }

  /// Total weight (samples) of `name` over every rank. Collective on first use, as mean().
  [[nodiscard]] double weight(std::string_view name) { return total(name).weight; }

  /// The means of every name this rank added, by name. Collective on first use, as mean().
  [[nodiscard]] std::map<std::string, double> means() {
    reduce();
    std::map<std::string, double> out;
    for (const auto& [name, e] : entries_) out[name] = mean(name);
    return out;
  }

 private:
  struct Entry {
    uint64_t hash = 0;
    double host_sum = 0;
    at::Tensor device_sum;  // float64 [1] on the value's device, or undefined
    double weight = 0;
  };
  struct Total {
    double sum = 0;
    double weight = 0;
  };

  Entry& entry(std::string_view name, double weight) {
    if (reduced_)
      throw Error(
          fmt::format("Metrics::add('{}'): these metrics were already reduced (mean() was called); create a new "
                      "Metrics for the next period",
                      name));
    if (!std::isfinite(weight) || weight < 0)
      throw InvalidArgument(fmt::format("Metrics::add('{}'): weight {} is negative or not finite", name, weight));
    auto it = entries_.find(std::string(name));
    if (it != entries_.end()) return it->second;
    if (entries_.size() >= options_.capacity)
      throw InvalidArgument(
          fmt::format("Metrics::add('{}'): more than {} names (MetricsOptions::capacity)", name, options_.capacity));
    const uint64_t h = detail::fnv1a(name);
    for (const auto& [other, e] : entries_)
      if (e.hash == h)
        throw InvalidArgument(fmt::format("Metrics: names '{}' and '{}' have the same hash; rename one", other, name));
    Entry& e = entries_[std::string(name)];
    e.hash = h;
    return e;
  }

  const Total& total(std::string_view name) {
    reduce();
    auto it = totals_.find(detail::fnv1a(name));
    if (it == totals_.end())
      throw InvalidArgument(fmt::format("Metrics::mean: no rank added a metric named '{}'", name));
    return it->second;
  }

  // Table row: hash high 32 bits, hash low 32 bits, weighted sum, weight (float64 each; a row of
  // zeros with weight -1 is empty).
  void reduce() {
    if (reduced_) return;
    reduced_ = true;
    const auto cap = static_cast<int64_t>(options_.capacity);
    const auto device = comm_->device();
    at::Tensor host = at::zeros({cap, 4}, at::kDouble);
    auto* h = host.data_ptr<double>();
    for (int64_t k = 0; k < cap; ++k) h[4 * k + 3] = -1;
    std::vector<at::Tensor> sums;
    int64_t k = 0;
    for (const auto& [name, e] : entries_) {
      h[4 * k] = static_cast<double>(e.hash >> 32);
      h[4 * k + 1] = static_cast<double>(e.hash & 0xffffffffULL);
      h[4 * k + 2] = e.host_sum;
      h[4 * k + 3] = e.weight;
      ++k;
    }
    at::Tensor table = host.to(device);
    k = 0;
    for (const auto& [name, e] : entries_) {
      if (e.device_sum.defined()) table[k][2] += e.device_sum.to(device).squeeze();
      ++k;
    }
    trace::Scope scope(*comm_, trace::Context::metrics);
    const std::vector<at::Tensor> all = comm_->all_gather(table);
    const at::Tensor gathered = at::cat(all).to(at::kCPU);  // the one host read
    const auto* g = gathered.data_ptr<double>();
    for (int64_t row = 0; row < gathered.size(0); ++row) {
      if (g[4 * row + 3] < 0) continue;
      const uint64_t hash = (static_cast<uint64_t>(g[4 * row]) << 32) | static_cast<uint64_t>(g[4 * row + 1]);
      Total& t = totals_[hash];
      t.sum += g[4 * row + 2];
      t.weight += g[4 * row + 3];
    }
  }

  Comm* comm_;
  MetricsOptions options_;
  std::map<std::string, Entry, std::less<>> entries_;
  std::map<uint64_t, Total> totals_;
  bool reduced_ = false;
};

}  // namespace loom
