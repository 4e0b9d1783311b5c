// loom/train/detail/elastic_state.hpp — what loom::Trainer does after its process group was rebuilt
// over the survivors of a rank's death (loom/dist/elastic.hpp): every survivor takes the state of
// the one that had come furthest (its parameters and buffers, its optimizer's state and options, the
// Trainer's counts, loss scaler and grid exponents, and the step it stood at), sent as one archive
// in the format of loom's checkpoint (loom/train/checkpoint.hpp), so no file is written.
//
// Example: `auto s = detail::share_trainer_state(comm, source, list, optimizer, mine);`
// Throws: the communicator's errors; loom::InvalidArgument when the state does not fit (another model).
#pragma once

#include <concepts>
#include <cstdint>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <loom/accumulate/loss_scaler.hpp>
#include <loom/comm/communicator.hpp>
#include <loom/comm/host_values.hpp>
#include <loom/dist/elastic.hpp>
#include <loom/error.hpp>
#include <loom/reduce/parameters.hpp>
#include <loom/train/detail/checkpoint_file.hpp>
#include <loom/train/detail/checkpoint_state.hpp>
#include <loom/train/options.hpp>

namespace loom::detail {

/// A communicator that can go on over the survivors of a rank's death (loom::ProcessGroup).
template <class C>
concept ElasticCommunicator = requires(C& c, const C& cc, const std::string& cause) {
  { cc.elastic() } -> std::convertible_to<bool>;
  { cc.launch_rank() } -> std::convertible_to<int>;
  { c.recover(int64_t{}, cause) } -> std::same_as<Recovery>;
};

/// Where a Trainer stands: its state, the epoch and the next step of that epoch to run.
struct TrainerPosition {
  TrainerState state{};
  int64_t epoch = 0;
  int64_t next_step = 0;
  int64_t steps_in_epoch = 0;  // steps applied or skipped in the running epoch
  int64_t boundaries = 0;      // step boundaries passed since the Trainer was built
  bool in_loop = false;        // the epoch's plan check passed
  bool stop = false;           // Trainer::stop() was called (the loop ends at the next boundary)
};

/// The line the new rank 0 prints after a recovery without Trainer::on_recovery:
/// "loom: recovered: rank 2 died at step 5 of epoch 0, 2 ranks left, 1.31 s".
inline std::string recovery_line(const Recovery& r) {
  return fmt::format("loom: recovered: rank{} {} died at step {} of epoch {}, {} ranks left, {:.2f} s",
                     r.lost.size() > 1 ? "s" : "", fmt::join(r.lost, ", "), r.step, r.epoch, r.members.size(),
                     r.seconds);
}

/// The survivor whose state the others take: the one with the most progress (committed steps),
/// the lowest new rank among equals. `progress` is in new-rank order (Recovery::progress).
inline int state_source(const std::vector<int64_t>& progress) {
  int best = 0;
  for (std::size_t i = 1; i < progress.size(); ++i)
    if (progress[i] > progress[static_cast<std::size_t>(best)]) best = static_cast<int>(i);
  return best;
}

/// Every rank takes rank `source`'s parameters, buffers, optimizer state and options and `mine`
/// (rank source's position); returns rank source's position on every rank.
template <Communicator C, class Opt>
TrainerPosition share_trainer_state(C& comm, int source, const ParameterList& list, Opt& optimizer,
                                    const TrainerPosition& mine) {
  static_assert(
      requires(Opt & o, torch::serialize::OutputArchive & out, torch::serialize::InputArchive & in) {
        o.save(out);
        o.load(in);
      },
      "loom::Trainer with an elastic process group: the optimizer must have save(OutputArchive&) and "
      "load(InputArchive&), as every torch::optim optimizer (the survivors share its state)");
  std::string bytes;
  if (comm.rank() == source) {
    torch::serialize::OutputArchive archive;
    write_model_and_optimizer(archive, list, optimizer);
    write_trainer_state(archive, mine.state);
    archive.write("epoch", c10::IValue(mine.epoch));
    archive.write("next_step", c10::IValue(mine.next_step));
    archive.write("steps_in_epoch", c10::IValue(mine.steps_in_epoch));
    archive.write("boundaries", c10::IValue(mine.boundaries));
    archive.write("in_loop", c10::IValue(static_cast<int64_t>(mine.in_loop)));
    archive.write("stop", c10::IValue(static_cast<int64_t>(mine.stop)));
    std::ostringstream out;
    archive.save_to(out);
    bytes = out.str();
  }
  bytes = broadcast_string(comm, bytes, source);
  if (comm.rank() == source) return mine;
  const at::Device device = list.params.empty() ? at::Device(at::kCPU) : list.params.front().device();
  std::istringstream in(bytes);
  torch::serialize::InputArchive archive;
  archive.load_from(in, device);
  const std::filesystem::path what = fmt::format("(the state of rank {} after a recovery)", source);
  CheckpointReader read(what, archive);
  TrainerPosition out;
  out.state = read_trainer_state(read);
  out.epoch = read.integer("epoch");
  out.next_step = read.integer("next_step");
  out.steps_in_epoch = read.integer("steps_in_epoch");
  out.boundaries = read.integer("boundaries");
  out.in_loop = read.integer("in_loop") != 0;
  out.stop = read.integer("stop") != 0;
  const StagedParameters staged(read, list);
  StagedParamGroups<Opt> groups(read, optimizer);
  torch::serialize::InputArchive opt;
  read.archive("optimizer", opt);
  optimizer.load(opt);
  groups.apply(optimizer);
  staged.copy_into(list);
  return out;
}

}  // namespace loom::detail
