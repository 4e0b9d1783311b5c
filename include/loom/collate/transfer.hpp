// loom/collate/transfer.hpp — the transfer step of a loader: a collated host batch on its way to
// its device. The seam where CUDA staging plugs in; the generator loaders (loom/schedule/) take it,
// and loom::cuda::CudaTransfer (loom/cuda/transfer.hpp) models it, so it lives below both.
//
// For every batch the loader calls `t.start(batch, device)` on a worker thread right after
// the collate step (for one device: one call at a time, in step order, on whichever worker collated that
// step) (a CUDA transfer copies into pinned staging memory and issues a
// non-blocking copy on the device's own stream, then records an event), keeps the returned
// Ticket next to the batch in the prefetch queue, and calls `t.finish(batch, device, ticket)` on
// the consumer's thread just before handing the batch out (a CUDA transfer makes the
// consumer's current stream wait on the event — not the whole device). HostTransfer, the
// default, leaves the batch where it is and does nothing. loom::cuda::CudaTransfer
// (loom/cuda/transfer.hpp) is the CUDA model of this seam.
//
// Example:
//   struct CountingTransfer {                  // a transfer that only counts what it saw
//     struct Ticket { std::int64_t rows; };
//     Ticket start(loom::Batch& b, int) { return {b.num_samples}; }
//     void finish(loom::Batch&, int, Ticket&) {}
//   };
//   static_assert(loom::BatchTransfer<CountingTransfer, loom::Batch>);
//
// Source: the staging / per-device stream / event protocol of torch.utils.data's pin_memory
// thread followed by `.to(device, non_blocking=True)`, done per device.
#pragma once

#include <concepts>

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

}  // namespace loom
