// loom/reduce/detail/bucket.hpp — a reducer's memory: flat buckets whose slots are the
// parameters' gradients, per-gradient bookkeeping, and the allocation of buckets for an order.
//
// Shape: a bucket's `flat` is [gradients | one used-flag per gradient | the window meta's limbs
//        (window_meta.hpp; the first bucket only, floating arithmetic) | the range flag (floating
//        arithmetic, CPU float32/float64 buckets that are neither compressed nor float32-accumulated)],
//        one dtype and device; the integer arithmetic's buckets are its own (grid_reduce.hpp). Each slot is a tensor sharing `flat`'s storage with its parameter's shape.
//        A float32-accumulated bucket (`main`) holds float16/bfloat16 parameters' gradients in float32.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/core/grad_mode.h>

#include <loom/error.hpp>
#include <loom/reduce/buckets.hpp>
#include <loom/reduce/detail/host_path.hpp>
#include <loom/reduce/detail/scale.hpp>
#include <loom/reduce/detail/window_meta.hpp>
#include <loom/reduce/options.hpp>
#include <loom/reduce/parameters.hpp>

namespace loom::detail {

/// A tensor that shares `flat`'s storage from element `offset`, shaped like `like` (its strides when
/// `like` is dense, else row-major). Built with set_() rather than a view op, so autograd does not
/// treat it as a view (LibTorch's Optimizer::zero_grad calls detach_(), which views refuse).
inline at::Tensor alias_into(const at::Tensor& flat, std::int64_t offset, const at::Tensor& like) {
  std::vector<std::int64_t> strides;
  if (like.is_non_overlapping_and_dense()) {
    strides = like.strides().vec();
  } else {
    strides.assign(static_cast<std::size_t>(like.dim()), 1);
    for (std::int64_t d = like.dim() - 2; d >= 0; --d)
      strides[static_cast<std::size_t>(d)] =
          strides[static_cast<std::size_t>(d) + 1] * std::max<std::int64_t>(like.size(d + 1), 1);
  }
  auto t = at::empty({0}, flat.options());
  t.set_(flat.storage(), flat.storage_offset() + offset, like.sizes(), strides);
  return t;
}

/// Whether `g` is exactly the slot `view` (same memory, shape, strides, dtype).
inline bool aliases(const at::Tensor& g, const at::Tensor& view) {
  return g.defined() && g.data_ptr() == view.data_ptr() && g.scalar_type() == view.scalar_type() &&
         g.sizes() == view.sizes() && g.strides() == view.strides();
}

/// A parameter index's slot when the parameter has none (frozen: never reduced).
inline constexpr std::size_t kNoSlot = static_cast<std::size_t>(-1);

/// One trainable parameter's gradient in a bucket, and what the current window knows of it.
struct GradSlot {
  std::size_t param = 0;        // index into ParameterList::params
  std::size_t bucket = 0;       // bucket holding the gradient
  std::int64_t offset = 0;      // first element in the bucket
  std::size_t flag = 0;         // position among the bucket's used-flags
  at::Tensor view;              // the gradient's memory in the bucket
  at::Tensor saved;             // pre-window gradient of a locally unused parameter (restored if unused everywhere)
  std::int64_t ready_pos = -1;  // order of its first gradient while recording (bucket rebuild)
  bool used = false;            // a gradient arrived during the current window
  bool fired = false;           // a gradient arrived during the current sync backward
  bool was_undefined = false;   // its .grad() was undefined when the window began
};

/// One flat bucket: the unit of an all-reduce.
struct GradBucket {
  at::Tensor flat;    // [head: the gradients | tail: one used-flag per gradient | meta: the window meta's limbs |
                      //  range_flag]
  bool main = false;  // float32 slots for 16-bit parameters: .grad() is moved into the slot, never a view of it
  c10::ScalarType param_dtype = c10::ScalarType::Float;  // the dtype of the bucket's parameters
  at::Tensor head;
  at::Tensor tail;
  at::Tensor wire;  // compressed copy of flat (wire_dtype), or undefined
  at::Tensor wire_head;
  at::Tensor wire_tail;
  int meta_bits = 0;           // bits per limb of the window meta carried after the used-flags (0: not carried)
  at::Tensor meta;             // the limbs: MetaLimbs::count(meta_bits) elements of flat, or of wire when compressed
  at::Tensor wire_div;         // float32 [1]: the world size, the pre-division of a compressed bucket
  at::Tensor range_flag;       // the last element of flat, or undefined: when the bucket was divided before its
                               // all-reduce (WindowAverage::pre_divide), 1 on a rank that sent a value that is inf,
                               // NaN or large enough that the sum might overflow, else 0; summed with the bucket
  bool late_gradient = false;  // a gradient reached a slot after the bucket left (refused): scan it after all
  at::Tensor bad;              // float32 [1] on the bucket's device: inf/NaN in the reduced bucket (device path)
  bool bad_host = false;       // the same verdict, computed on the host (CPU path)
  at::Tensor flags_host;       // pinned staging for the used-flags (and the meta's limbs) of a bucket on a GPU
  std::vector<std::size_t> slots;
  std::size_t pending = 0;
  bool ready = false;
  bool launched = false;
};

/// Writes bucket `b`'s tail: one used-flag per gradient (1: a gradient arrived in this window), then,
/// when the bucket carries the window meta (b.meta_bits > 0), the limbs of `row` (this rank's row,
/// required then). A bucket on a GPU stages them in pinned memory and copies them without waiting.
inline void write_used_flags(GradBucket& b, const std::vector<GradSlot>& slots, const WindowMeta::Row* row) {
  const auto n = b.slots.size();
  const at::Tensor& carrier = b.wire.defined() ? b.wire : b.flat;
  const std::int64_t limbs = b.meta_bits > 0 ? MetaLimbs::count(b.meta_bits) : 0;
  LOOM_ASSERT(limbs == 0 || row != nullptr, "a bucket carrying the window meta needs this rank's row");
  at::Tensor tail = carrier.narrow(0, b.head.numel(), static_cast<std::int64_t>(n) + limbs);
  at::Tensor dst = on_host(tail) ? tail : b.flags_host;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dst.scalar_type(), "loom_write_flags", [&] {
    scalar_t* p = dst.data_ptr<scalar_t>();
    for (std::size_t j = 0; j < n; ++j) p[j] = slots[b.slots[j]].used ? scalar_t(1) : scalar_t(0);
    if (limbs > 0) MetaLimbs::encode(*row, b.meta_bits, p + n);
  });
  if (!on_host(tail)) tail.copy_(b.flags_host, /*non_blocking=*/true);
}

