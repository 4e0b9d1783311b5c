// loom/cuda/all.hpp — every header of loom/cuda/, in one include (opt in: needs the CUDA runtime).
//
// Example:
//   #include <loom/cuda/all.hpp>
//   auto copy_stream = loom::cuda::Stream::create(0);     // an owned stream on device 0
//
// Contents: LOOM_CUDA_CHECK / CudaError (error.hpp), probe_devices / DeviceGuard (device.hpp),
// Stream / Event (stream.hpp), DeviceBuffer (buffer.hpp), pinned host memory (pinned.hpp),
// host-to-device transfers (transfer.hpp; transfer_batch and CudaTransfer need a LibTorch with CUDA).
// Not part of loom/loom.hpp. A build without CUDA (LOOM_HAS_CUDA=0) stops at one #error.
// Guide: docs/gpu.md.
#pragma once

#include <loom/cuda/buffer.hpp>
#include <loom/cuda/device.hpp>
#include <loom/cuda/error.hpp>
#include <loom/cuda/pinned.hpp>
#include <loom/cuda/stream.hpp>
#include <loom/cuda/transfer.hpp>
