// loom/reduce/detail/reducer_state.hpp — the engine behind loom::Reducer: the window state machine
// (prepare_backward / gradient hooks / finish_window), the buckets' memory and launch, and what a
// window leaves in .grad(). Its parts live beside it: hooks.hpp (the autograd hook),
// window_summary.hpp (what the ranks exchange per window), averaging.hpp (sum to average),
// bucket_order.hpp (the ready-order rebuild), reducer_checks.hpp (options and parameter checks).
// The rules it implements are documented in loom/reduce/reducer.hpp.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <torch/csrc/autograd/variable.h>

#include <loom/comm/communicator.hpp>
#include <loom/detail/torch_api.hpp>
#include <loom/error.hpp>
#include <loom/reduce/buckets.hpp>
#include <loom/reduce/concepts.hpp>
#include <loom/reduce/detail/averaging.hpp>
#include <loom/reduce/detail/bucket.hpp>
#include <loom/reduce/detail/bucket_order.hpp>
#include <loom/reduce/detail/exact.hpp>
#include <loom/reduce/detail/grid_aten.hpp>
#include <loom/reduce/detail/hooks.hpp>
#include <loom/reduce/detail/host_path.hpp>
#include <loom/reduce/detail/reducer_checks.hpp>
#include <loom/reduce/detail/window_summary.hpp>
#include <loom/reduce/detail/work.hpp>
#include <loom/reduce/options.hpp>
#include <loom/reduce/parameters.hpp>
#include <loom/trace/recorder.hpp>

namespace loom::detail {

/// Where a reducer is between windows: closed (no window open), accumulating (a window is open and
/// its backwards only accumulate), synchronising (the backward that closes the window was prepared),
/// final_flush (the same, for an end-of-epoch flush that may have no backward).
enum class WindowState { closed, accumulating, synchronising, final_flush };

/// All of Reducer's state, at a stable address (autograd hooks point at it).
template <class Comm>
class ReducerState {
 public:
  using Work = typename WorkOf<Comm>::type;

