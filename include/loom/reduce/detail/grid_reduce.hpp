// loom/reduce/detail/grid_reduce.hpp — the integer arithmetic's per-slot and per-bucket state and
// the end of its window: every integer bucket waited for (sent again as int64 when some rank's
// values did not fit the int32 wire) and turned back into the floating bucket, the verdicts and the
// next grid exponents decided from the reduced integers, which are the same on every rank.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>

#include <loom/reduce/detail/bucket.hpp>
#include <loom/reduce/detail/exact.hpp>
#include <loom/reduce/detail/grid_aten.hpp>
#include <loom/reduce/detail/host_path.hpp>
#include <loom/reduce/detail/scale.hpp>
#include <loom/reduce/detail/window_core.hpp>
#include <loom/trace/recorder.hpp>

namespace loom::detail {

/// One gradient slot's integer state (GridWindow::slots_[k] belongs to WindowCore::slots[k]).
struct GridSlot {
  int exponent = kGridInitialExponent;  // the grid step is 2^-exponent
  std::int64_t contributions = 0;       // micro-batches put on the grid this window
  bool pending = false;                 // the slot holds this micro-batch's gradient, not on the grid yet
  bool sums = false;                    // the int64 sums hold this window's earlier contributions
  bool detached = false;                // int32 wire: .grad() was taken off the slot when the bucket left
};

/// One bucket's integer memory (GridWindow::buckets_[bi] belongs to WindowCore::buckets[bi]).
/// Shape: flat int64 [gradients on the grid | GridTail]; wire int32 [gradients | GridTail | wide flag].
struct GridBuffers {
  at::Tensor flat;     // int64 [gradients | GridTail]
  at::Tensor head;     // its gradients
  at::Tensor tail;     // its GridTail
  at::Tensor staging;  // bucket on a GPU: pinned [used n | contributions n], else undefined
  at::Tensor lengths;  // bucket on a GPU: the slots' element counts (int64 [n]), the whole-bucket operators' segments
  at::Tensor wire;     // float32/float64 bucket on the CPU: the int32 wire, else undefined
};

/// Waits for each integer bucket in launch order and turns it back into the floating bucket,
/// (q x 2^-e x mean loss divisor x grad_scale) / divisor, divisor the window's sample count
/// (average = samples) or 1 (none); then decides the verdicts and the next grid exponents (into
/// `slots`) from the reduced integers. Host reads: none on the CPU; on a GPU one for the window
/// meta, one for the tails and maxima, one more for clipping.
template <class Comm>
ReducedWindow reduce_on_grid(WindowCore<Comm>& core, std::vector<GridSlot>& grid, std::vector<GridBuffers>& qs,
                             bool clip) {
  ReducedWindow out;
  WindowSummary& summary = out.summary;
  GridVerdict& verdict = out.grid;
  const at::Tensor m = on_host(core.meta) ? core.meta : core.host_read(core.meta);
  summary.counts = WindowCounts::decode(m.data_ptr<std::int64_t>());
  const WindowCounts& c = summary.counts;
  const double divisor =
      core.options.average == Average::samples ? static_cast<double>(std::max<std::int64_t>(c.samples, 1)) : 1.0;
  const double multiplier =
      (c.voters > 0 ? static_cast<double>(c.divisor_sum) / static_cast<double>(c.voters) : 1.0) * core.grad_scale;
  const std::vector<GradSlot>& slots = core.slots;
  const std::vector<GradBucket>& buckets = core.buckets;

  // Per bucket: [largest |q| per slot (n) | result not finite (1) | the reduced tail], on the host.
  std::vector<std::vector<std::int64_t>> info(buckets.size());
  std::vector<at::Tensor> device_info;
  for (std::size_t bi = 0; bi < buckets.size(); ++bi) {
    core.works[bi]->wait();
    const auto& b = buckets[bi];
    auto& q = qs[bi];
    const auto n = static_cast<std::int64_t>(b.slots.size());
    if (on_host(q.flat) && has_fused_scan(b.flat)) {
      // The int32 wire's sums, unless some rank's integers did not fit it: then every rank (the
      // flag is the reduced one) sends the bucket again as int64, in bucket order.
      bool narrow = q.wire.defined();
      const std::int64_t len = q.flat.numel();
      if (narrow && q.wire.data_ptr<std::int32_t>()[len] > 0) {
        // This rank's int64 sums of the window, from the floating slots the wire was written from.
        auto* sums = q.flat.data_ptr<std::int64_t>();
        for (std::size_t k : b.slots) {
          const auto& s = slots[k];
          const auto& gs = grid[k];
          const std::int64_t numel = core.param(k).numel();
          if (gs.pending) {
            AT_DISPATCH_FLOATING_TYPES(b.flat.scalar_type(), "loom_grid_widen", [&] {
              quantize_add_cpu(b.flat.data_ptr<scalar_t>() + s.offset, sums + s.offset, numel, gs.exponent,
                               /*first=*/!gs.sums, /*keep_gradient=*/true);
            });
          } else if (!gs.sums) {
            std::fill(sums + s.offset, sums + s.offset + numel, std::int64_t{0});
          }
        }
        trace::Scope scope(*core.comm, trace::Context::reducer_bucket, static_cast<std::int64_t>(bi));
        auto wide = core.start(q.flat);
        wide.wait();
        ++out.wide_buckets;
        narrow = false;
      }
      if (narrow) {
        const std::int32_t* wt = q.wire.data_ptr<std::int32_t>() + (len - GridTail::length(n));
        std::copy(wt, wt + GridTail::length(n), q.tail.data_ptr<std::int64_t>());
      }
      auto& v = info[bi];
      v.assign(static_cast<std::size_t>(n + 1), 0);
      bool bad = false;
      AT_DISPATCH_FLOATING_TYPES(b.flat.scalar_type(), "loom_grid_dequantize", [&] {
        for (std::int64_t j = 0; j < n; ++j) {
          const std::size_t k = b.slots[static_cast<std::size_t>(j)];
          const std::int64_t numel = core.param(k).numel();
          const std::int64_t offset = slots[k].offset;
          scalar_t* dst = b.flat.data_ptr<scalar_t>() + offset;
          v[static_cast<std::size_t>(j)] = narrow ? dequantize_cpu(q.wire.data_ptr<std::int32_t>() + offset, dst, numel,
                                                                   grid[k].exponent, multiplier, divisor, bad)
                                                  : dequantize_cpu(q.flat.data_ptr<std::int64_t>() + offset, dst, numel,
                                                                   grid[k].exponent, multiplier, divisor, bad);
        }
      });
      if (b.main && !bad) bad = !at::isfinite(b.head.to(b.param_dtype)).all().template item<bool>();
      v[static_cast<std::size_t>(n)] = bad ? 1 : 0;
      const auto* t = q.tail.data_ptr<std::int64_t>();
      v.insert(v.end(), t, t + GridTail::length(n));
      continue;
    }
    std::vector<at::Tensor> parts;
    at::Tensor bad;
    if (q.lengths.defined()) {  // off the host: the whole bucket in a fixed number of operators
      std::vector<double> factors;
      factors.reserve(b.slots.size());
      for (std::size_t k : b.slots) factors.push_back(grid_factor(grid[k].exponent, multiplier, divisor));
      auto [largest, not_finite] =
          dequantize_bucket_aten(q.head, b.head, per_element(factors, q.lengths, b.head.numel()), q.lengths);
      parts.push_back(largest);
      bad = not_finite;
    } else {
      bad = at::zeros({1}, q.flat.options());
      for (std::size_t k : b.slots) {
        const auto& s = slots[k];
        const std::int64_t numel = core.param(k).numel();
        auto [largest, not_finite] =
            dequantize_aten(q.flat.narrow(0, s.offset, numel), b.flat.narrow(0, s.offset, numel), grid[k].exponent,
                            multiplier, divisor);
        parts.push_back(largest);
        bad.add_(not_finite);
      }
    }
    if (b.main) bad.add_(non_finite_flag(b.head, at::kLong, b.param_dtype));
    parts.push_back(bad);
    parts.push_back(q.tail);
    device_info.push_back(at::cat(parts).to(core.device));
  }
  if (!device_info.empty()) {  // one read for every bucket that lives off the host
    const at::Tensor all = core.host_read(at::cat(device_info));
    const auto* p = all.data_ptr<std::int64_t>();
    for (std::size_t bi = 0; bi < buckets.size(); ++bi) {
      if (!info[bi].empty()) continue;
      const auto n = static_cast<std::int64_t>(buckets[bi].slots.size());
      const auto len = static_cast<std::size_t>(n + 1 + GridTail::length(n));
      info[bi].assign(p, p + len);
      p += len;
    }
  }

  summary.used.assign(slots.size(), 0);
  std::vector<char> overflowed(slots.size(), 0), near(slots.size(), 0);
  std::vector<std::int64_t> largest(slots.size(), 0);
  for (std::size_t bi = 0; bi < buckets.size(); ++bi) {
    const auto& b = buckets[bi];
    const auto n = static_cast<std::int64_t>(b.slots.size());
    const std::int64_t* v = info[bi].data();
    const std::int64_t* t = v + n + 1;
    if (v[n] > 0 || t[GridTail::non_finite(n)] > 0) summary.non_finite = true;
    for (std::int64_t j = 0; j < n; ++j) {
      const std::size_t k = b.slots[static_cast<std::size_t>(j)];
      verdict.contributions = std::max(verdict.contributions, t[GridTail::contributions(n, j)]);
      largest[k] = v[j];
      summary.used[k] = t[GridTail::used(n, j)] > 0 ? 1 : 0;
      overflowed[k] = t[GridTail::overflow(n, j)] > 0 ? 1 : 0;
      near[k] = t[GridTail::near(n, j)] > 0 ? 1 : 0;
    }
  }
  verdict.too_many_contributions = verdict.contributions > kGridMaxContributions;
  verdict.overflow = std::any_of(overflowed.begin(), overflowed.end(), [](char o) { return o != 0; });
  if (verdict.overflow) {
    std::string names;
    for (std::size_t k = 0; k < slots.size(); ++k) {
      if (!overflowed[k]) continue;
      grid[k].exponent = backed_off_grid_exponent(grid[k].exponent);
      names += fmt::format("{}{} (now 2^{})", names.empty() ? "" : ", ", core.list.describe(slots[k].param),
                           -grid[k].exponent);
    }
    TORCH_WARN_ONCE(
        "loom::Reducer (deterministic): a gradient was too large for its integer grid; every rank "
        "skipped the step and made the grid coarser: ",
        names, ". Reduction::grid_overflow reports each such step; this warning is shown once.");
  } else if (!summary.non_finite && !verdict.too_many_contributions) {
    for (std::size_t k = 0; k < slots.size(); ++k)
      grid[k].exponent = next_grid_exponent(grid[k].exponent, largest[k], near[k] != 0, summary.used[k] != 0);
  }
  if (clip) {
    // Per parameter, summed in parameter order: the bucket split (rank 0's first ready order, which
    // can depend on the world size) does not enter the norm.
    std::vector<at::Tensor> norms;
    for (std::size_t k = 0; k < slots.size(); ++k) {
      const auto& b = buckets[slots[k].bucket];
      const at::Tensor g = b.flat.narrow(0, slots[k].offset, core.param(k).numel());
      norms.push_back(at::norm(g, 2, compute_dtype(g.scalar_type())).to(at::kDouble).reshape({1}));
    }
    const bool host = std::all_of(buckets.begin(), buckets.end(), [](const GradBucket& b) { return on_host(b.flat); });
    if (!host)
      for (auto& n : norms) n = n.to(core.device);
    const at::Tensor all = host ? at::cat(norms) : core.host_read(at::cat(norms));
    double sumsq = 0;
    for (std::int64_t k = 0; k < all.numel(); ++k) sumsq += all.data_ptr<double>()[k] * all.data_ptr<double>()[k];
    summary.squared_norm = sumsq;
  }
  return out;
}

}  // namespace loom::detail
