// loom/comm/detail/gloo_group.hpp — a GlooCommunicator's c10d process group: what it is told (the
// c10d reduce op of a loom::ReduceOp; bfloat16, which ProcessGroupGloo rejects, is staged by the
// communicator), the state it shares with its GlooWorks (broken, collectives still running), and
// its lifetime (GlooGroup: a broken group whose collective still runs is left to the process).
// Not a public header: loom/comm/gloo.hpp is (its header comment says why a group is left).
//
// Example: `detail::GlooGroup pg(std::move(connection.pg), peers); pg->allreduce(tensors, opts);`
// Source: c10d ProcessGroupGloo (its dtype switch, its worker threads joined by its destructor).
#pragma once

#include <loom/config.hpp>

#if LOOM_HAS_GLOO && defined(USE_C10D_GLOO)

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <utility>

#include <c10/core/ScalarType.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <loom/comm/communicator.hpp>
#include <loom/comm/detail/gloo_peers.hpp>

namespace loom::detail {

/// Whether ProcessGroupGloo accepts the dtype. Its dtype switch has no bfloat16 case ("Invalid scalar
/// type") in 1.13 and, per pytorch/pytorch#111131 (open through 2024), in the 2.x releases loom
/// targets, so loom stages bfloat16 on every version rather than guess which release added it.
inline bool gloo_supports_dtype(c10::ScalarType dtype) noexcept {
  return dtype != c10::ScalarType::BFloat16;
}

inline c10d::ReduceOp::RedOpType to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg: return c10d::ReduceOp::SUM;  // avg: divided afterwards
    case ReduceOp::min: return c10d::ReduceOp::MIN;
    case ReduceOp::max: return c10d::ReduceOp::MAX;
  }
  return c10d::ReduceOp::SUM;
}

/// What a GlooCommunicator and its GlooWorks share about its process group: whether one of its
/// collectives failed (or abort() was called), and how many of its collectives Gloo still runs.
struct GlooGroupState {
  std::atomic<bool> broken{false};
  std::mutex m;
  std::condition_variable cv;
  std::int64_t running = 0;

  /// True when no collective runs any more, waiting at most `wait` for that.
  bool drained(std::chrono::milliseconds wait) {
    std::unique_lock<std::mutex> lock(m);
    return cv.wait_for(lock, wait, [&] { return running == 0; });
  }
};

/// Counts `work` in `state->running` until its future completes (with a result or an error). A work
/// without a future is not counted.
inline void track_running(const std::shared_ptr<GlooGroupState>& state, const c10::intrusive_ptr<c10d::Work>& work) {
  c10::intrusive_ptr<c10::ivalue::Future> future;
  try {
    future = work->getFuture();
  } catch (const std::exception&) {
    return;
  }
  if (!future) return;
  {
    std::lock_guard<std::mutex> lock(state->m);
    ++state->running;
  }
  future->addCallback([state](c10::ivalue::Future& f) {
    if (f.hasError()) state->broken = true;
    {
      std::lock_guard<std::mutex> lock(state->m);
      --state->running;
    }
    state->cv.notify_all();
  });
}

/// A GlooCommunicator's process group. Destroying it (or assigning over it) destroys the process
/// group, as an intrusive_ptr would, except when the communicator is broken (a collective failed,
/// abort(), or Gloo closed one of its connections) and Gloo still runs one of its collectives 200 ms
/// later: ~ProcessGroupGloo would then join a worker thread that may wait in Gloo until its timeout,
/// so the process group is left to the process instead (see the header).
class GlooGroup {
 public:
  GlooGroup() = default;
  GlooGroup(c10::intrusive_ptr<c10d::ProcessGroupGloo> pg, std::shared_ptr<const GlooPeerTable> peers)
      : state_(std::make_shared<GlooGroupState>()), peers_(std::move(peers)), pg_(std::move(pg)) {}
  GlooGroup(GlooGroup&&) noexcept = default;
  GlooGroup& operator=(GlooGroup&& other) noexcept {
    if (this != &other) {
      leave();
      state_ = std::move(other.state_);
      peers_ = std::move(other.peers_);
      pg_ = std::move(other.pg_);
    }
    return *this;
  }
  GlooGroup(const GlooGroup&) = delete;
  GlooGroup& operator=(const GlooGroup&) = delete;
  ~GlooGroup() { leave(); }

  c10d::ProcessGroupGloo* operator->() const noexcept { return pg_.get(); }
  explicit operator bool() const noexcept { return static_cast<bool>(pg_); }
  [[nodiscard]] const c10::intrusive_ptr<c10d::ProcessGroupGloo>& get() const noexcept { return pg_; }
  [[nodiscard]] const std::shared_ptr<GlooGroupState>& state() const noexcept { return state_; }

 private:
  void leave() noexcept {
    if (!pg_ || !state_) return;
    const bool broken = state_->broken.load() || (peers_ && peers_->now().closed);
    if (broken && !state_->drained(std::chrono::milliseconds(200))) (void)pg_.release();
  }

  std::shared_ptr<GlooGroupState> state_;
  std::shared_ptr<const GlooPeerTable> peers_;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg_;
};

}  // namespace loom::detail

#endif  // LOOM_HAS_GLOO && USE_C10D_GLOO
