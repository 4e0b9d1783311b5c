// loom/comm/detail/trace_exchange.hpp — when a collective fails, every rank writes its flight
// record and the failing rank names the first divergence (used by GlooCommunicator).
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
//  3. The failing rank posts its own record, waits for the others' (at most kCollectWait, less
//     when the timeout is shorter), and appends first_divergence's verdict and the folder to its error.
// Records are written once per communicator (the first failure's); later failures still get the
// verdict. Everything here is best effort and never throws: a store that is gone (its host exited)
// leaves the ranks that can still write their own files, and the verdict names the ranks missing.
// Cost when nothing fails: one store check per kPollInterval on the watcher thread of each rank.
// Source: loom's own protocol (key names are loom's); PyTorch's NCCL flight recorder dumps on a
// store signal from its watchdog in the same spirit.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <memory>
#include <mutex>
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
class TraceExchange {
 public:
  static constexpr const char* kRequestKey = "loom_trace/request";
  static constexpr const char* kRequestsKey = "loom_trace/requests";
  static constexpr std::chrono::milliseconds kPollInterval{100};
  static constexpr std::chrono::milliseconds kCollectWait{3000};

  /// `store`: the communicator's prefixed store; `side`: a second connection to the same keys (or
  /// `store` itself); both may be null (then only this rank's file is written). `folder`: where the
  /// record files go (empty: default_trace_folder()).
  TraceExchange(std::shared_ptr<trace::FlightRecorder> recorder, c10::intrusive_ptr<c10d::Store> store,
                c10::intrusive_ptr<c10d::Store> side, std::chrono::milliseconds timeout, std::string folder)
      : recorder_(std::move(recorder)),
        store_(std::move(store)),
        side_(std::move(side)),
        collect_wait_(std::min(timeout, kCollectWait)),
        folder_(folder.empty() ? default_trace_folder() : std::move(folder)) {
    if (recorder_->world_size() > 1 && side_) watcher_ = std::thread([this] { watch(); });
  }

  TraceExchange(const TraceExchange&) = delete;
  TraceExchange& operator=(const TraceExchange&) = delete;

  ~TraceExchange() {
    stop_.store(true);
    if (watcher_.joinable()) watcher_.join();
  }

  [[nodiscard]] trace::FlightRecorder& recorder() noexcept { return *recorder_; }

  /// The folder the record files go to.
  [[nodiscard]] std::string folder() const {
    std::lock_guard lock(mutex_);
    return folder_;
  }
  /// Changes it (loom::Trainer puts the records beside its checkpoints).
  void set_folder(std::string folder) {
    std::lock_guard lock(mutex_);
    folder_ = folder.empty() ? default_trace_folder() : std::move(folder);
  }

  /// Steps 1 and 3 of the protocol for a failure described by `error`: returns the text to append to
  /// the error ("; flight recorder: <verdict>; records: <folder>/loom-trace-rank*.txt ..."), and the
  /// verdict in `verdict` when given. Never throws.
  std::string on_failure(const std::string& error, trace::Verdict* verdict = nullptr) noexcept {
    try {
      const int me = recorder_->rank();
      const int world = recorder_->world_size();
      if (store_ && world > 1) {
        try {
          if (store_->add(kRequestsKey, 1) == 1) store_->set(kRequestKey, bytes(fmt::format("rank {}: {}", me, error)));
        } catch (const std::exception&) {
        }
      }
      post(error);
      // The verdict reads this rank as it is now (its record may have been posted earlier, on another
      // rank's request, while the collective that failed here was still in flight).
      std::vector<trace::Record> records{recorder_->snapshot(error)};
      if (store_ && world > 1) {
        bool store_gone = false;
        std::vector<bool> have(static_cast<std::size_t>(world), false);
        have[static_cast<std::size_t>(me)] = true;
        const auto until = std::chrono::steady_clock::now() + collect_wait_;
        for (;;) {
          for (int q = 0; q < world; ++q) {
            if (have[static_cast<std::size_t>(q)]) continue;
            try {
              const std::string key = rank_key(q);
              if (!store_->check({key})) continue;
              const auto value = store_->get(key);
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
      }
      trace::Verdict v = trace::first_divergence(records, world);
      std::error_code ec;
      const std::string where = std::filesystem::absolute(folder(), ec).lexically_normal().string();
      std::string text = fmt::format("; flight recorder: {}; records in {} (read them with: loom-trace {})", v.text,
                                     where, where);
      if (!written_.empty()) text += written_;
      if (verdict != nullptr) *verdict = std::move(v);
      return text;
    } catch (const std::exception& e) {
      return fmt::format("; flight recorder: no verdict ({})", e.what());
    }
  }

 private:
  static std::vector<std::uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }
  std::string rank_key(int q) const { return fmt::format("loom_trace/rank/{}", q); }

  /// Step 2 for this rank, once: snapshot, file, store. Never throws.
  void post(const std::string& reason) noexcept {
    std::lock_guard post_lock(post_mutex_);
    if (posted_) return;
    posted_ = true;
    try {
      trace::Record r = recorder_->snapshot(reason);
      try {
        trace::write_record(folder(), r);
      } catch (const std::exception& e) {
        written_ = fmt::format(" (this rank's file could not be written: {})", e.what());
      }
      c10::intrusive_ptr<c10d::Store> store = side_ ? side_ : store_;
      if (store && recorder_->world_size() > 1) store->set(rank_key(recorder_->rank()), bytes(trace::to_text(r)));
    } catch (const std::exception&) {
    }
  }

  /// The watcher thread: step 2 when another rank asks.
  void watch() noexcept {
    while (!stop_.load()) {
      try {
        if (side_->check({kRequestKey})) {
          const auto value = side_->get(kRequestKey);
          post("requested by " + std::string(value.begin(), value.end()));
          return;
        }
      } catch (const std::exception&) {
        return;  // the store went away: the job is over
      }
      for (int i = 0; i < 5 && !stop_.load(); ++i) std::this_thread::sleep_for(kPollInterval / 5);
    }
  }

  std::shared_ptr<trace::FlightRecorder> recorder_;
  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<c10d::Store> side_;
  std::chrono::milliseconds collect_wait_;
  mutable std::mutex mutex_;  // folder_
  std::string folder_;
  std::mutex post_mutex_;
  bool posted_ = false;
  std::string written_;
  std::atomic<bool> stop_{false};
  std::thread watcher_;
};

}  // namespace loom::detail
