// loom/comm/detail/gloo_peers.hpp — the parts of GlooCommunicator that keep a dead peer from
// killing a rank and let the error say which peer it was (used by loom/comm/gloo.hpp).
//
// 1. SIGPIPE. Gloo's TCP transport sends with writev(2), without MSG_NOSIGNAL. After a peer's socket
//    is gone, the first write draws a reset and a later write fails with EPIPE, which also raises
//    SIGPIPE in the writing thread; with the default disposition that kills the whole process before
//    Gloo can report the error. ignore_sigpipe_if_default() sets SIGPIPE to SIG_IGN in the whole
//    process when (and only when) its disposition is still SIG_DFL, so writes fail with EPIPE and
//    Gloo turns that into an error. A handler the program installed, or SIG_IGN, is left as it is.
//    This is what CPython does at start-up (so PyTorch users never meet the signal) and what Gloo's
//    own tests do.
// 2. Which peer. Gloo's errors name the address its pair holds for the peer ("Connection closed by
//    peer [127.0.0.1]:42929", "Read error [10.0.0.2]:5121: Connection reset by peer"). That address is
//    the remote end of the connection, or, when the peer connected before this rank called connect()
//    on the pair (Gloo then overwrites the accepted address with the one it was told), the address
//    the peer listened on for this pair. GlooPeerTable holds both, built once right after the process
//    group connected:
//    - remote ends: for each peer r, Gloo's pair gives the local address of the connection to r
//      (transport::Pair::address()); the process's socket with that local address gives the remote
//      one (getpeername(2));
//    - listening addresses: each rank reads its own keys of Gloo's address exchange ("<device>/<rank>"
//      under the communicator's store prefix: one record per peer) and the ranks swap the records
//      with one all-to-all (one record per rank pair and device, O(world size) bytes per rank).
//    So a message naming either address becomes "peer rank r". Only virtual calls and data members of
//    Gloo are used (nothing needs a Gloo symbol at link time); what cannot be read stays out of the
//    table, and errors then say "a peer".
// 3. Failing fast everywhere. When a collective fails on a rank (a peer died, a timeout), Gloo closes
//    only the connection that failed (all of them on a timeout); the rank's other connections stay
//    open while its queued collectives wait for their own timeouts, so a peer waiting on this rank
//    learns nothing until then, and its error names no peer. GlooPeerTable::shutdown_connections()
//    shuts down every recorded socket of the communicator: every peer reads the end of its
//    connection to this rank at once and names it, and this rank's own queued collectives fail.
//
// Source: Gloo's TCP transport (gloo/transport/tcp/pair.cc: writev; Address::str() prints
//         "[ip]:port" with the port field as stored, i.e. in network byte order, then "$seq" when set),
//         c10d::ProcessGroupGloo's one gloo::Context per device.
#pragma once

#include <loom/config.hpp>

#if LOOM_HAS_GLOO && defined(USE_C10D_GLOO)

#include <algorithm>
#include <arpa/inet.h>
#include <cctype>
#include <chrono>
#include <compare>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <netinet/in.h>
#include <signal.h>
#include <string>
#include <sys/socket.h>
#include <vector>

#include <ATen/ATen.h>
#include <dirent.h>
#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

// The table needs gloo::transport::Context (its pairs); a LibTorch whose Gloo headers lack it still
// builds, and errors then name the peer only where it is unambiguous (two ranks).
#if __has_include(<gloo/context.h>) && __has_include(<gloo/transport/context.h>)
#include <gloo/context.h>
#include <gloo/transport/address.h>
#include <gloo/transport/context.h>
#include <gloo/transport/pair.h>
#define LOOM_GLOO_PEER_TABLE 1
#else
#define LOOM_GLOO_PEER_TABLE 0
#endif

