// loom/train/detail/shared_buffer_check.hpp — BatchLoader's check for a fetch that hands several
// worker threads views of one reused buffer (a decoder's output buffer shared by all threads):
// with LoaderOptions::num_workers > 0, fetch runs on several threads at once, so one thread's
// decode overwrites the buffer while another's sample is still being copied into its batch.
//
// The rule, within one epoch: each worker thread keeps a reference to its last fetched sample, with a probe of its
// bytes (the first and last 64). When a worker's fetch returns a CPU tensor at the same address as
// another worker's last sample (whose storage that reference keeps alive, so the address is the same
// memory, not a reused allocation) and the bytes both cover no longer match that sample's probe, the
// memory was rewritten across threads: loom::InvalidArgument. Views into one read-only dataset
// tensor (different addresses per sample) and a constant tensor returned for every sample (same
// bytes) pass; a thread_local buffer per worker passes.
//
// Example (what BatchLoader's workers do with each fetched sample):
//   loom::detail::SharedBufferCheck check;
//   check.fetched(index, projection.data(sample));   // throws when the rule above is broken
// Cost: a mutex, a scan of one record per worker and 128 bytes read per fetched sample.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <loom/error.hpp>

namespace loom::detail {

/// See the file comment.
class SharedBufferCheck {
 public:
  /// Records worker-fetched sample `data` (dataset index `index`) for the calling thread, after
  /// checking it against the other threads' last samples.
  /// Throws: loom::InvalidArgument naming both indices when another thread's last sample lives at the
  ///         same address and its bytes changed since.
  void fetched(int64_t index, const at::Tensor& data) {
    if (!data.defined() || !data.device().is_cpu() || data.nbytes() == 0) return;
    const void* address = data.data_ptr();
    const auto bytes = static_cast<std::size_t>(data.nbytes());
    const Probe now = probe(address, bytes);
    const std::thread::id me = std::this_thread::get_id();
    std::lock_guard lock(mutex_);
    for (const auto& [thread, last] : last_) {
      if (thread == me || last.address != address) continue;
      // The bytes both samples cover: the first min(64, sizes), and the last 64 when the sizes match.
      const std::size_t head = std::min({std::size_t{64}, bytes, last.bytes});
      const bool same = std::memcmp(last.probe.data(), now.data(), head) == 0 &&
                        (bytes != last.bytes || std::memcmp(last.probe.data() + 64, now.data() + 64, 64) == 0);
      if (same) continue;
      throw InvalidArgument(fmt::format(
          "BatchLoader: fetch({}) on one worker thread returned the memory fetch({}) returned on another, rewritten "
          "in between: fetch reuses one buffer across threads, so a worker's decode overwrites a sample another "
          "worker is still copying. With LoaderOptions::num_workers > 0 fetch runs on several threads at once: give "
          "each thread its own buffer (thread_local), return a new tensor, or set num_workers = 0",
          index, last.index));
    }
    last_[me] = Last{data.storage(), address, bytes, now, index};
  }

  /// Forgets every thread's last sample (at each epoch's start: the rule compares samples of one
  /// epoch, in which each index is fetched once).
  void reset() {
    std::lock_guard lock(mutex_);
    last_.clear();
  }

 private:
  using Probe = std::array<unsigned char, 128>;
  struct Last {
    c10::Storage storage;  // keeps the memory alive, so the same address is the same memory
    const void* address = nullptr;
    std::size_t bytes = 0;
    Probe probe{};
    int64_t index = -1;
  };

  static Probe probe(const void* address, std::size_t bytes) {
    Probe p{};
    const auto* b = static_cast<const unsigned char*>(address);
    const std::size_t head = std::min<std::size_t>(bytes, 64);
    std::memcpy(p.data(), b, head);
    const std::size_t tail = std::min<std::size_t>(bytes, 64);
    std::memcpy(p.data() + 64, b + bytes - tail, tail);
    return p;
  }

  std::mutex mutex_;
  std::map<std::thread::id, Last> last_;
};

}  // namespace loom::detail
