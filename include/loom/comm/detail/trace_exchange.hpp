// loom/comm/detail/trace_exchange.hpp — when a collective fails, every rank writes its flight
// record and the failing rank names the first divergence (used by GlooCommunicator and
// NcclCommunicator).
//
// Protocol, over the communicator's own (prefixed) c10d::Store, never over the broken process group:
//  1. The rank whose collective fails (timeout, mismatch, a peer gone, a fingerprint that differs)
//     adds 1 to "loom_trace/requests"; the first such rank sets "loom_trace/request" to
//     "rank r: <its error>".
//  2. Every rank's watcher thread looks for that key every kPollInterval on a second store connection
//     (the main one may be held by a wait); when it appears, the rank writes its record file
//     (<folder>/loom-trace-rank<r>.txt) and posts the record's text as "loom_trace/rank/<r>". The
//     watcher runs beside the training thread, so a rank blocked outside any collective (a stalled
//     generator, a stuck fetch) still answers, with its last collective and the time since.
//  3. The failing rank posts its own record, waits for the others' (at most collect_wait: an eighth
//     of the timeout, between 250 ms and 1 s), and appends first_divergence's verdict and the folder
//     to its error; then it stays until every rank that posted has collected too (at most
//     collect_wait again), so that the rank hosting the store does not take it away under the
//     others' reads. The store requests run on a helper thread, so a store that cannot be reached
//     delays the error by 2 x collect_wait at most.
// The job: rank 0 makes an id for its communicator's job and posts it as "loom_trace/job"; the
// other ranks' watchers read it (the records carry it: Record::job, so that loom-trace keeps to one
// job's records in a folder that holds an earlier run's too).
// Records are written once per communicator (the first failure's); later failures still get the
// verdict. Everything here is best effort and never throws: a store that is gone (its host exited)
// leaves the ranks that can still write their own files, and the verdict names the ranks missing.
// Stuck collectives: when this rank's oldest collective has been in flight longer than probe_after
// (a twentieth of the timeout, between 1 s and 5 s), the watcher posts its last kProbeEntries
// entries as "loom_trace/probe/<r>" and, every 500 ms while it stays stuck, reads the other ranks'
// probes. When two ranks' probes hold different calls under the same sequence number (trace::
// first_conflict: proof that they went different ways, which no waiting can mend), it asks for the
// dump and aborts this rank's communicator, so every rank fails now with the verdict instead of at
// the timeout. A collective that is merely slow never aborts anything.
// A process that ends in std::terminate (Gloo ends a rank so when a message does not fit the
// buffer of a mismatched collective) still asks for the dump and posts its record first: a
// terminate handler, installed with the first communicator, does it for every live one.
// Cost when nothing fails: one store check per kPollInterval on the watcher thread of each rank.
// Source: loom's own protocol (key names are loom's); PyTorch's NCCL flight recorder dumps on a
// store signal from its watchdog in the same spirit.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <c10/util/intrusive_ptr.h>
#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <loom/error.hpp>
#include <loom/trace/record_file.hpp>
#include <loom/trace/recorder.hpp>
#include <loom/trace/verdict.hpp>

namespace loom::detail {

/// The flight-record folder when none is set: LOOM_TRACE_DIR, else "loom-trace" in the working folder.
inline std::string default_trace_folder() {
  const char* env = std::getenv("LOOM_TRACE_DIR");
  return env != nullptr && *env != '\0' ? std::string(env) : std::string("loom-trace");
}

/// One communicator's side of the protocol (see the header comment).
class TraceExchange : public std::enable_shared_from_this<TraceExchange> {
 public:
  static constexpr const char* kRequestKey = "loom_trace/request";
  static constexpr const char* kRequestsKey = "loom_trace/requests";
  static constexpr const char* kPostedKey = "loom_trace/posted";
  static constexpr const char* kCollectedKey = "loom_trace/collected";
  static constexpr const char* kJobKey = "loom_trace/job";
  static constexpr std::chrono::milliseconds kPollInterval{100};
  static constexpr std::chrono::milliseconds kCollectWait{1000};
  static constexpr std::size_t kProbeEntries = 64;