namespace loom::detail {

/// Sets SIGPIPE to SIG_IGN for the whole process if its disposition is SIG_DFL; see the header
/// comment. Returns true when it changed the disposition. Thread-safe enough: two threads racing here
/// both install SIG_IGN.
inline bool ignore_sigpipe_if_default() noexcept {
  struct sigaction current {};
  if (::sigaction(SIGPIPE, nullptr, &current) != 0) return false;
  if ((current.sa_flags & SA_SIGINFO) != 0 || current.sa_handler != SIG_DFL) return false;
  struct sigaction ignore {};
  ignore.sa_handler = SIG_IGN;
  sigemptyset(&ignore.sa_mask);
  return ::sigaction(SIGPIPE, &ignore, nullptr) == 0;
}

/// One "[ip]:port" socket address as Gloo prints it.
struct GlooSocketName {
  std::string ip;
  long port = -1;
  friend auto operator<=>(const GlooSocketName&, const GlooSocketName&) = default;
};

/// Every "[ip]:port" in `text` (Gloo's messages; its "[file.cc:line]" prefixes do not match: an
/// address holds only hexadecimal digits, '.' and ':').
inline std::vector<GlooSocketName> parse_gloo_socket_names(const std::string& text) {
  std::vector<GlooSocketName> out;
  std::size_t pos = 0;
  while ((pos = text.find('[', pos)) != std::string::npos) {
    const std::size_t close = text.find(']', pos + 1);
    if (close == std::string::npos) break;
    const std::string ip = text.substr(pos + 1, close - pos - 1);
    bool ok = !ip.empty();
    for (char c : ip) ok = ok && (std::isxdigit(static_cast<unsigned char>(c)) != 0 || c == '.' || c == ':');
    std::size_t p = close + 1;
    if (ok && p + 1 < text.size() && text[p] == ':' && std::isdigit(static_cast<unsigned char>(text[p + 1])) != 0) {
      long port = 0;
      ++p;
      while (p < text.size() && std::isdigit(static_cast<unsigned char>(text[p])) != 0 && port < 1'000'000)
        port = port * 10 + (text[p++] - '0');
      out.push_back({ip, port});
    }
    pos = close;
  }
  return out;
}

/// The remote socket address of each of this rank's Gloo connections, with the peer's rank; turns a
/// Gloo error's "[ip]:port" into a rank. Empty (every lookup -1) when the transport is not Gloo's TCP.
class GlooPeerTable {
 public:
  GlooPeerTable() = default;

  /// Builds the table of a connected process group (call right after its constructor returned, on
  /// every rank: the listening-address swap is a collective). `store` is the store the group was
  /// created with (Gloo's keys are under it).
  /// Throws: what the all-to-all throws when a peer fails meanwhile; nothing else (unreadable parts
  /// are left out).
  static GlooPeerTable build(c10d::ProcessGroupGloo& pg, c10d::Store& store, int rank, int world_size,
                             std::chrono::milliseconds timeout) {
    GlooPeerTable table;
#if LOOM_GLOO_PEER_TABLE
    try {
      table.add_remote_ends(pg, rank);
    } catch (...) {
      table.entries_.clear();
      table.sockets_.clear();
    }
#else
    (void)pg;
#endif
    if (world_size > 1) {
      int devices = 1;
#if LOOM_GLOO_PEER_TABLE
      devices = static_cast<int>((pg.*(&ContextsOf::contexts_)).size());
#endif
      table.swap_listening_addresses(pg, store, rank, world_size, std::max(devices, 1), timeout);
    }
    return table;
  }

  /// The rank whose socket address `text` (a Gloo message) names, or -1 when none or several match.
  [[nodiscard]] int rank_named_in(const std::string& text) const {
    int found = -1;
    for (const auto& name : parse_gloo_socket_names(text))
      for (const auto& e : entries_)
        if (e.name == name) {
          if (found >= 0 && found != e.rank) return -1;
          found = e.rank;
        }
    return found;
  }

  /// Number of known connections (tests).
  [[nodiscard]] std::size_t size() const noexcept {
    return entries_.size();
  }

  /// Number of this rank's Gloo sockets that shutdown_connections() would shut down (tests).
  [[nodiscard]] std::size_t connections() const noexcept {
    return sockets_.size();
  }

