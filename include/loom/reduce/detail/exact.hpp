// loom/reduce/detail/exact.hpp — the CPU arithmetic of the deterministic reducer
// (ReducerOptions::deterministic): a micro-batch's gradient onto its parameter's power-of-two grid
// as int64 (q = round(g x 2^e), half to even), the int32 wire, the sum turned back once per window,
// the rule that moves each grid exponent e from one window to the next, and the counters an integer
// bucket carries. The same arithmetic with ATen operators, for buckets off the host: grid_aten.hpp.
//
// Shape: an integer bucket is int64 [gradients | GridTail]; a slot is the same element range
//        [offset, offset + numel) as in the floating bucket, whatever the parameter's strides. On
//        the CPU it travels as int32 [gradients | GridTail | wide flag] when every value fits
//        wire_limit(world size), else again as int64 (quantize_add_cpu with keep_gradient).
// Units: the grid step of a parameter is 2^-e gradient units; "grid units" are multiples of it.
// Bounds: a contribution below 2^42 grid units (kGridLimit), at most 2^20 per element and window,
//         so no int64 sum overflows; the turned-back sum is float64(Q) x (2^-e x multiplier /
//         divisor), then the cast (a Q above 2^53 also rounds to float64). Error bound, the wire:
//         docs/elastic.md#bit-identical-training-on-any-world-size-reduceroptionsdeterministic.
// Source: fixed-point (integer) accumulation as in reproducible summation (Demmel and Nguyen,
//         "Fast reproducible floating-point summation", 2013), here with one exponent per tensor
//         chosen from the previous window instead of per-element bins.
#pragma once

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#if defined(__SSE2__) && !defined(__FAST_MATH__)
#include <emmintrin.h>
#endif

