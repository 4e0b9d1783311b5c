// loom/reduce/detail/reducer_state.hpp — the engine behind loom::Reducer: the window state machine
// (prepare_backward / gradient hooks / finish_window), the buckets' layout and launch order, and
// what a window leaves in .grad(). What both arithmetics share lives in window_core.hpp; the
// floating arithmetic in floating_window.hpp, the integer one (deterministic) in grid_window.hpp,
// one of them chosen at construction. Beside it: hooks.hpp (the autograd hook), window_summary.hpp
// (what the ranks exchange per window), bucket_order.hpp (the ready-order rebuild),
// reducer_checks.hpp (options and parameter checks). The rules are documented in loom/reduce/reducer.hpp.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <fmt/format.h>
#include <torch/csrc/autograd/variable.h>

#include <loom/comm/communicator.hpp>
#include <loom/detail/torch_api.hpp>
#include <loom/error.hpp>
#include <loom/reduce/concepts.hpp>
#include <loom/reduce/detail/bucket.hpp>
#include <loom/reduce/detail/bucket_order.hpp>
#include <loom/reduce/detail/exact.hpp>
#include <loom/reduce/detail/floating_window.hpp>
#include <loom/reduce/detail/grid_window.hpp>
#include <loom/reduce/detail/hooks.hpp>
#include <loom/reduce/detail/host_path.hpp>
#include <loom/reduce/detail/reducer_checks.hpp>
#include <loom/reduce/detail/step_verdict.hpp>
#include <loom/reduce/detail/window_core.hpp>
#include <loom/reduce/detail/window_summary.hpp>
#include <loom/reduce/options.hpp>
#include <loom/reduce/parameters.hpp>
#include <loom/trace/recorder.hpp>

namespace loom::detail {

/// All of Reducer's state, at a stable address (autograd hooks point at it): the window state
/// machine over a WindowCore and the arithmetic ReducerOptions::deterministic chose.
template <class Comm>
class ReducerState {
  static_assert(WindowArithmetic<FloatingWindow, Comm> && WindowArithmetic<GridWindow, Comm>);

 public:
  ReducerState(Comm& comm, ParameterList list, ReducerOptions options)
      : core_(comm, std::move(list), std::move(options)), order_(0, false) {
    check_reducer_options(core_.options);
    check_names(core_.list);
    // Before any collective: every rank of the same program reaches the same verdict.
    check_not_hooked(core_.list, "Reducer");
    if (core_.options.check_parameters) {
      trace::Scope scope(comm, trace::Context::parameter_check);
      check_same_reducer_options(comm, core_.options);
      check_same_parameters(comm, core_.list);
    }
    if (core_.options.broadcast_parameters) {
      trace::Scope scope(comm, trace::Context::parameter_broadcast);
      broadcast_from_rank0(comm, core_.list);
    }

    slot_of_param_ = trainable_slots(core_.list);
    for (std::size_t i = 0; i < slot_of_param_.size(); ++i)
      if (slot_of_param_[i] != kNoSlot) {
        core_.slots.emplace_back();
        core_.slots.back().param = i;
      }
    if (core_.options.deterministic) arithmetic_.template emplace<GridWindow>(core_.slots.size(), comm.rank());
    order_ = BucketOrder(core_.slots.size(), core_.options.rebuild_buckets);
    core_.meta = at::zeros({WindowMeta::kLength}, at::TensorOptions().dtype(at::kLong).device(core_.device));
    rebuild_buckets();
    for (std::size_t k = 0; k < core_.slots.size(); ++k) {
      auto acc = torch::autograd::impl::grad_accumulator(core_.param(k));
      LOOM_ASSERT(acc != nullptr, core_.list.describe(core_.slots[k].param));
      keys_.push_back(acc->add_post_hook(std::make_unique<GradReadyHook<ReducerState>>(this, k)));
      accumulators_.push_back(std::move(acc));
    }
  }

  ReducerState(const ReducerState&) = delete;
  ReducerState& operator=(const ReducerState&) = delete;

  ~ReducerState() {
    for (std::size_t k = 0; k < accumulators_.size(); ++k) accumulators_[k]->del_post_hook(keys_[k]);
  }

