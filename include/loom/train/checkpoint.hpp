// loom/train/checkpoint.hpp — one call saves, one call restores, everything a resumed run needs:
// the model's parameters and buffers, the optimizer's state, the loader's world-size-free cursor,
// the Trainer's step counts and loss scaler, values of the user's, and a format version.
//
// Example (every rank calls both, at the same point of the run):
//   loom::Trainer trainer(pg, *model, opt);
//   int64_t first_epoch = 0;
//   if (fs::exists(file)) first_epoch = loom::load_checkpoint(file, trainer, loader).cursor.epoch;
//   trainer.on_step([&](const loom::SyncResult&) {
//     if (trainer.steps() % 100 == 0) loom::save_checkpoint(file, trainer, loader);
//   });
//   for (int64_t e = first_epoch; e < epochs; ++e)
//     for (loom::Batch& b : trainer.epoch(loader, e)) trainer.backward(loss_of(b), b);
//   loom::save_checkpoint(file, trainer, loader);  // after an epoch: resumes at the next one
//
// Saving: first every rank compares its parameters and optimizer options with the others'
// (Trainer::check_replicas: loom::Error on every rank naming what differs, nothing written), since
// rank 0's copy is the one kept. Then rank 0 creates the file's folder (and missing parents), writes `<file>.loom-tmp`, flushes
// it to disk (fsync), renames it over `file` and flushes the folder: a crash or SIGKILL mid-save,
// or a write that fails (a full disk, a file size limit), leaves the previous checkpoint whole.
// Then every rank learns whether rank 0 succeeded (one all_gather of its error text): a failed save
// is a loom::Error on every rank, so no rank goes on alone. Call it where every rank is at the same
// step: in on_step(), or between epoch loops (never in the loop body, which ranks run different
// numbers of times).
// Loading: rank 0 reads the file and broadcasts its bytes (ranks need no shared file system); every
// rank checks the checksum, reads and checks everything, then restores the same values into the
// Trainer's optimizer (`optimizer.load(archive)`, as every torch::optim optimizer, then every
// parameter group's options: learning rate, momentum, betas, eps, weight decay..., on every
// LibTorch version), its parameters and buffers (copied in place, on their device), its step
// counts and loss scaler (Trainer::load_state), and points the loader at the cursor
// (`loader.resume`). Call it between epoch loops, then start the loop at `cursor.epoch` (a
// `loader.sampler().set_epoch(cursor.epoch)` before it keeps the cursor).
// World size: nothing in the file depends on it (parameters are replicas, the cursor is global):
// a checkpoint of 2 ranks resumes on 3. TrainerOptions::zero_stage = 1 writes the optimizer state
// whole, as stage 0 does (ShardedOptimizer::gather_state: rank 0 holds all of it while it writes;
// every rank holds it for a moment while it loads, then keeps its shard): either stage, on any world
// size, resumes the other's file.
// Format "loom-checkpoint v2": a LibTorch archive (torch::serialize, a zip file) followed by a
// 40-byte trailer, "\nloom-checksum fnv1a64 <16 hex digits>\n": FNV-1a 64 of every byte before it,
// checked on load (about 1 GB/s). The archive's keys: loom_checkpoint ("loom-checkpoint v2"),
// param_count, buffer_count, param_<i> / param_name_<i> / buffer_<i> (CPU tensors; names checked on
// load), optimizer (the optimizer's own archive), param_group_count, param_group_<i>_type /
// _size / _options (the options' own serialize(); count 0 for an optimizer that is not a
// torch::optim::Optimizer), cursor and loss_scaler (their one-line texts), plan_field_count,
// plan_name_<i> / plan_value_<i> (the loader's plan options, loom::detail::plan_fields),
// trainer_steps, trainer_skipped_steps, grid_exponents (a deterministic reducer's, comma-separated;
// absent otherwise), user_count, user_key_<i> / user_value_<i>. Files of format v1 (no trailer, no
// parameter group options) are refused naming their format.
// Throws: loom::DataError naming the file and what is wrong: it cannot be read, its checksum
//   differs from its trailer's (the bytes changed after the save), it is truncated or not a
//   LibTorch archive, is an archive without the loom_checkpoint key, has another format version
//   (v1 included), lacks the trailer, or misses a key; loom::InvalidArgument when it does not fit
//   this run: another number, name, shape or dtype of parameters (naming the parameter), another
//   number of parameter groups, options type or group size (naming the group), a loss scaler state
//   where the Trainer has none or the reverse, a cursor of another plan (naming each batching
//   option that differs with both values, or "the shapes differ"), another seed or a step outside
//   the epoch (the loader's resume errors); loom::Error on every rank when rank 0 could not save
//   (naming the file and the reason: a folder it cannot create, a failed write).
//   Everything is read and checked before the run changes; an error after that (only the
//   optimizer's own load, which runs first) leaves the optimizer partly restored: build a new one.
// Source: Accelerate's save_state / load_state and the torch.save dict of a DDP loop.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
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
#include <loom/error.hpp>
#include <loom/sample/global_batch.hpp>
#include <loom/train/batch_source.hpp>
#include <loom/train/detail/checkpoint_file.hpp>
#include <loom/train/detail/checkpoint_state.hpp>
#include <loom/train/trainer.hpp>

