// loom/train/epoch_range.hpp — EpochRange, the loop over this rank's batches of one epoch that
// Trainer::epoch returns: an iterator over the trainer's next_batch(source), which joins the steps
// in which this rank has no batch and closes the epoch at its end; its destructor tells the trainer
// when a started loop ends early (end_loop_early). Made by Trainer::epoch (loom/train/trainer.hpp),
// whose file comment states the protocol.
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
/// T: the trainer (next_batch(L&) -> Batch*, end_loop_early(bool)); L: its BatchSource.
template <class T, class L>
class EpochRange {
 public:
  struct End {};
  class Iterator {
   public:
    using value_type = Batch;
    using difference_type = std::ptrdiff_t;
    Batch& operator*() const { return *range_->current_; }
    Iterator& operator++() {
      range_->advance();
      return *this;
    }
    void operator++(int) { ++*this; }
    friend bool operator==(const Iterator& it, End) { return it.at_end(); }

   private:
    friend class EpochRange;
    explicit Iterator(EpochRange* r) : range_(r) {}
    [[nodiscard]] bool at_end() const { return range_->current_ == nullptr; }
    EpochRange* range_;
  };

  EpochRange(T* trainer, L* loader) : trainer_(trainer), loader_(loader), exceptions_(std::uncaught_exceptions()) {}
  EpochRange(const EpochRange&) = delete;
  EpochRange& operator=(const EpochRange&) = delete;
  EpochRange& operator=(EpochRange&&) = delete;
  EpochRange(EpochRange&& other) noexcept
      : trainer_(std::exchange(other.trainer_, nullptr)),
        loader_(other.loader_),
        current_(other.current_),
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
    trainer_->end_loop_early(/*by_exception=*/std::uncaught_exceptions() > exceptions_);
  }

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
    current_ = trainer_->next_batch(*loader_);
    if (current_ == nullptr) done_ = true;
  }

  T* trainer_;
  L* loader_;
  Batch* current_ = nullptr;  // the trainer's current batch; nullptr once the loop is over
  bool started_ = false;
  bool done_ = false;
  int exceptions_ = 0;  // std::uncaught_exceptions() when the range was made
};

}  // namespace loom
