// loom/schedule/rank_generator_loader.hpp — RankGeneratorLoader: the per-rank mode. Rank r of world
// size W runs the generators the assignment gives device r, and all ranks agree on every step.
//
// Example (16 generators over 8 ranks: rank r runs generators 2r and 2r+1):
//   loom::run([&](loom::ProcessGroup& pg) {
//     loom::RankGeneratorLoader loader(pg, 16, [](int g) { return Sim(g); }, {.end = loom::EndPolicy::drain});
//     for (auto& db : loader) {                            // db.device == rank, db.step == k
//       auto mb = accumulator.micro_batch(db.batch);       // 2 x (sample shape); 0 rows when this rank ran dry
//       if (db.batch.num_samples > 0) loss_of(db.batch).backward();
//       if (mb.finish()) opt.step();                       // every rank runs the same number of steps
//       opt.zero_grad();
//     }
//   }, {.nproc = 8});
//
// Agreement: at most once per step (fewer when batches are prefetched), every rank contributes
// [ready batches, end/failure code, generator, sample, config] to one all_gather of 8 int64; from
// the same numbers every rank decides the same thing: how many steps all can take without talking
// again (the minimum of the ready counts), or that the loading ended (stop_at_shortest: some
// rank's generator ended; drain: every rank ran dry), or that a rank's generator threw. So no
// rank waits alone at a later collective, and a rank that is slow or dead shows up as the
// communicator's loom::TimeoutError. A failure costs one more all_gather that carries the
// message (up to 511 bytes) to every rank.
//
// Collectives: the agreement runs on the consumer's thread, on the same communicator as the
// training loop's collectives, and in the same order on every rank (decisions are identical);
// its tensors live on the communicator's device (comm.device()).
//
// Source: the agreement on "who still has data" follows DDP's join context (a per-step
// all-reduce of a has-data flag), batched over the steps that are already prefetched.
#pragma once

#include <concepts>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <loom/collate/transfer.hpp>
#include <loom/comm/communicator.hpp>
#include <loom/comm/host_values.hpp>
#include <loom/detail/exception_text.hpp>
#include <loom/error.hpp>
#include <loom/schedule/assign.hpp>
#include <loom/schedule/collate_fn.hpp>
#include <loom/schedule/detail/cursor.hpp>
#include <loom/schedule/detail/engine.hpp>
#include <loom/schedule/detail/next_iterator.hpp>
#include <loom/schedule/generator.hpp>
#include <loom/schedule/options.hpp>
#include <loom/schedule/results.hpp>
#include <loom/trace/recorder.hpp>

namespace loom {

/// The per-rank mode: this rank's generators, one batch per step, steps agreed over all ranks.
///
/// Example: see the file comment.
/// Shape: DeviceBatch::batch is Collate's result (DefaultCollate: loom::Batch, data R x (sample shape),
///        R = this rank's generators still running; R = 0 and weight 0 when this rank ran dry).
/// Throws: loom::InvalidArgument from the constructor (bad options, more ranks than generators,
///         a factory result of the wrong type); from next(): loom::GeneratorError on the rank whose
///         generator threw, loom::RemoteError on the other ranks (naming the rank, generator and
///         message), loom::ConfigError when ranks disagree on the number of generators, the policy
///         or the step, and the communicator's errors (loom::TimeoutError when a rank stops
///         answering).
/// Source: see the file comment.
template <SampleGenerator G, Communicator C, class Collate = DefaultCollate<>, class Transfer = HostTransfer>
class RankGeneratorLoader {
  static_assert(SampleGenerator<G>,
                "loom::RankGeneratorLoader: G must model loom::SampleGenerator (a callable returning "
                "std::optional<Sample>, or an input range)");
  static_assert(Communicator<C>, "loom::RankGeneratorLoader: C must model loom::Communicator");
  static_assert(CollateFunction<Collate, generator_sample_t<G>>,
                "loom::RankGeneratorLoader: Collate must model loom::CollateFunction for the generators' sample type");

 public:
  using Generator = G;
  using Sample = generator_sample_t<G>;
  using BatchType = collate_result_t<Collate, Sample>;
  static_assert(BatchTransfer<Transfer, BatchType>,
                "loom::RankGeneratorLoader: Transfer must model loom::BatchTransfer for the collated batch type");
  using Item = DeviceBatch<BatchType>;

