// loom/comm/detail/store_side.hpp — a second client connection to a job's c10d store, with the same
// key prefixes (used by the Gloo join watch and the flight recorder's exchange of both communicators).
//
// Why: c10d's TCPStore serialises one client's requests, a blocking wait included, so a thread that
// must look at the store while another one waits on it (a watcher beside Gloo's connection setup, the
// flight recorder's watcher beside a training thread) needs a connection of its own.
//
// Example: `auto side = loom::detail::second_connection(prefixed_store, std::chrono::seconds(30));`
// Throws: what c10d::TCPStore's client constructor throws when the store's host cannot be reached
//         within `timeout` (a c10::Error / c10::DistNetworkError).
// Source: c10d's public TCPStore and PrefixStore classes; loom's own helper.
#pragma once

#include <chrono>
#include <string>
#include <vector>

#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

namespace loom::detail {

namespace store_side {
// Named access to c10d::PrefixStore's protected prefix (a pointer to member taken through a class
// that makes it public; never instantiated).
struct PrefixOf : c10d::PrefixStore {
  using c10d::PrefixStore::prefix_;
};
}  // namespace store_side

/// A second client connection with the same key prefixes as `store`, when `store` is (a chain of
/// c10d::PrefixStores over) a c10d::TCPStore; otherwise `store` itself (in-process stores such as
/// HashStore and FileStore do not hold a lock while one request waits). `timeout`: the new
/// connection's timeout for its requests and for connecting.
inline c10::intrusive_ptr<c10d::Store> second_connection(const c10::intrusive_ptr<c10d::Store>& store,
                                                         std::chrono::milliseconds timeout) {
  std::vector<std::string> prefixes;  // outermost first
  c10::intrusive_ptr<c10d::Store> base = store;
  while (auto* prefix = dynamic_cast<c10d::PrefixStore*>(base.get())) {
    prefixes.push_back((*prefix).*(&store_side::PrefixOf::prefix_));
    base = prefix->getUnderlyingStore();
  }
  auto* tcp = dynamic_cast<c10d::TCPStore*>(base.get());
  if (tcp == nullptr) return store;
  c10d::TCPStoreOptions opts;
  opts.port = tcp->getPort();
  opts.isServer = false;
  opts.waitWorkers = false;
  opts.timeout = timeout;
  c10::intrusive_ptr<c10d::Store> side = c10::make_intrusive<c10d::TCPStore>(tcp->getHost(), opts);
  for (auto it = prefixes.rbegin(); it != prefixes.rend(); ++it)
    side = c10::make_intrusive<c10d::PrefixStore>(*it, side);
  return side;
}

}  // namespace loom::detail