  ReducerState(Comm& comm, ParameterList list, ReducerOptions options)
      : comm_(&comm), options_(std::move(options)), list_(std::move(list)), device_(comm.device()), order_(0, false) {
    check_reducer_options(options_);
    if (options_.deterministic) warn_threads(at::get_num_threads(), comm.rank());
    check_names(list_);
    // Before any collective: every rank of the same program reaches the same verdict.
    check_not_hooked(list_, "Reducer");
    if (options_.check_parameters) {
      trace::Scope scope(*comm_, trace::Context::parameter_check);
      check_same_reducer_options(*comm_, options_);
      check_same_parameters(*comm_, list_);
    }
    if (options_.broadcast_parameters) {
      trace::Scope scope(*comm_, trace::Context::parameter_broadcast);
      broadcast_from_rank0(*comm_, list_);
    }

    slot_of_param_ = trainable_slots(list_);
    for (std::size_t i = 0; i < slot_of_param_.size(); ++i)
      if (slot_of_param_[i] != kNoSlot) {
        slots_.emplace_back();
        slots_.back().param = i;
      }
    order_ = BucketOrder(slots_.size(), options_.rebuild_buckets);
    meta_ = at::zeros({WindowMeta::kLength}, at::TensorOptions().dtype(at::kLong).device(device_));
    rebuild_buckets();
    for (std::size_t k = 0; k < slots_.size(); ++k) {
      auto acc = torch::autograd::impl::grad_accumulator(param(k));
      LOOM_ASSERT(acc != nullptr, list_.describe(slots_[k].param));
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
    if (synchronising())
      throw Error("Reducer::prepare_backward: the previous synchronising backward was not closed with finish_window()");
    check_backward_plan(plan, comm_->world_size());
    at::NoGradGuard no_grad;
    if (window_ == WindowState::closed) begin_window();
    if (options_.deterministic) {  // the previous micro-batch's gradients go on the grid before this one adds to them
      for (std::size_t k = 0; k < slots_.size(); ++k) {
        auto& s = slots_[k];
        if (!s.grid_pending) continue;
        auto& g = param(k).mutable_grad();
        if (!buckets_[s.bucket].main && g.defined() && !aliases(g, s.view)) {  // replaced by hand since: it counts
          s.view.copy_(g);
          g = s.view;
        }
      }
      for (std::size_t bi = 0; bi < buckets_.size(); ++bi) quantize_pending(bi);
    }
    for (auto& s : slots_) s.fired = false;
    if (!plan.sync) return;
    window_ = plan.final ? WindowState::final_flush : WindowState::synchronising;
    loss_divisor_ = plan.loss_divisor;
    grad_scale_ = plan.grad_scale;
    average_.begin(options_.average, comm_->world_size(), plan.grad_scale);
    for (auto& b : buckets_) {
      b.pending = b.slots.size();
      b.ready = false;
      b.launched = false;
    }
    works_.assign(buckets_.size(), std::nullopt);
    next_launch_ = 0;
    // The flight recorder's fingerprint of what this rank issued since its previous window rides in
    // the meta: ranks whose collectives differed are found in finish_window, with no collective of its own.
    trace::FlightRecorder* recorder = trace::recorder_of(*comm_);
    fingerprint_ = recorder != nullptr ? recorder->take_fingerprint() : 0;
    meta_row_ = WindowMeta::encode(
        plan, recorder != nullptr ? std::optional<std::int64_t>(fingerprint_) : std::optional<std::int64_t>(),
        replica_fingerprint_);
    meta_ready_ = false;
    if (carries_meta()) return;  // the row rides in the first bucket's all-reduce
    WindowMeta::write(meta_, meta_row_);
    trace::Scope scope(*comm_, trace::Context::reducer_window);
    meta_work_ = start(meta_);
  }

  Reduction finish_window() {
    std::lock_guard lock(mutex_);
    if (!synchronising())
      throw Error("Reducer::finish_window: no synchronising backward was prepared (prepare_backward({.sync = true}))");
    at::NoGradGuard no_grad;
    Reduction r;
    const int world = comm_->world_size();
    if (carries_meta() && window_ == WindowState::final_flush) {
      // The flush's verdict below needs the meta: the first bucket goes (and comes back) first.
      if (next_launch_ == 0) launch(next_launch_++);
      wait_bucket(0);
    }
    wait_meta();  // its own all-reduce, started before backward: long done unless nothing was sent yet
    if (window_ == WindowState::final_flush) {
      // A flush without backward: skip the buckets when every rank flushes and nobody has a sample.
      const at::Tensor m = host_read(meta_);
      const WindowCounts c = WindowCounts::decode(m.data_ptr<std::int64_t>());
      if (c.final_ranks == world && c.samples == 0 && c.leaving_ranks == 0 &&
          !c.fingerprints_differ(fingerprint_, world) && !c.replicas_differ()) {
        r.all_final = true;
        discard_window();
        return r;
      }
    }
    for (std::size_t b = next_launch_; b < buckets_.size(); ++b) launch(b);
    next_launch_ = buckets_.size();

    // Wait for each bucket in launch order and, while later buckets are still in flight, divide it
    // to the average and scan it for inf/NaN (the reduced values are identical on every rank, so
    // every rank reaches the same verdict; a sum that overflowed is caught too).
    const bool clip = options_.max_grad_norm.has_value();
    GridVerdict grid;
    const WindowSummary summary =
        options_.deterministic ? reduce_on_grid(clip, grid, r.grid_wide_buckets) : reduce_floating(clip);
    const WindowCounts& counts = summary.counts;
    const bool no_samples = options_.average == Average::samples && counts.samples == 0;
    r.global_samples = counts.samples;
    r.all_final = counts.final_ranks == world;
    r.ranks_leaving = counts.leaving_ranks;
    // A rank leaving its loop closes its window as it is: its report comes first.
    const bool divisors_differ = r.ranks_leaving == 0 && counts.divisors_differ();
    // A rank leaving its loop closes its window wherever it is (its report comes first, as above).
    const bool diverged = r.ranks_leaving == 0 && counts.fingerprints_differ(fingerprint_, world);
    r.replicas_differ = r.ranks_leaving == 0 && counts.replicas_differ();
    bool non_finite = summary.non_finite;
    if (clip && !no_samples) {
      const double total = std::sqrt(*summary.squared_norm);
      r.grad_norm = total;
      if (!std::isfinite(total)) non_finite = true;
      if (!non_finite) {
        const double coef = std::min(1.0, *options_.max_grad_norm / (total + 1e-6));
        r.clip_coef = coef;
        if (coef < 1.0)
          for (auto& b : buckets_) b.head.mul_(coef);
      }
    }
    if (non_finite || no_samples || r.ranks_leaving > 0 || divisors_differ || diverged || grid.overflow ||
        grid.too_many_contributions || r.replicas_differ)
      for (auto& b : buckets_) b.head.zero_();
    r.non_finite = non_finite;
    r.grid_overflow = grid.overflow;
    r.no_samples = no_samples;
    r.reduced = true;
    r.verdict = r.ranks_leaving > 0 ? StepVerdict::leaving
                : r.replicas_differ ? StepVerdict::replicas_differ
                : non_finite        ? StepVerdict::skip_non_finite
                : grid.overflow     ? StepVerdict::skip_grid_overflow
                : no_samples        ? StepVerdict::skip_no_samples
                                    : StepVerdict::apply;
    // Parameters unused on every rank get back the gradient they had before the window; a
    // float32-accumulated parameter's .grad() becomes the 16-bit copy of its average.
    for (std::size_t k = 0; k < slots_.size(); ++k) {
      auto& s = slots_[k];
      const bool main = buckets_[s.bucket].main;
      auto& g = param(k).mutable_grad();
      reattach_grad(s, g);
      if (summary.used[k]) {
        if (main) g = s.view.to(param(k).scalar_type());
        continue;
      }
      if (s.was_undefined)
        g.reset();
      else if (main)
        g = (s.saved.defined() ? s.saved : s.view).to(param(k).scalar_type());
      else if (s.saved.defined())
        s.view.copy_(s.saved);
    }
    close_window();
    order_.window_closed();
    if (diverged) {
      const std::string message = fmt::format(
          "Reducer::finish_window: the ranks issued different collectives since their previous window (the flight "
          "recorder's fingerprints differ; gradients zeroed, the step not applied)");
      trace::FlightRecorder* recorder = trace::recorder_of(*comm_);
      throw CommError(message + (recorder != nullptr ? recorder->failure_report(message) : std::string{}));
    }
    if (divisors_differ)
      throw InvalidArgument(fmt::format(
          "Reducer::finish_window: the ranks divided their losses by different loss_divisor values (this rank: {}; "
          "mean over the {} ranks that gave one: {}); every rank must use the same divisor for a window (gradients "
          "zeroed, the step not applied)",
          loss_divisor_, counts.voters, counts.mean_divisor()));
    if (grid.too_many_contributions)
      throw InvalidArgument(fmt::format(
          "Reducer::finish_window: deterministic mode sums at most {} gradient contributions (micro-batches) of a "
          "parameter per window over all ranks; this window had {} (gradients zeroed, the step not applied)",
          kGridMaxContributions, grid.contributions));
    if (options_.broadcast_buffers && world > 1 && !list_.buffers.empty()) {
      trace::Scope scope(*comm_, trace::Context::buffer_broadcast);
      broadcast_from_rank0(*comm_, ParameterList{.names = {}, .params = {}, .buffers = list_.buffers});
    }
    return r;
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
    in_hook_ = true;
    try {
      mark_ready_locked(k);
    } catch (...) {
      in_hook_ = false;
      throw;
    }
    in_hook_ = false;
  }

  void mark_ready(std::size_t param_index) {
    if (param_index >= slot_of_param_.size() || slot_of_param_[param_index] == kNoSlot)
      throw InvalidArgument(fmt::format(
          "Reducer::mark_ready: {} is not a trainable parameter of this reducer",
          param_index < list_.params.size() ? list_.describe(param_index) : fmt::format("parameter {}", param_index)));
    std::lock_guard lock(mutex_);
    at::NoGradGuard no_grad;
    if (window_ == WindowState::closed) throw Error("Reducer::mark_ready: call prepare_backward() first");
    check_not_late(slots_[slot_of_param_[param_index]]);  // its .grad() may be off the slot (launch)
    auto& g = param(slot_of_param_[param_index]).mutable_grad();
    if (!g.defined())
      throw InvalidArgument(fmt::format("Reducer::mark_ready: {} has no gradient", list_.describe(param_index)));
    mark_ready_locked(slot_of_param_[param_index]);
  }

  // ---- introspection -------------------------------------------------------------------------

  [[nodiscard]] std::vector<std::vector<std::size_t>> bucket_params() const {
    std::vector<std::vector<std::size_t>> out;
    for (const auto& b : buckets_) {
      out.emplace_back();
      for (std::size_t k : b.slots) out.back().push_back(slots_[k].param);
    }
    return out;
  }
  [[nodiscard]] std::vector<int> grid_exponents() const {
    std::vector<int> out;
    for (const auto& s : slots_) out.push_back(s.grid_exponent);  // slots are numbered in list order
    return out;
  }
  void check_grid_exponents(const std::vector<int>& exponents) const {
    if (!options_.deterministic)
      throw InvalidArgument(
          "Reducer::load_grid_exponents: this reducer is not deterministic (ReducerOptions::deterministic)");
    if (exponents.size() != slots_.size())
      throw InvalidArgument(fmt::format("Reducer::load_grid_exponents: {} exponents for {} trainable parameters",
                                        exponents.size(), slots_.size()));
    for (std::size_t k = 0; k < exponents.size(); ++k)
      if (exponents[k] < kGridMinExponent || exponents[k] > kGridMaxExponent)
        throw InvalidArgument(fmt::format("Reducer::load_grid_exponents: exponent {} of {} is outside [{}, {}]",
                                          exponents[k], list_.describe(slots_[k].param), kGridMinExponent,
                                          kGridMaxExponent));
  }
  void load_grid_exponents(const std::vector<int>& exponents) {
    std::lock_guard lock(mutex_);
    check_grid_exponents(exponents);
    if (window_ != WindowState::closed)
      throw Error("Reducer::load_grid_exponents: a window is open; load the exponents between optimizer steps");
    for (std::size_t k = 0; k < exponents.size(); ++k) slots_[k].grid_exponent = exponents[k];
  }
  [[nodiscard]] std::vector<at::Tensor> bucket_tensors() const {
    std::vector<at::Tensor> out;
    for (const auto& b : buckets_) out.push_back(b.head);
    return out;
  }
  [[nodiscard]] bool rebuilt() const noexcept { return order_.phase() == BucketOrder::Phase::rebuilt; }
  [[nodiscard]] HostReads host_reads() const noexcept { return reads_; }
  [[nodiscard]] std::int64_t gradient_arrivals() const noexcept { return arrivals_; }
  [[nodiscard]] const ParameterList& parameters() const noexcept { return list_; }
  [[nodiscard]] const ReducerOptions& options() const noexcept { return options_; }
  [[nodiscard]] Comm& communicator() const noexcept { return *comm_; }

 private:
  const at::Tensor& param(std::size_t k) const { return list_.params[slots_[k].param]; }

  bool synchronising() const noexcept {
    return window_ == WindowState::synchronising || window_ == WindowState::final_flush;
  }

  /// Copies `t` to the host, counting the read (a synchronisation point on a GPU).
  at::Tensor host_read(const at::Tensor& t) {
    count_host_read();
    return t.to(at::kCPU);
  }

  void count_host_read() {
    ++reads_.total;
    if (in_hook_) ++reads_.in_hooks;
  }

  /// Buckets for the current order; every defined gradient moves into its slot. The first bucket
  /// carries the window meta when its dtype has room (floating mode).
  void rebuild_buckets() {
    buckets_ = allocate_buckets(assign_slots(list_, slots_, order_.order(), options_), slots_, list_, options_,
                                comm_->world_size(), /*carry_meta=*/true);
    if (carries_meta() && !(on_host(buckets_.front().meta) && on_host(meta_)))
      meta_tables_ = MetaLimbs::tables(buckets_.front().meta_bits, device_);
  }

  /// Whether the window meta rides in the first bucket's all-reduce (else it is an all-reduce of its own).
  bool carries_meta() const noexcept { return !buckets_.empty() && buckets_.front().meta_bits > 0; }

  /// Waits (on the host) for bucket bi's all-reduce if it is still in flight; the first bucket's also
  /// gives the summed window meta (meta_) when it carries it.
  void wait_bucket(std::size_t bi) {
    if (!works_[bi]) return;
    works_[bi]->wait();
    works_[bi].reset();
    if (bi != 0 || !carries_meta() || meta_ready_) return;
    const auto& b = buckets_.front();
    if (on_host(b.meta) && on_host(meta_)) {
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, b.meta.scalar_type(), "loom_meta_decode", [&] {
        WindowMeta::write(meta_, MetaLimbs::decode(b.meta.data_ptr<scalar_t>(), b.meta_bits, comm_->world_size()));
      });
    } else {
      MetaLimbs::decode(b.meta, meta_tables_, meta_);
    }
    meta_ready_ = true;
  }