  /// Builds only this rank's generators with `make(g)` for its generator ids g, then starts the worker.
  template <class MakeGenerator>
  requires std::invocable<MakeGenerator&, int> && std::same_as<std::invoke_result_t<MakeGenerator&, int>, G>
  RankGeneratorLoader(C& comm, int num_generators, MakeGenerator make, GeneratorLoaderOptions options = {},
                      Collate collate_fn = {}, Transfer transfer = {})
      : comm_(comm), options_(std::move(options)), num_generators_(num_generators) {
    std::vector<std::unique_ptr<detail::GeneratorCursor<G>>> cursors(
        static_cast<std::size_t>(std::max(num_generators, 0)));
    prepare();
    for (int g : generators_)
      cursors[static_cast<std::size_t>(g)] = std::make_unique<detail::GeneratorCursor<G>>(make(g));
    start(std::move(cursors), collate_fn, transfer);
  }

  /// Takes all N generators (id = position), keeps this rank's and destroys the others.
  RankGeneratorLoader(C& comm, std::vector<G> generators, GeneratorLoaderOptions options = {}, Collate collate_fn = {},
                      Transfer transfer = {})
      : comm_(comm), options_(std::move(options)), num_generators_(static_cast<int>(generators.size())) {
    std::vector<std::unique_ptr<detail::GeneratorCursor<G>>> cursors(generators.size());
    prepare();
    for (int g : generators_)
      cursors[static_cast<std::size_t>(g)] =
          std::make_unique<detail::GeneratorCursor<G>>(std::move(generators[static_cast<std::size_t>(g)]));
    generators.clear();
    start(std::move(cursors), collate_fn, transfer);
  }

  RankGeneratorLoader(const RankGeneratorLoader&) = delete;
  RankGeneratorLoader& operator=(const RankGeneratorLoader&) = delete;
  ~RankGeneratorLoader() = default;

  /// This rank's batch of the next step, or std::nullopt once all ranks agreed the schedule ended.
  /// Every rank must call next() the same number of times (it may run a collective).
  /// Throws: see the class comment; the same exception again on later calls.
  std::optional<Item> next() {
    if (error_) std::rethrow_exception(error_);
    if (finished_) return std::nullopt;
    if (agreed_ == 0) {
      agree();
      if (finished_) return std::nullopt;
    }
    LOOM_ASSERT(agreed_ > 0);
    --agreed_;
    try {
      std::optional<Item> out = take();
      ++step_;
      return out;
    } catch (...) {  // a transfer's finish() or empty() threw: the step is lost, so the schedule ends here
      error_ = std::current_exception();
      finished_ = true;
      core_->abort();
      throw;
    }
  }

  /// Range-for support: `for (auto& db : loader)`.
  detail::NextIterator<RankGeneratorLoader, Item> begin() {
    return detail::NextIterator<RankGeneratorLoader, Item>(*this);
  }
  std::default_sentinel_t end() const noexcept { return {}; }

  /// How the schedule ended (this rank's generators); shortest_generator is the same on every rank.
  /// Waits for this rank's workers (with count_unread: their counting, at most count_unread_limit
  /// samples per generator). No collective.
  /// Throws: loom::InvalidArgument before the end; the schedule's error if it failed.
  GeneratorLoaderReport report() {
    if (error_) std::rethrow_exception(error_);
    if (!finished_)
      throw InvalidArgument(
          fmt::format("RankGeneratorLoader::report(): the schedule has not ended (rank {} at step {})", rank_, step_));
    core_->join();
    GeneratorLoaderReport r;
    r.policy = options_.end;
    r.steps = step_;
    r.shortest_generator = options_.end == EndPolicy::stop_at_shortest ? shortest_ : -1;
    for (int g : generators_) {
      GeneratorReport gr;
      gr.generator = g;
      gr.device = rank_;
      gr.delivered = delivered_[static_cast<std::size_t>(g)];
      gr.unread = core_->position(g) - gr.delivered;
      gr.ended = core_->ended(g);
      gr.unread_exact = core_->counted(g);
      r.generators.push_back(gr);
    }
    return r;
  }

