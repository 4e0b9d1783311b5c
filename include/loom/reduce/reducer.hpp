// loom/reduce/reducer.hpp — Reducer: bucketed, overlapped, exactly weighted gradient all-reduce
// over any loom Communicator.
//
// One sentence: the reducer packs every trainable parameter's gradient into flat per-dtype/device
// buckets (each `p.grad()` is a view into its bucket), sends a bucket with one asynchronous
// all-reduce as soon as backward has produced all of its gradients, and at the step boundary
// returns gradients that are the global average on every rank.
//
// Example:
//   loom::GlooCommunicator comm(loom::Environment::from_env());
//   loom::Reducer reducer(comm, loom::parameters_of(*model));   // checks + broadcasts rank 0's weights
//   reducer.prepare_backward({.sync = true, .window_samples = batch.num_samples});
//   auto loss = torch::nn::functional::cross_entropy(model->forward(batch.data), batch.targets,
//                   torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum));
//   loss.backward();                                             // buckets leave while backward runs
//   loom::Reduction r = reducer.finish_window();                 // p.grad() == d(mean loss over all
//   if (!r.non_finite) optimizer.step();                         //   ranks' samples)/dp on every rank
//   optimizer.zero_grad();
// Most loops use loom::Accumulator (accumulate/accumulator.hpp), which makes these calls.
//
// Averaging (ReducerOptions::average):
//   samples (default, exact): write each micro-batch's loss as a SUM over its samples (or a mean
//     times its sample count); gradients are summed over micro-batches and ranks and divided by the
//     all-reduced sample count. The result is the gradient of the mean loss over every sample of the
//     step, whatever the micro-batch sizes and per-rank counts.
//   world_size (DDP's convention): gradients are summed over micro-batches and ranks and divided by
//     the number of ranks; with per-rank mean losses this is the mean of the ranks' means, which
//     differs from the global mean when ranks hold different numbers of samples.
//   none: the plain sum over ranks.
//
// Rules:
//   Buckets: ~25 MiB (bucket_cap_bytes), the first one 1 MiB (first_bucket_cap_bytes), one dtype and
//     device per bucket, filled in reverse registration order; after the first step they are rebuilt
//     once in the order gradients became ready on rank 0 (broadcast, so every rank agrees). Each
//     bucket ends with one flag per parameter that says whether the sending rank used it.
//   Launch order: bucket k is sent only after buckets 0..k-1, on every rank the same sequence.
//     Each gradient is scaled in place to this rank's share of the average as soon as its hook
//     fires in the synchronising backward (divided by the global sample count, which a small
//     all-reduce started before backward delivered; or by the world size; times 1 / loss scale)
//     and scanned for inf/NaN in the same pass, like DDP's per-gradient division; gradients that
//     arrived only in earlier micro-batches are scaled when their bucket leaves. The sum over
//     ranks is then the average.
//   Unused parameters: a parameter whose gradient hook did not fire on a rank during the window
//     counts as zero in that rank's slot (it cannot stall its bucket: unfinished buckets are sent by
//     finish_window). A parameter unused on EVERY rank keeps the gradient it had before the window
//     (an undefined gradient stays undefined, so optimizers skip it; a stale value stays).
//   Gradients accumulate across the window's backward passes as in plain LibTorch; zero them after
//     each optimizer step (optimizer.zero_grad(), with or without set_to_none) as usual.
//   Non-finite: each rank's scan puts its verdict (0 or 1) in the bucket's tail, next to the
//     used-flags; the bucket's own all-reduce sums the verdicts, so every rank reads the same
//     answer and reports Reduction::non_finite together, without an extra collective; the window's
//     gradients are then zeroed. (An overflow created only by the sum of finite values near the
//     dtype's maximum is not detected.)
//   Clipping (max_grad_norm): the L2 norm of the averaged, unscaled gradient over all buckets — the
//     global norm, identical on every rank — and the clip factor min(1, max / (norm + 1e-6)).
//   Wire compression (wire_dtype = float16 / bfloat16): float32 buckets are scaled to their share
//     of the average while being cast for the wire (so float16 carries averages, not sums),
//     summed across ranks in that dtype, and cast back into the float32 bucket, which is then
//     scanned for inf/NaN; local accumulation stays float32 (DDP's fp16_compress_hook). The
//     relative error is about 2^-8 (bfloat16) / 2^-11 (float16) per rounding.
//   Sample count and join: each window's sync backward starts one small int64 all-reduce of
//     [window samples, final flag] before backward runs; a final flush (end of epoch) that finds
//     every rank final and no sample anywhere stops without touching the buckets.
//
// Collectives per step: 1 + number of buckets all-reduces (+ one broadcast, once, for the rebuild).
// Shape: gradients have their parameters' shapes and strides (dense layouts kept, e.g.
//        channels-last), dtypes float32/float64/float16/bfloat16; frozen parameters are left out.
// Units: caps in bytes, samples in samples.
// Throws: loom::InvalidArgument (bad options, non-floating or non-leaf trainable parameter,
//         parameters that differ across ranks, a gradient produced twice after its bucket left),
//         loom::Error (calls out of order), and the communicator's CommError / TimeoutError.
// Source: PyTorch DistributedDataParallel's Reducer (bucketing, gradient_as_bucket_view, ready-order
//         rebuild, find_unused_parameters' bitmap, fp16_compress_hook, join for uneven inputs).
#pragma once

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <fmt/format.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <loom/comm/communicator.hpp>
#include <loom/error.hpp>
#include <loom/reduce/buckets.hpp>
#include <loom/reduce/concepts.hpp>
#include <loom/reduce/parameters.hpp>