namespace loom::detail {

/// A contribution's magnitude must stay below this many grid units (2^42), so that 2^20 of them
/// sum below 2^62.
inline constexpr double kGridLimit = 4398046511104.0;
/// Contributions at or above this many grid units (2^40, within 4x of the limit) are counted as
/// near the limit: the next window's grid is made coarser before they overflow it.
inline constexpr double kGridNear = 1099511627776.0;
/// The most contributions (micro-batches, over all ranks) one window may sum: 2^20.
inline constexpr std::int64_t kGridMaxContributions = std::int64_t{1} << 20;
/// The bit length the rule aims the reduced sum's largest magnitude at: 16 bits (65536x) below the
/// limit, so a gradient may grow 65536-fold from one window to the next before it overflows, and 5
/// bits below int32's range: on W ranks a rank's partial sum may reach 2^31 / W on the int32 wire,
/// so a bucket stays on it while its sums grow less than 32-fold when the ranks hold alike shares
/// (each about 1 / W of the sum), and less than 32 / W-fold when one rank holds all of it. Grid
/// step: 2^-26 of the previous window's largest reduced magnitude (float32's spacing there is 2^-23).
inline constexpr int kGridTargetBits = 26;
/// Every parameter's first exponent: grid step 2^-32 (2.3e-10), contributions up to 2^10 = 1024
/// (on the int32 wire up to 0.5 / W: a first window of larger gradients travels as int64).
inline constexpr int kGridInitialExponent = 32;
/// After an overflow, the exponent of each parameter that overflowed drops by this much (2^16 coarser).
inline constexpr int kGridBackoff = 16;
/// The most the exponent rises from one window to the next (a grid 2^8 finer), so a window of small
/// gradients does not leave the next, larger ones above the limit.
inline constexpr int kGridMaxRise = 8;
/// A contribution near the limit lowers the next exponent by at least this much.
inline constexpr int kGridNearStep = 2;
/// A parameter that received gradients but whose reduced sum was 0 (gradients below half a grid
/// step round to 0) rises by kGridMaxRise per window up to this exponent (grid step 2^-96), so
/// gradients down to 2^-97 are trained from their second window on; smaller ones stay 0.
inline constexpr int kGridZeroCeiling = 96;
/// The exponent stays in [kGridMinExponent, kGridMaxExponent]: 2^e and 2^-e are normal float64.
inline constexpr int kGridMinExponent = -900;
inline constexpr int kGridMaxExponent = 900;

/// The tail of an integer bucket with n slots: [used n | overflow n | near n | contributions n |
/// non-finite 1]. Each rank writes a flag as > 0 when it holds (0 otherwise) and its number of
/// contributions per slot; the all-reduce sums them, so after it a flag is > 0 when some rank set
/// it and a slot's contributions are its total over the ranks.
struct GridTail {
  static std::int64_t length(std::int64_t n) { return 4 * n + 1; }
  static std::int64_t used(std::int64_t /*n*/, std::int64_t j) { return j; }
  static std::int64_t overflow(std::int64_t n, std::int64_t j) { return n + j; }
  static std::int64_t near(std::int64_t n, std::int64_t j) { return 2 * n + j; }
  static std::int64_t contributions(std::int64_t n, std::int64_t j) { return 3 * n + j; }
  static std::int64_t non_finite(std::int64_t n) { return 4 * n; }
};

/// What putting one contribution on the grid found.
struct GridFlags {
  bool non_finite = false;  ///< an element was inf or NaN (not added)
  bool overflow = false;    ///< an element was at or above kGridLimit grid units (not added)
  bool near = false;        ///< an element was at or above kGridNear grid units
  bool wide = false;        ///< a sum written to the int32 wire was above its limit (quantize_to_wire_cpu only)
};

/// x rounded to the nearest integer, half to even, for |x| < 2^51 (here |x| < 2^42): adding and
/// subtracting 1.5 x 2^52 leaves no fraction bits, so the float64 addition itself rounds, in the
/// default rounding mode, as std::nearbyint does, without a library call per element (x86-64
/// without SSE4.1 has no inline instruction for it). Under -ffast-math, which may cancel the two
/// additions, it is std::nearbyint.
inline double round_to_integer(double x) {
#ifdef __FAST_MATH__
  return std::nearbyint(x);
#else
  constexpr double kShift = 6755399441055744.0;  // 1.5 x 2^52
  return (x + kShift) - kShift;
#endif
}

/// What a pass of quantize_loop writes besides reading the gradient g.
enum class GridWrite {
  sums,       ///< q[i] = base + round(...), g[i] = 0 (a contribution before the synchronising backward)
  wire,       ///< w[i] = int32(base + round(...)); g and q unchanged; wide when one is above the limit
  sums_keep,  ///< q[i] = base + round(...); g unchanged (the int64 resend of a bucket whose wire overflowed)
};

#if defined(__SSE2__) && !defined(__FAST_MATH__)
/// The common case of quantize_to_wire_cpu on x86-64: float32 gradients [begin, end) with no
/// earlier sums, 4 at a time (SSE2; compilers leave the scalar loop unvectorized). Writes w[i] =
/// round_to_integer(g[i] x scale) — the same float64 operations, so the same integers — and
/// returns true when every one is at most `limit` in magnitude. That also rules out inf/NaN,
/// overflow and near-limit elements (all far above any int32 limit), so false sends the caller
/// to the scalar loop for the range, which finds the exact flags (rare: a grid that is too fine).
inline bool wire_from_float_sse2(const float* g, std::int32_t* w, std::int64_t begin, std::int64_t end, double scale,
                                 double limit) {
  const __m128d s = _mm_set1_pd(scale), shift = _mm_set1_pd(6755399441055744.0), lim = _mm_set1_pd(limit);
  const __m128d sign = _mm_set1_pd(-0.0);
  __m128d outside = _mm_setzero_pd();  // lanes where !(|r| <= limit), NaN included
  std::int64_t i = begin;
  for (; i + 4 <= end; i += 4) {
    const __m128 v = _mm_loadu_ps(g + i);
    __m128d r0 = _mm_mul_pd(_mm_cvtps_pd(v), s);
    __m128d r1 = _mm_mul_pd(_mm_cvtps_pd(_mm_movehl_ps(v, v)), s);
    r0 = _mm_sub_pd(_mm_add_pd(r0, shift), shift);
    r1 = _mm_sub_pd(_mm_add_pd(r1, shift), shift);
    outside = _mm_or_pd(outside, _mm_cmpnle_pd(_mm_andnot_pd(sign, r0), lim));
    outside = _mm_or_pd(outside, _mm_cmpnle_pd(_mm_andnot_pd(sign, r1), lim));
    // Lanes outside the limit convert to 0x80000000; they are not used (the caller redoes the range).
    _mm_storeu_si128(reinterpret_cast<__m128i*>(w + i), _mm_unpacklo_epi64(_mm_cvtpd_epi32(r0), _mm_cvtpd_epi32(r1)));
  }
  bool fits = _mm_movemask_pd(outside) == 0;
  for (; i < end; ++i) {
    const double r = round_to_integer(static_cast<double>(g[i]) * scale);
    const bool ok = std::abs(r) <= limit;
    w[i] = ok ? static_cast<std::int32_t>(r) : 0;
    fits = fits && ok;
  }
  return fits;
}
#endif

/// The loop of the CPU quantizers: each element's contribution round(g[i] x 2^exponent) is added to
/// base = q[i] (kFirst: base = 0, q not read) and written as kWrite says.
template <class T, bool kFirst, GridWrite kWrite>
GridFlags quantize_loop(std::conditional_t<kWrite == GridWrite::sums, T, const T>* g,
                        std::conditional_t<kWrite == GridWrite::wire, const std::int64_t, std::int64_t>* q,
                        std::int32_t* w, std::int64_t n, int exponent, std::int64_t limit) {
  const double scale = std::ldexp(1.0, exponent);
  std::atomic<bool> non_finite{false}, overflow{false}, near{false}, wide{false};
  at::parallel_for(0, n, std::int64_t{1} << 16, [&](std::int64_t begin, std::int64_t end) {
    bool bad = false, over = false, close = false, fits = true;
    auto range = [&](std::int64_t from, std::int64_t to) {
      for (std::int64_t i = from; i < to; ++i) {
        const T v = g[i];
        if constexpr (kWrite == GridWrite::sums) g[i] = T(0);
        std::int64_t add = 0;
        if (!std::isfinite(v)) {
          bad = true;
        } else {
          const double x = static_cast<double>(v) * scale;
          const double a = std::abs(x);
          if (!(a < kGridLimit)) {
            over = true;
          } else {
            if (a >= kGridNear) close = true;
            add = static_cast<std::int64_t>(round_to_integer(x));
          }
        }
        const std::int64_t sum = kFirst ? add : q[i] + add;
        if constexpr (kWrite == GridWrite::wire) {
          fits &= (sum <= limit) & (sum >= -limit);
          w[i] = static_cast<std::int32_t>(sum);  // modulo 2^32 (C++20); used only when it fits
        } else {
          q[i] = sum;
        }
      }
    };
#if defined(__SSE2__) && !defined(__FAST_MATH__)
    if constexpr (kWrite == GridWrite::wire && kFirst && std::is_same_v<T, float>) {
      constexpr std::int64_t kPiece = 4096;  // a piece with a value outside the limit is redone by `range`
      for (std::int64_t from = begin; from < end; from += kPiece) {
        const std::int64_t to = std::min(end, from + kPiece);
        if (!wire_from_float_sse2(g, w, from, to, scale, static_cast<double>(limit))) range(from, to);
      }
    } else {
      range(begin, end);
    }
#else
    range(begin, end);
#endif
    if (bad) non_finite.store(true, std::memory_order_relaxed);
    if (over) overflow.store(true, std::memory_order_relaxed);
    if (close) near.store(true, std::memory_order_relaxed);
    if (!fits) wide.store(true, std::memory_order_relaxed);
  });
  return {non_finite.load(), overflow.load(), near.load(), wide.load()};
}

/// Adds round(g[i] x 2^exponent) to q[i] for i in [0, n) and sets g[i] to 0 (CPU, float/double);
/// `first`: sets q[i] to it instead (q's old values are ignored); `keep_gradient`: leaves g as it is.
/// `g x 2^exponent` is exact in float64 (a power-of-two scaling of a float32 or float64 value, away
/// from float64's subnormals); rounding is to nearest, half to even (round_to_integer). Elements that
/// are not finite or not below the limit are left out (add 0) and flagged.
template <class T>
GridFlags quantize_add_cpu(T* g, std::int64_t* q, std::int64_t n, int exponent, bool first = false,
                           bool keep_gradient = false) {
  if (keep_gradient)
    return first ? quantize_loop<T, true, GridWrite::sums_keep>(g, q, nullptr, n, exponent, 0)
                 : quantize_loop<T, false, GridWrite::sums_keep>(g, q, nullptr, n, exponent, 0);
  return first ? quantize_loop<T, true, GridWrite::sums>(g, q, nullptr, n, exponent, 0)
               : quantize_loop<T, false, GridWrite::sums>(g, q, nullptr, n, exponent, 0);
}

/// Writes base[i] + round(g[i] x 2^exponent) to the int32 wire w[i] for i in [0, n) (CPU,
/// float/double), base the int64 sums `q` of earlier contributions or 0 when `q` is null; g and q
/// are not changed. Elements are rounded, left out and flagged as by quantize_add_cpu;
/// GridFlags::wide is set when some sum is above `limit` in magnitude (then w holds wrapped values
/// that must not be used: the bucket goes as int64, quantize_add_cpu(..., keep_gradient = true)).
template <class T>
GridFlags quantize_to_wire_cpu(const T* g, const std::int64_t* q, std::int32_t* w, std::int64_t n, int exponent,
                               std::int64_t limit) {
  return q == nullptr ? quantize_loop<T, true, GridWrite::wire>(g, nullptr, w, n, exponent, limit)
                      : quantize_loop<T, false, GridWrite::wire>(g, q, w, n, exponent, limit);
}

/// The largest magnitude a rank's value may have on the int32 wire of `world_size` ranks:
/// floor((2^31 - 1) / world_size), so a sum over the ranks stays within int32.
inline std::int64_t wire_limit(int world_size) {
  return std::int64_t{std::numeric_limits<std::int32_t>::max()} / std::max(world_size, 1);
}

/// Copies q[0, n) to the int32 wire w[0, n) (CPU). Returns true when every |q[i]| <= limit; false
/// when one is larger (then w holds wrapped values that must not be used: the bucket goes as int64).
inline bool narrow_to_wire_cpu(const std::int64_t* q, std::int32_t* w, std::int64_t n, std::int64_t limit) {
  std::atomic<bool> fits{true};
  at::parallel_for(0, n, std::int64_t{1} << 16, [&](std::int64_t begin, std::int64_t end) {
    bool ok = true;
    for (std::int64_t i = begin; i < end; ++i) {
      const std::int64_t v = q[i];
      ok &= (v <= limit) & (v >= -limit);
      w[i] = static_cast<std::int32_t>(v);  // modulo 2^32 (C++20); used only when ok
    }
    if (!ok) fits.store(false, std::memory_order_relaxed);
  });
  return fits.load();
}

/// The factor that turns a reduced integer back: 2^-exponent x multiplier / divisor, in float64
/// (the same operations on every rank).
inline double grid_factor(int exponent, double multiplier, double divisor) {
  return std::ldexp(1.0, -exponent) * multiplier / divisor;
}

/// Turns a reduced integer slot back: out[i] = T(float64(q[i]) x grid_factor(...)), one float64
/// multiplication per element; q is int64 or the int32 wire (the same integers give the same bits).
/// Returns the largest |q[i]| (the next exponent's input); `non_finite` is set when a result is not
/// finite in T.
template <class T, class I>
std::int64_t dequantize_cpu(const I* q, T* out, std::int64_t n, int exponent, double multiplier, double divisor,
                            bool& non_finite) {
  const double factor = grid_factor(exponent, multiplier, divisor);
#if defined(__SSE2__) && !defined(__FAST_MATH__)
  if constexpr (std::is_same_v<I, std::int32_t> && std::is_same_v<T, float>) {
    // 4 at a time with the maxima and flags in registers (the blocked loop below keeps its lane
    // arrays in memory): the same float64 multiplication and cast, so the same bits.
    const __m128d f = _mm_set1_pd(factor), sign_d = _mm_set1_pd(-0.0);
    const __m128 sign_s = _mm_set1_ps(-0.0f), max_s = _mm_set1_ps(std::numeric_limits<float>::max());
    __m128d big = _mm_setzero_pd();
    __m128 bad4 = _mm_setzero_ps();
    std::int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i));
      const __m128d d0 = _mm_cvtepi32_pd(v), d1 = _mm_cvtepi32_pd(_mm_shuffle_epi32(v, 0xee));
      big = _mm_max_pd(big, _mm_max_pd(_mm_andnot_pd(sign_d, d0), _mm_andnot_pd(sign_d, d1)));
      const __m128 r = _mm_movelh_ps(_mm_cvtpd_ps(_mm_mul_pd(d0, f)), _mm_cvtpd_ps(_mm_mul_pd(d1, f)));
      _mm_storeu_ps(out + i, r);
      bad4 = _mm_or_ps(bad4, _mm_cmpnle_ps(_mm_andnot_ps(sign_s, r), max_s));  // inf or NaN
    }
    double lanes[2];
    _mm_storeu_pd(lanes, big);
    double largest = std::max(lanes[0], lanes[1]);
    bool bad = _mm_movemask_ps(bad4) != 0;
    for (; i < n; ++i) {
      const double d = static_cast<double>(q[i]);
      largest = std::max(largest, std::abs(d));
      const float r = static_cast<float>(d * factor);
      out[i] = r;
      bad = bad || !(std::abs(r) <= std::numeric_limits<float>::max());
    }
    if (bad) non_finite = true;
    return static_cast<std::int64_t>(largest);
  }
