// loom/reduce/detail/grid_window.hpp — the reducer's integer arithmetic
// (ReducerOptions::deterministic): each micro-batch's gradient goes on its parameter's grid as
// int64 (exact.hpp; grid_aten.hpp off the host), the integer buckets are all-reduced (on the CPU
// over the int32 wire when every value fits it), and the sums come back to floating point once per
// window (grid_reduce.hpp). Models WindowArithmetic.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <fmt/format.h>

#include <loom/error.hpp>
#include <loom/reduce/concepts.hpp>
#include <loom/reduce/detail/bucket.hpp>
#include <loom/reduce/detail/exact.hpp>
#include <loom/reduce/detail/grid_aten.hpp>
#include <loom/reduce/detail/grid_reduce.hpp>
#include <loom/reduce/detail/host_path.hpp>
#include <loom/reduce/detail/reducer_checks.hpp>
#include <loom/reduce/detail/scale.hpp>
#include <loom/reduce/detail/window_core.hpp>

namespace loom::detail {

/// The integer arithmetic's state: every slot's grid and every bucket's integers.
/// Example: ReducerState holds a GridWindow when ReducerOptions::deterministic is true.
class GridWindow {
 public:
  /// The buckets carry neither the window meta (it goes on its own all-reduce) nor range flags.
  static constexpr bool kFloating = false;

  /// `num_slots`: the reducer's trainable parameters. Warns (rank 0) when more than one intra-op
  /// thread makes the local floating sums order-dependent.
  GridWindow(std::size_t num_slots, int rank) : slots_(num_slots) { warn_threads(at::get_num_threads(), rank); }

  template <class Comm>
  void buckets_allocated(WindowCore<Comm>& core) {
    buckets_.assign(core.buckets.size(), GridBuffers{});
    for (std::size_t bi = 0; bi < core.buckets.size(); ++bi) {
      const auto& b = core.buckets[bi];
      auto& q = buckets_[bi];
      const auto n = static_cast<std::int64_t>(b.slots.size());
      const auto opts = b.flat.options().dtype(at::kLong);
      q.flat = at::zeros({b.head.numel() + GridTail::length(n)}, opts);
      q.head = q.flat.narrow(0, 0, b.head.numel());
      q.tail = q.flat.narrow(0, b.head.numel(), GridTail::length(n));
      if (!on_host(b.flat)) {
        q.staging = at::empty({2 * n}, at::TensorOptions().dtype(at::kLong).pinned_memory(b.flat.is_cuda()));
        std::vector<std::int64_t> lengths;
        for (std::size_t k : b.slots) lengths.push_back(core.param(k).numel());
        q.lengths = at::tensor(lengths, at::kLong).to(b.flat.device());
      }
      if (has_fused_scan(b.flat)) q.wire = at::empty({q.flat.numel() + 1}, opts.dtype(at::kInt));
    }
  }

  /// A slot's integers are written by its first contribution (or zeroed when it leaves without
  /// one): only the tail and the ATen path's buckets need zeros here.
  template <class Comm>
  void begin_window(WindowCore<Comm>& core) {
    for (auto& q : buckets_) (q.wire.defined() ? q.tail : q.flat).zero_();
    for (std::size_t k = 0; k < slots_.size(); ++k) {
      reattach(core, k);  // a window that ended in an error
      auto& s = slots_[k];
      s.contributions = 0;
      s.pending = false;
      s.sums = false;
    }
  }

  /// The previous micro-batch's gradients go on the grid before this one adds to them.
  template <class Comm>
  void before_backward(WindowCore<Comm>& core) {
    for (std::size_t k = 0; k < slots_.size(); ++k) {
      GradSlot& s = core.slots[k];
      if (!slots_[k].pending) continue;
      auto& g = core.param(k).mutable_grad();
      if (!core.buckets[s.bucket].main && g.defined() && !aliases(g, s.view)) {  // replaced by hand since: it counts
        s.view.copy_(g);
        g = s.view;
      }
    }
    for (std::size_t bi = 0; bi < buckets_.size(); ++bi) quantize_pending(core, bi);
  }

  template <class Comm>
  void begin_sync(WindowCore<Comm>& /*core*/, const BackwardPlan& /*plan*/) {}

  /// The slot collects this micro-batch's gradients (autograd adds a second one in place) and goes
  /// on the grid once, at the next prepare_backward or when its bucket leaves.
  template <class Comm>
  void gradient_arrived(WindowCore<Comm>& core, std::size_t k) {
    if (core.window != WindowState::closed) slots_[k].pending = true;
  }

  /// Refuses a gradient of slot k that arrives in the synchronising backward after its bucket left
  /// (before it touches the integers in flight). Throws: loom::InvalidArgument naming the parameter.
  template <class Comm>
  void check_not_late(WindowCore<Comm>& core, std::size_t k) {
    const GradSlot& s = core.slots[k];
    if (core.synchronising() && s.fired && core.buckets[s.bucket].launched)
      throw InvalidArgument(core.late_gradient_message(s));
  }

