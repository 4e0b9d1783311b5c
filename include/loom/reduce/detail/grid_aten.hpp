// loom/reduce/detail/grid_aten.hpp — the deterministic reducer's grid arithmetic (exact.hpp) with
// ATen operators, for buckets that do not live in host memory (a GPU's, or CPU tensors under
// DevicePathOnCpu): a slot at a time (quantize_add_aten, dequantize_aten), or a whole bucket in a
// fixed number of operators whatever its number of slots (quantize_add_bucket_aten,
// dequantize_bucket_aten: each element's factor repeated over its slot's segment, per-slot flags and
// largest sums as segment maxima). Each computes the bits of its CPU loop in exact.hpp: the same
// float64 product and rounding per element; nothing here reads a value back to the host.
//
// Shape: `g` / `out` 1-D floating, `q` 1-D int64 of the same length (a bucket's heads or one slot's
//        range of them); a bucket's tail is GridTail (int64 [4n + 1]).
// Source: see exact.hpp.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include <loom/reduce/detail/exact.hpp>
#include <loom/reduce/detail/scale.hpp>

namespace loom::detail {

/// The same as quantize_add_cpu with ATen ops on any device, for 1-D `g` (floating) and `q`
/// (int64) of equal length. The flags are added to the one-element int64 tensors `non_finite`,
/// `overflow` and `near` (0 or 1 each), on q's device, without reading anything back to the host.
inline void quantize_add_aten(at::Tensor g, at::Tensor q, int exponent, at::Tensor non_finite, at::Tensor overflow,
                              at::Tensor near) {
  const double scale = std::ldexp(1.0, exponent);
  const at::Tensor finite = at::isfinite(g);
  const at::Tensor x = g.to(at::kDouble).mul(scale);
  const at::Tensor a = x.abs();
  const at::Tensor below = at::logical_and(finite, a.lt(kGridLimit));
  q.add_(at::where(below, x.round(), at::zeros({}, x.options())).to(at::kLong));
  non_finite.add_(at::logical_not(finite).any().to(at::kLong).reshape({1}));
  overflow.add_(at::logical_and(finite, at::logical_not(a.lt(kGridLimit))).any().to(at::kLong).reshape({1}));
  near.add_(at::logical_and(below, a.ge(kGridNear)).any().to(at::kLong).reshape({1}));
  g.zero_();
}

/// The same as dequantize_cpu with ATen ops on any device: writes `out` (1-D floating, the length
/// of `q`) and returns the largest |q| as a one-element int64 tensor on q's device and whether a
/// result is not finite as a one-element int64 tensor (0/1), both without a host read. The values
/// are the bits of dequantize_cpu (one float64 multiplication by the same factor, then the cast).
inline std::pair<at::Tensor, at::Tensor> dequantize_aten(const at::Tensor& q, at::Tensor out, int exponent,
                                                         double multiplier, double divisor) {
  out.copy_(q.to(at::kDouble).mul(grid_factor(exponent, multiplier, divisor)));
  at::Tensor largest = q.numel() > 0 ? q.abs().max().reshape({1}) : at::zeros({1}, q.options());
  at::Tensor bad = non_finite_flag(out, at::kLong);
  return {largest, bad};
}

/// Per element of a bucket's head, its slot's value: `per_slot` (float64, one value per slot, on
/// the host) repeated lengths[j] times, on lengths' device (lengths: int64, the slots' element
/// counts, summing to `total`). The factors of quantize_add_bucket_aten and dequantize_bucket_aten.
/// For a CUDA device the values go through pinned memory without waiting (LibTorch's pinned
/// allocator keeps the staging block until the copy ran), so a hook that calls it never waits for
/// the GPU; `total` spares repeat_interleave a read of the lengths' sum.
inline at::Tensor per_element(const std::vector<double>& per_slot, const at::Tensor& lengths, std::int64_t total) {
  at::Tensor values = at::tensor(per_slot, at::TensorOptions().dtype(at::kDouble));
  if (lengths.is_cuda()) values = values.pin_memory().to(lengths.device(), /*non_blocking=*/true);
  return at::repeat_interleave(values, lengths, /*dim=*/0, total);
}

/// quantize_add_aten over a whole bucket in a fixed number of operators, whatever its number of
/// slots: `g` (floating) and `q` (int64) are the bucket's heads, `scale` the float64 2^exponent of
/// each element's slot (per_element), `lengths` the slots' element counts (int64 [n]) and `tail`
/// the bucket's GridTail (int64 [4n + 1]): slot j's overflow and near flags and the bucket's
/// non-finite flag grow by 0 or 1 as n calls of quantize_add_aten would make them grow. The sums
/// are those bits (the same float64 product and rounding per element); g is zeroed.
inline void quantize_add_bucket_aten(at::Tensor g, at::Tensor q, const at::Tensor& scale, const at::Tensor& lengths,
                                     at::Tensor tail) {
  const std::int64_t n = lengths.numel();
  const at::Tensor finite = at::isfinite(g);
  const at::Tensor x = g.to(at::kDouble).mul(scale);
  const at::Tensor a = x.abs();
  const at::Tensor in_range = a.lt(kGridLimit);
  const at::Tensor below = at::logical_and(finite, in_range);
  q.add_(at::where(below, x.round(), at::zeros({}, x.options())).to(at::kLong));
  // Per slot, whether any element overflowed or came near the limit: a segment maximum of 0/1.
  const at::Tensor flags =
      at::stack({at::logical_and(finite, at::logical_not(in_range)), at::logical_and(below, a.ge(kGridNear))}, 1)
          .to(at::kDouble);
  const at::Tensor per_slot =
      at::segment_reduce(flags, "max", lengths, {}, {}, /*axis=*/0, /*unsafe=*/true, at::Scalar(0.0)).to(at::kLong);
  tail.narrow(0, n, n).add_(per_slot.select(1, 0));
  tail.narrow(0, 2 * n, n).add_(per_slot.select(1, 1));
  tail.narrow(0, 4 * n, 1).add_(at::logical_not(finite).any().to(at::kLong).reshape({1}));
  g.zero_();
}

/// dequantize_aten over a whole bucket in a fixed number of operators: writes `out` (the floating
/// head) from `q` (the int64 head) times `factor` (float64 per element: each slot's grid_factor,
/// per_element) and returns each slot's largest |q| (int64 [n], on q's device; exact below 2^53,
/// a float64 segment maximum) and whether a result is not finite (int64 [1], 0/1), without a host
/// read. The values are the bits of dequantize_aten slot by slot.
inline std::pair<at::Tensor, at::Tensor> dequantize_bucket_aten(const at::Tensor& q, at::Tensor out,
                                                                const at::Tensor& factor, const at::Tensor& lengths) {
  out.copy_(q.to(at::kDouble).mul(factor));
  at::Tensor largest =
      at::segment_reduce(q.abs().to(at::kDouble), "max", lengths, {}, {}, /*axis=*/0, /*unsafe=*/true, at::Scalar(0.0))
          .clamp_max(0x1p62)
          .to(at::kLong);
  at::Tensor bad = non_finite_flag(out, at::kLong);
  return {largest, bad};
}

}  // namespace loom::detail
