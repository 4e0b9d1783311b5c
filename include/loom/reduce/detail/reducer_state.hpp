// loom/reduce/detail/reducer_state.hpp — the engine behind loom::Reducer: autograd hooks, the
// window state machine (prepare_backward / hooks / finish_window), bucket launch and the one
// summary read per step. The rules it implements are documented in loom/reduce/reducer.hpp.
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
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <loom/comm/communicator.hpp>
#include <loom/detail/torch_api.hpp>
#include <loom/error.hpp>
#include <loom/reduce/buckets.hpp>
#include <loom/reduce/concepts.hpp>
#include <loom/reduce/detail/bucket.hpp>
#include <loom/reduce/detail/scale.hpp>
#include <loom/reduce/detail/work.hpp>
#include <loom/reduce/options.hpp>
#include <loom/reduce/parameters.hpp>

namespace loom::detail {

/// Carried by every loom reducer's gradient hook (whatever its communicator type), so that a second
/// reducer on the same parameters finds the first one's hooks (see ReducerState's constructor).
class ReducerHookMarker {
 public:
  virtual ~ReducerHookMarker() = default;
};

/// The describe() text of the first trainable parameter in `list` whose gradient accumulator already
/// carries a loom reducer's hook, or an empty string. Creates missing accumulators (as hooking does).
inline std::string first_hooked_parameter(const ParameterList& list) {
  for (std::size_t i = 0; i < list.params.size(); ++i) {
    const auto& p = list.params[i];
    if (!p.defined() || !p.requires_grad() || !p.is_leaf()) continue;
    auto acc = torch::autograd::impl::grad_accumulator(p);
    if (acc == nullptr) continue;
    for (const auto& hook : acc->post_hooks())
      if (dynamic_cast<const ReducerHookMarker*>(hook.get()) != nullptr) return list.describe(i);
  }
  return {};
}

/// Throws loom::InvalidArgument when a trainable parameter of `list` is already hooked by another
/// live loom::Reducer (see first_hooked_parameter). `who` starts the message.
inline void check_not_hooked(const ParameterList& list, const char* who) {
  if (const std::string hooked = first_hooked_parameter(list); !hooked.empty())
    throw InvalidArgument(fmt::format(
        "{}: {} already belongs to another live loom::Reducer (a second Trainer or Reducer on the same model "
        "while the first exists); both would take its gradient, and one of them would apply it unreduced. "
        "Destroy the first before building another (one Trainer per model: keep it, or scope each phase's "
        "Trainer so it ends before the next begins)",
        who, hooked));
}

template <class State>
class GradReadyHook final : public torch::autograd::FunctionPostHook, public ReducerHookMarker {
 public:
  GradReadyHook(State* state, std::size_t slot) : state_(state), slot_(slot) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    state_->on_grad_ready(slot_);
    return outputs;
  }

 private:
  State* state_;
  std::size_t slot_;
};

/// All of Reducer's state, at a stable address (autograd hooks point at it).
template <class Comm>
class ReducerState {
 public:
  using Work = typename WorkOf<Comm>::type;

