// loom/launch/rendezvous.hpp — meet the other ranks at a c10d TCPStore (the key-value store every
// communicator uses to exchange addresses).
//
// One sentence: `loom::rendezvous(env)` returns a store shared by all ranks of the job once every
// rank has connected, or throws loom::TimeoutError("rendezvous", ...) naming who waited how long.
//
// Example:
//   auto env = loom::Environment::from_env();
//   auto store = loom::rendezvous(env, {.timeout = std::chrono::seconds(30)});
//   loom::GlooCommunicator comm(store, env.rank, env.world_size);
//
// Three modes, chosen from the environment:
//   - default: rank 0 hosts a TCPStore on MASTER_ADDR:MASTER_PORT (listening on every interface);
//     the other ranks connect to it as clients. Under loom::spawn with LibTorch 2.x rank 0 hosts it
//     on the listening socket spawn reserved the port with (LOOM_MASTER_LISTEN_FD), taken over once
//     per process; a client that connects before the store runs waits in that socket's backlog.
//   - spawn's store process (Environment::external_store, LOOM_STORE_HOST=spawn, set by
//     loom::spawn with SpawnOptions::elastic): a process of spawn's hosts the store, so it outlives
//     every rank (rank 0 may die and the others still use it); every rank, rank 0 included, is a
//     client, with the same identity check, check-in and keys (under the job's secret) as the default.
//   - torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE=True, torchrun's default rendezvous):
//     the torchrun agent already hosts the store at MASTER_ADDR:MASTER_PORT, so every rank, rank 0
//     included, is a client; keys live under "/worker/attempt_<TORCHELASTIC_RESTART_COUNT>", the
//     prefix torchrun's own workers use, so each restart attempt starts from fresh keys.
//   - world size 1 without an agent or store process: an in-memory c10d HashStore, no port is opened.
// The rank 0 (or store process) that hosts the store writes whose it is under the unprefixed key
// "loom/store" (a tag of the job's secret, its world size, its host:pid); a client reads it before
// checking in, so a store of another job on MASTER_PORT is named as such at once. The client's
// connect and that read run on a helper thread bounded by the timeout: c10d's first request to a
// server that accepts and never answers waits far past it. A rank 0 that cannot listen on
// MASTER_PORT reads the same key there to say whose store holds the port (another job's, or this
// job's: a second process with RANK=0).
// Then every rank checks in ("loom/rdzv/<n>/..." keys, n counting the rendezvous of this process):
// it claims its rank (a second claimant is named), compares its world size with the first one
// posted (a disagreement is named, with both ranks' values), and counts itself; the call returns on
// all ranks only when all have arrived, and a mistake found by one rank reaches the others at once.
//
// The job's secret (Environment::rendezvous_secret, from LOOM_RENDEZVOUS_SECRET): rank 0's TCPStore
// listens on every interface and anyone who reaches its port may read and write keys. With a secret,
// the returned store keeps every key under "loom/job/<secret>/", so the check-in, Gloo's addresses and
// NCCL's unique id live under names a stranger cannot guess: what a stranger writes elsewhere is
// never read, and the store protocol has no request that lists keys (c10d's TCPStore: set, get, add,
// check, wait, compare-set, delete, key count). loom::spawn gives its ranks a fresh 128-bit secret;
// with a launcher, export the same random value on every rank (torchrun and srun pass the
// environment on, mpirun needs `-x LOOM_RENDEZVOUS_SECRET`). Without one, keys are used as they are
// (unprotected) and rank 0 prints one warning line to stderr. The secret travels in clear text inside
// key names: it keeps out whoever can reach the port, not whoever can read the traffic.
//
// Machinery (loom/launch/detail/): store_contact.hpp reaches the store, store_identity.hpp says whose
// it is, check_in.hpp is the check-in.
//
// Throws: loom::TimeoutError (collective "rendezvous") when rank 0's store cannot be reached, when
//         the server on MASTER_PORT answers no store request, or a rank does not arrive within
//         `timeout`; loom::ConfigError at once when the ranks disagree on WORLD_SIZE ("rank 1 says
//         WORLD_SIZE=3, rank 0 says WORLD_SIZE=2") or two processes claim one RANK ("two processes
//         claim RANK=0: host:pid and host:pid"); loom::CommError when rank 0 cannot listen on the port
//         (e.g. already in use) and when MASTER_ADDR:MASTER_PORT is held by another job's store (on
//         every rank of the job that finds it); loom::InvalidArgument for a bad Environment.
// Source: c10d's TCPStore and torch.distributed's env:// init method; torchrun's agent-store protocol
//         (torch/distributed/elastic/agent/server/local_elastic_agent.py).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <exception>
#include <stdexcept>
#include <string>
#include <thread>

#include <c10/util/intrusive_ptr.h>
#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <loom/detail/exception_text.hpp>
#include <loom/detail/host_and_pid.hpp>
#include <loom/detail/process_counter.hpp>
#include <loom/detail/torch_api.hpp>
#include <loom/error.hpp>
#include <loom/launch/detail/check_in.hpp>
#include <loom/launch/detail/store_contact.hpp>
#include <loom/launch/detail/store_identity.hpp>
#include <loom/launch/environment.hpp>

