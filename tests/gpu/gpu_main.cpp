// main() of the GPU device tests, compiled without the precompiled header (doctest's
// implementation must not come from a PCH; see tests/meson.build).
//
// Exit code 77 (Meson's "skipped"), with a line saying why, in two cases:
//  - no CUDA device is usable here (the device probe fails);
//  - the run matched no test case at all: a filter or test suite whose tests this build does not
//    compile (the torch_cuda suite needs a LibTorch built with CUDA). doctest would report such a
//    run as a success with 0 test cases; it tested nothing, so it is a skip.
// "--child MODE ..." runs one helper process of a multi-process test (NCCL timeouts and two ranks
// on one GPU run in their own processes, started with posix_spawn).
#define DOCTEST_CONFIG_IMPLEMENT
#include <cstdio>
#include <cstring>

#include <doctest/doctest.h>

#include <loom/config.hpp>
#include <loom/cuda/device.hpp>

int loom_gpu_test_child(int argc, char** argv);  // test_gpu_device.cpp

namespace {

/// A doctest listener that keeps the run's statistics (test cases that matched the filters).
struct RunStats : doctest::IReporter {
  static inline int matched = -1;  // -1: no test run happened (e.g. --list-test-cases)
  explicit RunStats(const doctest::ContextOptions&) {}
  void report_query(const doctest::QueryData&) override {}
  void test_run_start() override {}
  void test_run_end(const doctest::TestRunStats& s) override {
    matched = static_cast<int>(s.numTestCasesPassingFilters);
  }
  void test_case_start(const doctest::TestCaseData&) override {}
  void test_case_reenter(const doctest::TestCaseData&) override {}
  void test_case_end(const doctest::CurrentTestCaseStats&) override {}
  void test_case_exception(const doctest::TestCaseException&) override {}
  void subcase_start(const doctest::SubcaseSignature&) override {}
  void subcase_end() override {}
  void log_assert(const doctest::AssertData&) override {}
  void log_message(const doctest::MessageData&) override {}
  void test_case_skipped(const doctest::TestCaseData&) override {}
};

}  // namespace

DOCTEST_REGISTER_LISTENER("loom_run_stats", 1, RunStats);

int main(int argc, char** argv) {
  if (argc >= 3 && std::strcmp(argv[1], "--child") == 0) return loom_gpu_test_child(argc - 2, argv + 2);
  const auto probe = loom::cuda::probe_devices();
  if (probe.count == 0) {
    std::printf(
        "SKIP: the GPU device tests need a CUDA device, and none is usable here (%s). "
        "They run on a GPU machine through scripts/device-check.sh.\n",
        probe.reason.c_str());
    return 77;
  }
  std::printf("CUDA devices: %d\n", probe.count);
  doctest::Context context(argc, argv);
  const int rc = context.run();
  if (rc == 0 && RunStats::matched == 0) {
    std::printf(
        "SKIP: no test case of this build matched the filters, so nothing was tested "
        "(tests of LibTorch CUDA tensors, test suite torch_cuda, are compiled only when LibTorch has CUDA; "
        "this build: LOOM_TORCH_HAS_CUDA = %d).\n",
        LOOM_TORCH_HAS_CUDA);
    return 77;
  }
  return rc;
}