  // ---- the GradientReducer protocol ---------------------------------------------------------

  void prepare_backward(const BackwardPlan& plan) {
    std::lock_guard lock(mutex_);
    if (core_.synchronising())
      throw Error("Reducer::prepare_backward: the previous synchronising backward was not closed with finish_window()");
    check_backward_plan(plan, core_.comm->world_size());
    at::NoGradGuard no_grad;
    if (core_.window == WindowState::closed) begin_window();
    visit([&](auto& a) { a.before_backward(core_); });
    for (auto& s : core_.slots) s.fired = false;
    if (!plan.sync) return;
    core_.window = plan.final ? WindowState::final_flush : WindowState::synchronising;
    core_.loss_divisor = plan.loss_divisor;
    core_.grad_scale = plan.grad_scale;
    visit([&](auto& a) { a.begin_sync(core_, plan); });
    for (auto& b : core_.buckets) {
      b.pending = b.slots.size();
      b.ready = false;
      b.launched = false;
    }
    core_.works.assign(core_.buckets.size(), std::nullopt);
    next_launch_ = 0;
    // The flight recorder's fingerprint of what this rank issued since its previous window rides in
    // the meta: ranks whose collectives differed are found in finish_window, with no collective of its own.
    trace::FlightRecorder* recorder = trace::recorder_of(*core_.comm);
    fingerprint_ = recorder != nullptr ? recorder->take_fingerprint() : 0;
    core_.meta_row = WindowMeta::encode(
        plan, recorder != nullptr ? std::optional<std::int64_t>(fingerprint_) : std::optional<std::int64_t>(),
        replica_fingerprint_);
    core_.meta_ready = false;
    if (core_.carries_meta()) return;  // the row rides in the first bucket's all-reduce
    WindowMeta::write(core_.meta, core_.meta_row);
    trace::Scope scope(*core_.comm, trace::Context::reducer_window);
    core_.meta_work = core_.start(core_.meta);
  }

  Reduction finish_window() {
    std::lock_guard lock(mutex_);
    if (!core_.synchronising())
      throw Error("Reducer::finish_window: no synchronising backward was prepared (prepare_backward({.sync = true}))");
    at::NoGradGuard no_grad;
    const int world = core_.comm->world_size();
    if (core_.carries_meta() && core_.window == WindowState::final_flush) {
      // The flush's verdict below needs the meta: the first bucket goes (and comes back) first.
      if (next_launch_ == 0) launch(next_launch_++);
      core_.wait_bucket(0);
    }
    core_.wait_meta();  // its own all-reduce, started before backward: long done unless nothing was sent yet
    if (core_.window == WindowState::final_flush) {
      // A flush without backward: skip the buckets when every rank flushes and nobody has a sample.
      const at::Tensor m = core_.host_read(core_.meta);
      const WindowCounts c = WindowCounts::decode(m.data_ptr<std::int64_t>());
      if (c.final_ranks == world && c.samples == 0 && c.leaving_ranks == 0 &&
          !c.fingerprints_differ(fingerprint_, world) && !c.replicas_differ()) {
        discard_window();
        Reduction r;
        r.all_final = true;
        return r;
      }
    }
    for (std::size_t b = next_launch_; b < core_.buckets.size(); ++b) launch(b);
    next_launch_ = core_.buckets.size();

    const bool clip = core_.options.max_grad_norm.has_value();
    const ReducedWindow reduced = visit([&](auto& a) { return a.reduce(core_, clip); });
    const WindowDecision decision = decide_window(reduced, core_.options, world, fingerprint_);
    if (decision.scale < 1.0)
      for (auto& b : core_.buckets) b.head.mul_(decision.scale);
    if (decision.zero)
      for (auto& b : core_.buckets) b.head.zero_();
    const std::vector<char>& used = reduced.summary.used;
    // Parameters unused on every rank get back the gradient they had before the window; a
    // float32-accumulated parameter's .grad() becomes the 16-bit copy of its average.
    visit([&](auto& a) {
      for (std::size_t k = 0; k < core_.slots.size(); ++k) {
        auto& s = core_.slots[k];
        const bool main = core_.buckets[s.bucket].main;
        a.reattach(core_, k);
        auto& g = core_.param(k).mutable_grad();
        if (used[k]) {
          if (main) g = s.view.to(core_.param(k).scalar_type());
          continue;
        }
        core_.restore_unused(k);
      }
    });
    close_window();
    order_.window_closed();
    if (decision.diverged) {
      const std::string message = fmt::format(
          "Reducer::finish_window: the ranks issued different collectives since their previous window (the flight "
          "recorder's fingerprints differ; gradients zeroed, the step not applied)");
      trace::FlightRecorder* recorder = trace::recorder_of(*core_.comm);
      throw CommError(message + (recorder != nullptr ? recorder->failure_report(message) : std::string{}));
    }
    if (decision.divisors_differ)
      throw InvalidArgument(fmt::format(
          "Reducer::finish_window: the ranks divided their losses by different loss_divisor values (this rank: {}; "
          "mean over the {} ranks that gave one: {}); every rank must use the same divisor for a window (gradients "
          "zeroed, the step not applied)",
          core_.loss_divisor, reduced.summary.counts.voters, reduced.summary.counts.mean_divisor()));
    if (reduced.grid.too_many_contributions)
      throw InvalidArgument(fmt::format(
          "Reducer::finish_window: deterministic mode sums at most {} gradient contributions (micro-batches) of a "
          "parameter per window over all ranks; this window had {} (gradients zeroed, the step not applied)",
          kGridMaxContributions, reduced.grid.contributions));
    if (core_.options.broadcast_buffers && world > 1 && !core_.list.buffers.empty()) {
      trace::Scope scope(*core_.comm, trace::Context::buffer_broadcast);
      broadcast_from_rank0(*core_.comm, ParameterList{.names = {}, .params = {}, .buffers = core_.list.buffers});
    }
    return decision.reduction;
  }