  /// `store`: the communicator's prefixed store; `side`: a second connection to the same keys (or
  /// `store` itself); both may be null (then only this rank's file is written). `folder`: where the
  /// record files go (empty: default_trace_folder()).
  /// `abort`: breaks the communicator (every pending collective of every rank fails at once); the
  /// stuck-collective probe calls it on a proven conflict. `communicator`: the communicator's number
  /// among this process's communicators with a flight recorder (0, 1, ...; Counted::flight_recorder):
  /// the records of communicator n > 0 go to the subfolder "comm<n>".
  TraceExchange(std::shared_ptr<trace::FlightRecorder> recorder, c10::intrusive_ptr<c10d::Store> store,
                c10::intrusive_ptr<c10d::Store> side, std::chrono::milliseconds timeout, std::string folder,
                std::function<void()> abort = {}, int communicator = 0)
      : recorder_(std::move(recorder)),
        store_(std::move(store)),
        side_(side ? std::move(side) : store_),
        subfolder_(communicator > 0 ? fmt::format("comm{}", communicator) : std::string{}),
        collect_wait_(std::clamp<std::chrono::milliseconds>(timeout / 8, std::chrono::milliseconds(250), kCollectWait)),
        probe_after_(
            std::clamp<std::chrono::milliseconds>(timeout / 20, std::chrono::seconds(1), std::chrono::seconds(5))),
        folder_(folder.empty() ? default_trace_folder() : std::move(folder)),
        abort_(std::move(abort)) {
    // The job's id: rank 0 makes it and posts it; the other ranks' watchers read it (learn_job).
    if (recorder_->rank() == 0 || !side_) {
      recorder_->set_job(fresh_job_id());
      try {
        if (store_ && recorder_->world_size() > 1) store_->set(kJobKey, bytes(recorder_->job()));
      } catch (const std::exception&) {
      }
    }
    live().add(this);
  }

  /// Starts the watcher thread (call once, right after make_shared: it holds a weak reference).
  /// The thread holds the exchange only while it talks to the store, so a request that never
  /// returns (a host cut off from the store) never holds the owner's destructor: the exchange then
  /// lives on with that thread and ends when its request does.
  void start_watcher() {
    if (recorder_->world_size() > 1 && side_ && !watcher_.joinable())
      watcher_ = std::thread([weak = weak_from_this()] { watch(weak); });
  }

  TraceExchange(const TraceExchange&) = delete;
  TraceExchange& operator=(const TraceExchange&) = delete;

  ~TraceExchange() {
    live().remove(this);
    stop_.store(true);
    if (!watcher_.joinable()) return;
    if (watcher_.get_id() == std::this_thread::get_id())
      watcher_.detach();  // the watcher held the last reference: it ends right after this
    else
      watcher_.join();  // it is asleep (it holds a reference while it works) and sees the exchange gone
  }

  [[nodiscard]] trace::FlightRecorder& recorder() noexcept { return *recorder_; }

  /// The folder the record files go to (the trace folder, or its subfolder "comm<n>" for the
  /// process's communicator n > 0).
  [[nodiscard]] std::string folder() const {
    std::lock_guard lock(mutex_);
    return subfolder_.empty() ? folder_ : (std::filesystem::path(folder_) / subfolder_).string();
  }
  /// Changes it; empty: default_trace_folder().
  void set_folder(std::string folder) {
    std::lock_guard lock(mutex_);
    folder_ = folder.empty() ? default_trace_folder() : std::move(folder);
  }

