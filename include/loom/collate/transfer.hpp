// loom/collate/transfer.hpp — the transfer step of a loader: a collated host batch on its way to
// its device. The generator loaders (loom/schedule/) and loom::BatchLoader take a BatchTransfer and
// loom::cuda::CudaTransfer models it, so it lives below all three.
//
// Example:
//   struct CountingTransfer {                  // a transfer that only counts what it saw
//     struct Ticket { std::int64_t rows; };
//     Ticket start(loom::Batch& b, int) { return {b.num_samples}; }
//     void finish(loom::Batch&, int, Ticket&) {}
//   };
//   static_assert(loom::BatchTransfer<CountingTransfer, loom::Batch>);
//
// Protocol: start(batch, label) on the thread that collated it (a generator loader's worker;
// BatchLoader's caller of load() or next()), finish(batch, label, ticket) on the consumer's thread
// before the batch is handed out. Label: a generator loader's device slot, BatchLoader's device index.
// Guide: docs/collate.md#on-to-a-device-the-transfer-seam-loomcollatetransferhpp.
// Source: the staging / per-device stream / event protocol of torch.utils.data's pin_memory
// thread followed by `.to(device, non_blocking=True)`, done per device.
#pragma once

#include <array>
#include <concepts>
#include <cstddef>
#include <optional>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/DeviceType.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <loom/collate/batch.hpp>
#include <loom/error.hpp>

namespace loom {

/// A two-phase move of a batch of type B to a device: start on the worker, finish on the consumer.
///
/// Requirements:
///  1. `T::Ticket` is a move-constructible object type. Reason: it rides in the prefetch queue
///     with its batch (a CUDA event, a staging-buffer handle).
///  2. `t.start(b, device)` (B&, int) returns a T::Ticket; it may replace b's tensors by device
///     tensors. Called on the worker thread. Reason: the copy overlaps the consumer's compute.
///  3. `t.finish(b, device, ticket)` (B&, int, Ticket&). Called on the consumer's thread before b
///     is handed out. Reason: the consumer must not read b before the copy landed.
///  4. T is copy-constructible. Reason: the loader keeps one copy per device. Calls of start()
///     on that copy never overlap (one collate at a time per device) but may come from different
///     worker threads (set the CUDA device inside start()); start() and finish() of that copy may
///     run at the same time on two threads (a worker, the consumer).
///  5. Either call may throw; the exception reaches the consumer's thread.
/// Not required: anything about where B lives afterwards (the host no-op keeps it on the host).
template <class T, class B>
concept BatchTransfer = std::copy_constructible<T> && std::move_constructible<typename T::Ticket> &&
    requires(T& t, B& b, int device, typename T::Ticket& ticket) {
  { t.start(b, device) } -> std::same_as<typename T::Ticket>;
  t.finish(b, device, ticket);
};

/// The default transfer: batches stay in host memory; both phases do nothing.
///
/// Example: `loom::GeneratorLoader<Gen, loom::DefaultCollate<>, loom::HostTransfer>` (the defaults).
/// Throws: never.
struct HostTransfer {
  struct Ticket {};
  template <class B>
  Ticket start(B& /*batch*/, int /*device*/) const noexcept {
    return {};
  }
  template <class B>
  void finish(B& /*batch*/, int /*device*/, Ticket& /*ticket*/) const noexcept {}
};

/// Options of DeviceTransfer; an aggregate used with designated initializers.
struct DeviceTransferOptions {
  /// The device type batches go to. c10::kCPU: every label is the CPU (CPU tensors stay as they are).
  c10::DeviceType type = c10::kCPU;
  /// Device index of each label (label d -> devices[d]); empty: label d is index d.
  std::vector<int> devices{};
  /// Tensor::to(device, non_blocking): the copy may overlap the host's next work when the source is
  /// pinned. false: every copy has completed when start() returns (needed when the host memory is
  /// handed out again at once, as a loom::BufferPool of the user's does).
  bool non_blocking = true;
};

/// The plain transfer on any LibTorch device: models loom::BatchTransfer<DeviceTransfer, Batch>.
///
/// start(b, d): data, targets and mask (those defined) become `t.to(device(d), non_blocking)`;
/// indices, num_samples, weight, step_end, step and idle stay. On a device with streams (CUDA,
/// HIP, XPU, MPS, a PrivateUse1 backend) a non-blocking copy runs on the calling thread's
/// current stream of the target device, and an event is recorded after it. finish(b, d, ticket)
/// on the consumer's thread: when the consumer's current stream is another one (a generator
/// loader's worker thread copied, or the consumer set a stream of its own), that stream waits on
/// the event on the device (the host does not block) and the batch's memory is recorded as used
/// by it; on the same stream it does nothing. Pinned host memory stays alive until the copy
/// finished (LibTorch's host allocator records the copy's stream).
///
/// Example: `loom::DeviceTransfer to_gpu({.type = c10::kCUDA, .devices = {local_rank}});`
/// Throws: loom::InvalidArgument (a label below 0, or one with no entry in `devices`), naming it;
///         LibTorch's errors of the copy.
/// Source: `batch.to(device, non_blocking=True)` after a pin_memory DataLoader.
class DeviceTransfer {
 public:
  /// The copy's stream and event (none for the CPU, a blocking copy, or a device without streams).
  struct Ticket {
    std::optional<c10::Stream> stream;
    std::optional<c10::Event> done;
  };

