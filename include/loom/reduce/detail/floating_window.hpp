// loom/reduce/detail/floating_window.hpp — the reducer's floating arithmetic (the default): each
// bucket is all-reduced in its own dtype (or a compressed wire dtype), divided to the average
// (averaging.hpp) and scanned for inf/NaN as it comes back; the window's one host read gives the
// counts, used-flags, verdicts and squared norm (window_summary.hpp). Models WindowArithmetic.
#pragma once

#include <cstddef>

#include <ATen/ATen.h>

#include <loom/reduce/concepts.hpp>
#include <loom/reduce/detail/averaging.hpp>
#include <loom/reduce/detail/bucket.hpp>
#include <loom/reduce/detail/window_core.hpp>
#include <loom/reduce/detail/window_summary.hpp>

namespace loom::detail {

/// The floating arithmetic's state: the averaging of the open synchronising window.
/// Example: ReducerState holds a FloatingWindow when ReducerOptions::deterministic is false.
class FloatingWindow {
 public:
  /// The buckets carry the window meta's limbs (the first) and range flags (CPU float32/float64).
  static constexpr bool kFloating = true;

  template <class Comm>
  void buckets_allocated(WindowCore<Comm>& /*core*/) {}
  template <class Comm>
  void begin_window(WindowCore<Comm>& /*core*/) {}
  template <class Comm>
  void before_backward(WindowCore<Comm>& /*core*/) {}
  template <class Comm>
  void begin_sync(WindowCore<Comm>& core, const BackwardPlan& plan) {
    average_.begin(core.options.average, core.comm->world_size(), plan.grad_scale);
  }
  template <class Comm>
  void gradient_arrived(WindowCore<Comm>& /*core*/, std::size_t /*k*/) {}
  /// A second gradient after the bucket left is refused in ReducerState (after it reached the slot,
  /// which finish_window then scans): nothing to refuse before.
  template <class Comm>
  void check_not_late(WindowCore<Comm>& /*core*/, std::size_t /*k*/) {}

  /// Divides bucket bi by the part of the divisor known now (WindowAverage::pre_divide: the world
  /// size, a power of two, when averaging by it), writes the used-flags (and the first bucket's
  /// window meta) and starts the all-reduce: the rest of the divisor is applied when it comes back
  /// (WindowAverage::apply), so a hook never waits for the window's count. No host read.
  template <class Comm>
  void launch(WindowCore<Comm>& core, std::size_t bi) {
    auto& b = core.buckets[bi];
    average_.pre_divide(b);
    write_used_flags(b, core.slots, &core.meta_row);
    at::Tensor* target = &b.flat;
    if (b.wire.defined()) {
      // Compressed: divided by the world size while cast (the loss scale stays on the wire); the
      // rest of the average is applied in float32 when the bucket is back.
      at::div_out(b.wire_head, b.head, b.wire_div);
      target = &b.wire;
    }
    core.works[bi] = core.start(*target);
  }

  /// Waits for each bucket in launch order and, while later buckets are still in flight, divides it
  /// to the average and scans it for inf/NaN (the reduced values are identical on every rank, so
  /// every rank reaches the same verdict; a sum that overflowed is caught too); then the window's
  /// one host read: counts, used-flags, verdicts, squared norm.
  template <class Comm>
  ReducedWindow reduce(WindowCore<Comm>& core, bool clip) {
    for (std::size_t bi = 0; bi < core.buckets.size(); ++bi) {
      core.wait_bucket(bi);  // the first one also gives core.meta when it carries it
      LOOM_ASSERT(bi > 0 || !core.carries_meta() || core.meta_ready, "the window meta was not decoded before its use");
      average_.apply(core.buckets[bi], core.meta);
    }
    core.count_host_read();
    ReducedWindow out;
    out.summary = WindowSummary::decode(WindowSummary::gather(core.meta, core.buckets, clip, core.device), core.buckets,
                                        core.slots.size(), clip);
    return out;
  }

  template <class Comm>
  void reattach(WindowCore<Comm>& /*core*/, std::size_t /*k*/) {}

 private:
  WindowAverage average_;
};

}  // namespace loom::detail
