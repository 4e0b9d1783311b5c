// loom/train/loader.hpp — BatchLoader: a GlobalBatchSampler, a fetch function and collation in one
// object, handing the training loop collated batches on the process group's device.
//
// One sentence: `loom::BatchLoader loader(pg, shapes, fetch, {.max_samples = 16, .batches_per_step = 4})`
// plans world-size-invariant optimizer steps over the dataset's shapes, and `load(item)` turns one
// of the sampler's items into a Batch (samples fetched, padded to the planned shape, moved to the
// device) — the input side of loom::Trainer::epoch.
//
// Example:
//   std::vector<std::pair<at::Tensor, int64_t>> data = ...;                 // (C x H x W image, label)
//   loom::BatchLoader loader(pg, shapes, [&](int64_t i) { return data[i]; },
//                            {.seed = 1, .max_samples = 32, .batches_per_step = 2});
//   for (loom::Batch& b : trainer.epoch(loader, epoch)) { ... }             // see loom/train/trainer.hpp
//
// Example (CUDA copies on a stream of their own):
//   loom::BatchLoader loader(pg, shapes, fetch, plan, {}, loom::DefaultProjection{}, loom::cuda::CudaTransfer{});
//
// Device: batches are collated on the CPU, then handed to the transfer (loom::BatchTransfer,
//   loom/collate/transfer.hpp): load() calls `transfer.start(b, label)` and then
//   `transfer.finish(b, label, ticket)`, with label = the loader's device's index (0 for the CPU or
//   a device without an index). The default, loom::DeviceTransfer, goes to the process group's
//   device (or LoaderOptions::device) with Tensor::to; loom::cuda::CudaTransfer (its own copy
//   stream and pinned staging) plugs in as the third template parameter. When the device is a GPU,
//   batches are collated into pinned memory and the default copies with non_blocking = true (the
//   copy overlaps with the host's next work; the pinned buffer lives until the copy finished:
//   LibTorch's host allocator records the stream). With a BufferPool of your own
//   (LoaderOptions::collate.pool) the default copies synchronously instead: a pool hands a buffer
//   out again as soon as the last host tensor viewing it is gone, which is when load() / next() returns,
//   and an asynchronous copy could still be reading it.
// Shape: as loom::collate_sampled (Batch::data N x planned padded shape, targets); Batch::mask
//   (bool, true = real) whenever the plan pads (GlobalBatchOptions::pad), or when collate.mask asks.
//   Each fetched sample must have its declared shape (shapes[i]) exactly.
// Background loading (LoaderOptions::num_workers > 0): that many threads fetch and collate the
//   batches ahead of the loop, at most num_workers * prefetch_factor batches ahead; next() hands
//   them out in the sampler's order and starts and finishes their transfer on the calling thread.
//   The order, the batches and every sample's single appearance are those of num_workers = 0: the
//   workers follow a copy of the sampler, and the loader's own sampler advances only as next()
//   hands a batch out, so sampler().cursor() (and a checkpoint) names exactly the batches the loop
//   has received. begin_epoch(), resume() and the destructor wait for the running loads and drop
//   the rest. A sampler moved by hand (sampler().resume(...)) is noticed at the next next(), which
//   drops what the workers loaded and continues from the sampler's position.
//   Thread safety: with workers, `fetch` and the projection are called from the worker threads,
//   several at once: they must be safe to call concurrently (reading a const container or file is;
//   a shared decoder, cursor or random generator is not), as must CollateOptions::allocate. A fetch
//   that returns views of one reused buffer (a decoder's output) needs one buffer per thread
//   (thread_local): a buffer the threads share is rewritten by one while another's sample is being
//   copied; a worker that finds another worker's last sample rewritten at the address its own fetch
//   returned throws loom::InvalidArgument (detail/shared_buffer_check.hpp). fetch(i)
//   must depend on i only (and on state that stays fixed during the epoch): it runs up to
//   num_workers * prefetch_factor batches before the loop reaches them. Thread-local settings of
//   the training thread (a NoGradGuard, InferenceMode, at::set_num_threads) do not reach the workers.
//   Memory: up to num_workers * prefetch_factor collated batches wait, plus the one being handed out.
//   Source: torch.utils.data.DataLoader(num_workers, prefetch_factor, persistent_workers=True),
//   with threads instead of processes (a C++ fetch holds no interpreter lock).
// Throws: the sampler's errors, named after the BatchLoader call that met them ("BatchLoader: ",
//   "BatchLoader::begin_epoch: ", "BatchLoader::resume: " before the sampler's text); the fetch
//   function's and collation's errors (naming the sample index); a
//   fetched sample whose shape is not its declared one (loom::InvalidArgument naming both). With
//   workers, an error on a worker reaches the thread calling next() when that batch is due, as
//   loom::Error (loom::InvalidArgument for a sample of another shape) naming the step, the batch's
//   samples and the fetch(i) that threw (when it was the fetch), followed by the original text.
// Source: torch.utils.data.DataLoader with pin_memory=True and a batch_sampler.
#pragma once

