// loom/reduce/detail/window_core.hpp — what both of the reducer's arithmetics share: the
// communicator, the parameters, the gradient slots and flat buckets, the buckets' all-reduces in
// flight, the window meta and the host-read counter; and the WindowArithmetic concept an arithmetic
// (floating_window.hpp, grid_window.hpp) models. ReducerState (reducer_state.hpp) owns one
// WindowCore and the arithmetic its options chose.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <fmt/format.h>

#include <loom/comm/communicator.hpp>
#include <loom/error.hpp>
#include <loom/reduce/concepts.hpp>
#include <loom/reduce/detail/bucket.hpp>
#include <loom/reduce/detail/host_path.hpp>
#include <loom/reduce/detail/window_meta.hpp>
#include <loom/reduce/detail/window_summary.hpp>
#include <loom/reduce/detail/work.hpp>
#include <loom/reduce/options.hpp>
#include <loom/reduce/parameters.hpp>

namespace loom::detail {

/// Where a reducer is between windows: closed (no window open), accumulating (a window is open and
/// its backwards only accumulate), synchronising (the backward that closes the window was prepared),
/// final_flush (the same, for an end-of-epoch flush that may have no backward).
enum class WindowState { closed, accumulating, synchronising, final_flush };

/// What the integer arithmetic decided about a window besides its summary (all false/0 in floating
/// arithmetic).
struct GridVerdict {
  bool overflow = false;                // a contribution left its grid: skip, coarser grids
  bool too_many_contributions = false;  // more than kGridMaxContributions: the sums may have wrapped
  std::int64_t contributions = 0;       // the largest per-rank contribution count, summed over ranks
};

/// What an arithmetic's reduce() returns: the window's summary (counts, used-flags, inf/NaN, squared
/// norm), the integer arithmetic's verdict and how many buckets went again as int64.
struct ReducedWindow {
  WindowSummary summary;
  GridVerdict grid;
  std::int64_t wide_buckets = 0;
};

/// The state both arithmetics read and write, at a stable address inside ReducerState.
template <class Comm>
struct WindowCore {
  using Work = typename WorkOf<Comm>::type;

  Comm* comm;
  ReducerOptions options;
  ParameterList list;
  c10::Device device;  // where the communicator's collectives run (meta, the summary)
  std::vector<GradSlot> slots;
  std::vector<GradBucket> buckets;
  std::vector<std::optional<Work>> works;  // each bucket's all-reduce in flight
  std::optional<Work> meta_work;           // the window meta's own all-reduce (when the first bucket does not carry it)
  at::Tensor meta;                         // the window meta (WindowMeta) on device: this rank's row, then the sum
  WindowMeta::Row meta_row{};              // this rank's row of the open synchronising window
  bool meta_ready = false;                 // meta holds the window's sum (decoded from the first bucket)
  std::pair<at::Tensor, at::Tensor> meta_tables;  // MetaLimbs::tables for a first bucket off the host
  HostReads reads;
  bool in_hook = false;           // a gradient hook is running (HostReads::in_hooks)
  std::int64_t loss_divisor = 1;  // this rank's BackwardPlan::loss_divisor of the current sync window (0: none)
  double grad_scale = 1.0;        // BackwardPlan::grad_scale of the current sync window
  WindowState window = WindowState::closed;

  WindowCore(Comm& c, ParameterList l, ReducerOptions o)
      : comm(&c), options(std::move(o)), list(std::move(l)), device(c.device()) {}

  /// Slot k's parameter.
  const at::Tensor& param(std::size_t k) const { return list.params[slots[k].param]; }

  bool synchronising() const noexcept {
    return window == WindowState::synchronising || window == WindowState::final_flush;
  }

  void count_host_read() {
    ++reads.total;
    if (in_hook) ++reads.in_hooks;
  }

  /// Copies `t` to the host, counting the read (a synchronisation point on a GPU).
  at::Tensor host_read(const at::Tensor& t) {
    count_host_read();
    return t.to(at::kCPU);
  }

  /// Whether the window meta rides in the first bucket's all-reduce (else it is an all-reduce of its own).
  bool carries_meta() const noexcept { return !buckets.empty() && buckets.front().meta_bits > 0; }

