// loom/schedule/assign.hpp — which generators feed which device.
//
// An Assignment is a policy value; `assign(policy, num_generators, num_devices)` resolves it into
// the list of generator ids of every device, each list in increasing generator order (that order
// is the row order of the device's batches).
//
// Example:
//   auto a = loom::assign(loom::Assignment::contiguous(), 16, 8);   // a[3] == {6, 7}
//   auto b = loom::assign(loom::Assignment::round_robin(), 10, 4);  // b[1] == {1, 5, 9}
//   auto c = loom::assign(loom::Assignment::explicit_map({1, 0, 1}), 3, 2);  // c == {{1}, {0, 2}}
//
// Uneven counts (N generators, M devices, N % M != 0): the first N % M devices get
// ceil(N / M) generators and the others floor(N / M), so device loads differ by at most one
// generator. 10 onto 4: contiguous gives {0,1,2} {3,4,5} {6,7} {8,9}; round-robin gives
// {0,4,8} {1,5,9} {2,6} {3,7}.
//
// Source: the contiguous split follows numpy.array_split / torch.tensor_split (first N % M parts
// one larger); round-robin is the strided split of torch.utils.data.DistributedSampler.
#pragma once

#include <cstdint>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <loom/error.hpp>

namespace loom {

/// How generators are spread over devices. Build one with contiguous(), round_robin() or
/// explicit_map(); pass it in the loader's options.
///
/// Example: `loom::GeneratorLoaderOptions{.assignment = loom::Assignment::round_robin()}`.
struct Assignment {
  enum class Kind { contiguous, round_robin, explicit_map };

  Kind kind = Kind::contiguous;
  /// For Kind::explicit_map: device_of[g] is the device of generator g (size = number of generators).
  std::vector<int> device_of;

  /// Device d takes a block of consecutive generators (16 onto 8: device d takes 2d and 2d+1).
  static Assignment contiguous() { return {Kind::contiguous, {}}; }
  /// Generator g goes to device g % M (16 onto 8: device d takes d and d + 8).
  static Assignment round_robin() { return {Kind::round_robin, {}}; }
  /// Generator g goes to device `device_of[g]`; every device must get at least one generator.
  static Assignment explicit_map(std::vector<int> device_of) { return {Kind::explicit_map, std::move(device_of)}; }
};

/// Name of an assignment kind ("contiguous", "round_robin", "explicit_map"), for messages.
constexpr std::string_view to_string(Assignment::Kind k) noexcept {
  switch (k) {
    case Assignment::Kind::contiguous: return "contiguous";
    case Assignment::Kind::round_robin: return "round_robin";
    case Assignment::Kind::explicit_map: return "explicit_map";
  }
  return "?";
}

/// Generator ids of every device: `result[d]` lists device d's generators in increasing order.
///
/// Example: `loom::assign(loom::Assignment::contiguous(), 10, 4)` == {{0,1,2}, {3,4,5}, {6,7}, {8,9}}.
/// Units: ids are generator indices in [0, num_generators); devices are indices in [0, num_devices).
/// Throws: loom::InvalidArgument when num_generators < 1, num_devices < 1, num_generators <
///         num_devices (a device would have no generator), or an explicit map whose size is not
///         num_generators, which names a device outside [0, num_devices), or leaves a device empty.
/// Source: see the file comment (numpy.array_split for contiguous blocks).
inline std::vector<std::vector<int>> assign(const Assignment& policy, int num_generators, int num_devices) {
  if (num_generators < 1)
    throw InvalidArgument(fmt::format("assign: num_generators is {}, must be >= 1", num_generators));
  if (num_devices < 1) throw InvalidArgument(fmt::format("assign: num_devices is {}, must be >= 1", num_devices));
  std::vector<std::vector<int>> out(static_cast<std::size_t>(num_devices));
  if (policy.kind == Assignment::Kind::explicit_map) {
    if (static_cast<int64_t>(policy.device_of.size()) != num_generators)
      throw InvalidArgument(fmt::format("assign: the explicit map has {} entries but there are {} generators",
                                        policy.device_of.size(), num_generators));
    for (int g = 0; g < num_generators; ++g) {
      const int d = policy.device_of[static_cast<std::size_t>(g)];
      if (d < 0 || d >= num_devices)
        throw InvalidArgument(fmt::format("assign: the explicit map sends generator {} to device {}, outside [0, {})",
                                          g, d, num_devices));
      out[static_cast<std::size_t>(d)].push_back(g);
    }
    for (int d = 0; d < num_devices; ++d)
      if (out[static_cast<std::size_t>(d)].empty())
        throw InvalidArgument(
            fmt::format("assign: the explicit map {} gives device {} no generator", policy.device_of, d));
    return out;
  }
  if (num_generators < num_devices)
    throw InvalidArgument(fmt::format("assign: {} generators onto {} devices leaves devices {}..{} without a generator",
                                      num_generators, num_devices, num_generators, num_devices - 1));
  const int base = num_generators / num_devices;
  const int extra = num_generators % num_devices;
  if (policy.kind == Assignment::Kind::contiguous) {
    int g = 0;
    for (int d = 0; d < num_devices; ++d) {
      const int count = base + (d < extra ? 1 : 0);
      for (int i = 0; i < count; ++i) out[static_cast<std::size_t>(d)].push_back(g++);
    }
  } else {
    for (int g = 0; g < num_generators; ++g) out[static_cast<std::size_t>(g % num_devices)].push_back(g);
  }
  return out;
}

/// Generator ids of one device (in the per-rank mode: of rank `device` of world size `num_devices`).
///
/// Example: `loom::generators_of(loom::Assignment::contiguous(), 16, 8, 3)` == {6, 7}.
/// Throws: as assign(), and loom::InvalidArgument when device is outside [0, num_devices).
inline std::vector<int> generators_of(const Assignment& policy, int num_generators, int num_devices, int device) {
  if (device < 0 || device >= num_devices)
    throw InvalidArgument(fmt::format("generators_of: device {} is outside [0, {})", device, num_devices));
  return std::move(assign(policy, num_generators, num_devices)[static_cast<std::size_t>(device)]);
}

}  // namespace loom
