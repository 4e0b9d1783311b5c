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
//   Launch order: bucket k is sent only after buckets 0..k-1, on every rank the same sequence. A
//     bucket leaves once every gradient in it arrived in the synchronising backward: it is then
//     scaled as a whole to this rank's share of the average (divided by the global sample count,
//     which a small all-reduce started before backward delivered, or by the world size; times
//     1 / loss scale) and scanned for inf/NaN in the same pass. The sum over ranks is the average.
//   A gradient that arrives twice in the synchronising backward (two backward passes before
//     finish_window, reentrant checkpointing, mark_ready after adding to a gradient by hand) is
//     exact while its bucket has not left: the arrivals add up in the slot and the bucket is
//     scaled once, (x + y) / N. After the bucket left, the second arrival would miss the
//     all-reduce: loom::InvalidArgument naming the parameter (DDP: "Expected to mark a variable
//     ready only once"). overlap = false sends nothing before finish_window, so it never throws.
//   Unused parameters: a parameter whose gradient hook did not fire on a rank during the window
//     counts as zero in that rank's slot (it cannot stall its bucket: unfinished buckets are sent by
//     finish_window). A parameter unused on EVERY rank keeps the gradient it had before the window
//     (an undefined gradient stays undefined, so optimizers skip it; a stale value stays).
//   Gradients accumulate across the window's backward passes as in plain LibTorch; zero them after
//     each optimizer step (optimizer.zero_grad(), with or without set_to_none) as usual.
//   The parameter set is fixed at construction: at the first prepare_backward of every window the
//     reducer checks that no frozen parameter became trainable (or the reverse), that dtypes,
//     devices and shapes are unchanged, and that every parameter still has the gradient
//     accumulator its hook hangs on (module->to(dtype) or set_data replace it, after which the
//     gradient would bypass the reducer); otherwise loom::InvalidArgument naming the parameter.
//     Build the Reducer after moving, casting, freezing or unfreezing the model.
//   Buffers (broadcast_buffers, default on): at the end of every finish_window that reduced, rank
//     0's buffers (BatchNorm running statistics, ...) are broadcast to every rank, so replicas,
//     checkpoints and evaluation agree after every optimizer step. DDP broadcasts before each
//     forward instead; loom does it at the step boundary, the one point it owns where no forward
//     reads the buffers, and so that they are equal whenever the caller looks. One coalesced
//     broadcast per buffer dtype per step; nothing when the list has no buffer.
//   Non-finite: each rank's scan puts its verdict (0 or 1) in the bucket's tail, next to the
//     used-flags; the bucket's own all-reduce sums the verdicts, so every rank reads the same
//     answer and reports Reduction::non_finite together, without an extra collective; the window's
//     gradients are then zeroed. The scan tests each element (isfinite), never a sum, so float16
//     gradients whose sum exceeds 65504 are finite. (An overflow created only by the sum over
//     ranks of finite values near the dtype's maximum is not detected.)
//   Clipping (max_grad_norm): the L2 norm of the averaged, unscaled gradient over all buckets — the
//     global norm, identical on every rank, accumulated in float32 for float16/bfloat16 buckets
//     and float64 for float64 ones — and the clip factor min(1, max / (norm + 1e-6)).
//   Host reads: nothing inside an autograd hook reads a value back to the host (the divisor and the
//     verdicts stay on the communicator's device); finish_window makes one read of a small float64
//     summary (count, final flags, used-flags, verdicts, squared norm), and an end-of-epoch flush
//     one more first (whether any rank has samples). host_reads() counts them.
//   Wire compression (wire_dtype = float16 / bfloat16, float32 buckets only): rank r sends its
//     share s_r = S_r / W, where S_r is its summed (still loss-scaled) gradient and W the world size,
//     cast to the wire dtype; the shares are summed in that dtype and cast back, and the float32
//     bucket is multiplied by W x (1 / loss scale) / divisor, then scanned for inf/NaN. Dividing by
//     W, not by the sample count, keeps the shares count/W times larger, away from float16's
//     subnormal range (below 2^-14 = 6.1e-5), and the loss scale stays on the wire where it
//     protects small gradients. Error bound per element (float16; bfloat16 with 2^-8 and no
//     subnormal term in its range): |error| <= (W / divisor) x sum over the W casts and W - 1
//     additions of (2^-11 x |value rounded| + 2^-25), i.e. relative 2^-11 per rounding while
//     shares are normal, and an absolute 2^-25 x W / divisor per rounding below; a share below
//     2^-25 (3e-8) is flushed to zero, and one above 65504 becomes inf (reported non_finite).
//   Sample count and join: each window's sync backward starts one small int64 all-reduce of
//     [window samples, final flag] before backward runs; a final flush (end of epoch) that finds
//     every rank final and no sample anywhere stops without touching the buckets.
//
// Collectives per step: 1 + number of buckets all-reduces (+ one broadcast, once, for the rebuild;
// + the buffer broadcast when the model has buffers).
// Shape: gradients have their parameters' shapes and strides (dense layouts kept, e.g.
//        channels-last), dtypes float32/float64/float16/bfloat16; frozen parameters are left out.
// Units: caps in bytes, samples in samples.
// Throws: loom::InvalidArgument (bad options, non-floating or non-leaf trainable parameter,
//         parameters that differ across ranks, a gradient produced twice after its bucket left,
//         a parameter set changed after construction),
//         loom::Error (calls out of order), and the communicator's CommError / TimeoutError.
// Source: PyTorch DistributedDataParallel's Reducer (bucketing, gradient_as_bucket_view, ready-order
//         rebuild, find_unused_parameters' bitmap, fp16_compress_hook, join for uneven inputs).
#pragma once

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <concepts>
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
#include <fmt/ranges.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <loom/comm/communicator.hpp>
#include <loom/comm/device.hpp>
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
  bool broadcast_buffers = true;                  ///< copy rank 0's buffers to every rank at each step boundary
};