namespace loom {

/// The format version save_checkpoint writes and load_checkpoint accepts.
inline constexpr const char* kCheckpointFormat = "loom-checkpoint v2";

/// An optimizer whose state a checkpoint can hold: `save(OutputArchive&)` and `load(InputArchive&)`
/// (every torch::optim optimizer).
template <class O>
concept SerializableOptimizer = requires(O& o, torch::serialize::OutputArchive& out,
                                         torch::serialize::InputArchive& in) {
  o.save(out);
  o.load(in);
};

/// What load_checkpoint restored besides the tensors: where the run continues.
struct CheckpointInfo {
  GlobalCursor cursor{};                      ///< the next step to run: start the loop at cursor.epoch
  TrainerState trainer{};                     ///< step counts and loss scaler, already loaded into the Trainer
  std::map<std::string, std::string> user{};  ///< the values passed to save_checkpoint
};

/// Saves the run's state to `file` (see the file comment), creating its folder. Every rank calls it
/// at the same step. `user`: values of the user's (e.g. the wall time spent), returned by load_checkpoint.
/// Throws: loom::Error on every rank when rank 0 could not save, naming the file and the reason (a
///         folder it cannot create, a failed write, an optimizer's options type that cannot
///         serialize itself); the previous file at `file` is then unchanged.
template <Communicator C, StepOptimizer Opt, PlannedBatchSource Loader>
void save_checkpoint(const std::filesystem::path& file, Trainer<C, Opt>& trainer, const Loader& loader,
                     const std::map<std::string, std::string>& user = {}) {
  static_assert(SerializableOptimizer<Opt>,
                "loom::save_checkpoint: the optimizer must have save(OutputArchive&) and load(InputArchive&), as "
                "every torch::optim optimizer");
  C& comm = trainer.communicator();
  // Rank 0's replica stands for every rank's: first make sure they are all the same.
  trainer.check_replicas("save_checkpoint");
  std::string failure;
  // TrainerOptions::zero_stage = 1: the state's shards joined on rank 0, as an unsharded optimizer
  // holds it. Rank 0's own failure there (its memory) becomes the save's error on every rank.
  if (auto* sharded = trainer.sharded_optimizer()) {
    try {
      sharded->gather_state(0);
    } catch (const CommError&) {
      throw;
    } catch (const std::exception& e) {
      failure = detail::first_line(e.what());
    }
  }
  if (comm.rank() == 0 && failure.empty()) {
    try {
      torch::serialize::OutputArchive archive;
      archive.write("loom_checkpoint", c10::IValue(std::string(kCheckpointFormat)));
      detail::write_model_and_optimizer(archive, trainer.reducer().parameters(), trainer.optimizer());
      archive.write("cursor", c10::IValue(to_string(loader.sampler().cursor())));
      detail::write_plan_fields(archive, loader.sampler());
      detail::write_trainer_state(archive, trainer.state());
      detail::write_user_values(archive, user);
      detail::write_atomically(file, archive);
    } catch (const std::exception& e) {
      failure = detail::first_line(e.what());
      if (failure.empty()) failure = "unknown error";
    }
  }
  if (auto* sharded = trainer.sharded_optimizer()) sharded->release_state();
  detail::agree_on_save(comm, file, failure);
}

/// Restores the run's state from `file` into `trainer` and `loader` (see the file comment) and
/// returns the cursor, the Trainer's state and the user's values. Every rank calls it, between
/// epoch loops.
/// Throws: see the file comment (the same error on every rank).
template <Communicator C, StepOptimizer Opt, PlannedBatchSource Loader>
CheckpointInfo load_checkpoint(const std::filesystem::path& file, Trainer<C, Opt>& trainer, Loader& loader) {
  static_assert(SerializableOptimizer<Opt>,
                "loom::load_checkpoint: the optimizer must have save(OutputArchive&) and load(InputArchive&), as "
                "every torch::optim optimizer");
  C& comm = trainer.communicator();
  if (trainer.loop_running())  // the same on every rank: they all run the loop
    throw Error(fmt::format("load_checkpoint({}): an epoch loop is running; load a checkpoint between epoch loops",
                            file.string()));
  const std::string bytes = detail::broadcast_file(comm, file);
  const ParameterList& list = trainer.reducer().parameters();
  const at::Device device = list.params.empty() ? at::Device(at::kCPU) : list.params.front().device();
  torch::serialize::InputArchive archive = detail::open_checkpoint(file, bytes, device, kCheckpointFormat);

  // Everything is read and checked before anything of the run changes.
  CheckpointInfo info;
  detail::CheckpointReader read(file, archive);
  info.cursor = parse_global_cursor(read.text("cursor"));
  detail::check_plan_fields(read, loader.sampler(), info.cursor);  // names the changed batching options
  try {
    loader.sampler().check_resume(info.cursor);  // what loader.resume would refuse
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(fmt::format("load_checkpoint: {}: {}", file.string(), detail::first_line(e.what())));
  }
  info.trainer = detail::read_trainer_state(read);
  detail::check_trainer_state(info.trainer, /*scales_loss=*/false);  // the scaler is checked below, naming the file
  if (const LossScaler* scaler = trainer.accumulator().loss_scaler()) {
    if (!info.trainer.loss_scaler)
      throw InvalidArgument(fmt::format(
          "load_checkpoint: {}: this Trainer scales the loss but the state has no loss scaler state (the run that "
          "saved it had no TrainerOptions::loss_scaling)",
          file.string()));
    LossScaler probe = *scaler;
    probe.load_state(*info.trainer.loss_scaler);  // a state this scaler refuses: refused here
  } else if (info.trainer.loss_scaler) {
    throw InvalidArgument(
        fmt::format("load_checkpoint: {} holds a loss scaler state ({}), but this Trainer has no loss scaler "
                    "(TrainerOptions::loss_scaling unset)",
                    file.string(), to_string(*info.trainer.loss_scaler)));
  }
  if (!info.trainer.grid_exponents.empty() && trainer.reducer().options().deterministic)
    trainer.reducer().check_grid_exponents(info.trainer.grid_exponents);  // another model's count: refused here
  info.user = read.user_values();
  const detail::StagedParameters staged(read, list);
  detail::StagedParamGroups<Opt> groups(read, trainer.optimizer());
  torch::serialize::InputArchive optimizer;
  read.archive("optimizer", optimizer);

  trainer.optimizer().load(optimizer);  // the only step that can still fail (the optimizer's own checks)
  groups.apply(trainer.optimizer());    // LibTorch < 2.4's load keeps the constructor's options
  if (auto* sharded = trainer.sharded_optimizer()) sharded->scatter_state();  // this rank's pieces only
  staged.copy_into(list);
  trainer.load_state(info.trainer);
  loader.resume(info.cursor);
  return info;
}

}  // namespace loom
