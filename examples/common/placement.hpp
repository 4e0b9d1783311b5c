// examples/common/placement.hpp — how the examples choose their process group's backend and their
// model's device from `--backend auto|gloo|nccl` and `--device auto|cpu|cuda`.
//
// Rule: `--device auto` is a GPU when LibTorch sees one, else the CPU; `--backend auto` is NCCL
// for a GPU model (loom::ProcessGroup picks it when the build has NCCL and a CUDA LibTorch) and
// Gloo for a CPU model. With `--backend gloo --device cuda` the model is on this rank's GPU and
// Gloo moves the CUDA tensors through host memory (the comparison the device check makes). A
// rank's GPU is its LOCAL_RANK among CUDA_VISIBLE_DEVICES (loom::rank_cuda_device).
//
// Throws: loom::ConfigError for `--device cuda` without a CUDA device, or a bad name.
#pragma once

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>

#include <torch/cuda.h>
#include <torch/types.h>

#include <loom/dist/process_group.hpp>
#include <loom/error.hpp>
#include <loom/launch/rank_device.hpp>

namespace examples {

/// Whether the model should live on a GPU.
inline bool wants_cuda(const std::string& device) {
  if (device != "auto" && device != "cpu" && device != "cuda")
    throw loom::ConfigError("--device '" + device + "' is not one of auto, cpu, cuda");
  const bool cuda = torch::cuda::is_available();
  if (device == "cuda" && !cuda)
    throw loom::ConfigError("--device cuda: this LibTorch or machine has no CUDA device; use --device cpu");
  return device == "cuda" || (device == "auto" && cuda);
}

/// The process group's backend for `--backend` and `--device`.
inline loom::Backend group_backend(const std::string& backend, const std::string& device) {
  if (backend == "auto") return wants_cuda(device) ? loom::Backend::automatic : loom::Backend::gloo;
  return loom::parse_backend(backend);
}

/// The process group's timeout for `--timeout SECONDS`: unset (0) leaves it to LOOM_TIMEOUT or
/// loom's default (300 s); a negative value is a loom::ConfigError.
inline std::optional<std::chrono::milliseconds> group_timeout(double seconds) {
  if (seconds < 0) throw loom::ConfigError("--timeout " + std::to_string(seconds) + " must be > 0 seconds");
  if (seconds == 0) return std::nullopt;
  return std::chrono::milliseconds(static_cast<int64_t>(std::ceil(seconds * 1000)));
}

/// The model's device: the process group's GPU under NCCL; with Gloo, this rank's GPU when asked.
inline torch::Device model_device(const loom::ProcessGroup& pg, const std::string& device) {
  if (pg.device().is_cuda()) return pg.device();
  if (!wants_cuda(device)) return torch::Device(torch::kCPU);
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  const auto d =
      loom::rank_cuda_device(pg.environment(), static_cast<int>(torch::cuda::device_count()), visible ? visible : "");
  return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(d.ordinal));
}

}  // namespace examples