#include <atomic>
#include <concepts>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/Device.h>
#include <c10/core/DeviceGuard.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <loom/collate/batch.hpp>
#include <loom/collate/collator.hpp>
#include <loom/collate/sample.hpp>
#include <loom/collate/transfer.hpp>
#include <loom/comm/communicator.hpp>
#include <loom/detail/exception_text.hpp>
#include <loom/error.hpp>
#include <loom/sample/global_batch.hpp>
#include <loom/sample/sampled_batch.hpp>
#include <loom/train/detail/shared_buffer_check.hpp>
#include <loom/train/detail/worker_pool.hpp>

namespace loom {

/// Options of BatchLoader beyond the plan; use with designated initializers.
struct LoaderOptions {
  CollateOptions collate{};  ///< pad value, mask, pool / allocator (padded_shape comes from the plan);
                             ///< a plan that pads (GlobalBatchOptions::pad) always gets Batch::mask,
                             ///< as padded buckets do by default

  std::optional<c10::Device> device{};  ///< where batches go; default: the process group's device

  /// Threads that fetch and collate batches ahead of the loop (see the file comment); 0: next()
  /// fetches and collates on the calling thread. PyTorch's DataLoader(num_workers).
  int num_workers = 0;
  /// Batches loaded ahead per worker when num_workers > 0 (up to num_workers * prefetch_factor
  /// collated batches wait in host memory). PyTorch's DataLoader(prefetch_factor), default 2 as there.
  int prefetch_factor = 2;
};

/// Sampler + fetch + collate. See the file comment.
///
/// Example: see the file comment.
/// Throws: see the file comment.
template <class Fetch, class Projection = DefaultProjection, class Transfer = DeviceTransfer>
class BatchLoader {
  static_assert(std::invocable<Fetch&, int64_t>,
                "loom::BatchLoader: the fetch function must be callable as fetch(int64_t index) and return one sample "
                "(an at::Tensor, a (data, target) pair or 2-tuple, or a struct with .data and .target)");
  static_assert(SampleProjection<Projection, std::remove_cvref_t<std::invoke_result_t<Fetch&, int64_t>>>,
                "loom::BatchLoader: the projection cannot read the sample fetch(i) returns: projection.data(sample) "
                "must give an at::Tensor and projection.target(sample) a tensor, an integer or loom::NoTarget (the "
                "default projection reads a tensor, a (data, target) pair or 2-tuple, or a struct with .data and "
                ".target); a floating-point target (regression) goes in a tensor: {x, torch::tensor({y})}");
  static_assert(BatchTransfer<Transfer, Batch>,
                "loom::BatchLoader: the transfer must model loom::BatchTransfer<Transfer, loom::Batch> "
                "(loom/collate/transfer.hpp): a Ticket type, start(batch, label) and finish(batch, label, ticket)");

 public:
  /// Plans over `shapes` (shapes[i]: sample i's shape) for `comm`'s world size and rank; batches
  /// go to the loader's device with the default transfer (DeviceTransfer to that device, or a
  /// default-constructed Transfer).
  template <Communicator C>
  BatchLoader(const C& comm, std::vector<std::vector<int64_t>> shapes, Fetch fetch, GlobalBatchOptions plan = {},
              LoaderOptions options = {}, Projection projection = {})
      : sampler_(named("BatchLoader", [&] { return GlobalBatchSampler(comm, std::move(shapes), std::move(plan)); })),
        fetch_(std::move(fetch)),
        options_(std::move(options)),
        projection_(std::move(projection)),
        device_(options_.device.value_or(comm.device())),
        transfer_(default_transfer(device_, options_.collate.pool != nullptr)) {
    prepare_collate();
  }

