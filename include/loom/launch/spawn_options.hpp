// loom/launch/spawn_options.hpp — what spawn() and spawn_command() take (SpawnOptions) and what they
// report when a rank fails (RankFailure, SpawnError). See loom/launch/spawn.hpp for both calls.
//
// Example:
//   try {
//     loom::spawn(2, fn, {.timeout = std::chrono::seconds(60)});
//   } catch (const loom::SpawnError& e) {
//     std::cerr << e.what();   // "spawn: rank 1 threw loom::CommError: ... (of 2 ranks)
//                              //    then rank 0 was terminated by spawn"
//     return e.failed_rank();
//   }
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <string.h>

#include <loom/error.hpp>

namespace loom {

/// Options of spawn(); use with designated initializers.
///
/// Example: `loom::spawn(3, fn, {.timeout = std::chrono::seconds(60), .grace = std::chrono::seconds(5)})`;
///          `loom::spawn(3, fn, {.elastic = true})` (ranks that may die while the others go on).
/// Units: durations are wall-clock; threads_per_rank counts intra-op threads.
struct SpawnOptions {
  std::chrono::milliseconds timeout{0};        ///< whole-job limit; 0 = none
  std::chrono::milliseconds grace{5000};       ///< after the first failure: how long the others may run before SIGTERM
                                               ///< (not with `elastic`, where they run until they end)
  std::chrono::milliseconds kill_after{2000};  ///< after SIGTERM: how long before SIGKILL
  int threads_per_rank = 1;                  ///< at::set_num_threads in each child; 0 = leave unchanged (see fork rule)
  std::string master_addr = "127.0.0.1";     ///< MASTER_ADDR given to the children
  std::uint16_t master_port = 0;             ///< MASTER_PORT; 0 = a free port spawn picks (held while forking)
  std::map<std::string, std::string> env{};  ///< extra variables for every child, set last (may override loom's)
  /// The store lives in a process of spawn's (not rank 0) and a rank's death does not end the job:
  /// no grace period, spawn waits for every rank (see loom/launch/spawn.hpp, "Elastic").
  bool elastic = false;
};

/// How one spawned rank failed.
struct RankFailure {
  /// What went wrong.
  enum class Kind {
    exception,   ///< fn threw; `message` holds "<type>: <what()>"
    exit_code,   ///< the process exited with a non-zero `code`
    signal,      ///< the process was killed by signal `code`
    terminated,  ///< spawn terminated it because another rank failed or the timeout elapsed
  };
  int rank = 0;
  Kind kind = Kind::exception;
  int code = 0;           ///< exit code or signal number
  std::string message{};  ///< exception text (Kind::exception)

  /// One line, e.g. "rank 1 threw loom::TimeoutError: all_reduce timed out ..." or
  /// "rank 2 was killed by signal SIGSEGV (11)".
  [[nodiscard]] std::string describe() const {
    switch (kind) {
      case Kind::exception: return fmt::format("rank {} threw {}", rank, message);
      case Kind::exit_code: return fmt::format("rank {} exited with code {}", rank, code);
      case Kind::signal: {
        const char* name = sigabbrev_np(code);
        return fmt::format("rank {} was killed by signal SIG{} ({})", rank, name ? name : "?", code);
      }
      case Kind::terminated: return fmt::format("rank {} was terminated by spawn", rank);
    }
    return "?";
  }
};

/// A spawned rank failed. what() names the first failed rank and how on its first line (the cause),
/// then each other rank that did not succeed on a line of its own ("  then rank 0 threw ...");
/// failures() has the details of every one (first failure first, then by rank). An exception's text
/// is quoted without LibTorch's C++ backtrace.
class SpawnError : public RemoteError {
 public:
  SpawnError(int nprocs, std::vector<RankFailure> failures)
      : RemoteError(make_message(nprocs, failures)), failures_(std::move(failures)) {}

  [[nodiscard]] const std::vector<RankFailure>& failures() const noexcept { return failures_; }
  /// The rank that failed first (the likely cause).
  [[nodiscard]] int failed_rank() const noexcept { return failures_.empty() ? -1 : failures_.front().rank; }

 private:
  static std::string make_message(int nprocs, const std::vector<RankFailure>& f) {
    if (f.empty()) return fmt::format("spawn: a rank of {} failed", nprocs);
    std::vector<std::string> rest;
    for (std::size_t i = 1; i < f.size(); ++i) rest.push_back(f[i].describe());
    std::string text = fmt::format("spawn: {} (of {} ranks)", f.front().describe(), nprocs);
    for (const auto& line : rest) text += "\n  then " + line;
    return text;
  }
  std::vector<RankFailure> failures_;
};

}  // namespace loom
