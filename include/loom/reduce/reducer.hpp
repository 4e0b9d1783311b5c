// loom/reduce/reducer.hpp — Reducer: bucketed, overlapped, exactly weighted gradient all-reduce
// over any loom Communicator.
//
// One sentence: the reducer packs every trainable parameter's gradient into flat per-dtype/device
// buckets (a float32 or float64 `p.grad()` is a view into its bucket; float16/bfloat16 gradients are
// summed in float32 slots), sends a bucket with one asynchronous
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
//   if (!r.non_finite && !r.grid_overflow) optimizer.step();     //   ranks' samples)/dp on every rank
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
//   One reducer per parameter: a parameter already hooked by another live loom::Reducer (a second
//     Trainer or Reducer on the same model) is loom::InvalidArgument at construction, before any
//     collective; build the next one after the first is destroyed.
//   Buckets: ~25 MiB (bucket_cap_bytes), the first one 1 MiB (first_bucket_cap_bytes), one dtype and
//     device per bucket, filled in reverse registration order; after the first step they are rebuilt
//     once in the order gradients became ready on rank 0 (broadcast, so every rank agrees). Each
//     bucket ends with one flag per parameter that says whether the sending rank used it.
//   Launch order: bucket k is sent only after buckets 0..k-1, on every rank the same sequence. A
//     bucket leaves, as it is, once every gradient in it arrived in the synchronising backward: a
//     hook never waits for anything. finish_window waits for the buckets in that order and, while
//     later ones are still in flight, divides each reduced sum to the average (by the global
//     sample count, which the first bucket carries with it, or by the world size; times 1 / loss
//     scale) and scans it for inf/NaN in the same pass. With average = world_size on a world size
//     that is a power of two (or average = none), a CPU float32/float64 bucket (not compressed, not
//     float32-accumulated) is instead divided by the world size when it leaves, as DDP divides
//     before its all-reduce, in a pass that flags values that are inf, NaN or large enough that the
//     sum might overflow; the flag travels in the bucket, and the reduced bucket is read again only
//     when a rank set it or a factor (loss scale, loss divisor) is left to apply. Dividing by 2^k
//     before the sum gives the bits of dividing after it, unless a quotient is subnormal or the
//     undivided sum would have overflowed (its finite mean is then kept, not reported non-finite).
//   A gradient that arrives twice in the synchronising backward (two backward passes before
//     finish_window, reentrant checkpointing, mark_ready after adding to a gradient by hand) is
//     exact while its bucket has not left: the arrivals add up in the slot and the sum is divided
//     once, (x + y) / N. After the bucket left, the second arrival would miss the
//     all-reduce: loom::InvalidArgument naming the parameter (DDP: "Expected to mark a variable
//     ready only once"). overlap = false sends nothing before finish_window, so it never throws.
//   Unused parameters: a parameter whose gradient hook did not fire on a rank during the window
//     counts as zero in that rank's slot (it cannot stall its bucket: unfinished buckets are sent by
//     finish_window). A parameter unused on EVERY rank keeps the gradient it had before the window
//     (an undefined gradient stays undefined, so optimizers skip it; a stale value stays).
//   Gradients accumulate across the window's backward passes as in plain LibTorch; zero them after
//     each optimizer step (optimizer.zero_grad(), with or without set_to_none) as usual. Except
//     float16/bfloat16 parameters with float32_accumulation: inside a window their p.grad() holds
//     only what the next hook (or mark_ready) moves into the float32 slot, so a gradient written by
//     hand is assigned (`p.mutable_grad() = g`) and adds to the window's sum when marked ready.
//     And deterministic mode: each micro-batch's gradient goes onto the integer grid (and .grad()
//     is zeroed) at the next prepare_backward; once a CPU bucket has been sent its parameters have
//     no .grad() until finish_window (ReducerOptions::deterministic).
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
//   Non-finite: the scan runs on the reduced bucket, which is bit-identical on every rank (an
//     all-reduce gives every rank the same result), so every rank reaches the same verdict and
//     reports Reduction::non_finite together, without an extra collective; the window's gradients
//     are then zeroed. An inf or NaN on any rank reaches the sum (inf + x = inf, NaN + x = NaN),
//     and a sum over ranks that overflows is caught too. A bucket divided before its all-reduce
//     (above) is scanned only when its summed range flag says a rank sent inf, NaN or a value above
//     (largest finite) / (2 x world size); below that bound the sum cannot overflow. The scan tests
//     each element's magnitude (on the CPU a loop, on a device one infinity-norm reduction per
//     bucket), never a sum of elements, so float16 gradients whose sum exceeds 65504 are finite.
//   Clipping (max_grad_norm): the L2 norm of the averaged, unscaled gradient over all buckets — the
//     global norm, identical on every rank, accumulated in float32 for float16/bfloat16 buckets
//     and float64 for float64 ones — and the clip factor min(1, max / (norm + 1e-6)).
//   Host reads: nothing inside an autograd hook reads a value back to the host, or waits (hooks
//     only start all-reduces); the divisor and the verdicts stay on the communicator's device
//     (CPU communicators read them from host memory); finish_window makes one read of a small
//     float64 summary (count, final and leaving flags, used-flags, verdicts, squared norm), and an end-of-epoch
//     flush one more first (whether any rank has samples). host_reads() counts them. Deterministic
//     mode on a GPU reads the window meta, then the integer tails and maxima, then (clipping) the
//     per-parameter norms: up to 3 reads per window; none on the CPU beyond host memory.
//   Wire compression (wire_dtype = float16 / bfloat16, float32 buckets only; a bucket of bfloat16
//     parameters accumulated in float32 goes on a bfloat16 wire, never float16, whose range is
//     narrower than its parameters'): rank r sends its
//     share s_r = S_r / W, where S_r is its summed (still loss-scaled) gradient and W the world size,
//     cast to the wire dtype (a division before the all-reduce: W needs no waiting); the
//     shares are summed in that dtype and cast back, and the float32
//     bucket is multiplied by W x (1 / loss scale) / divisor, then scanned for inf/NaN. Dividing by
//     W, not by the sample count, keeps the shares count/W times larger, away from float16's
//     subnormal range (below 2^-14 = 6.1e-5), and the loss scale stays on the wire where it
//     protects small gradients. Error bound per element (float16; bfloat16 with 2^-8 and no
//     subnormal term in its range): |error| <= (W / divisor) x sum over the W casts and W - 1
//     additions of (2^-11 x |value rounded| + 2^-25), i.e. relative 2^-11 per rounding while
//     shares are normal, and an absolute 2^-25 x W / divisor per rounding below; a share below
//     2^-25 (3e-8) is flushed to zero, and one above 65504 becomes inf (reported non_finite).
//   16-bit parameters (float32_accumulation, default on): a float16/bfloat16 parameter's slot is
//     float32. Its hook adds the backward's 16-bit gradient to the slot and resets p.grad() (undefined
//     until the step boundary, which sets it to the 16-bit copy of the average; a gradient the
//     parameter holds when a window starts is moved into the slot first), so micro-batch sums,
//     the all-reduce, the division and the clipping norm are float32, and the result is rounded to
//     the parameter's dtype once. An average outside that dtype's range (float16: 65504) is reported
//     non_finite like an inf. Cost: 4 bytes per element instead of 2 and float32 on the wire (set
//     wire_dtype to send 16 bits). Off: each 16-bit gradient is a view into a bucket of its dtype and
//     every micro-batch's addition rounds (bfloat16's spacing at 1.0 is 2^-7: a small later
//     micro-batch can vanish).
//   Loss divisor (BackwardPlan::loss_divisor = d, default 1): the caller divided every loss of the
//     window by d, the same on every rank; the average is sum x d / count. A float16 loop divides by
//     the step's planned global samples instead of multiplying each micro-batch's mean loss by its
//     own samples, so no backward produces more than its share of the step's mean (loom::Trainer
//     does this for 16-bit parameters; float16 without loss scaling trades overflow for underflow:
//     use loss scaling). A rank whose window holds no loss (a join, an end-of-epoch flush with
//     nothing left) passes d = 0 and takes the others' d. Ranks whose d >= 1 differ: every rank
//     throws loom::InvalidArgument from finish_window after the collectives (gradients zeroed),
//     found from the voters' number, sum and sum of squares of d in the window meta.
//   Sample count and join (the window meta): each rank's [window samples, final flag, leaving
//     flag, d, d^2, d >= 1, flight-recorder fingerprint f, f^2, has f, replica fingerprint g
//     (compare_replicas), g^2, has g] is summed over the ranks in
//     the first bucket's all-reduce, after its used-flags, as limbs of b = p - ceil(log2 world
//     size) bits in the bucket's wire dtype of p significand bits (24 float32, 53 float64, 11
//     float16, 8 bfloat16): each limb's sum stays below 2^p, exact in any order, so a step issues
//     one all-reduce per bucket, as DDP. Deterministic mode, and a first bucket without room
//     (bfloat16 on more than 128 ranks, float16 on more than 1024), send it as an int64
//     all-reduce of its own before backward (trace context "reducer window"). A final flush (end
//     of epoch) sends the first bucket first;
//     when it finds every rank final and no sample anywhere it stops there, every gradient as it was.
//   Leaving (BackwardPlan::leaving): a rank that abandons its loop early (loom::Trainer, on a
//     `break`) closes one last window with the flag set; every rank's Reduction then reports
//     ranks_leaving > 0 with its gradients zeroed, so the ranks still in that step stop with an
//     error instead of waiting for a rank that will not come.
//
// Collectives per step: one all-reduce per bucket (+ the window meta's own when the first bucket
// does not carry it; + one broadcast, once, for the rebuild; + the buffer broadcast when the model
// has buffers).
// Shape: gradients have their parameters' shapes and strides (dense layouts kept, e.g.
//        channels-last), dtypes float32/float64/float16/bfloat16 (16-bit ones in float32 slots, see
//        above); frozen parameters are left out.
//        A bucket on the wire is [gradients | one used-flag per gradient (| the window meta's limbs,
//        the first bucket) (| the range flag, CPU float32/float64 buckets neither compressed nor
//        float32-accumulated, floating mode)], one dtype and device.
// Units: caps in bytes, samples in samples.
// Throws: loom::InvalidArgument (bad options, non-floating or non-leaf trainable parameter, a
//         parameter another live Reducer already hooks,
//         parameters that differ across ranks, a gradient produced twice after its bucket left,
//         a parameter set changed after construction, a loss_divisor outside [1, kMaxLossDivisor]
//         or different across ranks),
//         loom::Error (calls out of order), and the communicator's CommError / TimeoutError.
// Source: PyTorch DistributedDataParallel's Reducer (bucketing, gradient_as_bucket_view, ready-order
//         rebuild, find_unused_parameters' bitmap, fp16_compress_hook, join for uneven inputs).
#pragma once

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include <loom/comm/communicator.hpp>
#include <loom/error.hpp>
#include <loom/reduce/buckets.hpp>
#include <loom/reduce/concepts.hpp>
#include <loom/reduce/detail/reducer_state.hpp>
#include <loom/reduce/options.hpp>
#include <loom/reduce/parameters.hpp>

