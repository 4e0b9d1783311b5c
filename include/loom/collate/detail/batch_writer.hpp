// loom/collate/detail/batch_writer.hpp — the one collate kernel: a batch's storage carved from
// one buffer, and rows written into it.
//
// Every path that makes a loom::Batch from samples goes through BatchWriter: BucketCollator (rows
// written on arrival into an open batch of a fixed bucket, or from the staged copies when a
// pad-to-max batch closes), loom::collate (a given list, read in place or from staged copies),
// and so the generator loader's DefaultCollate and collate_sampled, which call loom::collate.
//
// Storage: data (rows x padded shape, the samples' dtype), the mask (bool, like data) and the
// targets (int64 rows, or rows x target shape) are carved from one uint8 buffer, each part at a
// 64-byte boundary: one allocation (or one BufferPool hit) per batch, never one per sample.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>

#include <loom/collate/batch.hpp>
#include <loom/collate/detail/rows.hpp>
#include <loom/collate/detail/sample_read.hpp>
#include <loom/collate/pool.hpp>
#include <loom/error.hpp>

namespace loom::detail {

/// One tensor to carve from a batch buffer (`sizes` views the caller's array, alive for the call).
struct StoragePart {
  c10::IntArrayRef sizes;
  c10::ScalarType dtype;
  at::Tensor* out;
};

/// Where batch storage comes from: a pool, else an allocator, else at::empty. The parts are
/// carved from one buffer, each starting at a 64-byte boundary.
struct StorageSource {
  std::shared_ptr<BufferPool> pool;
  BatchAllocator allocate;

  void get(std::initializer_list<StoragePart> parts) const {
    get(std::span<const StoragePart>(parts.begin(), parts.size()));
  }

  void get(std::span<const StoragePart> parts) const {
    int64_t total = 0;
    for (const StoragePart& p : parts) total += (part_bytes(p) + 63) / 64 * 64;
    const ByteBlock block =
        pool ? pool->acquire_block(total) : byte_block(allocate_checked(allocate, {total}, c10::ScalarType::Byte));
    int64_t offset = 0;
    for (const StoragePart& p : parts) {
      const int64_t bytes = part_bytes(p);
      *p.out = carve(block, offset, p.dtype, p.sizes);
      offset += (bytes + 63) / 64 * 64;
    }
  }

 private:
  static int64_t part_bytes(const StoragePart& p) {
    int64_t n = 1;
    for (int64_t s : p.sizes) n *= s;
    return n * static_cast<int64_t>(c10::elementSize(p.dtype));
  }
};

/// What every row of one batch shares.
struct BatchLayout {
  std::vector<int64_t> padded;                                ///< row shape every sample is padded to
  c10::ScalarType dtype = c10::ScalarType::Undefined;         ///< the samples' dtype
  bool mask = false;                                          ///< write Batch::mask
  ElementPattern pad;                                         ///< padding value in dtype
  TargetValue::Kind target_kind = TargetValue::Kind::none;    ///< the samples' target kind
  std::vector<int64_t> target_shape;                          ///< tensor targets: their shape
  c10::ScalarType target_dtype = c10::ScalarType::Undefined;  ///< tensor targets: their dtype
};

/// Allocates one batch of `rows` rows for a layout and writes rows into it: data (padded with the
/// layout's pad value), mask rows, target rows. Rows may be written in any order; rows not
/// written are left as the storage had them (callers write every row they hand out).
class BatchWriter {
 public:
  BatchWriter(const BatchLayout& layout, int64_t rows, const StorageSource& storage)
      : padded_(layout.padded.begin(), layout.padded.end()), pad_(layout.pad), es_(c10::elementSize(layout.dtype)) {
    const ShapeVector sizes = with_leading(rows, padded_);
    const bool integer = layout.target_kind == TargetValue::Kind::integer;
    const bool targets = layout.target_kind != TargetValue::Kind::none;
    ShapeVector tsizes;
    if (targets) tsizes = integer ? ShapeVector{rows} : with_leading(rows, layout.target_shape);
    const c10::ScalarType tdtype = integer ? c10::ScalarType::Long : layout.target_dtype;
    if (layout.mask && targets)
      storage.get({{sizes, layout.dtype, &data_}, {sizes, c10::ScalarType::Bool, &mask_}, {tsizes, tdtype, &targets_}});
    else if (layout.mask)
      storage.get({{sizes, layout.dtype, &data_}, {sizes, c10::ScalarType::Bool, &mask_}});
    else if (targets)
      storage.get({{sizes, layout.dtype, &data_}, {tsizes, tdtype, &targets_}});
    else
      storage.get({{sizes, layout.dtype, &data_}});
    row_numel_ = 1;
    for (int64_t s : padded_) row_numel_ *= static_cast<std::size_t>(s);
    row_bytes_ = row_numel_ * es_;
    if (targets) {
      std::size_t tnumel = 1;
      for (int64_t d : layout.target_shape) tnumel *= static_cast<std::size_t>(d);
      target_row_bytes_ = integer ? sizeof(int64_t) : tnumel * c10::elementSize(layout.target_dtype);
    }
    data_ptr_ = static_cast<std::byte*>(data_.data_ptr());
    mask_ptr_ = mask_.defined() ? static_cast<bool*>(mask_.data_ptr()) : nullptr;
    target_ptr_ = targets_.defined() ? static_cast<std::byte*>(targets_.data_ptr()) : nullptr;
  }

