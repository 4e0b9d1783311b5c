// loom/comm/detail/gloo_device.hpp — which network address a rank's Gloo device listens on and
// advertises to its peers (used by loom/comm/gloo.hpp; the rule is documented in docs/launching.md).
//
// The rule, first match wins:
//   1. GlooOptions::interface is set: those interfaces ("eth0", or a comma-separated list
//      "eth0,eth1": one Gloo device each, collectives spread over them round-robin).
//   2. GLOO_SOCKET_IFNAME is set: the same, read from the environment (PyTorch's variable, which its
//      Python layer reads and c10d's C++ constructor does not; loom reads it here).
//   3. MASTER_ADDR resolves to a loopback address (127.0.0.1, localhost, ::1): 127.0.0.1 — every rank
//      is on this machine.
//   4. This host's name resolves to a loopback address, or to nothing (Debian's default
//      "127.0.1.1 <hostname>" line in /etc/hosts, most containers): the local address that routes to
//      MASTER_ADDR (the source address the kernel picks for a connection there; no packet is sent).
//      Advertising the loopback address would make peers on other hosts connect to themselves.
//   5. Otherwise: Gloo's default device (the address this host's name resolves to).
// An interface that does not exist or has no address is a loom::ConfigError naming it and where it
// came from, with the interfaces this host has.
//
// Source: PyTorch's GLOO_SOCKET_IFNAME (comma-separated list, one device per interface, as
//         torch.distributed's Python layer does); c10d::ProcessGroupGloo::createDeviceForInterface /
//         createDeviceForHostname / createDefaultDevice.
#pragma once

#include <loom/config.hpp>

#if LOOM_HAS_GLOO && defined(USE_C10D_GLOO)

#include <arpa/inet.h>
#include <array>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <netinet/in.h>
#include <set>
#include <string>
#include <sys/socket.h>
#include <unistd.h>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <loom/error.hpp>

namespace loom::detail {

/// Where a rank's Gloo device comes from (rule 1-5 of the header comment).
struct GlooDeviceChoice {
  enum class Kind {
    interfaces,       ///< rule 1 or 2: `interfaces`, from `source`
    loopback,         ///< rule 3: `address` is 127.0.0.1 (or ::1)
    route_to_master,  ///< rule 4: `address` is the local address that routes to MASTER_ADDR
    host_name,        ///< rule 5: Gloo's default device
  };
  Kind kind = Kind::host_name;
  std::vector<std::string> interfaces{};
  std::string source{};   ///< "GlooOptions::interface" or "GLOO_SOCKET_IFNAME"
  std::string address{};  ///< loopback / route_to_master
  std::string reason{};   ///< one phrase, for messages

