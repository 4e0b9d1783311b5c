// loom/launch/detail/store_contact.hpp — how a rank reaches the job's store: a plain TCP connect
// timed to the millisecond (port_answers), c10d's client connect and the read of the store's
// identity on a helper thread bounded by a deadline (contact_store: a server that accepts and never
// answers costs no more than the deadline), and the listening MASTER_PORT socket loom::spawn hands
// to rank 0 (take_spawned_listen_fd). Not a public header: loom/launch/rendezvous.hpp is.
//
// Example: `auto c = detail::contact_store(addr, opts, /*identify=*/true, deadline);`
//          `if (c.outcome == detail::StoreContact::Outcome::connected) store = c.store;`
// Source: c10d's TCPStore client; connect(2), poll(2), getsockname(2), SO_ACCEPTCONN (socket(7)).
#pragma once

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <netinet/in.h>
#include <poll.h>
#include <string>
#include <sys/socket.h>
#include <thread>
#include <unistd.h>
#include <utility>

#include <c10/util/intrusive_ptr.h>
#include <netdb.h>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <loom/detail/exception_text.hpp>
#include <loom/launch/detail/check_in.hpp>
#include <loom/launch/detail/store_identity.hpp>

namespace loom::detail {

/// How a client's contact with the store at MASTER_ADDR:MASTER_PORT ended.
struct StoreContact {
  enum class Outcome {
    connected,  ///< `store` is connected; `identity` holds its owner's line (when asked for)
    failed,     ///< c10d threw `error` (refused, reset, timed out): worth another try
    silent,     ///< the deadline passed inside c10d's connect: the server never answered a request
    anonymous,  ///< a store answered but no loom rank 0 said it was theirs before the deadline
  };
  Outcome outcome = Outcome::failed;
  c10::intrusive_ptr<c10d::Store> store;
  std::string identity;
  std::string error;
};

/// Connects a c10d client to `addr` with `opts` and, when `identify`, waits for the store's
/// identity key; all of it on a helper thread, so that a server which accepts connections and never
/// answers (a program that is not a store) costs this rank no more than `deadline`. A helper left
/// waiting inside c10d owns what it uses and ends when c10d gives up.
inline StoreContact contact_store(const std::string& addr, c10d::TCPStoreOptions opts, bool identify,
                                  std::chrono::steady_clock::time_point deadline) {
  struct Shared {
    std::mutex m;
    std::condition_variable cv;
    bool done = false;
    bool connected = false;
    StoreContact contact;
  };
  auto shared = std::make_shared<Shared>();
  std::thread([shared, addr, opts, identify, deadline] {
    StoreContact c;
    try {
      auto store = c10::make_intrusive<c10d::TCPStore>(addr, opts);
      // The first request a store answers at once (LibTorch 1.13's connect sends none; a server
      // that never answers is still "connecting" at the deadline).
      const bool identified = store->check({kStoreIdentityKey});
      {
        std::lock_guard lock(shared->m);
        shared->connected = true;
      }
      c.store = store;
      c.outcome = StoreContact::Outcome::connected;
      if (identify) {
        try {
          // Polled: the rank 0 that hosts the store writes it right after starting it.
          bool there = identified;
          while (!there && std::chrono::steady_clock::now() < deadline) {
            std::this_thread::sleep_for(std::chrono::milliseconds(5));
            there = store->check({kStoreIdentityKey});
          }
          if (there)
            c.identity = store_text(store->get(kStoreIdentityKey));
          else
            c.outcome = StoreContact::Outcome::anonymous;
        } catch (const std::exception& e) {
          c.outcome = StoreContact::Outcome::anonymous;
          c.error = exception_text(e);
        }
      }
    } catch (const std::exception& e) {
      c.outcome = StoreContact::Outcome::failed;
      c.error = exception_text(e);
    }
    {
      std::lock_guard lock(shared->m);
      shared->contact = std::move(c);
      shared->done = true;
    }
    shared->cv.notify_all();
  }).detach();
  std::unique_lock lock(shared->m);
  if (!shared->cv.wait_until(lock, deadline, [&] { return shared->done; })) {
    StoreContact c;
    c.outcome = shared->connected ? StoreContact::Outcome::anonymous : StoreContact::Outcome::silent;
    return c;
  }
  return std::move(shared->contact);
}

/// Whether a TCP connection to host:port succeeds within `timeout` (retried every 50 ms while it is
/// refused). A plain connect, closed at once: the rendezvous's millisecond-exact wait for the store.
inline bool port_answers(const std::string& host, std::uint16_t port, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  for (;;) {
    addrinfo* res = nullptr;
    if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) == 0) {
      for (auto* p = res; p != nullptr; p = p->ai_next) {
        const int fd = ::socket(p->ai_family, p->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, p->ai_protocol);
        if (fd < 0) continue;
        bool ok = ::connect(fd, p->ai_addr, p->ai_addrlen) == 0;
        if (!ok && errno == EINPROGRESS) {
          const auto left =
              std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
          pollfd pfd{fd, POLLOUT, 0};
          int err = 0;
          socklen_t len = sizeof(err);
          ok = left.count() > 0 && ::poll(&pfd, 1, static_cast<int>(left.count())) == 1 &&
               ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0 && err == 0;
        }
        ::close(fd);
        if (ok) {
          ::freeaddrinfo(res);
          return true;
        }
      }
      ::freeaddrinfo(res);
    }
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) return false;
    std::this_thread::sleep_for(
        std::min<std::chrono::steady_clock::duration>(std::chrono::milliseconds(50), deadline - now));
  }
}

/// The listening MASTER_PORT socket loom::spawn handed to this process (LOOM_MASTER_LISTEN_FD), or
/// -1: none was handed over, it was taken already (once per process: the store that took it closes
/// it), or the descriptor is not a listening socket on `port` (a variable inherited by another program).
inline int take_spawned_listen_fd(std::uint16_t port) {
  static std::atomic<bool> taken{false};
  const char* text = std::getenv("LOOM_MASTER_LISTEN_FD");
  if (text == nullptr || taken.load()) return -1;
  char* end = nullptr;
  const long fd = std::strtol(text, &end, 10);
  if (end == text || *end != '\0' || fd < 0 || fd > 1 << 20) return -1;
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  int listening = 0;
  socklen_t opt_len = sizeof(listening);
  if (::getsockname(static_cast<int>(fd), reinterpret_cast<sockaddr*>(&addr), &len) != 0 || addr.ss_family != AF_INET ||
      ntohs(reinterpret_cast<const sockaddr_in*>(&addr)->sin_port) != port ||
      ::getsockopt(static_cast<int>(fd), SOL_SOCKET, SO_ACCEPTCONN, &listening, &opt_len) != 0 || listening == 0)
    return -1;
  if (taken.exchange(true)) return -1;
  return static_cast<int>(fd);
}

}  // namespace loom::detail