namespace loom {

/// Options of rendezvous().
///
/// Units: `timeout` is the wall-clock bound on connecting and on waiting for every rank.
struct RendezvousOptions {
  std::chrono::milliseconds timeout = kDefaultTimeout;  ///< bound on connect + check-in
};

/// Connects to (rank 0: hosts, unless spawn's store process or torchrun's agent does) the job's
/// TCPStore and waits for all ranks; see the header comment.
///
/// Example: `auto store = loom::rendezvous(loom::Environment::from_env());`
/// Units: `options.timeout` bounds the whole call.
/// Throws: loom::TimeoutError("rendezvous", rank, seconds) if the store is unreachable, never answers
///         or a rank is missing after the timeout; loom::ConfigError naming a WORLD_SIZE disagreement
///         or a RANK claimed twice; loom::CommError if rank 0 cannot listen on MASTER_PORT or the port
///         is held by another job's store (see the header comment).
/// Source: torch.distributed env:// (rank 0 is the TCPStore server) and torchrun's agent store.
/// Example (elastic): under `loom::spawn(3, fn, {.elastic = true})` every rank's
///          `loom::rendezvous(env)` is a client of spawn's store process (env.external_store).
inline c10::intrusive_ptr<c10d::Store> rendezvous(const Environment& env, RendezvousOptions options = {}) {
  if (env.world_size < 1 || env.rank < 0 || env.rank >= env.world_size)
    throw InvalidArgument(fmt::format("rendezvous: rank {} is outside [0, world size {})", env.rank, env.world_size));
  // One process and no store hosted elsewhere (torchrun's agent, spawn's store process): nobody to
  // meet, so no TCP port is taken (two single-process runs on one machine never collide on
  // MASTER_PORT); an in-memory store serves the same API.
  if (env.world_size == 1 && !env.use_agent_store && !env.external_store) return c10::make_intrusive<c10d::HashStore>();
  const auto start = std::chrono::steady_clock::now();
  const bool host = env.rank == 0 && !env.use_agent_store && !env.external_store;

  c10d::TCPStoreOptions opts;
  opts.port = env.master_port;
  opts.isServer = host;
  opts.timeout = options.timeout;
  if (!env.use_agent_store) {
    opts.numWorkers = static_cast<std::size_t>(env.world_size);
    opts.waitWorkers = false;  // loom's own check-in below gives the better error message
  }
  // Under loom::spawn with LibTorch 2.x, rank 0 hosts the store on the socket spawn reserved (already
  // listening, so early clients wait in its backlog and no other process can take the port).
  if (host) {
    const int fd = detail::take_spawned_listen_fd(env.master_port);
    if (fd >= 0) detail::set_master_listen_fd(opts, fd);
  }
  c10::intrusive_ptr<c10d::Store> store;
  const std::string where = fmt::format("{}:{}", env.master_addr, env.master_port);
  const std::string hosted_by = env.use_agent_store  ? " hosted by torchrun's agent"
                                : env.external_store ? " hosted by spawn's store process"
                                                     : " hosted by rank 0";
  const std::string tag = detail::job_tag(env.rendezvous_secret);
  // A client first waits, with a plain connect timed to the millisecond, until the store's port
  // answers, then lets c10d connect (an attempt gets the whole seconds left, at least 1 s), and tries
  // again until loom's own deadline. c10d's connect does not keep to a deadline: LibTorch 1.13 counts
  // its timeout in whole seconds and gives up as soon as its next 1 s back-off step would pass it
  // (measured: a refused connect with a 1.5 s timeout gave up after 0.3 s, so a rank started a little
  // before rank 0 would not find the store), and LibTorch 2.x's retries against an address nobody
  // has overshot a 3 s timeout by 2 s on a loaded machine; against a server that accepts and never
  // answers, its first request waits far past the timeout (measured: over 30 s with a 2 s timeout),
  // so the connect and the store's identity run on a helper thread bounded by the deadline
  // (detail::contact_store).
  // Then the client reads whose store it reached (kStoreIdentityKey, written by the rank 0 that
  // hosts it): another job's store is named as such at once.
  const auto deadline = start + options.timeout;
  auto other_job = [&](const detail::StoreIdentity& id) {
    return fmt::format(
        "MASTER_ADDR:MASTER_PORT {} is held by another job's store (hosted by {} for a job of {} ranks), not this "
        "job's: give each job its own MASTER_PORT",
        where, id.host, id.world_size);
  };
  // What the store a client reached says about its owner: "" (this job's, or one that cannot be told
  // apart: no secret on either side), or the error to throw.
  auto check_identity = [&](const detail::StoreContact& c) -> std::string {
    const auto id = detail::parse_store_identity(c.identity);
    if (!id)
      return fmt::format("{} answers as a store, but not as one hosted by {} ('{}')", where,
                         env.external_store ? "loom::spawn's store process" : "a loom rank 0", c.identity);
    if (id->tag != tag) return other_job(*id);
    return {};
  };
  bool hosting = false;  // this process runs the store (a second RANK=0 continues as a client)
  for (;;) {
    try {
      const auto left = deadline - std::chrono::steady_clock::now();
      const auto whole = std::chrono::floor<std::chrono::seconds>(left);
      if (!host &&
          !detail::port_answers(env.master_addr, env.master_port, std::chrono::ceil<std::chrono::milliseconds>(left)))
        throw TimeoutError(
            "rendezvous", env.rank, detail::seconds_since(start),
            fmt::format("could not reach the store at {}{} (no answer within the timeout)", where, hosted_by));
      if (host) {
        opts.timeout = options.timeout;
        store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, opts);
        hosting = true;
        store->set(detail::kStoreIdentityKey, detail::store_bytes(detail::store_identity(env)));
        store->setTimeout(options.timeout);
        break;
      }
      opts.timeout = std::chrono::milliseconds(std::max(whole, std::chrono::seconds(1)));
      auto contact = detail::contact_store(env.master_addr, opts, !env.use_agent_store, deadline);
      using Outcome = detail::StoreContact::Outcome;
      if (contact.outcome == Outcome::silent)
        throw TimeoutError(
            "rendezvous", env.rank, detail::seconds_since(start),
            fmt::format("{} accepted the connection but answered no store request within the timeout: whatever "
                        "listens on MASTER_PORT is not a c10d store (another program holds the port?)",
                        where));
      if (contact.outcome == Outcome::anonymous)
        throw TimeoutError(
            "rendezvous", env.rank, detail::seconds_since(start),
            fmt::format("the store at {} never said whose it is (no {} wrote its identity there "
                        "within the timeout{}{})",
                        where, env.external_store ? "store process of a loom::spawn" : "rank 0 of a loom job",
                        contact.error.empty() ? "" : ": ", contact.error));
      if (contact.outcome == Outcome::failed) throw std::runtime_error(contact.error);
      if (!env.use_agent_store)
        if (auto wrong = check_identity(contact); !wrong.empty()) throw CommError("rendezvous: " + wrong);
      store = contact.store;
      store->setTimeout(options.timeout);  // the bound of later gets and waits, not the attempt's
      break;
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      std::string text = detail::exception_text(e);
      if (host && !detail::mentions_timeout(text)) {
        // The port is taken: say by whom when a store answers there.
        std::string cause = text;
        if (detail::port_answers(env.master_addr, env.master_port, std::chrono::milliseconds(200))) {
          c10d::TCPStoreOptions probe;
          probe.port = env.master_port;
          probe.isServer = false;
          probe.waitWorkers = false;
          probe.timeout = std::chrono::seconds(1);
          auto contact = detail::contact_store(env.master_addr, probe, true, deadline);
          using Outcome = detail::StoreContact::Outcome;
          const auto id = detail::parse_store_identity(contact.identity);
          if (contact.outcome == Outcome::connected && id && id->tag == tag && id->host != detail::host_and_pid()) {
            // This job's store, hosted by another process: continue as a client, whose check-in
            // names the two claims of RANK=0 on both.
            store = contact.store;
            store->setTimeout(options.timeout);
            break;
          }
          if (contact.outcome == Outcome::connected && id && id->tag != tag)
            throw CommError(fmt::format("rendezvous: rank 0 could not host the store on port {} (MASTER_PORT): {}",
                                        env.master_port, other_job(*id)));
          if (contact.outcome == Outcome::connected && id)
            cause += "; this process hosts a store on that port already (an earlier rendezvous)";
          else if (contact.outcome == Outcome::silent)
            cause += "; the program listening there answers no store request (not a c10d store)";
        }
        throw CommError(fmt::format("rendezvous: rank 0 could not host the store on port {} (MASTER_PORT): {}",
                                    env.master_port, cause));
      }
      const auto now = std::chrono::steady_clock::now();
      if (host || now >= deadline)
        throw TimeoutError("rendezvous", env.rank, detail::seconds_since(start),
                           fmt::format("could not reach the store at {}{} ({})", where, hosted_by, text));
      std::this_thread::sleep_for(
          std::min<std::chrono::steady_clock::duration>(std::chrono::milliseconds(50), deadline - now));
    }
  }
  if (env.use_agent_store)
    store = c10::make_intrusive<c10d::PrefixStore>(fmt::format("/worker/attempt_{}", env.restart_count), store);
  if (!env.rendezvous_secret.empty())
    store = c10::make_intrusive<c10d::PrefixStore>(fmt::format("loom/job/{}", env.rendezvous_secret), store);
  else if (env.rank == 0)
    detail::warn_once_without_secret(env);

  const auto gen = detail::next_in_process(detail::Counted::rendezvous);
  detail::store_check_in(*store, fmt::format("loom/rdzv/{}", gen), env.rank, env.world_size, options.timeout, start,
                         env.rendezvous_secret.empty()
                             ? " (without LOOM_RENDEZVOUS_SECRET, a second job on the same MASTER_PORT looks the same: "
                               "give each job its own MASTER_PORT and secret)"
                             : "",
                         hosting);
  return store;
}

}  // namespace loom
