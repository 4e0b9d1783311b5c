// loom/collate/detail/staged_samples.hpp — copies of samples whose batch is not written yet.
//
// When a batch's padded shape is known only once the batch closes (buckets padded to the batch's
// largest size), or when the samples come from a range that does not hold them (a view that
// decodes on demand), the collator copies each sample on arrival into these byte buffers (data,
// shape, target), reused from batch to batch, and BatchWriter writes the batch from here. So a
// collator never keeps a reference to a caller's tensor.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <loom/collate/detail/sample_read.hpp>
#include <loom/error.hpp>

namespace loom::detail {

/// Copies of samples in arrival order: their bytes, shapes and targets, in byte buffers reused
/// from batch to batch (no allocation once they have grown to the largest pending set). All
/// samples of one StagedSamples have one number of dimensions and one target layout.
class StagedSamples {
 public:
  /// Appends a copy of `data` (contiguous CPU tensor) and of its target.
  void push(const at::Tensor& data, const TargetValue& target) {
    if (ndim_ < 0) {
      ndim_ = data.dim();
      target_row_bytes_ = target.kind == TargetValue::Kind::integer  ? sizeof(int64_t)
                          : target.kind == TargetValue::Kind::tensor ? static_cast<std::size_t>(target.tensor.nbytes())
                                                                     : 0;
    }
    LOOM_ASSERT(data.dim() == ndim_, "one bucket holds samples of one number of dimensions");
    const auto n = static_cast<std::size_t>(data.nbytes());
    const std::size_t at = bytes_.size();
    offsets_.push_back(at);
    bytes_.resize(at + n);
    std::memcpy(bytes_.data() + at, data.data_ptr(), n);
    shapes_.insert(shapes_.end(), data.sizes().begin(), data.sizes().end());
    const std::size_t t = target_bytes_.size();
    target_bytes_.resize(t + target_row_bytes_);
    if (target_row_bytes_ > 0) {
      LOOM_ASSERT(target.kind != TargetValue::Kind::tensor ||
                      static_cast<std::size_t>(target.tensor.nbytes()) == target_row_bytes_,
                  "one bucket holds targets of one shape");
      std::memcpy(target_bytes_.data() + t, target.bytes(), target_row_bytes_);
    }
  }

  /// Number of staged samples.
  [[nodiscard]] std::size_t size() const noexcept { return offsets_.size(); }
  /// Bytes of sample i.
  [[nodiscard]] const std::byte* data(std::size_t i) const noexcept { return bytes_.data() + offsets_[i]; }
  /// Shape of sample i.
  [[nodiscard]] c10::IntArrayRef sizes(std::size_t i) const noexcept {
    return {shapes_.data() + i * static_cast<std::size_t>(ndim_), static_cast<std::size_t>(ndim_)};
  }
  /// Target bytes of sample i (an int64 for integer targets, the tensor's bytes for tensor targets).
  [[nodiscard]] const std::byte* target(std::size_t i) const noexcept {
    return target_bytes_.data() + i * target_row_bytes_;
  }

  /// Drops the first `count` samples (the ones a closed batch took); the rest move to the front.
  void erase_front(std::size_t count) {
    if (count >= size()) {
      clear();
      return;
    }
    const std::size_t cut = offsets_[count];
    bytes_.erase(bytes_.begin(), bytes_.begin() + static_cast<std::ptrdiff_t>(cut));
    offsets_.erase(offsets_.begin(), offsets_.begin() + static_cast<std::ptrdiff_t>(count));
    for (std::size_t& o : offsets_) o -= cut;
    shapes_.erase(shapes_.begin(),
                  shapes_.begin() + static_cast<std::ptrdiff_t>(count * static_cast<std::size_t>(ndim_)));
    target_bytes_.erase(target_bytes_.begin(),
                        target_bytes_.begin() + static_cast<std::ptrdiff_t>(count * target_row_bytes_));
  }

  /// Drops every sample; keeps the buffers' capacity.
  void clear() noexcept {
    bytes_.clear();
    offsets_.clear();
    shapes_.clear();
    target_bytes_.clear();
  }

 private:
  std::vector<std::byte> bytes_;         // samples' bytes, back to back
  std::vector<std::size_t> offsets_;     // where each sample starts in bytes_
  std::vector<int64_t> shapes_;          // ndim_ sizes per sample
  std::vector<std::byte> target_bytes_;  // target_row_bytes_ per sample
  int64_t ndim_ = -1;
  std::size_t target_row_bytes_ = 0;
};

}  // namespace loom::detail
