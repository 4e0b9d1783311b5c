// loom/reduce/options.hpp — what a Reducer is told (ReducerOptions, Average) and what it reports
// about itself (HostReads).
//
// Example: `loom::Reducer reducer(comm, params, {.bucket_cap_bytes = 16 * loom::kMiB, .max_grad_norm = 1.0});`
// Units: caps in bytes; max_grad_norm in gradient units; reads counted since construction.
// Source: DDP's constructor arguments (bucket_cap_mb, broadcast_buffers, gradient_as_bucket_view)
//         and its comm hooks (fp16_compress_hook) for the wire dtype.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

#include <c10/core/ScalarType.h>

#include <loom/reduce/buckets.hpp>

namespace loom {

/// How the summed gradient is divided: `samples` for the exact mean over every sample of the step,
/// `world_size` to reproduce DDP. Guide: docs/reduce.md#averaging-the-two-conventions.
enum class Average {
  samples,     ///< by the all-reduced sample count of the window (exact global mean; default)
  world_size,  ///< by the number of ranks (DDP)
  none,        ///< not divided (sum over ranks)
};

/// "samples", "world_size" or "none".
constexpr std::string_view to_string(Average a) noexcept {
  switch (a) {
    case Average::samples: return "samples";
    case Average::world_size: return "world_size";
    case Average::none: return "none";
  }
  return "?";
}

/// Options of Reducer; use with designated initializers.
///
/// Example: `loom::ReducerOptions{.bucket_cap_bytes = 16 * loom::kMiB, .max_grad_norm = 1.0}`.
/// Units: caps in bytes; max_grad_norm in gradient units (L2 norm of the averaged gradient).
struct ReducerOptions {
  std::size_t bucket_cap_bytes = 25 * kMiB;       ///< cap of every bucket but the first of each dtype/device
  std::size_t first_bucket_cap_bytes = 1 * kMiB;  ///< cap of the first bucket (sent first, so small)
  bool rebuild_buckets = true;                    ///< once, after the first step, in rank 0's gradient-ready order
  Average average = Average::samples;             ///< divisor of the summed gradient
  std::optional<c10::ScalarType> wire_dtype{};    ///< at::kHalf / at::kBFloat16: compress float32 buckets on the wire
  /// float16 / bfloat16 parameters: sum their micro-batch gradients, all-reduce and average them in
  /// float32 buckets (Megatron's main_grad), so a small micro-batch's gradient is not rounded away
  /// (bfloat16's spacing at 1.0 is 2^-7). Memory: 4 bytes per element instead of 2, plus the 16-bit
  /// copy of the average a parameter's .grad() holds after the step boundary; the all-reduce moves
  /// float32 unless wire_dtype compresses it. false: in the parameter's own dtype, each .grad() a view
  /// into its bucket (half the memory and traffic; gradients rounded at every micro-batch).
  bool float32_accumulation = true;
  bool overlap = true;                    ///< send full buckets from autograd hooks (false: all in finish_window)
  bool check_parameters = true;           ///< construction: same options and parameters on every rank (2 all-gathers)
  bool broadcast_parameters = true;       ///< construction: copy rank 0's parameters and buffers everywhere
  std::optional<double> max_grad_norm{};  ///< clip by the global L2 norm (after averaging and unscaling)
  bool broadcast_buffers = true;          ///< copy rank 0's buffers to every rank at each step boundary
  /// Bit-identical gradients on any number of ranks: each micro-batch's gradient (all backward
  /// passes between two prepare_backward calls) goes on a per-parameter power-of-two grid as int64,
  /// is summed as integers and turned back once per window (reduce/detail/exact.hpp). Needs
  /// average = samples or none and no wire_dtype; a micro-batch must hold the same backward passes
  /// on any world size (the Accumulator and the Trainer plan them so). Cost: 8 bytes of memory per
  /// element more (12 on the CPU). Inside a window .grad() holds only the current micro-batch.
  /// Guide (the grid, the int32 wire, what else a bit-identical run needs):
  /// docs/elastic.md#bit-identical-training-on-any-world-size-reduceroptionsdeterministic.
  bool deterministic = false;
};

/// How often a reducer copied a value from the communicator's device to the host (each such read
/// is a synchronisation point on a GPU). Exposed so tests can hold the reducer to its budget: at
/// most one read per step (two for an end-of-epoch flush), none inside autograd hooks.
///
/// Example: `CHECK(reducer.host_reads().in_hooks == 0);`
/// Units: reads since the reducer was built.
struct HostReads {
  std::int64_t total = 0;     ///< every read
  std::int64_t in_hooks = 0;  ///< reads made while an autograd hook ran (a regression if ever > 0)
};

}  // namespace loom
