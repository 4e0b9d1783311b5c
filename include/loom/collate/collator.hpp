// loom/collate/collator.hpp — BucketCollator (samples in, loom::Batch out) and collate() for a given list.
//
// A BucketCollator receives samples one at a time, sorts them into buckets (exact shape or padded,
// see options.hpp and planner.hpp) and emits a loom::Batch whenever a bucket's batch closes.
// Every sample is read when push() receives it, never later: the collator keeps no reference to
// the caller's tensors, so a source that decodes each sample into one reused output buffer (and
// hands out views of it) gets correct batches. For buckets whose padded shape is known up front
// (exact shapes, boundaries, multiples) the sample's bytes go straight into the bucket's open
// batch buffer (one copy). For buckets padded to the batch's largest size the padded shape is
// known only when the batch closes, so the bytes are first copied into the bucket's staging
// buffer (a byte buffer reused from batch to batch), then into the batch when it closes (two
// copies; on bench_collate's collate_padded, 4096 float32 sequences of L x 32 in batches of 64,
// about 1.15x the time of a single copy from the caller's tensors at close time). There is no
// per-group vector of tensors and no torch::stack. With a BufferPool (pool.hpp) the batch buffers are reused
// across batches, which removes the page faults that dominate collation cost.
//
// Example:
//   loom::BucketCollator<> c(loom::ShapeBucketOptions{.max_samples = 4});
//   for (int64_t i = 0; i < n; ++i) {
//     c.push(i, std::pair{images[i], labels[i]});        // at::Tensor 3 x H x W, int64 label
//     while (auto b = c.try_pop()) train_step(*b);
//   }
//   c.flush();                                           // partial buckets: emitted, not dropped
//   while (auto b = c.try_pop()) train_step(*b);
//
// Shape: Batch::data is N x (padded) sample shape in the samples' dtype; Batch::targets is an
//        int64 N-vector for integer targets, N x (target shape) for tensor targets, undefined for
//        NoTarget; Batch::mask (padded collators with mask = true) is bool like data, true = real.
//        Batch::indices are the dataset indices (from the projection's index(), from push(index, s),
//        or the 0-based input position), in row order; Batch::num_samples = N; Batch::weight = 1.
// Throws: loom::InvalidArgument naming the sample index and the bad value for: a data tensor that
//         is undefined or not on the CPU; samples of a different number of dimensions than the
//         first; a zero-size dimension; a dtype different from the dtype of its bucket; a tensor
//         target whose shape or dtype differs from its bucket's; a sample above max_elements on its
//         own (unless OversizePolicy::skip); flush() before any sample was pushed (empty dataset);
//         pop() with no batch ready. Bad options throw when the collator is built (options.hpp).
// Thread safety: one collator per thread; batches may outlive the collator.
// Source: the map-keyed-by-shape grouping is the usual hand-written collate function; the
//         copy-into-preallocated-storage idea is what torch's DataLoader does with pin_memory
//         buffers, minus the stack.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <iterator>
#include <optional>
#include <initializer_list>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <loom/collate/batch.hpp>
#include <loom/collate/options.hpp>
#include <loom/collate/planner.hpp>
#include <loom/collate/pool.hpp>
#include <loom/collate/sample.hpp>
#include <loom/error.hpp>

namespace loom {

namespace detail {

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
      : nd_(s.size()), s_(s.begin(), s.end()), p_(padded.begin(), padded.end()), dst_stride_(nd_), src_stride_(nd_), tail_equal_(nd_) {
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
    es_ = es;
  }

  void run(std::byte* dst, const std::byte* src, const ElementPattern& real, const ElementPattern& pad) const {
    if (nd_ == 0) {
      if (src != nullptr) std::memcpy(dst, src, es_);
      else fill_elements(dst, 1, real);
      return;
    }
    run_dim(0, dst, src, real, pad);
  }