#endif
  if constexpr (std::is_same_v<I, std::int32_t>) {
    // Blocks of 8 with per-lane maxima and flags, a form compilers vectorize at -O2; int32 values are
    // exact in float64, so the largest magnitude is taken there.
    constexpr int kBlock = 8;
    double big[kBlock] = {};
    int bad_lane[kBlock] = {};
    std::int64_t i = 0;
    for (; i + kBlock <= n; i += kBlock) {
      for (int k = 0; k < kBlock; ++k) {
        const double d = static_cast<double>(q[i + k]);
        big[k] = std::max(big[k], std::abs(d));
        const T r = static_cast<T>(d * factor);
        out[i + k] = r;
        bad_lane[k] |= !(std::abs(r) <= std::numeric_limits<T>::max());  // inf or NaN
      }
    }
    double largest = 0;
    int bad = 0;
    for (int k = 0; k < kBlock; ++k) {
      largest = std::max(largest, big[k]);
      bad |= bad_lane[k];
    }
    for (; i < n; ++i) {
      const double d = static_cast<double>(q[i]);
      largest = std::max(largest, std::abs(d));
      const T r = static_cast<T>(d * factor);
      out[i] = r;
      bad |= !(std::abs(r) <= std::numeric_limits<T>::max());
    }
    if (bad != 0) non_finite = true;
    return static_cast<std::int64_t>(largest);
  }
  std::uint64_t largest = 0;
  bool bad = false;
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t v = q[i];
    const std::uint64_t m = v < 0 ? std::uint64_t{0} - static_cast<std::uint64_t>(v) : static_cast<std::uint64_t>(v);
    largest = std::max(largest, m);
    const T r = static_cast<T>(static_cast<double>(v) * factor);
    out[i] = r;
    if (!(std::abs(r) <= std::numeric_limits<T>::max())) bad = true;  // inf or NaN, as the int32 loop tests it
  }
  if (bad) non_finite = true;
  return static_cast<std::int64_t>(std::min<std::uint64_t>(largest, std::uint64_t{1} << 62));
}

