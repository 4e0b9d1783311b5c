// loom/launch/rank_device.hpp — which GPU a rank uses: one per rank, chosen by LOCAL_RANK among the
// devices CUDA_VISIBLE_DEVICES lets the process see.
//
// One sentence: `loom::rank_cuda_device(env, visible_count, cuda_visible_devices)` is a pure
// function that returns the CUDA ordinal of this rank's GPU (its local rank: the runtime numbers
// the visible devices 0..n-1 in the order CUDA_VISIBLE_DEVICES lists them) and the name the
// variable gives that device, or throws naming the variables when the node has too few GPUs.
//
// Example:
//   // CUDA_VISIBLE_DEVICES=4,5 and torchrun --nproc-per-node 2: rank with LOCAL_RANK=1
//   auto d = loom::rank_cuda_device(env, 2, "4,5");   // d.ordinal == 1, d.visible_as == "5"
//
// Rule: NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU detected"), so every
// rank of the node needs its own device: LOCAL_WORLD_SIZE <= visible devices, else every rank
// throws (so none waits for the others). The convention is torchrun's and the TorchCV seed's
// (CUDA_VISIBLE_DEVICES restricts, torch.cuda.set_device(local_rank) selects).
// Throws: loom::ConfigError naming LOCAL_RANK, LOCAL_WORLD_SIZE, the visible count and
//         CUDA_VISIBLE_DEVICES.
// Source: torchrun's LOCAL_RANK convention; CUDA's CUDA_VISIBLE_DEVICES renumbering.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include <loom/error.hpp>
#include <loom/launch/environment.hpp>

namespace loom {

/// The GPU of one rank: the CUDA ordinal to use, and how CUDA_VISIBLE_DEVICES names it.
struct RankDevice {
  int ordinal = 0;         ///< CUDA device ordinal in this process (== local rank)
  std::string visible_as;  ///< the CUDA_VISIBLE_DEVICES entry at that position ("3", "GPU-5f2..."), or the ordinal
};

/// The entries of a CUDA_VISIBLE_DEVICES value ("0,2" -> {"0", "2"}; spaces trimmed; empty -> {}).
inline std::vector<std::string> parse_visible_devices(std::string_view value) {
  std::vector<std::string> out;
  std::size_t start = 0;
  while (start <= value.size()) {
    std::size_t end = value.find(',', start);
    if (end == std::string_view::npos) end = value.size();
    std::string_view item = value.substr(start, end - start);
    while (!item.empty() && item.front() == ' ') item.remove_prefix(1);
    while (!item.empty() && item.back() == ' ') item.remove_suffix(1);
    if (!item.empty()) out.emplace_back(item);
    start = end + 1;
  }
  return out;
}

/// The GPU of the rank described by `env`, given the number of devices the CUDA runtime reports
/// (`visible_count`) and the value of CUDA_VISIBLE_DEVICES (empty when unset). Pure.
///
/// Example: see the file comment.
/// Throws: loom::ConfigError when LOCAL_WORLD_SIZE > visible_count (no GPU, or fewer than ranks).
inline RankDevice rank_cuda_device(const Environment& env, int visible_count, std::string_view cuda_visible_devices) {
  const std::string shown =
      cuda_visible_devices.empty() ? std::string("unset") : fmt::format("'{}'", cuda_visible_devices);
  if (env.local_world_size > visible_count)
    throw ConfigError(fmt::format(
        "{} ranks on this node (LOCAL_WORLD_SIZE={}) need one GPU each, but {} {} visible "
        "(CUDA_VISIBLE_DEVICES {}); NCCL cannot share a GPU between ranks",
        env.local_world_size, env.local_world_size, visible_count, visible_count == 1 ? "is" : "are", shown));
  RankDevice d;
  d.ordinal = env.local_rank;
  const auto entries = parse_visible_devices(cuda_visible_devices);
  d.visible_as = static_cast<std::size_t>(env.local_rank) < entries.size()
                     ? entries[static_cast<std::size_t>(env.local_rank)]
                     : std::to_string(env.local_rank);
  return d;
}

}  // namespace loom