namespace loom {

/// How the summed gradient is divided. See the file comment for when to use which.
enum class Average {
  samples,     ///< by the all-reduced sample count of the window (exact global mean; default)
  world_size,  ///< by the number of ranks (DDP)
  none,        ///< not divided (sum over ranks)
};

/// "samples", "world_size" or "none".
constexpr std::string_view to_string(Average a) noexcept {
  switch (a) {
    case Average::samples: return "samples";
    case Average::world_size: return "world_size";
    case Average::none: return "none";
  }
  return "?";
}

/// Options of Reducer; use with designated initializers.
///
/// Example: `loom::ReducerOptions{.bucket_cap_bytes = 16 * loom::kMiB, .max_grad_norm = 1.0}`.
/// Units: caps in bytes; max_grad_norm in gradient units (L2 norm of the averaged gradient).
struct ReducerOptions {
  std::size_t bucket_cap_bytes = 25 * kMiB;       ///< cap of every bucket but the first of each dtype/device
  std::size_t first_bucket_cap_bytes = 1 * kMiB;  ///< cap of the first bucket (sent first, so small)
  bool rebuild_buckets = true;                    ///< once, after the first step, in rank 0's gradient-ready order
  Average average = Average::samples;             ///< divisor of the summed gradient
  std::optional<c10::ScalarType> wire_dtype{};      ///< at::kHalf / at::kBFloat16: compress float32 buckets on the wire
  bool overlap = true;                            ///< send full buckets from autograd hooks (false: all in finish_window)
  bool check_parameters = true;                   ///< construction: same parameters on every rank (one all-gather)
  bool broadcast_parameters = true;               ///< construction: copy rank 0's parameters and buffers everywhere
  bool skip_non_finite = true;                    ///< detect inf/NaN in the reduced gradient (Reduction::non_finite)
  std::optional<double> max_grad_norm{};            ///< clip by the global L2 norm (after averaging and unscaling)
};

namespace detail {

/// A tensor that shares `flat`'s storage from element `offset`, shaped like `like` (its strides when
/// `like` is dense, else row-major). Built with set_() rather than a view op, so autograd does not
/// treat it as a view (LibTorch's Optimizer::zero_grad calls detach_(), which views refuse).
inline at::Tensor alias_into(const at::Tensor& flat, std::int64_t offset, const at::Tensor& like) {
  std::vector<std::int64_t> strides;
  if (like.is_non_overlapping_and_dense()) {
    strides = like.strides().vec();
  } else {
    strides.assign(static_cast<std::size_t>(like.dim()), 1);
    for (std::int64_t d = like.dim() - 2; d >= 0; --d)
      strides[static_cast<std::size_t>(d)] = strides[static_cast<std::size_t>(d) + 1] * std::max<std::int64_t>(like.size(d + 1), 1);
  }
  auto t = at::empty({0}, flat.options());
  t.set_(flat.storage(), flat.storage_offset() + offset, like.sizes(), strides);
  return t;
}

/// Whether `g` is exactly the slot `view` (same memory, shape, strides, dtype).
inline bool aliases(const at::Tensor& g, const at::Tensor& view) {
  return g.defined() && g.data_ptr() == view.data_ptr() && g.scalar_type() == view.scalar_type() &&
         g.sizes() == view.sizes() && g.strides() == view.strides();
}

/// Scales a tensor in place (divides by `value` when `divide`, else multiplies) and, when `check`,
/// returns whether any result is inf or NaN — in one pass over contiguous CPU float32/float64 memory
/// (blocks of 64 elements the compiler vectorizes; non-finite = all exponent bits set), otherwise
/// with two ATen ops. Division is kept (not a reciprocal multiply) so a mean is exactly rounded.
template <class T, bool Divide>
bool scale_block_loop(T* p, std::int64_t n, T value, bool check) {
  using Bits = std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint64_t>;
  constexpr Bits kExponent = static_cast<Bits>(sizeof(T) == 4 ? 0x7f800000ull : 0x7ff0000000000000ull);
  constexpr std::int64_t kBlock = 64;
  Bits acc[kBlock] = {};
  std::int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    T* q = p + i;
    for (std::int64_t j = 0; j < kBlock; ++j) {
      const T y = Divide ? q[j] / value : q[j] * value;
      q[j] = y;
      const Bits e = std::bit_cast<Bits>(y) & kExponent;
      acc[j] = acc[j] > e ? acc[j] : e;
    }
  }
  Bits worst = 0;
  for (; i < n; ++i) {
    const T y = Divide ? p[i] / value : p[i] * value;
    p[i] = y;
    const Bits e = std::bit_cast<Bits>(y) & kExponent;
    worst = worst > e ? worst : e;
  }
  for (std::int64_t j = 0; j < kBlock; ++j) worst = worst > acc[j] ? worst : acc[j];
  return check && worst == kExponent;
}

/// scale_and_check on elements [offset, offset + numel) of a 1-D tensor, without making a view
/// when the memory is CPU float32/float64 (the reducer calls it once per gradient per step).
inline bool scale_and_check_span(at::Tensor& flat, std::int64_t offset, std::int64_t numel, double value, bool divide,
                                 bool check) {
  if (divide && value == 1.0) divide = false;
  if (flat.is_cpu() && flat.is_contiguous() && (flat.scalar_type() == at::kFloat || flat.scalar_type() == at::kDouble)) {
    if (!divide && value == 1.0 && !check) return false;
    std::atomic<bool> bad{false};
    AT_DISPATCH_FLOATING_TYPES(flat.scalar_type(), "loom_scale_and_check", [&] {
      scalar_t* p = flat.data_ptr<scalar_t>() + offset;
      const auto v = static_cast<scalar_t>(value);
      at::parallel_for(0, numel, std::int64_t{1} << 18, [&](std::int64_t begin, std::int64_t end) {
        const bool found = divide ? scale_block_loop<scalar_t, true>(p + begin, end - begin, v, check)
                                  : scale_block_loop<scalar_t, false>(p + begin, end - begin, v, check);
        if (found) bad.store(true, std::memory_order_relaxed);
      });
    });
    return bad.load();
  }
  auto t = (offset == 0 && numel == flat.numel()) ? flat : flat.narrow(0, offset, numel);
  if (divide) t.div_(value);
  else if (value != 1.0) t.mul_(value);
  return check && !std::isfinite(t.sum().item<double>());
}

inline bool scale_and_check(at::Tensor& t, double value, bool divide, bool check) {
  if (t.is_contiguous()) {
    auto flat = t.view({-1});
    return scale_and_check_span(flat, 0, flat.numel(), value, divide, check);
  }
  if (value != 1.0) {
    if (divide) t.div_(value);
    else t.mul_(value);
  }
  return check && !std::isfinite(t.sum().item<double>());
}

/// Stand-in handle for a communicator without all_reduce_async (the call blocked already).
struct DoneWork {
  void wait() const noexcept {}
};

template <class Comm, bool = AsyncCommunicator<Comm>>
struct WorkOf {
  using type = DoneWork;
};
template <class Comm>
struct WorkOf<Comm, true> {
  using type = std::decay_t<decltype(std::declval<Comm&>().all_reduce_async(std::declval<at::Tensor&>(), ReduceOp::sum))>;
};

struct GradSlot {
  std::size_t param = 0;        // index into ParameterList::params
  std::size_t bucket = 0;       // bucket holding the gradient
  std::int64_t offset = 0;      // first element in the bucket
  std::size_t flag = 0;         // position among the bucket's used-flags
  at::Tensor view;              // the gradient's memory in the bucket
  at::Tensor saved;             // pre-window gradient of a locally unused parameter (restored if unused everywhere)
  std::int64_t ready_pos = -1;  // order of its first gradient while recording (bucket rebuild)
  bool used = false;            // a gradient arrived during the current window
  bool fired = false;           // a gradient arrived during the current sync backward
  bool was_undefined = false;   // its .grad() was undefined when the window began
  bool scaled = false;          // already divided to its share of the average in this sync backward
};

struct GradBucket {
  at::Tensor flat;       // [head: the gradients | tail: one used-flag per gradient, one inf/NaN flag]
  at::Tensor head;
  at::Tensor tail;
  at::Tensor wire;       // compressed copy of flat (wire_dtype), or undefined
  at::Tensor wire_head;
  at::Tensor wire_tail;
  at::Tensor factor;     // float32 [1] on the bucket's device: a dimensioned multiplier, so a casting
                         // multiply computes in float32 (a 0-dim one would compute in the wire dtype)
  std::vector<std::size_t> slots;
  std::size_t pending = 0;
  bool ready = false;
  bool launched = false;
  bool bad = false;  // this rank's scan found inf/NaN in the bucket
};

template <class State>
class GradReadyHook final : public torch::autograd::FunctionPostHook {
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
      : comm_(&comm), options_(std::move(options)), list_(std::move(list)) {
    validate_options();
    if (!list_.names.empty() && list_.names.size() != list_.params.size())
      throw InvalidArgument(fmt::format("Reducer: {} names for {} parameters", list_.names.size(), list_.params.size()));
    if (options_.check_parameters) check_same_parameters(*comm_, list_);
    if (options_.broadcast_parameters) broadcast_from_rank0(*comm_, list_);

    slot_of_param_.assign(list_.params.size(), kNoSlot);
    for (std::size_t i = 0; i < list_.params.size(); ++i) {
      const auto& p = list_.params[i];
      if (!p.defined()) throw InvalidArgument(fmt::format("Reducer: {} is undefined", list_.describe(i)));
      if (!p.requires_grad()) continue;  // frozen: never reduced
      if (!p.is_leaf())
        throw InvalidArgument(fmt::format("Reducer: {} is not a leaf tensor (it has a grad_fn); pass the model's parameters",
                                          list_.describe(i)));
      if (!at::isFloatingType(p.scalar_type()))
        throw InvalidArgument(fmt::format("Reducer: {} has dtype {}; gradients are reduced for float32, float64, float16 and bfloat16",
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
    meta_ = at::zeros({2}, at::kLong);
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
    if (plan.window_samples < 0)
      throw InvalidArgument(fmt::format("Reducer::prepare_backward: window_samples = {} (must be >= 0)", plan.window_samples));
    if (!std::isfinite(plan.grad_scale) || plan.grad_scale <= 0)
      throw InvalidArgument(fmt::format("Reducer::prepare_backward: grad_scale = {} (must be finite and > 0)", plan.grad_scale));
    at::NoGradGuard no_grad;
    if (!window_open_) begin_window();
    for (auto& s : slots_) s.fired = false;
    if (!plan.sync) return;
    sync_ = true;
    final_ = plan.final;
    grad_scale_ = plan.grad_scale;
    factor_known_ = false;
    for (auto& b : buckets_) {
      b.pending = b.slots.size();
      b.ready = false;
      b.launched = false;
      b.bad = false;
    }
    for (auto& s : slots_) s.scaled = false;
    works_.assign(buckets_.size(), std::nullopt);
    next_launch_ = 0;
    auto* m = meta_.data_ptr<std::int64_t>();
    m[0] = plan.window_samples;
    m[1] = plan.final ? 1 : 0;
    meta_work_ = start(meta_);
  }

  Reduction finish_window() {
    std::lock_guard lock(mutex_);
    if (!sync_) throw Error("Reducer::finish_window: no synchronising backward was prepared (prepare_backward({.sync = true}))");
    at::NoGradGuard no_grad;
    Reduction r;
    const int world = comm_->world_size();
    wait_meta();  // started before backward: long done unless nothing was sent yet
    const auto* m = meta_.data_ptr<std::int64_t>();
    if (final_ && m[1] == world && m[0] == 0) {  // everyone is flushing and nobody has a sample: nothing to reduce
      r.all_final = true;
      discard_window();
      return r;
    }
    for (std::size_t b = next_launch_; b < buckets_.size(); ++b) launch(b);
    next_launch_ = buckets_.size();
    r.global_samples = m[0];
    r.all_final = m[1] == world;

    const bool clip = options_.max_grad_norm.has_value();
    bool non_finite = false;
    double sumsq = 0;
    global_used_.assign(slots_.size(), 0);
    for (std::size_t bi = 0; bi < buckets_.size(); ++bi) {
      auto& b = buckets_[bi];
      works_[bi]->wait();
      if (read_tail(b)) non_finite = true;  // some rank's scan found inf/NaN before sending
      if (no_samples_) continue;
      if (b.wire.defined()) {
        b.head.copy_(b.wire_head);  // back to float32
        if (!clip && options_.skip_non_finite && scale_and_check(b.head, 1.0, false, true)) non_finite = true;
      }
      if (clip) sumsq += square(b.head.norm().item<double>());
    }
    if (clip && !no_samples_) {
      const double total = std::sqrt(sumsq);
      r.grad_norm = total;
      if (!std::isfinite(total)) non_finite = true;
      if (!non_finite) {
        const double coef = std::min(1.0, *options_.max_grad_norm / (total + 1e-6));
        r.clip_coef = coef;
        if (coef < 1.0)
          for (auto& b : buckets_) b.head.mul_(coef);
      }
    }
    if (non_finite || no_samples_)
      for (auto& b : buckets_) b.head.zero_();
    r.non_finite = non_finite;
    r.no_samples = no_samples_;
    r.reduced = true;
    // Parameters unused on every rank get back the gradient they had before the window.
    for (std::size_t k = 0; k < slots_.size(); ++k) {
      if (global_used_[k]) continue;
      auto& s = slots_[k];
      if (s.was_undefined) param(k).mutable_grad().reset();
      else if (s.saved.defined()) s.view.copy_(s.saved);
    }
    close_window();
    if (recording_) rebuild_pending_ = true;
    return r;
  }

  // ---- hooks and manual readiness ------------------------------------------------------------

  void on_grad_ready(std::size_t k) {
    std::lock_guard lock(mutex_);
    mark_ready_locked(k);
  }

  void mark_ready(std::size_t param_index) {
    if (param_index >= slot_of_param_.size() || slot_of_param_[param_index] == kNoSlot)
      throw InvalidArgument(fmt::format("Reducer::mark_ready: {} is not a trainable parameter of this reducer",
                                        param_index < list_.params.size() ? list_.describe(param_index)
                                                                          : fmt::format("parameter {}", param_index)));
    std::lock_guard lock(mutex_);
    at::NoGradGuard no_grad;
    if (!window_open_) throw Error("Reducer::mark_ready: call prepare_backward() first");
    auto& g = param(slot_of_param_[param_index]).mutable_grad();
    if (!g.defined()) throw InvalidArgument(fmt::format("Reducer::mark_ready: {} has no gradient", list_.describe(param_index)));
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
  [[nodiscard]] const ParameterList& parameters() const noexcept { return list_; }
  [[nodiscard]] const ReducerOptions& options() const noexcept { return options_; }
  [[nodiscard]] Comm& communicator() const noexcept { return *comm_; }

 private:
  static constexpr std::size_t kNoSlot = static_cast<std::size_t>(-1);
  static double square(double x) { return x * x; }

  const at::Tensor& param(std::size_t k) const { return list_.params[slots_[k].param]; }

  void validate_options() const {
    if (options_.bucket_cap_bytes == 0 || options_.first_bucket_cap_bytes == 0)
      throw InvalidArgument(fmt::format("Reducer: bucket caps must be > 0 bytes (bucket_cap_bytes = {}, first_bucket_cap_bytes = {})",
                                        options_.bucket_cap_bytes, options_.first_bucket_cap_bytes));
    if (options_.wire_dtype && *options_.wire_dtype != at::kHalf && *options_.wire_dtype != at::kBFloat16)
      throw InvalidArgument(fmt::format("Reducer: wire_dtype {} is not float16 or bfloat16", c10::toString(*options_.wire_dtype)));
    if (options_.max_grad_norm && !(*options_.max_grad_norm > 0))
      throw InvalidArgument(fmt::format("Reducer: max_grad_norm = {} (must be > 0)", *options_.max_grad_norm));
  }

  std::vector<std::vector<std::size_t>> assign(const std::vector<std::size_t>& order) const {
    std::vector<GradSpec> specs;
    std::vector<std::pair<c10::ScalarType, c10::Device>> kinds;
    for (std::size_t k = 0; k < slots_.size(); ++k) {
      const auto& p = param(k);
      const std::pair<c10::ScalarType, c10::Device> key{p.scalar_type(), p.device()};
      auto it = std::find(kinds.begin(), kinds.end(), key);
      if (it == kinds.end()) it = kinds.insert(kinds.end(), key);
      specs.push_back({.numel = p.numel(), .element_size = static_cast<std::int64_t>(p.element_size()),
                       .kind = static_cast<std::int64_t>(it - kinds.begin())});
    }
    return assign_buckets(specs, order, {.first_bucket_cap_bytes = options_.first_bucket_cap_bytes,
                                         .bucket_cap_bytes = options_.bucket_cap_bytes});
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
      const auto opts = at::TensorOptions().dtype(first.scalar_type()).device(first.device());
      b.flat = at::zeros({total + n + 1}, opts);
      b.head = b.flat.narrow(0, 0, total);
      b.tail = b.flat.narrow(0, total, n + 1);
      if (options_.wire_dtype && first.scalar_type() == at::kFloat) {
        b.wire = at::empty({total + n + 1}, opts.dtype(*options_.wire_dtype));
        b.wire_head = b.wire.narrow(0, 0, total);
        b.wire_tail = b.wire.narrow(0, total, n + 1);
        b.factor = at::ones({1}, opts);
      }
      std::int64_t offset = 0;
      std::size_t flag = 0;
      for (std::size_t k : b.slots) {
        auto& s = slots_[k];
        s.bucket = bi;
        s.offset = offset;
        s.flag = flag++;
        s.view = alias_into(b.flat, offset, param(k));
        auto& g = param(k).mutable_grad();
        if (g.defined()) {
          s.view.copy_(g);
          g = s.view;
        }
        offset += param(k).numel();
      }
    }
    buckets_ = std::move(fresh);
  }

  /// First prepare_backward of a window: every gradient becomes its bucket slot.
  void begin_window() {
    if (rebuild_pending_) try_rebuild();
    rebuild_pending_ = false;
    for (auto& b : buckets_) {
      const bool all_undefined = std::none_of(b.slots.begin(), b.slots.end(),
                                              [&](std::size_t k) { return param(k).grad().defined(); });
      if (all_undefined) b.head.zero_();
      for (std::size_t k : b.slots) {
        auto& s = slots_[k];
        auto& g = param(k).mutable_grad();
        s.used = false;
        s.saved = at::Tensor();
        s.was_undefined = !g.defined();
        if (!g.defined()) {
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
    if (!aliases(g, s.view)) {  // replaced by the user or by a create_graph backward: move it into the slot
      at::NoGradGuard no_grad;
      if (g.defined()) s.view.copy_(g);
      else s.view.zero_();
      g = s.view;
    }
    s.used = true;
    if (recording_ && s.ready_pos < 0) s.ready_pos = next_ready_pos_++;
    if (!sync_) return;
    auto& b = buckets_[s.bucket];
    if (s.fired) {
      if (b.launched)
        throw InvalidArgument(fmt::format(
            "Reducer: {} received a second gradient in the synchronising backward after its bucket was sent; "
            "run one backward per micro-batch (sum the losses first)",
            list_.describe(s.param)));
      return;
    }
    s.fired = true;
    if (options_.overlap) scale_slot(k);  // while its memory is still in cache, like DDP's per-gradient division
    if (--b.pending == 0) b.ready = true;
    if (!options_.overlap) return;
    while (next_launch_ < buckets_.size() && buckets_[next_launch_].ready) launch(next_launch_++);
  }

  /// Zeroes the slots of unused parameters, scales what was not scaled yet, writes the used-flags
  /// and the inf/NaN verdict into the bucket's tail, and starts its all-reduce.
  void launch(std::size_t bi) {
    auto& b = buckets_[bi];
    for (std::size_t k : b.slots) {
      auto& s = slots_[k];
      if (s.used) continue;
      if (!s.was_undefined && !s.saved.defined()) s.saved = s.view.clone();
      s.view.zero_();  // an unused parameter's slot counts as zero
    }
    compute_factor();
    at::Tensor* target = &b.flat;
    if (b.wire.defined()) {
      // Compressed: scaled while cast; the scan runs on the float32 result (it also sees overflow).
      b.factor.fill_(factor_);
      at::mul_out(b.wire_head, b.head, b.factor);
      target = &b.wire;
    } else {
      for (std::size_t k : b.slots)
        if (slots_[k].used) scale_slot(k);  // gradients that did not arrive in this backward
    }
    write_tail(b, b.bad);
    works_[bi] = start(*target);
    b.launched = true;
  }

  /// Divides (or multiplies) slot k's gradient to this rank's share of the average and scans it for
  /// inf/NaN, once per sync backward. Compressed buckets are scaled while cast, at launch.
  void scale_slot(std::size_t k) {
    auto& s = slots_[k];
    auto& b = buckets_[s.bucket];
    if (s.scaled || b.wire.defined()) return;
    s.scaled = true;
    compute_factor();
    if (no_samples_) return;
    const auto n = param(k).numel();
    const bool bad = divide_ ? scale_and_check_span(b.flat, s.offset, n, denominator_, /*divide=*/true, options_.skip_non_finite)
                             : scale_and_check_span(b.flat, s.offset, n, factor_, /*divide=*/false, options_.skip_non_finite);
    b.bad = b.bad || bad;
  }

  /// The window's divisor, known once the sample-count all-reduce (started before backward) is in.
  void compute_factor() {
    if (factor_known_) return;
    const int world = comm_->world_size();
    std::int64_t count = 0;
    if (options_.average == Average::samples) {
      wait_meta();
      count = meta_.data_ptr<std::int64_t>()[0];
    }
    no_samples_ = options_.average == Average::samples && count == 0;
    denominator_ = options_.average == Average::samples      ? static_cast<double>(count)
                   : options_.average == Average::world_size ? static_cast<double>(world)
                                                              : 1.0;
    // Without a loss scale, divide: each rank's share is then exactly rounded (one rank: the mean is).
    divide_ = grad_scale_ == 1.0;
    factor_ = no_samples_ ? 1.0 : grad_scale_ / denominator_;
    factor_known_ = true;
  }

  Work start(at::Tensor& t) {
    if constexpr (AsyncCommunicator<Comm>) {
      return comm_->all_reduce_async(t, ReduceOp::sum);
    } else {
      comm_->all_reduce(t, ReduceOp::sum);
      return Work{};
    }
  }

  void wait_meta() {
    if (meta_work_) {
      meta_work_->wait();
      meta_work_.reset();
    }
  }

  // Tail of a bucket: one used-flag per gradient, then this rank's inf/NaN verdict (1 or 0).
  void write_tail(GradBucket& b, bool bad) {
    const auto n = b.slots.size();
    auto fill = [&](auto* p) {
      using T = std::remove_pointer_t<decltype(p)>;
      for (std::size_t j = 0; j < n; ++j) p[j] = slots_[b.slots[j]].used ? T(1) : T(0);
      p[n] = bad ? T(1) : T(0);
    };
    at::Tensor tail = b.wire.defined() ? b.wire_tail : b.tail;
    if (tail.is_cpu()) {
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, tail.scalar_type(), "loom_write_tail",
                                      [&] { fill(tail.data_ptr<scalar_t>()); });
    } else {
      auto host = at::empty({static_cast<std::int64_t>(n + 1)}, at::kFloat);
      fill(host.data_ptr<float>());
      tail.copy_(host);
    }
  }

  // Reads the reduced tail: which parameters some rank used, and whether some rank saw inf/NaN.
  bool read_tail(const GradBucket& b) {
    const auto n = static_cast<std::int64_t>(b.slots.size());
    at::Tensor src = b.wire.defined() ? b.wire_tail : b.tail;
    if (!src.is_cpu()) src = src.to(at::kCPU);
    bool bad = false;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src.scalar_type(), "loom_read_tail", [&] {
      const auto* p = src.data_ptr<scalar_t>();
      for (std::int64_t j = 0; j < n; ++j)
        global_used_[b.slots[static_cast<std::size_t>(j)]] = static_cast<double>(p[j]) > 0 ? 1 : 0;
      bad = static_cast<double>(p[n]) != 0;  // a count > 0 (NaN would also read as "bad")
    });
    return bad;
  }

  /// A final flush that found nothing anywhere: undo the window's setup.
  void discard_window() {
    for (std::size_t k = 0; k < slots_.size(); ++k) {
      auto& s = slots_[k];
      if (s.used) s.view.zero_();
      else if (s.was_undefined) param(k).mutable_grad().reset();
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
    if (comm_->world_size() > 1) comm_->broadcast(order, 0);
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

  Comm* comm_;
  ReducerOptions options_;
  ParameterList list_;
  std::vector<GradSlot> slots_;
  std::vector<std::size_t> slot_of_param_;
  std::vector<GradBucket> buckets_;
  std::vector<std::size_t> order_;  // launch order of slots
  std::vector<std::optional<Work>> works_;
  std::optional<Work> meta_work_;
  std::vector<char> global_used_;
  at::Tensor meta_;        // int64 [window samples, final flag]
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
  std::vector<std::uintptr_t> keys_;
  std::mutex mutex_;
  std::size_t next_launch_ = 0;
  double grad_scale_ = 1.0;   // of the current sync window
  double factor_ = 1.0;       // grad_scale_ / denominator_
  double denominator_ = 1.0;  // sample count, world size or 1
  bool divide_ = true;        // divide by denominator_ (exact) rather than multiply by factor_
  bool factor_known_ = false;
  bool no_samples_ = false;
  std::int64_t next_ready_pos_ = 0;
  bool window_open_ = false;
  bool sync_ = false;
  bool final_ = false;
  bool recording_ = false;
  bool rebuild_pending_ = false;
  bool rebuilt_ = false;
};

}  // namespace detail

/// Bucketed gradient all-reduce for data-parallel training. Models GradientReducer.
///
/// Example: see the file comment (and loom::Accumulator for the usual loop).
/// Shape: see the file comment. Movable, not copyable; the parameters must outlive it.
/// Throws: see the file comment.
/// Source: PyTorch DDP's Reducer.
template <Communicator Comm>
class Reducer {
 public:
  /// Checks the parameters across ranks, broadcasts rank 0's parameters and buffers, allocates the
  /// buckets and registers one autograd hook per trainable parameter.
  /// Throws: loom::InvalidArgument (mismatch across ranks, bad options or parameters); comm errors.
  Reducer(Comm& comm, ParameterList params, ReducerOptions options = {})
      : state_(std::make_unique<detail::ReducerState<Comm>>(comm, std::move(params), std::move(options))) {}

  /// See GradientReducer: announces whether the next backward closes the window (and starts the
  /// window's sample-count all-reduce when it does).
  void prepare_backward(const BackwardPlan& plan) { state_->prepare_backward(plan); }

  /// See GradientReducer: sends the buckets not sent yet, waits for all, restores parameters
  /// unused everywhere, reports inf/NaN, clips. Gradients are then identical on every rank.
  Reduction finish_window() { return state_->finish_window(); }

  /// Declares that parameter `param_index`'s gradient (written without autograd) is complete for
  /// this backward, as its hook would. Throws: loom::InvalidArgument for a frozen or unknown index.
  void mark_ready(std::size_t param_index) { state_->mark_ready(param_index); }

  /// Calls mark_ready for every trainable parameter with a gradient, in launch order.
  void mark_all_ready() {
    for (const auto& bucket : state_->bucket_params())
      for (std::size_t i : bucket) state_->mark_ready(i);
  }

  /// Parameter indices of each bucket, in launch order.
  [[nodiscard]] std::vector<std::vector<std::size_t>> bucket_params() const { return state_->bucket_params(); }
  /// The gradient part of each bucket (1-D, in launch order); gradients are views into these.
  [[nodiscard]] std::vector<at::Tensor> bucket_tensors() const { return state_->bucket_tensors(); }
  /// Whether the one-time rebuild in gradient-ready order happened.
  [[nodiscard]] bool rebuilt() const noexcept { return state_->rebuilt(); }
  [[nodiscard]] const ParameterList& parameters() const noexcept { return state_->parameters(); }
  [[nodiscard]] const ReducerOptions& options() const noexcept { return state_->options(); }
  [[nodiscard]] Comm& communicator() const noexcept { return state_->communicator(); }

 private:
  std::unique_ptr<detail::ReducerState<Comm>> state_;
};

}  // namespace loom