 private:
  void run_dim(std::size_t d, std::byte* dst, const std::byte* src, const ElementPattern& real, const ElementPattern& pad) const {
    const auto sd = static_cast<std::size_t>(s_[d]);
    if (tail_equal_[d]) {
      if (src != nullptr) std::memcpy(dst, src, sd * src_stride_[d]);
      else fill_elements(dst, static_cast<int64_t>(sd * src_stride_[d] / es_), real);
    } else {
      for (std::size_t i = 0; i < sd; ++i)
        run_dim(d + 1, dst + i * dst_stride_[d], src == nullptr ? nullptr : src + i * src_stride_[d], real, pad);
    }
    fill_elements(dst + sd * dst_stride_[d], static_cast<int64_t>((static_cast<std::size_t>(p_[d]) - sd) * dst_stride_[d] / es_), pad);
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
/// shape `padded`, and its mask row.
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

/// Writes one sample (contiguous CPU tensor) into a row of shape `padded`, and its mask row.
inline void write_row(std::byte* dst, bool* mask_dst, const at::Tensor& src, c10::IntArrayRef padded, const ElementPattern& pad) {
  write_row(dst, mask_dst, static_cast<const std::byte*>(src.data_ptr()), src.sizes(), src.element_size(), padded, pad);
}

inline std::vector<int64_t> with_leading(int64_t n, c10::IntArrayRef rest) {
  std::vector<int64_t> v;
  v.reserve(rest.size() + 1);
  v.push_back(n);
  v.insert(v.end(), rest.begin(), rest.end());
  return v;
}

/// One tensor to carve from a batch buffer.
struct StoragePart {
  std::vector<int64_t> sizes;
  c10::ScalarType dtype;
  at::Tensor* out;
};

/// Where batch storage comes from: a pool, else an allocator, else at::empty. A batch's data,
/// mask and targets are carved from one buffer (one allocation or pool hit per batch), each part
/// starting at a 64-byte boundary.
struct StorageSource {
  std::shared_ptr<BufferPool> pool;
  BatchAllocator allocate;

  void get(std::initializer_list<StoragePart> parts) const { get(std::span<const StoragePart>(parts.begin(), parts.size())); }

  void get(std::span<const StoragePart> parts) const {
    int64_t total = 0;
    for (const StoragePart& p : parts) total += (part_bytes(p) + 63) / 64 * 64;
    const at::Tensor block = pool ? pool->acquire_bytes(total) : allocate_checked(allocate, {total}, c10::ScalarType::Byte);
    int64_t offset = 0;
    for (const StoragePart& p : parts) {
      const int64_t bytes = part_bytes(p);
      *p.out = block.narrow(0, offset, bytes).view(p.dtype).view(p.sizes);
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

/// A sample's target as the collator stores it.
struct TargetValue {
  enum class Kind { none, integer, tensor } kind = Kind::none;
  int64_t integer = 0;
  at::Tensor tensor;
};

template <class T>
TargetValue to_target_value(T&& t, int64_t index) {
  using U = std::remove_cvref_t<T>;
  TargetValue v;
  if constexpr (std::same_as<U, NoTarget>) {
    v.kind = TargetValue::Kind::none;
  } else if constexpr (std::same_as<U, at::Tensor>) {
    if (!t.defined()) throw InvalidArgument(fmt::format("sample {}: its target tensor is undefined", index));
    if (!t.is_cpu())
      throw InvalidArgument(fmt::format("sample {}: its target is on {}, a collator works on CPU tensors", index, t.device().str()));
    v.kind = TargetValue::Kind::tensor;
    v.tensor = t.is_contiguous() ? t : t.contiguous();
  } else {
    v.kind = TargetValue::Kind::integer;
    v.integer = static_cast<int64_t>(t);
  }
  return v;
}

inline std::string shape_str(c10::IntArrayRef s) { return fmt::format("[{}]", fmt::join(s, ", ")); }

/// Copies of samples whose batch has not closed yet, in arrival order: their bytes, shapes and
/// targets, in byte buffers reused from batch to batch (no allocation once they have grown to
/// the largest pending set). Pad-to-max buckets keep their pending samples here, so they never
/// hold a reference to the caller's tensors.
class StagedSamples {
 public:
  /// Appends a copy of `data` (contiguous CPU tensor) and its target (copied too).
  void push(const at::Tensor& data, const TargetValue& target);

  /// Number of staged samples.
  [[nodiscard]] std::size_t size() const noexcept { return offsets_.size(); }
  /// Bytes of sample i.
  [[nodiscard]] const std::byte* data(std::size_t i) const noexcept { return bytes_.data() + offsets_[i]; }
  /// Shape of sample i.
  [[nodiscard]] c10::IntArrayRef sizes(std::size_t i) const noexcept {
    return {shapes_.data() + i * static_cast<std::size_t>(ndim_), static_cast<std::size_t>(ndim_)};
  }
  /// Target bytes of sample i (an int64 for integer targets, the tensor's bytes for tensor targets).
  [[nodiscard]] const std::byte* target(std::size_t i) const noexcept { return target_bytes_.data() + i * target_row_bytes_; }

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
    shapes_.erase(shapes_.begin(), shapes_.begin() + static_cast<std::ptrdiff_t>(count * static_cast<std::size_t>(ndim_)));
    target_bytes_.erase(target_bytes_.begin(), target_bytes_.begin() + static_cast<std::ptrdiff_t>(count * target_row_bytes_));
  }

  /// Drops every sample; keeps the buffers' capacity.
  void clear() noexcept {
    bytes_.clear();
    offsets_.clear();
    shapes_.clear();
    target_bytes_.clear();
  }

 private:
  std::vector<std::byte> bytes_;          // samples' bytes, back to back
  std::vector<std::size_t> offsets_;      // where each sample starts in bytes_
  std::vector<int64_t> shapes_;           // ndim_ sizes per sample
  std::vector<std::byte> target_bytes_;   // target_row_bytes_ per sample
  int64_t ndim_ = -1;
  std::size_t target_row_bytes_ = 0;
};

inline void StagedSamples::push(const at::Tensor& data, const TargetValue& target) {
  if (ndim_ < 0) {
    ndim_ = data.dim();
    target_row_bytes_ = target.kind == TargetValue::Kind::integer  ? sizeof(int64_t)
                        : target.kind == TargetValue::Kind::tensor ? static_cast<std::size_t>(target.tensor.nbytes())
                                                                   : 0;
  }
  LOOM_ASSERT(data.dim() == ndim_, "one bucket holds samples of one number of dimensions");
  const std::size_t n = static_cast<std::size_t>(data.nbytes());
  const std::size_t at = bytes_.size();
  offsets_.push_back(at);
  bytes_.resize(at + n);
  std::memcpy(bytes_.data() + at, data.data_ptr(), n);
  shapes_.insert(shapes_.end(), data.sizes().begin(), data.sizes().end());
  const std::size_t t = target_bytes_.size();
  target_bytes_.resize(t + target_row_bytes_);
  if (target.kind == TargetValue::Kind::integer) {
    std::memcpy(target_bytes_.data() + t, &target.integer, sizeof(int64_t));
  } else if (target.kind == TargetValue::Kind::tensor && target_row_bytes_ > 0) {
    LOOM_ASSERT(static_cast<std::size_t>(target.tensor.nbytes()) == target_row_bytes_, "one bucket holds targets of one shape");
    std::memcpy(target_bytes_.data() + t, target.tensor.data_ptr(), target_row_bytes_);
  }
}

}  // namespace detail

/// Groups samples into shape buckets and emits loom::Batch objects. See the file comment.
///
/// Example: see the file comment.
/// Shape: see the file comment (Batch::data N x padded sample shape, targets, mask, indices).
/// Throws: see the file comment.
/// Source: see the file comment.
template <class Projection = DefaultProjection>
class BucketCollator {
 public:
  /// Exact-shape buckets.
  explicit BucketCollator(const ShapeBucketOptions& o, Projection proj = {})
      : planner_(o), proj_(std::move(proj)), storage_{o.pool, o.allocate} {}
  /// Padded buckets.
  explicit BucketCollator(const PaddedBucketOptions& o, Projection proj = {})
      : planner_(o), proj_(std::move(proj)), storage_{o.pool, o.allocate}, padded_(true), mask_(o.mask), pad_value_(o.pad_value) {}

  // Move-only: a copy would share the open batch buffers and write into them twice.
  BucketCollator(const BucketCollator&) = delete;
  BucketCollator& operator=(const BucketCollator&) = delete;
  BucketCollator(BucketCollator&&) = default;
  BucketCollator& operator=(BucketCollator&&) = default;

  /// Adds a sample; its dataset index is `proj.index(s)` when the projection has one, else the
  /// number of samples pushed before it.
  template <class S>
  void push(const S& sample) {
    static_assert(SampleProjection<Projection, S>,
                  "BucketCollator: the projection cannot read this sample type; give a projection with data(s) and "
                  "target(s) (see loom/collate/sample.hpp)");
    int64_t index = position_;
    if constexpr (SampleProjectionWithIndex<Projection, S>) index = static_cast<int64_t>(proj_.index(sample));
    push(index, sample);
  }

  /// Adds a sample with an explicit dataset index.
  template <class S>
  void push(int64_t index, const S& sample) {
    static_assert(SampleProjection<Projection, S>,
                  "BucketCollator: the projection cannot read this sample type; give a projection with data(s) and "
                  "target(s) (see loom/collate/sample.hpp)");
    ++position_;
    const at::Tensor& raw = proj_.data(sample);
    if (!raw.defined()) throw InvalidArgument(fmt::format("sample {}: its data tensor is undefined", index));
    if (!raw.is_cpu())
      throw InvalidArgument(fmt::format("sample {}: its data is on {}, a collator works on CPU tensors", index, raw.device().str()));
    auto id = planner_.bucket_of(index, raw.sizes());
    if (!id) return;  // oversize, skipped and counted
    if (*id >= stores_.size()) stores_.resize(*id + 1);
    Store& st = stores_[*id];
    detail::TargetValue target = detail::to_target_value(proj_.target(sample), index);
    check_types(st, *id, index, raw, target);

    const BucketPlanner::Bucket& bucket = planner_.buckets()[*id];
    if (bucket.fixed) {
      const BucketPlanner::Placement p = planner_.place(*id, index, raw.sizes(), emitter());
      if (p.slot == 0) open_fixed(st, bucket);
      at::Tensor made_contiguous;
      const at::Tensor& src = raw.is_contiguous() ? raw : (made_contiguous = raw.contiguous());
      detail::write_row(st.data_ptr + static_cast<std::size_t>(p.slot) * st.row_bytes,
                        st.mask_ptr == nullptr ? nullptr : st.mask_ptr + static_cast<std::size_t>(p.slot) * st.row_numel, src,
                        bucket.key, st.pad);
      write_target(st, p.slot, target);
      planner_.commit(p, emitter());
    } else {
      const BucketPlanner::Placement p = planner_.place(*id, index, raw.sizes(), emitter());
      // Copied now: the caller may overwrite its tensors as soon as push() returns.
      at::Tensor made_contiguous;
      st.staged.push(raw.is_contiguous() ? raw : (made_contiguous = raw.contiguous()), target);
      planner_.commit(p, emitter());
    }
  }

  /// Emits every partial bucket (or drops and counts them with drop_incomplete).
  /// Throws loom::InvalidArgument when no sample was ever pushed (an empty dataset).
  void flush() {
    if (planner_.stats().samples_in == 0)
      throw InvalidArgument("collator: no samples were pushed before flush (the dataset is empty)");
    planner_.flush(emitter());
    for (Store& st : stores_) release_open(st);  // dropped partial batches free their buffers
  }

  /// True when a batch is ready.
  [[nodiscard]] bool ready() const noexcept { return !ready_.empty(); }
  /// Number of batches ready.
  [[nodiscard]] std::size_t ready_count() const noexcept { return ready_.size(); }

  /// Takes the oldest ready batch. Throws loom::InvalidArgument when none is ready.
  [[nodiscard]] Batch pop() {
    if (ready_.empty()) throw InvalidArgument("collator: pop() with no batch ready (check ready() or use try_pop())");
    Batch b = std::move(ready_.front());
    ready_.pop_front();
    return b;
  }

  /// Takes the oldest ready batch, or nullopt.
  [[nodiscard]] std::optional<Batch> try_pop() {
    if (ready_.empty()) return std::nullopt;
    return pop();
  }

  /// Counts so far: samples in/out, batches, dropped and skipped samples, real/padded elements.
  [[nodiscard]] const CollateStats& stats() const noexcept { return planner_.stats(); }
  /// The planner (bucket keys and pending samples), for inspection.
  [[nodiscard]] const BucketPlanner& planner() const noexcept { return planner_; }

 private:
  struct Store {
    bool typed = false;
    c10::ScalarType dtype = c10::ScalarType::Undefined;
    int64_t first_index = 0;
    detail::TargetValue::Kind target_kind = detail::TargetValue::Kind::none;
    c10::ScalarType target_dtype = c10::ScalarType::Undefined;
    std::vector<int64_t> target_shape;
    detail::ElementPattern pad;
    // fixed buckets: the open batch buffer (capacity rows)
    at::Tensor data, mask, targets;
    std::byte* data_ptr = nullptr;
    bool* mask_ptr = nullptr;
    std::byte* target_ptr = nullptr;
    std::size_t row_bytes = 0, row_numel = 0, target_row_bytes = 0;
    // kAny buckets: copies of the samples waiting for their batch to close
    detail::StagedSamples staged;
  };

  void check_types(Store& st, std::size_t id, int64_t index, const at::Tensor& data, const detail::TargetValue& t) {
    const auto& key = planner_.buckets()[id].key;
    if (!st.typed) {
      st.typed = true;
      st.dtype = data.scalar_type();
      st.first_index = index;
      st.target_kind = t.kind;
      if (t.kind == detail::TargetValue::Kind::tensor) {
        st.target_dtype = t.tensor.scalar_type();
        st.target_shape.assign(t.tensor.sizes().begin(), t.tensor.sizes().end());
      }
      if (padded_) st.pad = detail::ElementPattern(pad_value_, st.dtype);
      return;
    }
    if (data.scalar_type() != st.dtype)
      throw InvalidArgument(fmt::format("sample {} with shape {} has dtype {}, but its bucket {} holds dtype {} (from sample {})",
                                        index, detail::shape_str(data.sizes()), c10::toString(data.scalar_type()),
                                        detail::shape_str(key), c10::toString(st.dtype), st.first_index));
    if (t.kind != st.target_kind)
      throw InvalidArgument(fmt::format("sample {}: its target kind differs from sample {} in the same bucket", index, st.first_index));
    if (t.kind == detail::TargetValue::Kind::tensor &&
        (t.tensor.scalar_type() != st.target_dtype || t.tensor.sizes() != c10::IntArrayRef(st.target_shape)))
      throw InvalidArgument(fmt::format("sample {}: target of shape {} and dtype {}, but its bucket's targets are {} {} (from sample {})",
                                        index, detail::shape_str(t.tensor.sizes()), c10::toString(t.tensor.scalar_type()),
                                        detail::shape_str(st.target_shape), c10::toString(st.target_dtype), st.first_index));
  }

  void open_fixed(Store& st, const BucketPlanner::Bucket& b) {
    open_batch(st, b.capacity, b.key);
    st.row_numel = static_cast<std::size_t>(b.fixed_numel);
    st.row_bytes = st.row_numel * c10::elementSize(st.dtype);
  }

  // Carves data (rows x padded), mask (padded collators with mask) and targets from one buffer.
  void open_batch(Store& st, int64_t rows, c10::IntArrayRef padded) {
    std::vector<int64_t> sizes = detail::with_leading(rows, padded);
    const bool with_mask = padded_ && mask_;
    if (st.target_kind == detail::TargetValue::Kind::none) {
      if (with_mask) storage_.get({{sizes, st.dtype, &st.data}, {sizes, c10::ScalarType::Bool, &st.mask}});
      else storage_.get({{sizes, st.dtype, &st.data}});
    } else {
      const bool integer = st.target_kind == detail::TargetValue::Kind::integer;
      std::vector<int64_t> tsizes = integer ? std::vector<int64_t>{rows} : detail::with_leading(rows, st.target_shape);
      const c10::ScalarType tdtype = integer ? c10::ScalarType::Long : st.target_dtype;
      if (with_mask)
        storage_.get({{sizes, st.dtype, &st.data}, {sizes, c10::ScalarType::Bool, &st.mask}, {tsizes, tdtype, &st.targets}});
      else
        storage_.get({{sizes, st.dtype, &st.data}, {tsizes, tdtype, &st.targets}});
      std::size_t tnumel = 1;
      for (int64_t d : st.target_shape) tnumel *= static_cast<std::size_t>(d);
      st.target_row_bytes = integer ? sizeof(int64_t) : tnumel * c10::elementSize(st.target_dtype);
    }
    st.data_ptr = static_cast<std::byte*>(st.data.data_ptr());
    st.mask_ptr = st.mask.defined() ? static_cast<bool*>(st.mask.data_ptr()) : nullptr;
    st.target_ptr = st.targets.defined() ? static_cast<std::byte*>(st.targets.data_ptr()) : nullptr;
  }

  static void write_target(Store& st, int64_t slot, const detail::TargetValue& t) {
    std::byte* dst = st.target_ptr + static_cast<std::size_t>(slot) * st.target_row_bytes;
    if (t.kind == detail::TargetValue::Kind::integer) std::memcpy(dst, &t.integer, sizeof(int64_t));
    else if (t.kind == detail::TargetValue::Kind::tensor && st.target_row_bytes > 0) std::memcpy(dst, t.tensor.data_ptr(), st.target_row_bytes);
  }

  static void reset_buffers(Store& st) {
    st.data = at::Tensor();
    st.mask = at::Tensor();
    st.targets = at::Tensor();
    st.data_ptr = nullptr;
    st.mask_ptr = nullptr;
    st.target_ptr = nullptr;
  }

  static void release_open(Store& st) {
    reset_buffers(st);
    st.staged.clear();
  }

  auto emitter() {
    return [this](const BucketPlanner::Bucket& b, int64_t count, c10::IntArrayRef padded) { on_emit(b, count, padded); };
  }

  void on_emit(const BucketPlanner::Bucket& b, int64_t count, c10::IntArrayRef padded) {
    Store& st = stores_[b.id];
    Batch batch;
    batch.indices.assign(b.indices.begin(), b.indices.begin() + count);
    batch.num_samples = count;
    batch.weight = 1.0;
    if (b.fixed) {
      LOOM_ASSERT(count == b.size(), "fixed buckets are emitted whole");
      const bool whole = count == b.capacity;
      batch.data = whole ? std::move(st.data) : st.data.narrow(0, 0, count);
      if (st.mask.defined()) batch.mask = whole ? std::move(st.mask) : st.mask.narrow(0, 0, count);
      if (st.targets.defined()) batch.targets = whole ? std::move(st.targets) : st.targets.narrow(0, 0, count);
      reset_buffers(st);
    } else {
      open_batch(st, count, padded);
      int64_t row_numel = 1;
      for (int64_t s : padded) row_numel *= s;
      const std::size_t es = c10::elementSize(st.dtype);
      const std::size_t row_bytes = static_cast<std::size_t>(row_numel) * es;
      for (int64_t i = 0; i < count; ++i) {
        const auto ui = static_cast<std::size_t>(i);
        detail::write_row(st.data_ptr + ui * row_bytes, st.mask_ptr == nullptr ? nullptr : st.mask_ptr + ui * static_cast<std::size_t>(row_numel),
                          st.staged.data(ui), st.staged.sizes(ui), es, padded, st.pad);
        if (st.target_ptr != nullptr && st.target_row_bytes > 0)
          std::memcpy(st.target_ptr + ui * st.target_row_bytes, st.staged.target(ui), st.target_row_bytes);
      }
      batch.data = std::move(st.data);
      batch.mask = std::move(st.mask);
      batch.targets = std::move(st.targets);
      reset_buffers(st);
      st.staged.erase_front(static_cast<std::size_t>(count));
    }
    ready_.push_back(std::move(batch));
  }

  BucketPlanner planner_;
  Projection proj_;
  detail::StorageSource storage_;
  bool padded_ = false;
  bool mask_ = false;
  double pad_value_ = 0.0;
  int64_t position_ = 0;
  std::vector<Store> stores_;
  std::deque<Batch> ready_;
};

/// Options of collate(): one batch from a given list of samples.
///
/// Example: `loom::CollateOptions{.padded_shape = {3, 64, 64}, .mask = true}`.
/// Shape: padded_shape excludes the batch dimension; empty = the per-dimension maximum of the samples.
struct CollateOptions {
  std::vector<int64_t> padded_shape{};  ///< pad every sample to this shape (empty: the samples' max)
  double pad_value = 0.0;               ///< value written into padding
  bool mask = false;                    ///< emit Batch::mask (bool, true = real)
  std::shared_ptr<BufferPool> pool{};   ///< reuse storage from this pool
  BatchAllocator allocate{};            ///< allocates storage when there is no pool (empty: at::empty)
};

/// Collates a given list of samples into one Batch (e.g. the samples of a PlannedBatch that a
/// bucket batch sampler chose), copying each sample once into the batch storage.
///
/// Every sample is read when the walk over `samples` reaches it. A forward range whose elements
/// are lvalues (a std::vector of samples) holds its samples for the whole call, so they are read
/// in place; any other range (a view that decodes on demand, perhaps into one reused buffer) has
/// each sample copied into a staging buffer as it is reached, and from there into the batch. A
/// view whose elements are references to one object it overwrites is not a range that holds its
/// samples: make it yield samples by value (as collate_sampled does for its fetch).
///
/// Example: `auto b = loom::collate(samples, planned.indices, {.padded_shape = planned.padded_shape});`
/// Shape: data N x padded shape (samples' dtype), targets as for BucketCollator, mask when asked.
/// Throws: loom::InvalidArgument for an empty list, indices of a different length, samples that
///         differ in number of dimensions, dtype or target shape, a zero-size dimension, or a sample
///         larger than padded_shape; each message names the sample index.
/// Source: like a DataLoader collate_fn, but copying into one preallocated buffer instead of stacking.
template <class Range, class Projection = DefaultProjection>
Batch collate(const Range& samples, std::span<const int64_t> indices, const CollateOptions& o = {}, const Projection& proj = {}) {
  using Iterator = decltype(std::begin(samples));
  using S = std::remove_cvref_t<decltype(*std::begin(samples))>;
  static_assert(SampleProjection<Projection, S>,
                "loom::collate: the projection cannot read this sample type (see loom/collate/sample.hpp)");
  // The samples outlive the walk (and stay unchanged) only when the range stores them.
  constexpr bool kStable = std::forward_iterator<Iterator> && std::is_lvalue_reference_v<std::iter_reference_t<Iterator>> &&
                           std::is_reference_v<decltype(proj.data(*std::declval<Iterator>()))>;
  const auto n = static_cast<int64_t>(std::distance(std::begin(samples), std::end(samples)));
  if (n == 0) throw InvalidArgument("collate: the list of samples is empty");
  if (static_cast<int64_t>(indices.size()) != n)
    throw InvalidArgument(fmt::format("collate: {} samples but {} indices", n, indices.size()));
  std::vector<at::Tensor> held;       // kStable: the samples' own (contiguous) tensors
  std::vector<detail::TargetValue> held_targets;
  detail::StagedSamples staged;       // otherwise: copies made on arrival
  if constexpr (kStable) {
    held.reserve(static_cast<std::size_t>(n));
    held_targets.reserve(static_cast<std::size_t>(n));
  }
  std::vector<int64_t> padded = o.padded_shape;
  const bool given = !padded.empty();
  std::vector<int64_t> first_shape;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  detail::TargetValue::Kind target_kind = detail::TargetValue::Kind::none;
  std::vector<int64_t> target_shape;
  c10::ScalarType target_dtype = c10::ScalarType::Undefined;
  std::size_t i = 0;
  for (const auto& s : samples) {
    const int64_t index = indices[i];
    const at::Tensor& t = proj.data(s);
    if (!t.defined() || !t.device().is_cpu())
      throw InvalidArgument(fmt::format("collate: sample {}: data must be a defined CPU tensor", index));
    for (int64_t d : t.sizes())
      if (d <= 0) throw InvalidArgument(fmt::format("collate: sample {} has shape {}: a zero-size dimension cannot be batched", index, detail::shape_str(t.sizes())));
    detail::TargetValue target = detail::to_target_value(proj.target(s), index);
    if (i == 0) {
      first_shape.assign(t.sizes().begin(), t.sizes().end());
      dtype = t.scalar_type();
      target_kind = target.kind;
      if (target.kind == detail::TargetValue::Kind::tensor) {
        target_shape.assign(target.tensor.sizes().begin(), target.tensor.sizes().end());
        target_dtype = target.tensor.scalar_type();
      }
    } else {
      if (t.dim() != static_cast<int64_t>(first_shape.size()))
        throw InvalidArgument(fmt::format("collate: sample {} has shape {}, but sample {} has {}", index,
                                          detail::shape_str(t.sizes()), indices[0], detail::shape_str(first_shape)));
      if (t.scalar_type() != dtype)
        throw InvalidArgument(fmt::format("collate: sample {} has dtype {}, but sample {} has {}", index,
                                          c10::toString(t.scalar_type()), indices[0], c10::toString(dtype)));
      if (target.kind != target_kind ||
          (target.kind == detail::TargetValue::Kind::tensor &&
           (target.tensor.sizes() != c10::IntArrayRef(target_shape) || target.tensor.scalar_type() != target_dtype)))
        throw InvalidArgument(fmt::format("collate: sample {}: its target differs in kind, shape or dtype from sample {}'s", index, indices[0]));
    }
    if (!given) {
      if (padded.empty()) padded.assign(t.sizes().begin(), t.sizes().end());
      for (std::size_t d = 0; d < padded.size(); ++d) padded[d] = std::max(padded[d], t.sizes()[d]);
    } else {
      bool fits = static_cast<std::size_t>(t.dim()) == padded.size();
      for (std::size_t d = 0; fits && d < padded.size(); ++d) fits = t.sizes()[d] <= padded[d];
      if (!fits)
        throw InvalidArgument(fmt::format("collate: sample {} with shape {} does not fit padded_shape {}", index,
                                          detail::shape_str(t.sizes()), detail::shape_str(padded)));
    }
    if constexpr (kStable) {
      held.push_back(t.is_contiguous() ? t : t.contiguous());
      held_targets.push_back(std::move(target));
    } else {
      at::Tensor made_contiguous;
      staged.push(t.is_contiguous() ? t : (made_contiguous = t.contiguous()), target);
    }
    ++i;
  }
  const detail::StorageSource storage{o.pool, o.allocate};
  const std::vector<int64_t> sizes = detail::with_leading(n, padded);
  Batch batch;
  const bool integer = target_kind == detail::TargetValue::Kind::integer;
  std::vector<detail::StoragePart> parts{{sizes, dtype, &batch.data}};
  if (o.mask) parts.push_back({sizes, c10::ScalarType::Bool, &batch.mask});
  if (target_kind != detail::TargetValue::Kind::none)
    parts.push_back({integer ? std::vector<int64_t>{n} : detail::with_leading(n, target_shape),
                     integer ? c10::ScalarType::Long : target_dtype, &batch.targets});
  storage.get(parts);
  int64_t row_numel = 1;
  for (int64_t s : padded) row_numel *= s;
  const std::size_t es = c10::elementSize(dtype);
  const std::size_t row_bytes = static_cast<std::size_t>(row_numel) * es;
  const detail::ElementPattern pad(o.pad_value, dtype);
  auto* dst = static_cast<std::byte*>(batch.data.data_ptr());
  bool* mdst = o.mask ? static_cast<bool*>(batch.mask.data_ptr()) : nullptr;
  std::size_t tb = 0;
  if (target_kind != detail::TargetValue::Kind::none) tb = static_cast<std::size_t>(batch.targets.nbytes()) / static_cast<std::size_t>(n);
  auto* tdst = target_kind == detail::TargetValue::Kind::none ? nullptr : static_cast<std::byte*>(batch.targets.data_ptr());
  for (std::size_t r = 0; r < static_cast<std::size_t>(n); ++r) {
    bool* mrow = mdst == nullptr ? nullptr : mdst + r * static_cast<std::size_t>(row_numel);
    if constexpr (kStable) {
      detail::write_row(dst + r * row_bytes, mrow, held[r], padded, pad);
      const detail::TargetValue& t = held_targets[r];
      if (t.kind == detail::TargetValue::Kind::integer) std::memcpy(tdst + r * tb, &t.integer, tb);
      else if (t.kind == detail::TargetValue::Kind::tensor && tb > 0) std::memcpy(tdst + r * tb, t.tensor.data_ptr(), tb);
    } else {
      detail::write_row(dst + r * row_bytes, mrow, staged.data(r), staged.sizes(r), es, padded, pad);
      if (tdst != nullptr && tb > 0) std::memcpy(tdst + r * tb, staged.target(r), tb);
    }
  }
  batch.indices.assign(indices.begin(), indices.end());
  batch.num_samples = n;
  return batch;
}

}  // namespace loom
