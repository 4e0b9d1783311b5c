// GPU path, host side: everything about loom/comm/nccl.hpp and loom/cuda/*.hpp that needs no
// GPU (dtype and op mapping, error messages for forced error codes, the unique-id exchange
// through a c10d store, tensor checks, the flight recorder's verdict on NCCL's errors) runs here on every machine; the behaviour without a device
// (a clear loom::CudaError, not a crash) is checked where no device exists.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <exception>
#include <filesystem>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <unistd.h>

#include <doctest/doctest.h>
#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/torch.h>

#include <loom/comm/nccl.hpp>
#include <loom/cuda/buffer.hpp>
#include <loom/cuda/pinned.hpp>
#include <loom/cuda/stream.hpp>
#include <loom/cuda/transfer.hpp>
#include <loom/trace/record_file.hpp>

namespace {
ncclUniqueId patterned_id(uint8_t seed) {
  ncclUniqueId id{};
  for (int i = 0; i < NCCL_UNIQUE_ID_BYTES; ++i) id.internal[i] = static_cast<char>(static_cast<uint8_t>(seed + 3 * i));
  return id;
}
}  // namespace

TEST_CASE("to_nccl_dtype maps every loom dtype to the NCCL type of the same width and kind") {
  using loom::detail::to_nccl_dtype;
  CHECK(to_nccl_dtype(at::kFloat, "t") == ncclFloat32);
  CHECK(to_nccl_dtype(at::kDouble, "t") == ncclFloat64);
  CHECK(to_nccl_dtype(at::kBFloat16, "t") == ncclBfloat16);
  CHECK(to_nccl_dtype(at::kHalf, "t") == ncclFloat16);
  CHECK(to_nccl_dtype(at::kInt, "t") == ncclInt32);
  CHECK(to_nccl_dtype(at::kLong, "t") == ncclInt64);
  CHECK_THROWS_WITH_AS(to_nccl_dtype(at::kBool, "all_reduce"), doctest::Contains("all_reduce: unsupported dtype Bool"),
                       loom::InvalidArgument);
  CHECK_THROWS_AS(to_nccl_dtype(at::kByte, "t"), loom::InvalidArgument);
  CHECK_THROWS_AS(to_nccl_dtype(at::kComplexFloat, "t"), loom::InvalidArgument);
}

TEST_CASE("NCCL supports exactly the dtypes every loom communicator supports") {
  for (int i = 0; i < static_cast<int>(c10::ScalarType::NumOptions); ++i) {
    const auto dtype = static_cast<c10::ScalarType>(i);
    CAPTURE(c10::toString(dtype));
    bool mapped = true;
    try {
      (void)loom::detail::to_nccl_dtype(dtype, "t");
    } catch (const loom::InvalidArgument&) {
      mapped = false;
    }
    CHECK(mapped == loom::is_supported_dtype(dtype));
  }
}

TEST_CASE("to_nccl_op: avg is NCCL's own average, not a sum divided on the host") {
  CHECK(loom::detail::to_nccl_op(loom::ReduceOp::sum) == ncclSum);
  CHECK(loom::detail::to_nccl_op(loom::ReduceOp::avg) == ncclAvg);
  CHECK(loom::detail::to_nccl_op(loom::ReduceOp::min) == ncclMin);
  CHECK(loom::detail::to_nccl_op(loom::ReduceOp::max) == ncclMax);
}

TEST_CASE("NCCL version text from both version encodings") {
  CHECK(loom::detail::nccl_version_text(22809) == "2.28.9");
  CHECK(loom::detail::nccl_version_text(21903) == "2.19.3");
  CHECK(loom::detail::nccl_version_text(2708) == "2.7.8");  // before 2.9: major*1000 + minor*100 + patch
  const std::string v = loom::detail::nccl_runtime_version();
  CHECK(v.rfind("2.", 0) == 0);
  CHECK(std::count(v.begin(), v.end(), '.') == 2);
}

