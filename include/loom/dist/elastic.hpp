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
#include <future>
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
/// (see the file comment). Not copyable or movable.
/// A store request that never returns (a host cut off from the job's store: c10d's TCPStore waits
/// for a reply without a bound on LibTorch 2.x) never holds this rank: the agreement's requests run
/// on a helper thread, and when this rank's own heartbeat has not reached the store for
/// `dead_after` + 2 heartbeats (the others then count it dead too), agree() throws loom::CommError
/// ("cut off") and leaves the helper behind; the destructor does not wait for a heartbeat thread
/// stuck in a request either. Such threads hold only the shared state below and end when their
/// request does.
class Membership {
 public:
  /// Starts the heartbeat of `launch_rank` in `store` (the job's store, as loom::rendezvous returns it).
  /// Throws: loom::InvalidArgument for options out of range; the store's errors.
  Membership(c10::intrusive_ptr<c10d::Store> store, int launch_rank, int world_size, ElasticOptions options,
             std::chrono::milliseconds timeout)
      : state_(std::make_shared<State>()) {
    if (options.min_ranks < 1 || options.min_ranks > world_size)
      throw InvalidArgument(
          fmt::format("ElasticOptions::min_ranks = {} is outside [1, world size {}]", options.min_ranks, world_size));
    if (options.heartbeat.count() < 1 || options.dead_after < 2 * options.heartbeat)
      throw InvalidArgument(fmt::format(
          "ElasticOptions: heartbeat = {} ms and dead_after = {} ms (need heartbeat >= 1 ms and dead_after >= "
          "2 x heartbeat)",
          options.heartbeat.count(), options.dead_after.count()));
    State& s = *state_;
    s.store = std::move(store);
    s.me = launch_rank;
    s.options = options;
    s.timeout = timeout;
    for (int r = 0; r < world_size; ++r) s.members.push_back(r);
    s.side = second_connection(s.store, timeout);
    s.beat_once();
    beating_ = std::thread([weak = std::weak_ptr<State>(state_)] { State::beat(weak); });
  }
  Membership(const Membership&) = delete;
  Membership& operator=(const Membership&) = delete;
  /// Stops the heartbeat: waits for its thread up to 2 heartbeats + 1 s, then leaves a thread that
  /// is stuck in a store request behind (it ends when the request does).
  ~Membership() {
    state_->stop = true;
    const auto until = std::chrono::steady_clock::now() + 2 * state_->options.heartbeat + std::chrono::seconds(1);
    while (!state_->beat_ended && std::chrono::steady_clock::now() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    if (state_->beat_ended)
      beating_.join();
    else
      beating_.detach();
  }

  [[nodiscard]] int generation() const noexcept { return state_->generation; }
  [[nodiscard]] const std::vector<int>& members() const noexcept { return state_->members; }
  [[nodiscard]] const ElasticOptions& options() const noexcept { return state_->options; }
  [[nodiscard]] int launch_rank() const noexcept { return state_->me; }

  struct Agreement {
    std::vector<int> members;       // launch ranks, ascending
    std::vector<int64_t> progress;  // each one's progress
    std::vector<int> nodes;         // each one's node
  };

  /// Joins the agreement of the current generation with `progress` (and this rank's `node`) and
  /// returns the next group; moves to the next generation.
  /// Throws: loom::CommError when the agreed group leaves this rank out or this rank is cut off from
  ///         the store (its heartbeat did not reach it for dead_after + 2 heartbeats, or a request
  ///         failed); loom::TimeoutError when a member neither joins nor goes silent within the timeout.
  Agreement agree(int64_t progress, int node) {
    std::shared_ptr<State> state = state_;
    if (state->abandoned)
      throw CommError(
          fmt::format("elastic: launch rank {} was cut off from the job's store and left the job", state->me));
    auto task = std::make_shared<std::packaged_task<Agreement()>>(
        [state, progress, node] { return state->agree_in_store(progress, node); });
    std::future<Agreement> result = task->get_future();
    std::thread([task] { (*task)(); }).detach();  // holds the state, not this
    const auto cut_off_after = state->options.dead_after + 2 * state->options.heartbeat;
    while (result.wait_for(std::chrono::milliseconds(10)) != std::future_status::ready) {
      const auto silent = std::chrono::steady_clock::now() - state->last_beat.load();
      if (silent > cut_off_after && !state->beat_ended) {
        state->abandoned = true;
        throw CommError(fmt::format(
            "elastic: launch rank {} is cut off from the job's store: its heartbeat has not reached the store for "
            "{} ms (ElasticOptions::dead_after = {} ms), so the others count it dead; it leaves the job",
            state->me, std::chrono::duration_cast<std::chrono::milliseconds>(silent).count(),
            state->options.dead_after.count()));
      }
    }
    try {
      return result.get();
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {  // c10d's own errors: the store did not answer
      const std::string text = e.what();
      throw CommError(fmt::format(
          "elastic: launch rank {} could not reach the job's store during the agreement of generation {} ({}): "
          "this rank is cut off from the job and leaves it",
          state->me, state->generation, text.substr(0, text.find('\n'))));
    }
  }

 private:
  /// Everything the heartbeat thread and the agreement's helper read and write (shared with them,
  /// so that a thread left in a store request never touches a destroyed Membership).
  struct State {
    c10::intrusive_ptr<c10d::Store> store;
    c10::intrusive_ptr<c10d::Store> side;
    int me = 0;
    ElasticOptions options;
    std::chrono::milliseconds timeout{0};
    struct Seen {
      std::string beat;                             // the member's last heartbeat value seen
      std::chrono::steady_clock::time_point since;  // when it was first seen
    };
    std::mutex mutex;  // members and seen (the heartbeat thread reads and writes them too)
    std::vector<int> members;
    std::map<int, Seen> seen;
    int generation = 0;
    uint64_t beats = 0;
    std::atomic<bool> stop{false};
    std::atomic<bool> beat_ended{false};
    std::atomic<bool> abandoned{false};  // agree() gave up on this rank (cut off): the helper changes nothing
    std::atomic<std::chrono::steady_clock::time_point> last_beat{std::chrono::steady_clock::now()};

    void beat_once() {
      side->set(fmt::format("loom/elastic/beat/{}", me), store_bytes(std::to_string(beats++)));
      last_beat = std::chrono::steady_clock::now();
    }

    // When member m's beat last changed as seen from here (now, when first seen or changed).
    std::chrono::steady_clock::time_point observe(c10d::Store& from, int m, std::chrono::steady_clock::time_point now) {
      const std::string key = fmt::format("loom/elastic/beat/{}", m);
      std::string beat = from.check({key}) ? store_text(from.get(key)) : std::string();
      const std::lock_guard lock(mutex);
      auto it = seen.find(m);
      if (it == seen.end() || it->second.beat != beat) {
        seen[m] = {std::move(beat), now};
        return now;
      }
      return it->second.since;
    }

    static void beat(const std::weak_ptr<State>& weak) {
      for (;;) {
        std::shared_ptr<State> self = weak.lock();
        if (!self || self->stop) break;
        const std::chrono::milliseconds pause = self->options.heartbeat;
        self.reset();
        std::this_thread::sleep_for(pause);
        self = weak.lock();
        if (!self || self->stop) break;
        try {
          self->beat_once();
          std::vector<int> watched;
          {
            const std::lock_guard lock(self->mutex);
            if (self->members.size() <= kWatchedRanks) watched = self->members;
          }
          const auto now = std::chrono::steady_clock::now();
          for (int m : watched)
            if (m != self->me) (void)self->observe(*self->side, m, now);
        } catch (const std::exception&) {
          // The store did not answer (a loaded or cut-off link): try again next time; if it is gone
          // for good, agree() sees the heartbeat fall silent.
        }
      }
      if (auto self = weak.lock()) self->beat_ended = true;
    }

    Agreement agree_in_store(int64_t progress, int node) {
      const auto start = std::chrono::steady_clock::now();
      const std::string base = fmt::format("loom/elastic/g{}/", generation);
      store->set(base + fmt::format("joined/{}", me), store_bytes(fmt::format("{}:{}", progress, node)));
      std::string decided;
      for (;;) {
        const auto now = std::chrono::steady_clock::now();
        if (store->check({base + "members"})) {
          decided = store_text(store->get(base + "members"));
          break;
        }
        std::vector<std::pair<int, std::string>> joined;
        bool open = false;  // a member neither joined nor is dead yet
        for (int m : members) {
          const std::string key = base + fmt::format("joined/{}", m);
          const bool alive = m == me || now - observe(*store, m, now) < options.dead_after;
          if (store->check({key})) {
            // A member cut off after it joined falls silent too: it is left out like the dead.
            if (alive) joined.emplace_back(m, store_text(store->get(key)));
            continue;
          }
          if (alive) open = true;
        }
        if (!open) {
          std::string proposal;
          for (const auto& [m, p] : joined) proposal += fmt::format("{}{}:{}", proposal.empty() ? "" : ",", m, p);
          decided = store_text(store->compareSet(base + "members", {}, store_bytes(proposal)));
          break;
        }
        if (now - start > timeout)
          throw TimeoutError("elastic agreement", me, seconds_since(start),
                             fmt::format("generation {}: members [{}] neither joined the agreement nor went silent",
                                         generation, launch_ranks_text(members)));
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
      if (std::find(next.begin(), next.end(), me) == next.end())
        throw CommError(fmt::format(
            "elastic: launch rank {} was left out of the group of generation {} (members [{}]): its heartbeat or its "
            "arrival at the agreement came later than ElasticOptions::dead_after = {} ms",
            me, generation + 1, launch_ranks_text(next), options.dead_after.count()));
      if (abandoned) throw CommError("elastic: this rank left the job (cut off) before its agreement ended");
      {
        const std::lock_guard lock(mutex);
        members = next;
      }
      ++generation;
      return out;
    }
  };

  std::shared_ptr<State> state_;
  std::thread beating_;
};

}  // namespace detail

}  // namespace loom
