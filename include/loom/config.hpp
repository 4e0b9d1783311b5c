// loom/config.hpp — feature macros and version.
//
// LOOM_HAS_GLOO, LOOM_HAS_CUDA, LOOM_HAS_NCCL are 1 when the build found that backend, else 0.
// Meson writes them to <loom/build_config.hpp> (installed next to this header); a project that
// copies include/ without building can define them on the command line instead (-DLOOM_HAS_GLOO=1).
// LOOM_TORCH_HAS_CUDA is 1 when the LibTorch in use was built with CUDA (torch_cuda linked).
#pragma once

#if __has_include(<loom/build_config.hpp>)
#include <loom/build_config.hpp>
#endif

#ifndef LOOM_HAS_GLOO
#define LOOM_HAS_GLOO 0
#endif
#ifndef LOOM_HAS_CUDA
#define LOOM_HAS_CUDA 0
#endif
#ifndef LOOM_HAS_NCCL
#define LOOM_HAS_NCCL 0
#endif
#ifndef LOOM_TORCH_HAS_CUDA
#define LOOM_TORCH_HAS_CUDA 0
#endif
#ifndef LOOM_VERSION_STRING
#define LOOM_VERSION_STRING "0.1.0"
#endif
