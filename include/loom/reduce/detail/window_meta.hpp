// loom/reduce/detail/window_meta.hpp — the window meta: what each rank tells the others about a
// synchronising window, one int64 row per rank summed over the ranks, and how that row rides in the
// first bucket's all-reduce.
//
// Row:   [samples, final, leaving, loss divisor d, d^2, votes, fingerprint f, f^2, has f, replica
//        fingerprint g, g^2, has g] (f: the flight recorder's 20-bit fingerprint of the collectives
//        this rank issued since its previous window; has f: 1 when the rank's communicator keeps a
//        flight recorder; g: the caller's 20-bit fingerprint of what must be equal on every replica,
//        Reducer::compare_replicas, e.g. the Trainer's optimizer options).
// Limbs: in floating mode each field is cut into limbs of b = p - ceil(log2 world size) bits (p the
//        first bucket's significand precision) after the bucket's used-flags, each limb's sum exact
//        in any order (MetaLimbs); where b < 1 or in deterministic mode the row is an int64
//        all-reduce of its own. The decode checks every summed limb on the host; a first bucket on
//        a GPU is decoded with device ops, unchecked (no host read). Why: docs/reduce.md#buckets-views-overlap.
// Units: samples; loss divisors are the BackwardPlan's (dimensionless integers).
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <loom/error.hpp>
#include <loom/reduce/concepts.hpp>
#include <loom/reduce/detail/host_path.hpp>

namespace loom::detail {

/// The window meta: this rank's row, and the positions of its fields. Summed over ranks, `final`
/// and `leaving` count the ranks that set them. A rank with a loss divisor d >= 1 votes: the sums
/// of d and d^2 over the n voters tell every rank alike whether they all used the same d
/// ((sum d)^2 == n * sum d^2 only then), and that d (sum d / n) is every rank's, voters or not.
/// The fingerprints f_r (in [0, 2^20)) work alike: each rank finds sum (f_r - f_mine)^2 =
/// sum f^2 - 2 f_mine sum f + n f_mine^2, zero only when every rank's f is its own.
struct WindowMeta {
  enum Field : std::int64_t {
    samples,
    final_ranks,
    leaving_ranks,
    divisor_sum,
    divisor_squares,
    voters,
    fingerprint_sum,
    fingerprint_squares,
    fingerprinted,
    replica_sum,
    replica_squares,
    replica_voters,
    kLength
  };
  using Row = std::array<std::int64_t, kLength>;

  /// This rank's row for `plan`, flight-recorder fingerprint `f` (std::nullopt without a flight
  /// recorder) and replica fingerprint `replica` (std::nullopt: this rank does not compare).
  static Row encode(const BackwardPlan& plan, std::optional<std::int64_t> f,
                    std::optional<std::int64_t> replica = std::nullopt) {
    const std::int64_t d = plan.loss_divisor, g = f.value_or(0), h = replica.value_or(0);
    return {plan.window_samples,
            plan.final ? 1 : 0,
            plan.leaving ? 1 : 0,
            d,
            d * d,
            d > 0 ? 1 : 0,
            g,
            g * g,
            f ? 1 : 0,
            h,
            h * h,
            replica ? 1 : 0};
  }

  /// Writes `row` into `meta` (int64 [kLength], on any device).
  static void write(at::Tensor& meta, const Row& row) {
    if (on_host(meta))
      std::copy(row.begin(), row.end(), meta.data_ptr<std::int64_t>());
    else
      meta.copy_(at::tensor(std::vector<std::int64_t>(row.begin(), row.end()), at::kLong), /*non_blocking=*/false);
  }

  /// The one-element slice of `meta` holding `field`.
  static at::Tensor slice(const at::Tensor& meta, Field field) { return meta.narrow(0, field, 1); }
};

/// The window meta as limbs of `bits` bits in a floating-point bucket, after its used-flags.
struct MetaLimbs {
  /// The most bits each field of a row can hold (a row's values are never negative): samples any
  /// int64, the flags and votes 1, d <= 2^20 (kMaxLossDivisor) and d^2, f < 2^20 and f^2, g < 2^20 and g^2.
  static constexpr std::array<int, WindowMeta::kLength> kWidths = {63, 1, 1, 21, 41, 1, 20, 40, 1, 20, 40, 1};

  /// Significand precision of `dtype` in bits, the implicit leading one included (24 for float32,
  /// 53 float64, 11 float16, 8 bfloat16); 0 for any other dtype.
  static int precision(c10::ScalarType dtype) {
    switch (dtype) {
      case at::kFloat: return 24;
      case at::kDouble: return 53;
      case at::kHalf: return 11;
      case at::kBFloat16: return 8;
      default: return 0;
    }
  }

