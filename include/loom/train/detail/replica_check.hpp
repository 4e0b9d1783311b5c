// loom/train/detail/replica_check.hpp — what must be equal on every replica of a data-parallel
// run, and the words for where it is not: the optimizer's parameter-group options (every step) and
// the parameters' bytes (at an epoch's end and before a checkpoint).
//
// The Trainer hands ReplicaState::fingerprint() to Reducer::compare_replicas, which compares it in
// the window meta of every step (no collective of its own); when the ranks differ, every rank calls
// describe_replica_difference (two all_gathers, only then) to name the first option or parameter.
//
// Example:
//   loom::detail::ReplicaState mine{loom::detail::optimizer_option_values(opt), {}};
//   reducer.compare_replicas(mine.fingerprint());
//   // ... a window reports replicas_differ, on every rank:
//   throw loom::Error(loom::detail::describe_replica_difference(comm, mine, list));
// Cost: the options are a few numbers per parameter group; a parameter checksum reads every byte of
// every parameter once (a parameter on a GPU is copied to the host first, one at a time).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <loom/comm/communicator.hpp>
#include <loom/comm/host_values.hpp>
#include <loom/detail/hash.hpp>
#include <loom/error.hpp>
#include <loom/reduce/detail/host_path.hpp>
#include <loom/reduce/parameters.hpp>
#include <loom/trace/recorder.hpp>
#include <loom/train/detail/optimizer_options.hpp>

namespace loom::detail {

/// A checksum of `t`'s values (its bytes in row-major order, copied to the host when needed).
inline std::uint64_t tensor_checksum(const at::Tensor& t) {
  if (!t.defined()) return 0;
  const at::Tensor c = (on_host(t) ? t : t.to(at::kCPU)).contiguous();
  Fnv1a f;
  f.add_words(c.data_ptr(), static_cast<std::size_t>(c.nbytes()));
  return f.value();
}

/// What one rank holds that every replica must share.
struct ReplicaState {
  std::vector<OptionValue> options;        ///< every parameter group's options (optimizer_option_values)
  std::vector<std::uint64_t> checksums{};  ///< per parameter of the list (tensor_checksum); empty: not taken

