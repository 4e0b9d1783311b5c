// loom/reduce/detail/scale.hpp — the reducer's one pass over a bucket: divide (or multiply) every
// gradient to this rank's share of the average and, at the same time, scan for inf/NaN (after the
// all-reduce) or for values beyond a range bound (before it); and the device-side verdict for
// buckets the fused CPU loop does not take.
//
// Shape: 1-D contiguous tensors (a bucket's head) or any tensor (scale_and_check's fallback).
// Units: `value` is a divisor or a factor, dimensionless; `bound` in gradient units.
// Source: the vectorised scan of the bits follows the idea of torch's _amp_foreach_non_finite_check_and_unscale_.
#pragma once

#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <type_traits>

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <loom/reduce/detail/host_path.hpp>

namespace loom::detail {

/// The signed integer as wide as T. A float's bits with the sign bit cleared, read as this integer,
/// order as the magnitudes do: +0 < subnormals < normals < inf < NaN.
template <class T>
using MagnitudeBits = std::conditional_t<sizeof(T) == 4, std::int32_t, std::int64_t>;

/// The magnitude bits (see MagnitudeBits) of `bound`, a finite non-negative T: a value is beyond
/// it when its magnitude bits are greater (inf and NaN always are).
template <class T>
MagnitudeBits<T> magnitude_limit(T bound) {
  return std::bit_cast<MagnitudeBits<T>>(bound) & std::numeric_limits<MagnitudeBits<T>>::max();
}

/// The fused loop over n elements at p: each becomes p[i] / value (Divide) or p[i] * value, and
/// the result says whether any of them has magnitude bits above `limit` (by default T's largest
/// finite value: whether any result is inf or NaN). Blocks of 64 elements the compiler
/// vectorizes, one mask lane per element of a block.
template <class T, bool Divide>
[[gnu::always_inline]] inline bool scale_block_loop_body(T* p, std::int64_t n, T value, MagnitudeBits<T> limit) {
  using Bits = MagnitudeBits<T>;
  constexpr Bits kMagnitude = std::numeric_limits<Bits>::max();  // every bit but the sign
  constexpr std::int64_t kBlock = 64;
  Bits acc[kBlock] = {};  // lane j: all ones once a value beyond the limit was seen in lane j
  std::int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    T* q = p + i;
    for (std::int64_t j = 0; j < kBlock; ++j) {
      const T y = Divide ? q[j] / value : q[j] * value;
      q[j] = y;
      acc[j] |= (std::bit_cast<Bits>(y) & kMagnitude) > limit ? Bits{-1} : Bits{0};
    }
  }
  Bits bad = 0;
  for (; i < n; ++i) {
    const T y = Divide ? p[i] / value : p[i] * value;
    p[i] = y;
    bad |= (std::bit_cast<Bits>(y) & kMagnitude) > limit ? Bits{-1} : Bits{0};
  }
  for (std::int64_t j = 0; j < kBlock; ++j) bad |= acc[j];
  return bad != 0;
}

template <class T, bool Divide>
bool scale_block_loop_default(T* p, std::int64_t n, T value,
                              MagnitudeBits<T> limit = magnitude_limit(std::numeric_limits<T>::max())) {
  return scale_block_loop_body<T, Divide>(p, n, value, limit);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(_MSC_VER)
// The same loop compiled for AVX2 (8 float32 lanes instead of baseline x86-64's 4), taken when
// the CPU has it, as ATen's own kernels dispatch: a program built for baseline x86-64 still gets
// AVX2 here (one built with -mavx2 has it in both variants).
template <class T, bool Divide>
[[gnu::target("avx2")]] bool scale_block_loop_avx2(
    T* p, std::int64_t n, T value, MagnitudeBits<T> limit = magnitude_limit(std::numeric_limits<T>::max())) {
  return scale_block_loop_body<T, Divide>(p, n, value, limit);
}
inline bool cpu_has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2") != 0;
  return has;
}
#endif

/// The loop over n elements at p; returns whether a result's magnitude bits exceed `limit` (by
/// default: whether a result is inf or NaN).
template <class T, bool Divide>
bool scale_block_loop(T* p, std::int64_t n, T value,
                      MagnitudeBits<T> limit = magnitude_limit(std::numeric_limits<T>::max())) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(_MSC_VER)
  if (cpu_has_avx2()) return scale_block_loop_avx2<T, Divide>(p, n, value, limit);
#endif
  return scale_block_loop_default<T, Divide>(p, n, value, limit);
}

/// True when `value` is 2^k for an integer 0 <= k <= 62 (so dividing by it equals multiplying by
/// 1 / value, a normal number in float32 and float64).
inline bool is_power_of_two_divisor(double value) {
  int exponent = 0;
  return value >= 1.0 && value <= 0x1p62 && std::frexp(value, &exponent) == 0.5;
}

/// Whether scale_and_check_span takes the one-pass CPU path for `t`.
inline bool has_fused_scan(const at::Tensor& t) {
  return on_host(t) && t.is_contiguous() && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble);
}

