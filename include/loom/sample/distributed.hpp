// loom/sample/distributed.hpp — DistributedSampler: this rank's share of the dataset indices, per epoch.
//
// Conventions are those of torch.utils.data.DistributedSampler (PyTorch 1.13 / 2.x):
//   - num_samples per rank = ceil(N / R); with drop_last and N % R != 0 it is ceil((N - R) / R)
//     (the tail is dropped so every rank gets the same count; 0 when N < R).
//   - The epoch's index list is 0..N-1, or a permutation when shuffling; without drop_last it is
//     padded to num_samples x R by appending its own beginning, repeated as often as needed
//     (N = 3, R = 7: 0 1 2 0 1 2 0); with drop_last it is truncated to num_samples x R.
//   - Rank r takes every R-th entry starting at r: list[r], list[r + R], list[r + 2R], ...
//   - shuffle = false gives exactly PyTorch's indices for the same N, R and rank.
//   - shuffle = true permutes with a generator seeded seed + epoch (set_epoch). loom calls ATen's
//     randperm with a CPU generator seeded seed + epoch, which is what PyTorch's sampler does
//     (torch.randperm(N, generator=g) after g.manual_seed(seed + epoch)), so the permutation equals
//     the Python sampler's when both run the same PyTorch version; ATen has changed randperm's
//     algorithm between releases, so across versions only the conventions (not the permutation)
//     are guaranteed. Every rank computes the same permutation without communicating.
//
// Example:
//   loom::DistributedSampler s({.dataset_size = 10, .num_replicas = 3, .rank = 1, .shuffle = false});
//   s.indices();                    // {1, 4, 7, 0}
//   for (int64_t epoch = 0; epoch < epochs; ++epoch) {
//     s.set_epoch(epoch);            // reshuffles (when shuffle) and rewinds
//     while (auto i = s.next()) train_on(dataset[*i]);
//   }
//
// Units: indices are dataset indices in [0, dataset_size); size() counts indices.
// Throws: loom::InvalidArgument naming the value for dataset_size <= 0 (an empty dataset),
//         num_replicas < 1, rank outside [0, num_replicas), a negative epoch, and a state from a
//         differently configured sampler.
// Source: torch/utils/data/distributed.py (DistributedSampler) conventions; no code copied.
#pragma once

#include <cstdint>
#include <numeric>
#include <optional>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/randperm.h>

#include <loom/comm/communicator.hpp>
#include <loom/error.hpp>
#include <loom/sample/concepts.hpp>

namespace loom {

/// Settings of a DistributedSampler. Use with designated initializers.
struct DistributedSamplerOptions {
  int64_t dataset_size = 0;  ///< N, samples in the dataset (> 0)
  int num_replicas = 1;      ///< R, world size
  int rank = 0;              ///< this rank, in [0, R)
  bool shuffle = true;       ///< permute with seed + epoch
  uint64_t seed = 0;         ///< shared by every rank
  bool drop_last = false;    ///< drop the tail instead of padding so N' = R x num_samples <= N
};

namespace detail {
/// A random permutation of 0..n-1 as torch.randperm(n, generator) with the generator seeded `seed`.
inline std::vector<int64_t> seeded_randperm(int64_t n, uint64_t seed) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const at::Tensor p = at::randperm(n, gen, at::TensorOptions(at::kLong));
  const auto* ptr = static_cast<const int64_t*>(p.data_ptr());
  return {ptr, ptr + n};
}
}  // namespace detail

/// This rank's indices of a dataset, per epoch, with PyTorch's DistributedSampler conventions.
///
/// Example: see the file comment.
/// Shape: indices() has size() entries, each in [0, dataset_size).
/// Throws: see the file comment.
/// Source: torch.utils.data.DistributedSampler (see the file comment).
class DistributedSampler {
 public:
  using value_type = int64_t;
  using state_type = SamplerState;

  explicit DistributedSampler(DistributedSamplerOptions o) : o_(o) {
    if (o_.dataset_size <= 0)
      throw InvalidArgument(
          fmt::format("DistributedSampler: dataset_size = {} (the dataset is empty)", o_.dataset_size));
    if (o_.num_replicas < 1)
      throw InvalidArgument(fmt::format("DistributedSampler: num_replicas = {} must be >= 1", o_.num_replicas));
    if (o_.rank < 0 || o_.rank >= o_.num_replicas)
      throw InvalidArgument(fmt::format("DistributedSampler: rank {} is outside [0, {})", o_.rank, o_.num_replicas));
    const int64_t n = o_.dataset_size, r = o_.num_replicas;
    if (o_.drop_last && n % r != 0)
      num_samples_ = n >= r ? (n - r + r - 1) / r : 0;  // ceil((N - R) / R)
    else
      num_samples_ = (n + r - 1) / r;
  }