  DeviceTransfer() = default;
  explicit DeviceTransfer(DeviceTransferOptions options) : options_(std::move(options)) {}

  /// The device of label `label`.
  /// Throws: loom::InvalidArgument (a negative label, or one without an entry in `devices`).
  [[nodiscard]] c10::Device device(int label) const {
    if (options_.type == c10::kCPU) return c10::Device(c10::kCPU);
    if (label < 0) throw InvalidArgument(fmt::format("DeviceTransfer: device label {} is negative", label));
    if (options_.devices.empty()) return {options_.type, static_cast<c10::DeviceIndex>(label)};
    if (static_cast<std::size_t>(label) >= options_.devices.size())
      throw InvalidArgument(fmt::format("DeviceTransfer: device label {} has no entry in devices [{}]", label,
                                        fmt::join(options_.devices, ", ")));
    return {options_.type, static_cast<c10::DeviceIndex>(options_.devices[static_cast<std::size_t>(label)])};
  }

  Ticket start(Batch& b, int label) {
    const c10::Device target = device(label);
    for (at::Tensor* t : fields(b))
      if (t->defined()) *t = t->to(target, options_.non_blocking);
    Ticket ticket;
    if (options_.non_blocking && has_streams(target.type())) {
      const c10::impl::VirtualGuardImpl guard(target.type());
      ticket.stream = guard.getStream(target);
      ticket.done.emplace(target.type());
      ticket.done->record(*ticket.stream);
    }
    return ticket;
  }

  void finish(Batch& b, int label, Ticket& ticket) const {
    if (!ticket.done) return;
    const c10::Device target = device(label);
    const c10::Stream consumer = c10::impl::VirtualGuardImpl(target.type()).getStream(target);
    if (consumer == *ticket.stream) return;
    ticket.done->block(consumer);
    for (at::Tensor* t : fields(b))
      if (t->defined() && t->device() == target) t->record_stream(consumer);
  }

  [[nodiscard]] const DeviceTransferOptions& options() const noexcept { return options_; }

 private:
  static std::array<at::Tensor*, 3> fields(Batch& b) noexcept { return {&b.data, &b.targets, &b.mask}; }
  static bool has_streams(c10::DeviceType type) noexcept {
    return type == c10::kCUDA || type == c10::kHIP || type == c10::kXPU || type == c10::kMPS ||
           type == c10::kPrivateUse1;
  }

  DeviceTransferOptions options_{};
};

static_assert(BatchTransfer<DeviceTransfer, Batch>, "DeviceTransfer must model loom::BatchTransfer");

}  // namespace loom