  /// Starts bucket bi's integer all-reduce: on the CPU the int32 wire when this rank's integers fit
  /// it (its last element tells every rank whether some rank's did not; then reduce() sends the
  /// bucket again as int64). A slot with this micro-batch's gradient goes onto the wire from the
  /// floating slot (plus its earlier sums), leaving both as they are for that resend.
  template <class Comm>
  void launch(WindowCore<Comm>& core, std::size_t bi) {
    GradBucket& b = core.buckets[bi];
    auto& q = buckets_[bi];
    if (!q.wire.defined()) {
      quantize_pending(core, bi);
      write_tail(core, bi);
      core.works[bi] = core.start(q.flat);
      return;
    }
    const std::int64_t len = q.flat.numel(), tail = GridTail::length(static_cast<std::int64_t>(b.slots.size()));
    const std::int64_t limit = wire_limit(core.comm->world_size());
    auto* w = q.wire.data_ptr<std::int32_t>();
    auto* sums = q.flat.data_ptr<std::int64_t>();
    bool fits = true;
    for (std::size_t k : b.slots) {
      GradSlot& s = core.slots[k];
      auto& gs = slots_[k];
      const std::int64_t numel = core.param(k).numel();
      if (gs.pending) {
        ++gs.contributions;
        GridFlags f;
        AT_DISPATCH_FLOATING_TYPES(b.flat.scalar_type(), "loom_grid_wire", [&] {
          f = quantize_to_wire_cpu(b.flat.data_ptr<scalar_t>() + s.offset, gs.sums ? sums + s.offset : nullptr,
                                   w + s.offset, numel, gs.exponent, limit);
        });
        note_flags(q, static_cast<std::int64_t>(b.slots.size()), s, f);
        fits = fits && !f.wide;
        // The slot is the source of an int64 resend: a gradient arriving after the bucket left
        // (refused by check_not_late) must not reach it, so .grad() leaves the slot until the
        // window ends.
        auto& g = core.param(k).mutable_grad();
        if (!b.main && g.defined() && aliases(g, s.view)) {
          g.reset();
          gs.detached = true;
        }
      } else if (gs.sums) {
        fits = narrow_to_wire_cpu(sums + s.offset, w + s.offset, numel, limit) && fits;
      } else {
        std::fill(w + s.offset, w + s.offset + numel, std::int32_t{0});
      }
    }
    write_tail(core, bi);
    fits = narrow_to_wire_cpu(sums + (len - tail), w + (len - tail), tail, limit) && fits;
    w[len] = fits ? 0 : 1;
    core.works[bi] = core.start(q.wire);
  }

  /// Waits for every integer bucket and turns it back into the floating bucket; decides the
  /// verdicts and the next grid exponents (reduce_on_grid, grid_reduce.hpp).
  template <class Comm>
  ReducedWindow reduce(WindowCore<Comm>& core, bool clip) {
    return reduce_on_grid(core, slots_, buckets_, clip);
  }

  /// A gradient taken off its slot when its bucket left (launch) becomes the slot again.
  template <class Comm>
  void reattach(WindowCore<Comm>& core, std::size_t k) {
    auto& gs = slots_[k];
    if (!gs.detached) return;
    core.param(k).mutable_grad() = core.slots[k].view;
    gs.detached = false;
  }

  /// Each slot's grid exponent, in slot (parameter-list) order.
  [[nodiscard]] std::vector<int> exponents() const {
    std::vector<int> out;
    for (const auto& s : slots_) out.push_back(s.exponent);
    return out;
  }

  /// Throws loom::InvalidArgument for a count other than the slots' or an exponent outside
  /// [kGridMinExponent, kGridMaxExponent], naming the parameter.
  template <class Comm>
  void check_exponents(const WindowCore<Comm>& core, const std::vector<int>& exponents) const {
    if (exponents.size() != slots_.size())
      throw InvalidArgument(fmt::format("Reducer::load_grid_exponents: {} exponents for {} trainable parameters",
                                        exponents.size(), slots_.size()));
    for (std::size_t k = 0; k < exponents.size(); ++k)
      if (exponents[k] < kGridMinExponent || exponents[k] > kGridMaxExponent)
        throw InvalidArgument(fmt::format("Reducer::load_grid_exponents: exponent {} of {} is outside [{}, {}]",
                                          exponents[k], core.list.describe(core.slots[k].param), kGridMinExponent,
                                          kGridMaxExponent));
  }

  /// Sets every slot's exponent (checked by check_exponents).
  void load_exponents(const std::vector<int>& exponents) {
    for (std::size_t k = 0; k < exponents.size(); ++k) slots_[k].exponent = exponents[k];
  }

