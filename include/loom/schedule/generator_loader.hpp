// loom/schedule/generator_loader.hpp — GeneratorLoader: N generators onto M logical devices in one process,
// one batch per device per step, built ahead of the training loop on worker threads.
//
// Example (16 generators onto 8 devices, 2 per device):
//   std::vector<Sim> sims = make_sims(16);                       // each models SampleGenerator
//   loom::GeneratorLoader loader(std::move(sims), {.num_devices = 8, .prefetch_depth = 2});
//   for (auto& step : loader) {                                   // step.index == k
//     for (auto& db : step.devices)                              // db.device == 0..7
//       losses[db.device] = model[db.device]->forward(db.batch.data);   // data: 2 x (sample shape)
//   }
//   auto report = loader.report();                                // delivered / unread per generator
//
// Time alignment: the k-th batch of device d holds the k-th sample of each of d's generators
// (loom::assign gives them, increasing), in that order, collated by the Collate step (DefaultCollate,
// through loom's collator: stacked along a new leading batch dimension).
// Prefetch: worker threads (one per generator by default, or `num_workers`, generator g on worker
// g % W) pull the generators — the generators of one device at the same time — and the worker that
// completes a device's step collates it, while the consumer trains. At most `prefetch_depth` batches
// per device exist inside the loader, so host memory stays within M x depth x (batch bytes),
// plus the step the consumer holds.
// Batch memory (DefaultCollate): each device's batches live in buffers of a BufferPool the loader
// owns (prefetch_depth + 2 buffers; allocated by DefaultCollate's options.allocate, else by the
// transfer's batch_allocator() — pinned memory for loom::cuda::CudaTransfer — else at::empty),
// or in DefaultCollate's own options.pool. A sample's data is copied once, as it arrives, into its
// row of its step's buffer; a buffer is reused once the consumer has dropped every batch in it,
// so the steady state allocates no batch memory (a batch kept longer keeps its buffer).
// Workers: a worker pulls its generators in rounds (every one that can pull, then delivers them
// together), so the loader's one mutex is taken per round and per collated step, not per sample.
// Failure: a generator that throws stops production; the consumer receives every step before
// the failing one, then loom::GeneratorError (a RemoteError naming generator, device and sample).
// Leaving the loop early (break, exception, destruction) stops and joins the workers; a worker
// finishes at most the sample it is pulling.
// Determinism: batches depend only on the generators' streams, never on thread timing.
// Transfer: HostTransfer (default) keeps batches on the host; a CUDA transfer plugs in as the
// third template parameter (see loom/collate/transfer.hpp).
//
// Source: the k-th-sample alignment is zip() over streams; the bounded prefetch queue follows
// torch.utils.data.DataLoader's prefetch_factor.
#pragma once

#include <algorithm>
#include <cstdint>
#include <exception>
#include <iterator>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include <loom/collate/transfer.hpp>
#include <loom/error.hpp>
#include <loom/schedule/assign.hpp>
#include <loom/schedule/collate_fn.hpp>
#include <loom/schedule/detail/cursor.hpp>
#include <loom/schedule/detail/engine.hpp>
#include <loom/schedule/detail/next_iterator.hpp>
#include <loom/schedule/generator.hpp>
#include <loom/schedule/options.hpp>
#include <loom/schedule/results.hpp>