TEST_CASE("format_nccl_error names the call, place, code, NCCL's own words, version, rank and device") {
  const std::string msg = loom::detail::format_nccl_error(
      ncclInvalidUsage, "ncclAllReduce(data, data, count, dtype, op, comm, stream)",
      "/src/loom/include/loom/comm/nccl.hpp", 42, "Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 0",
      "2.28.9", {.rank = 1, .world_size = 2, .device = 0});
  CHECK(std::string_view(ncclGetErrorString(ncclInvalidUsage)).find("invalid usage") != std::string_view::npos);
  CHECK(msg ==
        fmt::format(
            "NCCL call ncclAllReduce(data, data, count, dtype, op, comm, stream) failed at loom/comm/nccl.hpp:42: "
            "ncclInvalidUsage ({}); NCCL says: Duplicate GPU detected : rank 1 and rank 0 both on CUDA "
            "device 0; NCCL 2.28.9, rank 1 of 2, device 0",
            ncclGetErrorString(ncclInvalidUsage)));
  // Unknown rank/device and no last error: those parts are left out, not printed as -1.
  const std::string bare =
      loom::detail::format_nccl_error(ncclSystemError, "ncclGetUniqueId(&id)", "x/y/z.cpp", 7, "", "2.28.9", {});
  CHECK(bare == fmt::format("NCCL call ncclGetUniqueId(&id) failed at y/z.cpp:7: ncclSystemError ({}); NCCL 2.28.9",
                            ncclGetErrorString(ncclSystemError)));
}

TEST_CASE("throw_nccl_error: a forced error code becomes loom::NcclError carrying the code") {
  for (ncclResult_t code : {ncclUnhandledCudaError, ncclSystemError, ncclInternalError, ncclInvalidArgument,
                            ncclInvalidUsage, ncclRemoteError}) {
    CAPTURE(loom::detail::nccl_result_name(code));
    bool caught = false;
    try {
      loom::detail::throw_nccl_error(code, "ncclBroadcast(a, b)", __FILE__, 1234, nullptr,
                                     {.rank = 3, .world_size = 8, .device = 1});
    } catch (const loom::NcclError& e) {
      caught = true;
      const std::string what = e.what();
      CHECK(e.code() == code);
      CHECK(what.rfind("loom: NCCL call ncclBroadcast(a, b) failed at gpu/test_gpu_host.cpp:1234: ", 0) == 0);
      CHECK(what.find(std::string(loom::detail::nccl_result_name(code))) != std::string::npos);
      CHECK(what.find(ncclGetErrorString(code)) != std::string::npos);
      CHECK(what.find("NCCL " + loom::detail::nccl_runtime_version() + ", rank 3 of 8, device 1") != std::string::npos);
    }
    CHECK(caught);
  }
  // NcclError is a CommError, so code that catches communication failures generically sees it.
  CHECK_THROWS_AS(loom::detail::throw_nccl_error(ncclRemoteError, "x", "f", 1, nullptr, {}), loom::CommError);
}

TEST_CASE("unique id round trip through a c10d store, byte for byte") {
  auto store = c10::make_intrusive<c10d::HashStore>();
  const ncclUniqueId sent = patterned_id(17);
  CHECK(loom::detail::unique_id_bytes(sent).size() == NCCL_UNIQUE_ID_BYTES);
  // The reader starts first and waits, as ranks > 0 do.
  ncclUniqueId received{};
  std::thread reader(
      [&] { received = loom::detail::fetch_unique_id(*store, "loom/nccl/0/unique_id", 1, std::chrono::seconds(20)); });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  loom::detail::publish_unique_id(*store, "loom/nccl/0/unique_id", sent);
  reader.join();
  CHECK(std::memcmp(sent.internal, received.internal, NCCL_UNIQUE_ID_BYTES) == 0);
  CHECK(static_cast<uint8_t>(received.internal[5]) == static_cast<uint8_t>(17 + 15));

  // A real id from NCCL (no GPU needed: it holds the bootstrap address of rank 0).
  ncclUniqueId real{};
  const ncclResult_t rc = ncclGetUniqueId(&real);
  if (rc == ncclSuccess) {
    loom::detail::publish_unique_id(*store, "real", real);
    const ncclUniqueId back = loom::detail::fetch_unique_id(*store, "real", 1, std::chrono::seconds(5));
    CHECK(std::memcmp(real.internal, back.internal, NCCL_UNIQUE_ID_BYTES) == 0);
  } else {
    MESSAGE("ncclGetUniqueId failed here (" << ncclGetErrorString(rc) << "); real-id round trip not run");
  }
}

