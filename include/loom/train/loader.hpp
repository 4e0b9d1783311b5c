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
//   out again as soon as the last host tensor viewing it is gone, which is when load() returns,
//   and an asynchronous copy could still be reading it.
// Shape: as loom::collate_sampled (Batch::data N x planned padded shape, targets); Batch::mask
//   (bool, true = real) whenever the plan pads (GlobalBatchOptions::pad), or when collate.mask asks.
//   Each fetched sample must have its declared shape (shapes[i]) exactly.
// Throws: the sampler's, the fetch function's and collation's errors (naming the sample index); a
//   fetched sample whose shape is not its declared one (loom::InvalidArgument naming both).
// Source: torch.utils.data.DataLoader with pin_memory=True and a batch_sampler.
#pragma once

#include <concepts>
#include <cstdint>
#include <functional>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/Device.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <loom/collate/batch.hpp>
#include <loom/collate/collator.hpp>
#include <loom/collate/sample.hpp>
#include <loom/collate/transfer.hpp>
#include <loom/comm/communicator.hpp>
#include <loom/sample/global_batch.hpp>
#include <loom/sample/sampled_batch.hpp>

namespace loom {

/// Options of BatchLoader beyond the plan; use with designated initializers.
struct LoaderOptions {
  CollateOptions collate{};  ///< pad value, mask, pool / allocator (padded_shape comes from the plan);
                             ///< a plan that pads (GlobalBatchOptions::pad) always gets Batch::mask,
                             ///< as padded buckets do by default

  std::optional<c10::Device> device{};  ///< where batches go; default: the process group's device
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
                ".target)");
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
      : sampler_(comm, std::move(shapes), std::move(plan)),
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
      : sampler_(comm, std::move(shapes), std::move(plan)),
        fetch_(std::move(fetch)),
        options_(std::move(options)),
        projection_(std::move(projection)),
        device_(options_.device.value_or(comm.device())),
        transfer_(std::move(transfer)) {
    prepare_collate();
  }

  /// The collated batch of one sampler item (an idle item gives an empty Batch with weight 0).
  /// Throws: loom::InvalidArgument when a fetched sample's shape is not its declared one
  ///         (shapes[i]), naming the index and both shapes; collation's errors.
  [[nodiscard]] Batch load(const SampledBatch& item) {
    auto checked = [this](int64_t i) {
      auto sample = fetch_(i);
      check_declared_shape(i, projection_.data(sample));
      return sample;
    };
    Batch b = collate_sampled(item, checked, options_.collate, projection_);
    auto ticket = transfer_.start(b, label());
    transfer_.finish(b, label(), ticket);
    return b;
  }

  /// This rank's next batch of the epoch begun by begin_epoch (BatchSource, loom/train/batch_source.hpp):
  /// the sampler's next item, loaded; an idle item gives an idle Batch. std::nullopt at the epoch's end.
  /// Throws: as load().
  [[nodiscard]] std::optional<Batch> next() {
    auto item = sampler_.next();
    if (!item) return std::nullopt;
    return load(*item);
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
  void resume(const GlobalCursor& cursor) { sampler_.resume(cursor); }

  /// Prepares epoch `epoch` (rewinds, unless a resume pointed into it); used by Trainer::epoch.
  /// Throws: loom::InvalidArgument when a resume pointed into another epoch (GlobalBatchSampler::set_epoch).
  void begin_epoch(int64_t epoch) { sampler_.set_epoch(epoch); }

 private:
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
  void check_declared_shape(int64_t i, const at::Tensor& data) const {
    const auto& declared = sampler_.shapes()[static_cast<std::size_t>(i)];
    if (data.sizes() != c10::IntArrayRef(declared))
      throw InvalidArgument(fmt::format(
          "BatchLoader: fetch({}) returned a sample of shape [{}], but its declared shape (shapes[{}]) is [{}]; the "
          "plan batches and pads samples by their declared shapes, so declare each sample's real shape",
          i, fmt::join(data.sizes(), ", "), i, fmt::join(declared, ", ")));
  }

  GlobalBatchSampler sampler_;
  Fetch fetch_;
  LoaderOptions options_;
  Projection projection_;
  c10::Device device_;
  Transfer transfer_;
};

}  // namespace loom
