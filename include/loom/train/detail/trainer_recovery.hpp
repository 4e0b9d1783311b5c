// loom/train/detail/trainer_recovery.hpp — how loom::Trainer goes on after a rank died (an elastic
// loom::ProcessGroup, loom/dist/elastic.hpp; docs/elastic.md): the survivors agree on who is left and
// rebuild the group, take the state of the survivor that had come furthest
// (loom/train/detail/elastic_state.hpp), rebuild the reducer and accumulator over the new group, and
// deal the rest of the epoch again from the first step not every survivor had committed.
//
// Example (inside Trainer): `catch (const CommError& e) { detail::TrainerRecovery::recover(*this, e); }`
// Throws: rethrows the caught error when the communicator is not elastic or no rank died; the
//         ProcessGroup's recovery errors (fewer ranks than ElasticOptions::min_ranks, ...).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <functional>
#include <string>
#include <type_traits>
#include <vector>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <loom/dist/elastic.hpp>
#include <loom/error.hpp>
#include <loom/reduce/parameters.hpp>
#include <loom/sample/global_batch.hpp>
#include <loom/trace/recorder.hpp>
#include <loom/train/batch_source.hpp>
#include <loom/train/detail/elastic_state.hpp>
#include <loom/train/detail/trainer_checks.hpp>

namespace loom::detail {

/// A Trainer's record for recoveries: its progress (step boundaries passed, the agreement's
/// measure), the next step of the running epoch, whether the loader must deal again, the
/// recoveries so far and the user's callback.
struct ElasticProgress {
  int64_t boundaries = 0;
  bool in_loop = false;  // the running epoch's plan check passed
  int64_t next_step = 0;
  bool redeal = false;
  std::vector<Recovery> recoveries;
  std::function<void(const Recovery&)> on_recovery;
};

/// The Trainer's recovery, a friend of loom::Trainer.
struct TrainerRecovery {
  /// A collective of `t` failed (the caught `e`): with an elastic communicator and a dead rank,
  /// the survivors rebuild the group, take the state of the one that had come furthest, rebuild
  /// the reducer and deal the interrupted step again (redeal, at the next batch); otherwise
  /// rethrows. Called only inside a catch block.
  template <class T>
  static void recover(T& t, const CommError& e) {
    using Comm = std::remove_reference_t<decltype(*t.comm_)>;
    using ReducerType = typename T::ReducerType;
    if constexpr (!ElasticCommunicator<Comm>) {
      throw;
    } else {
      if (!t.comm_->elastic() || !t.broken_.empty()) throw;
      const auto start = std::chrono::steady_clock::now();
      ParameterList list = t.reducer_->parameters();
      TrainerPosition mine = position(t);
      t.accumulator_.reset();
      t.reducer_.reset();  // its hooks go before the parameters' gradients are dropped
      {
        const at::NoGradGuard no_grad;
        for (auto& p : list.params)
          if (p.defined() && p.grad().defined()) p.mutable_grad().reset();
      }
      std::string cause = e.what();
      std::vector<int> lost;
      for (;;) {
        Recovery r;
        try {
          r = t.comm_->recover(progress(t), cause);
        } catch (const CommError& failed) {
          t.broken_ = "the job could not go on after a rank died";
          if (!t.options_.checkpoint) throw;
          throw CommError(
              fmt::format("{}; this Trainer's last checkpoint: {} (TrainerOptions::checkpoint: a rerun "
                          "resumes from it)",
                          failed.what(), t.options_.checkpoint->file.string()));
        } catch (...) {
          t.broken_ = "the job could not go on after a rank died";
          throw;
        }
        lost.insert(lost.end(), r.lost.begin(), r.lost.end());
        if (lost.empty()) {
          t.broken_ = fmt::format("a collective failed and no rank had died: {}", first_line(cause));
          throw;
        }
        try {
          const int source = state_source(r.progress);
          const TrainerPosition pos = share_trainer_state(*t.comm_, source, list, *t.optimizer_, mine);
          // This rank holds the source's state from here on, whatever fails next.
          mine = pos;
          t.steps_ = pos.state.steps;
          t.skipped_ = pos.state.skipped_steps;
          t.elastic_.next_step = pos.next_step;
          t.steps_in_epoch_ = pos.steps_in_epoch;
          t.stop_ = t.stop_ || pos.stop;
          t.elastic_.boundaries = pos.boundaries;
          t.elastic_.in_loop = pos.in_loop;
          if (pos.epoch != t.epoch_) {
            // The source had started another epoch (a rank died between epochs, while this rank
            // was still in epoch t.epoch_): the code between epochs is the user's, so this rank
            // cannot catch up in place. It leaves; the others see it go and agree again.
            t.broken_ = fmt::format("a rank died between epochs {} and {}, and this rank had not left epoch {}",
                                    t.epoch_, pos.epoch, t.epoch_);
            throw CommError(fmt::format(
                "elastic: launch rank(s) {} died between epochs {} and {} while this rank was still in epoch {} and "
                "others had started epoch {}; this rank leaves the job so that the others go on (min_ranks "
                "permitting)",
                launch_ranks_text(lost), t.epoch_, pos.epoch, t.epoch_, pos.epoch));
          }
          ReducerOptions reducer_options = t.options_.reducer;
          reducer_options.broadcast_parameters = false;  // every survivor holds the source's parameters now
          t.reducer_.emplace(make_trainer_reducer<ReducerType>(*t.comm_, list, reducer_options));
          t.accumulator_.emplace(*t.reducer_, t.accumulator_options());
          if (pos.state.loss_scaler) t.accumulator_->loss_scaler()->load_state(*pos.state.loss_scaler);
          if (!pos.state.grid_exponents.empty() && t.reducer_->options().deterministic)
            t.reducer_->load_grid_exponents(pos.state.grid_exponents);
        } catch (const CommError& again) {
          if (!t.broken_.empty()) throw;
          t.accumulator_.reset();  // another rank died meanwhile: agree again
          t.reducer_.reset();
          cause = again.what();
          continue;
        } catch (...) {
          t.broken_ = "its recovery from a rank's death failed";
          throw;
        }
        std::sort(lost.begin(), lost.end());
        r.lost = lost;
        r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        r.epoch = t.epoch_;
        r.step = t.elastic_.next_step;
        t.guard_ = TrainableGuard(t.reducer_->parameters());
        t.guard_.record_versions(t.reducer_->parameters());
        t.backward_done_ = true;  // the loop body's batch stays valid; the next batch replaces it
        t.arrivals_seen_ = t.reducer_->gradient_arrivals();
        t.skips_.set_rank(t.comm_->rank());  // rank 0 of the new group warns of skipped steps
        t.elastic_.redeal = true;
        t.elastic_.recoveries.push_back(r);
        if (t.elastic_.on_recovery)
          t.elastic_.on_recovery(r);
        else if (t.comm_->rank() == 0)
          std::fprintf(stderr, "%s\n", recovery_line(r).c_str());
        return;
      }
    }
  }

