// loom/train/generator_source.hpp — GeneratorSource: generator streams as a loom::BatchSource, so
// loom::Trainer trains them as it trains a dataset.
//
// Example (16 generators over 8 ranks, 2 per rank; epoch e makes fresh generators):
//   loom::run([&](loom::ProcessGroup& pg) {
//     loom::GeneratorSource source(pg, 16, [&](int g, int64_t epoch) { return Sim(g, epoch); },
//                                  {.end = loom::EndPolicy::drain});
//     loom::Trainer trainer(pg, *model, opt);
//     for (int64_t e = 0; e < epochs; ++e)
//       for (loom::Batch& b : trainer.epoch(source, e)) trainer.backward(loss_of(b), b);
//   }, {.nproc = 8});
//
// Epochs: generators are streams, read once. begin_epoch(e) builds a loom::RankGeneratorLoader
// over `make(g, e)` for this rank's generators (loom::generators_of), so an epoch is one pass
// over freshly made streams; the previous epoch's loader is stopped and joined first.
// Steps: step k of the epoch is the k-th sample of each of this rank's generators, collated into
// one batch (rows = this rank's generators still running): one micro-batch per optimizer step,
// `step_end` set, `step` = k. Every rank yields the same steps (the loader agrees on them over
// the communicator), so the trainer's collectives stay in step.
// Weighting: a batch's rows count as its samples (Batch::num_samples), so the Trainer's step is
// the mean over every row of the step on every rank, whatever the number of rows per rank.
// End of data (GeneratorLoaderOptions::end): stop_at_shortest ends every rank at the step where
// the first generator ended; drain runs until every generator ended, and a rank whose generators
// all ended yields an idle batch for each remaining step (weight 0: the Trainer joins the step
// with no backward, and its gradient counts as zero; no sample is dropped or counted twice).
// Resume: state() is where the running epoch stands (steps and samples per generator); give it
// as GeneratorLoaderOptions::resume to resume_epoch(e, state) on every rank, before the
// trainer's epoch(source, e): that epoch's streams skip the samples already delivered.
// Thread use: begin_epoch and next on the training thread; the loader's workers run the generators.
// Throws: the loader's errors (loom::InvalidArgument for bad options or a Collate whose result is
//         not a loom::Batch; loom::GeneratorError / RemoteError when a generator threw; the
//         communicator's errors), loom::Error for next() before begin_epoch.
// Source: the k-th-sample alignment and per-rank agreement of loom::RankGeneratorLoader; an
//         epoch as one pass over re-made streams follows torch.utils.data.IterableDataset, whose
//         iterator is made anew each epoch.
#pragma once

#include <concepts>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <type_traits>
#include <utility>

#include <fmt/format.h>

#include <loom/collate/batch.hpp>
#include <loom/collate/transfer.hpp>
#include <loom/comm/communicator.hpp>
#include <loom/error.hpp>
#include <loom/schedule/collate_fn.hpp>
#include <loom/schedule/options.hpp>
#include <loom/schedule/rank_generator_loader.hpp>
#include <loom/train/batch_source.hpp>

namespace loom {

/// Generator streams as a BatchSource: epoch e runs a RankGeneratorLoader over make(g, e).
///
/// Example: see the file comment.
/// Shape: each Batch is Collate's (DefaultCollate: data R x (sample shape), R = this rank's
///        running generators; indices = generator ids unless the projection gives an index).
/// Units: epochs and steps from 0; samples = rows.
/// Throws: see the file comment.
/// Source: see the file comment.
template <class Make, Communicator C, class Collate = DefaultCollate<>, class Transfer = HostTransfer>
requires std::invocable<Make&, int, std::int64_t>
class GeneratorSource {
 public:
  using Generator = std::invoke_result_t<Make&, int, std::int64_t>;
  using Loader = RankGeneratorLoader<Generator, C, Collate, Transfer>;
  static_assert(std::same_as<typename Loader::BatchType, Batch>,
                "loom::GeneratorSource: the collate function must return loom::Batch (DefaultCollate does), the "
                "type loom::Trainer trains on");