/// Whether `p`'s gradient is summed in a float32 slot (ReducerOptions::float32_accumulation).
inline bool accumulates_in_float32(const ReducerOptions& options, const at::Tensor& p) {
  return options.float32_accumulation && (p.scalar_type() == at::kHalf || p.scalar_type() == at::kBFloat16);
}

/// The slots' bucket assignment (lists of slot indices) for launch order `order`: assign_buckets
/// over each slot's size, element size (4 in a float32 slot) and (dtype, device) kind.
inline std::vector<std::vector<std::size_t>> assign_slots(const ParameterList& list, const std::vector<GradSlot>& slots,
                                                          const std::vector<std::size_t>& order,
                                                          const ReducerOptions& options) {
  std::vector<GradSpec> specs;
  std::vector<std::pair<c10::ScalarType, c10::Device>> kinds;
  for (const auto& slot : slots) {
    const auto& p = list.params[slot.param];
    const std::pair<c10::ScalarType, c10::Device> key{p.scalar_type(), p.device()};
    auto it = std::find(kinds.begin(), kinds.end(), key);
    if (it == kinds.end()) it = kinds.insert(kinds.end(), key);
    specs.push_back(
        {.numel = p.numel(),
         .element_size = static_cast<std::int64_t>(accumulates_in_float32(options, p) ? 4 : p.element_size()),
         .kind = static_cast<std::int64_t>(it - kinds.begin())});
  }
  return assign_buckets(
      specs, order,
      {.first_bucket_cap_bytes = options.first_bucket_cap_bytes, .bucket_cap_bytes = options.bucket_cap_bytes});
}