  /// From the next synchronising window on, `fingerprint` (in [0, 2^20)) rides in every window's
  /// meta and Reduction::replicas_differ says whether the ranks that set one sent different values;
  /// std::nullopt stops comparing.
  void compare_replicas(std::optional<std::int64_t> fingerprint) {
    std::lock_guard lock(mutex_);
    if (fingerprint && (*fingerprint < 0 || *fingerprint >= (std::int64_t{1} << 20)))
      throw InvalidArgument(
          fmt::format("Reducer::compare_replicas: fingerprint {} is outside [0, 2^20)", *fingerprint));
    replica_fingerprint_ = fingerprint;
  }

  // ---- hooks and manual readiness ------------------------------------------------------------

  void on_grad_ready(std::size_t k) {
    std::lock_guard lock(mutex_);
    ++arrivals_;
    core_.in_hook = true;
    try {
      mark_ready_locked(k);
    } catch (...) {
      core_.in_hook = false;
      throw;
    }
    core_.in_hook = false;
  }

  void mark_ready(std::size_t param_index) {
    const auto& list = core_.list;
    if (param_index >= slot_of_param_.size() || slot_of_param_[param_index] == kNoSlot)
      throw InvalidArgument(fmt::format(
          "Reducer::mark_ready: {} is not a trainable parameter of this reducer",
          param_index < list.params.size() ? list.describe(param_index) : fmt::format("parameter {}", param_index)));
    std::lock_guard lock(mutex_);
    at::NoGradGuard no_grad;
    if (core_.window == WindowState::closed) throw Error("Reducer::mark_ready: call prepare_backward() first");
    const std::size_t k = slot_of_param_[param_index];
    visit([&](auto& a) { a.check_not_late(core_, k); });  // its .grad() may be off the slot (launch)
    if (!core_.param(k).grad().defined())
      throw InvalidArgument(fmt::format("Reducer::mark_ready: {} has no gradient", list.describe(param_index)));
    mark_ready_locked(k);
  }

  // ---- introspection -------------------------------------------------------------------------

