// loom/detail/exception_text.hpp — the text loom puts into its own errors when it reports another
// exception (a rank's failure, a generator's, a backend's).
//
// Example:
//   try { ... } catch (...) { throw CommError("broadcast failed: " + loom::detail::exception_text(std::current_exception())); }
//
// LibTorch's c10::Error::what() carries a C++ backtrace of dozens of lines; loom quotes
// what_without_backtrace() instead. Anything not derived from std::exception becomes a fixed
// sentence.
#pragma once

#include <algorithm>
#include <exception>
#include <string>
#include <string_view>

#include <c10/util/Exception.h>

namespace loom::detail {

/// The text of an exception without LibTorch's C++ backtrace (c10::Error::what() carries one).
inline std::string exception_text(const std::exception& e) {
  if (const auto* ce = dynamic_cast<const c10::Error*>(&e)) return ce->what_without_backtrace();
  return e.what();
}

/// `text` without the lines of a LibTorch backtrace that a message may carry inside it (one quoted
/// with what() instead of what_without_backtrace()): "Exception raised from ... (most recent call
/// first):" and the "frame #<n>: ..." lines after it. The other lines are kept, in order, without
/// trailing blank lines.
inline std::string without_backtrace(std::string_view text) {
  std::string out;
  while (!text.empty()) {
    const auto end = text.find('\n');
    std::string_view line = text.substr(0, end);
    text = end == std::string_view::npos ? std::string_view{} : text.substr(end + 1);
    std::string_view trimmed = line.substr(std::min(line.size(), line.find_first_not_of(" \t")));
    if (trimmed.starts_with("Exception raised from ") || trimmed.starts_with("frame #")) continue;
    if (!out.empty()) out += '\n';
    out += line;
  }
  while (!out.empty() && (out.back() == '\n' || out.back() == ' ')) out.pop_back();
  return out;
}

/// The same for an exception_ptr: "a non-standard exception" when it does not hold a std::exception.
inline std::string exception_text(const std::exception_ptr& p) {
  try {
    std::rethrow_exception(p);
  } catch (const std::exception& e) {
    return exception_text(e);
  } catch (...) {
    return "a non-standard exception";
  }
}

}  // namespace loom::detail