/// The one-pass CPU loop over elements [offset, offset + numel) of a contiguous float32/float64
/// 1-D tensor (has_fused_scan): scales them in place (divides by `value` when `divide`, else
/// multiplies; a power-of-two divisor as a multiplication by its reciprocal, which is exact) and,
/// when `check`, returns whether any result is inf, NaN or, when `bound` is finite, of magnitude
/// above `bound` (rounded to the tensor's dtype).
inline bool scale_span_fused(at::Tensor& flat, std::int64_t offset, std::int64_t numel, double value, bool divide,
                             bool check, double bound) {
  if (divide && value == 1.0) divide = false;
  if (divide && is_power_of_two_divisor(value)) {  // exact: x / 2^k and x * 2^-k round the same real number
    value = 1.0 / value;
    divide = false;
  }
  if (!divide && value == 1.0 && !check) return false;
  std::atomic<bool> bad{false};
  AT_DISPATCH_FLOATING_TYPES(flat.scalar_type(), "loom_scale_and_check", [&] {
    scalar_t* p = flat.data_ptr<scalar_t>() + offset;
    const auto v = static_cast<scalar_t>(value);
    const auto limit =
        magnitude_limit(std::isfinite(bound) ? static_cast<scalar_t>(bound) : std::numeric_limits<scalar_t>::max());
    at::parallel_for(0, numel, std::int64_t{1} << 18, [&](std::int64_t begin, std::int64_t end) {
      const bool found = divide ? scale_block_loop<scalar_t, true>(p + begin, end - begin, v, limit)
                                : scale_block_loop<scalar_t, false>(p + begin, end - begin, v, limit);
      if (check && found) bad.store(true, std::memory_order_relaxed);
    });
  });
  return bad.load();
}

/// scale_and_check on elements [offset, offset + numel) of a 1-D tensor: scales them in place
/// (divides by `value` when `divide`, else multiplies) and, when `check`, returns whether any
/// result is inf or NaN. Contiguous CPU float32/float64 memory takes one pass (scale_span_fused,
/// no view made); other tensors ATen ops (then the verdict is read to the host: use it outside
/// hot paths only). Division by a power of two is done as a multiplication by its reciprocal,
/// which is exact (x / 2^k and x * 2^-k round the same real number, subnormal results included);
/// any other divisor is divided by (not a reciprocal multiply), so a mean is exactly rounded.
inline bool scale_and_check_span(at::Tensor& flat, std::int64_t offset, std::int64_t numel, double value, bool divide,
                                 bool check) {
  if (has_fused_scan(flat))
    return scale_span_fused(flat, offset, numel, value, divide, check, std::numeric_limits<double>::infinity());
  if (divide && value == 1.0) divide = false;
  auto t = (offset == 0 && numel == flat.numel()) ? flat : flat.narrow(0, offset, numel);
  if (divide)
    t.div_(value);
  else if (value != 1.0)
    t.mul_(value);
  return check && !at::isfinite(t).all().item<bool>();
}

inline bool scale_and_check(at::Tensor& t, double value, bool divide, bool check) {
  if (t.is_contiguous()) {
    auto flat = t.view({-1});
    return scale_and_check_span(flat, 0, flat.numel(), value, divide, check);
  }
  if (value != 1.0) {
    if (divide)
      t.div_(value);
    else
      t.mul_(value);
  }
  return check && !at::isfinite(t).all().item<bool>();
}

/// 1.0 where `t` holds an inf or NaN, or a value that becomes inf when cast to `range`
/// (default: t's own dtype; float16 for a float32 slot of float16 parameters: 65520 and above),
/// else 0.0, as a one-element tensor of `dtype` on t's device (no host synchronisation: the
/// verdict stays on the device). One reduction reads t once: its largest magnitude (an infinity
/// norm, which carries a NaN through), cast to `range` and compared with range's largest finite
/// value; the cast is monotonic, so the largest magnitude leaves the range exactly when some
/// element does. Then three one-element operators.
inline at::Tensor non_finite_flag(const at::Tensor& t, c10::ScalarType dtype,
                                  std::optional<c10::ScalarType> range = std::nullopt) {
  if (t.numel() == 0) return at::zeros({1}, t.options().dtype(dtype));
  const c10::ScalarType r = range.value_or(t.scalar_type());
  const at::Tensor largest = at::linalg_vector_norm(t, std::numeric_limits<double>::infinity()).to(r);
  double finite_max = 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, r, "loom_finite_max",
                                  [&] { finite_max = static_cast<double>(std::numeric_limits<scalar_t>::max()); });
  return largest.le(finite_max).logical_not().reshape({1}).to(dtype);  // NaN <= x is false
}

/// The accumulation dtype of a bucket's arithmetic: float64 for float64, float32 otherwise (a
/// float16 count above 2048 or a float16 factor would round).
inline c10::ScalarType compute_dtype(c10::ScalarType t) {
  return t == at::kDouble ? at::kDouble : at::kFloat;
}

}  // namespace loom::detail
