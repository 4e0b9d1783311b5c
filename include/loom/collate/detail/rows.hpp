// loom/collate/detail/rows.hpp — byte-level copies of one sample into one batch row: the
// padding pattern of a dtype, padded row copies, mask rows.
//
// Everything here works on raw bytes of contiguous rows: a sample of shape s (elements of es
// bytes) goes into a row of shape `padded` (s <= padded per dimension), padding written with the
// pad value's bytes, and optionally a bool mask row (true = real element). BatchWriter
// (batch_writer.hpp) is the only caller; collators never copy rows any other way.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <ATen/Dispatch.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/SmallVector.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

namespace loom::detail {

/// The bytes of `value` converted to `dtype` (at most 16 bytes). Throws for unsupported dtypes.
struct ElementPattern {
  alignas(16) std::byte bytes[16]{};
  std::size_t size = 0;
  bool all_zero = true;

  ElementPattern() = default;
  ElementPattern(double value, c10::ScalarType dtype) {
    AT_DISPATCH_ALL_TYPES_AND3(at::kHalf, at::kBFloat16, at::kBool, dtype, "loom_pad_value", [&] {
      const auto v = static_cast<scalar_t>(value);
      static_assert(sizeof(v) <= sizeof(bytes));
      std::memcpy(bytes, &v, sizeof(v));
      size = sizeof(v);
    });
    for (std::size_t i = 0; i < size; ++i) all_zero = all_zero && bytes[i] == std::byte{0};
  }
};

/// Fills `count` elements at `dst` with `pattern`.
inline void fill_elements(std::byte* dst, int64_t count, const ElementPattern& pattern) {
  if (count <= 0) return;
  const auto n = static_cast<std::size_t>(count);
  if (pattern.all_zero) {
    std::memset(dst, 0, n * pattern.size);
  } else if (pattern.size == 1) {
    std::memset(dst, static_cast<int>(pattern.bytes[0]), n);
  } else {
    std::memcpy(dst, pattern.bytes, pattern.size);
    std::size_t done = 1;  // double the filled prefix: log2(n) memcpy calls
    while (done < n) {
      const std::size_t step = std::min(done, n - done);
      std::memcpy(dst + done * pattern.size, dst, step * pattern.size);
      done += step;
    }
  }
}

/// Copies a contiguous sample of shape `s` into a contiguous row of shape `padded` (s <= padded
/// per dimension), writing `pad` into the rest; with src == nullptr writes `real` instead of data
/// (used to build masks). Element size es bytes.
class PaddedRowCopy {
 public:
  PaddedRowCopy(c10::IntArrayRef s, c10::IntArrayRef padded, std::size_t es)
      : nd_(s.size()),
        s_(s.begin(), s.end()),
        p_(padded.begin(), padded.end()),
        dst_stride_(nd_),
        src_stride_(nd_),
        tail_equal_(nd_),
        es_(es) {
    std::size_t ds = es, ss = es;
    bool eq = true;
    for (std::size_t d = nd_; d-- > 0;) {
      dst_stride_[d] = ds;
      src_stride_[d] = ss;
      tail_equal_[d] = eq;
      ds *= static_cast<std::size_t>(p_[d]);
      ss *= static_cast<std::size_t>(s_[d]);
      eq = eq && s_[d] == p_[d];
    }
  }

  void run(std::byte* dst, const std::byte* src, const ElementPattern& real, const ElementPattern& pad) const {
    if (nd_ == 0) {
      if (src != nullptr)
        std::memcpy(dst, src, es_);
      else
        fill_elements(dst, 1, real);
      return;
    }
    run_dim(0, dst, src, real, pad);
  }

 private:
  void run_dim(std::size_t d, std::byte* dst, const std::byte* src, const ElementPattern& real,
               const ElementPattern& pad) const {
    const auto sd = static_cast<std::size_t>(s_[d]);
    if (tail_equal_[d]) {
      if (src != nullptr)
        std::memcpy(dst, src, sd * src_stride_[d]);
      else
        fill_elements(dst, static_cast<int64_t>(sd * src_stride_[d] / es_), real);
    } else {
      for (std::size_t i = 0; i < sd; ++i)
        run_dim(d + 1, dst + i * dst_stride_[d], src == nullptr ? nullptr : src + i * src_stride_[d], real, pad);
    }
    fill_elements(dst + sd * dst_stride_[d],
                  static_cast<int64_t>((static_cast<std::size_t>(p_[d]) - sd) * dst_stride_[d] / es_), pad);
  }

  std::size_t nd_;
  std::vector<int64_t> s_, p_;
  std::vector<std::size_t> dst_stride_, src_stride_;  // bytes per step along each dim
  std::vector<bool> tail_equal_;                      // s == padded on every dim after d
  std::size_t es_ = 1;
};

inline const ElementPattern& mask_true() {
  static const ElementPattern p(1.0, c10::ScalarType::Bool);
  return p;
}
inline const ElementPattern& mask_false() {
  static const ElementPattern p(0.0, c10::ScalarType::Bool);
  return p;
}

/// Writes one contiguous sample of shape `sizes` (elements of `es` bytes at `src`) into a row of
/// shape `padded`, and its mask row when `mask_dst` is not null.
inline void write_row(std::byte* dst, bool* mask_dst, const std::byte* src, c10::IntArrayRef sizes, std::size_t es,
                      c10::IntArrayRef padded, const ElementPattern& pad) {
  if (sizes == padded) {
    std::size_t numel = 1;
    for (int64_t s : sizes) numel *= static_cast<std::size_t>(s);
    std::memcpy(dst, src, numel * es);
    if (mask_dst != nullptr) std::memset(mask_dst, 1, numel);
    return;
  }
  PaddedRowCopy copy(sizes, padded, es);
  copy.run(dst, src, pad, pad);
  if (mask_dst != nullptr) {
    PaddedRowCopy mcopy(sizes, padded, 1);
    mcopy.run(reinterpret_cast<std::byte*>(mask_dst), nullptr, mask_true(), mask_false());
  }
}

/// A shape held inline up to 6 dimensions (no heap allocation for a batch of samples of up to 5).
using ShapeVector = c10::SmallVector<int64_t, 6>;

/// {n, rest...}: a batch shape from its row count and a row shape.
inline ShapeVector with_leading(int64_t n, c10::IntArrayRef rest) {
  ShapeVector v;
  v.reserve(rest.size() + 1);
  v.push_back(n);
  v.append(rest.begin(), rest.end());
  return v;
}

/// "[a, b, c]": a shape for messages.
inline std::string shape_str(c10::IntArrayRef s) {
  return fmt::format("[{}]", fmt::join(s, ", "));
}

}  // namespace loom::detail