  /// This rank's position (steps, samples per generator id; other ranks' entries are passed
  /// through from the resume state), to resume with GeneratorLoaderOptions::resume.
  [[nodiscard]] GeneratorLoaderState state() const { return {step_, delivered_, world_}; }

  /// Stops and joins this rank's worker. Only for leaving early on every rank (or on error): a
  /// later next() returns std::nullopt without a collective.
  void stop() noexcept {
    core_->abort();
    finished_ = true;
  }

  /// This rank's generator ids, increasing (loom::generators_of for device = rank).
  [[nodiscard]] const std::vector<int>& generators() const noexcept { return generators_; }
  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int world_size() const noexcept { return world_; }

 private:
  using Core = detail::LoaderEngine<G, Collate, Transfer>;
  static constexpr int kFields = 8;
  static constexpr int kMessageWords = 64;  // 512 bytes for a failure message

  enum Code : std::int64_t { kReady = 0, kEnded = 1, kFailed = 2 };

  void prepare() {
    rank_ = comm_.rank();
    world_ = comm_.world_size();
    if (options_.num_devices != 1)
      throw InvalidArgument(
          fmt::format("RankGeneratorLoader: num_devices is {}, must be 1 (a rank feeds its own device; the {} "
                      "devices are the world size)",
                      options_.num_devices, world_));
    detail::check_options(options_, num_generators_, world_, "RankGeneratorLoader");
    generators_ = generators_of(options_.assignment, num_generators_, world_, rank_);
    delivered_ = options_.resume.samples;
    delivered_.resize(static_cast<std::size_t>(num_generators_), 0);
    step_ = options_.resume.steps;
  }

  void start(std::vector<std::unique_ptr<detail::GeneratorCursor<G>>> cursors, const Collate& collate_fn,
             const Transfer& transfer) {
    core_ = std::make_unique<Core>(detail::engine_config(options_, {generators_}, {rank_}), std::move(cursors),
                                   collate_fn, transfer);
  }

  std::vector<std::vector<std::int64_t>> all_gather(const std::vector<std::int64_t>& mine) {
    trace::Scope scope(comm_, trace::Context::generator_loader);
    return detail::all_gather_int64(comm_, std::span<const std::int64_t>(mine));
  }