  ReducerState(Comm& comm, ParameterList list, ReducerOptions options)
      : comm_(&comm), options_(std::move(options)), list_(std::move(list)), device_(comm.device()) {
    validate_options();
    if (!list_.names.empty() && list_.names.size() != list_.params.size())
      throw InvalidArgument(
          fmt::format("Reducer: {} names for {} parameters", list_.names.size(), list_.params.size()));
    // Before any collective: every rank of the same program reaches the same verdict.
    check_not_hooked(list_, "Reducer");
    if (options_.check_parameters) check_same_parameters(*comm_, list_);
    if (options_.broadcast_parameters) broadcast_from_rank0(*comm_, list_);

    slot_of_param_.assign(list_.params.size(), kNoSlot);
    for (std::size_t i = 0; i < list_.params.size(); ++i) {
      const auto& p = list_.params[i];
      if (!p.defined()) throw InvalidArgument(fmt::format("Reducer: {} is undefined", list_.describe(i)));
      if (!p.requires_grad()) continue;  // frozen: never reduced
      if (!p.is_leaf())
        throw InvalidArgument(fmt::format(
            "Reducer: {} is not a leaf tensor (it has a grad_fn); pass the model's parameters", list_.describe(i)));
      if (!at::isFloatingType(p.scalar_type()))
        throw InvalidArgument(
            fmt::format("Reducer: {} has dtype {}; gradients are reduced for float32, float64, float16 and bfloat16",
                        list_.describe(i), c10::toString(p.scalar_type())));
      for (std::size_t j = 0; j < i; ++j)
        if (list_.params[j].unsafeGetTensorImpl() == p.unsafeGetTensorImpl())
          throw InvalidArgument(fmt::format("Reducer: {} and {} are the same tensor; list shared parameters once",
                                            list_.describe(j), list_.describe(i)));
      slot_of_param_[i] = slots_.size();
      GradSlot s;
      s.param = i;
      slots_.push_back(std::move(s));
    }
    order_ = reverse_order(slots_.size());
    build(assign(order_));
    recording_ = options_.rebuild_buckets;
    meta_ = at::zeros({kMetaLen}, at::TensorOptions().dtype(at::kLong).device(device_));
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
    if (sync_)
      throw Error("Reducer::prepare_backward: the previous synchronising backward was not closed with finish_window()");
    if (plan.final && !plan.sync) throw InvalidArgument("Reducer::prepare_backward: final = true needs sync = true");
    if (plan.leaving && !plan.sync)
      throw InvalidArgument("Reducer::prepare_backward: leaving = true needs sync = true");
    if (plan.window_samples < 0)
      throw InvalidArgument(
          fmt::format("Reducer::prepare_backward: window_samples = {} (must be >= 0)", plan.window_samples));
    if (!std::isfinite(plan.grad_scale) || plan.grad_scale <= 0)
      throw InvalidArgument(
          fmt::format("Reducer::prepare_backward: grad_scale = {} (must be finite and > 0)", plan.grad_scale));
    if (plan.loss_divisor < 0 || plan.loss_divisor > kMaxLossDivisor)
      throw InvalidArgument(fmt::format("Reducer::prepare_backward: loss_divisor = {} (must be in [0, {}])",
                                        plan.loss_divisor, kMaxLossDivisor));
    if (static_cast<double>(comm_->world_size()) * static_cast<double>(plan.loss_divisor) *
            static_cast<double>(plan.loss_divisor) >
        kExactInDouble)
      throw InvalidArgument(fmt::format(
          "Reducer::prepare_backward: loss_divisor = {} on {} ranks: the check that every rank uses the same divisor "
          "sums their squares, which must stay below 2^53 (use a divisor <= {})",
          plan.loss_divisor, comm_->world_size(),
          static_cast<std::int64_t>(std::sqrt(kExactInDouble / comm_->world_size()))));
    at::NoGradGuard no_grad;
    if (!window_open_) begin_window();
    for (auto& s : slots_) s.fired = false;
    if (!plan.sync) return;
    sync_ = true;
    final_ = plan.final;
    grad_scale_ = plan.grad_scale;
    loss_divisor_ = plan.loss_divisor;
    // Without a loss scale, divide: each rank's share is then exactly rounded (one rank: the mean is)
    // when the divisor is an integer (loss divisor 1, or one that divides the count).
    divide_ = grad_scale_ == 1.0;
    factors_.clear();
    for (auto& b : buckets_) {
      b.pending = b.slots.size();
      b.ready = false;
      b.launched = false;
    }
    works_.assign(buckets_.size(), std::nullopt);
    next_launch_ = 0;
    // [count, final, leaving, d, d^2, votes]: a rank with a loss divisor d >= 1 votes; the sums of d
    // and d^2 over the n voters tell every rank alike whether they all used the same d ((sum d)^2 ==
    // n * sum d^2 only then), and that d (sum d / n) is every rank's, voters or not.
    const std::int64_t d = plan.loss_divisor;
    const std::int64_t values[kMetaLen] = {plan.window_samples, plan.final ? 1 : 0, plan.leaving ? 1 : 0, d, d * d,
                                           d > 0 ? 1 : 0};
    if (meta_.is_cpu())
      std::copy(values, values + kMetaLen, meta_.data_ptr<std::int64_t>());
    else
      meta_.copy_(at::tensor(std::vector<std::int64_t>(values, values + kMetaLen), at::kLong),
                  /*non_blocking=*/false);
    meta_work_ = start(meta_);
  }