  /// As above, with a transfer of the user's (e.g. loom::cuda::CudaTransfer).
  template <Communicator C>
  BatchLoader(const C& comm, std::vector<std::vector<int64_t>> shapes, Fetch fetch, GlobalBatchOptions plan,
              LoaderOptions options, Projection projection, Transfer transfer)
      : sampler_(named("BatchLoader", [&] { return GlobalBatchSampler(comm, std::move(shapes), std::move(plan)); })),
        fetch_(std::move(fetch)),
        options_(std::move(options)),
        projection_(std::move(projection)),
        device_(options_.device.value_or(comm.device())),
        transfer_(std::move(transfer)) {
    prepare_collate();
  }

  /// Waits for the workers' running loads (LoaderOptions::num_workers) and stops them.
  ~BatchLoader() { background_.stop(); }
  /// A copy starts without workers (its own start at its first next()); moving or assigning a
  /// loader first stops the workers of both sides.
  BatchLoader(const BatchLoader&) = default;
  BatchLoader(BatchLoader&&) = default;
  BatchLoader& operator=(const BatchLoader&) = default;
  BatchLoader& operator=(BatchLoader&&) = default;

  /// The collated batch of one sampler item (an idle item gives an empty Batch with weight 0), on
  /// the calling thread whatever num_workers says.
  /// Throws: loom::InvalidArgument when a fetched sample's shape is not its declared one
  ///         (shapes[i]), naming the index and both shapes; collation's errors.
  [[nodiscard]] Batch load(const SampledBatch& item) {
    int64_t fetching = -1;
    Batch b = collate_item(item, sampler_.shapes(), fetching);
    deliver(b);
    return b;
  }

  /// This rank's next batch of the epoch begun by begin_epoch (BatchSource, loom/train/batch_source.hpp):
  /// the sampler's next item, loaded (by a worker ahead of time when num_workers > 0); an idle item
  /// gives an idle Batch. std::nullopt at the epoch's end.
  /// Throws: as load(); with workers, loom::Error for a batch a worker failed to load (see the file comment).
  [[nodiscard]] std::optional<Batch> next() {
    if (options_.num_workers == 0) {
      auto item = sampler_.next();
      if (!item) return std::nullopt;
      return load(*item);
    }
    Background& bg = background_;
    if (!bg.lookahead) bg.start(sampler_, options_.num_workers);
    auto item = sampler_.next();
    if (!item) {
      bg.drain();
      return std::nullopt;
    }
    std::optional<std::future<Batch>> loading;
    try {
      refill();
      if (!bg.pending.empty() && bg.pending.front().first == *item) {
        loading = std::move(bg.pending.front().second);
        bg.pending.pop_front();
        refill();  // keeps the workers busy while this batch finishes
      }
    } catch (...) {  // no room for another load: this batch loads here, the workers start again at the next call
      if (loading) loading->wait();
      loading.reset();
    }
    if (!loading) {
      // The sampler was moved by hand since the workers started (or queueing failed): load this
      // item here; the next call starts the workers from the sampler's position.
      bg.drain();
      return load(*item);
    }
    Batch b;
    try {
      b = loading->get();
    } catch (...) {
      bg.drain();
      throw;
    }
    deliver(b);
    return b;
  }

  /// Not a range: `for (loom::Batch& b : loader)` stops at one static_assert (the epoch loop goes
  /// through trainer.epoch(loader, e), which owns the step protocol). std::ranges::range<BatchLoader>
  /// is false: NotARange is no iterator.
  struct NotARange {
    Batch& operator*() const;
    NotARange& operator++();
    bool operator!=(const NotARange&) const;
  };
  template <class T = void>
  NotARange begin() {
    static_assert(!std::is_void_v<T> && std::is_void_v<T>,
                  "loom::BatchLoader is not a range: loop with `for (loom::Batch& b : trainer.epoch(loader, e))` "
                  "(loom/train/trainer.hpp), or call loader.begin_epoch(e) and then loader.next() until std::nullopt");
    return {};
  }
  template <class T = void>
  NotARange end() {
    return {};
  }

  [[nodiscard]] GlobalBatchSampler& sampler() noexcept { return sampler_; }
  /// Whether batches carry Batch::mask (see LoaderOptions).
  [[nodiscard]] bool mask() const noexcept { return options_.collate.mask; }
  [[nodiscard]] const GlobalBatchSampler& sampler() const noexcept { return sampler_; }
  /// Where batches are delivered.
  [[nodiscard]] c10::Device device() const noexcept { return device_; }
  /// The transfer every batch goes through.
  [[nodiscard]] const Transfer& transfer() const noexcept { return transfer_; }

