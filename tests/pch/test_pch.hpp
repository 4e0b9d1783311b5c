// Precompiled header for loom's test executables (tests only; library headers never include
// <torch/torch.h>).
#include <doctest/doctest.h>
#include <fmt/format.h>
#include <torch/torch.h>