  /// Steps 1 and 3 of the protocol for a failure described by `error`: returns the text to append to
  /// the error ("; flight recorder: <verdict>; records in <folder> ..."), and the verdict in `verdict`
  /// when given. The store's requests run on a helper thread: this call returns after at most
  /// 2 x collect_wait (the collection, then the linger), even when the store cannot be reached (a
  /// link that went down blocks a store request up to its timeout). Never throws.
  std::string on_failure(const std::string& error, trace::Verdict* verdict = nullptr) noexcept {
    try {
      std::error_code ec;
      const std::string where = std::filesystem::absolute(folder(), ec).lexically_normal().string();
      // One exchange per communicator: a later failure would compare this rank's new record with the
      // others' old ones (a communicator that failed is to be destroyed; docs/comm.md).
      if (reported_.exchange(true))
        return fmt::format("; flight recorder: the records of this communicator's first failure are in {}", where);
      struct Outcome {
        std::mutex m;
        std::condition_variable cv;
        bool done = false;
        trace::Verdict v;
      };
      auto out = std::make_shared<Outcome>();
      std::thread([self = shared_from_this(), out, error] {
        trace::Verdict v = self->exchange(error);
        {
          std::lock_guard lock(out->m);
          out->v = std::move(v);
          out->done = true;
        }
        out->cv.notify_all();
      }).detach();
      std::unique_lock lock(out->m);
      if (!out->cv.wait_for(lock, 2 * collect_wait_ + std::chrono::milliseconds(100), [&] { return out->done; }))
        return fmt::format(
            "; flight recorder: no verdict (the job's store did not answer within {:.3f} s); this rank's record is in "
            "{}",
            std::chrono::duration<double>(2 * collect_wait_).count(), where);
      std::string text = fmt::format("; flight recorder: {}; records in {} (read them with: loom-trace {})",
                                     out->v.text, where, where);
      {
        std::lock_guard post_lock(post_mutex_);
        text += written_;
      }
      if (verdict != nullptr) *verdict = std::move(out->v);
      return text;
    } catch (const std::exception& e) {
      return fmt::format("; flight recorder: no verdict ({})", e.what());
    }
  }

  /// Steps 1 and 3 on the calling thread: asks, posts this rank's record, collects the others' (at
  /// most collect_wait, or until the store fails), lingers, and returns the verdict. Never throws.
  trace::Verdict exchange(const std::string& error) noexcept {
    try {
      const int me = recorder_->rank();
      const int world = recorder_->world_size();
      const c10::intrusive_ptr<c10d::Store>& store = side_;
      request(error, store);
      post(error);
      // The verdict reads this rank as it is now (its record may have been posted earlier, on another
      // rank's request, while the collective that failed here was still in flight).
      std::vector<trace::Record> records{recorder_->snapshot(error)};
      if (store && world > 1) {
        bool store_gone = false;
        std::vector<bool> have(static_cast<std::size_t>(world), false);
        have[static_cast<std::size_t>(me)] = true;
        const auto until = std::chrono::steady_clock::now() + collect_wait_;
        for (;;) {
          for (int q = 0; q < world; ++q) {
            if (have[static_cast<std::size_t>(q)]) continue;
            try {
              const std::string key = rank_key(q);
              if (!store->check({key})) continue;
              const auto value = store->get(key);
              records.push_back(trace::parse_record(std::string(value.begin(), value.end()), key));
              have[static_cast<std::size_t>(q)] = true;
            } catch (const DataError&) {
              have[static_cast<std::size_t>(q)] = true;  // a garbled record: that rank counts as missing
            } catch (const std::exception&) {
              store_gone = true;  // its host exited: no more records can come
              break;
            }
          }
          if (store_gone || std::all_of(have.begin(), have.end(), [](bool b) { return b; })) break;
          if (std::chrono::steady_clock::now() >= until) break;
          std::this_thread::sleep_for(std::chrono::milliseconds(20));
        }
        if (!store_gone) linger();
      }
      return trace::first_divergence(records, world);
    } catch (const std::exception& e) {
      trace::Verdict v;
      v.text = fmt::format("no verdict ({})", e.what());
      return v;
    }
  }