  /// First prepare_backward of a window: every gradient becomes its bucket slot.
  void begin_window() {
    check_parameter_set(list_, slot_of_param_, slots_, buckets_, accumulators_);
    if (order_.phase() == BucketOrder::Phase::pending) try_rebuild();
    if (options_.deterministic) {
      // A slot's integers are written by its first contribution (or zeroed when it leaves without
      // one): only the tail and the ATen path's buckets need zeros here.
      for (auto& b : buckets_) (b.qwire.defined() ? b.qtail : b.qflat).zero_();
      for (std::size_t k = 0; k < slots_.size(); ++k) {
        auto& s = slots_[k];
        reattach_grad(s, param(k).mutable_grad());  // a window that ended in an error
        s.window_contributions = 0;
        s.grid_pending = false;
        s.grid_sums = false;
        s.grad_detached = false;
      }
    }
    for (auto& b : buckets_) {
      const bool all_undefined =
          std::none_of(b.slots.begin(), b.slots.end(), [&](std::size_t k) { return param(k).grad().defined(); });
      if (all_undefined) b.head.zero_();
      for (std::size_t k : b.slots) {
        auto& s = slots_[k];
        auto& g = param(k).mutable_grad();
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
    window_ = WindowState::accumulating;
  }

  void mark_ready_locked(std::size_t k) {
    auto& s = slots_[k];
    auto& g = param(k).mutable_grad();
    check_not_late(s);              // before the in-flight integers are touched
    if (buckets_[s.bucket].main) {  // float32 accumulation: add this backward's 16-bit gradient, free it
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
    // Deterministic mode: the slot collects this micro-batch's gradients (autograd adds a second one
    // in place) and goes on the grid once, at the next prepare_backward or when its bucket leaves.
    if (options_.deterministic && window_ != WindowState::closed) s.grid_pending = true;
    s.used = true;
    order_.record(s);
    if (!synchronising()) return;
    auto& b = buckets_[s.bucket];
    if (s.fired) {
      // A second gradient in the synchronising backward. Before the bucket left it was simply added
      // to the slot, and the bucket is scaled as a whole when it leaves: (x + y) / N, exact.
      if (b.launched) {
        b.late_gradient = true;  // it was added to the slot: a finish_window after the error scans the bucket
        throw InvalidArgument(late_gradient_message(s));
      }
      return;
    }
    s.fired = true;
    if (--b.pending == 0) b.ready = true;
    if (!options_.overlap) return;
    while (next_launch_ < buckets_.size() && buckets_[next_launch_].ready) launch(next_launch_++);
  }

  /// Zeroes the slots of unused parameters, divides the bucket by the part of the divisor known now
  /// (WindowAverage::pre_divide: the world size, a power of two, when averaging by it), writes the
  /// used-flags and starts the bucket's all-reduce at once: the rest of the divisor is applied after
  /// it comes back (WindowAverage::apply), so a hook never waits for the window's count. Nothing here
  /// reads a value back to the host.
  void launch(std::size_t bi) {
    auto& b = buckets_[bi];
    for (std::size_t k : b.slots) {
      auto& s = slots_[k];
      if (s.used) continue;
      if (!s.was_undefined && !s.saved.defined()) s.saved = s.view.clone();
      s.view.zero_();  // an unused parameter's slot counts as zero
    }
    trace::Scope scope(*comm_, trace::Context::reducer_bucket, static_cast<std::int64_t>(bi));
    if (options_.deterministic) {
      if (b.qwire.defined()) {
        // The int32 wire when this rank's integers fit it; the last element tells every rank
        // whether some rank's did not (then the bucket goes again as int64 in reduce_on_grid). A
        // slot with this micro-batch's gradient goes onto the wire from the floating slot (plus its
        // earlier sums), leaving both as they are for that resend; a slot without one sends its sums.
        const std::int64_t len = b.qflat.numel(), tail = GridTail::length(static_cast<std::int64_t>(b.slots.size()));
        const std::int64_t limit = wire_limit(comm_->world_size());
        auto* w = b.qwire.data_ptr<std::int32_t>();
        auto* q = b.qflat.data_ptr<std::int64_t>();
        bool fits = true;
        for (std::size_t k : b.slots) {
          auto& s = slots_[k];
          const std::int64_t numel = param(k).numel();
          if (s.grid_pending) {
            ++s.window_contributions;
            GridFlags f;
            AT_DISPATCH_FLOATING_TYPES(b.flat.scalar_type(), "loom_grid_wire", [&] {
              f = quantize_to_wire_cpu(b.flat.data_ptr<scalar_t>() + s.offset, s.grid_sums ? q + s.offset : nullptr,
                                       w + s.offset, numel, s.grid_exponent, limit);
            });
            note_grid_flags(b, s, f);
            fits = fits && !f.wide;
            // The slot is the source of an int64 resend: a gradient arriving after the bucket left
            // (refused in mark_ready_locked) must not reach it, so .grad() leaves the slot until
            // finish_window.
            auto& g = param(k).mutable_grad();
            if (!b.main && g.defined() && aliases(g, s.view)) {
              g.reset();
              s.grad_detached = true;
            }
          } else if (s.grid_sums) {
            fits = narrow_to_wire_cpu(q + s.offset, w + s.offset, numel, limit) && fits;
          } else {
            std::fill(w + s.offset, w + s.offset + numel, std::int32_t{0});
          }
        }
        write_grid_tail(b);
        fits = narrow_to_wire_cpu(q + (len - tail), w + (len - tail), tail, limit) && fits;
        w[len] = fits ? 0 : 1;
        works_[bi] = start(b.qwire);
      } else {
        quantize_pending(bi);
        write_grid_tail(b);
        works_[bi] = start(b.qflat);
      }
      b.launched = true;
      return;
    }
    average_.pre_divide(b, options_.detect_non_finite);
    write_used_flags(b, slots_, &meta_row_);
    at::Tensor* target = &b.flat;
    if (b.wire.defined()) {
      // Compressed: divided by the world size while cast (the loss scale stays on the wire); the
      // rest of the average is applied in float32 when the bucket is back (average_bucket).
      at::div_out(b.wire_head, b.head, b.wire_div);
      target = &b.wire;
    }
    works_[bi] = start(*target);
    b.launched = true;
  }

  Work start(at::Tensor& t) {
    if constexpr (AsyncCommunicator<Comm>) {
      return comm_->all_reduce_async(t, ReduceOp::sum);
    } else {
      comm_->all_reduce(t, ReduceOp::sum);
      return Work{};
    }
  }

  /// Deterministic mode: refuses a gradient of slot s that arrives in the synchronising backward
  /// after its bucket left. Throws: loom::InvalidArgument naming the parameter.
  void check_not_late(const GradSlot& s) const {
    if (options_.deterministic && synchronising() && s.fired && buckets_[s.bucket].launched)
      throw InvalidArgument(late_gradient_message(s));
  }

  /// The error for a gradient that arrives in the synchronising backward after its bucket left.
  std::string late_gradient_message(const GradSlot& s) const {
    return fmt::format(
        "Reducer: {} received a second gradient in the synchronising backward after its bucket was sent, so it "
        "would miss the all-reduce; run one backward per micro-batch (sum the losses first), or use overlap = false",
        list_.describe(s.param));
  }

  /// Floating mode: waits for each bucket in launch order and, while later buckets are still in
  /// flight, divides it to the average and scans it for inf/NaN (the reduced values are identical
  /// on every rank, so every rank reaches the same verdict; a sum that overflowed is caught too);
  /// then the window's one host read: counts, used-flags, verdicts, squared norm.
  WindowSummary reduce_floating(bool clip) {
    for (std::size_t bi = 0; bi < buckets_.size(); ++bi) {
      wait_bucket(bi);  // the first one also gives meta_ when it carries it
      LOOM_ASSERT(bi > 0 || !carries_meta() || meta_ready_, "the window meta was not decoded before its use");
      average_.apply(buckets_[bi], meta_, options_.detect_non_finite);
    }
    count_host_read();
    return WindowSummary::decode(WindowSummary::gather(meta_, buckets_, clip, device_), buckets_, slots_.size(), clip);
  }

  /// What the integer reduction of a window decided besides the summary.
  struct GridVerdict {
    bool overflow = false;                // a contribution left its grid: skip, coarser grids
    bool too_many_contributions = false;  // more than kGridMaxContributions: the sums may have wrapped
    std::int64_t contributions = 0;       // the largest per-rank contribution count, summed over ranks
  };

  /// Deterministic mode: puts the pending slots of bucket bi on the grid (quantize_slot): a bucket
  /// off the host whose slots are all pending in a fixed number of operators
  /// (quantize_add_bucket_aten), any other slot by slot.
  void quantize_pending(std::size_t bi) {
    auto& b = buckets_[bi];
    const bool whole =
        b.grid_lengths.defined() && !b.slots.empty() &&
        std::all_of(b.slots.begin(), b.slots.end(), [&](std::size_t k) { return slots_[k].grid_pending; });
    if (!whole) {
      for (std::size_t k : b.slots)
        if (slots_[k].grid_pending) quantize_slot(k);
      return;
    }
    std::vector<double> scales;
    scales.reserve(b.slots.size());
    for (std::size_t k : b.slots) {
      auto& s = slots_[k];
      ++s.window_contributions;
      s.grid_pending = false;
      s.grid_sums = true;
      scales.push_back(std::ldexp(1.0, s.grid_exponent));
    }
    quantize_add_bucket_aten(b.head, b.qhead, per_element(scales, b.grid_lengths, b.head.numel()), b.grid_lengths,
                             b.qtail);
  }

  /// Deterministic mode: adds the micro-batch's gradient that slot k holds (plus a gradient the
  /// parameter held when the window began) to the slot's integers on the slot's grid and zeroes the
  /// floating slot, flagging inf/NaN and overflow in the bucket's tail.
  void quantize_slot(std::size_t k) {
    auto& s = slots_[k];
    auto& b = buckets_[s.bucket];
    const auto n = static_cast<std::int64_t>(b.slots.size());
    const auto j = static_cast<std::int64_t>(s.flag);
    const std::int64_t numel = param(k).numel();
    ++s.window_contributions;
    s.grid_pending = false;
    const bool first = !s.grid_sums;  // the first contribution writes the sums (a bucket's are not zeroed)
    s.grid_sums = true;
    if (on_host(b.qflat) && has_fused_scan(b.flat)) {
      GridFlags f;
      AT_DISPATCH_FLOATING_TYPES(b.flat.scalar_type(), "loom_grid_quantize", [&] {
        f = quantize_add_cpu(b.flat.data_ptr<scalar_t>() + s.offset, b.qflat.data_ptr<std::int64_t>() + s.offset, numel,
                             s.grid_exponent, first);
      });
      note_grid_flags(b, s, f);
      return;
    }
    quantize_add_aten(b.flat.narrow(0, s.offset, numel), b.qflat.narrow(0, s.offset, numel), s.grid_exponent,
                      b.qtail.narrow(0, GridTail::non_finite(n), 1), b.qtail.narrow(0, GridTail::overflow(n, j), 1),
                      b.qtail.narrow(0, GridTail::near(n, j), 1));
  }

  /// Deterministic mode, a bucket on the CPU: what putting slot s's contribution on the grid found,
  /// into the bucket's tail.
  static void note_grid_flags(GradBucket& b, const GradSlot& s, const GridFlags& f) {
    const auto n = static_cast<std::int64_t>(b.slots.size());
    const auto j = static_cast<std::int64_t>(s.flag);
    auto* t = b.qtail.data_ptr<std::int64_t>();
    if (f.non_finite) t[GridTail::non_finite(n)] = 1;
    if (f.overflow) t[GridTail::overflow(n, j)] = 1;
    if (f.near) t[GridTail::near(n, j)] = 1;
  }

  /// Deterministic mode: this rank's used-flags and contribution counts into bucket b's tail. A
  /// bucket on a GPU stages them in pinned memory and copies them without waiting (a hook never waits).
  void write_grid_tail(GradBucket& b) {
    const auto n = static_cast<std::int64_t>(b.slots.size());
    at::Tensor host = on_host(b.qtail) ? b.qtail : b.qflags_host;
    auto* t = host.data_ptr<std::int64_t>();
    const std::int64_t c0 = on_host(b.qtail) ? GridTail::contributions(n, 0) : n;  // staging: [used n | counts n]
    for (std::int64_t j = 0; j < n; ++j) {
      const auto& s = slots_[b.slots[static_cast<std::size_t>(j)]];
      t[GridTail::used(n, j)] = s.used ? 1 : 0;
      t[c0 + j] = s.window_contributions;
    }
    if (on_host(b.qtail)) return;
    b.qtail.narrow(0, 0, n).copy_(b.qflags_host.narrow(0, 0, n), /*non_blocking=*/true);
    b.qtail.narrow(0, GridTail::contributions(n, 0), n).copy_(b.qflags_host.narrow(0, n, n), /*non_blocking=*/true);
  }

  /// Deterministic mode: waits for each integer bucket in launch order and turns it back into the
  /// floating bucket, (q x 2^-e x mean loss divisor x grad_scale) / divisor, divisor the window's
  /// sample count (average = samples) or 1 (none); then decides the verdicts and the next grid
  /// exponents from the reduced integers, which are the same on every rank. Host reads: none on
  /// the CPU; on a GPU one for the window meta, one for the tails and maxima, one more for clipping.
  WindowSummary reduce_on_grid(bool clip, GridVerdict& verdict, std::int64_t& wide_buckets) {
    const at::Tensor m = on_host(meta_) ? meta_ : host_read(meta_);
    WindowSummary summary;
    summary.counts = WindowCounts::decode(m.data_ptr<std::int64_t>());
    const WindowCounts& c = summary.counts;
    const double divisor =
        options_.average == Average::samples ? static_cast<double>(std::max<std::int64_t>(c.samples, 1)) : 1.0;
    const double multiplier =
        (c.voters > 0 ? static_cast<double>(c.divisor_sum) / static_cast<double>(c.voters) : 1.0) * grad_scale_;

    // Per bucket: [largest |q| per slot (n) | result not finite (1) | the reduced tail], on the host.
    std::vector<std::vector<std::int64_t>> info(buckets_.size());
    std::vector<at::Tensor> device_info;
    for (std::size_t bi = 0; bi < buckets_.size(); ++bi) {
      works_[bi]->wait();
      auto& b = buckets_[bi];
      const auto n = static_cast<std::int64_t>(b.slots.size());
      if (on_host(b.qflat) && has_fused_scan(b.flat)) {
        // The int32 wire's sums, unless some rank's integers did not fit it: then every rank (the
        // flag is the reduced one) sends the bucket again as int64, in bucket order.
        bool narrow = b.qwire.defined();
        const std::int64_t len = b.qflat.numel();
        if (narrow && b.qwire.data_ptr<std::int32_t>()[len] > 0) {
          // This rank's int64 sums of the window, from the floating slots the wire was written from.
          auto* q = b.qflat.data_ptr<std::int64_t>();
          for (std::size_t k : b.slots) {
            const auto& s = slots_[k];
            const std::int64_t numel = param(k).numel();
            if (s.grid_pending) {
              AT_DISPATCH_FLOATING_TYPES(b.flat.scalar_type(), "loom_grid_widen", [&] {
                quantize_add_cpu(b.flat.data_ptr<scalar_t>() + s.offset, q + s.offset, numel, s.grid_exponent,
                                 /*first=*/!s.grid_sums, /*keep_gradient=*/true);
              });
            } else if (!s.grid_sums) {
              std::fill(q + s.offset, q + s.offset + numel, std::int64_t{0});
            }
          }
          trace::Scope scope(*comm_, trace::Context::reducer_bucket, static_cast<std::int64_t>(bi));
          Work wide = start(b.qflat);
          wide.wait();
          ++wide_buckets;
          narrow = false;
        }
        if (narrow) {
          const std::int32_t* wt = b.qwire.data_ptr<std::int32_t>() + (len - GridTail::length(n));
          std::copy(wt, wt + GridTail::length(n), b.qtail.data_ptr<std::int64_t>());
        }
        auto& v = info[bi];
        v.assign(static_cast<std::size_t>(n + 1), 0);
        bool bad = false;
        AT_DISPATCH_FLOATING_TYPES(b.flat.scalar_type(), "loom_grid_dequantize", [&] {
          for (std::int64_t j = 0; j < n; ++j) {
            const auto& s = slots_[b.slots[static_cast<std::size_t>(j)]];
            const std::int64_t numel = param(b.slots[static_cast<std::size_t>(j)]).numel();
            scalar_t* out = b.flat.data_ptr<scalar_t>() + s.offset;
            v[static_cast<std::size_t>(j)] = narrow ? dequantize_cpu(b.qwire.data_ptr<std::int32_t>() + s.offset, out,
                                                                     numel, s.grid_exponent, multiplier, divisor, bad)
                                                    : dequantize_cpu(b.qflat.data_ptr<std::int64_t>() + s.offset, out,
                                                                     numel, s.grid_exponent, multiplier, divisor, bad);
          }
        });
        if (b.main && !bad) bad = !at::isfinite(b.head.to(b.param_dtype)).all().template item<bool>();
        v[static_cast<std::size_t>(n)] = bad ? 1 : 0;
        const auto* t = b.qtail.data_ptr<std::int64_t>();
        v.insert(v.end(), t, t + GridTail::length(n));
        continue;
      }
      std::vector<at::Tensor> parts;
      at::Tensor bad;
      if (b.grid_lengths.defined()) {  // off the host: the whole bucket in a fixed number of operators
        std::vector<double> factors;
        factors.reserve(b.slots.size());
        for (std::size_t k : b.slots) factors.push_back(grid_factor(slots_[k].grid_exponent, multiplier, divisor));
        auto [largest, not_finite] = dequantize_bucket_aten(
            b.qhead, b.head, per_element(factors, b.grid_lengths, b.head.numel()), b.grid_lengths);
        parts.push_back(largest);
        bad = not_finite;
      } else {
        bad = at::zeros({1}, b.qflat.options());
        for (std::size_t k : b.slots) {
          const auto& s = slots_[k];
          const std::int64_t numel = param(k).numel();
          auto [largest, not_finite] =
              dequantize_aten(b.qflat.narrow(0, s.offset, numel), b.flat.narrow(0, s.offset, numel), s.grid_exponent,
                              multiplier, divisor);
          parts.push_back(largest);
          bad.add_(not_finite);
        }
      }
      if (b.main) bad.add_(non_finite_flag(b.head, at::kLong, b.param_dtype));
      parts.push_back(bad);
      parts.push_back(b.qtail);
      device_info.push_back(at::cat(parts).to(device_));
    }
    if (!device_info.empty()) {  // one read for every bucket that lives off the host
      const at::Tensor all = host_read(at::cat(device_info));
      const auto* p = all.data_ptr<std::int64_t>();
      for (std::size_t bi = 0; bi < buckets_.size(); ++bi) {
        if (!info[bi].empty()) continue;
        const auto n = static_cast<std::int64_t>(buckets_[bi].slots.size());
        const auto len = static_cast<std::size_t>(n + 1 + GridTail::length(n));
        info[bi].assign(p, p + len);
        p += len;
      }
    }

    summary.used.assign(slots_.size(), 0);
    std::vector<char> overflowed(slots_.size(), 0), near(slots_.size(), 0);
    std::vector<std::int64_t> largest(slots_.size(), 0);
    for (std::size_t bi = 0; bi < buckets_.size(); ++bi) {
      const auto& b = buckets_[bi];
      const auto n = static_cast<std::int64_t>(b.slots.size());
      const std::int64_t* v = info[bi].data();
      const std::int64_t* t = v + n + 1;
      if (v[n] > 0 || t[GridTail::non_finite(n)] > 0) summary.non_finite = true;
      for (std::int64_t j = 0; j < n; ++j) {
        const std::size_t k = b.slots[static_cast<std::size_t>(j)];
        verdict.contributions = std::max(verdict.contributions, t[GridTail::contributions(n, j)]);
        largest[k] = v[j];
        summary.used[k] = t[GridTail::used(n, j)] > 0 ? 1 : 0;
        overflowed[k] = t[GridTail::overflow(n, j)] > 0 ? 1 : 0;
        near[k] = t[GridTail::near(n, j)] > 0 ? 1 : 0;
      }
    }
    verdict.too_many_contributions = verdict.contributions > kGridMaxContributions;
    verdict.overflow = std::any_of(overflowed.begin(), overflowed.end(), [](char o) { return o != 0; });
    if (verdict.overflow) {
      std::string names;
      for (std::size_t k = 0; k < slots_.size(); ++k) {
        if (!overflowed[k]) continue;
        slots_[k].grid_exponent = backed_off_grid_exponent(slots_[k].grid_exponent);
        names += fmt::format("{}{} (now 2^{})", names.empty() ? "" : ", ", list_.describe(slots_[k].param),
                             -slots_[k].grid_exponent);
      }
      TORCH_WARN_ONCE(
          "loom::Reducer (deterministic): a gradient was too large for its integer grid; every rank "
          "skipped the step and made the grid coarser: ",
          names, ". Reduction::grid_overflow reports each such step; this warning is shown once.");
    } else if (!summary.non_finite && !verdict.too_many_contributions) {
      for (std::size_t k = 0; k < slots_.size(); ++k)
        slots_[k].grid_exponent =
            next_grid_exponent(slots_[k].grid_exponent, largest[k], near[k] != 0, summary.used[k] != 0);
    }
    if (clip) {
      // Per parameter, summed in parameter order: the bucket split (rank 0's first ready order, which
      // can depend on the world size) does not enter the norm.
      std::vector<at::Tensor> norms;
      for (std::size_t k = 0; k < slots_.size(); ++k) {
        const auto& b = buckets_[slots_[k].bucket];
        const at::Tensor g = b.flat.narrow(0, slots_[k].offset, param(k).numel());
        norms.push_back(at::norm(g, 2, compute_dtype(g.scalar_type())).to(at::kDouble).reshape({1}));
      }
      const bool host =
          std::all_of(buckets_.begin(), buckets_.end(), [](const GradBucket& b) { return on_host(b.flat); });
      if (!host)
        for (auto& n : norms) n = n.to(device_);
      const at::Tensor all = host ? at::cat(norms) : host_read(at::cat(norms));
      double sumsq = 0;
      for (std::int64_t k = 0; k < all.numel(); ++k) sumsq += all.data_ptr<double>()[k] * all.data_ptr<double>()[k];
      summary.squared_norm = sumsq;
    }
    return summary;
  }

  /// Waits (on the host) for the window meta's own all-reduce (started in prepare_backward), if any.
  void wait_meta() {
    if (meta_work_) {
      meta_work_->wait();
      meta_work_.reset();
    }
  }

  /// A final flush that found nothing anywhere: undo the window's setup.
  void discard_window() {
    for (std::size_t k = 0; k < slots_.size(); ++k) {
      auto& s = slots_[k];
      reattach_grad(s, param(k).mutable_grad());
      if (s.used)
        s.view.zero_();
      else if (s.was_undefined)
        param(k).mutable_grad().reset();
      else if (buckets_[s.bucket].main)  // the gradient it held before the window
        param(k).mutable_grad() = (s.saved.defined() ? s.saved : s.view).to(param(k).scalar_type());
      else if (s.saved.defined())  // its bucket left (the first, carrying the meta): the slot was zeroed
        s.view.copy_(s.saved);
    }
    meta_work_.reset();
    close_window();
  }

  /// A gradient taken off its slot when its bucket left (launch) becomes the slot again.
  static void reattach_grad(GradSlot& s, at::Tensor& g) {
    if (!s.grad_detached) return;
    g = s.view;
    s.grad_detached = false;
  }

  void close_window() {
    for (auto& s : slots_) s.saved = at::Tensor();
    window_ = WindowState::closed;
  }

  /// After the first synchronising window: rank 0's ready order, broadcast, becomes the bucket order.
  void try_rebuild() {
    at::Tensor positions = order_.take_positions(slots_);
    if (comm_->world_size() > 1) {
      auto shared = positions.to(device_);
      trace::Scope scope(*comm_, trace::Context::bucket_order);
      comm_->broadcast(shared, 0);
      positions = host_read(shared);
    }
    if (order_.adopt(positions.contiguous())) rebuild_buckets();
  }

  Comm* comm_;
  ReducerOptions options_;
  ParameterList list_;
  c10::Device device_;  // where the communicator's collectives run (meta_, the summary)
  std::vector<GradSlot> slots_;
  std::vector<std::size_t> slot_of_param_;
  std::vector<GradBucket> buckets_;
  BucketOrder order_;
  std::vector<std::optional<Work>> works_;
  std::optional<Work> meta_work_;  // the window meta's own all-reduce (when the first bucket does not carry it)
  at::Tensor meta_;                // the window meta (WindowMeta) on device_: this rank's row, then the sum
  WindowMeta::Row meta_row_{};     // this rank's row of the open synchronising window
  bool meta_ready_ = false;        // meta_ holds the window's sum (decoded from the first bucket)
  std::pair<at::Tensor, at::Tensor> meta_tables_;  // MetaLimbs::tables for a first bucket off the host
  std::int64_t fingerprint_ = 0;                   // this rank's flight-recorder fingerprint in the open window's meta
  std::optional<std::int64_t> replica_fingerprint_;  // compare_replicas: compared in every synchronising window's meta
  WindowAverage average_;
  std::vector<GradAccumulatorPtr> accumulators_;
  std::vector<std::uintptr_t> keys_;
  std::mutex mutex_;
  std::size_t next_launch_ = 0;
  HostReads reads_;
  std::int64_t arrivals_ = 0;      // gradients delivered by autograd hooks since construction
  std::int64_t loss_divisor_ = 1;  // this rank's BackwardPlan::loss_divisor of the current sync window (0: none)
  double grad_scale_ = 1.0;        // BackwardPlan::grad_scale of the current sync window
  WindowState window_ = WindowState::closed;
  bool in_hook_ = false;  // a gradient hook is running (HostReads::in_hooks)
};

}  // namespace loom::detail