namespace loom {

/// Bucketed gradient all-reduce for data-parallel training. Models GradientReducer.
///
/// Example: see the file comment (and loom::Accumulator for the usual loop).
/// Shape: see the file comment. Movable, not copyable; the parameters must outlive it.
/// Throws: see the file comment.
/// Source: PyTorch DDP's Reducer.
template <Communicator Comm>
class Reducer {
 public:
  /// Checks the options and parameters across ranks (ReducerOptions::check_parameters; one all_gather
  /// each: every rank must pass the same ReducerOptions, `overlap` aside), broadcasts rank 0's parameters and buffers, allocates the
  /// buckets and registers one autograd hook per trainable parameter.
  /// Throws: loom::InvalidArgument (options or parameters that differ across ranks, naming the first
  ///         one and both values; bad options or parameters); comm errors.
  Reducer(Comm& comm, ParameterList params, ReducerOptions options = {})
      : state_(std::make_unique<detail::ReducerState<Comm>>(comm, std::move(params), std::move(options))) {}

  /// See GradientReducer: announces whether the next backward closes the window (and, where the
  /// first bucket does not carry the window meta, starts the meta's own all-reduce when it does).
  void prepare_backward(const BackwardPlan& plan) { state_->prepare_backward(plan); }

  /// See GradientReducer: sends the buckets not sent yet, waits for all, restores parameters
  /// unused everywhere, reports inf/NaN, clips. Gradients are then identical on every rank.
  Reduction finish_window() { return state_->finish_window(); }