namespace loom {

/// Runs N generators onto M logical devices in one process, yielding one GeneratorLoaderStep (a batch per
/// device) per call of next() or per iteration of a range-for.
///
/// Example: see the file comment.
/// Shape: GeneratorLoaderStep::devices[d].batch is Collate's result; with DefaultCollate a loom::Batch whose data is
///        R x (sample shape) with R = the number of device d's generators (fewer under drain).
/// Units: prefetch_depth in batches per device; steps and samples counted from 0.
/// Throws: loom::InvalidArgument from the constructor for a bad option (num_devices < 1,
///         prefetch_depth < 1, num_workers < 0, more devices than generators, a bad explicit
///         map or resume state); from next(): loom::GeneratorError when a generator threw (and on
///         every later call), or the collate function's / transfer's own exception unchanged.
/// Source: see the file comment.
template <SampleGenerator G, class Collate = DefaultCollate<>, class Transfer = HostTransfer>
class GeneratorLoader {
  static_assert(SampleGenerator<G>,
                "loom::GeneratorLoader: G must model loom::SampleGenerator (a callable returning "
                "std::optional<Sample>, or an input range)");
  static_assert(CollateFunction<Collate, generator_sample_t<G>>,
                "loom::GeneratorLoader: Collate must model loom::CollateFunction for the generators' sample type "
                "(the default DefaultCollate reads at::Tensor, pair<at::Tensor, target>, or structs with .data/.target "
                "through loom::DefaultProjection)");

 public:
  using Generator = G;
  using Sample = generator_sample_t<G>;
  using BatchType = collate_result_t<Collate, Sample>;
  static_assert(BatchTransfer<Transfer, BatchType>,
                "loom::GeneratorLoader: Transfer must model loom::BatchTransfer for the collated batch type");
  using StepType = GeneratorLoaderStep<BatchType>;

  /// Takes ownership of the generators (generator id = position in the vector) and starts the
  /// workers at once, so batches are being built before the first next().
  explicit GeneratorLoader(std::vector<G> generators, GeneratorLoaderOptions options = {}, Collate collate_fn = {},
                           Transfer transfer = {})
      : options_(std::move(options)) {
    const int n = static_cast<int>(generators.size());
    const int m = options_.num_devices;
    if (m < 1) throw InvalidArgument(fmt::format("GeneratorLoader: num_devices is {}, must be >= 1", m));
    detail::check_options(options_, n, m, "GeneratorLoader");
    assignment_ = assign(options_.assignment, n, m);
    delivered_ = options_.resume.samples;
    delivered_.resize(static_cast<std::size_t>(n), 0);
    step_ = options_.resume.steps;

    std::vector<std::unique_ptr<detail::GeneratorCursor<G>>> cursors;
    cursors.reserve(generators.size());
    for (auto& g : generators) cursors.push_back(std::make_unique<detail::GeneratorCursor<G>>(std::move(g)));
    std::vector<int> labels(static_cast<std::size_t>(m));
    for (int d = 0; d < m; ++d) labels[static_cast<std::size_t>(d)] = d;
    core_ = std::make_unique<Core>(detail::engine_config(options_, assignment_, std::move(labels)), std::move(cursors),
                                   collate_fn, transfer);
  }

  GeneratorLoader(const GeneratorLoader&) = delete;
  GeneratorLoader& operator=(const GeneratorLoader&) = delete;
  /// Stops and joins the workers (see stop()).
  ~GeneratorLoader() = default;

  /// The next step, or std::nullopt at the end of data. Blocks until every device's batch of the
  /// step is ready.
  /// Throws: loom::GeneratorError (a generator threw: naming it, its device and the sample
  ///         index), the collate function's or transfer's exception; the same exception again on later calls.
  std::optional<StepType> next() {
    if (error_) std::rethrow_exception(error_);
    if (finished_) return std::nullopt;
    const int m = core_->num_devices();
    core_->wait_step(step_);  // one wake-up for the whole step
    items_.resize(static_cast<std::size_t>(m));
    if (!core_->take_step(step_, items_)) {  // the stop event ends the schedule at this step
      const detail::StopEvent e = core_->event();
      finished_ = true;
      if (e.failure) {
        error_ = e.error;
        core_->abort();
        std::rethrow_exception(error_);
      }
      shortest_ = e.generator;
      return std::nullopt;
    }
    if (std::none_of(items_.begin(), items_.end(), [](const auto& item) { return item.has_value(); })) {
      finished_ = true;  // drain: every device ran dry
      return std::nullopt;
    }
    StepType step;
    step.index = step_;
    step.devices.reserve(static_cast<std::size_t>(m));
    try {
      for (int d = 0; d < m; ++d) {
        auto& item = items_[static_cast<std::size_t>(d)];
        if (!item) {  // drain: device d ran dry
          step.devices.push_back(DeviceBatch<BatchType>{
              .batch = core_->empty_batch(d, step_), .device = d, .step = step_, .generators = {}, .partial = true});
          continue;
        }
        core_->finish(d, *item);
        for (int g : item->generators) ++delivered_[static_cast<std::size_t>(g)];
        step.devices.push_back(DeviceBatch<BatchType>{.batch = std::move(item->batch),
                                                      .device = d,
                                                      .step = step_,
                                                      .generators = std::move(item->generators),
                                                      .partial = item->partial});
        item.reset();
      }
    } catch (...) {  // a transfer's finish() or empty() threw: the step is lost, so the schedule ends here
      for (auto& item : items_) item.reset();
      error_ = std::current_exception();
      finished_ = true;
      core_->abort();
      throw;
    }
    core_->release();
    ++step_;
    return step;
  }

