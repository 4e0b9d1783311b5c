// loom/collate/detail/sample_read.hpp — reading one sample through a SampleProjection, checked:
// its data tensor (defined, on the CPU, made contiguous) and its target as the collators store it.
//
// Every collation path (BucketCollator::push, loom::collate, the generator loader's
// DefaultCollate through loom::collate) reads samples here, so one sample gives the same errors
// wherever it is collated.
#pragma once

#include <concepts>
#include <cstdint>
#include <string>
#include <type_traits>

#include <ATen/core/Tensor.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <loom/collate/sample.hpp>
#include <loom/error.hpp>

namespace loom::detail {

/// A sample's target as the collators store it: nothing, an integer (stored as int64), or a
/// contiguous CPU tensor.
struct TargetValue {
  enum class Kind { none, integer, tensor } kind = Kind::none;
  int64_t integer = 0;
  at::Tensor tensor;

  /// The target's bytes in a batch row: the int64, the tensor's bytes, or null for none.
  [[nodiscard]] const std::byte* bytes() const noexcept {
    if (kind == Kind::integer) return reinterpret_cast<const std::byte*>(&integer);
    if (kind == Kind::tensor) return static_cast<const std::byte*>(tensor.data_ptr());
    return nullptr;
  }
};

/// "an int64 label", "no target" or "a Float tensor [2, 3]": a target's kind, dtype and shape, for messages.
inline std::string target_text(TargetValue::Kind kind, c10::IntArrayRef shape, c10::ScalarType dtype) {
  switch (kind) {
    case TargetValue::Kind::none: return "no target";
    case TargetValue::Kind::integer: return "an int64 label";
    case TargetValue::Kind::tensor:
      return fmt::format("a {} tensor [{}]", c10::toString(dtype), fmt::join(shape, ", "));
  }
  return "?";
}
inline std::string target_text(TargetValue::Kind kind, const at::Tensor& tensor) {
  return kind == TargetValue::Kind::tensor ? target_text(kind, tensor.sizes(), tensor.scalar_type())
                                           : target_text(kind, {}, c10::ScalarType::Undefined);
}

/// Converts what a projection's target() returned. Throws loom::InvalidArgument (naming
/// `who` and the sample index) for an undefined or non-CPU target tensor.
template <class T>
TargetValue to_target_value(T&& t, int64_t index, const char* who) {
  using U = std::remove_cvref_t<T>;
  TargetValue v;
  if constexpr (std::same_as<U, NoTarget>) {
    v.kind = TargetValue::Kind::none;
  } else if constexpr (std::same_as<U, at::Tensor>) {
    if (!t.defined()) throw InvalidArgument(fmt::format("{}sample {}: its target tensor is undefined", who, index));
    if (!t.is_cpu())
      throw InvalidArgument(fmt::format("{}sample {}: its target is on {}, a collator works on CPU tensors", who, index,
                                        t.device().str()));
    v.kind = TargetValue::Kind::tensor;
    v.tensor = t.is_contiguous() ? t : t.contiguous();
  } else {
    v.kind = TargetValue::Kind::integer;
    v.integer = static_cast<int64_t>(t);
  }
  return v;
}

/// One sample as a collator copies it: its data as a contiguous CPU tensor and its target.
/// data() is the sample's own tensor when the projection returns a reference to a contiguous one
/// (no copy, no reference count taken), else a contiguous copy held here; so a SampleRead must
/// not outlive the sample it was read from.
struct SampleRead {
  const at::Tensor* borrowed = nullptr;  ///< the sample's own contiguous tensor, or null
  at::Tensor owned;                      ///< otherwise: a contiguous copy (or the projection's by-value result)
  TargetValue target;

  [[nodiscard]] const at::Tensor& data() const noexcept { return borrowed != nullptr ? *borrowed : owned; }
};

/// Reads `sample` through `proj`. `who` prefixes messages ("collate: " or "").
/// Throws: loom::InvalidArgument naming the sample index when its data tensor is undefined or
///         not on the CPU, or its target tensor is.
template <class Projection, class S>
requires SampleProjection<Projection, S> SampleRead read_sample(const Projection& proj, const S& sample, int64_t index,
                                                                const char* who = "") {
  decltype(auto) raw = proj.data(sample);
  const at::Tensor& t = raw;
  if (!t.defined()) throw InvalidArgument(fmt::format("{}sample {}: its data tensor is undefined", who, index));
  if (!t.is_cpu())
    throw InvalidArgument(
        fmt::format("{}sample {}: its data is on {}, a collator works on CPU tensors", who, index, t.device().str()));
  SampleRead r;
  if constexpr (std::is_lvalue_reference_v<decltype(proj.data(sample))>) {
    if (t.is_contiguous())
      r.borrowed = &t;
    else
      r.owned = t.contiguous();
  } else {
    r.owned = t.is_contiguous() ? at::Tensor(t) : t.contiguous();
  }
  r.target = to_target_value(proj.target(sample), index, who);
  return r;
}

}  // namespace loom::detail