  /// Starts the sum all-reduce of `t` (completed at once by a communicator without async collectives).
  Work start(at::Tensor& t) {
    if constexpr (AsyncCommunicator<Comm>) {
      return comm->all_reduce_async(t, ReduceOp::sum);
    } else {
      comm->all_reduce(t, ReduceOp::sum);
      return Work{};
    }
  }

  /// Waits (on the host) for bucket bi's all-reduce if it is still in flight; the first bucket's also
  /// gives the summed window meta (meta) when it carries it.
  void wait_bucket(std::size_t bi) {
    if (!works[bi]) return;
    works[bi]->wait();
    works[bi].reset();
    if (bi != 0 || !carries_meta() || meta_ready) return;
    const auto& b = buckets.front();
    if (on_host(b.meta) && on_host(meta)) {
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, b.meta.scalar_type(), "loom_meta_decode", [&] {
        WindowMeta::write(meta, MetaLimbs::decode(b.meta.data_ptr<scalar_t>(), b.meta_bits, comm->world_size()));
      });
    } else {
      MetaLimbs::decode(b.meta, meta_tables, meta);
    }
    meta_ready = true;
  }

  /// Waits (on the host) for the window meta's own all-reduce (started in prepare_backward), if any.
  void wait_meta() {
    if (!meta_work) return;
    meta_work->wait();
    meta_work.reset();
  }

  /// Slot k's parameter, unused on every rank, gets back the gradient it had before the window
  /// (none; a float32 slot's copy in the parameter's dtype; the saved values of a slot zeroed when
  /// its bucket left).
  void restore_unused(std::size_t k) {
    auto& s = slots[k];
    auto& g = param(k).mutable_grad();
    if (s.was_undefined)
      g.reset();
    else if (buckets[s.bucket].main)
      g = (s.saved.defined() ? s.saved : s.view).to(param(k).scalar_type());
    else if (s.saved.defined())
      s.view.copy_(s.saved);
  }

  /// The error for a gradient that arrives in the synchronising backward after its bucket left.
  std::string late_gradient_message(const GradSlot& s) const {
    return fmt::format(
        "Reducer: {} received a second gradient in the synchronising backward after its bucket was sent, so it "
        "would miss the all-reduce; run one backward per micro-batch (sum the losses first), or use overlap = false",
        list.describe(s.param));
  }
};

/// A reducer's arithmetic: how gradients are summed within and across ranks and turned into the
/// window's result. ReducerState calls it at fixed points of the window, holding its lock:
/// 1. `kFloating`: the buckets carry the window meta and range flags (floating arithmetic), or not.
/// 2. `buckets_allocated(core)`: after the buckets were (re)allocated, its own per-bucket memory.
/// 3. `begin_window(core)`: the first prepare_backward of a window, before the slots are set up.
/// 4. `before_backward(core)`: every prepare_backward (the previous micro-batch's gradients are complete).
/// 5. `begin_sync(core, plan)`: a synchronising prepare_backward.
/// 6. `gradient_arrived(core, k)`: slot k received a gradient inside a window.
/// 7. `check_not_late(core, k)`: throws when slot k may not take a gradient now.
/// 8. `launch(core, bi)`: bucket bi's unused slots were zeroed: start its all-reduce into core.works[bi].
/// 9. `reduce(core, clip)`: every bucket launched: wait for them and give the window's ReducedWindow.
/// 10. `reattach(core, k)`: slot k's .grad() is the slot again (a window ends).
/// Not required: thread safety (the caller locks), knowledge of hooks or of the window meta's encoding.
template <class A, class Comm>
concept WindowArithmetic = requires(A a, WindowCore<Comm>& core, const BackwardPlan& plan, std::size_t k, bool clip) {
  { A::kFloating } -> std::convertible_to<bool>;
  a.buckets_allocated(core);
  a.begin_window(core);
  a.before_backward(core);
  a.begin_sync(core, plan);
  a.gradient_arrived(core, k);
  a.check_not_late(core, k);
  a.launch(core, k);
  { a.reduce(core, clip) } -> std::same_as<ReducedWindow>;
  a.reattach(core, k);
};

}  // namespace loom::detail
