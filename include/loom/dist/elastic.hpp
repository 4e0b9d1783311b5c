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
//     connection; a rank whose value does not change for `dead_after` (as seen by the reader's own
//     clock: no clocks are compared across hosts) is dead.
//   - agreement for generation g (0: the group the job started with): each survivor writes
//     "g<g>/joined/<launch rank>" = its progress (a number the caller chooses: loom::Trainer counts
//     its committed steps), then waits until every member of generation g has joined or is dead; the
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
  int old_rank = 0;               ///< this rank before
  int new_rank = 0;               ///< and after
  double seconds = 0;             ///< from the start of the agreement to the new communicator
  std::string cause;              ///< the error that started it (its first line)
};

namespace detail {

/// The launch ranks in `list` as "1, 2" (or "none").
inline std::string launch_ranks_text(const std::vector<int>& list) {
  return list.empty() ? std::string("none") : fmt::format("{}", fmt::join(list, ", "));
}

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
      throw InvalidArgument(fmt::format("ElasticOptions::min_ranks = {} is outside [1, world size {}]",
                                        options_.min_ranks, world_size));
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

  /// Joins the agreement of the current generation with `progress` and returns the next group's
  /// members and their progress; moves to the next generation.
  /// Throws: loom::CommError when the agreed group leaves this rank out; loom::TimeoutError when a
  ///         member neither joins nor goes silent within the timeout; the store's errors.
  std::pair<std::vector<int>, std::vector<int64_t>> agree(int64_t progress) {
    const auto start = std::chrono::steady_clock::now();
    const std::string base = fmt::format("loom/elastic/g{}/", generation_);
    store_->set(base + fmt::format("joined/{}", me_), store_bytes(std::to_string(progress)));
    struct Seen {
      std::string beat;
      std::chrono::steady_clock::time_point since;
    };
    std::map<int, Seen> seen;
    std::string decided;
    for (;;) {
      const auto now = std::chrono::steady_clock::now();
      if (store_->check({base + "members"})) {
        decided = store_text(store_->get(base + "members"));
        break;
      }
      std::vector<std::pair<int, int64_t>> joined;
      bool open = false;  // a member neither joined nor is dead yet
      for (int m : members_) {
        const std::string key = base + fmt::format("joined/{}", m);
        if (store_->check({key})) {
          joined.emplace_back(m, std::stoll(store_text(store_->get(key))));
          continue;
        }
        const std::string beat_key = fmt::format("loom/elastic/beat/{}", m);
        const std::string beat = store_->check({beat_key}) ? store_text(store_->get(beat_key)) : std::string();
        auto it = seen.find(m);
        if (it == seen.end() || it->second.beat != beat) {
          seen[m] = {beat, now};
          open = true;
        } else if (now - it->second.since < options_.dead_after) {
          open = true;
        }
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
    std::vector<int> next;
    std::vector<int64_t> progress_of;
    for (std::size_t at = 0; at < decided.size();) {
      std::size_t comma = decided.find(',', at);
      if (comma == std::string::npos) comma = decided.size();
      const std::string item = decided.substr(at, comma - at);
      const auto colon = item.find(':');
      next.push_back(std::stoi(item.substr(0, colon)));
      progress_of.push_back(std::stoll(item.substr(colon + 1)));
      at = comma + 1;
    }
    if (std::find(next.begin(), next.end(), me_) == next.end())
      throw CommError(fmt::format(
          "elastic: launch rank {} was left out of the group of generation {} (members [{}]): its heartbeat or its "
          "arrival at the agreement came later than ElasticOptions::dead_after = {} ms",
          me_, generation_ + 1, launch_ranks_text(next), options_.dead_after.count()));
    members_ = next;
    ++generation_;
    return {std::move(next), std::move(progress_of)};
  }

 private:
  void beat_once() { side_->set(fmt::format("loom/elastic/beat/{}", me_), store_bytes(std::to_string(beats_++))); }

  void beat() {
    while (!stop_) {
      std::this_thread::sleep_for(options_.heartbeat);
      try {
        beat_once();
      } catch (const std::exception&) {
        return;  // the store is gone: the main thread's next store request says so
      }
    }
  }

  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<c10d::Store> side_;
  int me_;
  ElasticOptions options_;
  std::chrono::milliseconds timeout_;
  std::vector<int> members_;
  int generation_ = 0;
  uint64_t beats_ = 0;
  std::atomic<bool> stop_{false};
  std::thread beating_;
};

}  // namespace detail

}  // namespace loom