TEST_CASE("unique id exchange: a missing id times out with loom::TimeoutError; a wrong size is a CommError") {
  auto store = c10::make_intrusive<c10d::HashStore>();
  try {
    (void)loom::detail::fetch_unique_id(*store, "loom/nccl/9/unique_id", 2, std::chrono::milliseconds(100));
    FAIL("fetch_unique_id returned without an id");
  } catch (const loom::TimeoutError& e) {
    CHECK(e.collective() == "nccl_unique_id");
    CHECK(e.rank() == 2);
    CHECK(e.seconds_waited() >= 0.05);
    CHECK(std::string(e.what()).find("'loom/nccl/9/unique_id'") != std::string::npos);
  }
  store->set("short", std::vector<uint8_t>{1, 2, 3, 4, 5});
  CHECK_THROWS_WITH_AS((void)loom::detail::fetch_unique_id(*store, "short", 1, std::chrono::seconds(1)),
                       doctest::Contains("'short' has 5 bytes, expected 128"), loom::CommError);
}

TEST_CASE("NCCL tensor check: a CPU tensor is refused naming its device") {
  auto t = torch::ones({4});
  CHECK_THROWS_WITH_AS(loom::detail::check_nccl_tensor(t, 0, "all_reduce"),
                       doctest::Contains("all_reduce: NcclCommunicator needs a CUDA tensor on cuda:0, got one on cpu"),
                       loom::InvalidArgument);
  // The generic checks come first: a non-contiguous CPU tensor is reported as non-contiguous.
  auto nc = torch::zeros({3, 4}).t();
  CHECK_THROWS_WITH_AS(loom::detail::check_nccl_tensor(nc, 0, "broadcast"), doctest::Contains("not contiguous"),
                       loom::InvalidArgument);
}

TEST_CASE("CUDA error text: a forced code names the call, the place and the code") {
  CHECK(loom::cuda::detail::short_file("/w/main/include/loom/cuda/pinned.hpp") == "loom/cuda/pinned.hpp");
  CHECK(loom::cuda::detail::short_file("/w/main/tests/gpu/test_gpu_host.cpp") == "gpu/test_gpu_host.cpp");
  CHECK(loom::cuda::detail::short_file("plain.cpp") == "plain.cpp");
  CHECK(loom::cuda::detail::cuda_version_text(12080) == "12.8");
  CHECK(loom::cuda::detail::format_cuda_error(cudaErrorMemoryAllocation, "cudaMalloc(&p, n)",
                                              "/x/include/loom/cuda/buffer.hpp", 7, 0, 13000, 12080) ==
        "CUDA call cudaMalloc(&p, n) failed at loom/cuda/buffer.hpp:7: cudaErrorMemoryAllocation (out of memory); "
        "device 0, CUDA runtime 13.0, driver 12.8");

  int evaluations = 0;
  auto failing = [&] {
    ++evaluations;
    return cudaErrorInvalidValue;
  };
  try {
    LOOM_CUDA_CHECK(failing());
    FAIL("LOOM_CUDA_CHECK did not throw");
  } catch (const loom::CudaError& e) {
    CHECK(e.code() == cudaErrorInvalidValue);
    CHECK(std::string(e.what()).rfind("loom: CUDA call failing() failed at gpu/test_gpu_host.cpp:", 0) == 0);
    CHECK(std::string(e.what()).find("cudaErrorInvalidValue (invalid argument)") != std::string::npos);
  }
  CHECK(evaluations == 1);
  CHECK_NOTHROW(LOOM_CUDA_CHECK(cudaSuccess));
}

