// loom/trace/recorder.hpp — the flight recorder: a bounded ring of the last collectives a rank
// issued, with the loom context that issued each one, the step and micro-batch, and its state.
//
// One FlightRecorder belongs to one communicator (GlooCommunicator keeps one, always on); the
// communicator records each public collective call as it is issued, completes or fails. loom's
// parts say who is calling through a Scope (the reducer's window meta and buckets, metrics, the
// sampler check, ...); a call outside any Scope is `Context::user`. The Trainer (or a user's own
// loop, through set_position) says which step and micro-batch the rank is in. Both reach the
// recorder of a communicator that models TracedCommunicator (below); any other is not recorded.
//
// Example:
//   loom::GlooCommunicator comm(env);
//   loom::trace::set_position(comm, /*step=*/41, /*micro_batch=*/0);
//   {
//     loom::trace::Scope scope(comm, loom::trace::Context::metrics);
//     comm.all_reduce(t, loom::ReduceOp::sum);  // recorded as "all_reduce (metrics, step 41)"
//   }
//   loom::trace::Record r = comm.flight_recorder()->snapshot();
//
// Memory: `capacity` entries of 64 bytes (default 4096: 256 KiB per communicator), allocated once.
// Cost: a mutex and a few stores per collective; no allocation, no I/O, no collective.
// Threads: every member is safe to call from any thread (the communicator's waits may run on
//   another thread than its issues; the dump of loom/comm/detail/trace_exchange.hpp reads a snapshot
//   from a watcher thread).
// Fingerprint: take_fingerprint() folds the signatures (operation, dtype, element count, context,
//   context index, and the step when it is checked) of every collective issued since the previous
//   call into a 20-bit number;
//   the reducer sends it in its window meta (inside its first bucket's all-reduce), so ranks whose
//   collectives differ are detected at the next synchronising backward, with no collective of its
//   own (docs/debugging.md).
// Source: the idea of PyTorch's NCCL flight recorder (a per-rank ring of collectives dumped on
//   failure), kept by loom's own communicators for every backend, with loom's step and context.
#pragma once

#include <algorithm>
#include <chrono>
#include <concepts>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <fmt/format.h>

#include <loom/error.hpp>
#include <loom/trace/record.hpp>

namespace loom::trace {

/// A per-communicator ring of the last `capacity` collectives (see the header comment).
class FlightRecorder {
 public:
  static constexpr std::size_t kDefaultCapacity = 4096;

  /// Throws loom::InvalidArgument when capacity is 0.
  FlightRecorder(int rank, int world_size, std::string host, std::size_t capacity = kDefaultCapacity)
      : rank_(rank), world_size_(world_size), host_(std::move(host)), ring_(capacity) {
    if (capacity == 0) throw InvalidArgument("FlightRecorder: capacity = 0 (need >= 1)");
    wall_start_ms_ =
        std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
            .count();
  }

  FlightRecorder(const FlightRecorder&) = delete;
  FlightRecorder& operator=(const FlightRecorder&) = delete;

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int world_size() const noexcept { return world_size_; }
  [[nodiscard]] std::size_t capacity() const noexcept { return ring_.size(); }

  /// The id of the job this recorder's communicator belongs to, which every rank of the job shares
  /// (loom/comm/detail/trace_exchange.hpp: rank 0 makes it and posts it in the store); "" until known.
  /// Records carry it, so that loom-trace keeps to one job's records in a folder that holds several.
  void set_job(std::string job) {
    std::lock_guard lock(mutex_);
    job_ = std::move(job);
  }
  [[nodiscard]] std::string job() const {
    std::lock_guard lock(mutex_);
    return job_;
  }

  /// The step and micro-batch the next collectives belong to (-1: unknown). `check_step`: every
  /// rank gives the same step to the same collectives (a plan-driven loop: loom::Trainer over a
  /// BatchLoader), so the step enters the fingerprint and the verdict's comparison; otherwise it is
  /// only shown.
  void set_position(std::int64_t step, std::int64_t micro_batch, bool check_step = false) noexcept {
    std::lock_guard lock(mutex_);
    step_ = step;
    micro_batch_ = micro_batch;
    step_checked_ = check_step;
  }
  [[nodiscard]] std::int64_t step() const noexcept {
    std::lock_guard lock(mutex_);
    return step_;
  }

  /// The context the next collectives are issued in (Scope sets and restores it).
  void set_context(Context c, std::int64_t index) noexcept {
    std::lock_guard lock(mutex_);
    context_ = c;
    index_ = index;
  }
  [[nodiscard]] std::pair<Context, std::int64_t> context() const noexcept {
    std::lock_guard lock(mutex_);
    return {context_, index_};
  }

