// Precompiled header for loom's test executables (tests only; library headers never include
// <torch/torch.h>).
// Order matters: LibTorch brings glog's one-argument CHECK macro; doctest's CHECK must be defined
// after it, so <torch/torch.h> comes first.
// clang-format off
#include <torch/torch.h>
#include <doctest/doctest.h>
#include <fmt/format.h>
// clang-format on