  /// Uses the communicator's rank and world size (overriding those in `o`).
  template <Communicator C>
  static DistributedSampler for_communicator(const C& comm, DistributedSamplerOptions o) {
    o.num_replicas = comm.world_size();
    o.rank = comm.rank();
    return DistributedSampler(o);
  }

  /// Selects the epoch (the shuffle seed is seed + epoch) and rewinds to its first index.
  void set_epoch(int64_t epoch) {
    if (epoch < 0) throw InvalidArgument(fmt::format("DistributedSampler: epoch {} is negative", epoch));
    epoch_ = epoch;
    position_ = 0;
    cached_epoch_.reset();
  }

  /// Indices this rank yields per epoch (num_samples in PyTorch).
  [[nodiscard]] int64_t size() const noexcept { return num_samples_; }
  /// Indices all ranks yield together per epoch (total_size in PyTorch).
  [[nodiscard]] int64_t total_size() const noexcept { return num_samples_ * o_.num_replicas; }
  [[nodiscard]] int64_t epoch() const noexcept { return epoch_; }
  [[nodiscard]] const DistributedSamplerOptions& options() const noexcept { return o_; }

  /// The next index of this epoch, or nullopt at its end.
  std::optional<int64_t> next() {
    if (position_ >= num_samples_) return std::nullopt;
    ensure_epoch();
    return indices_[static_cast<std::size_t>(position_++)];
  }

  /// This rank's whole index list for the current epoch (independent of the position).
  [[nodiscard]] const std::vector<int64_t>& indices() {
    ensure_epoch();
    return indices_;
  }

  /// The epoch's index list over all ranks (total_size() entries, padded or truncated), before sharding.
  [[nodiscard]] std::vector<int64_t> global_indices() const {
    std::vector<int64_t> list;
    if (o_.shuffle) {
      list = detail::seeded_randperm(o_.dataset_size, o_.seed + static_cast<uint64_t>(epoch_));
    } else {
      list.resize(static_cast<std::size_t>(o_.dataset_size));
      std::iota(list.begin(), list.end(), int64_t{0});
    }
    const auto total = static_cast<std::size_t>(total_size());
    if (total <= list.size()) {
      list.resize(total);
    } else {
      const std::size_t n = list.size();
      for (std::size_t i = n; i < total; ++i) list.push_back(list[i % n]);  // wraps, repeating as often as needed
    }
    return list;
  }

  [[nodiscard]] SamplerState state() const {
    SamplerState s = identity();
    s.epoch = epoch_;
    s.position = position_;
    return s;
  }

  /// Resumes at the saved epoch and position. Throws loom::InvalidArgument for a state of another configuration.
  void load_state(const SamplerState& st) {
    detail::check_state_matches(st, identity(), num_samples_, "DistributedSampler");
    set_epoch(st.epoch);
    position_ = st.position;
  }

 private:
  SamplerState identity() const {
    detail::Fingerprint f;
    f.add(o_.shuffle ? 1 : 0);
    f.add(o_.drop_last ? 1 : 0);
    SamplerState s;
    s.seed = o_.seed;
    s.dataset_size = o_.dataset_size;
    s.num_replicas = o_.num_replicas;
    s.rank = o_.rank;
    s.fingerprint = f.h;
    return s;
  }

  void ensure_epoch() {
    if (cached_epoch_ == epoch_) return;
    const std::vector<int64_t> list = global_indices();
    indices_.clear();
    indices_.reserve(static_cast<std::size_t>(num_samples_));
    for (std::size_t i = static_cast<std::size_t>(o_.rank); i < list.size();
         i += static_cast<std::size_t>(o_.num_replicas))
      indices_.push_back(list[i]);
    LOOM_ASSERT(static_cast<int64_t>(indices_.size()) == num_samples_);
    cached_epoch_ = epoch_;
  }

  DistributedSamplerOptions o_;
  int64_t num_samples_ = 0;
  int64_t epoch_ = 0;
  int64_t position_ = 0;
  std::optional<int64_t> cached_epoch_;
  std::vector<int64_t> indices_;
};

static_assert(ResumableSampler<DistributedSampler>);

}  // namespace loom