  /// Records a collective being issued; returns its sequence number (for complete / fail).
  std::int64_t issue(Op op, c10::ScalarType dtype, std::int64_t numel) noexcept {
    const double now = seconds();
    std::lock_guard lock(mutex_);
    Entry& e = ring_[static_cast<std::size_t>(next_ % static_cast<std::int64_t>(ring_.size()))];
    // The bucket-order broadcast (at a rank's first backward after the first window) and the generator
    // loader's agreement (per batch of the loader) come at points that need not share a step between
    // ranks: their step is shown, never compared.
    const bool checked = step_checked_ && context_ != Context::bucket_order && context_ != Context::generator_loader;
    e = Entry{next_, op, dtype, numel, context_, index_, step_, micro_batch_, checked, State::issued, now, -1, -1};
    fingerprint_ = mix(fingerprint_, e);
    return next_++;
  }
  /// Records a collective of tensor `t` being issued.
  std::int64_t issue(Op op, const at::Tensor& t) noexcept {
    return issue(op, t.defined() ? t.scalar_type() : c10::ScalarType::Undefined, t.defined() ? t.numel() : 0);
  }

  /// Notes that a wait for entry `seq` begins (the stuck-collective probe looks at waited entries only).
  void waiting(std::int64_t seq) noexcept {
    const double now = seconds();
    std::lock_guard lock(mutex_);
    const std::int64_t n = static_cast<std::int64_t>(ring_.size());
    if (seq < 0 || seq >= next_ || seq < next_ - n) return;
    Entry& e = ring_[static_cast<std::size_t>(seq % n)];
    if (e.state == State::issued && e.waited_s < 0) e.waited_s = now;
  }

  /// Marks entry `seq` completed (no effect when it already left the ring or was ended).
  void complete(std::int64_t seq) noexcept { end(seq, State::completed); }
  /// Marks entry `seq` failed.
  void fail(std::int64_t seq) noexcept { end(seq, State::failed); }

  /// The 20-bit fingerprint of the collectives issued since the previous call (0 bits set by none:
  /// the value of an empty run is a fixed constant), and starts a new run.
  std::int64_t take_fingerprint() noexcept {
    std::lock_guard lock(mutex_);
    const std::uint64_t f = fingerprint_;
    fingerprint_ = kFingerprintSeed;
    return static_cast<std::int64_t>((f ^ (f >> 20) ^ (f >> 40)) & ((1U << 20) - 1));
  }

  /// The oldest collective still in the `issued` state that somebody waits for, if any (a handle
  /// never waited on is not stuck). Cost: the entries issued since the oldest open one.
  [[nodiscard]] std::optional<Entry> oldest_waited() const noexcept {
    std::lock_guard lock(mutex_);
    const std::int64_t n = static_cast<std::int64_t>(ring_.size());
    first_open_ = std::max(first_open_, next_ - n);
    while (first_open_ < next_ && ring_[static_cast<std::size_t>(first_open_ % n)].state != State::issued)
      ++first_open_;
    for (std::int64_t s = first_open_; s < next_; ++s) {
      const Entry& e = ring_[static_cast<std::size_t>(s % n)];
      if (e.state == State::issued && e.waited_s >= 0) return e;
    }
    return std::nullopt;
  }

  /// Collectives issued so far.
  [[nodiscard]] std::int64_t issued_total() const noexcept {
    std::lock_guard lock(mutex_);
    return next_;
  }

  /// A copy of what the recorder holds (at most its `last` newest entries), oldest entry first.
  [[nodiscard]] Record snapshot(std::string reason = {}, std::size_t last = static_cast<std::size_t>(-1)) const {
    Record r;
    r.rank = rank_;
    r.world_size = world_size_;
    r.host = host_;
    r.wall_start_ms = wall_start_ms_;
    r.reason = std::move(reason);
    const double now = seconds();
    std::lock_guard lock(mutex_);
    r.job = job_;
    r.step = step_;
    r.micro_batch = micro_batch_;
    r.taken_s = now;
    r.issued_total = next_;
    const std::int64_t n = static_cast<std::int64_t>(ring_.size());
    const std::int64_t keep = static_cast<std::int64_t>(std::min<std::size_t>(last, ring_.size()));
    for (std::int64_t s = std::max<std::int64_t>(0, next_ - std::min(n, keep)); s < next_; ++s)
      r.entries.push_back(ring_[static_cast<std::size_t>(s % n)]);
    return r;
  }

  /// What the owning communicator does when a loom part finds that the ranks went different ways:
  /// writes the records, collects the other ranks' and returns the verdict's text to end the error
  /// (GlooCommunicator installs loom/comm/detail/trace_exchange.hpp's).
  void set_failure_handler(std::function<std::string(const std::string&)> handler) {
    auto h = std::make_shared<const std::function<std::string(const std::string&)>>(std::move(handler));
    std::lock_guard lock(mutex_);
    handler_ = std::move(h);
  }
  /// Runs the failure handler for `error` (its text, to append to the error), or "" without one.
  /// Never throws.
  std::string failure_report(const std::string& error) noexcept {
    std::shared_ptr<const std::function<std::string(const std::string&)>> handler;
    {
      std::lock_guard lock(mutex_);
      handler = handler_;
    }
    try {
      return handler && *handler ? (*handler)(error) : std::string{};
    } catch (...) {
      return {};
    }
  }

  /// Seconds since the recorder was created (its clock).
  [[nodiscard]] double seconds() const noexcept {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }

 private:
  static constexpr std::uint64_t kFingerprintSeed = 0xcbf29ce484222325ULL;

  void end(std::int64_t seq, State s) noexcept {
    const double now = seconds();
    std::lock_guard lock(mutex_);
    const std::int64_t n = static_cast<std::int64_t>(ring_.size());
    if (seq < 0 || seq >= next_ || seq < next_ - n) return;
    Entry& e = ring_[static_cast<std::size_t>(seq % n)];
    if (e.state != State::issued) return;
    e.state = s;
    e.ended_s = now;
  }

  /// FNV-1a over the signature fields of `e` (Entry::same_call's, without seq).
  static std::uint64_t mix(std::uint64_t h, const Entry& e) noexcept {
    const std::int64_t words[] = {static_cast<std::int64_t>(e.op),
                                  static_cast<std::int64_t>(e.dtype),
                                  e.numel,
                                  static_cast<std::int64_t>(e.context),
                                  e.index,
                                  e.step_checked ? e.step : -1};
    for (std::int64_t w : words)
      for (int b = 0; b < 8; ++b) {
        h ^= static_cast<std::uint64_t>(w >> (8 * b)) & 0xffU;
        h *= 0x100000001b3ULL;
      }
    return h;
  }

  int rank_ = 0;
  int world_size_ = 1;
  std::string host_;
  std::string job_;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  std::int64_t wall_start_ms_ = 0;
  mutable std::mutex mutex_;
  std::vector<Entry> ring_;
  std::int64_t next_ = 0;
  mutable std::int64_t first_open_ = 0;  // no entry before it is in flight (oldest_in_flight)
  std::int64_t step_ = -1;
  std::int64_t micro_batch_ = -1;
  Context context_ = Context::user;
  std::int64_t index_ = -1;
  std::uint64_t fingerprint_ = kFingerprintSeed;
  bool step_checked_ = false;
  std::shared_ptr<const std::function<std::string(const std::string&)>> handler_;
};

/// A communicator that keeps a flight recorder loom's parts can reach: GlooCommunicator,
/// NcclCommunicator and ProcessGroup model it; LocalCommunicator does not.
///
/// Example: `static_assert(loom::trace::TracedCommunicator<loom::GlooCommunicator>);`
///
/// Requirements:
///  1. `c.flight_recorder()` on a `C&` returns something convertible to `FlightRecorder*`. Reason:
///     loom's parts reach the recorder through the communicator they were given (recorder_of):
///     Scope names the part issuing a collective, set_position the step and micro-batch, and the
///     reducer sends the recorder's fingerprint in its window meta; none of them knows the backend.
///  2. The pointer may be null (the recorder is off, as with GlooOptions::flight_recorder = false,
///     or the communicator was moved from). Reason: turning the recorder off must not change the
///     communicator's type; every caller checks.
/// Not required: being a loom::Communicator (this folder sits below loom/comm/; the parts that take
/// a communicator constrain it there), owning the recorder (a wrapper may return its inner
/// communicator's), thread safety beyond FlightRecorder's own. A type without the member is no
/// error: recorder_of returns nullptr, and Scope and set_position do nothing.
template <class C>
concept TracedCommunicator = requires(C& c) {
  { c.flight_recorder() } -> std::convertible_to<FlightRecorder*>;
};

/// The communicator's recorder, or nullptr when it keeps none (a type that does not model
/// TracedCommunicator: LocalCommunicator, a user's own communicator without `flight_recorder()`).
template <class C>
FlightRecorder* recorder_of(C& comm) noexcept {
  if constexpr (TracedCommunicator<C>)
    return comm.flight_recorder();
  else
    return nullptr;
}

/// Tells the communicator's recorder which step and micro-batch the rank is in (loom::Trainer does
/// it; a loop of one's own calls it before each micro-batch). `check_step`: see
/// FlightRecorder::set_position — true only when every rank gives every collective the same step
/// (a rank that joins other ranks' remaining steps at the end of an epoch, Accumulator::end_epoch,
/// does not know them). No effect without a recorder.
template <class C>
void set_position(C& comm, std::int64_t step, std::int64_t micro_batch, bool check_step = false) noexcept {
  if (FlightRecorder* r = recorder_of(comm)) r->set_position(step, micro_batch, check_step);
}

/// While alive, the collectives of `comm` are recorded as issued by `context` (with `index`, e.g. a
/// bucket); restores the previous context when destroyed. No effect without a recorder.
class Scope {
 public:
  template <class C>
  Scope(C& comm, Context context, std::int64_t index = -1) noexcept : recorder_(recorder_of(comm)) {
    if (recorder_ == nullptr) return;
    std::tie(previous_, previous_index_) = recorder_->context();
    recorder_->set_context(context, index);
  }
  ~Scope() {
    if (recorder_ != nullptr) recorder_->set_context(previous_, previous_index_);
  }
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  FlightRecorder* recorder_ = nullptr;
  Context previous_ = Context::user;
  std::int64_t previous_index_ = -1;
};

}  // namespace loom::trace