 private:
  static std::vector<std::uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }
  static std::string rank_key(int q) { return fmt::format("loom_trace/rank/{}", q); }
  static std::string probe_key(int q) { return fmt::format("loom_trace/probe/{}", q); }

  /// A new job id: 16 hexadecimal digits from the wall clock (ms) and 24 random bits, so that the
  /// ids of jobs started one after another differ.
  static std::string fresh_job_id() {
    const auto ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
            .count();
    std::random_device random;
    return fmt::format("{:010x}{:06x}", static_cast<std::uint64_t>(ms) & 0xffffffffffULL, random() & 0xffffffU);
  }

  /// Reads the job id rank 0 posted, once it is there (a check, then a get: never waits). Never throws.
  void learn_job() noexcept {
    try {
      if (!recorder_->job().empty() || !side_ || !side_->check({kJobKey})) return;
      const auto value = side_->get(kJobKey);
      recorder_->set_job(std::string(value.begin(), value.end()));
    } catch (const std::exception&) {
    }
  }

  /// After collecting: stays until every rank that posted a record has collected too (at most
  /// collect_wait), so that the rank hosting the store does not exit under the others' reads.
  void linger() noexcept {
    if (!side_ || recorder_->world_size() <= 1) return;
    try {
      side_->add(kCollectedKey, 1);
      const auto until = std::chrono::steady_clock::now() + collect_wait_;
      while (std::chrono::steady_clock::now() < until && side_->add(kCollectedKey, 0) < side_->add(kPostedKey, 0))
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
    } catch (const std::exception&) {
    }
  }

  /// Step 1: asks every rank for its record (the first request's text is kept). Never throws.
  void request(const std::string& error, const c10::intrusive_ptr<c10d::Store>& store) noexcept {
    if (!store || recorder_->world_size() <= 1) return;
    try {
      if (store->add(kRequestsKey, 1) == 1)
        store->set(kRequestKey, bytes(fmt::format("rank {}: {}", recorder_->rank(), error)));
    } catch (const std::exception&) {
    }
  }

  /// The communicators alive in this process, for the terminate handler.
  class Live {
   public:
    void add(TraceExchange* t) {
      std::lock_guard lock(m_);
      set_.insert(t);
      std::call_once(installed_, [this] { previous_ = std::set_terminate([] { live().on_terminate(); }); });
    }
    void remove(TraceExchange* t) {
      std::lock_guard lock(m_);
      set_.erase(t);
    }
    /// Every live communicator asks for the dump and posts its record, then the previous handler runs.
    void on_terminate() noexcept {
      std::string why = "the process is ending in std::terminate";
      if (auto e = std::current_exception()) {
        try {
          std::rethrow_exception(e);
        } catch (const std::exception& x) {
          why += fmt::format(" after an uncaught exception: {}", x.what());
        } catch (...) {
          why += " after an uncaught exception";
        }
      }
      if (m_.try_lock()) {
        for (TraceExchange* t : set_) {
          t->request(why, t->side_ ? t->side_ : t->store_);
          t->post(why);
        }
        m_.unlock();
      }
      if (previous_ != nullptr) previous_();
      std::abort();
    }

   private:
    std::mutex m_;
    std::set<TraceExchange*> set_;
    std::once_flag installed_;
    std::terminate_handler previous_ = nullptr;
  };
  static Live& live() {
    static Live& l = *new Live;  // never destroyed: a std::terminate during exit may still use it
    return l;
  }