  Reduction finish_window() {
    std::lock_guard lock(mutex_);
    if (!sync_)
      throw Error("Reducer::finish_window: no synchronising backward was prepared (prepare_backward({.sync = true}))");
    at::NoGradGuard no_grad;
    Reduction r;
    const int world = comm_->world_size();
    wait_meta();   // started before backward: long done unless nothing was sent yet
    if (final_) {  // a flush without backward: skip the buckets when every rank flushes and nobody has a sample
      const at::Tensor m = host_read(meta_);
      const auto* v = m.data_ptr<std::int64_t>();
      if (v[1] == world && v[0] == 0 && v[2] == 0) {
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
    for (std::size_t bi = 0; bi < buckets_.size(); ++bi) {
      works_[bi]->wait();
      average_bucket(buckets_[bi]);
    }

    // The window's one host read: count, final and leaving flags, used-flags and inf/NaN verdicts, squared norm.
    const std::vector<double> summary = read_summary(clip);
    const double* v = summary.data();
    const auto count = static_cast<std::int64_t>(v[0]);
    const bool no_samples = options_.average == Average::samples && count == 0;
    r.global_samples = count;
    r.all_final = static_cast<std::int64_t>(v[1]) == world;
    r.ranks_leaving = static_cast<std::int64_t>(v[2]);
    // A rank leaving its loop closes its window as it is: its report comes first.
    const bool divisors_differ = r.ranks_leaving == 0 && loss_divisors_differ(v[5], v[3], v[4]);
    bool non_finite = false;
    global_used_.assign(slots_.size(), 0);
    std::size_t pos = kMetaLen;
    for (const auto& b : buckets_) {
      for (std::size_t j = 0; j < b.slots.size(); ++j) global_used_[b.slots[j]] = v[pos + j] > 0 ? 1 : 0;
      pos += b.slots.size();
      if (v[pos++] != 0) non_finite = true;  // the scan of the reduced bucket
    }
    if (clip && !no_samples) {
      const double total = std::sqrt(v[pos]);
      r.grad_norm = total;
      if (!std::isfinite(total)) non_finite = true;
      if (!non_finite) {
        const double coef = std::min(1.0, *options_.max_grad_norm / (total + 1e-6));
        r.clip_coef = coef;
        if (coef < 1.0)
          for (auto& b : buckets_) b.head.mul_(coef);
      }
    }
    if (non_finite || no_samples || r.ranks_leaving > 0 || divisors_differ)
      for (auto& b : buckets_) b.head.zero_();
    r.non_finite = non_finite;
    r.no_samples = no_samples;
    r.reduced = true;
    // Parameters unused on every rank get back the gradient they had before the window; a
    // float32-accumulated parameter's .grad() becomes the 16-bit copy of its average.
    for (std::size_t k = 0; k < slots_.size(); ++k) {
      auto& s = slots_[k];
      const bool main = buckets_[s.bucket].main;
      auto& g = param(k).mutable_grad();
      if (global_used_[k]) {
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
    if (recording_) rebuild_pending_ = true;
    if (divisors_differ)
      throw InvalidArgument(fmt::format(
          "Reducer::finish_window: the ranks divided their losses by different loss_divisor values (this rank: {}; "
          "mean over the {} ranks that gave one: {}); every rank must use the same divisor for a window (gradients "
          "zeroed, the step not applied)",
          loss_divisor_, static_cast<std::int64_t>(v[5]), v[3] / v[5]));
    if (options_.broadcast_buffers && world > 1 && !list_.buffers.empty())
      broadcast_from_rank0(*comm_, ParameterList{.names = {}, .params = {}, .buffers = list_.buffers});
    return r;
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
    if (!window_open_) throw Error("Reducer::mark_ready: call prepare_backward() first");
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
  [[nodiscard]] std::vector<at::Tensor> bucket_tensors() const {
    std::vector<at::Tensor> out;
    for (const auto& b : buckets_) out.push_back(b.head);
    return out;
  }
  [[nodiscard]] bool rebuilt() const noexcept { return rebuilt_; }
  [[nodiscard]] HostReads host_reads() const noexcept { return reads_; }
  [[nodiscard]] std::int64_t gradient_arrivals() const noexcept { return arrivals_; }
  [[nodiscard]] const ParameterList& parameters() const noexcept { return list_; }
  [[nodiscard]] const ReducerOptions& options() const noexcept { return options_; }
  [[nodiscard]] Comm& communicator() const noexcept { return *comm_; }

 private:
  static constexpr std::size_t kNoSlot = static_cast<std::size_t>(-1);
  static constexpr std::int64_t kMetaLen = 6;  // the window's [count, final, leaving, d, d^2, votes], summed
  static constexpr double kExactInDouble = 9007199254740992.0;  // 2^53
  /// Whether the voters' loss divisors d_r differ, from their number, sum and sum of squares (exact
  /// integers): n * sum d^2 - (sum d)^2 = sum over pairs of (d_r - d_s)^2, zero only when all are equal.
  static bool loss_divisors_differ(double voters, double sum, double sum_squares) {
    __extension__ typedef __int128 Wide;  // (sum d)^2 needs up to 66 bits
    const auto s = static_cast<Wide>(static_cast<std::int64_t>(sum));
    const auto q = static_cast<Wide>(static_cast<std::int64_t>(sum_squares));
    return static_cast<Wide>(static_cast<std::int64_t>(voters)) * q != s * s;
  }

  /// Whether `p`'s gradient is summed in a float32 slot (ReducerOptions::float32_accumulation).
  bool accumulates_in_float32(const at::Tensor& p) const {
    return options_.float32_accumulation && (p.scalar_type() == at::kHalf || p.scalar_type() == at::kBFloat16);
  }

  const at::Tensor& param(std::size_t k) const { return list_.params[slots_[k].param]; }

  void validate_options() const {
    if (options_.bucket_cap_bytes == 0 || options_.first_bucket_cap_bytes == 0)
      throw InvalidArgument(
          fmt::format("Reducer: bucket caps must be > 0 bytes (bucket_cap_bytes = {}, first_bucket_cap_bytes = {})",
                      options_.bucket_cap_bytes, options_.first_bucket_cap_bytes));
    if (options_.wire_dtype && *options_.wire_dtype != at::kHalf && *options_.wire_dtype != at::kBFloat16)
      throw InvalidArgument(
          fmt::format("Reducer: wire_dtype {} is not float16 or bfloat16", c10::toString(*options_.wire_dtype)));
    if (options_.max_grad_norm && !(*options_.max_grad_norm > 0))
      throw InvalidArgument(fmt::format("Reducer: max_grad_norm = {} (must be > 0)", *options_.max_grad_norm));
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

  /// Whether bucket `b` and the window's count are host memory (a CPU communicator and CPU
  /// gradients): then scalars are read directly instead of computed by device ops.
  bool host_side(const GradBucket& b) const { return meta_.is_cpu() && b.flat.is_cpu(); }

  /// The window's summary as float64 on the host, in this order: count, number of final ranks, number
  /// of leaving ranks, then per bucket its used-flags (summed over ranks) and its inf/NaN verdict, then
  /// (clipping) the squared global norm. One counted read: a device-to-host copy of one small tensor,
  /// or direct reads of host memory when everything lives there.
  std::vector<double> read_summary(bool clip) {
    const bool on_host = meta_.is_cpu() && std::all_of(buckets_.begin(), buckets_.end(),
                                                       [](const GradBucket& b) { return b.flat.is_cpu(); });
    count_host_read();
    std::vector<double> out;
    if (on_host) {
      const auto* m = meta_.data_ptr<std::int64_t>();
      out.assign(m, m + kMetaLen);
      double sumsq = 0;
      for (const auto& b : buckets_) {
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
    std::vector<at::Tensor> pieces{meta_.to(at::kDouble)};
    std::vector<at::Tensor> norms;
    for (const auto& b : buckets_) {
      pieces.push_back((b.wire.defined() ? b.wire_tail : b.tail).to(device_, at::kDouble));
      pieces.push_back(b.bad.to(device_, at::kDouble));
      if (clip)
        norms.push_back(at::norm(b.head, 2, compute_dtype(b.head.scalar_type())).to(device_, at::kDouble).reshape({1}));
    }
    if (clip) pieces.push_back(at::cat(norms).square().sum().reshape({1}));
    const at::Tensor summary = at::cat(pieces).to(at::kCPU);
    const auto* d = summary.data_ptr<double>();
    out.assign(d, d + summary.numel());
    return out;
  }

  std::vector<std::vector<std::size_t>> assign(const std::vector<std::size_t>& order) const {
    std::vector<GradSpec> specs;
    std::vector<std::pair<c10::ScalarType, c10::Device>> kinds;
    for (std::size_t k = 0; k < slots_.size(); ++k) {
      const auto& p = param(k);
      const std::pair<c10::ScalarType, c10::Device> key{p.scalar_type(), p.device()};
      auto it = std::find(kinds.begin(), kinds.end(), key);
      if (it == kinds.end()) it = kinds.insert(kinds.end(), key);
      specs.push_back({.numel = p.numel(),
                       .element_size = static_cast<std::int64_t>(accumulates_in_float32(p) ? 4 : p.element_size()),
                       .kind = static_cast<std::int64_t>(it - kinds.begin())});
    }
    return assign_buckets(
        specs, order,
        {.first_bucket_cap_bytes = options_.first_bucket_cap_bytes, .bucket_cap_bytes = options_.bucket_cap_bytes});
  }

  /// Allocates buckets for `assignment` (slot indices) and moves every defined gradient into them.
  void build(const std::vector<std::vector<std::size_t>>& assignment) {
    at::NoGradGuard no_grad;
    std::vector<GradBucket> fresh(assignment.size());
    for (std::size_t bi = 0; bi < assignment.size(); ++bi) {
      auto& b = fresh[bi];
      b.slots = assignment[bi];
      const auto& first = param(b.slots.front());
      std::int64_t total = 0;
      for (std::size_t k : b.slots) total += param(k).numel();
      const auto n = static_cast<std::int64_t>(b.slots.size());
      b.main = accumulates_in_float32(first);
      b.param_dtype = first.scalar_type();
      const auto opts = at::TensorOptions().dtype(b.main ? at::kFloat : first.scalar_type()).device(first.device());
      b.flat = at::zeros({total + n}, opts);
      b.head = b.flat.narrow(0, 0, total);
      b.tail = b.flat.narrow(0, total, n);
      b.bad = at::zeros({1}, opts.dtype(at::kFloat));
      if (options_.wire_dtype && b.flat.scalar_type() == at::kFloat) {
        b.wire = at::empty({total + n}, opts.dtype(*options_.wire_dtype));
        b.wire_head = b.wire.narrow(0, 0, total);
        b.wire_tail = b.wire.narrow(0, total, n);
        b.wire_div = at::full({1}, static_cast<double>(comm_->world_size()), opts);
      }
      if (!first.is_cpu())
        b.flags_host = at::empty({n}, at::TensorOptions()
                                          .dtype(b.wire.defined() ? *options_.wire_dtype : b.flat.scalar_type())
                                          .pinned_memory(true));
      std::int64_t offset = 0;
      std::size_t flag = 0;
      for (std::size_t k : b.slots) {
        auto& s = slots_[k];
        s.bucket = bi;
        s.offset = offset;
        s.flag = flag++;
        s.view = alias_into(b.flat, offset, param(k));
        auto& g = param(k).mutable_grad();
        if (g.defined() && !b.main) {  // a float32 slot takes the gradient at the window's start
          s.view.copy_(g);
          g = s.view;
        }
        offset += param(k).numel();
      }
    }
    buckets_ = std::move(fresh);
  }

  /// Throws loom::InvalidArgument when a parameter's trainability, dtype, device or shape, or the
  /// gradient accumulator the hooks hang on, changed since construction (e.g. module->to(dtype),
  /// which replaces the accumulators, or requires_grad_ toggled). Cost: a few reads per parameter.
  void check_parameter_set() const {
    constexpr const char* kAdvice = "build the Reducer after moving, casting, freezing or unfreezing the model";
    for (std::size_t i = 0; i < list_.params.size(); ++i) {
      const auto& p = list_.params[i];
      const std::size_t k = slot_of_param_[i];
      if (k == kNoSlot) {
        if (p.requires_grad())
          throw InvalidArgument(
              fmt::format("Reducer: {} was frozen (requires_grad = false) when the Reducer was built and is "
                          "trainable now, so its gradient would never be reduced; {}",
                          list_.describe(i), kAdvice));
        continue;
      }
      const auto& view = slots_[k].view;
      if (!p.requires_grad())
        throw InvalidArgument(fmt::format("Reducer: {} was trainable when the Reducer was built and is frozen now; {}",
                                          list_.describe(i), kAdvice));
      const c10::ScalarType built_dtype = buckets_[slots_[k].bucket].param_dtype;
      if (p.scalar_type() != built_dtype || p.device() != view.device() || p.sizes() != view.sizes())
        throw InvalidArgument(
            fmt::format("Reducer: {} is {} [{}] on {} now but was {} [{}] on {} when the Reducer was built "
                        "(e.g. module->to(...) afterwards); {}",
                        list_.describe(i), c10::toString(p.scalar_type()), fmt::join(p.sizes(), ", "), p.device().str(),
                        c10::toString(built_dtype), fmt::join(view.sizes(), ", "), view.device().str(), kAdvice));
      if (torch::autograd::impl::try_get_grad_accumulator(p).get() != accumulators_[k].get())
        throw InvalidArgument(
            fmt::format("Reducer: {} got a new gradient accumulator after the Reducer was built (set_data or "
                        "module->to(...) replaced it), so its gradient would bypass the reducer; {}",
                        list_.describe(i), kAdvice));
    }
  }

  /// First prepare_backward of a window: every gradient becomes its bucket slot.
  void begin_window() {
    check_parameter_set();
    if (rebuild_pending_) try_rebuild();
    rebuild_pending_ = false;
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
    window_open_ = true;
  }

  void mark_ready_locked(std::size_t k) {
    auto& s = slots_[k];
    auto& g = param(k).mutable_grad();
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
    s.used = true;
    if (recording_ && s.ready_pos < 0) s.ready_pos = next_ready_pos_++;
    if (!sync_) return;
    auto& b = buckets_[s.bucket];
    if (s.fired) {
      // A second gradient in the synchronising backward. Before the bucket left it was simply added
      // to the slot, and the bucket is scaled as a whole when it leaves: (x + y) / N, exact.
      if (b.launched)
        throw InvalidArgument(fmt::format(
            "Reducer: {} received a second gradient in the synchronising backward after its bucket was sent, so it "
            "would miss the all-reduce; run one backward per micro-batch (sum the losses first), or use overlap = "
            "false",
            list_.describe(s.param)));
      return;
    }
    s.fired = true;
    if (--b.pending == 0) b.ready = true;
    if (!options_.overlap) return;
    while (next_launch_ < buckets_.size() && buckets_[next_launch_].ready) launch(next_launch_++);
  }

  /// Zeroes the slots of unused parameters, writes the used-flags and starts the bucket's all-reduce
  /// at once: the sum is divided to the average after it comes back (average_bucket), so a hook
  /// never waits for the window's count. Nothing here reads a value back to the host.
  void launch(std::size_t bi) {
    auto& b = buckets_[bi];
    for (std::size_t k : b.slots) {
      auto& s = slots_[k];
      if (s.used) continue;
      if (!s.was_undefined && !s.saved.defined()) s.saved = s.view.clone();
      s.view.zero_();  // an unused parameter's slot counts as zero
    }
    write_flags(b);
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

  /// After bucket b's all-reduce: divides (or multiplies) its gradients by the window's factor —
  /// the sum over ranks becomes the average — and scans the result for inf/NaN in the same pass.
  /// A compressed bucket is first cast back from the wire, times its remaining factor. CPU
  /// float32/float64 with a CPU count: one fused pass, the verdict on the host (bad_host);
  /// elsewhere ATen ops on the device, the verdict in the device tensor b.bad (no host read).
  void average_bucket(GradBucket& b) {
    const bool check = options_.detect_non_finite;
    if (host_side(b)) {
      double value = host_factor(/*post_wire=*/b.wire.defined());
      bool divide = divide_ && !b.wire.defined();
      if (b.wire.defined()) {
        at::mul_out(b.head, b.wire_head, at::full({1}, value, b.head.options()));
        value = 1.0;
        divide = false;
      }
      if (has_fused_scan(b.flat)) {
        b.bad_host = scale_and_check_span(b.flat, 0, b.head.numel(), value, divide, check);
        if (check && b.main && !b.bad_host)
          b.bad_host = !at::isfinite(b.head.to(b.param_dtype)).all().template item<bool>();
        return;
      }
      // float16 / bfloat16 on the CPU: a one-element float32 operand makes ATen compute in float32.
      const at::Tensor f = at::full({1}, value, b.head.options().dtype(compute_dtype(b.head.scalar_type())));
      if (divide)
        b.head.div_(f);
      else if (value != 1.0)
        b.head.mul_(f);
      b.bad_host = check && !at::isfinite(b.head).all().template item<bool>();
      return;
    }
    if (b.wire.defined()) {
      at::mul_out(b.head, b.wire_head, device_factor(b.head, /*post_wire=*/true));
    } else {
      const at::Tensor& f = device_factor(b.head, /*post_wire=*/false);
      if (divide_)
        b.head.div_(f);
      else
        b.head.mul_(f);
    }
    if (check)  // a float32 average outside the parameters' 16-bit range would step with inf: non-finite too
      b.bad.copy_(non_finite_flag(b.main ? b.head.to(b.param_dtype) : b.head, at::kFloat));
    else
      b.bad.zero_();
  }

  /// The window's factor: the divisor (count, world size or 1) when dividing, else grad_scale /
  /// divisor; with post_wire, world size x grad_scale / divisor (what a compressed bucket still
  /// needs after its world-size pre-division). host_factor reads the count from host memory (a CPU
  /// communicator); device_factor computes it with device ops as a one-element tensor (no host read).
  double host_factor(bool post_wire) {
    wait_meta();
    const double base = options_.average == Average::samples
                            ? static_cast<double>(std::max<std::int64_t>(meta_.data_ptr<std::int64_t>()[0], 1))
                        : options_.average == Average::world_size ? static_cast<double>(comm_->world_size())
                                                                  : 1.0;
    // The losses were divided by the voters' d (sum d / n; 1 when nobody voted).
    const auto* m = meta_.data_ptr<std::int64_t>();
    const double divisor = m[5] > 0 ? base * static_cast<double>(m[5]) / static_cast<double>(m[3]) : base;
    if (post_wire) return comm_->world_size() * grad_scale_ / divisor;
    return divide_ ? divisor : grad_scale_ / divisor;
  }

  const at::Tensor& device_factor(const at::Tensor& like, bool post_wire) {
    const auto dtype = compute_dtype(like.scalar_type());
    for (const auto& f : factors_)
      if (f.dtype == dtype && f.device == like.device() && f.post_wire == post_wire) return f.value;
    wait_meta();
    const auto opts = at::TensorOptions().dtype(at::kDouble).device(meta_.device());
    at::Tensor divisor = options_.average == Average::samples
                             ? meta_.narrow(0, 0, 1).clamp_min(1).to(at::kDouble)
                             : at::full({1}, options_.average == Average::world_size ? comm_->world_size() : 1.0, opts);
    // The losses were divided by the voters' d: times n / sum d (both clamped to 1: nobody voted).
    divisor = divisor.mul(meta_.narrow(0, 5, 1).clamp_min(1).to(at::kDouble))
                  .div(meta_.narrow(0, 3, 1).clamp_min(1).to(at::kDouble));
    at::Tensor value = post_wire ? divisor.reciprocal().mul(comm_->world_size() * grad_scale_)
                       : divide_ ? divisor
                                 : divisor.reciprocal().mul(grad_scale_);
    factors_.push_back({dtype, like.device(), post_wire, value.to(like.device()).to(dtype)});
    return factors_.back().value;
  }

  Work start(at::Tensor& t) {
    if constexpr (AsyncCommunicator<Comm>) {
      return comm_->all_reduce_async(t, ReduceOp::sum);
    } else {
      comm_->all_reduce(t, ReduceOp::sum);
      return Work{};
    }
  }

  /// Waits (on the host) for the window's count all-reduce, started in prepare_backward.
  void wait_meta() {
    if (meta_work_) {
      meta_work_->wait();
      meta_work_.reset();
    }
  }

  // A bucket's tail: one used-flag per gradient (host-known; a GPU bucket copies them from pinned
  // memory without waiting).
  void write_flags(GradBucket& b) {
    const auto n = b.slots.size();
    auto fill = [&](auto* p) {
      using T = std::remove_pointer_t<decltype(p)>;
      for (std::size_t j = 0; j < n; ++j) p[j] = slots_[b.slots[j]].used ? T(1) : T(0);
    };
    at::Tensor tail = b.wire.defined() ? b.wire_tail : b.tail;
    at::Tensor dst = tail.is_cpu() ? tail : b.flags_host;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dst.scalar_type(), "loom_write_flags",
                                    [&] { fill(dst.data_ptr<scalar_t>()); });
    if (!tail.is_cpu()) tail.copy_(b.flags_host, /*non_blocking=*/true);
  }

  /// A final flush that found nothing anywhere: undo the window's setup.
  void discard_window() {
    for (std::size_t k = 0; k < slots_.size(); ++k) {
      auto& s = slots_[k];
      if (s.used)
        s.view.zero_();
      else if (s.was_undefined)
        param(k).mutable_grad().reset();
      else if (buckets_[s.bucket].main)  // the gradient it held before the window
        param(k).mutable_grad() = (s.saved.defined() ? s.saved : s.view).to(param(k).scalar_type());
    }
    meta_work_.reset();
    close_window();
  }

  void close_window() {
    for (auto& s : slots_) s.saved = at::Tensor();
    window_open_ = false;
    sync_ = false;
    final_ = false;
  }

  /// After the first step: rank 0's ready order, broadcast, becomes the bucket order.
  void try_rebuild() {
    const auto n = static_cast<std::int64_t>(slots_.size());
    auto order = at::empty({n}, at::kLong);
    auto* o = order.data_ptr<std::int64_t>();
    for (std::int64_t k = 0; k < n; ++k) o[k] = slots_[static_cast<std::size_t>(k)].ready_pos;
    if (comm_->world_size() > 1) {
      auto shared = order.to(device_);
      comm_->broadcast(shared, 0);
      order = host_read(shared);
    }
    o = order.data_ptr<std::int64_t>();
    const bool any = std::any_of(o, o + n, [](std::int64_t v) { return v >= 0; });
    for (auto& s : slots_) s.ready_pos = -1;
    next_ready_pos_ = 0;
    if (!any) return;  // rank 0 produced no gradient yet: record again during the next window
    std::vector<std::size_t> position(slots_.size());
    for (std::size_t p = 0; p < order_.size(); ++p) position[order_[p]] = p;
    std::vector<std::size_t> next(order_);
    std::stable_sort(next.begin(), next.end(), [&](std::size_t a, std::size_t b) {
      const auto pa = o[a] < 0 ? n : o[a], pb = o[b] < 0 ? n : o[b];
      return pa != pb ? pa < pb : position[a] < position[b];
    });
    order_ = std::move(next);
    build(assign(order_));
    rebuilt_ = true;
    recording_ = false;
  }

  struct Factor {
    c10::ScalarType dtype;
    c10::Device device;
    bool post_wire;
    at::Tensor value;
  };

  Comm* comm_;
  ReducerOptions options_;
  ParameterList list_;
  c10::Device device_;  // where the communicator's collectives run (meta_, the summary)
  std::vector<GradSlot> slots_;
  std::vector<std::size_t> slot_of_param_;
  std::vector<GradBucket> buckets_;
  std::vector<std::size_t> order_;  // launch order of slots
  std::vector<std::optional<Work>> works_;
  std::optional<Work> meta_work_;
  std::vector<char> global_used_;
  at::Tensor meta_;              // int64 [window samples, final, leaving, loss divisor, its square] on device_
  std::vector<Factor> factors_;  // this window's factors, per dtype / device
  std::vector<GradAccumulatorPtr> accumulators_;
  std::vector<std::uintptr_t> keys_;
  std::mutex mutex_;
  std::size_t next_launch_ = 0;
  HostReads reads_;
  std::int64_t arrivals_ = 0;      // gradients delivered by autograd hooks since construction
  double grad_scale_ = 1.0;        // of the current sync window
  std::int64_t loss_divisor_ = 1;  // this rank's BackwardPlan::loss_divisor of the current sync window (0: none)
  bool divide_ = true;             // divide by the divisor (exact) rather than multiply by grad_scale / divisor
  std::int64_t next_ready_pos_ = 0;
  bool in_hook_ = false;
  bool window_open_ = false;
  bool sync_ = false;
  bool final_ = false;
  bool recording_ = false;
  bool rebuild_pending_ = false;
  bool rebuilt_ = false;
};

}  // namespace loom::detail