  /// Declares that parameter `param_index`'s gradient (written without autograd) is complete for
  /// this backward, as its hook would. Throws: loom::InvalidArgument for a frozen or unknown index.
  void mark_ready(std::size_t param_index) { state_->mark_ready(param_index); }

  /// Calls mark_ready for every trainable parameter with a gradient, in launch order (a parameter
  /// without one counts as unused, as when its hook does not fire).
  void mark_all_ready() {
    const auto& params = state_->parameters().params;
    for (const auto& bucket : state_->bucket_params())
      for (std::size_t i : bucket)
        if (params[i].grad().defined()) state_->mark_ready(i);
  }

  /// ReducerOptions::deterministic: each trainable parameter's grid exponent e (its gradient
  /// contributions are summed as integer multiples of 2^-e), in parameter-list order, frozen ones
  /// left out; the exponents the next window will use. Equal on every rank.
  [[nodiscard]] std::vector<int> grid_exponents() const { return state_->grid_exponents(); }
  /// Continues the grid exponents of a run (grid_exponents() as saved in a checkpoint), so a
  /// resumed deterministic run, on any world size, puts its gradients on the grids the
  /// uninterrupted one would have used. Call between windows, with the same values on every rank.
  /// Throws: loom::InvalidArgument when the reducer is not deterministic, for a count other than
  ///         the trainable parameters' or an exponent outside [-900, 900]; loom::Error inside a window.
  void load_grid_exponents(const std::vector<int>& exponents) { state_->load_grid_exponents(exponents); }
  /// Throws what load_grid_exponents would for `exponents` (but for an open window), changing
  /// nothing: a checkpoint is checked before any of the run changes.
  void check_grid_exponents(const std::vector<int>& exponents) const { state_->check_grid_exponents(exponents); }