  [[nodiscard]] std::vector<std::vector<std::size_t>> bucket_params() const {
    std::vector<std::vector<std::size_t>> out;
    for (const auto& b : core_.buckets) {
      out.emplace_back();
      for (std::size_t k : b.slots) out.back().push_back(core_.slots[k].param);
    }
    return out;
  }
  /// The integer arithmetic's grid exponents in parameter-list order; empty in floating arithmetic.
  [[nodiscard]] std::vector<int> grid_exponents() const {
    const auto* grid = std::get_if<GridWindow>(&arithmetic_);
    return grid != nullptr ? grid->exponents() : std::vector<int>{};
  }
  void check_grid_exponents(const std::vector<int>& exponents) const {
    const auto* grid = std::get_if<GridWindow>(&arithmetic_);
    if (grid == nullptr)
      throw InvalidArgument(
          "Reducer::load_grid_exponents: this reducer is not deterministic (ReducerOptions::deterministic)");
    grid->check_exponents(core_, exponents);
  }
  void load_grid_exponents(const std::vector<int>& exponents) {
    std::lock_guard lock(mutex_);
    check_grid_exponents(exponents);
    if (core_.window != WindowState::closed)
      throw Error("Reducer::load_grid_exponents: a window is open; load the exponents between optimizer steps");
    std::get<GridWindow>(arithmetic_).load_exponents(exponents);
  }
  [[nodiscard]] std::vector<at::Tensor> bucket_tensors() const {
    std::vector<at::Tensor> out;
    for (const auto& b : core_.buckets) out.push_back(b.head);
    return out;
  }
  [[nodiscard]] bool rebuilt() const noexcept { return order_.phase() == BucketOrder::Phase::rebuilt; }
  [[nodiscard]] HostReads host_reads() const noexcept { return core_.reads; }
  [[nodiscard]] std::int64_t gradient_arrivals() const noexcept { return arrivals_; }
  [[nodiscard]] const ParameterList& parameters() const noexcept { return core_.list; }
  [[nodiscard]] const ReducerOptions& options() const noexcept { return core_.options; }
  [[nodiscard]] Comm& communicator() const noexcept { return *core_.comm; }

 private:
  /// Calls `f` with the arithmetic chosen at construction.
  template <class F>
  decltype(auto) visit(F&& f) {
    return std::visit(std::forward<F>(f), arithmetic_);
  }

  /// Buckets for the current order; every defined gradient moves into its slot. The first bucket
  /// carries the window meta when its dtype has room (floating arithmetic).
  void rebuild_buckets() {
    visit([&](auto& a) {
      core_.buckets = allocate_buckets(assign_slots(core_.list, core_.slots, order_.order(), core_.options),
                                       core_.slots, core_.list, core_.options, core_.comm->world_size(),
                                       /*floating=*/std::decay_t<decltype(a)>::kFloating);
      a.buckets_allocated(core_);
    });
    if (core_.carries_meta() && !(on_host(core_.buckets.front().meta) && on_host(core_.meta)))
      core_.meta_tables = MetaLimbs::tables(core_.buckets.front().meta_bits, core_.device);
  }

  /// First prepare_backward of a window: every gradient becomes its bucket slot.
  void begin_window() {
    check_parameter_set(core_.list, slot_of_param_, core_.slots, core_.buckets, accumulators_);
    if (order_.phase() == BucketOrder::Phase::pending) try_rebuild();
    visit([&](auto& a) { a.begin_window(core_); });
    for (auto& b : core_.buckets) {
      const bool all_undefined =
          std::none_of(b.slots.begin(), b.slots.end(), [&](std::size_t k) { return core_.param(k).grad().defined(); });
      if (all_undefined) b.head.zero_();
      for (std::size_t k : b.slots) {
        auto& s = core_.slots[k];
        auto& g = core_.param(k).mutable_grad();
        s.used = false;
        s.saved = at::Tensor();
        s.was_undefined = !g.defined();
        if (b.main) {  // a float32 slot: the gradient the parameter holds (a stale one) starts the sum
          if (g.defined())
            s.view.copy_(g);
          else if (!all_undefined)
            s.view.zero_();
          g.reset();
        } else if (!g.defined()) {
          if (!all_undefined) s.view.zero_();
          g = s.view;
        } else if (!aliases(g, s.view)) {
          s.view.copy_(g);
          g = s.view;
        }
      }
    }
    core_.window = WindowState::accumulating;
  }

