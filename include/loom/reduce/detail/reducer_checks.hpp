// loom/reduce/detail/reducer_checks.hpp — what a reducer refuses: options out of range, parameters
// it cannot reduce, and a parameter set that changed under it after construction.
//
// Errors: loom::InvalidArgument naming the option and value, or the parameter and what changed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/csrc/autograd/variable.h>

#include <loom/comm/communicator.hpp>
#include <loom/comm/host_values.hpp>
#include <loom/detail/torch_api.hpp>
#include <loom/error.hpp>
#include <loom/reduce/detail/bucket.hpp>
#include <loom/reduce/options.hpp>
#include <loom/reduce/parameters.hpp>

namespace loom::detail {

/// Throws loom::InvalidArgument for a bucket cap of 0 bytes, a wire dtype other than float16 or
/// bfloat16, or a max_grad_norm that is not > 0.
inline void check_reducer_options(const ReducerOptions& options) {
  if (options.bucket_cap_bytes == 0 || options.first_bucket_cap_bytes == 0)
    throw InvalidArgument(
        fmt::format("Reducer: bucket caps must be > 0 bytes (bucket_cap_bytes = {}, first_bucket_cap_bytes = {})",
                    options.bucket_cap_bytes, options.first_bucket_cap_bytes));
  if (options.wire_dtype && *options.wire_dtype != at::kHalf && *options.wire_dtype != at::kBFloat16)
    throw InvalidArgument(
        fmt::format("Reducer: wire_dtype {} is not float16 or bfloat16", c10::toString(*options.wire_dtype)));
  if (options.max_grad_norm && !(*options.max_grad_norm > 0))
    throw InvalidArgument(fmt::format("Reducer: max_grad_norm = {} (must be > 0)", *options.max_grad_norm));
  if (options.deterministic && options.average == Average::world_size)
    throw InvalidArgument(
        "Reducer: deterministic = true with average = world_size: dividing by the number of ranks makes the "
        "gradient depend on it; use average = samples (or none)");
  if (options.deterministic && options.wire_dtype)
    throw InvalidArgument(fmt::format(
        "Reducer: deterministic = true with wire_dtype = {}: the deterministic reducer sends int64 sums; leave "
        "wire_dtype unset",
        c10::toString(*options.wire_dtype)));
}

/// The options every rank's reducer must share, as (name, value) pairs: those that decide which
/// collectives a window issues and what they carry (bucket caps, rebuild, average, wire dtype,
/// float32 accumulation, deterministic, clipping, the inf/NaN scan, the construction checks and
/// broadcasts). `overlap` only moves when a bucket is sent, so it may differ.
/// Example: reducer_option_values({.deterministic = true})[8] == {"deterministic", 1}.
inline std::vector<std::pair<const char*, std::int64_t>> reducer_option_values(const ReducerOptions& o) {
  std::int64_t clip = -1;  // no max_grad_norm; else its float64 bits
  if (o.max_grad_norm) std::memcpy(&clip, &*o.max_grad_norm, sizeof clip);
  return {{"bucket_cap_bytes", static_cast<std::int64_t>(o.bucket_cap_bytes)},
          {"first_bucket_cap_bytes", static_cast<std::int64_t>(o.first_bucket_cap_bytes)},
          {"rebuild_buckets", o.rebuild_buckets ? 1 : 0},
          {"average", static_cast<std::int64_t>(o.average)},
          {"wire_dtype", o.wire_dtype ? static_cast<std::int64_t>(*o.wire_dtype) : -1},
          {"float32_accumulation", o.float32_accumulation ? 1 : 0},
          {"check_parameters", o.check_parameters ? 1 : 0},
          {"broadcast_parameters", o.broadcast_parameters ? 1 : 0},
          {"deterministic", o.deterministic ? 1 : 0},
          {"max_grad_norm", clip},
          {"broadcast_buffers", o.broadcast_buffers ? 1 : 0}};
}

/// How reducer_option_values' entry `name` = `v` reads in a message ("true", "Half", "none", "1.5").
inline std::string reducer_option_text(const std::string& name, std::int64_t v) {
  if (name == "rebuild_buckets" || name == "float32_accumulation" || name == "check_parameters" ||
      name == "broadcast_parameters" || name == "deterministic" || name == "broadcast_buffers")
    return v != 0 ? "true" : "false";
  if (name == "average") return std::string(to_string(static_cast<Average>(v)));
  if (name == "wire_dtype") return v < 0 ? "unset" : c10::toString(static_cast<c10::ScalarType>(v));
  if (name == "max_grad_norm") {
    if (v == -1) return "unset";
    double d = 0;
    std::memcpy(&d, &v, sizeof d);
    return fmt::format("{}", d);
  }
  return fmt::format("{}", v);
}

/// Checks that every rank built its reducer with the same options (reducer_option_values): one
/// all_gather of a dozen integers, before any other collective of the reducer, so ranks that would
/// issue different collectives (deterministic on one rank only: int64 sums against float buckets)
/// stop with an error instead of failing inside the backend or waiting.
/// Throws: loom::InvalidArgument on every rank naming the first option that differs, the rank and
///         both values; the communicator's errors.
template <Communicator Comm>
void check_same_reducer_options(Comm& comm, const ReducerOptions& options) {
  if (comm.world_size() == 1) return;
  const auto values = reducer_option_values(options);
  std::vector<std::int64_t> mine;
  for (const auto& v : values) mine.push_back(v.second);
  const auto all = all_gather_int64(comm, std::span<const std::int64_t>(mine));
  const auto& ref = all[0];
  for (std::size_t r = 1; r < all.size(); ++r) {
    const auto& other = all[r];
    for (std::size_t i = 0; i < values.size(); ++i) {
      if (other[i] == ref[i]) continue;
      const std::string name = values[i].first;
      throw InvalidArgument(fmt::format(
          "Reducer: the ranks were built with different ReducerOptions: {} is {} on rank {} but {} on rank 0 (seen "
          "from rank {}); every rank must build its Reducer (TrainerOptions::reducer) with the same options",
          name, reducer_option_text(name, other[i]), r, reducer_option_text(name, ref[i]), comm.rank()));
    }
  }
}

/// Deterministic mode promises the same bits on any world size only with one intra-op thread per
/// rank (a float reduction inside a kernel may split its work by thread count): with `threads` > 1
/// this prints one warning line on stderr, once per process, naming the count and the fix.
/// loom::run and loom::spawn set one thread in the ranks they start (SpawnOptions::threads_per_rank).
/// Example: warn_threads(at::get_num_threads(), comm.rank());
inline void warn_threads(int threads, int rank) {
  static bool warned = false;
  if (threads <= 1 || warned) return;
  warned = true;
  std::fprintf(stderr,
               "loom: warning: rank %d: ReducerOptions::deterministic promises the same bits on any world size only "
               "with one intra-op thread per rank, and this process runs %d (at::get_num_threads()); call "
               "at::set_num_threads(1) before training (loom::run does it for the ranks it spawns)\n",
               rank, threads);
  std::fflush(stderr);
}

/// Throws loom::InvalidArgument when `list` has names, but not one per parameter.
inline void check_names(const ParameterList& list) {
  if (!list.names.empty() && list.names.size() != list.params.size())
    throw InvalidArgument(fmt::format("Reducer: {} names for {} parameters", list.names.size(), list.params.size()));
}

/// Each parameter's slot: trainable parameters numbered in list order, kNoSlot for frozen ones.
/// Throws loom::InvalidArgument for an undefined parameter, and for a trainable one that is not a
/// leaf, has no floating dtype, or is listed twice.
inline std::vector<std::size_t> trainable_slots(const ParameterList& list) {
  std::vector<std::size_t> slot_of_param(list.params.size(), kNoSlot);
  std::size_t slots = 0;
  for (std::size_t i = 0; i < list.params.size(); ++i) {
    const auto& p = list.params[i];
    if (!p.defined()) throw InvalidArgument(fmt::format("Reducer: {} is undefined", list.describe(i)));
    if (!p.requires_grad()) continue;  // frozen: never reduced
    if (!p.is_leaf())
      throw InvalidArgument(fmt::format(
          "Reducer: {} is not a leaf tensor (it has a grad_fn); pass the model's parameters", list.describe(i)));
    if (!at::isFloatingType(p.scalar_type()))
      throw InvalidArgument(
          fmt::format("Reducer: {} has dtype {}; gradients are reduced for float32, float64, float16 and bfloat16",
                      list.describe(i), c10::toString(p.scalar_type())));
    for (std::size_t j = 0; j < i; ++j)
      if (list.params[j].unsafeGetTensorImpl() == p.unsafeGetTensorImpl())
        throw InvalidArgument(fmt::format("Reducer: {} and {} are the same tensor; list shared parameters once",
                                          list.describe(j), list.describe(i)));
    slot_of_param[i] = slots++;
  }
  return slot_of_param;
}

/// Throws loom::InvalidArgument when a parameter's trainability, dtype, device or shape, or the
/// gradient accumulator the hooks hang on, changed since construction (e.g. module->to(dtype),
/// which replaces the accumulators, or requires_grad_ toggled). Cost: a few reads per parameter.
/// The vectors are the reducer's: slot_of_param maps a parameter index to its slot (kNoSlot: frozen).
inline void check_parameter_set(const ParameterList& list, const std::vector<std::size_t>& slot_of_param,
                                const std::vector<GradSlot>& slots, const std::vector<GradBucket>& buckets,
                                const std::vector<GradAccumulatorPtr>& accumulators) {
  constexpr const char* kAdvice =
      "build the Reducer (or the loom::Trainer holding it) after moving, casting, freezing or unfreezing the model";
  for (std::size_t i = 0; i < list.params.size(); ++i) {
    const auto& p = list.params[i];
    const std::size_t k = slot_of_param[i];
    if (k == kNoSlot) {
      if (p.requires_grad())
        throw InvalidArgument(
            fmt::format("Reducer: {} was frozen (requires_grad = false) when the Reducer was built and is "
                        "trainable now, so its gradient would never be reduced; {}",
                        list.describe(i), kAdvice));
      continue;
    }
    const auto& view = slots[k].view;
    if (!p.requires_grad())
      throw InvalidArgument(fmt::format("Reducer: {} was trainable when the Reducer was built and is frozen now; {}",
                                        list.describe(i), kAdvice));
    const c10::ScalarType built_dtype = buckets[slots[k].bucket].param_dtype;
    if (p.scalar_type() != built_dtype || p.device() != view.device() || p.sizes() != view.sizes())
      throw InvalidArgument(
          fmt::format("Reducer: {} is {} [{}] on {} now but was {} [{}] on {} when the Reducer was built "
                      "(e.g. module->to(...) afterwards); {}",
                      list.describe(i), c10::toString(p.scalar_type()), fmt::join(p.sizes(), ", "), p.device().str(),
                      c10::toString(built_dtype), fmt::join(view.sizes(), ", "), view.device().str(), kAdvice));
    if (torch::autograd::impl::try_get_grad_accumulator(p).get() != accumulators[k].get())
      throw InvalidArgument(
          fmt::format("Reducer: {} got a new gradient accumulator after the Reducer was built (set_data or "
                      "module->to(...) replaced it), so its gradient would bypass the reducer; {}",
                      list.describe(i), kAdvice));
  }
}

}  // namespace loom::detail
