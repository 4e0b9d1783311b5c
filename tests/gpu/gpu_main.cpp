// main() of the GPU device tests, compiled without the precompiled header (doctest's
// implementation must not come from a PCH; see tests/meson.build).
//
// Without a CUDA device the whole executable is skipped (exit code 77, Meson's "skipped") with a
// message saying why. "--child MODE ..." runs one helper process of a multi-process test (NCCL
// timeouts and two ranks on one GPU run in their own processes, started with posix_spawn).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>
#include <cstring>

#include <loom/cuda/device.hpp>

int loom_gpu_test_child(int argc, char** argv);  // test_gpu_device.cpp

int main(int argc, char** argv) {
  if (argc >= 3 && std::strcmp(argv[1], "--child") == 0) return loom_gpu_test_child(argc - 2, argv + 2);
  const auto probe = loom::cuda::probe_devices();
  if (probe.count == 0) {
    std::printf("SKIP: the GPU device tests need a CUDA device, and none is usable here (%s). "
                "They run on a GPU machine through scripts/device-check.sh.\n",
                probe.reason.c_str());
    return 77;
  }
  std::printf("CUDA devices: %d\n", probe.count);
  doctest::Context context(argc, argv);
  return context.run();
}
