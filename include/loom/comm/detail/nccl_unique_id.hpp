// loom/comm/detail/nccl_unique_id.hpp — the exchange of ncclUniqueId through the job's c10d store:
// rank 0 publishes the id's bytes at a key, the others wait for it (bounded) and read it back
// (used by loom/comm/nccl.hpp).
//
// Example:
//   if (rank == 0) publish_unique_id(store, key, id); else id = fetch_unique_id(store, key, rank, timeout);
//   // or both sides in one call: id = exchange_unique_id(store, key, {rank, world_size, device}, timeout);
// Throws: loom::TimeoutError("nccl_unique_id") naming the key when rank 0 never published it;
//         loom::CommError when the stored bytes are not NCCL_UNIQUE_ID_BYTES long; loom::NcclError
//         when rank 0 cannot make the id.
// Source: c10d ProcessGroupNCCL's broadcastUniqueNCCLID (the same store protocol).
#pragma once

#include <loom/config.hpp>

#if LOOM_HAS_NCCL

#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>
#include <nccl.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <loom/comm/detail/nccl_error.hpp>
#include <loom/error.hpp>

namespace loom::detail {

/// The unique id as store bytes (NCCL_UNIQUE_ID_BYTES of them).
inline std::vector<uint8_t> unique_id_bytes(const ncclUniqueId& id) {
  const auto* p = reinterpret_cast<const uint8_t*>(id.internal);
  return {p, p + NCCL_UNIQUE_ID_BYTES};
}

/// The unique id from store bytes; loom::CommError naming `key` if the size is wrong.
inline ncclUniqueId unique_id_from_bytes(const std::vector<uint8_t>& bytes, std::string_view key) {
  if (bytes.size() != NCCL_UNIQUE_ID_BYTES)
    throw CommError(
        fmt::format("NCCL unique id at store key '{}' has {} bytes, expected {} (is another program using this key?)",
                    key, bytes.size(), NCCL_UNIQUE_ID_BYTES));
  ncclUniqueId id{};
  std::copy(bytes.begin(), bytes.end(), reinterpret_cast<uint8_t*>(id.internal));
  return id;
}

/// Rank 0 publishes `id` at `key`.
inline void publish_unique_id(c10d::Store& store, const std::string& key, const ncclUniqueId& id) {
  store.set(key, unique_id_bytes(id));
}

/// Waits up to `timeout` for `key` and reads the unique id. loom::TimeoutError ("nccl_unique_id",
/// naming the key and rank) when rank 0 never published it.
inline ncclUniqueId fetch_unique_id(c10d::Store& store, const std::string& key, int rank,
                                    std::chrono::milliseconds timeout) {
  const auto start = std::chrono::steady_clock::now();
  try {
    store.wait({key}, timeout);
  } catch (const std::exception& e) {
    const std::chrono::duration<double> waited = std::chrono::steady_clock::now() - start;
    throw TimeoutError("nccl_unique_id", rank, waited.count(),
                       fmt::format("rank 0 did not publish store key '{}' (store says: {})", key, e.what()));
  }
  return unique_id_from_bytes(store.get(key), key);
}

/// The unique id of the communicator `site` joins: rank 0 makes it (ncclGetUniqueId) and publishes it
/// at `key`, the others fetch it from there (at most `timeout`).
/// Throws: loom::NcclError (ncclGetUniqueId failed), and what fetch_unique_id throws.
inline ncclUniqueId exchange_unique_id(c10d::Store& store, const std::string& key, const NcclSite& site,
                                       std::chrono::milliseconds timeout) {
  if (site.rank == 0) {
    ncclUniqueId id{};
    const ncclResult_t rc = ncclGetUniqueId(&id);
    if (rc != ncclSuccess) throw_nccl_error(rc, "ncclGetUniqueId(&id)", __FILE__, __LINE__, nullptr, site);
    publish_unique_id(store, key, id);
    return id;
  }
  return fetch_unique_id(store, key, site.rank, timeout);
}

}  // namespace loom::detail

#endif  // LOOM_HAS_NCCL