  /// Continues at a saved cursor: the next Trainer::epoch(loader, cursor.epoch) starts at its step
  /// instead of the epoch's first (the same as loader.sampler().resume(cursor)).
  /// Throws as GlobalBatchSampler::resume.
  void resume(const GlobalCursor& cursor) {
    background_.drain();
    named("BatchLoader::resume", [&] { sampler_.resume(cursor); });
  }

  /// Deals the rest of epoch `epoch` from step `step` over `world_size` ranks as rank `rank`
  /// (GlobalBatchSampler::reshard); loads queued for the old deal are dropped. Used by Trainer after
  /// a rank died (docs/elastic.md).
  /// Throws as GlobalBatchSampler::reshard.
  void reshard(int rank, int world_size, int64_t epoch, int64_t step) {
    background_.drain();
    buffer_check_->reset();
    named("BatchLoader::reshard", [&] { sampler_.reshard(rank, world_size, epoch, step); });
  }

  /// Prepares epoch `epoch` (rewinds, unless a resume pointed into it); used by Trainer::epoch.
  /// Throws: loom::InvalidArgument when a resume pointed into another epoch (GlobalBatchSampler::set_epoch).
  void begin_epoch(int64_t epoch) {
    background_.drain();
    buffer_check_->reset();
    named("BatchLoader::begin_epoch", [&] { sampler_.set_epoch(epoch); });
  }

 private:
  // The background workers' state (num_workers > 0). Declared first among the members, so a move
  // stops the source's workers before the members their loads read (fetch_, projection_, options_)
  // move away; ~BatchLoader stops them before any member is destroyed.
  struct Background {
    std::unique_ptr<detail::WorkerPool> pool;
    std::optional<GlobalBatchSampler> lookahead;                      // the sampler's copy the workers' items come from
    std::deque<std::pair<SampledBatch, std::future<Batch>>> pending;  // in the sampler's order
    std::shared_ptr<std::atomic<bool>> cancelled;                     // this round's loads: skip

    Background() = default;
    Background(const Background&) noexcept {}
    Background(Background&& other) noexcept { other.stop(); }
    Background& operator=(const Background& other) noexcept {
      if (this != &other) stop();
      return *this;
    }
    Background& operator=(Background&& other) noexcept {
      stop();
      other.stop();
      return *this;
    }
    ~Background() { stop(); }

    // Workers follow a copy of `sampler` from its position.
    void start(const GlobalBatchSampler& sampler, int workers) {
      if (!pool) pool = std::make_unique<detail::WorkerPool>(workers);
      lookahead.emplace(sampler);
      cancelled = std::make_shared<std::atomic<bool>>(false);
    }
    // Loads not started are skipped, running ones awaited; their results and errors are dropped.
    void drain() noexcept {
      if (cancelled) cancelled->store(true);
      for (auto& p : pending) p.second.wait();
      pending.clear();
      lookahead.reset();
      cancelled.reset();
    }
    void stop() noexcept {
      drain();
      pool.reset();
    }
  };

  // Runs f; the sampler's refusals (loom::InvalidArgument) name `where`, the BatchLoader call the user wrote.
  template <class F>
  static decltype(auto) named(const char* where, F&& f) {
    try {
      return f();
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(fmt::format("{}: {}", where, detail::first_line(e.what())));
    }
  }

  // Queues loads until num_workers * prefetch_factor batches are pending or the epoch is planned out.
  void refill() {
    Background& bg = background_;
    const auto depth =
        static_cast<std::size_t>(options_.num_workers) * static_cast<std::size_t>(options_.prefetch_factor);
    while (bg.pending.size() < depth) {
      auto item = bg.lookahead->next();
      if (!item) return;
      const GlobalBatchSampler* plan = &*bg.lookahead;
      auto job = [this, plan, item = *item, cancelled = bg.cancelled]() -> Batch {
        if (cancelled->load()) return Batch{};
        // Pinned host memory is allocated on the loader's GPU (as DataLoader's pin-memory thread
        // sets its device): a new thread would otherwise start on device 0.
        c10::OptionalDeviceGuard on_device;
        if (device_.is_cuda()) on_device.reset_device(device_);
        int64_t fetching = -1;
        auto text = [&] {
          return fmt::format("BatchLoader: a worker thread failed to load step {} (samples [{}]){}: {}", item.step,
                             fmt::join(item.indices, ", "),
                             fetching >= 0 ? fmt::format(", in fetch({})", fetching) : std::string(),
                             detail::first_line(detail::exception_text(std::current_exception())));
        };
        try {
          return collate_item(item, plan->shapes(), fetching, /*on_worker=*/true);
        } catch (const InvalidArgument&) {  // a sample of another shape: the type loading here throws
          throw InvalidArgument(text());
        } catch (...) {
          throw Error(text());
        }
      };
      bg.pending.emplace_back(*item, bg.pool->submit(std::move(job)));
    }
  }