  void mark_ready_locked(std::size_t k) {
    auto& s = core_.slots[k];
    auto& g = core_.param(k).mutable_grad();
    visit([&](auto& a) { a.check_not_late(core_, k); });  // before the in-flight integers are touched
    if (core_.buckets[s.bucket].main) {  // float32 accumulation: add this backward's 16-bit gradient, free it
      at::NoGradGuard no_grad;
      if (g.defined()) s.view.add_(g);
      g.reset();
    } else if (!aliases(g, s.view)) {  // replaced by the user or by a create_graph backward: move it into the slot
      at::NoGradGuard no_grad;
      if (g.defined())
        s.view.copy_(g);
      else
        s.view.zero_();
      g = s.view;
    }
    visit([&](auto& a) { a.gradient_arrived(core_, k); });
    s.used = true;
    order_.record(s);
    if (!core_.synchronising()) return;
    auto& b = core_.buckets[s.bucket];
    if (s.fired) {
      // A second gradient in the synchronising backward. Before the bucket left it was simply added
      // to the slot, and the bucket is scaled as a whole when it leaves: (x + y) / N, exact.
      if (b.launched) {
        b.late_gradient = true;  // it was added to the slot: a finish_window after the error scans the bucket
        throw InvalidArgument(core_.late_gradient_message(s));
      }
      return;
    }
    s.fired = true;
    if (--b.pending == 0) b.ready = true;
    if (!core_.options.overlap) return;
    while (next_launch_ < core_.buckets.size() && core_.buckets[next_launch_].ready) launch(next_launch_++);
  }

  /// Zeroes the slots of unused parameters (an unused parameter counts as zero; its gradient is
  /// saved for the restore) and lets the arithmetic start the bucket's all-reduce. Nothing here
  /// reads a value back to the host.
  void launch(std::size_t bi) {
    auto& b = core_.buckets[bi];
    for (std::size_t k : b.slots) {
      auto& s = core_.slots[k];
      if (s.used) continue;
      if (!s.was_undefined && !s.saved.defined()) s.saved = s.view.clone();
      s.view.zero_();
    }
    trace::Scope scope(*core_.comm, trace::Context::reducer_bucket, static_cast<std::int64_t>(bi));
    visit([&](auto& a) { a.launch(core_, bi); });
    b.launched = true;
  }

  /// A final flush that found nothing anywhere: undo the window's setup.
  void discard_window() {
    visit([&](auto& a) {
      for (std::size_t k = 0; k < core_.slots.size(); ++k) {
        auto& s = core_.slots[k];
        a.reattach(core_, k);
        if (s.used)
          s.view.zero_();
        else
          core_.restore_unused(k);
      }
    });
    core_.meta_work.reset();
    close_window();
  }

  void close_window() {
    for (auto& s : core_.slots) s.saved = at::Tensor();
    core_.window = WindowState::closed;
  }

  /// After the first synchronising window: rank 0's ready order, broadcast, becomes the bucket order.
  void try_rebuild() {
    at::Tensor positions = order_.take_positions(core_.slots);
    if (core_.comm->world_size() > 1) {
      auto shared = positions.to(core_.device);
      trace::Scope scope(*core_.comm, trace::Context::bucket_order);
      core_.comm->broadcast(shared, 0);
      positions = core_.host_read(shared);
    }
    if (order_.adopt(positions.contiguous())) rebuild_buckets();
  }

  WindowCore<Comm> core_;
  std::variant<FloatingWindow, GridWindow> arithmetic_;
  std::vector<std::size_t> slot_of_param_;
  BucketOrder order_;
  std::int64_t fingerprint_ = 0;  // this rank's flight-recorder fingerprint in the open window's meta
  std::optional<std::int64_t> replica_fingerprint_;  // compare_replicas: compared in every synchronising window's meta
  std::vector<GradAccumulatorPtr> accumulators_;
  std::vector<std::uintptr_t> keys_;
  std::mutex mutex_;
  std::size_t next_launch_ = 0;
  std::int64_t arrivals_ = 0;  // gradients delivered by autograd hooks since construction
};

}  // namespace loom::detail