/// The next window's exponent of a parameter whose reduced sum had largest magnitude `largest`
/// (grid units) under exponent `e`: aimed so that magnitude lands at kGridTargetBits bits, rising
/// by at most kGridMaxRise, and kGridNearStep lower when a contribution came near the limit
/// (cancelling contributions can be much larger than their sum). A parameter whose sum was 0 keeps
/// its exponent when no rank gave it a gradient (`used` false), and rises by kGridMaxRise up to
/// kGridZeroCeiling when some did (its gradients may have rounded to 0 on this grid). Every rank
/// computes it from the same reduced integers and flags.
inline int next_grid_exponent(int e, std::int64_t largest, bool near, bool used) {
  int next = e;
  if (largest > 0)
    next = e + std::min(kGridMaxRise,
                        kGridTargetBits - static_cast<int>(std::bit_width(static_cast<std::uint64_t>(largest))));
  else if (used && e < kGridZeroCeiling)
    next = std::min(e + kGridMaxRise, kGridZeroCeiling);
  if (near) next = std::min(next, e - kGridNearStep);
  return std::clamp(next, kGridMinExponent, kGridMaxExponent);
}

/// The exponent after a window in which a contribution overflowed the grid of exponent `e`.
inline int backed_off_grid_exponent(int e) {
  return std::max(e - kGridBackoff, kGridMinExponent);
}

}  // namespace loom::detail
