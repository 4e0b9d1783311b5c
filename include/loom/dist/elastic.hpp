// loom/dist/elastic.hpp — who is still alive after a rank died: each rank's heartbeat in the job's
// store, and the survivors' agreement on the next group (its members and how far each had come).
//
// One sentence: with `ProcessGroupOptions::elastic` set, a ProcessGroup keeps a Membership, and
// `ProcessGroup::recover(progress)` asks it which ranks are left before it builds a new
// communicator over them (loom::Trainer calls it when a collective fails; docs/elastic.md).
//
// Example:
//   loom::ProcessGroup pg(env, {.backend = loom::Backend::gloo, .elastic = loom::ElasticOptions{.min_ranks = 2}});
//   try { pg.all_reduce(t, loom::ReduceOp::sum); }
//   catch (const loom::CommError&) { auto r = pg.recover(/*progress=*/steps); }  // r.lost: who died
//
// The protocol (keys under "loom/elastic/" in the job's store, which must outlive every rank:
// loom::spawn with SpawnOptions::elastic hosts it in a process of its own):
//   - heartbeat: a thread writes "beat/<launch rank>" every `heartbeat` through a second store
//     connection, and (up to kWatchedRanks ranks) reads the other members' beats as often; a rank
//     whose value did not change for `dead_after` (as seen by the reader's own clock: no clocks are
//     compared across hosts) is dead. Since the reader watched before the failure, a rank that died
//     a second before the survivors noticed is known dead at once.
//   - agreement for generation g (0: the group the job started with): each survivor writes
//     "g<g>/joined/<launch rank>" = its progress (a number the caller chooses: loom::Trainer counts
//     its committed steps) and its node, then waits until every member of generation g has joined or is dead; the
//     first survivor to see that writes the member list with compare-and-set, so every survivor
//     reads the same list. A rank that joins after the list was written without it (it was
//     declared dead while slow) gets loom::CommError. The new group's ranks are the members in
//     launch-rank order.
// Units: durations are wall-clock. Launch ranks are the ranks the job started with (RANK).
// Throws: loom::CommError (this rank was left out; the store cannot be reached), loom::TimeoutError
//         ("elastic agreement") when a member neither joins nor stops its heartbeat within the timeout.
// Source: the heartbeat-and-quorum shape of torchft's Lighthouse and TorchElastic's rendezvous
//         (keep-alive keys in a store), reduced to one compare-and-set in the job's own store.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <c10/util/intrusive_ptr.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <loom/comm/detail/store_side.hpp>
#include <loom/error.hpp>
#include <loom/launch/detail/check_in.hpp>