TEST_CASE("pinned allocation sizes: bytes of a contiguous tensor; negative sizes refused") {
  CHECK(loom::cuda::detail::tensor_bytes({2, 3}, at::kFloat) == 24);
  CHECK(loom::cuda::detail::tensor_bytes({5}, at::kBFloat16) == 10);
  CHECK(loom::cuda::detail::tensor_bytes({}, at::kDouble) == 8);
  CHECK(loom::cuda::detail::tensor_bytes({4, 0}, at::kLong) == 0);
  CHECK_THROWS_WITH_AS(loom::cuda::detail::tensor_bytes({2, -1}, at::kFloat),
                       doctest::Contains("negative size -1 in sizes [2, -1]"), loom::InvalidArgument);
}

TEST_CASE("without a CUDA device every entry point fails with a loom::CudaError naming the call") {
  const auto probe = loom::cuda::probe_devices();
  if (probe.count > 0) {
    MESSAGE("a CUDA device is present; the no-device behaviour is not checked here");
    return;
  }
  CHECK(!probe.reason.empty());
  CHECK(probe.reason.rfind("cudaGetDeviceCount: cuda", 0) == 0);
  MESSAGE("no device: " << probe.reason);

  CHECK_THROWS_WITH_AS((void)loom::cuda::pinned_empty({16}, at::kFloat),
                       doctest::Contains("cudaHostAlloc(&p, 64 bytes"), loom::CudaError);
  loom::cuda::PinnedPool pool;
  CHECK_THROWS_AS((void)pool.empty({16}, at::kFloat), loom::CudaError);
  CHECK(pool.stats().host_allocs == 0);
  // The device is selected first, so that is the call that fails.
  CHECK_THROWS_WITH_AS(loom::cuda::DeviceBuffer(0, 4096), doctest::Contains("CUDA call cudaGetDevice(&d) failed"),
                       loom::CudaError);
  CHECK_THROWS_AS((void)loom::cuda::Stream::create(0), loom::CudaError);
  CHECK_THROWS_AS(loom::cuda::Event(0), loom::CudaError);

  // The communicator: rank 1 never calls NCCL before it needs the device, so a missing id is a
  // timeout; rank 0 gets the id, then fails on the device with a CudaError (not a hang or crash).
  auto store = c10::make_intrusive<c10d::HashStore>();
  try {
    loom::NcclCommunicator comm(*store, 0, 2, {.timeout = std::chrono::seconds(2)});
    FAIL("NcclCommunicator constructed without a device");
  } catch (const loom::CudaError& e) {
    CHECK(std::string(e.what()).find("cudaGetDevice") != std::string::npos);
  }
  CHECK_THROWS_AS(loom::NcclCommunicator(*store, 0, 2, {.device = 0, .timeout = std::chrono::seconds(2)}),
                  loom::CudaError);
  CHECK_THROWS_WITH_AS(loom::NcclCommunicator(*store, 2, 2), doctest::Contains("rank 2 is outside [0, 2)"),
                       loom::InvalidArgument);
}

TEST_CASE("NcclOptions is an aggregate with designated initializers and documented defaults") {
  const loom::NcclOptions defaults;
  CHECK(defaults.device == -1);
  CHECK(defaults.timeout == loom::kDefaultTimeout);
  CHECK(defaults.stream == nullptr);
  CHECK(defaults.nonblocking);
  CHECK(defaults.store_prefix == "loom/nccl");
  const loom::NcclOptions o{.device = 3, .timeout = std::chrono::seconds(5), .nonblocking = false, .name = "dp"};
  CHECK(o.device == 3);
  CHECK(o.timeout == std::chrono::milliseconds(5000));
  CHECK(!o.nonblocking);
}

// Concepts: the NCCL types model loom's, the CUDA helpers do not pretend to.
static_assert(loom::AsyncCommunicator<loom::NcclCommunicator>);
static_assert(loom::WorkHandle<loom::NcclWork>);
static_assert(std::is_copy_constructible_v<loom::NcclWork>, "handles are values: copies refer to the same collective");
static_assert(!loom::WorkHandle<loom::cuda::Event>, "an Event has no wait(): use NcclWork or InFlightBatch");
static_assert(!loom::Communicator<loom::cuda::Stream>);
static_assert(!std::is_copy_constructible_v<loom::NcclCommunicator> &&
              std::is_move_constructible_v<loom::NcclCommunicator>);