  // One agreement round (see the file comment). Sets agreed_, dry_, or finished_, or throws.
  void agree() {
    const auto r = core_->wait(0, step_);
    std::int64_t ready = 0, code = kReady, generator = -1, sample = -1;
    std::exception_ptr local_error;
    if (r == Core::Resolved::batch) {
      ready = static_cast<std::int64_t>(core_->ready(0));
    } else if (r == Core::Resolved::dry) {
      code = kEnded;
    } else {
      const detail::StopEvent e = core_->event();
      code = e.failure ? kFailed : kEnded;
      generator = e.generator;
      sample = e.sample;
      local_error = e.error;
    }
    const std::vector<std::int64_t> mine = {ready,
                                            code,
                                            generator,
                                            sample,
                                            num_generators_,
                                            static_cast<std::int64_t>(options_.assignment.kind),
                                            static_cast<std::int64_t>(options_.end),
                                            step_};
    const auto all = all_gather(mine);
    for (int q = 0; q < world_; ++q) {
      const auto& row = all[static_cast<std::size_t>(q)];
      LOOM_ASSERT(static_cast<int>(row.size()) == kFields);
      if (!std::equal(row.begin() + 4, row.end(), mine.begin() + 4))
        fail_with(std::make_exception_ptr(ConfigError(fmt::format(
            "RankGeneratorLoader: ranks disagree on [generators, assignment, end policy, step]: rank {} has [{}], rank "
            "{} has [{}]",
            rank_, fmt::join(mine.begin() + 4, mine.end(), ", "), q, fmt::join(row.begin() + 4, row.end(), ", ")))));
    }
    // The first rank whose step is not ready decides, if its event stops the schedule.
    int stopper = -1;
    for (int q = 0; q < world_ && stopper < 0; ++q) {
      const auto c = all[static_cast<std::size_t>(q)][1];
      if (c == kFailed || (c == kEnded && options_.end == EndPolicy::stop_at_shortest)) stopper = q;
    }
    if (stopper >= 0 && all[static_cast<std::size_t>(stopper)][1] == kFailed) {
      // every rank takes part in the message exchange, then throws
      std::vector<std::int64_t> words(kMessageWords, 0);
      if (stopper == rank_) {
        const std::string text = detail::exception_text(local_error);
        std::memcpy(words.data(), text.data(), std::min(text.size(), sizeof(std::int64_t) * kMessageWords - 1));
      }
      const auto messages = all_gather(words);
      const auto& w = messages[static_cast<std::size_t>(stopper)];
      std::string text(reinterpret_cast<const char*>(w.data()), sizeof(std::int64_t) * w.size());
      text.resize(std::strlen(text.c_str()));
      const auto& row = all[static_cast<std::size_t>(stopper)];
      if (stopper == rank_) fail_with(local_error);
      fail_with(std::make_exception_ptr(
          RemoteError(fmt::format("schedule: rank {} stopped at step {}: its generator {} failed at sample {}: {}",
                                  stopper, step_, row[2], row[3], text))));
    }
    if (stopper >= 0) {  // stop_at_shortest: some rank's generator ended at this step
      shortest_ = static_cast<int>(all[static_cast<std::size_t>(stopper)][2]);
      finish();
      return;
    }
    std::int64_t agreed = -1;
    for (int q = 0; q < world_; ++q) {
      const auto& row = all[static_cast<std::size_t>(q)];
      if (row[1] == kEnded) continue;  // drain: a dry rank delivers empty batches
      agreed = agreed < 0 ? row[0] : std::min(agreed, row[0]);
    }
    if (agreed < 0) {  // drain: every rank ran dry
      finish();
      return;
    }
    dry_ = code == kEnded;
    agreed_ = agreed;
  }

  // This rank's batch of the agreed step step_ (an empty one when this rank ran dry).
  std::optional<Item> take() {
    std::optional<Item> out;
    if (dry_) {
      out.emplace(Item{
          .batch = core_->empty_batch(0, step_), .device = rank_, .step = step_, .generators = {}, .partial = true});
    } else {
      const auto r = core_->wait(0, step_);
      LOOM_ASSERT(r == Core::Resolved::batch, "an agreed step is ready locally");
      auto item = core_->pop(0);
      core_->release();
      for (int g : item.generators) ++delivered_[static_cast<std::size_t>(g)];
      out.emplace(Item{.batch = std::move(item.batch),
                       .device = rank_,
                       .step = step_,
                       .generators = std::move(item.generators),
                       .partial = item.partial});
    }
    return out;
  }

  void finish() {
    finished_ = true;
    core_->stop_at(step_);
  }

  [[noreturn]] void fail_with(std::exception_ptr e) {
    error_ = e;
    finished_ = true;
    core_->abort();
    std::rethrow_exception(e);
  }

  C& comm_;
  GeneratorLoaderOptions options_;
  int num_generators_ = 0;
  int rank_ = 0;
  int world_ = 1;
  std::vector<int> generators_;
  std::vector<std::int64_t> delivered_;
  std::int64_t step_ = 0;
  std::int64_t agreed_ = 0;
  bool dry_ = false;
  bool finished_ = false;
  int shortest_ = -1;
  std::exception_ptr error_;
  std::unique_ptr<Core> core_;
};

template <class C, class MakeGenerator>
RankGeneratorLoader(C&, int, MakeGenerator) -> RankGeneratorLoader<std::invoke_result_t<MakeGenerator&, int>, C>;
template <class C, class MakeGenerator>
RankGeneratorLoader(C&, int, MakeGenerator, GeneratorLoaderOptions)
    -> RankGeneratorLoader<std::invoke_result_t<MakeGenerator&, int>, C>;
template <class C, class G>
RankGeneratorLoader(C&, std::vector<G>) -> RankGeneratorLoader<G, C>;
template <class C, class G>
RankGeneratorLoader(C&, std::vector<G>, GeneratorLoaderOptions) -> RankGeneratorLoader<G, C>;

}  // namespace loom
