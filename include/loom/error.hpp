// loom/error.hpp — the exception family every loom component throws, and kDefaultTimeout, the bound
// after which collectives and rendezvous give up with TimeoutError.
//
// One sentence: every user-visible failure in loom is a `loom::Error` (a `std::runtime_error`),
// and the message names the bad value, variable, rank or collective.
//
// Example:
//   try { auto env = loom::Environment::from_env(); }
//   catch (const loom::ConfigError& e) { std::cerr << e.what(); }
//   // prints e.g. "loom: RANK='abc' is not an integer"
//
// Hierarchy (catch the base to catch all):
//   Error                    base of everything loom throws on purpose
//   ├── InvalidArgument      a bad value passed to a loom function (empty batch, rank >= world size, ...)
//   ├── ConfigError          a bad launcher environment variable or option
//   ├── CommError            a collective failed (backend error, dtype/shape mismatch across ranks)
//   │   └── TimeoutError     a collective or rendezvous did not finish within its timeout
//   ├── RemoteError          another rank (or a worker thread / generator) failed; carries its message
//   └── DataError            a data file is missing, unreadable or corrupt (names the file)
//
// Internal invariants are checked with LOOM_ASSERT (an assertion that throws loom::Error with
// file:line, so a bug never silently corrupts a batch), not with these user-facing types.
#pragma once

#include <chrono>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

#include <fmt/format.h>

namespace loom {

/// Base of every exception loom throws on purpose. `what()` starts with "loom: ".
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message)
      : std::runtime_error(message.rfind("loom: ", 0) == 0 ? message : "loom: " + message) {}
};

/// A bad value passed to a loom function; the message names the parameter and the value.
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

/// A bad environment variable or configuration option; the message names it and its value.
class ConfigError : public Error {
 public:
  using Error::Error;
};

/// A collective operation failed (backend error, mismatch across ranks, closed peer).
class CommError : public Error {
 public:
  using Error::Error;
};

/// Default timeout of every blocking collective and of rendezvous: 300 s (c10d's default is 30 min;
/// loom prefers a failure a person sees within minutes).
inline constexpr std::chrono::milliseconds kDefaultTimeout{std::chrono::seconds(300)};

/// A collective or rendezvous did not complete within its timeout.
///
/// Carries the collective's name (e.g. "all_reduce"), the rank that waited and the time waited
/// in seconds, so a log line from any rank says which operation hung and for how long.
class TimeoutError : public CommError {
 public:
  TimeoutError(std::string collective, int rank, double seconds_waited, const std::string& detail = {})
      : CommError(fmt::format("{} timed out on rank {} after {:.3f} s{}{}", collective, rank, seconds_waited,
                              detail.empty() ? "" : ": ", detail)),
        collective_(std::move(collective)),
        rank_(rank),
        seconds_(seconds_waited) {}

  /// Name of the collective that timed out ("all_reduce", "barrier", "rendezvous", ...).
  [[nodiscard]] const std::string& collective() const noexcept { return collective_; }
  /// Rank of the process that waited.
  [[nodiscard]] int rank() const noexcept { return rank_; }
  /// Seconds waited before giving up.
  [[nodiscard]] double seconds_waited() const noexcept { return seconds_; }

 private:
  std::string collective_;
  int rank_;
  double seconds_;
};

/// Another party failed: a peer rank, a worker thread, a generator. The message says who.
class RemoteError : public Error {
 public:
  using Error::Error;
};

/// A data file is missing, unreadable or corrupt; the message names the file.
class DataError : public Error {
 public:
  using Error::Error;
};

namespace detail {
/// The first line of an error text (LibTorch's messages carry a backtrace after it), without the
/// "loom: " prefix of loom's own errors.
inline std::string first_line(std::string_view text) {
  text = text.substr(0, text.find('\n'));
  if (text.starts_with("loom: ")) text.remove_prefix(6);
  return std::string(text);
}

[[noreturn]] inline void assert_fail(const char* expr, const char* file, int line, const std::string& msg) {
  throw Error(
      fmt::format("internal invariant violated: {} at {}:{}{}{}", expr, file, line, msg.empty() ? "" : ": ", msg));
}
}  // namespace detail

}  // namespace loom

/// Checks an internal invariant (a loom bug if it fails); throws loom::Error with file:line.
#define LOOM_ASSERT(cond, ...)                                                                     \
  do {                                                                                             \
    if (!(cond)) ::loom::detail::assert_fail(#cond, __FILE__, __LINE__, std::string{__VA_ARGS__}); \
  } while (false)