static_assert(!std::is_copy_constructible_v<loom::cuda::Stream> &&
              !std::is_copy_constructible_v<loom::cuda::DeviceBuffer>);

// ---- the communicator's lifecycle under a watchdog, through the NcclApi seam ------------------
// NCCL allows one thread at a time to operate a communicator; ncclCommAbort frees it. These
// tests drive loom's state machine (detail::BasicNcclState, the code NcclCommunicator runs) with
// a fake NCCL whose calls take a little time, so that a watchdog thread's abort() lands while
// another thread polls a pending collective, and they count what NCCL forbids: two threads
// inside calls on one communicator at once, and any call on a communicator after its abort.
namespace {

struct FakeNccl {
  static inline std::mutex table_mutex;
  static inline std::set<ncclComm_t> live;      // created and neither aborted nor destroyed
  static inline std::atomic<int> inside{0};     // threads inside a call right now
  static inline std::atomic<int> overlaps{0};   // calls that began while another was inside
  static inline std::atomic<int> dead_uses{0};  // calls on a communicator that is not live
  static inline std::atomic<int> aborts{0};
  static inline std::atomic<int> polls{0};
  static inline std::atomic<ncclResult_t> async_state{ncclSuccess};  // what get_async_error reports
  static inline std::atomic<ncclResult_t> finalize_result{ncclSuccess};
  static constexpr auto kCallTime = std::chrono::microseconds(300);
  // How long ncclCommAbort takes; a real one can wait for the device to go idle.
  static inline std::atomic<std::chrono::microseconds> abort_time{kCallTime};

  static void reset() {
    std::lock_guard lk(table_mutex);
    live.clear();
    inside = 0;
    overlaps = 0;
    dead_uses = 0;
    aborts = 0;
    polls = 0;
    async_state = ncclSuccess;
    finalize_result = ncclSuccess;
    abort_time = kCallTime;
  }
  static ncclComm_t create() {
    static char handles[64];
    static std::atomic<int> next{0};
    auto c = reinterpret_cast<ncclComm_t>(&handles[next++ % 64]);
    std::lock_guard lk(table_mutex);
    live.insert(c);
    return c;
  }

  struct Call {
    explicit Call(ncclComm_t c) {
      if (inside.fetch_add(1) != 0) ++overlaps;
      std::lock_guard lk(table_mutex);
      if (live.count(c) == 0) ++dead_uses;
    }
    ~Call() { --inside; }
  };
  static void free(ncclComm_t c) {
    std::lock_guard lk(table_mutex);
    live.erase(c);
  }

  struct DeviceGuard {
    explicit DeviceGuard(int) {}
  };
  static ncclResult_t get_async_error(ncclComm_t c, ncclResult_t* state) {
    Call call(c);
    ++polls;
    std::this_thread::sleep_for(kCallTime);
    *state = async_state.load();
    return ncclSuccess;
  }
  static ncclResult_t abort(ncclComm_t c) {
    Call call(c);
    std::this_thread::sleep_for(abort_time.load());
    free(c);
    ++aborts;
    return ncclSuccess;
  }
  static ncclResult_t finalize(ncclComm_t c) {
    Call call(c);
    return finalize_result.load();
  }
  static ncclResult_t destroy(ncclComm_t c) {
    Call call(c);
    free(c);
    return ncclSuccess;
  }
  static const char* last_error(ncclComm_t c) {
    if (c != nullptr) Call call(c);
    return "";
  }
};
using FakeState = loom::detail::BasicNcclState<FakeNccl>;

std::shared_ptr<FakeState> fake_state(std::chrono::milliseconds timeout) {
  auto st = std::make_shared<FakeState>();
  st->comm = FakeNccl::create();
  st->site = {.rank = 1, .world_size = 2, .device = 0};
  st->timeout = timeout;
  st->poll_interval = std::chrono::microseconds(50);
  return st;
}

// Waits (bounded) until the fake saw at least n polls: the other thread is in its wait loop.
void wait_for_polls(int n) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (FakeNccl::polls.load() < n && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
  REQUIRE(FakeNccl::polls.load() >= n);
}

}  // namespace