  BatchWriter(const BatchWriter&) = delete;
  BatchWriter& operator=(const BatchWriter&) = delete;
  BatchWriter(BatchWriter&&) noexcept = default;  // the row pointers point into the tensors' storage, which moves along
  BatchWriter& operator=(BatchWriter&&) noexcept = default;

  /// Writes row r from raw bytes: a contiguous sample of shape `sizes` (each size <= the padded
  /// size) in the layout's dtype, and its target bytes (the layout's target row size; ignored
  /// when the layout has no targets).
  void write(int64_t r, const std::byte* src, c10::IntArrayRef sizes, const std::byte* target) {
    const auto ur = static_cast<std::size_t>(r);
    write_row(data_ptr_ + ur * row_bytes_, mask_ptr_ == nullptr ? nullptr : mask_ptr_ + ur * row_numel_, src, sizes,
              es_, padded_, pad_);
    if (target_ptr_ != nullptr && target_row_bytes_ > 0)
      std::memcpy(target_ptr_ + ur * target_row_bytes_, target, target_row_bytes_);
  }

  /// Writes row r from a sample read by read_sample (its contiguous data and its target).
  void write(int64_t r, const at::Tensor& data, const TargetValue& target) {
    write(r, static_cast<const std::byte*>(data.data_ptr()), data.sizes(), target.bytes());
  }

  /// The batch of the first `count` rows (all rows: the tensors themselves; fewer: their leading
  /// `count` rows), with `indices`, num_samples = count and weight 1. The writer is spent.
  [[nodiscard]] Batch finish(int64_t count, std::vector<int64_t> indices) && {
    Batch b;
    const bool whole = count == data_.size(0);
    b.data = whole ? std::move(data_) : data_.narrow(0, 0, count);
    if (mask_.defined()) b.mask = whole ? std::move(mask_) : mask_.narrow(0, 0, count);
    if (targets_.defined()) b.targets = whole ? std::move(targets_) : targets_.narrow(0, 0, count);
    b.indices = std::move(indices);
    b.num_samples = count;
    b.weight = 1.0;
    return b;
  }

 private:
  ShapeVector padded_;
  ElementPattern pad_;
  std::size_t es_;
  at::Tensor data_, mask_, targets_;
  std::byte* data_ptr_ = nullptr;
  bool* mask_ptr_ = nullptr;
  std::byte* target_ptr_ = nullptr;
  std::size_t row_numel_ = 1, row_bytes_ = 0, target_row_bytes_ = 0;
};

}  // namespace loom::detail
