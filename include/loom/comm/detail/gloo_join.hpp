// loom/comm/detail/gloo_join.hpp — no rank waits for a peer that already failed to join (used by
// GlooCommunicator's constructor).
//
// A rank whose construction fails (its Gloo device, the connect to its peers) writes one line to the
// store, under the communicator's prefix: key "loom_join/failed" = "rank r (host:pid): <error>" (the
// first failing rank's line is kept; "loom_join/failures" counts them). The other ranks connect on a
// helper thread and meanwhile look for that key every 20 ms; when it appears they stop waiting and
// throw loom::CommError naming the failed rank and its error, instead of waiting for their timeout.
// They look through a second connection to the store (detail::second_connection, loom/comm/detail/store_side.hpp), because Gloo's own
// waits hold the first one (c10d's TCPStore serialises a client's requests, a wait included). Every
// rank that gives up this way (the failed one and those that read its line) stays until every rank
// has read the line or failed itself ("loom_join/seen" + "loom_join/failures" = world size), at most
// 2 s: the rank that hosts the store must not take it away while others still look.
//
// What cannot be reported this way: a rank that cannot reach the store at all (its rendezvous fails;
// the others then see "1 of 2 ranks arrived" at their rendezvous timeout), and a rank killed before it
// could write.
//
// Source: loom's own protocol over a c10d::Store; key names are loom's.
#pragma once

#include <loom/config.hpp>

#if LOOM_HAS_GLOO && defined(USE_C10D_GLOO)

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <loom/comm/detail/store_side.hpp>

namespace loom::detail {

/// The join-failure protocol of one communicator's construction (see the header comment).
class JoinWatch {
 public:
  static constexpr const char* kFailedKey = "loom_join/failed";
  static constexpr const char* kFailuresKey = "loom_join/failures";
  static constexpr const char* kSeenKey = "loom_join/seen";
  /// How often the other ranks look for a failure.
  static constexpr std::chrono::milliseconds kPollInterval{20};

  /// `store`: the communicator's (prefixed) store. `side`: a second connection to the same keys (see
  /// second_connection), or `store` itself when the store needs none.
  JoinWatch(c10::intrusive_ptr<c10d::Store> store, c10::intrusive_ptr<c10d::Store> side, int world_size)
      : store_(std::move(store)), side_(std::move(side)), world_size_(world_size) {}

  /// Publishes this rank's failure (the first failing rank's line is the one the others read), then
  /// waits until the others have read it, at most `wait_at_most`. Never throws (a store that is gone
  /// cannot carry the news).
  void report_failure(const std::string& line, std::chrono::milliseconds wait_at_most) noexcept {
    if (world_size_ <= 1) return;
    try {
      if (store_->add(kFailuresKey, 1) == 1)
        store_->set(kFailedKey, std::vector<std::uint8_t>(line.begin(), line.end()));
    } catch (...) {
      return;
    }
    linger(wait_at_most);
  }

  /// Waits until every rank has read the failure line or failed itself, at most `wait_at_most`.
  /// Never throws.
  void linger(std::chrono::milliseconds wait_at_most) noexcept {
    if (world_size_ <= 1) return;
    try {
      const auto until = std::chrono::steady_clock::now() + wait_at_most;
      while (std::chrono::steady_clock::now() < until) {
        if (side_->add(kSeenKey, 0) + side_->add(kFailuresKey, 0) >= world_size_) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    } catch (...) {
    }
  }

  /// Another rank's failure line, if one was published; marks it as read. Does not block (one request
  /// on the side connection); a store that stopped answering counts as no news.
  std::optional<std::string> failure() noexcept {
    if (broken_) return std::nullopt;
    try {
      if (!side_->check({kFailedKey})) return std::nullopt;
      const auto value = side_->get(kFailedKey);
      side_->add(kSeenKey, 1);
      return std::string(value.begin(), value.end());
    } catch (...) {
      broken_ = true;  // the store went away (its host exited): Gloo's own errors will tell
      return std::nullopt;
    }
  }

 private:
  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<c10d::Store> side_;
  int world_size_ = 1;
  bool broken_ = false;
};

}  // namespace loom::detail

#endif  // LOOM_HAS_GLOO && USE_C10D_GLOO
