// loom/cuda/error.hpp — checking CUDA runtime calls: LOOM_CUDA_CHECK and loom::CudaError.
//
// Example:
//   void* p = nullptr;
//   LOOM_CUDA_CHECK(cudaHostAlloc(&p, 1 << 20, cudaHostAllocPortable));
//   // on a machine without a GPU this throws loom::CudaError:
//   // "loom: CUDA call cudaHostAlloc(&p, 1 << 20, cudaHostAllocPortable) failed at
//   //  loom/cuda/pinned.hpp:51: cudaErrorNoDevice (no CUDA-capable device is detected);
//   //  device -1, CUDA runtime 13.0, driver 0.0"
//
// Throws: loom::CudaError (a loom::CommError: on the GPU path a CUDA failure is what makes a
//         collective or a transfer fail) from LOOM_CUDA_CHECK. Destructors use
//         detail::cuda_noexcept, which reports on stderr (except during process teardown) and
//         never throws.
// Guide: docs/gpu.md#what-exists.
// Source: the "check every call, say which call" habit of c10's C10_CUDA_CHECK and NCCLUtils.
#pragma once

#include <loom/config.hpp>

#if !LOOM_HAS_CUDA
#error \
    "loom/cuda/*.hpp needs the CUDA runtime, but this build has LOOM_HAS_CUDA=0: install the CUDA toolkit (cuda_runtime_api.h, libcudart) and reconfigure with -Dcudatoolkit_dir=<its root>, or leave the loom/cuda headers out of a CPU-only build."
#endif

#include <cstdio>
#include <string>
#include <string_view>

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <loom/error.hpp>

namespace loom {

/// A CUDA runtime call failed. `code()` is the cudaError_t; `what()` names the call and place.
///
/// Example: `catch (const loom::CudaError& e) { if (e.code() == cudaErrorMemoryAllocation) ... }`
class CudaError : public CommError {
 public:
  CudaError(cudaError_t code, const std::string& message) : CommError(message), code_(code) {}
  /// The failing call's return code.
  [[nodiscard]] cudaError_t code() const noexcept { return code_; }

 private:
  cudaError_t code_;
};

namespace cuda::detail {

/// "13.0" from a CUDA version number such as 13000 (major*1000 + minor*10).
inline std::string cuda_version_text(int version) {
  return fmt::format("{}.{}", version / 1000, (version % 1000) / 10);
}

/// Drops the directories of a __FILE__ path up to "include/" (or keeps the last two parts), so
/// messages read "loom/cuda/pinned.hpp:51" rather than an absolute build-machine path.
constexpr std::string_view short_file(std::string_view file) noexcept {
  if (auto p = file.rfind("include/"); p != std::string_view::npos) return file.substr(p + 8);
  if (auto p = file.rfind('/'); p != std::string_view::npos && p > 0) {
    if (auto q = file.rfind('/', p - 1); q != std::string_view::npos) return file.substr(q + 1);
  }
  return file;
}

/// The message of a failed CUDA call; `device` < 0 means unknown. Pure: testable without a GPU.
inline std::string format_cuda_error(cudaError_t code, std::string_view call, std::string_view file, int line,
                                     int device, int runtime_version, int driver_version) {
  return fmt::format("CUDA call {} failed at {}:{}: {} ({}); device {}, CUDA runtime {}, driver {}", call,
                     short_file(file), line, cudaGetErrorName(code), cudaGetErrorString(code), device,
                     cuda_version_text(runtime_version), cuda_version_text(driver_version));
}

/// Builds the message from the live runtime (device, versions), clears the runtime's
/// non-sticky error state and throws loom::CudaError.
[[noreturn]] inline void throw_cuda_error(cudaError_t code, const char* call, const char* file, int line) {
  (void)cudaGetLastError();  // the failing call also set the "last error"; do not report it twice
  int device = -1;
  if (cudaGetDevice(&device) != cudaSuccess) device = -1;
  int runtime = 0;
  int driver = 0;
  (void)cudaRuntimeGetVersion(&runtime);
  (void)cudaDriverGetVersion(&driver);
  (void)cudaGetLastError();
  throw CudaError(code, format_cuda_error(code, call, file, line, device, runtime, driver));
}

/// For destructors: reports a failed call on stderr and never throws. Errors that only mean the
/// process is shutting down (runtime unloading, context destroyed) are not reported.
inline void cuda_noexcept(cudaError_t code, const char* call, const char* file, int line) noexcept {
  if (code == cudaSuccess) return;
  (void)cudaGetLastError();
  if (code == cudaErrorCudartUnloading || code == cudaErrorContextIsDestroyed) return;
  std::fprintf(stderr, "loom: warning: CUDA call %s failed at %s:%d: %s (%s) (ignored in a destructor)\n", call,
               std::string(short_file(file)).c_str(), line, cudaGetErrorName(code), cudaGetErrorString(code));
}

}  // namespace cuda::detail
}  // namespace loom

/// Evaluates a CUDA runtime call once; throws loom::CudaError naming the call if it did not
/// return cudaSuccess.
#define LOOM_CUDA_CHECK(...)                                                                   \
  do {                                                                                         \
    const ::cudaError_t loom_cuda_rc_ = (__VA_ARGS__);                                         \
    if (loom_cuda_rc_ != ::cudaSuccess)                                                        \
      ::loom::cuda::detail::throw_cuda_error(loom_cuda_rc_, #__VA_ARGS__, __FILE__, __LINE__); \
  } while (false)

/// Like LOOM_CUDA_CHECK for destructors and other noexcept paths: reports, never throws.
#define LOOM_CUDA_CHECK_NOEXCEPT(...) \
  ::loom::cuda::detail::cuda_noexcept((__VA_ARGS__), #__VA_ARGS__, __FILE__, __LINE__)