 private:
  /// Puts the pending slots of bucket bi on the grid: a bucket off the host whose slots are all
  /// pending in a fixed number of operators (quantize_add_bucket_aten), any other slot by slot.
  template <class Comm>
  void quantize_pending(WindowCore<Comm>& core, std::size_t bi) {
    GradBucket& b = core.buckets[bi];
    auto& q = buckets_[bi];
    const bool whole = q.lengths.defined() && !b.slots.empty() &&
                       std::all_of(b.slots.begin(), b.slots.end(), [&](std::size_t k) { return slots_[k].pending; });
    if (!whole) {
      for (std::size_t k : b.slots)
        if (slots_[k].pending) quantize_slot(core, k);
      return;
    }
    std::vector<double> scales;
    scales.reserve(b.slots.size());
    for (std::size_t k : b.slots) {
      auto& gs = slots_[k];
      ++gs.contributions;
      gs.pending = false;
      gs.sums = true;
      scales.push_back(std::ldexp(1.0, gs.exponent));
    }
    quantize_add_bucket_aten(b.head, q.head, per_element(scales, q.lengths, b.head.numel()), q.lengths, q.tail);
  }

  /// Adds the micro-batch's gradient that slot k holds (plus a gradient the parameter held when the
  /// window began) to the slot's integers on its grid and zeroes the floating slot, flagging inf/NaN
  /// and overflow in the bucket's tail.
  template <class Comm>
  void quantize_slot(WindowCore<Comm>& core, std::size_t k) {
    const GradSlot& s = core.slots[k];
    auto& gs = slots_[k];
    GradBucket& b = core.buckets[s.bucket];
    auto& q = buckets_[s.bucket];
    const auto n = static_cast<std::int64_t>(b.slots.size());
    const auto j = static_cast<std::int64_t>(s.flag);
    const std::int64_t numel = core.param(k).numel();
    ++gs.contributions;
    gs.pending = false;
    const bool first = !gs.sums;  // the first contribution writes the sums (a bucket's are not zeroed)
    gs.sums = true;
    if (on_host(q.flat) && has_fused_scan(b.flat)) {
      GridFlags f;
      AT_DISPATCH_FLOATING_TYPES(b.flat.scalar_type(), "loom_grid_quantize", [&] {
        f = quantize_add_cpu(b.flat.data_ptr<scalar_t>() + s.offset, q.flat.data_ptr<std::int64_t>() + s.offset, numel,
                             gs.exponent, first);
      });
      note_flags(q, n, s, f);
      return;
    }
    quantize_add_aten(b.flat.narrow(0, s.offset, numel), q.flat.narrow(0, s.offset, numel), gs.exponent,
                      q.tail.narrow(0, GridTail::non_finite(n), 1), q.tail.narrow(0, GridTail::overflow(n, j), 1),
                      q.tail.narrow(0, GridTail::near(n, j), 1));
  }

  /// A bucket of n slots on the CPU: what putting slot s's contribution on the grid found, into its tail.
  static void note_flags(GridBuffers& q, std::int64_t n, const GradSlot& s, const GridFlags& f) {
    const auto j = static_cast<std::int64_t>(s.flag);
    auto* t = q.tail.data_ptr<std::int64_t>();
    if (f.non_finite) t[GridTail::non_finite(n)] = 1;
    if (f.overflow) t[GridTail::overflow(n, j)] = 1;
    if (f.near) t[GridTail::near(n, j)] = 1;
  }

  /// This rank's used-flags and contribution counts into bucket bi's tail. A bucket on a GPU stages
  /// them in pinned memory and copies them without waiting (a hook never waits).
  template <class Comm>
  void write_tail(WindowCore<Comm>& core, std::size_t bi) {
    const auto& b = core.buckets[bi];
    auto& q = buckets_[bi];
    const auto n = static_cast<std::int64_t>(b.slots.size());
    at::Tensor host = on_host(q.tail) ? q.tail : q.staging;
    auto* t = host.data_ptr<std::int64_t>();
    const std::int64_t c0 = on_host(q.tail) ? GridTail::contributions(n, 0) : n;  // staging: [used n | counts n]
    for (std::int64_t j = 0; j < n; ++j) {
      const std::size_t k = b.slots[static_cast<std::size_t>(j)];
      t[GridTail::used(n, j)] = core.slots[k].used ? 1 : 0;
      t[c0 + j] = slots_[k].contributions;
    }
    if (on_host(q.tail)) return;
    q.tail.narrow(0, 0, n).copy_(q.staging.narrow(0, 0, n), /*non_blocking=*/true);
    q.tail.narrow(0, GridTail::contributions(n, 0), n).copy_(q.staging.narrow(0, n, n), /*non_blocking=*/true);
  }

  std::vector<GridSlot> slots_;
  std::vector<GridBuffers> buckets_;
};

}  // namespace loom::detail
