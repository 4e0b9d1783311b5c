// loom/train/detail/trainer_sharding.hpp — TrainerOptions::zero_stage: the Trainer's optimizer
// sharded across the ranks (loom::ShardedOptimizer, ZeRO stage 1), built after the reducer, with the
// stage compared across the ranks first.
//
// Example (inside Trainer's constructor): `sharded_(detail::make_trainer_sharding(comm, optimizer, options_))`.
// Throws: loom::InvalidArgument for a stage other than 0 or 1, ranks that chose different stages
//         (naming each rank's), an optimizer that is not a torch::optim optimizer ShardedOptimizer
//         takes, or an elastic ProcessGroup (a dead rank's shard of the state would be lost with it).
#pragma once

#include <concepts>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/optim/optimizer.h>

#include <loom/comm/communicator.hpp>
#include <loom/comm/host_values.hpp>
#include <loom/error.hpp>
#include <loom/optim/sharded_optimizer.hpp>
#include <loom/train/detail/elastic_state.hpp>
#include <loom/train/options.hpp>

namespace loom::detail {

/// The ShardedOptimizer TrainerOptions::zero_stage asks for over `optimizer`, or none (stage 0).
/// One all_gather of the stage when the world size is above 1 (first, so that a bad stage on one
/// rank is an error on every rank). Throws: see the file comment.
template <Communicator Comm, class Opt>
std::optional<ShardedOptimizer<Comm>> make_trainer_sharding(Comm& comm, Opt& optimizer, const TrainerOptions& options) {
  const int stage = options.zero_stage;
  if (comm.world_size() > 1) {
    const std::vector<std::int64_t> mine{stage};
    const auto all = all_gather_int64(comm, mine);
    std::vector<std::int64_t> stages;
    for (const auto& r : all) stages.push_back(r.at(0));
    for (std::int64_t s : stages)
      if (s != stage)
        throw InvalidArgument(fmt::format(
            "Trainer: the ranks set different TrainerOptions::zero_stage values (by rank: {}); every rank must pass "
            "the same",
            fmt::join(stages, ", ")));
  }
  // After the stages are compared (every rank reaches the same verdict, none waits in the all_gather).
  if (stage != 0 && stage != 1)
    throw InvalidArgument(fmt::format(
        "Trainer: TrainerOptions::zero_stage = {}; loom has stage 0 (every rank keeps the whole optimizer state) and "
        "stage 1 (loom::ShardedOptimizer: each rank keeps its shard of it)",
        stage));
  if (stage == 0) return std::nullopt;
  if constexpr (ElasticCommunicator<Comm>) {
    if (comm.elastic())
      throw InvalidArgument(
          "Trainer: TrainerOptions::zero_stage = 1 with an elastic ProcessGroup: each rank keeps the only copy of its "
          "shard of the optimizer state, so a rank's death would lose it; use the restart path "
          "(TrainerOptions::checkpoint, docs/elastic.md) without ProcessGroupOptions::elastic");
  }
  if constexpr (std::derived_from<Opt, torch::optim::Optimizer>) {
    try {
      return std::optional<ShardedOptimizer<Comm>>(std::in_place, comm, optimizer);
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(fmt::format("Trainer: TrainerOptions::zero_stage = 1: {}", first_line(e.what())));
    }
  } else {
    throw InvalidArgument(
        "Trainer: TrainerOptions::zero_stage = 1 needs a torch::optim optimizer (SGD, Adam, AdamW, RMSprop or "
        "Adagrad), whose state loom can cut into shards; this Trainer's optimizer is none");
  }
}

}  // namespace loom::detail