  /// E.g. "198.18.0.2 (the local address that routes to MASTER_ADDR 198.18.0.1; this host's name
  /// 'hostb' resolves to loopback)".
  [[nodiscard]] std::string describe() const {
    switch (kind) {
      case Kind::interfaces: return fmt::format("interface(s) {} ({})", fmt::join(interfaces, ","), reason);
      case Kind::loopback:
      case Kind::route_to_master: return fmt::format("{} ({})", address, reason);
      case Kind::host_name: return fmt::format("Gloo's default device ({})", reason);
    }
    return "?";
  }
};

/// "eth0, eth1" -> {"eth0", "eth1"}; blanks and empty entries dropped.
inline std::vector<std::string> split_interface_list(const std::string& list) {
  std::vector<std::string> out;
  std::size_t start = 0;
  while (start <= list.size()) {
    std::size_t end = list.find(',', start);
    if (end == std::string::npos) end = list.size();
    std::string item = list.substr(start, end - start);
    const auto first = item.find_first_not_of(" \t");
    const auto last = item.find_last_not_of(" \t");
    if (first != std::string::npos) out.push_back(item.substr(first, last - first + 1));
    start = end + 1;
  }
  return out;
}

/// Which rule applies (the decision alone, for tests; see the header comment).
inline GlooDeviceChoice::Kind gloo_device_rule(bool option_set, bool env_set, bool master_is_loopback,
                                               bool host_name_is_loopback) noexcept {
  if (option_set || env_set) return GlooDeviceChoice::Kind::interfaces;
  if (master_is_loopback) return GlooDeviceChoice::Kind::loopback;
  if (host_name_is_loopback) return GlooDeviceChoice::Kind::route_to_master;
  return GlooDeviceChoice::Kind::host_name;
}

/// True for an IPv4 address in 127.0.0.0/8 or the IPv6 loopback address.
inline bool is_loopback_sockaddr(const sockaddr* sa) noexcept {
  if (sa->sa_family == AF_INET) return (ntohl(reinterpret_cast<const sockaddr_in*>(sa)->sin_addr.s_addr) >> 24) == 127;
  if (sa->sa_family == AF_INET6) {
    const auto& a = reinterpret_cast<const sockaddr_in6*>(sa)->sin6_addr;
    if (IN6_IS_ADDR_LOOPBACK(&a)) return true;
    if (IN6_IS_ADDR_V4MAPPED(&a)) return a.s6_addr[12] == 127;
  }
  return false;
}

/// Whether `host` (a name or an address) resolves, and whether every address it resolves to is a
/// loopback address.
struct Resolution {
  bool resolves = false;
  bool loopback = false;
};

inline Resolution resolve_host(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (host.empty() || ::getaddrinfo(host.c_str(), nullptr, &hints, &res) != 0 || res == nullptr) return {};
  bool all = true;
  for (auto* p = res; p != nullptr; p = p->ai_next) all = all && is_loopback_sockaddr(p->ai_addr);
  ::freeaddrinfo(res);
  return {true, all};
}

/// This host's name (gethostname).
inline std::string this_host_name() {
  std::array<char, 256> buf{};
  if (::gethostname(buf.data(), buf.size() - 1) != 0) return {};
  return buf.data();
}

/// The local address the kernel would use for a connection to `host` (a UDP socket connected there:
/// no packet is sent). Throws loom::ConfigError naming MASTER_ADDR when it does not resolve or no
/// route leads there.
inline std::string local_address_toward(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  if (const int rc = ::getaddrinfo(host.c_str(), "9", &hints, &res); rc != 0 || res == nullptr)
    throw ConfigError(fmt::format("MASTER_ADDR '{}' does not resolve ({}), so no local address routes to it", host,
                                  ::gai_strerror(rc)));
  std::string last_error = "no address";
  for (auto* p = res; p != nullptr; p = p->ai_next) {
    const int fd = ::socket(p->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    if (::connect(fd, p->ai_addr, p->ai_addrlen) != 0) {
      last_error = std::strerror(errno);
      ::close(fd);
      continue;
    }
    sockaddr_storage local{};
    socklen_t len = sizeof(local);
    const int got = ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len);
    ::close(fd);
    if (got != 0) continue;
    char text[INET6_ADDRSTRLEN] = {};
    const void* where = local.ss_family == AF_INET
                            ? static_cast<const void*>(&reinterpret_cast<const sockaddr_in*>(&local)->sin_addr)
                            : static_cast<const void*>(&reinterpret_cast<const sockaddr_in6*>(&local)->sin6_addr);
    if (::inet_ntop(local.ss_family, where, text, sizeof(text)) != nullptr) {
      ::freeaddrinfo(res);
      return text;
    }
  }
  ::freeaddrinfo(res);
  throw ConfigError(fmt::format("no route from this host to MASTER_ADDR '{}' ({})", host, last_error));
}

/// Names of this host's interfaces that have an IPv4 or IPv6 address.
inline std::set<std::string> interfaces_with_address() {
  std::set<std::string> out;
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return out;
  for (auto* p = list; p != nullptr; p = p->ifa_next)
    if (p->ifa_addr != nullptr && (p->ifa_addr->sa_family == AF_INET || p->ifa_addr->sa_family == AF_INET6))
      out.insert(p->ifa_name);
  ::freeifaddrs(list);
  return out;
}

/// Applies the rule of the header comment. `option` is GlooOptions::interface; `env_ifname` the value
/// of GLOO_SOCKET_IFNAME (nullptr when unset).
/// Throws: loom::ConfigError for an interface this host does not have (naming it, its source and the
/// interfaces there are), or when rule 4 finds no route to MASTER_ADDR.
inline GlooDeviceChoice choose_gloo_device(const std::string& option, const char* env_ifname,
                                           const std::string& master_addr) {
  GlooDeviceChoice c;
  const bool option_set = !split_interface_list(option).empty();
  const bool env_set = env_ifname != nullptr && !split_interface_list(env_ifname).empty();
  const std::string host = this_host_name();
  const Resolution master = (option_set || env_set) ? Resolution{} : resolve_host(master_addr);
  const Resolution self = (option_set || env_set || master.loopback) ? Resolution{} : resolve_host(host);
  c.kind = gloo_device_rule(option_set, env_set, master.loopback, !self.resolves || self.loopback);
  switch (c.kind) {
    case GlooDeviceChoice::Kind::interfaces: {
      c.source = option_set ? "GlooOptions::interface" : "GLOO_SOCKET_IFNAME";
      const std::string value = option_set ? option : std::string(env_ifname);
      c.interfaces = split_interface_list(value);
      c.reason = fmt::format("{}='{}'", c.source, value);
      const auto present = interfaces_with_address();
      for (const auto& name : c.interfaces)
        if (present.count(name) == 0)
          throw ConfigError(
              fmt::format("{}='{}': host '{}' has no network interface '{}' with an address (its "
                          "interfaces: {})",
                          c.source, value, host, name, fmt::join(present, ", ")));
      break;
    }
    case GlooDeviceChoice::Kind::loopback:
      c.address = master_addr == "::1" ? "::1" : "127.0.0.1";
      c.reason = fmt::format("MASTER_ADDR '{}' is a loopback address: every rank is on this host", master_addr);
      break;
    case GlooDeviceChoice::Kind::route_to_master:
      c.address = local_address_toward(master_addr);
      c.reason = fmt::format("the local address that routes to MASTER_ADDR {}; this host's name '{}' {}", master_addr,
                             host, self.resolves ? "resolves to loopback" : "does not resolve");
      break;
    case GlooDeviceChoice::Kind::host_name:
      c.reason = fmt::format("the address this host's name '{}' resolves to", host);
      break;
  }
  return c;
}

/// The Gloo devices of a choice (one per interface for Kind::interfaces).
inline std::vector<std::shared_ptr<::gloo::transport::Device>> make_gloo_devices(const GlooDeviceChoice& c) {
  std::vector<std::shared_ptr<::gloo::transport::Device>> out;
  switch (c.kind) {
    case GlooDeviceChoice::Kind::interfaces:
      for (const auto& name : c.interfaces) out.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(name));
      break;
    case GlooDeviceChoice::Kind::loopback:
    case GlooDeviceChoice::Kind::route_to_master:
      out.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(c.address));
      break;
    case GlooDeviceChoice::Kind::host_name: out.push_back(c10d::ProcessGroupGloo::createDefaultDevice()); break;
  }
  return out;
}

}  // namespace loom::detail

#endif  // LOOM_HAS_GLOO && USE_C10D_GLOO