  /// A survivor's progress in the agreement: step boundaries passed, then whether it had passed
  /// the running epoch's plan check (a rank that died in the check may have let some through).
  template <class T>
  static int64_t progress(const T& t) {
    return 2 * t.elastic_.boundaries + (t.elastic_.in_loop ? 1 : 0);
  }

  template <class T>
  static TrainerPosition position(const T& t) {
    TrainerPosition p{t.state(), t.epoch_, t.elastic_.next_step};
    p.steps_in_epoch = t.steps_in_epoch_;
    p.boundaries = t.elastic_.boundaries;
    p.in_loop = t.elastic_.in_loop;
    p.stop = t.stop_;
    return p;
  }

  /// Trainer::epoch's plan check (loom::check_same_plan) at the start of epoch `t.epoch_`, again
  /// over the survivors when a rank died in it; notes the step the epoch starts at.
  template <class T, class Loader>
  static void check_plan(T& t, Loader& loader, const std::exception_ptr& failed) {
    const GlobalCursor at = loader.sampler().cursor();
    t.elastic_.next_step = at.epoch == t.epoch_ ? at.step : 0;
    t.elastic_.in_loop = false;
    for (;;) {
      try {
        trace::set_position(*t.comm_, 0, 0, t.planned_);
        trace::Scope scope(*t.comm_, trace::Context::sampler_check);
        check_same_plan(*t.comm_, loader.sampler(), fmt::format("Trainer::epoch({})", t.epoch_), failed);
        t.elastic_.in_loop = true;
        return;
      } catch (const CommError& e) {
        recover(t, e);
        redeal(t, loader);
        if (t.elastic_.in_loop) return;  // the survivor furthest on had passed the check: so do all now
      }
    }
  }

  /// After a recovery: this rank's share of the rest of the epoch, from the step every survivor
  /// stands at, over the new group.
  template <class T, class Loader>
  static void redeal(T& t, Loader& loader) {
    t.elastic_.redeal = false;
    if constexpr (requires { loader.reshard(0, 1, int64_t{}, int64_t{}); }) {
      loader.reshard(t.comm_->rank(), t.comm_->world_size(), t.epoch_, t.elastic_.next_step);
      if constexpr (PlannedBatchSource<Loader>) t.plan_ = &loader.sampler().plan();
    } else {
      t.broken_ = "its loader cannot deal the epoch again over the survivors";
      throw Error(
          "Trainer: a rank died and the survivors go on, but this loader cannot deal the rest of the epoch over "
          "them: it needs reshard(rank, world_size, epoch, step), as loom::BatchLoader has");
    }
  }
};

}  // namespace loom::detail
