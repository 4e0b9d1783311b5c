// loom/reduce/detail/averaging.hpp — how a reduced bucket becomes the average: the window's factor
// (divisor by ReducerOptions::average, the voters' loss divisor multiplied back, the loss scale),
// the division before the all-reduce when part of the divisor is known then, and the one pass over a
// reduced bucket, which also scans the result for inf/NaN.
//
// Units: the divisor is a sample count, the world size or 1, times n / sum d over the loss-divisor
//        voters (see window_summary.hpp); grad_scale is 1 / loss scale.
// Rule: a CPU float32/float64 bucket is divided when it is launched only by a power-of-two world
//       size (or 1), as DDP divides before its all-reduce; every other divisor is applied after the
//       all-reduce, so a hook never waits. Why, and the range flag: docs/reduce.md#the-rules
//       ("Non-finite gradients").
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include <ATen/ATen.h>

#include <loom/reduce/detail/bucket.hpp>
#include <loom/reduce/detail/host_path.hpp>
#include <loom/reduce/detail/scale.hpp>
#include <loom/reduce/detail/window_summary.hpp>
#include <loom/reduce/options.hpp>

namespace loom::detail {

/// The averaging of one synchronising window. begin() at prepare_backward, apply() per bucket in
/// finish_window once the bucket's all-reduce and the window meta's (the first bucket's) are complete.
class WindowAverage {
 public:
  /// Starts a window: the sum over `world_size` ranks becomes the mean by `average`, times
  /// `grad_scale`. Without a loss scale (grad_scale == 1) the sum is divided, so each rank's share
  /// is exactly rounded (one rank: the mean is) when the divisor is an integer; otherwise it is
  /// multiplied by grad_scale / divisor.
  void begin(Average average, int world_size, double grad_scale) {
    average_ = average;
    world_size_ = world_size;
    grad_scale_ = grad_scale;
    divide_ = grad_scale == 1.0;
    pre_divisor_ = average == Average::world_size && is_power_of_two_divisor(static_cast<double>(world_size))
                       ? static_cast<double>(world_size)
                   : average == Average::none ? 1.0
                                              : 0.0;
    factors_.clear();
  }

  /// Called when bucket `b` is launched, before its all-reduce (floating mode): a bucket with a
  /// range flag is divided by the pre-divisor (pre_divisor_) in place when that is not 0, and its range flag set to
  /// 1 when a quotient is inf, NaN or above (largest finite value) / (2 x world size),
  /// else 0. Below that bound the sum of the ranks' quotients cannot overflow, so a zero summed flag
  /// says the reduced bucket is finite without reading it.
  void pre_divide(GradBucket& b) {
    b.late_gradient = false;
    if (!b.range_flag.defined()) return;
    bool beyond = false;
    if (divided_before(b)) {
      const double largest = b.flat.scalar_type() == at::kFloat ? static_cast<double>(std::numeric_limits<float>::max())
                                                                : std::numeric_limits<double>::max();
      beyond = scale_span_fused(b.flat, 0, b.head.numel(), pre_divisor_, /*divide=*/true, /*check=*/true,
                                largest / (2.0 * world_size_));
    }
    AT_DISPATCH_FLOATING_TYPES(b.flat.scalar_type(), "loom_range_flag",
                               [&] { *b.range_flag.data_ptr<scalar_t>() = beyond ? scalar_t(1) : scalar_t(0); });
  }

  /// Turns bucket `b`'s all-reduced sum into the average and scans the result for inf/NaN
  /// in the same pass. A compressed bucket (b.wire) is first cast back from the wire, times its
  /// remaining factor. A bucket divided before its all-reduce (pre_divide) gets the rest of the
  /// factor; when nothing is left and neither a rank's range flag nor a late gradient
  /// (GradBucket::late_gradient) says otherwise, it is not read: finite. CPU float32/float64 with
  /// a CPU `meta`: one fused pass, the verdict on the host (b.bad_host); elsewhere ATen ops on the
  /// device, the verdict in b.bad (no host read).
  /// `meta`: the summed window meta (int64 [WindowMeta::kLength]), its all-reduce complete.
  void apply(GradBucket& b, const at::Tensor& meta) {
    if (on_host(meta) && on_host(b.flat)) {
      double value = host_factor(meta, /*post_wire=*/b.wire.defined());
      bool divide = divide_ && !b.wire.defined();
      if (b.wire.defined()) {
        at::mul_out(b.head, b.wire_head, at::full({1}, value, b.head.options()));
        value = 1.0;
        divide = false;
      }
      if (divided_before(b)) {
        // Divided by pre_divisor_ before the sum: what is left of the factor is exact (a power of
        // two apart). Nothing left and no rank flagged a value: the bucket is the average and finite.
        value = divide ? value / pre_divisor_ : value * pre_divisor_;
        if (value == 1.0 && !b.late_gradient && !range_flagged(b)) {
          b.bad_host = false;
          return;
        }
      }
      if (has_fused_scan(b.flat)) {
        b.bad_host = scale_and_check_span(b.flat, 0, b.head.numel(), value, divide, /*check=*/true);
        if (b.main && !b.bad_host) b.bad_host = !at::isfinite(b.head.to(b.param_dtype)).all().template item<bool>();
        return;
      }
      // float16 / bfloat16 on the CPU: a one-element float32 operand makes ATen compute in float32.
      const at::Tensor f = at::full({1}, value, b.head.options().dtype(compute_dtype(b.head.scalar_type())));
      if (divide)
        b.head.div_(f);
      else if (value != 1.0)
        b.head.mul_(f);
      b.bad_host = !at::isfinite(b.head).all().template item<bool>();
      return;
    }
    if (b.wire.defined()) {
      at::mul_out(b.head, b.wire_head, device_factor(meta, b.head, /*post_wire=*/true));
    } else {
      const at::Tensor& f = device_factor(meta, b.head, /*post_wire=*/false);
      if (divided_before(b) && divide_)  // a CPU bucket with the window meta on a device: the rest of the
        b.head.div_(f.div(pre_divisor_).to(b.head.device()));  // factor (exact: pre_divisor_ is 2^k)
      else if (divided_before(b))
        b.head.mul_(f.mul(pre_divisor_).to(b.head.device()));
      else if (divide_)
        b.head.div_(f);
      else
        b.head.mul_(f);
    }
    // A float32 average outside the parameters' 16-bit range would step with inf: non-finite too.
    b.bad.copy_(non_finite_flag(b.head, at::kFloat, b.main ? std::optional(b.param_dtype) : std::nullopt));
  }

