// loom/detail/host_and_pid.hpp — "host:pid", the name of this process in loom's errors and flight
// records (which process failed, on which machine).
//
// Example: `loom::detail::host_and_pid()` -> "node7:41233"
// Errors: none; a host name that cannot be read is "?".
#pragma once

#include <array>
#include <string>
#include <unistd.h>

#include <fmt/format.h>

namespace loom::detail {

/// "host:pid" of the calling process (gethostname and getpid).
inline std::string host_and_pid() {
  std::array<char, 256> host{};
  if (gethostname(host.data(), host.size() - 1) != 0) host[0] = '?';
  return fmt::format("{}:{}", host.data(), static_cast<long>(getpid()));
}

}  // namespace loom::detail