  /// Shuts down (shutdown(2), SHUT_RDWR) every socket of this rank's Gloo connections, so each peer
  /// reads the end of its connection to this rank at once ("Connection closed by peer", naming this
  /// rank) instead of waiting for its timeout, and this rank's own pending operations fail. The
  /// descriptors stay open (Gloo closes them); a descriptor whose local and remote addresses are no
  /// longer the recorded ones (Gloo closed it and the number was reused) is left alone. Called when a
  /// collective failed: the communicator is broken from then on (c10d behaves the same).
  void shutdown_connections() const noexcept {
    for (const auto& sock : sockets_) {
      sockaddr_storage local{}, remote{};
      socklen_t llen = sizeof(local), rlen = sizeof(remote);
      if (::getsockname(sock.fd, reinterpret_cast<sockaddr*>(&local), &llen) != 0) continue;
      if (::getpeername(sock.fd, reinterpret_cast<sockaddr*>(&remote), &rlen) != 0) continue;
      if (socket_name(local) != sock.local || socket_name(remote) != sock.remote) continue;
      ::shutdown(sock.fd, SHUT_RDWR);
    }
  }

  /// Adds a remote socket address for `peer_rank`, as Gloo prints it (port in network byte order)
  /// and with the port in host order, in case a Gloo release prints it that way.
  void add(const sockaddr_storage& ss, int peer_rank) {
    const auto name = socket_name(ss);
    if (name.port < 0) return;
    entries_.push_back({name, peer_rank});
    const long host_port = ntohs(static_cast<std::uint16_t>(name.port));
    if (host_port != name.port) entries_.push_back({{name.ip, host_port}, peer_rank});
  }

  /// Remote ends of this rank's Gloo connections (see the header comment).
  void add_remote_ends(c10d::ProcessGroupGloo& pg, int rank) {
#if LOOM_GLOO_PEER_TABLE
    const auto remote_of = connected_sockets();
    for (const auto& context : pg.*(&ContextsOf::contexts_)) {
      if (!context) continue;
      const auto& transport = (*context).*(&TransportOf::transportContext_);
      if (!transport) continue;
      const auto& pairs = (*transport).*(&PairsOf::pairs_);
      for (std::size_t r = 0; r < pairs.size(); ++r) {
        if (!pairs[r] || static_cast<int>(r) == rank) continue;
        const auto local = parse_gloo_socket_names(pairs[r]->address().str());
        if (local.size() != 1) continue;
        auto it = remote_of.find(local.front());
        if (it == remote_of.end())  // a Gloo that prints the port in host order
          it = remote_of.find(
              {local.front().ip, static_cast<long>(htons(static_cast<std::uint16_t>(local.front().port)))});
        if (it != remote_of.end()) {
          add(it->second.remote, static_cast<int>(r));
          sockets_.push_back({it->second.fd, it->first, socket_name(it->second.remote)});
        }
      }
    }
#else
    (void)pg;
    (void)rank;
#endif
  }

  /// Listening addresses (see the header comment): this rank's record for peer j on device d goes to
  /// j, j's record for this rank comes back. A rank that cannot read its keys sends zeros (left out by
  /// add()).
  void swap_listening_addresses(c10d::ProcessGroupGloo& pg, c10d::Store& store, int rank, int world_size, int devices,
                                std::chrono::milliseconds timeout) {
    constexpr std::size_t kRecord = sizeof(sockaddr_storage);
    static_assert(kRecord % sizeof(std::int64_t) == 0);
    const auto words = static_cast<std::int64_t>(kRecord / sizeof(std::int64_t)) * devices;
    // Slot j (j = 0..world_size-1) holds `devices` records for rank j.
    auto send = at::zeros({world_size * words}, at::kLong);
    auto* out = reinterpret_cast<unsigned char*>(send.data_ptr<std::int64_t>());
    const auto peers = static_cast<std::size_t>(world_size - 1);
    for (int d = 0; d < devices; ++d) {
      try {
        // Gloo's key of device d: one record per peer in rank order (this rank left out); a record
        // starts with the sockaddr_storage of the pair's listening socket.
        const std::string key = fmt::format("{}/{}", d, rank);
        if (!store.check({key})) continue;
        const auto bytes = store.get(key);
        if (bytes.size() % peers != 0 || bytes.size() / peers < kRecord) continue;
        const std::size_t record = bytes.size() / peers;
        for (int j = 0; j < world_size; ++j) {
          if (j == rank) continue;
          const std::size_t index = static_cast<std::size_t>(j > rank ? j - 1 : j);
          std::memcpy(out + (static_cast<std::size_t>(j) * devices + d) * kRecord, bytes.data() + index * record,
                      kRecord);
        }
      } catch (...) {
      }
    }
    auto receive = at::zeros_like(send);
    std::vector<std::int64_t> counts;
    c10d::AllToAllOptions opts;
    opts.timeout = timeout;
    pg.alltoall_base(receive, send, counts, counts, opts)->wait(timeout);
    const auto* in = reinterpret_cast<const unsigned char*>(receive.data_ptr<std::int64_t>());
    for (int j = 0; j < world_size; ++j) {
      if (j == rank) continue;
      for (int d = 0; d < devices; ++d) {
        sockaddr_storage ss{};
        std::memcpy(&ss, in + (static_cast<std::size_t>(j) * devices + d) * kRecord, kRecord);
        add(ss, j);
      }
    }
  }