/// How often a reducer copied a value from the communicator's device to the host (each such read
/// is a synchronisation point on a GPU). Exposed so tests can hold the reducer to its budget: at
/// most one read per step (two for an end-of-epoch flush), none inside autograd hooks.
///
/// Example: `CHECK(reducer.host_reads().in_hooks == 0);`
/// Units: reads since the reducer was built.
struct HostReads {
  std::int64_t total = 0;     ///< every read
  std::int64_t in_hooks = 0;  ///< reads made while an autograd hook ran (a regression if ever > 0)
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
/// with ATen ops (then the verdict is read to the host: use it outside hot paths only). Division is
/// kept (not a reciprocal multiply) so a mean is exactly rounded.
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

/// Whether scale_and_check_span takes the one-pass CPU path for `t`.
inline bool has_fused_scan(const at::Tensor& t) {
  return t.is_cpu() && t.is_contiguous() && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble);
}

/// scale_and_check on elements [offset, offset + numel) of a 1-D tensor, without making a view
/// when the memory is CPU float32/float64.
inline bool scale_and_check_span(at::Tensor& flat, std::int64_t offset, std::int64_t numel, double value, bool divide,
                                 bool check) {
  if (divide && value == 1.0) divide = false;
  if (has_fused_scan(flat)) {
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
  return check && !at::isfinite(t).all().item<bool>();
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
  return check && !at::isfinite(t).all().item<bool>();
}

/// 1.0 where `t` holds an inf or NaN, else 0.0, as a one-element tensor of `dtype` on t's device
/// (no host synchronisation: the verdict stays on the device).
inline at::Tensor non_finite_flag(const at::Tensor& t, c10::ScalarType dtype) {
  return at::logical_not(at::isfinite(t)).any().reshape({1}).to(dtype);
}

/// The accumulation dtype of a bucket's arithmetic: float64 for float64, float32 otherwise (a
/// float16 count above 2048 or a float16 factor would round).
inline c10::ScalarType compute_dtype(c10::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

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
};

struct GradBucket {
  at::Tensor flat;        // [head: the gradients | tail: one used-flag per gradient, one inf/NaN flag]
  at::Tensor head;
  at::Tensor tail;
  at::Tensor wire;        // compressed copy of flat (wire_dtype), or undefined
  at::Tensor wire_head;
  at::Tensor wire_tail;
  at::Tensor wire_div;    // float32 [1]: the world size, the pre-division of a compressed bucket
  at::Tensor wire_bad;    // float32 [1]: inf/NaN after the compressed bucket came back (same on every rank)
  at::Tensor flags_host;  // pinned staging for the used-flags of a bucket on a GPU
  std::vector<std::size_t> slots;
  std::size_t pending = 0;
  bool ready = false;
  bool launched = false;
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
      : comm_(&comm), options_(std::move(options)), list_(std::move(list)), device_(collective_device(comm)) {
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
    meta_ = at::zeros({2}, at::TensorOptions().dtype(at::kLong).device(device_));
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
    // Without a loss scale, divide: each rank's share is then exactly rounded (one rank: the mean is).
    divide_ = grad_scale_ == 1.0;
    factors_.clear();
    for (auto& b : buckets_) {
      b.pending = b.slots.size();
      b.ready = false;
      b.launched = false;
    }
    works_.assign(buckets_.size(), std::nullopt);
    next_launch_ = 0;
    const std::int64_t values[2] = {plan.window_samples, plan.final ? 1 : 0};
    if (meta_.is_cpu()) std::copy(values, values + 2, meta_.data_ptr<std::int64_t>());
    else meta_.copy_(at::tensor(std::vector<std::int64_t>(values, values + 2), at::kLong), /*non_blocking=*/false);
    meta_work_ = start(meta_);
  }

  Reduction finish_window() {
    std::lock_guard lock(mutex_);
    if (!sync_) throw Error("Reducer::finish_window: no synchronising backward was prepared (prepare_backward({.sync = true}))");
    at::NoGradGuard no_grad;
    Reduction r;
    const int world = comm_->world_size();
    wait_meta();  // started before backward: long done unless nothing was sent yet
    if (final_) {  // a flush without backward: skip the buckets when every rank flushes and nobody has a sample
      const at::Tensor m = host_read(meta_);
      const auto* v = m.data_ptr<std::int64_t>();
      if (v[1] == world && v[0] == 0) {
        r.all_final = true;
        discard_window();
        return r;
      }
    }
    for (std::size_t b = next_launch_; b < buckets_.size(); ++b) launch(b);
    next_launch_ = buckets_.size();

    // Wait for every bucket; bring compressed buckets back to their dtype (and scan them there).
    const bool clip = options_.max_grad_norm.has_value();
    std::vector<at::Tensor> pieces{meta_.to(at::kDouble)};
    std::vector<at::Tensor> norms;
    for (std::size_t bi = 0; bi < buckets_.size(); ++bi) {
      auto& b = buckets_[bi];
      works_[bi]->wait();
      if (b.wire.defined()) {
        at::mul_out(b.head, b.wire_head, factor(b.head, /*post_wire=*/true));
        b.wire_bad.copy_(non_finite_flag(b.head, at::kFloat));
        pieces.push_back(b.wire_tail.to(at::kDouble));
        pieces.push_back(b.wire_bad.to(at::kDouble));
      } else {
        pieces.push_back(b.tail.to(at::kDouble));
      }
      if (clip) norms.push_back(at::norm(b.head, 2, compute_dtype(b.head.scalar_type())).to(at::kDouble).reshape({1}));
    }
    if (clip) pieces.push_back(at::cat(norms).square().sum().reshape({1}).to(device_));
    for (auto& piece : pieces) piece = piece.to(device_);

    // The window's one host read: count, final flags, used-flags and inf/NaN verdicts, squared norm.
    const at::Tensor summary = host_read(at::cat(pieces));
    const auto* v = summary.data_ptr<double>();
    const auto count = static_cast<std::int64_t>(v[0]);
    const bool no_samples = options_.average == Average::samples && count == 0;
    r.global_samples = count;
    r.all_final = static_cast<std::int64_t>(v[1]) == world;
    bool non_finite = false;
    global_used_.assign(slots_.size(), 0);
    std::size_t pos = 2;
    for (const auto& b : buckets_) {
      for (std::size_t j = 0; j < b.slots.size(); ++j) global_used_[b.slots[j]] = v[pos + j] > 0 ? 1 : 0;
      pos += b.slots.size();
      if (v[pos++] != 0) non_finite = true;  // some rank's scan before sending (NaN reads as "bad" too)
      if (b.wire.defined() && v[pos++] != 0) non_finite = true;
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
    if (non_finite || no_samples)
      for (auto& b : buckets_) b.head.zero_();
    r.non_finite = non_finite;
    r.no_samples = no_samples;
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
  [[nodiscard]] HostReads host_reads() const noexcept { return reads_; }
  [[nodiscard]] std::int64_t gradient_arrivals() const noexcept { return arrivals_; }
  [[nodiscard]] const ParameterList& parameters() const noexcept { return list_; }
  [[nodiscard]] const ReducerOptions& options() const noexcept { return options_; }
  [[nodiscard]] Comm& communicator() const noexcept { return *comm_; }

 private:
  static constexpr std::size_t kNoSlot = static_cast<std::size_t>(-1);

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

  /// Copies `t` to the host, counting the read (a synchronisation point on a GPU).
  at::Tensor host_read(const at::Tensor& t) {
    ++reads_.total;
    if (in_hook_) ++reads_.in_hooks;
    return t.to(at::kCPU);
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
        b.wire_div = at::full({1}, static_cast<double>(comm_->world_size()), opts);
        b.wire_bad = at::zeros({1}, opts);
      }
      if (!first.is_cpu()) b.flags_host = at::empty({n}, at::TensorOptions().dtype(b.wire.defined() ? *options_.wire_dtype : first.scalar_type()).pinned_memory(true));
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
          throw InvalidArgument(fmt::format("Reducer: {} was frozen (requires_grad = false) when the Reducer was built and is "
                                            "trainable now, so its gradient would never be reduced; {}",
                                            list_.describe(i), kAdvice));
        continue;
      }
      const auto& view = slots_[k].view;
      if (!p.requires_grad())
        throw InvalidArgument(fmt::format("Reducer: {} was trainable when the Reducer was built and is frozen now; {}",
                                          list_.describe(i), kAdvice));
      if (p.scalar_type() != view.scalar_type() || p.device() != view.device() || p.sizes() != view.sizes())
        throw InvalidArgument(fmt::format("Reducer: {} is {} [{}] on {} now but was {} [{}] on {} when the Reducer was built "
                                          "(e.g. module->to(...) afterwards); {}",
                                          list_.describe(i), c10::toString(p.scalar_type()), fmt::join(p.sizes(), ", "),
                                          p.device().str(), c10::toString(view.scalar_type()), fmt::join(view.sizes(), ", "),
                                          view.device().str(), kAdvice));
      if (torch::autograd::impl::try_get_grad_accumulator(p).get() != accumulators_[k].get())
        throw InvalidArgument(fmt::format("Reducer: {} got a new gradient accumulator after the Reducer was built (set_data or "
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
      // A second gradient in the synchronising backward. Before the bucket left it was simply added
      // to the slot, and the bucket is scaled as a whole when it leaves: (x + y) / N, exact.
      if (b.launched)
        throw InvalidArgument(fmt::format(
            "Reducer: {} received a second gradient in the synchronising backward after its bucket was sent, so it "
            "would miss the all-reduce; run one backward per micro-batch (sum the losses first), or use overlap = false",
            list_.describe(s.param)));
      return;
    }
    s.fired = true;
    if (--b.pending == 0) b.ready = true;
    if (!options_.overlap) return;
    while (next_launch_ < buckets_.size() && buckets_[next_launch_].ready) launch(next_launch_++);
  }

  /// Zeroes the slots of unused parameters, writes the used-flags, scales the bucket to this rank's
  /// share of the average while scanning it for inf/NaN (the verdict goes into the tail), and starts
  /// its all-reduce. Nothing here reads a value back to the host.
  void launch(std::size_t bi) {
    auto& b = buckets_[bi];
    for (std::size_t k : b.slots) {
      auto& s = slots_[k];
      if (s.used) continue;
      if (!s.was_undefined && !s.saved.defined()) s.saved = s.view.clone();
      s.view.zero_();  // an unused parameter's slot counts as zero
    }
    wait_meta();
    write_flags(b);
    at::Tensor* target = &b.flat;
    if (b.wire.defined()) {
      // Compressed: divided by the world size while cast (the loss scale stays on the wire); the
      // rest of the average is applied in float32 when the bucket is back (finish_window).
      at::div_out(b.wire_head, b.head, b.wire_div);
      target = &b.wire;
    } else {
      scale_bucket(b);
    }
    works_[bi] = start(*target);
    b.launched = true;
  }

  /// Divides (or multiplies) the bucket's gradients by the window's factor and writes this rank's
  /// inf/NaN verdict into the tail. CPU float32/float64: one fused pass reading the factor from its
  /// (CPU) tensor; elsewhere ATen ops on the device, with the verdict computed there.
  void scale_bucket(GradBucket& b) {
    const auto n = static_cast<std::int64_t>(b.slots.size());
    const at::Tensor& f = factor(b.head, /*post_wire=*/false);
    if (has_fused_scan(b.flat)) {
      bool bad = false;
      AT_DISPATCH_FLOATING_TYPES(b.flat.scalar_type(), "loom_scale_bucket", [&] {
        const double value = static_cast<double>(f.data_ptr<scalar_t>()[0]);
        bad = scale_and_check_span(b.flat, 0, b.head.numel(), value, divide_, options_.skip_non_finite);
        b.flat.data_ptr<scalar_t>()[b.head.numel() + n] = bad ? scalar_t(1) : scalar_t(0);
      });
      return;
    }
    if (divide_) b.head.div_(f);
    else b.head.mul_(f);
    auto verdict = b.tail.narrow(0, n, 1);
    if (options_.skip_non_finite) verdict.copy_(non_finite_flag(b.head, b.tail.scalar_type()));
    else verdict.zero_();
  }

  /// The window's factor for a bucket like `like`, as a one-element tensor on its device, computed
  /// on the device from the all-reduced sample count (no host read): the divisor (count, world
  /// size or 1) when dividing, else grad_scale / divisor; with post_wire, world size x grad_scale /
  /// divisor (what a compressed bucket still needs after its world-size pre-division).
  const at::Tensor& factor(const at::Tensor& like, bool post_wire) {
    const auto dtype = compute_dtype(like.scalar_type());
    for (const auto& f : factors_)
      if (f.dtype == dtype && f.device == like.device() && f.post_wire == post_wire) return f.value;
    wait_meta();
    const auto opts = at::TensorOptions().dtype(at::kDouble).device(meta_.device());
    at::Tensor divisor = options_.average == Average::samples
                             ? meta_.narrow(0, 0, 1).clamp_min(1).to(at::kDouble)
                             : at::full({1}, options_.average == Average::world_size ? comm_->world_size() : 1.0, opts);
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

  void wait_meta() {
    if (meta_work_) {
      meta_work_->wait();
      meta_work_.reset();
    }
  }

  // Head of a bucket's tail: one used-flag per gradient (host-known; a GPU bucket copies them from
  // pinned memory without waiting). The inf/NaN verdict after them is written by scale_bucket.
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
    if (!tail.is_cpu()) tail.narrow(0, 0, static_cast<std::int64_t>(n)).copy_(b.flags_host, /*non_blocking=*/true);
    if (b.wire.defined()) tail.narrow(0, static_cast<std::int64_t>(n), 1).zero_();  // checked after the trip instead
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
  at::Tensor meta_;  // int64 [window samples, final flag] on device_
  std::vector<Factor> factors_;  // this window's factors, per dtype / device
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
  std::vector<std::uintptr_t> keys_;
  std::mutex mutex_;
  std::size_t next_launch_ = 0;
  HostReads reads_;
  std::int64_t arrivals_ = 0;  // gradients delivered by autograd hooks since construction
  double grad_scale_ = 1.0;  // of the current sync window
  bool divide_ = true;       // divide by the divisor (exact) rather than multiply by grad_scale / divisor
  std::int64_t next_ready_pos_ = 0;
  bool in_hook_ = false;
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
  /// Reads of collective results to the host so far (see HostReads).
  [[nodiscard]] HostReads host_reads() const noexcept { return state_->host_reads(); }
  /// Gradients autograd delivered to this reducer's hooks since construction (one per parameter
  /// per backward that reached it). A caller that knows how many backward passes it ran can tell
  /// from it whether a backward ran behind its back (loom::Trainer does).
  [[nodiscard]] std::int64_t gradient_arrivals() const noexcept { return state_->gradient_arrivals(); }
  [[nodiscard]] const ParameterList& parameters() const noexcept { return state_->parameters(); }
  [[nodiscard]] const ReducerOptions& options() const noexcept { return state_->options(); }
  [[nodiscard]] Comm& communicator() const noexcept { return state_->communicator(); }

 private:
  std::unique_ptr<detail::ReducerState<Comm>> state_;
};

}  // namespace loom