TEST_CASE(
    "NCCL abort() from a watchdog thread while a collective waits: CommError, never a call on a freed communicator") {
  for (int trial = 0; trial < 20; ++trial) {
    CAPTURE(trial);
    FakeNccl::reset();
    auto st = fake_state(std::chrono::seconds(5));
    std::string error;
    std::thread waiter([&] {
      try {
        st->wait_event([] { return false; }, "all_reduce", std::chrono::steady_clock::now());  // a hung collective
        error = "wait returned";
      } catch (const loom::TimeoutError& e) {
        error = std::string("TimeoutError: ") + e.what();
      } catch (const loom::CommError& e) {
        error = e.what();
      }
    });
    wait_for_polls(3 + trial % 5);
    st->abort("watchdog: all_reduce exceeded its deadline");
    waiter.join();
    CHECK(error.find("all_reduce on rank 1: the NCCL communicator was aborted while this collective was pending") !=
          std::string::npos);
    CHECK(error.find("watchdog: all_reduce exceeded its deadline") != std::string::npos);
    CHECK(FakeNccl::overlaps.load() == 0);
    CHECK(FakeNccl::dead_uses.load() == 0);
    CHECK(FakeNccl::aborts.load() == 1);
    CHECK(st->phase == FakeState::Phase::aborted);
    CHECK(st->comm == nullptr);
  }
}

TEST_CASE("NCCL abort() that blocks (ncclCommAbort waiting for the device) still ends a pending wait at once") {
  // Seen on an H200 with NCCL 2.28: ncclCommAbort returned only after a 3 s stall of the
  // collective's input stream ended. The waiter must not wait for it.
  FakeNccl::reset();
  FakeNccl::abort_time = std::chrono::microseconds(1'500'000);
  auto st = fake_state(std::chrono::seconds(30));
  std::string error;
  std::chrono::steady_clock::time_point caught;
  std::thread waiter([&] {
    try {
      st->wait_event([] { return false; }, "all_reduce", std::chrono::steady_clock::now());
      error = "wait returned";
    } catch (const loom::CommError& e) {
      error = e.what();
    }
    caught = std::chrono::steady_clock::now();
  });
  wait_for_polls(3);
  const auto abort_start = std::chrono::steady_clock::now();
  st->abort("watchdog: a slow abort");
  const auto abort_end = std::chrono::steady_clock::now();
  waiter.join();
  CHECK(error.find("aborted while this collective was pending (watchdog: a slow abort)") != std::string::npos);
  CHECK(abort_end - abort_start >= std::chrono::milliseconds(1500));
  // The waiter saw the abort while ncclCommAbort still ran (it ends 1.5 s after abort_start).
  CHECK(caught - abort_start < std::chrono::milliseconds(1000));
  CHECK(FakeNccl::aborts.load() == 1);
  CHECK(FakeNccl::dead_uses.load() == 0);
  CHECK(FakeNccl::overlaps.load() == 0);
  CHECK(st->comm == nullptr);
  CHECK_THROWS_WITH_AS(st->ensure_live("barrier"), doctest::Contains("aborted earlier (watchdog: a slow abort)"),
                       loom::CommError);
}

TEST_CASE("NCCL abort() from two threads at once: ncclCommAbort runs once, the first reason stays") {
  for (int trial = 0; trial < 20; ++trial) {
    CAPTURE(trial);
    FakeNccl::reset();
    auto st = fake_state(std::chrono::seconds(5));
    std::atomic<int> ready{0};
    auto aborter = [&](const char* why) {
      ++ready;
      while (ready.load() < 2) {
      }
      st->abort(why);
    };
    std::thread a(aborter, "watchdog A");
    std::thread b(aborter, "watchdog B");
    a.join();
    b.join();
    CHECK(FakeNccl::aborts.load() == 1);
    CHECK(FakeNccl::overlaps.load() == 0);
    CHECK(FakeNccl::dead_uses.load() == 0);
    CHECK((st->abort_reason == "watchdog A" || st->abort_reason == "watchdog B"));
    const std::string expected =
        "broadcast on rank 1: the NCCL communicator was aborted earlier (" + st->abort_reason + ")";
    CHECK_THROWS_WITH_AS(st->ensure_live("broadcast"), doctest::Contains(expected.c_str()), loom::CommError);
  }
}