  /// A socket address the way Gloo prints it: inet_ntop's text and the port field as stored.
  static GlooSocketName socket_name(const sockaddr_storage& ss) {
    char ip[INET6_ADDRSTRLEN] = {};
    if (ss.ss_family == AF_INET) {
      const auto* in = reinterpret_cast<const sockaddr_in*>(&ss);
      if (::inet_ntop(AF_INET, &in->sin_addr, ip, sizeof(ip)) != nullptr) return {ip, static_cast<long>(in->sin_port)};
    } else if (ss.ss_family == AF_INET6) {
      const auto* in6 = reinterpret_cast<const sockaddr_in6*>(&ss);
      if (::inet_ntop(AF_INET6, &in6->sin6_addr, ip, sizeof(ip)) != nullptr)
        return {ip, static_cast<long>(in6->sin6_port)};
    }
    return {};
  }

  /// A connected TCP socket of this process: its descriptor and remote address.
  struct ConnectedSocket {
    int fd = -1;
    sockaddr_storage remote{};
  };

  /// This process's connected TCP sockets: local address (as Gloo prints it) -> descriptor and
  /// remote address.
  static std::map<GlooSocketName, ConnectedSocket> connected_sockets() {
    std::map<GlooSocketName, ConnectedSocket> out;
    DIR* dir = ::opendir("/proc/self/fd");
    if (dir == nullptr) return out;
    while (const dirent* e = ::readdir(dir)) {
      char* end = nullptr;
      const long fd = std::strtol(e->d_name, &end, 10);
      if (end == e->d_name || *end != '\0' || fd == ::dirfd(dir)) continue;
      sockaddr_storage local{}, remote{};
      socklen_t llen = sizeof(local), rlen = sizeof(remote);
      if (::getsockname(static_cast<int>(fd), reinterpret_cast<sockaddr*>(&local), &llen) != 0) continue;
      if (local.ss_family != AF_INET && local.ss_family != AF_INET6) continue;
      if (::getpeername(static_cast<int>(fd), reinterpret_cast<sockaddr*>(&remote), &rlen) != 0) continue;
      out.emplace(socket_name(local), ConnectedSocket{static_cast<int>(fd), remote});
    }
    ::closedir(dir);
    return out;
  }

 private:
#if LOOM_GLOO_PEER_TABLE
  // Named access to three protected members (c10d::ProcessGroupGloo::contexts_, gloo::Context's
  // transport context and gloo::transport::Context's pairs): a pointer to a base's member taken
  // through a derived class that makes it public. None of these classes is ever instantiated.
  struct ContextsOf : c10d::ProcessGroupGloo {
    using c10d::ProcessGroupGloo::contexts_;
  };
  struct TransportOf : ::gloo::Context {
    using ::gloo::Context::transportContext_;
  };
  struct PairsOf : ::gloo::transport::Context {
    using ::gloo::transport::Context::pairs_;
  };
#endif

  struct Entry {
    GlooSocketName name;
    int rank = -1;
  };
  /// One of this rank's Gloo connections: descriptor, local and remote address when recorded.
  struct Socket {
    int fd = -1;
    GlooSocketName local;
    GlooSocketName remote;
  };
  std::vector<Entry> entries_;
  std::vector<Socket> sockets_;
};

}  // namespace loom::detail

#endif  // LOOM_HAS_GLOO && USE_C10D_GLOO
