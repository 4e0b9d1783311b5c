// loom/launch/detail/store_identity.hpp — whose store a rank reached: the line the rank 0 that
// hosts the job's store writes under the unprefixed key "loom/store" (a tag of the job's secret, its
// world size, its host:pid), its parts, and rank 0's one warning about a job without a secret.
// Not a public header: loom/launch/rendezvous.hpp is (its header comment describes the protocol).
//
// Example: `detail::parse_store_identity("job 1f2e... world_size 2 host node1:4242")->world_size` is 2.
// Source: loom's own key and format; the tag is a SHA-1 of the secret (c10::sha1).
#pragma once

#include <atomic>
#include <cstdio>
#include <optional>
#include <string>

#include <c10/util/hash.h>
#include <fmt/format.h>

#include <loom/detail/host_and_pid.hpp>
#include <loom/launch/environment.hpp>

namespace loom::detail {

/// The unprefixed key under which the rank 0 that hosts a store says whose store it is.
inline constexpr const char* kStoreIdentityKey = "loom/store";

/// A job's tag in the store's identity: "none" without a secret, else the first 16 hexadecimal
/// digits of a SHA-1 of the secret (the secret itself never leaves the key names of its own job).
inline std::string job_tag(const std::string& secret) {
  if (secret.empty()) return "none";
  return c10::sha1("loom rendezvous job " + secret).str().substr(0, 16);
}

/// The value of kStoreIdentityKey rank 0 writes: "job <tag> world_size <n> host <host:pid>".
inline std::string store_identity(const Environment& env) {
  return fmt::format("job {} world_size {} host {}", job_tag(env.rendezvous_secret), env.world_size, host_and_pid());
}

/// The parts of a store identity.
struct StoreIdentity {
  std::string tag, host;
  int world_size = 0;
};

inline std::optional<StoreIdentity> parse_store_identity(const std::string& text) {
  char tag[65] = {}, host[257] = {};
  int world_size = 0;
  if (std::sscanf(text.c_str(), "job %64s world_size %d host %256s", tag, &world_size, host) != 3) return std::nullopt;
  return StoreIdentity{tag, host, world_size};
}

/// Rank 0's one line about a job without LOOM_RENDEZVOUS_SECRET (once per process).
inline void warn_once_without_secret(const Environment& env) {
  static std::atomic<bool> warned{false};
  if (warned.exchange(true)) return;
  std::fprintf(stderr,
               "loom: warning: LOOM_RENDEZVOUS_SECRET is not set, so anyone who can reach %s:%u can read and write "
               "this job's rendezvous keys; export the same random value on every rank (openssl rand -hex 16)\n",
               env.master_addr.c_str(), static_cast<unsigned>(env.master_port));
  std::fflush(stderr);
}

}  // namespace loom::detail