  /// Range-for support: `for (auto& step : loader)`; each step is destroyed before the next is made.
  detail::NextIterator<GeneratorLoader, StepType> begin() {
    return detail::NextIterator<GeneratorLoader, StepType>(*this);
  }
  std::default_sentinel_t end() const noexcept { return {}; }

  /// How the schedule ended: steps, the generator that stopped it, delivered and unread samples
  /// per generator. Waits for the workers; with count_unread they may still be counting unread
  /// samples (at most count_unread_limit per generator), otherwise they have stopped already.
  /// Throws: loom::InvalidArgument before the end (next() has not returned std::nullopt yet);
  ///         the generator's error if the schedule failed.
  GeneratorLoaderReport report() {
    if (error_) std::rethrow_exception(error_);
    if (!finished_)
      throw InvalidArgument(
          fmt::format("GeneratorLoader::report(): the schedule has not ended (at step {}); call it after next() "
                      "returned std::nullopt",
                      step_));
    core_->join();
    GeneratorLoaderReport r;
    r.policy = options_.end;
    r.steps = step_;
    r.shortest_generator = options_.end == EndPolicy::stop_at_shortest ? shortest_ : -1;
    for (int d = 0; d < core_->num_devices(); ++d)
      for (int g : core_->generators(d)) r.generators.push_back(make_report(g, d));
    std::sort(r.generators.begin(), r.generators.end(),
              [](const auto& a, const auto& b) { return a.generator < b.generator; });
    return r;
  }

  /// Where the schedule stands (steps and samples delivered so far), to resume it later with
  /// GeneratorLoaderOptions::resume. Call it on the consumer's thread.
  [[nodiscard]] GeneratorLoaderState state() const { return {step_, delivered_, core_->num_devices()}; }

  /// Stops and joins the workers now (what the destructor does); next() then returns std::nullopt.
  void stop() noexcept {
    core_->abort();
    finished_ = true;
  }

  /// Generator ids of every device, `assignment()[d]` increasing (see loom::assign).
  [[nodiscard]] const std::vector<std::vector<int>>& assignment() const noexcept { return assignment_; }
  [[nodiscard]] int num_devices() const noexcept { return static_cast<int>(assignment_.size()); }

 private:
  using Core = detail::LoaderEngine<G, Collate, Transfer>;

  GeneratorReport make_report(int g, int d) const {
    const auto gi = static_cast<std::size_t>(g);
    GeneratorReport gr;
    gr.generator = g;
    gr.device = d;
    gr.delivered = delivered_[gi];
    gr.unread = core_->position(g) - delivered_[gi];
    gr.ended = core_->ended(g);
    gr.unread_exact = core_->counted(g);
    return gr;
  }

  GeneratorLoaderOptions options_;
  std::vector<std::vector<int>> assignment_;
  std::vector<std::int64_t> delivered_;
  std::int64_t step_ = 0;
  bool finished_ = false;
  int shortest_ = -1;
  std::exception_ptr error_;
  std::unique_ptr<Core> core_;
  std::vector<std::optional<typename Core::Item>> items_;  // next()'s batches of one step, by device
};

}  // namespace loom