  // Fetches (checking declared shapes) and collates `item` (on a worker, or in load()); `fetching` holds
  // the index while fetch(index) runs, -1 otherwise.
  // A worker's samples also go through the shared-buffer check (detail/shared_buffer_check.hpp).
  Batch collate_item(const SampledBatch& item, const std::vector<std::vector<int64_t>>& shapes, int64_t& fetching,
                     bool on_worker = false) {
    auto checked = [&](int64_t i) {
      fetching = i;
      auto sample = fetch_(i);
      fetching = -1;
      check_declared_shape(shapes, i, projection_.data(sample));
      if (on_worker) buffer_check_->fetched(i, projection_.data(sample));
      return sample;
    };
    return collate_sampled(item, checked, options_.collate, projection_);
  }

  // Hands a collated batch to the transfer.
  void deliver(Batch& b) {
    auto ticket = transfer_.start(b, label());
    transfer_.finish(b, label(), ticket);
  }

  // The default transfer: to `device`, blocking when a user's pool owns the host buffers.
  static Transfer default_transfer(c10::Device device, bool user_pool) {
    if constexpr (std::same_as<Transfer, DeviceTransfer>) {
      return DeviceTransfer({.type = device.type(), .devices = {}, .non_blocking = !user_pool});
    } else {
      static_assert(std::default_initializable<Transfer>,
                    "loom::BatchLoader: pass the transfer to the constructor (it is not default-constructible)");
      return Transfer{};
    }
  }

  // Padded plans get a mask (as padded buckets); a GPU device gets pinned host batches.
  void prepare_collate() {
    if (options_.num_workers < 0)
      throw InvalidArgument(
          fmt::format("BatchLoader: LoaderOptions::num_workers = {} must be >= 0 (0 loads on the training thread)",
                      options_.num_workers));
    if (options_.num_workers > 0 && options_.prefetch_factor < 1)
      throw InvalidArgument(fmt::format(
          "BatchLoader: LoaderOptions::prefetch_factor = {} must be >= 1 with num_workers = {} (batches loaded "
          "ahead per worker)",
          options_.prefetch_factor, options_.num_workers));
    if (!sampler_.options().pad.empty()) options_.collate.mask = true;
    if (device_.is_cuda() && !options_.collate.allocate && !options_.collate.pool)
      options_.collate.allocate = [](c10::IntArrayRef sizes, c10::ScalarType dtype) {
        return at::empty(sizes, at::TensorOptions(dtype).pinned_memory(true));
      };
  }

  // The transfer's label of this loader's device (see the file comment).
  [[nodiscard]] int label() const noexcept { return device_.has_index() ? device_.index() : 0; }

  // The plan batches and pads by the declared shapes: a sample of another shape would be padded
  // (or cut) silently.
  static void check_declared_shape(const std::vector<std::vector<int64_t>>& shapes, int64_t i, const at::Tensor& data) {
    const auto& declared = shapes[static_cast<std::size_t>(i)];
    if (data.sizes() != c10::IntArrayRef(declared))
      throw InvalidArgument(fmt::format(
          "BatchLoader: fetch({}) returned a sample of shape [{}], but its declared shape (shapes[{}]) is [{}]; the "
          "plan batches and pads samples by their declared shapes, so declare each sample's real shape",
          i, fmt::join(data.sizes(), ", "), i, fmt::join(declared, ", ")));
  }

  Background background_;  // first: see Background
  std::unique_ptr<detail::SharedBufferCheck> buffer_check_ = std::make_unique<detail::SharedBufferCheck>();
  GlobalBatchSampler sampler_;
  Fetch fetch_;
  LoaderOptions options_;
  Projection projection_;
  c10::Device device_;
  Transfer transfer_;
};

}  // namespace loom