 private:
  struct Factor {
    c10::ScalarType dtype;
    c10::Device device;
    bool post_wire;
    at::Tensor value;
  };

  /// The window's factor, read from host memory: the divisor when dividing, else grad_scale /
  /// divisor; with post_wire, world size x grad_scale / divisor (what a compressed bucket still
  /// needs after its world-size pre-division).
  [[nodiscard]] double host_factor(const at::Tensor& meta, bool post_wire) const {
    const WindowCounts c = WindowCounts::decode(meta.data_ptr<std::int64_t>());
    const double base = average_ == Average::samples      ? static_cast<double>(std::max<std::int64_t>(c.samples, 1))
                        : average_ == Average::world_size ? static_cast<double>(world_size_)
                                                          : 1.0;
    // The losses were divided by the voters' d (sum d / n; 1 when nobody voted).
    const double divisor =
        c.voters > 0 ? base * static_cast<double>(c.voters) / static_cast<double>(c.divisor_sum) : base;
    if (post_wire) return world_size_ * grad_scale_ / divisor;
    return divide_ ? divisor : grad_scale_ / divisor;
  }

  /// The same factor computed with device ops as a one-element tensor of `like`'s compute dtype on
  /// its device (no host read), cached per dtype, device and post_wire for the window.
  const at::Tensor& device_factor(const at::Tensor& meta, const at::Tensor& like, bool post_wire) {
    const auto dtype = compute_dtype(like.scalar_type());
    for (const auto& f : factors_)
      if (f.dtype == dtype && f.device == like.device() && f.post_wire == post_wire) return f.value;
    const auto opts = at::TensorOptions().dtype(at::kDouble).device(meta.device());
    at::Tensor divisor = average_ == Average::samples
                             ? WindowMeta::slice(meta, WindowMeta::samples).clamp_min(1).to(at::kDouble)
                             : at::full({1}, average_ == Average::world_size ? world_size_ : 1.0, opts);
    // The losses were divided by the voters' d: times n / sum d (both clamped to 1: nobody voted).
    divisor = divisor.mul(WindowMeta::slice(meta, WindowMeta::voters).clamp_min(1).to(at::kDouble))
                  .div(WindowMeta::slice(meta, WindowMeta::divisor_sum).clamp_min(1).to(at::kDouble));
    at::Tensor value = post_wire ? divisor.reciprocal().mul(world_size_ * grad_scale_)
                       : divide_ ? divisor
                                 : divisor.reciprocal().mul(grad_scale_);
    factors_.push_back({dtype, like.device(), post_wire, value.to(like.device()).to(dtype)});
    return factors_.back().value;
  }

  /// Whether bucket `b` was divided by pre_divisor_ when it was launched this window (pre_divide).
  [[nodiscard]] bool divided_before(const GradBucket& b) const { return pre_divisor_ > 0 && b.range_flag.defined(); }

  /// Whether some rank set bucket `b`'s range flag (its summed value, read on the host).
  static bool range_flagged(const GradBucket& b) {
    bool flagged = false;
    AT_DISPATCH_FLOATING_TYPES(b.flat.scalar_type(), "loom_range_flagged",
                               [&] { flagged = *b.range_flag.data_ptr<scalar_t>() != scalar_t(0); });
    return flagged;
  }

  Average average_ = Average::samples;
  int world_size_ = 1;
  double grad_scale_ = 1.0;
  bool divide_ = true;  // divide by the divisor (exact) rather than multiply by grad_scale / divisor
  // What a bucket with a range flag is divided by when it is launched: the world size when averaging
  // by it and it is a power of two (the bits of dividing after the sum, but for subnormal quotients
  // and an overflowing sum), 1 when not averaging, 0 (no division before) otherwise; the same on
  // every rank (options and world size only), as the sum needs.
  double pre_divisor_ = 0.0;
  std::vector<Factor> factors_;  // this window's device factors
};

}  // namespace loom::detail
