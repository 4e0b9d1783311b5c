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
// 2. Which peer. Gloo's errors name a socket address of the connection that failed: its remote end
//    ("Connection closed by peer [127.0.0.1]:42929", "Read error [10.0.0.2]:5121: ...") or the
//    address the peer listens on. GlooPeerTable turns such an address into "peer rank r" from the
//    operating system's view of the sockets alone, without reading any Gloo type (Gloo's internals
//    and its rendezvous records differ between the Gloo releases inside LibTorch 1.13 and 2.x, and a
//    pip or zip LibTorch ships no Gloo headers to read them with):
//    - each rank lists the TCP sockets (connected and listening) that appeared in its process while
//      its Gloo device and process group were made (a snapshot of /proc/self/fd before, one after),
//      and the listening addresses that the Gloo of LibTorch 1.13 published in the store for its
//      pairs and closed once connected (read only where the record has that Gloo's layout);
//    - the ranks swap these lists with two small all-to-alls of the new process group (the counts,
//      then the records: 64 bytes per socket);
//    - a connection of this rank whose (local, remote) addresses are a peer's (remote, local) is a
//      connection to that peer; a peer's listening addresses are that peer's.
//    Sockets that only one side lists (a store connection made meanwhile) match no peer and are
//    left out; what cannot be read stays out of the table, and errors then say "a peer".
// 3. Failing fast everywhere. When a collective fails on a rank (a peer died, a timeout), Gloo closes
//    only the connection that failed (all of them on a timeout); the rank's other connections stay
//    open while its queued collectives wait for their own timeouts, so a peer waiting on this rank
//    learns nothing until then, and its error names no peer. GlooPeerTable::shutdown_connections()
//    shuts down every recorded socket of the communicator: every peer reads the end of its
//    connection to this rank at once and names it, and this rank's own queued collectives fail.
//
// Source: Gloo's TCP transport (gloo/transport/tcp/pair.cc: writev; Address::str() prints
//         "[ip]:port" with the port field as stored, i.e. in network byte order, then "$seq" when set);
//         socket(7), tcp(7) (SO_ACCEPTCONN), proc(5) (/proc/self/fd).
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
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <optional>
#include <signal.h>
#include <string>
#include <sys/socket.h>
#include <vector>

#include <ATen/ATen.h>
#include <dirent.h>
#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

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

/// One TCP socket of this process: its descriptor, local address and, when connected, remote
/// address (a listening socket has none: remote.port < 0).
struct GlooProcessSocket {
  int fd = -1;
  GlooSocketName local;
  GlooSocketName remote;
  friend auto operator<=>(const GlooProcessSocket&, const GlooProcessSocket&) = default;
};

/// Which peer a Gloo error's socket address names, and this rank's Gloo connections (see the header
/// comment). Empty (every lookup -1) when the sockets cannot be read (no /proc).
class GlooPeerTable {
 public:
  GlooPeerTable() = default;

  /// This process's TCP sockets now (connected and listening); take it right before the Gloo device
  /// and the process group are made, and hand it to build().
  static std::vector<GlooProcessSocket> snapshot() {
    std::vector<GlooProcessSocket> out;
    DIR* dir = ::opendir("/proc/self/fd");
    if (dir == nullptr) return out;
    while (const dirent* e = ::readdir(dir)) {
      char* end = nullptr;
      const long fd = std::strtol(e->d_name, &end, 10);
      if (end == e->d_name || *end != '\0' || fd == ::dirfd(dir)) continue;
      if (auto sock = read_socket(static_cast<int>(fd))) out.push_back(*sock);
    }
    ::closedir(dir);
    std::sort(out.begin(), out.end());
    return out;
  }

