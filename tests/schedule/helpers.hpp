// Test generators for the loader tests: streams whose sample k of generator g is the int64
// tensor [g, k], with optional per-sample delays (to shake thread timing), a length, and a sample
// index at which they throw.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <doctest/doctest.h>
#include <torch/torch.h>

#include <loom/schedule/assign.hpp>

namespace loom::test {

/// A deterministic pseudo-random delay in [0, max_us) microseconds for (seed, g, k).
inline std::chrono::microseconds jitter(uint64_t seed, int g, int64_t k, int max_us) {
  if (max_us <= 0) return std::chrono::microseconds(0);
  uint64_t x = seed * 0x9E3779B97F4A7C15ull ^ (static_cast<uint64_t>(g) << 32) ^ static_cast<uint64_t>(k);
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  return std::chrono::microseconds(static_cast<int64_t>(x % static_cast<uint64_t>(max_us)));
}

/// Callable generator: sample k of generator g is torch::tensor({g, k}) (int64, shape 2).
struct Stream {
  int g = 0;
  int64_t length = 1'000'000;
  int64_t throw_at = -1;  ///< throws std::runtime_error("boom ...") when asked for this sample
  int jitter_us = 0;      ///< random delay per sample, up to this many microseconds
  uint64_t seed = 1;
  std::shared_ptr<std::atomic<int64_t>> pulls{};  ///< counts calls, when set
  int64_t k = 0;

  std::optional<at::Tensor> operator()() {
    if (pulls) pulls->fetch_add(1);
    if (jitter_us > 0) std::this_thread::sleep_for(jitter(seed, g, k, jitter_us));
    if (k == throw_at) throw std::runtime_error("boom at sample " + std::to_string(k));
    if (k >= length) return std::nullopt;
    auto t = torch::tensor({static_cast<int64_t>(g), k});
    ++k;
    return t;
  }
};

/// Stream plus skip(n): models SkippableSampleGenerator; counts how often skip was used.
struct SkippableStream : Stream {
  std::shared_ptr<std::atomic<int64_t>> skipped{};
  void skip(int64_t n) {
    k += n;
    if (skipped) skipped->fetch_add(n);
  }
};

/// Callable generator that never ends: sample k of generator g is torch::tensor({g, k}).
struct EndlessStream {
  int g = 0;
  int64_t k = 0;
  std::optional<at::Tensor> operator()() { return torch::tensor({static_cast<int64_t>(g), k++}); }
};

/// Callable generator that decodes every sample into one output buffer it keeps and returns that
/// buffer (as decoders with an output buffer do): sample k of generator g is the int64 tensor
/// [g, k], written through the buffer's data pointer over the previous sample. `delay` per sample.
struct ReusingStream {
  int g = 0;
  int64_t length = 6;
  std::chrono::milliseconds delay{0};
  at::Tensor buffer = torch::empty({2}, torch::kLong);
  int64_t k = 0;

  std::optional<at::Tensor> operator()() {
    if (delay.count() > 0) std::this_thread::sleep_for(delay);
    if (k >= length) return std::nullopt;
    auto* p = buffer.data_ptr<int64_t>();
    p[0] = g;
    p[1] = k++;
    return buffer;
  }
};

/// Generators 0 (fast) and 1 (20 ms per sample) reusing their output buffers: with both on one
/// device and prefetch_depth 3, samples 0, 1, 2 of generator 0 are all waiting for their steps
/// while generator 1 holds each step open.
inline std::vector<ReusingStream> fast_and_slow_reusing(int64_t length) {
  std::vector<ReusingStream> v;
  v.push_back(ReusingStream{.g = 0, .length = length});
  v.push_back(ReusingStream{.g = 1, .length = length, .delay = std::chrono::milliseconds(20)});
  return v;
}

/// Returns fn(); if fn has not returned after `limit`, prints "FAIL: <what> ..." and ends the
/// process with exit code 1, so a hang fails the test run instead of stalling it (inside a rank
/// started by loom::spawn, spawn reports the rank's exit code).
template <class F>
auto within(std::chrono::seconds limit, const char* what, F&& fn) {
  struct Guard {
    std::mutex m;
    std::condition_variable cv;
    bool done = false;
    std::thread t;
    Guard(std::chrono::seconds limit, const char* what) {
      t = std::thread([this, limit, what] {
        std::unique_lock lk(m);
        if (!cv.wait_for(lk, limit, [this] { return done; })) {
          std::fprintf(stderr, "FAIL: %s did not return within %lld s (a hang)\n", what,
                       static_cast<long long>(limit.count()));
          std::fflush(stderr);
          std::_Exit(1);
        }
      });
    }
    ~Guard() {
      {
        std::lock_guard lk(m);
        done = true;
      }
      cv.notify_all();
      t.join();
    }
  } guard(limit, what);
  return fn();
}

inline std::vector<Stream> streams(int n, int64_t length = 1'000'000, int jitter_us = 0, uint64_t seed = 1) {
  std::vector<Stream> v;
  for (int g = 0; g < n; ++g) v.push_back(Stream{.g = g, .length = length, .jitter_us = jitter_us, .seed = seed});
  return v;
}

/// Expected data of a device batch at step k: rows [g, k] for the given generator ids, in order.
inline at::Tensor expected_rows(const std::vector<int>& gens, int64_t k) {
  auto t = torch::empty({static_cast<int64_t>(gens.size()), 2}, torch::kLong);
  for (size_t i = 0; i < gens.size(); ++i) {
    t[static_cast<int64_t>(i)][0] = gens[i];
    t[static_cast<int64_t>(i)][1] = k;
  }
  return t;
}

}  // namespace loom::test