  /// A 64-bit hash of the options' values and the checksums.
  [[nodiscard]] std::uint64_t hash() const {
    Fnv1a f;
    for (const auto& o : options) {
      std::uint64_t bits;
      std::memcpy(&bits, &o.value, sizeof bits);
      f.add(static_cast<std::uint64_t>(o.group));
      f.add(std::string_view(o.name));
      f.add(bits);
    }
    for (std::uint64_t c : checksums) f.add(c);
    return f.value();
  }
  /// The hash folded to the 20 bits Reducer::compare_replicas carries.
  [[nodiscard]] std::int64_t fingerprint() const {
    const std::uint64_t h = hash();
    return static_cast<std::int64_t>((h ^ (h >> 20) ^ (h >> 40)) & 0xFFFFFu);
  }
};

/// `mine` with the checksum of every parameter of `list` taken now.
inline ReplicaState with_checksums(ReplicaState mine, const ParameterList& list) {
  mine.checksums.clear();
  for (const auto& p : list.params) mine.checksums.push_back(tensor_checksum(p));
  return mine;
}

/// Names the first thing that differs between this rank's `mine` and another rank's (compared with
/// rank 0, in order: the options' count, each option, each parameter checksum). Every rank must call
/// it at the same point (two all_gathers). Returns an empty string when every rank holds the same.
template <Communicator Comm>
std::string describe_replica_difference(Comm& comm, const ReplicaState& mine, const ParameterList& list) {
  // Row: [options, checksums, then per option its group, name hash and value bits, then checksums].
  std::vector<std::int64_t> row{static_cast<std::int64_t>(mine.options.size()),
                                static_cast<std::int64_t>(mine.checksums.size())};
  for (const auto& o : mine.options) {
    std::int64_t bits = 0;
    std::memcpy(&bits, &o.value, sizeof bits);
    row.push_back(o.group);
    row.push_back(static_cast<std::int64_t>(fnv1a(std::string_view(o.name))));
    row.push_back(bits);
  }
  for (std::uint64_t c : mine.checksums) row.push_back(static_cast<std::int64_t>(c));
  const auto all = all_gather_int64_ragged(comm, std::span<const std::int64_t>(row));
  const auto* ref = all[0].data();
  auto value_of = [](std::int64_t bits) {
    double v = 0;
    std::memcpy(&v, &bits, sizeof v);
    return v;
  };
  for (std::size_t r = 1; r < all.size(); ++r) {
    const auto* other = all[r].data();
    if (other[0] != ref[0])
      return fmt::format(
          "the optimizer has {} parameter-group options on rank {} but {} on rank 0 (another optimizer "
          "or another number of parameter groups)",
          other[0], r, ref[0]);
    for (std::int64_t i = 0; i < ref[0]; ++i) {
      const std::int64_t pos = 2 + 3 * i;
      if (other[pos] == ref[pos] && other[pos + 1] == ref[pos + 1] && other[pos + 2] == ref[pos + 2]) continue;
      const auto& o = mine.options[static_cast<std::size_t>(i)];
      if (other[pos] != ref[pos] || other[pos + 1] != ref[pos + 1])
        return fmt::format(
            "the optimizer's parameter groups differ in kind on rank {} and rank 0 (option {} of group "
            "{} on this rank is '{}')",
            r, i, o.group, o.name);
      return fmt::format("parameter group {}'s option {} is {} on rank {} but {} on rank 0", o.group, o.name,
                         value_of(other[pos + 2]), r, value_of(ref[pos + 2]));
    }
    const std::int64_t first = 2 + 3 * ref[0];
    for (std::int64_t k = 0; k < std::min(ref[1], other[1]); ++k) {
      if (other[first + k] == ref[first + k]) continue;
      return fmt::format("{} holds other values on rank {} than on rank 0 (checksums {:016x} and {:016x})",
                         list.describe(static_cast<std::size_t>(k)), r, static_cast<std::uint64_t>(other[first + k]),
                         static_cast<std::uint64_t>(ref[first + k]));
    }
  }
  return {};
}

/// This rank's ReplicaState: `optimizer`'s options, and with `with_parameters` the checksums of
/// `list`'s parameters.
template <class Opt>
ReplicaState replica_state_of(Opt& optimizer, const ParameterList& list, bool with_parameters) {
  ReplicaState state{optimizer_option_values(optimizer)};
  return with_parameters ? with_checksums(std::move(state), list) : state;
}

/// Where a learning-rate schedule belongs, for the replica errors.
inline constexpr const char* kReplicaAdvice =
    "Every rank must hold the same parameters and optimizer options: change them alike on every rank (a "
    "learning-rate schedule in on_step(), which every rank runs at every step, or between epochs), never in the "
    "loop body, which ranks run different numbers of times per step, nor on one rank only (docs/loop.md, \"PyTorch "
    "habits\")";

/// After a window found the ranks' fingerprints different (the same verdict on every rank): names
/// what differs (every rank takes part: two all_gathers) and throws loom::Error "Trainer: the replicas
/// differ <where> ...".
template <Communicator Comm>
[[noreturn]] void throw_replicas_differ(Comm& comm, const ReplicaState& mine, const ParameterList& list,
                                        const std::string& where) {
  std::string what;
  {
    trace::Scope scope(comm, trace::Context::parameter_check);
    what = describe_replica_difference(comm, mine, list);
  }
  if (what.empty()) what = "their fingerprints differ, though no option or parameter compared differs";
  throw Error(fmt::format("Trainer: the replicas differ {} (this window's step was not applied): {}. {}", where, what,
                          kReplicaAdvice));
}

/// Compares the optimizer's options and the parameters across the ranks now (two all_gathers; every
/// rank calls it at the same point). Throws: loom::Error "<where>: the replicas differ: ..." naming
/// the first difference.
template <Communicator Comm, class Opt>
void check_replicas_now(Comm& comm, Opt& optimizer, const ParameterList& list, const char* where) {
  const ReplicaState state = replica_state_of(optimizer, list, /*with_parameters=*/true);
  std::string what;
  {
    trace::Scope scope(comm, trace::Context::parameter_check);
    what = describe_replica_difference(comm, state, list);
  }
  if (!what.empty()) throw Error(fmt::format("{}: the replicas differ: {}. {}", where, what, kReplicaAdvice));
}

}  // namespace loom::detail
