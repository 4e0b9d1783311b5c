// loom/train/epoch_range.hpp — EpochRange, the loop over this rank's batches of one epoch that
// Trainer::epoch returns: advancing it takes the loader's next item, joins the steps in which this
// rank has no batch, and closes the epoch at its end; its destructor handles a loop left early.
// Made only by Trainer::epoch (loom/train/trainer.hpp), whose file comment states the protocol.
//
// Example: `for (loom::Batch& b : trainer.epoch(loader, e)) trainer.backward(loss_of(b), b);`
#pragma once

#include <cstddef>
#include <exception>
#include <utility>

#include <loom/collate/batch.hpp>
#include <loom/error.hpp>

namespace loom {

/// The loop over this rank's batches of one epoch, made by Trainer::epoch. Iterating it yields
/// `loom::Batch&`; advancing joins steps without a batch here; reaching the end closes the epoch
/// (remainder and join). Single pass.
///
/// Example: `for (loom::Batch& b : trainer.epoch(loader, e)) trainer.backward(loss_of(b), b);`
/// Throws (while advancing): the checks of Trainer (a batch without backward, a stray backward),
/// the loader's errors, the reducer's errors. Its destructor throws loom::Error when a started loop
/// ends before the epoch's end other than by stop() or an exception (a break or return: see the
/// Trainer's file comment); it is noexcept(false) for that reason.
template <class T, class L>
class EpochRange {
 public:
  struct End {};
  class Iterator {
   public:
    using value_type = Batch;
    using difference_type = std::ptrdiff_t;
    Batch& operator*() const { return *range_->trainer_->current_; }
    Iterator& operator++() {
      range_->advance();
      return *this;
    }
    void operator++(int) { ++*this; }
    friend bool operator==(const Iterator& it, End) { return it.range_->finished(); }

   private:
    friend class EpochRange;
    explicit Iterator(EpochRange* r) : range_(r) {}
    EpochRange* range_;
  };

  EpochRange(T* trainer, L* loader) : trainer_(trainer), loader_(loader), exceptions_(std::uncaught_exceptions()) {}
  EpochRange(const EpochRange&) = delete;
  EpochRange& operator=(const EpochRange&) = delete;
  EpochRange& operator=(EpochRange&&) = delete;
  EpochRange(EpochRange&& other) noexcept
      : trainer_(std::exchange(other.trainer_, nullptr)),
        loader_(other.loader_),
        started_(other.started_),
        done_(other.done_),
        exceptions_(other.exceptions_) {}

  /// A loop that started and did not reach the epoch's end:
  ///  - left by an exception: nothing is sent (the error is on its way); when a step was open, the
  ///    Trainer refuses further use (its gradients and counts belong to a step that never closed);
  ///  - left by a break or return right after stop() took effect at a boundary: as if the loop
  ///    had ended by stop() (the other ranks stop there too);
  ///  - otherwise (a break or return): the Trainer tells every rank and throws (see its file comment).
  ~EpochRange() noexcept(false) {
    if (trainer_ == nullptr || !started_ || done_) return;
    if (std::uncaught_exceptions() > exceptions_) {
      trainer_->abandon_loop();
      return;
    }
    if (trainer_->stop_ && trainer_->accumulator_.window_micro_batches() == 0) {
      trainer_->stopped_ = true;
      return;
    }
    trainer_->leave_loop();
  }

  friend class Iterator;

  /// Whether the loop reached the end of the epoch (and closed it).
  [[nodiscard]] bool finished() const noexcept { return done_; }

  Iterator begin() {
    if (started_) throw Error("Trainer::epoch: an epoch range is single-pass; call trainer.epoch(loader, e) again");
    started_ = true;
    advance();
    return Iterator(this);
  }
  End end() const noexcept { return {}; }

 private:
  void advance() {
    for (;;) {
      if (trainer_->stop_ && trainer_->accumulator_.window_micro_batches() == 0) {  // stop() at a step boundary
        trainer_->stopped_ = true;
        done_ = true;
        return;
      }
      auto item = loader_->sampler().next();
      if (!item) {
        trainer_->end_epoch();
        done_ = true;
        return;
      }
      if (item->idle) {
        trainer_->join(item->step);
        continue;
      }
      trainer_->receive(loader_->load(*item), item->step);
      return;
    }
  }

  T* trainer_;
  L* loader_;
  bool started_ = false;
  bool done_ = false;
  int exceptions_ = 0;  // std::uncaught_exceptions() when the range was made
};

}  // namespace loom
