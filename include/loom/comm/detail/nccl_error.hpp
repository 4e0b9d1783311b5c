// loom/comm/detail/nccl_error.hpp — loom::NcclError and the text of a failed NCCL call: which
// call, on which rank and device, NCCL's result name, its last error and its version (used by
// loom/comm/nccl.hpp).
//
// Example (inside the communicator's state machine):
//   if (r != ncclSuccess) loom::detail::throw_nccl_error(r, "ncclAllReduce", __FILE__, __LINE__, comm, site);
// format_nccl_error is pure, so the message is tested without a GPU (tests/gpu/test_gpu_host.cpp).
// Source: NCCL's ncclGetErrorString / ncclGetLastError / ncclGetVersion.
#pragma once

#include <loom/config.hpp>

#if LOOM_HAS_NCCL

#include <string>
#include <string_view>

#include <fmt/format.h>
#include <nccl.h>

#include <loom/cuda/error.hpp>
#include <loom/error.hpp>

namespace loom {

/// An NCCL call failed. `code()` is its ncclResult_t; `what()` says which call, where, and why.
class NcclError : public CommError {
 public:
  NcclError(ncclResult_t code, const std::string& message) : CommError(message), code_(code) {}
  [[nodiscard]] ncclResult_t code() const noexcept { return code_; }

 private:
  ncclResult_t code_;
};

namespace detail {

/// Where an NCCL call ran, for messages (-1: unknown).
struct NcclSite {
  int rank = -1;
  int world_size = -1;
  int device = -1;
};

/// "ncclInvalidUsage" etc.: the enumerator's name of an ncclResult_t.
constexpr std::string_view nccl_result_name(ncclResult_t r) noexcept {
  switch (r) {
    case ncclSuccess: return "ncclSuccess";
    case ncclUnhandledCudaError: return "ncclUnhandledCudaError";
    case ncclSystemError: return "ncclSystemError";
    case ncclInternalError: return "ncclInternalError";
    case ncclInvalidArgument: return "ncclInvalidArgument";
    case ncclInvalidUsage: return "ncclInvalidUsage";
    case ncclRemoteError: return "ncclRemoteError";
    case ncclInProgress: return "ncclInProgress";
    default: return "ncclResult?";
  }
}

/// "2.28.9" from an NCCL version code (ncclGetVersion / NCCL_VERSION_CODE); both encodings.
inline std::string nccl_version_text(int code) {
  if (code >= 10000) return fmt::format("{}.{}.{}", code / 10000, (code % 10000) / 100, code % 100);
  return fmt::format("{}.{}.{}", code / 1000, (code % 1000) / 100, code % 100);
}

/// The NCCL library's version ("2.28.9"), or the header's when the library cannot say.
inline std::string nccl_runtime_version() {
  int v = 0;
  if (ncclGetVersion(&v) != ncclSuccess || v == 0) v = NCCL_VERSION_CODE;
  return nccl_version_text(v);
}

/// The message of a failed NCCL call. Pure (testable without a GPU): `last_error` is what
/// ncclGetLastError said, `version` the NCCL version text.
inline std::string format_nccl_error(ncclResult_t code, std::string_view call, std::string_view file, int line,
                                     std::string_view last_error, std::string_view version, const NcclSite& site) {
  std::string msg = fmt::format("NCCL call {} failed at {}:{}: {} ({})", call, cuda::detail::short_file(file), line,
                                nccl_result_name(code), ncclGetErrorString(code));
  if (!last_error.empty()) msg += fmt::format("; NCCL says: {}", last_error);
  msg += fmt::format("; NCCL {}", version);
  if (site.rank >= 0) msg += fmt::format(", rank {} of {}", site.rank, site.world_size);
  if (site.device >= 0) msg += fmt::format(", device {}", site.device);
  return msg;
}

/// Throws loom::NcclError for `code` with the live NCCL state (last error of `comm`, version).
[[noreturn]] inline void throw_nccl_error(ncclResult_t code, const char* call, const char* file, int line,
                                          ncclComm_t comm, const NcclSite& site) {
  const char* last = ncclGetLastError(comm);
  throw NcclError(code,
                  format_nccl_error(code, call, file, line, last != nullptr ? last : "", nccl_runtime_version(), site));
}

}  // namespace detail
}  // namespace loom

#endif  // LOOM_HAS_NCCL
