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

#include <exception>
#include <string>

#include <c10/util/Exception.h>

namespace loom::detail {

/// The text of an exception without LibTorch's C++ backtrace (c10::Error::what() carries one).
inline std::string exception_text(const std::exception& e) {
  if (const auto* ce = dynamic_cast<const c10::Error*>(&e)) return ce->what_without_backtrace();
  return e.what();
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