/// The wire dtype of a compressed float32 bucket: ReducerOptions::wire_dtype, except that the wire
/// never narrows a gradient below its parameter's own range: a bucket that accumulates bfloat16
/// parameters in float32 (GradBucket::main) goes on a bfloat16 wire when float16 was asked for
/// (float16's largest value, 65504, would overflow gradients their bfloat16 parameters hold).
/// Example: wire_dtype_of(at::kHalf, bucket of bfloat16 parameters) == at::kBFloat16.
inline c10::ScalarType wire_dtype_of(c10::ScalarType requested, const GradBucket& b) {
  if (requested == at::kHalf && b.main && b.param_dtype == at::kBFloat16) return at::kBFloat16;
  return requested;
}

/// Allocates buckets for `assignment` (slot indices), points each slot of `slots` at its memory and
/// moves every defined gradient of a non-float32 slot into it (a float32 slot takes its gradient at
/// the window's start). `world_size`: the pre-division of a compressed bucket. `floating`: the
/// floating arithmetic's extras: the first bucket carries the window meta's limbs when its wire
/// dtype has room for them on `world_size` ranks (MetaLimbs::bits >= 1; GradBucket::meta_bits says
/// whether it does), CPU float32/float64 buckets a range flag.
inline std::vector<GradBucket> allocate_buckets(const std::vector<std::vector<std::size_t>>& assignment,
                                                std::vector<GradSlot>& slots, const ParameterList& list,
                                                const ReducerOptions& options, int world_size, bool floating) {
  auto param = [&](std::size_t k) -> const at::Tensor& { return list.params[slots[k].param]; };
  at::NoGradGuard no_grad;
  std::vector<GradBucket> fresh(assignment.size());
  for (std::size_t bi = 0; bi < assignment.size(); ++bi) {
    auto& b = fresh[bi];
    b.slots = assignment[bi];
    const auto& first = param(b.slots.front());
    std::int64_t total = 0;
    for (std::size_t k : b.slots) total += param(k).numel();
    const auto n = static_cast<std::int64_t>(b.slots.size());
    b.main = accumulates_in_float32(options, first);
    b.param_dtype = first.scalar_type();
    const c10::ScalarType dtype = b.main ? at::kFloat : first.scalar_type();
    const auto opts = at::TensorOptions().dtype(dtype).device(first.device());
    const bool compressed = options.wire_dtype && dtype == at::kFloat;
    const c10::ScalarType wire_dtype = compressed ? wire_dtype_of(*options.wire_dtype, b) : dtype;
    if (floating && bi == 0) b.meta_bits = MetaLimbs::bits(wire_dtype, world_size);
    const std::int64_t limbs = b.meta_bits > 0 ? MetaLimbs::count(b.meta_bits) : 0;
    const bool ranged =
        floating && !b.main && !compressed && on_host(first) && (dtype == at::kFloat || dtype == at::kDouble);
    b.flat = at::zeros({total + n + limbs + (ranged ? 1 : 0)}, opts);
    b.head = b.flat.narrow(0, 0, total);
    b.tail = b.flat.narrow(0, total, n);
    if (!compressed) b.meta = b.flat.narrow(0, total + n, limbs);
    if (ranged) b.range_flag = b.flat.narrow(0, total + n + limbs, 1);
    b.bad = at::zeros({1}, opts.dtype(at::kFloat));
    if (compressed) {
      b.wire = at::empty({total + n + limbs}, opts.dtype(wire_dtype));
      b.wire_head = b.wire.narrow(0, 0, total);
      b.wire_tail = b.wire.narrow(0, total, n);
      b.meta = b.wire.narrow(0, total + n, limbs);
      b.wire_div = at::full({1}, static_cast<double>(world_size), opts);
    }
    if (!on_host(first))
      b.flags_host = at::empty({n + limbs}, at::TensorOptions().dtype(wire_dtype).pinned_memory(first.is_cuda()));
    std::int64_t offset = 0;
    std::size_t flag = 0;
    for (std::size_t k : b.slots) {
      auto& s = slots[k];
      s.bucket = bi;
      s.offset = offset;
      s.flag = flag++;
      s.view = alias_into(b.flat, offset, param(k));
      auto& g = param(k).mutable_grad();
      if (g.defined() && !b.main) {  // a float32 slot takes the gradient at the window's start
        s.view.copy_(g);
        g = s.view;
      }
      offset += param(k).numel();
    }
  }
  return fresh;
}

}  // namespace loom::detail
