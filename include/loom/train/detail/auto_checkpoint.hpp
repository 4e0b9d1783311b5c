// loom/train/detail/auto_checkpoint.hpp — TrainerOptions::checkpoint: the Trainer saves its own
// checkpoint every N optimizer steps and after each epoch's last step, and resumes from the file
// at its first epoch loop when the file exists (epochs before the cursor's then run no batch), so
// a restarted job continues with no code of its own (docs/elastic.md, "The restart path").
//
// Example (inside Trainer): `if (detail::AutoCheckpoint::begin(*this, loader, epoch)) return range;`
// Throws: loom::InvalidArgument when the option is set for an optimizer without save/load or a
//         loader without a plan; load_checkpoint's and save_checkpoint's errors.
#pragma once

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <type_traits>

#include <fmt/format.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <loom/comm/host_values.hpp>
#include <loom/error.hpp>
#include <loom/train/batch_source.hpp>

namespace loom::detail {

/// A Trainer's record for its own checkpoint.
struct AutoCheckpointState {
  bool started = false;        // the first epoch loop looked for the file
  int64_t first_epoch = 0;     // the epoch the file resumed at (0 without one)
  bool skipping = false;       // the running loop is an epoch before first_epoch: no batch
  std::function<void()> save;  // saves with the running epoch's loader
};

/// TrainerOptions::checkpoint's work, a friend of loom::Trainer. save_checkpoint / load_checkpoint
/// (loom/train/checkpoint.hpp, included at the end of loom/train/trainer.hpp) are found by
/// argument-dependent lookup when the Trainer's templates are instantiated.
struct AutoCheckpoint {
  /// At Trainer::epoch(loader, epoch): the first time, resumes from the file when it exists; then
  /// whether `epoch` comes before the resumed epoch (its loop runs no batch).
  template <class T, class Loader>
  static bool begin(T& t, Loader& loader, int64_t epoch) {
    t.auto_.skipping = false;
    if (!t.options_.checkpoint) return false;
    using Opt = std::remove_reference_t<decltype(*t.optimizer_)>;
    constexpr bool serializable =
        requires(Opt & o, torch::serialize::OutputArchive & out, torch::serialize::InputArchive & in) {
      o.save(out);
      o.load(in);
    };
    if constexpr (!serializable || !PlannedBatchSource<Loader>) {
      throw InvalidArgument(
          "Trainer: TrainerOptions::checkpoint needs an optimizer with save/load (every torch::optim optimizer) and a "
          "loader that follows a plan (loom::BatchLoader)");
    } else {
      const auto& file = t.options_.checkpoint->file;
      t.auto_.save = [&t, &loader, &file] { save_checkpoint(file, t, loader); };
      if (!t.auto_.started) {
        t.auto_.started = true;
        // Rank 0's file is the one read (ranks need no shared file system): its answer counts.
        if (broadcast_string(*t.comm_, std::filesystem::exists(file) ? "1" : "0") == "1") {
          const auto info = load_checkpoint(file, t, loader);
          t.auto_.first_epoch = info.cursor.epoch;
          if (t.comm_->rank() == 0)
            std::fprintf(stderr, "loom: resumed from %s at epoch %lld, step %lld (%lld optimizer steps done)\n",
                         file.string().c_str(), static_cast<long long>(info.cursor.epoch),
                         static_cast<long long>(info.cursor.step), static_cast<long long>(t.steps_));
        }
      }
      if (epoch < t.auto_.first_epoch) t.auto_.skipping = true;
      return t.auto_.skipping;
    }
  }

  /// After a step boundary: saves every `every_steps` applied optimizer steps.
  template <class T>
  static void after_step(T& t, bool applied) {
    if (!t.options_.checkpoint || !applied || t.options_.checkpoint->every_steps == 0) return;
    if (t.steps_ % t.options_.checkpoint->every_steps == 0) t.auto_.save();
  }

  /// After an epoch's last step: saves (the cursor then names the next epoch's step 0).
  template <class T>
  static void after_epoch(T& t) {
    if (t.options_.checkpoint) t.auto_.save();
  }
};

}  // namespace loom::detail