namespace loom {

/// Elastic training's options (ProcessGroupOptions::elastic); use with designated initializers.
///
/// Example: `loom::ElasticOptions{.min_ranks = 2}` — go on while at least 2 ranks are alive.
/// Units: durations are wall-clock.
struct ElasticOptions {
  int min_ranks = 1;                           ///< fewer survivors: the job ends with loom::CommError
  std::chrono::milliseconds heartbeat{100};    ///< how often each rank writes its heartbeat
  std::chrono::milliseconds dead_after{1000};  ///< a heartbeat unchanged this long: the rank is dead
};

/// What one recovery did (ProcessGroup::recover, and loom::Trainer::recoveries()).
///
/// Example: `fmt::print("rank {} died, {} ranks left\n", fmt::join(r.lost, ","), r.members.size());`
struct Recovery {
  int generation = 0;             ///< the group's generation after it (1 after the first recovery)
  std::vector<int> lost;          ///< launch ranks of the members that died (left out), ascending
  std::vector<int> members;       ///< launch ranks of the new group, in new-rank order
  std::vector<int64_t> progress;  ///< each member's progress when it joined, in the same order
  std::vector<int> nodes;         ///< each member's node (Environment::node_rank), in the same order
  int old_rank = 0;               ///< this rank before
  int new_rank = 0;               ///< and after
  double seconds = 0;             ///< from the failure to the new communicator (loom::Trainer: to the shared state)
  int64_t epoch = -1;             ///< loom::Trainer: the epoch it happened in (-1 for a bare ProcessGroup)
  int64_t step = -1;              ///< loom::Trainer: the step dealt again over the survivors (-1 likewise)
  std::string cause;              ///< the error that started it (its first line)
};

namespace detail {

/// The launch ranks in `list` as "1, 2" (or "none").
inline std::string launch_ranks_text(const std::vector<int>& list) {
  return list.empty() ? std::string("none") : fmt::format("{}", fmt::join(list, ", "));
}

/// Up to this many ranks every rank watches every other's heartbeat all the time (N - 1 store reads
/// per heartbeat); in larger jobs the watch starts at the agreement (it then lasts dead_after).
inline constexpr std::size_t kWatchedRanks = 64;

/// A rank's membership of an elastic job: its heartbeat thread and the survivors' agreement
/// (see the file comment). Not copyable or movable (the thread holds `this`).
class Membership {
 public:
  /// Starts the heartbeat of `launch_rank` in `store` (the job's store, as loom::rendezvous returns it).
  /// Throws: loom::InvalidArgument for options out of range; the store's errors.
  Membership(c10::intrusive_ptr<c10d::Store> store, int launch_rank, int world_size, ElasticOptions options,
             std::chrono::milliseconds timeout)
      : store_(std::move(store)), me_(launch_rank), options_(options), timeout_(timeout) {
    if (options_.min_ranks < 1 || options_.min_ranks > world_size)
      throw InvalidArgument(
          fmt::format("ElasticOptions::min_ranks = {} is outside [1, world size {}]", options_.min_ranks, world_size));
    if (options_.heartbeat.count() < 1 || options_.dead_after < 2 * options_.heartbeat)
      throw InvalidArgument(fmt::format(
          "ElasticOptions: heartbeat = {} ms and dead_after = {} ms (need heartbeat >= 1 ms and dead_after >= "
          "2 x heartbeat)",
          options_.heartbeat.count(), options_.dead_after.count()));
    for (int r = 0; r < world_size; ++r) members_.push_back(r);
    side_ = second_connection(store_, timeout_);
    beat_once();
    beating_ = std::thread([this] { beat(); });
  }
  Membership(const Membership&) = delete;
  Membership& operator=(const Membership&) = delete;
  ~Membership() {
    stop_ = true;
    if (beating_.joinable()) beating_.join();
  }

  [[nodiscard]] int generation() const noexcept { return generation_; }
  [[nodiscard]] const std::vector<int>& members() const noexcept { return members_; }
  [[nodiscard]] const ElasticOptions& options() const noexcept { return options_; }
  [[nodiscard]] int launch_rank() const noexcept { return me_; }

  struct Agreement {
    std::vector<int> members;       // launch ranks, ascending
    std::vector<int64_t> progress;  // each one's progress
    std::vector<int> nodes;         // each one's node
  };