TEST_CASE("NCCL abort() from a watchdog while finalize() polls an in-progress call: finalize stops with CommError") {
  for (int trial = 0; trial < 5; ++trial) {
    CAPTURE(trial);
    FakeNccl::reset();
    FakeNccl::finalize_result = ncclInProgress;  // non-blocking finalize: polled until done
    FakeNccl::async_state = ncclInProgress;      // ... and it never finishes (a peer is gone)
    auto st = fake_state(std::chrono::seconds(2));
    std::string error;
    std::thread finalizer([&] {
      try {
        st->finalize();
        error = "finalize returned";
      } catch (const loom::TimeoutError& e) {
        error = std::string("TimeoutError: ") + e.what();
      } catch (const loom::CommError& e) {
        error = e.what();
      }
    });
    wait_for_polls(3);
    st->abort("watchdog: finalize took too long");
    finalizer.join();
    CHECK(error.find("nccl_finalize on rank 1: the NCCL communicator was aborted") != std::string::npos);
    CHECK(error.find("watchdog: finalize took too long") != std::string::npos);
    CHECK(FakeNccl::overlaps.load() == 0);
    CHECK(FakeNccl::dead_uses.load() == 0);
    CHECK(FakeNccl::aborts.load() == 1);
  }
}

TEST_CASE("NCCL lifecycle through the seam: finalize then destroy; abort after destroy changes nothing") {
  FakeNccl::reset();
  auto st = fake_state(std::chrono::seconds(5));
  const ncclComm_t c = st->comm;
  st->finalize();
  CHECK(st->phase == FakeState::Phase::finalized);
  st->destroy();
  CHECK(st->phase == FakeState::Phase::destroyed);
  CHECK(st->comm == nullptr);
  st->abort("late watchdog");
  CHECK(st->phase == FakeState::Phase::destroyed);
  CHECK(FakeNccl::aborts.load() == 0);
  CHECK(FakeNccl::dead_uses.load() == 0);
  {
    std::lock_guard lk(FakeNccl::table_mutex);
    CHECK(FakeNccl::live.count(c) == 0);
  }
}

namespace {
/// A flight recorder with one issued all_reduce entry and its exchange without a store (as an
/// NcclCommunicator built from a unique id keeps): a failure writes this rank's record only.
struct RecordedFailure {
  std::filesystem::path folder;
  std::shared_ptr<loom::detail::TraceExchange> trace;
  std::int64_t seq = -1;
  explicit RecordedFailure(const std::string& name)
      : folder(std::filesystem::temp_directory_path() / fmt::format("loom-gpu-host-{}-{}", name, getpid())) {
    std::filesystem::remove_all(folder);
    auto recorder = std::make_shared<loom::trace::FlightRecorder>(0, 1, "host:1", 16);
    trace = std::make_shared<loom::detail::TraceExchange>(recorder, c10::intrusive_ptr<c10d::Store>{},
                                                          c10::intrusive_ptr<c10d::Store>{}, std::chrono::seconds(2),
                                                          folder.string());
    seq = recorder->issue(loom::trace::Op::all_reduce, c10::ScalarType::Float, 256);
    recorder->waiting(seq);
  }
  ~RecordedFailure() { std::filesystem::remove_all(folder); }
  /// What rethrow_with_flight_record makes of `error`.
  template <class E>
  std::exception_ptr rethrown(E error) {
    try {
      loom::detail::rethrow_with_flight_record(std::make_exception_ptr(std::move(error)), *trace, seq);
    } catch (...) {
      return std::current_exception();
    }
    return nullptr;
  }
};
}  // namespace