  /// Parameter indices of each bucket, in launch order.
  [[nodiscard]] std::vector<std::vector<std::size_t>> bucket_params() const { return state_->bucket_params(); }
  /// The gradient part of each bucket (1-D, in launch order); float32/float64 gradients are views into
  /// these, float16/bfloat16 ones are summed in them as float32 (ReducerOptions::float32_accumulation).
  [[nodiscard]] std::vector<at::Tensor> bucket_tensors() const { return state_->bucket_tensors(); }
  /// Whether the one-time rebuild in gradient-ready order happened.
  [[nodiscard]] bool rebuilt() const noexcept { return state_->rebuilt(); }
  /// Reads of collective results to the host so far (see HostReads).
  [[nodiscard]] HostReads host_reads() const noexcept { return state_->host_reads(); }
  /// Gradients autograd delivered to this reducer's hooks since construction (one per parameter
  /// per backward that reached it). A caller that knows how many backward passes it ran can tell
  /// from it whether a backward ran behind its back (loom::Trainer does).
  [[nodiscard]] std::int64_t gradient_arrivals() const noexcept { return state_->gradient_arrivals(); }
  /// Compares `fingerprint` (a value in [0, 2^20) of something every replica must share) across
  /// the ranks in every following synchronising window, with no collective of its own: it rides in
  /// the window meta. When the ranks that set one sent different values, the window's
  /// Reduction::replicas_differ is true and its gradients are zeroed. std::nullopt stops comparing.
  /// Example: `reducer.compare_replicas(hash_of_learning_rates & 0xFFFFF);` (loom::Trainer does this).
  /// Throws: loom::InvalidArgument for a value outside [0, 2^20).
  void compare_replicas(std::optional<std::int64_t> fingerprint) { state_->compare_replicas(fingerprint); }
  [[nodiscard]] const ParameterList& parameters() const noexcept { return state_->parameters(); }
  [[nodiscard]] const ReducerOptions& options() const noexcept { return state_->options(); }
  [[nodiscard]] Comm& communicator() const noexcept { return state_->communicator(); }

 private:
  std::unique_ptr<detail::ReducerState<Comm>> state_;
};

}  // namespace loom