  /// The stuck-collective probe (see the header comment); runs on the watcher thread.
  void probe() {
    const auto open = recorder_->oldest_waited();
    if (!open) return;
    const double stuck = recorder_->seconds() - open->waited_s;
    if (stuck < std::chrono::duration<double>(probe_after_).count()) return;
    const auto now = std::chrono::steady_clock::now();
    const std::int64_t total = recorder_->issued_total();
    if (open->seq != probed_seq_ || total != probed_total_) {
      probed_seq_ = open->seq;
      probed_total_ = total;
      side_->set(probe_key(recorder_->rank()), bytes(trace::to_text(recorder_->snapshot("probe", kProbeEntries))));
    } else if (now - last_probe_read_ < std::chrono::milliseconds(500)) {
      return;
    }
    last_probe_read_ = now;
    std::vector<trace::Record> records{recorder_->snapshot("probe", kProbeEntries)};
    for (int q = 0; q < recorder_->world_size(); ++q) {
      if (q == recorder_->rank() || !side_->check({probe_key(q)})) continue;
      const auto value = side_->get(probe_key(q));
      try {
        records.push_back(trace::parse_record(std::string(value.begin(), value.end()), probe_key(q)));
      } catch (const DataError&) {
      }
    }
    const std::int64_t conflict = trace::first_conflict(records);
    if (conflict < 0) return;
    const std::string why = fmt::format(
        "rank {} waited {:.3f} s in collective #{}, and the ranks' flight records hold different calls under #{}",
        recorder_->rank(), stuck, open->seq, conflict);
    request(why, side_);
    if (abort_) abort_();
  }

  /// Step 2 for this rank, once: snapshot, file, store. Never throws.
  void post(const std::string& reason) noexcept {
    std::lock_guard post_lock(post_mutex_);
    if (posted_) return;
    posted_ = true;
    try {
      learn_job();
      trace::Record r = recorder_->snapshot(reason);
      try {
        trace::write_record(folder(), r);
      } catch (const std::exception& e) {
        written_ = fmt::format(" (this rank's file could not be written: {})", e.what());
      }
      c10::intrusive_ptr<c10d::Store> store = side_ ? side_ : store_;
      if (store && recorder_->world_size() > 1) {
        store->set(rank_key(recorder_->rank()), bytes(trace::to_text(r)));
        store->add(kPostedKey, 1);
      }
    } catch (const std::exception&) {
    }
  }

  /// The watcher thread: step 2 when another rank asks.
  static void watch(const std::weak_ptr<TraceExchange>& weak) noexcept {
    int failures = 0;  // consecutive store errors
    for (;;) {
      {
        const std::shared_ptr<TraceExchange> self = weak.lock();
        if (!self || self->stop_.load()) return;
        try {
          self->learn_job();
          if (self->side_->check({kRequestKey})) {
            const auto value = self->side_->get(kRequestKey);
            if (!self->stop_.load()) self->post("requested by " + std::string(value.begin(), value.end()));
            return;
          }
          self->probe();
          failures = 0;
        } catch (const std::exception&) {
          if (++failures >= 20) return;  // the store went away: the job is over
        }
      }
      for (int i = 0; i < 5; ++i) {
        std::this_thread::sleep_for(kPollInterval / 5);
        const std::shared_ptr<TraceExchange> self = weak.lock();
        if (!self || self->stop_.load()) return;
      }
    }
  }

  std::shared_ptr<trace::FlightRecorder> recorder_;
  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<c10d::Store> side_;
  std::string subfolder_;
  std::chrono::milliseconds collect_wait_;
  std::chrono::milliseconds probe_after_;
  mutable std::mutex mutex_;  // folder_
  std::string folder_;
  std::mutex post_mutex_;
  bool posted_ = false;
  std::string written_;
  std::function<void()> abort_;
  std::int64_t probed_seq_ = -1;  // watcher thread only
  std::int64_t probed_total_ = -1;
  std::atomic<bool> reported_{false};
  std::chrono::steady_clock::time_point last_probe_read_{};
  std::atomic<bool> stop_{false};
  std::thread watcher_;
};

}  // namespace loom::detail