TEST_CASE("NCCL errors carry the flight recorder's verdict: the type, code and fields stay, the record is written") {
  SUBCASE("TimeoutError: same collective, rank and seconds; the detail, then the verdict") {
    RecordedFailure f("timeout");
    const loom::TimeoutError original("all_reduce", 0, 2.5, "its CUDA event did not complete; timeout 2000 ms");
    const std::exception_ptr e = f.rethrown(original);
    try {
      std::rethrow_exception(e);
    } catch (const loom::TimeoutError& t) {
      CHECK(t.collective() == "all_reduce");
      CHECK(t.rank() == 0);
      CHECK(t.seconds_waited() == 2.5);
      const std::string what = t.what();
      CHECK(what.rfind(std::string(original.what()) + "; flight recorder: ", 0) == 0);
      CHECK(what.find("records in ") != std::string::npos);
    }
    const auto file = f.folder / "loom-trace-rank0.txt";
    REQUIRE(std::filesystem::exists(file));
    const auto records = loom::trace::read_folder(f.folder);
    REQUIRE(records.size() == 1);
    REQUIRE(records[0].entries.size() == 1);
    CHECK(records[0].entries[0].op == loom::trace::Op::all_reduce);
    CHECK(records[0].entries[0].numel == 256);
    CHECK(records[0].entries[0].state == loom::trace::State::failed);
    CHECK(records[0].reason.find("all_reduce timed out on rank 0 after 2.500 s") != std::string::npos);
  }
  SUBCASE("TimeoutError without a detail: the verdict is the detail") {
    RecordedFailure f("timeout-bare");
    const std::exception_ptr e = f.rethrown(loom::TimeoutError("barrier", 0, 1.0));
    try {
      std::rethrow_exception(e);
    } catch (const loom::TimeoutError& t) {
      CHECK(std::string(t.what()).rfind("loom: barrier timed out on rank 0 after 1.000 s: flight recorder: ", 0) == 0);
    }
  }
  SUBCASE("NcclError keeps its code; CommError stays a CommError; a later failure points to the first one's records") {
    RecordedFailure f("nccl");
    const std::exception_ptr e = f.rethrown(loom::NcclError(ncclUnhandledCudaError, "ncclAllReduce failed"));
    try {
      std::rethrow_exception(e);
    } catch (const loom::NcclError& n) {
      CHECK(n.code() == ncclUnhandledCudaError);
      CHECK(std::string(n.what()).rfind("loom: ncclAllReduce failed; flight recorder: ", 0) == 0);
    }
    const std::exception_ptr again = f.rethrown(loom::CommError("the NCCL communicator was aborted earlier"));
    CHECK_THROWS_WITH_AS(
        std::rethrow_exception(again),
        doctest::Contains("aborted earlier; flight recorder: the records of this communicator's first failure are in"),
        loom::CommError);
  }
  SUBCASE("CudaError keeps its code") {
    RecordedFailure f("cuda");
    const std::exception_ptr e = f.rethrown(loom::CudaError(cudaErrorIllegalAddress, "cudaEventQuery(event) failed"));
    try {
      std::rethrow_exception(e);
    } catch (const loom::CudaError& c) {
      CHECK(c.code() == cudaErrorIllegalAddress);
      CHECK(std::string(c.what()).rfind("loom: cudaEventQuery(event) failed; flight recorder: ", 0) == 0);
    }
    CHECK(f.trace->recorder().snapshot().entries.at(0).state == loom::trace::State::failed);
  }
  SUBCASE("anything but a CommError passes unchanged, and the entry is not marked failed") {
    RecordedFailure f("other");
    const std::exception_ptr e = f.rethrown(loom::InvalidArgument("all_reduce: unsupported dtype Bool"));
    CHECK_THROWS_WITH_AS(std::rethrow_exception(e), "loom: all_reduce: unsupported dtype Bool", loom::InvalidArgument);
    CHECK(f.trace->recorder().snapshot().entries.at(0).state == loom::trace::State::issued);
    CHECK_FALSE(std::filesystem::exists(f.folder));
  }
}
