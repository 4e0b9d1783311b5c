// loom/train/detail/loop_exit.hpp — what loom::Trainer does when its epoch loop ends before the
// epoch's end (EpochRange's destructor): after an exception nothing is sent (a step left open makes
// the Trainer refuse further use); right after stop() it is that stop; after a break or return every
// rank is told and loom::Error is thrown (docs/loop.md, "What loom checks").
//
// Example (inside Trainer): `void end_loop_early(bool e) { detail::LoopExit::end_early(*this, e); }`
// Throws: loom::Error after a break or return out of the loop.
#pragma once

#include <cstdint>

#include <fmt/format.h>

#include <loom/error.hpp>
#include <loom/train/detail/trainer_checks.hpp>

namespace loom::detail {

/// The end of a Trainer's epoch loop before the epoch's end, a friend of loom::Trainer.
struct LoopExit {
  template <class T>
  static void end_early(T& t, bool by_exception) {
    t.loop_open_ = false;
    if (by_exception) {
      abandon(t);
      return;
    }
    if (t.stop_ && t.accumulator_->window_micro_batches() == 0) {
      t.stopped_ = true;
      return;
    }
    leave(t);
  }

  /// An exception left the loop (EpochRange's destructor while unwinding): with a step open on this
  /// rank the Trainer refuses further use (no collective is attempted).
  template <class T>
  static void abandon(T& t) noexcept {
    if (!t.accumulator_) return;  // a recovery failed: broken_ says why
    if (t.accumulator_->window_micro_batches() == 0 && !t.guard_.holds_gradients()) return;
    if (t.broken_.empty())
      t.broken_ = fmt::format(
          "an exception left the loop over epoch {} inside step {}, whose micro-batches were never reduced (the "
          "ranks may be out of step); build a new Trainer",
          t.epoch_, t.current_step_);
  }

  /// A loop over trainer.epoch(...) ended before the epoch's end, not by stop() and not by an
  /// exception (EpochRange's destructor): one last window marked leaving, so the other ranks stop
  /// with an error instead of waiting for this one; then the error here.
  template <class T>
  [[noreturn]] static void leave(T& t) {
    const int64_t step = t.current_step_, batch = t.batch_number_;
    t.current_.reset();
    if (t.broken_.empty()) {
      t.broken_ = fmt::format("its loop over epoch {} was left before the epoch's end (step {})", t.epoch_, step);
      // No check may throw here: the other ranks wait for this window.
      t.guard_.put_back(t.reducer_->parameters());
      (void)t.accumulator_->leave_step();
    }
    throw Error(loop_left_message(t.epoch_, batch, step));
  }
};

}  // namespace loom::detail