  /// Joins the agreement of the current generation with `progress` (and this rank's `node`) and
  /// returns the next group; moves to the next generation.
  /// Throws: loom::CommError when the agreed group leaves this rank out; loom::TimeoutError when a
  ///         member neither joins nor goes silent within the timeout; the store's errors.
  Agreement agree(int64_t progress, int node) {
    try {
      return agree_in_store(progress, node);
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {  // c10d's own errors: the store did not answer
      const std::string text = e.what();
      throw CommError(fmt::format(
          "elastic: launch rank {} could not reach the job's store during the agreement of generation {} ({}): "
          "this rank is cut off from the job and leaves it",
          me_, generation_, text.substr(0, text.find('\n'))));
    }
  }

 private:
  Agreement agree_in_store(int64_t progress, int node) {
    const auto start = std::chrono::steady_clock::now();
    const std::string base = fmt::format("loom/elastic/g{}/", generation_);
    store_->set(base + fmt::format("joined/{}", me_), store_bytes(fmt::format("{}:{}", progress, node)));
    std::string decided;
    for (;;) {
      const auto now = std::chrono::steady_clock::now();
      if (store_->check({base + "members"})) {
        decided = store_text(store_->get(base + "members"));
        break;
      }
      std::vector<std::pair<int, std::string>> joined;
      bool open = false;  // a member neither joined nor is dead yet
      for (int m : members_) {
        const std::string key = base + fmt::format("joined/{}", m);
        if (store_->check({key})) {
          joined.emplace_back(m, store_text(store_->get(key)));
          continue;
        }
        if (now - observe(*store_, m, now) < options_.dead_after) open = true;
      }
      if (!open) {
        std::string proposal;
        for (const auto& [m, p] : joined) proposal += fmt::format("{}{}:{}", proposal.empty() ? "" : ",", m, p);
        decided = store_text(store_->compareSet(base + "members", {}, store_bytes(proposal)));
        break;
      }
      if (now - start > timeout_)
        throw TimeoutError("elastic agreement", me_, seconds_since(start),
                           fmt::format("generation {}: members [{}] neither joined the agreement nor went silent",
                                       generation_, launch_ranks_text(members_)));
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    Agreement out;  // "launch:progress:node,..."
    for (std::size_t at = 0; at < decided.size();) {
      std::size_t comma = decided.find(',', at);
      if (comma == std::string::npos) comma = decided.size();
      const std::string item = decided.substr(at, comma - at);
      const auto first = item.find(':'), second = item.find(':', first + 1);
      out.members.push_back(std::stoi(item.substr(0, first)));
      out.progress.push_back(std::stoll(item.substr(first + 1, second - first - 1)));
      out.nodes.push_back(std::stoi(item.substr(second + 1)));
      at = comma + 1;
    }
    const std::vector<int>& next = out.members;
    if (std::find(next.begin(), next.end(), me_) == next.end())
      throw CommError(fmt::format(
          "elastic: launch rank {} was left out of the group of generation {} (members [{}]): its heartbeat or its "
          "arrival at the agreement came later than ElasticOptions::dead_after = {} ms",
          me_, generation_ + 1, launch_ranks_text(next), options_.dead_after.count()));
    {
      const std::lock_guard lock(mutex_);
      members_ = next;
    }
    ++generation_;
    return out;
  }

 private:
  void beat_once() { side_->set(fmt::format("loom/elastic/beat/{}", me_), store_bytes(std::to_string(beats_++))); }

  // When member m's beat last changed as seen from here (now, when first seen or changed).
  std::chrono::steady_clock::time_point observe(c10d::Store& store, int m, std::chrono::steady_clock::time_point now) {
    const std::string key = fmt::format("loom/elastic/beat/{}", m);
    std::string beat = store.check({key}) ? store_text(store.get(key)) : std::string();
    const std::lock_guard lock(mutex_);
    auto it = seen_.find(m);
    if (it == seen_.end() || it->second.beat != beat) {
      seen_[m] = {std::move(beat), now};
      return now;
    }
    return it->second.since;
  }

  void beat() {
    while (!stop_) {
      std::this_thread::sleep_for(options_.heartbeat);
      try {
        beat_once();
        std::vector<int> members;
        {
          const std::lock_guard lock(mutex_);
          if (members_.size() <= kWatchedRanks) members = members_;
        }
        const auto now = std::chrono::steady_clock::now();
        for (int m : members)
          if (m != me_) (void)observe(*side_, m, now);
      } catch (const std::exception&) {
        // The store did not answer (a loaded or cut-off link): try again next time; if it is gone
        // for good, the main thread's next store request says so.
      }
    }
  }

  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<c10d::Store> side_;
  int me_;
  ElasticOptions options_;
  std::chrono::milliseconds timeout_;
  struct Seen {
    std::string beat;                             // the member's last heartbeat value seen
    std::chrono::steady_clock::time_point since;  // when it was first seen
  };
  std::mutex mutex_;  // members_ and seen_ (the heartbeat thread reads and writes them too)
  std::vector<int> members_;
  std::map<int, Seen> seen_;
  int generation_ = 0;
  uint64_t beats_ = 0;
  std::atomic<bool> stop_{false};
  std::thread beating_;
};

}  // namespace detail

}  // namespace loom
