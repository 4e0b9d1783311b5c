// loom/reduce/detail/bucket_order.hpp — the order in which a reducer's gradient slots fill its
// buckets: reverse parameter order at first, then (ReducerOptions::rebuild_buckets) once the order
// in which rank 0's gradients arrived during the first synchronising window.
//
// Shape: positions are int64 [number of slots]: the rank of each slot's first gradient, -1 for none.
// Source: PyTorch DDP's Reducer rebuilds its buckets once, after the first iteration, in the order
//         its autograd hooks fired on rank 0 (broadcast so every rank builds the same buckets).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include <ATen/ATen.h>

#include <loom/reduce/buckets.hpp>
#include <loom/reduce/detail/bucket.hpp>

namespace loom::detail {

/// The slots' launch order and its one rebuild from recorded ready positions.
class BucketOrder {
 public:
  /// fixed: never rebuilt; recording: gradients' first arrivals are numbered; pending: a
  /// synchronising window closed while recording, so the next window starts with rebuild; rebuilt:
  /// done (recording stops).
  enum class Phase { fixed, recording, pending, rebuilt };

  /// Reverse slot order (the order in which backward usually produces gradients); recording
  /// when `rebuild`.
  BucketOrder(std::size_t num_slots, bool rebuild)
      : order_(reverse_order(num_slots)), phase_(rebuild ? Phase::recording : Phase::fixed) {}

  [[nodiscard]] const std::vector<std::size_t>& order() const noexcept { return order_; }
  [[nodiscard]] Phase phase() const noexcept { return phase_; }

  /// A gradient of `s` arrived: numbers its first arrival while recording.
  void record(GradSlot& s) {
    if ((phase_ == Phase::recording || phase_ == Phase::pending) && s.ready_pos < 0) s.ready_pos = next_pos_++;
  }

  /// A synchronising window closed: a recording becomes due for rebuild.
  void window_closed() noexcept {
    if (phase_ == Phase::recording) phase_ = Phase::pending;
  }

  /// This rank's recorded positions (int64 [slots.size()] on the CPU, -1: no gradient), which are
  /// then cleared for the next recording.
  at::Tensor take_positions(std::vector<GradSlot>& slots) {
    auto positions = at::empty({static_cast<std::int64_t>(slots.size())}, at::kLong);
    auto* p = positions.data_ptr<std::int64_t>();
    for (std::size_t k = 0; k < slots.size(); ++k) {
      p[k] = slots[k].ready_pos;
      slots[k].ready_pos = -1;
    }
    next_pos_ = 0;
    return positions;
  }

  /// Adopts rank 0's `positions` (contiguous int64 CPU [number of slots]): slots by first arrival;
  /// slots without a gradient after them; ties in the current order. Returns false, and goes on
  /// recording, when rank 0 recorded no gradient at all.
  bool adopt(const at::Tensor& positions) {
    const auto n = static_cast<std::int64_t>(order_.size());
    const auto* o = positions.data_ptr<std::int64_t>();
    if (std::none_of(o, o + n, [](std::int64_t v) { return v >= 0; })) {
      phase_ = Phase::recording;
      return false;
    }
    std::vector<std::size_t> position(order_.size());
    for (std::size_t p = 0; p < order_.size(); ++p) position[order_[p]] = p;
    std::stable_sort(order_.begin(), order_.end(), [&](std::size_t a, std::size_t b) {
      const auto pa = o[a] < 0 ? n : o[a], pb = o[b] < 0 ? n : o[b];
      return pa != pb ? pa < pb : position[a] < position[b];
    });
    phase_ = Phase::rebuilt;
    return true;
  }

 private:
  std::vector<std::size_t> order_;  // launch order of slots
  Phase phase_;
  std::int64_t next_pos_ = 0;
};

}  // namespace loom::detail