  /// Bits per limb for `dtype` on `world_size` ranks: p - ceil(log2 world_size), so that a limb's sum
  /// over the ranks, below world_size * 2^b <= 2^p, is exact; 0 when none fits (the row is then sent
  /// on its own).
  static int bits(c10::ScalarType dtype, int world_size) {
    int log2_ceil = 0;
    while ((std::int64_t{1} << log2_ceil) < world_size) ++log2_ceil;
    return std::max(0, precision(dtype) - log2_ceil);
  }

  /// Limbs of field `field` at `bits` bits each.
  static std::int64_t limbs_of(std::size_t field, int bits) { return (kWidths[field] + bits - 1) / bits; }

  /// Limbs of a whole row at `bits` bits each (bits >= 1).
  static std::int64_t count(int bits) {
    std::int64_t n = 0;
    for (std::size_t f = 0; f < kWidths.size(); ++f) n += limbs_of(f, bits);
    return n;
  }

  /// Writes `row`'s limbs (least significant first, field by field) to out[0, count(bits)) as
  /// values of T. Throws: loom::Error if a field is negative or wider than its kWidths entry (an
  /// internal invariant: BackwardPlan checks and the recorder's fingerprint keep every field in range).
  template <class T>
  static void encode(const WindowMeta::Row& row, int bits, T* out) {
    const std::uint64_t mask = (std::uint64_t{1} << bits) - 1;
    for (std::size_t f = 0; f < kWidths.size(); ++f) {
      LOOM_ASSERT(row[f] >= 0 && (kWidths[f] >= 63 || row[f] < (std::int64_t{1} << kWidths[f])),
                  fmt::format("window meta field {} = {} outside its {} bits", f, row[f], kWidths[f]));
      auto v = static_cast<std::uint64_t>(row[f]);
      for (std::int64_t i = 0; i < limbs_of(f, bits); ++i) {
        *out++ = static_cast<T>(static_cast<double>(v & mask));
        v >>= bits;
      }
    }
  }

  /// The summed row from the limbs in[0, count(bits)) summed over `world_size` ranks (host memory,
  /// any arithmetic T). Each field is sum_i limb_i * 2^(bits i), taken modulo 2^64 like the int64
  /// all-reduce it stands for. Throws: loom::CommError when a summed limb is not a whole number in
  /// [0, world_size * 2^bits) — the ranks' first buckets were not the same collective (a rank that
  /// issued another all-reduce in its place), so the sums are not the ranks' rows.
  template <class T>
  static WindowMeta::Row decode(const T* in, int bits, int world_size) {
    const double limit = std::ldexp(static_cast<double>(world_size), bits);
    WindowMeta::Row row{};
    for (std::size_t f = 0; f < kWidths.size(); ++f) {
      std::uint64_t v = 0;
      for (std::int64_t i = 0; i < limbs_of(f, bits); ++i) {
        const auto limb = static_cast<double>(*in++);
        if (!(limb >= 0 && limb < limit && limb == std::floor(limb)))
          throw CommError(fmt::format(
              "Reducer: the window meta in the first bucket came back as {} (a sum over {} ranks of whole numbers "
              "below 2^{}): the ranks did not all-reduce the same first bucket (a rank issued another collective in "
              "its place?)",
              limb, world_size, bits));
        v += static_cast<std::uint64_t>(limb) << (bits * i);
      }
      row[f] = static_cast<std::int64_t>(v);
    }
    return row;
  }

  /// The tables of the device decode for `bits`: per limb its field (int64 [count]) and its weight
  /// 2^(bits i) (int64 [count]), on `device`.
  static std::pair<at::Tensor, at::Tensor> tables(int bits, c10::Device device) {
    std::vector<std::int64_t> field, weight;
    for (std::size_t f = 0; f < kWidths.size(); ++f)
      for (std::int64_t i = 0; i < limbs_of(f, bits); ++i) {
        field.push_back(static_cast<std::int64_t>(f));
        weight.push_back(std::int64_t{1} << (bits * i));
      }
    return {at::tensor(field, at::kLong).to(device), at::tensor(weight, at::kLong).to(device)};
  }

  /// decode with device ops, no host read: the summed limbs `limbs` (any floating dtype, any
  /// device) into `meta` (int64 [WindowMeta::kLength]) through `tables` (from tables(), on meta's
  /// device). Each product limb x weight is at most its field's sum, so it wraps only where the
  /// int64 sum would.
  static void decode(const at::Tensor& limbs, const std::pair<at::Tensor, at::Tensor>& tables, at::Tensor& meta) {
    meta.zero_();
    meta.index_add_(0, tables.first, limbs.to(meta.device(), at::kLong).mul(tables.second));
  }
};

}  // namespace loom::detail