  /// Builds the table of a connected process group: call right after its constructor returned, on
  /// every rank (the swap is two all-to-alls of `pg`), with the snapshot taken before its device.
  /// Throws: what the all-to-alls throw when a peer fails meanwhile; nothing else.
  static GlooPeerTable build(c10d::ProcessGroupGloo& pg, c10d::Store& store, int devices,
                             const std::vector<GlooProcessSocket>& before, int rank, int world_size,
                             std::chrono::milliseconds timeout) {
    GlooPeerTable table;
    if (world_size < 2) return table;
    std::vector<GlooProcessSocket> mine;
    for (const auto& sock : snapshot())
      if (!std::binary_search(before.begin(), before.end(), sock)) mine.push_back(sock);
    // Listening sockets that Gloo closed again once its pairs were connected (one per pair in the
    // Gloo of LibTorch 1.13) are no longer in the snapshot; their addresses are in Gloo's address
    // exchange, which is read where it has the layout of that Gloo.
    auto listed = mine;
    for (const auto& name : published_listening_addresses(store, devices, rank, world_size, mine))
      listed.push_back({-1, name, {}});
    const auto lists = swap_socket_lists(pg, listed, rank, world_size, timeout);
    for (int j = 0; j < world_size; ++j) {
      if (j == rank) continue;
      for (const auto& theirs : lists[static_cast<std::size_t>(j)]) {
        if (theirs.remote.port < 0) {  // a listening socket of peer j
          table.add_name(theirs.local, j);
          continue;
        }
        for (const auto& own : mine)
          if (own.remote.port >= 0 && own.local == theirs.remote && own.remote == theirs.local) {
            table.add_name(own.remote, j);
            table.sockets_.push_back(own);
          }
      }
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

  /// Number of known socket addresses (tests).
  [[nodiscard]] std::size_t size() const noexcept { return entries_.size(); }

  /// Number of this rank's Gloo connections that shutdown_connections() would shut down (tests).
  [[nodiscard]] std::size_t connections() const noexcept { return sockets_.size(); }

  /// Number of this rank's Gloo connections that lead to `peer` (tests, diagnostics).
  [[nodiscard]] std::size_t connections_to(int peer) const noexcept {
    std::size_t n = 0;
    for (const auto& sock : sockets_)
      for (const auto& e : entries_)
        if (e.rank == peer && e.name == sock.remote) {
          ++n;
          break;
        }
    return n;
  }

  /// Shuts down (shutdown(2), SHUT_RDWR) every socket of this rank's Gloo connections, so each peer
  /// reads the end of its connection to this rank at once ("Connection closed by peer", naming this
  /// rank) instead of waiting for its timeout, and this rank's own pending operations fail. The
  /// descriptors stay open (Gloo closes them); a descriptor whose local and remote addresses are no
  /// longer the recorded ones (Gloo closed it and the number was reused) is left alone. Called when a
  /// collective failed: the communicator is broken from then on (c10d behaves the same).
  void shutdown_connections() const noexcept {
    for (const auto& sock : sockets_) {
      const auto now = read_socket(sock.fd);
      if (!now || *now != sock) continue;
      ::shutdown(sock.fd, SHUT_RDWR);
    }
  }

  /// This rank's recorded Gloo connections now: the first one whose descriptor no longer holds it
  /// (closed, or its number reused by another file), how many are still open, and the milliseconds
  /// since data last arrived on any open one (TCP_INFO's tcpi_last_data_recv; UINT32_MAX when none
  /// is open or none can be read). Gloo closes a connection's socket after an error on it (the peer
  /// closed or reset it, a read or write failed, a timeout) and when it reads the end of a peer that
  /// exited, and when the process group is destroyed. Cost: three system calls per connection.
  struct Now {
    std::optional<GlooProcessSocket> closed;
    std::size_t open = 0;
    std::uint32_t quiet_ms = UINT32_MAX;
  };
  [[nodiscard]] Now now() const {
    Now out;
    for (const auto& sock : sockets_) {
      const auto current = read_socket(sock.fd);
      if (!current || *current != sock) {
        if (!out.closed) out.closed = sock;
        continue;
      }
      ++out.open;
      tcp_info info{};
      socklen_t len = sizeof(info);
      if (::getsockopt(sock.fd, IPPROTO_TCP, TCP_INFO, &info, &len) == 0)
        out.quiet_ms = std::min(out.quiet_ms, static_cast<std::uint32_t>(info.tcpi_last_data_recv));
    }
    return out;
  }

  /// Adds a socket address of `peer_rank` (tests, and build()).
  void add(const sockaddr_storage& ss, int peer_rank) { add_name(socket_name(ss), peer_rank); }

  /// A socket address the way Gloo prints it: inet_ntop's text and the port field as stored
  /// (network byte order); port -1 for anything but IPv4 / IPv6.
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

 private:
  /// The socket behind `fd` when it is a connected or listening IPv4 / IPv6 socket.
  static std::optional<GlooProcessSocket> read_socket(int fd) {
    sockaddr_storage local{}, remote{};
    socklen_t llen = sizeof(local), rlen = sizeof(remote);
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &llen) != 0) return std::nullopt;
    if (local.ss_family != AF_INET && local.ss_family != AF_INET6) return std::nullopt;
    GlooProcessSocket sock{fd, socket_name(local), {}};
    if (::getpeername(fd, reinterpret_cast<sockaddr*>(&remote), &rlen) == 0) {
      sock.remote = socket_name(remote);
      return sock;
    }
    int listening = 0;
    socklen_t len = sizeof(listening);
    if (::getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &len) == 0 && listening != 0) return sock;
    return std::nullopt;
  }

  /// This rank's listening addresses as the Gloo of LibTorch 1.13 publishes them: key "<device>/<rank>"
  /// of the group's store holds one record per peer (rank order, this rank left out), each starting
  /// with the sockaddr_storage of this rank's listening socket for that pair. A Gloo that publishes
  /// another layout (LibTorch 2.x: one record per rank, one listener per device, which stays open and
  /// is in the snapshot) yields nothing here: a record counts only when it is an IPv4 / IPv6 address
  /// with a port, on an IP address that one of this rank's new sockets has.
  static std::vector<GlooSocketName> published_listening_addresses(c10d::Store& store, int devices, int rank,
                                                                   int world_size,
                                                                   const std::vector<GlooProcessSocket>& mine) {
    constexpr std::size_t kRecord = sizeof(sockaddr_storage);
    std::vector<GlooSocketName> out;
    const auto peers = static_cast<std::size_t>(world_size - 1);
    for (int d = 0; d < devices; ++d) {
      try {
        const std::string key = fmt::format("{}/{}", d, rank);
        if (!store.check({key})) continue;
        const auto bytes = store.get(key);
        if (bytes.size() % peers != 0 || bytes.size() / peers < kRecord) continue;
        const std::size_t record = bytes.size() / peers;
        for (std::size_t i = 0; i < peers; ++i) {
          sockaddr_storage ss{};
          std::memcpy(&ss, bytes.data() + i * record, kRecord);
          const auto name = socket_name(ss);
          if (name.port <= 0) continue;
          const bool own_ip =
              std::any_of(mine.begin(), mine.end(), [&](const GlooProcessSocket& m) { return m.local.ip == name.ip; });
          if (own_ip) out.push_back(name);
        }
      } catch (...) {
      }
    }
    return out;
  }

  // A socket record on the wire: 8 int64 words, local then remote, each as (port + 1, family,
  // address bytes 0-7, address bytes 8-15); port + 1 == 0 is "no address".
  static constexpr std::int64_t kWords = 8;

  static void encode(const GlooSocketName& name, std::int64_t* out) {
    out[0] = name.port + 1;
    unsigned char bytes[16] = {};
    if (name.port >= 0) {
      if (::inet_pton(AF_INET, name.ip.c_str(), bytes) == 1) {
        out[1] = AF_INET;
      } else if (::inet_pton(AF_INET6, name.ip.c_str(), bytes) == 1) {
        out[1] = AF_INET6;
      } else {
        out[0] = 0;
      }
    }
    std::memcpy(out + 2, bytes, sizeof(bytes));
  }

  static GlooSocketName decode(const std::int64_t* in) {
    if (in[0] <= 0) return {};
    unsigned char bytes[16];
    std::memcpy(bytes, in + 2, sizeof(bytes));
    char ip[INET6_ADDRSTRLEN] = {};
    const int family = in[1] == AF_INET6 ? AF_INET6 : AF_INET;
    if (::inet_ntop(family, bytes, ip, sizeof(ip)) == nullptr) return {};
    return {ip, in[0] - 1};
  }

  /// Every rank's list of new sockets (index = rank): the counts, then the records padded to the
  /// longest list, each through one all-to-all that sends this rank's data to every rank.
  static std::vector<std::vector<GlooProcessSocket>> swap_socket_lists(c10d::ProcessGroupGloo& pg,
                                                                       const std::vector<GlooProcessSocket>& mine,
                                                                       int rank, int world_size,
                                                                       std::chrono::milliseconds timeout) {
    auto all_to_all = [&](const at::Tensor& row) {  // row: this rank's data; returns [world_size, n]
      auto send = row.reshape({1, -1}).repeat({world_size, 1}).contiguous();
      auto receive = at::zeros_like(send);
      std::vector<std::int64_t> counts;
      c10d::AllToAllOptions opts;
      opts.timeout = timeout;
      pg.alltoall_base(receive, send, counts, counts, opts)->wait(timeout);
      return receive;
    };
    const auto counts = all_to_all(at::full({1}, static_cast<std::int64_t>(mine.size()), at::kLong));
    const std::int64_t longest = counts.max().item<std::int64_t>();
    std::vector<std::vector<GlooProcessSocket>> lists(static_cast<std::size_t>(world_size));
    if (longest == 0) return lists;
    auto row = at::zeros({longest * kWords}, at::kLong);
    auto* out = row.data_ptr<std::int64_t>();
    for (std::size_t i = 0; i < mine.size(); ++i) {
      encode(mine[i].local, out + i * kWords);
      encode(mine[i].remote, out + i * kWords + kWords / 2);
    }
    const auto received = all_to_all(row);
    const auto* in = received.data_ptr<std::int64_t>();
    for (int j = 0; j < world_size; ++j) {
      if (j == rank) continue;
      const std::int64_t n = std::min(counts[j].item<std::int64_t>(), longest);
      for (std::int64_t i = 0; i < n; ++i) {
        const auto* rec = in + (j * longest + i) * kWords;
        GlooProcessSocket sock{-1, decode(rec), decode(rec + kWords / 2)};
        if (sock.local.port >= 0) lists[static_cast<std::size_t>(j)].push_back(sock);
      }
    }
    return lists;
  }

  /// Adds `name` for `peer_rank` as Gloo prints it (port in network byte order) and with the port in
  /// host order, in case a Gloo release prints it that way.
  void add_name(const GlooSocketName& name, int peer_rank) {
    if (name.port < 0) return;
    entries_.push_back({name, peer_rank});
    const long host_port = ntohs(static_cast<std::uint16_t>(name.port));
    if (host_port != name.port) entries_.push_back({{name.ip, host_port}, peer_rank});
  }

  struct Entry {
    GlooSocketName name;
    int rank = -1;
  };
  std::vector<Entry> entries_;
  std::vector<GlooProcessSocket> sockets_;
};

}  // namespace loom::detail

#endif  // LOOM_HAS_GLOO && USE_C10D_GLOO