  /// Keeps the communicator, the number of generators (all ranks), the factory and the options;
  /// builds nothing until begin_epoch.
  /// Throws: loom::InvalidArgument for num_generators < 1.
  GeneratorSource(C& comm, int num_generators, Make make, GeneratorLoaderOptions options = {}, Collate collate_fn = {},
                  Transfer transfer = {})
      : comm_(&comm),
        num_generators_(num_generators),
        make_(std::move(make)),
        options_(std::move(options)),
        collate_(std::move(collate_fn)),
        transfer_(std::move(transfer)) {
    if (num_generators < 1)
      throw InvalidArgument(fmt::format("GeneratorSource: num_generators is {}, must be >= 1", num_generators));
    resume_ = options_.resume;
    options_.resume = {};
  }

  GeneratorSource(const GeneratorSource&) = delete;
  GeneratorSource& operator=(const GeneratorSource&) = delete;

  /// Stops the previous epoch's loader and starts epoch `epoch`'s (generator g = make(g, epoch)),
  /// from the resume state given for it (resume_epoch, or GeneratorLoaderOptions::resume for
  /// the first epoch begun), else from the streams' beginning.
  void begin_epoch(std::int64_t epoch) {
    loader_.reset();
    GeneratorLoaderOptions o = options_;
    if (resume_epoch_ == -1 || resume_epoch_ == epoch) o.resume = resume_;
    resume_ = {};
    resume_epoch_ = -2;  // a resume state applies to one epoch only
    epoch_ = epoch;
    loader_ = std::make_unique<Loader>(
        *comm_, num_generators_, [this, epoch](int g) { return make_(g, epoch); }, std::move(o), collate_, transfer_);
  }

  /// Resumes epoch `epoch` from `state` (a state() saved during it) at its next begin_epoch(epoch).
  void resume_epoch(std::int64_t epoch, GeneratorLoaderState state) {
    resume_ = std::move(state);
    resume_epoch_ = epoch;
  }

  /// This rank's batch of the next step (idle when its generators all ended under drain), or
  /// std::nullopt when the epoch's streams ended on every rank.
  /// Throws: loom::Error before begin_epoch; the loader's errors.
  std::optional<Batch> next() {
    if (!loader_)
      throw Error("GeneratorSource::next: no epoch has begun (call begin_epoch(e), or trainer.epoch(source, e))");
    auto item = loader_->next();
    if (!item) return std::nullopt;
    Batch b = std::move(item->batch);
    b.step = item->step;
    b.step_end = true;
    if (item->num_rows() == 0) {  // this rank ran dry under drain: it only joins the step
      b.idle = true;
      b.weight = 0.0;
      b.num_samples = 0;
    }
    return b;
  }

  /// Where the running epoch stands, for resume_epoch (call on the training thread).
  /// Throws: loom::Error before begin_epoch.
  [[nodiscard]] GeneratorLoaderState state() const {
    if (!loader_) throw Error("GeneratorSource::state: no epoch has begun");
    return loader_->state();
  }

  /// The running epoch's loader (its report(), assignment()); nullptr before begin_epoch.
  [[nodiscard]] Loader* loader() noexcept { return loader_.get(); }
  [[nodiscard]] std::int64_t epoch() const noexcept { return epoch_; }

 private:
  C* comm_;
  int num_generators_;
  Make make_;
  GeneratorLoaderOptions options_;
  Collate collate_;
  Transfer transfer_;
  GeneratorLoaderState resume_{};
  std::int64_t resume_epoch_ = -1;  // -1: the first epoch begun; -2: none
  std::int64_t epoch_ = -1;
  std::unique_ptr<Loader> loader_;
};

}  // namespace loom
