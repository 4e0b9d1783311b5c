// Launch mistakes whose errors name their cause (issue 49, items 16-17): a MASTER_PORT held by a
// server that never answers, a second job started on a running job's MASTER_PORT, ranks that
// disagree on WORLD_SIZE, two processes that claim the same RANK. Each scenario runs real processes
// (loom::spawn) on loopback with a 2-3 s timeout, and checks the error's type, its text and that it
// came within the timeout.
#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <unistd.h>

#include <loom/comm/gloo.hpp>
#include <loom/launch/rendezvous.hpp>
#include <loom/launch/spawn.hpp>

#include "support/temp_dir.hpp"

namespace test_launch_causes {

namespace fs = std::filesystem;

namespace {

/// The folder the ranks write their outcome to (removed at scope exit).
using Folder = loom::test::TempDir;

/// Writes `text` to `p` through a rename, so a reader polling for `p` never sees it half written.
void write_file(const fs::path& p, const std::string& text) {
  std::ofstream out(p.string() + ".tmp");
  out << text;
  out.close();
  fs::rename(p.string() + ".tmp", p);
}

/// "<type> <seconds> <what()>" of what `body` throws (the type as "ConfigError", "CommError",
/// "TimeoutError", "other"), or "returned".
template <class Body>
std::string outcome(Body&& body) {
  const auto start = std::chrono::steady_clock::now();
  auto seconds = [&] { return loom::detail::seconds_since(start); };
  try {
    body();
  } catch (const loom::ConfigError& e) {
    return fmt::format("ConfigError {:.3f} {}", seconds(), e.what());
  } catch (const loom::TimeoutError& e) {
    return fmt::format("TimeoutError {:.3f} {}", seconds(), e.what());
  } catch (const loom::CommError& e) {
    return fmt::format("CommError {:.3f} {}", seconds(), e.what());
  } catch (const std::exception& e) {
    return fmt::format("other {:.3f} {}", seconds(), e.what());
  }
  return "returned";
}

/// The seconds an outcome() line reports.
double seconds_of(const std::string& line) {
  std::istringstream in(line);
  std::string type;
  double s = -1;
  in >> type >> s;
  return s;
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

}  // namespace

TEST_CASE("rendezvous: a MASTER_PORT whose server accepts and never answers is a TimeoutError within the timeout") {
  // A listening socket nobody accepts on: the kernel completes every connect, nothing ever answers.
  auto [fd, port] = loom::detail::reserve_port();
  REQUIRE(::listen(fd, 16) == 0);
  Folder out;
  const std::string result = (out.path / "result").string();
  loom::spawn(1,
              [&, port = port](int) {
                loom::Environment client;
                client.rank = 1;
                client.world_size = 2;
                client.master_port = port;
                write_file(result,
                           outcome([&] { (void)loom::rendezvous(client, {.timeout = std::chrono::seconds(2)}); }));
              },
              {.timeout = std::chrono::seconds(30)});
  ::close(fd);
  const std::string line = out.read("result");
  INFO(line);
  CHECK(line.starts_with("TimeoutError"));
  CHECK(contains(line, fmt::format("127.0.0.1:{} accepted the connection but answered no store request", port)));
  CHECK(seconds_of(line) >= 2.0);
  CHECK(seconds_of(line) < 3.5);
}

TEST_CASE("rendezvous: ranks that disagree on WORLD_SIZE are told which rank says what, at once") {
  Folder out;
  loom::spawn(2,
              [&](const loom::Environment& env0) {
                loom::Environment env = env0;
                if (env.rank == 1) env.world_size = 3;
                write_file(out.path / fmt::format("rank{}", env0.rank),
                           outcome([&] { (void)loom::rendezvous(env, {.timeout = std::chrono::seconds(3)}); }));
              },
              {.timeout = std::chrono::seconds(30)});
  for (int r = 0; r < 2; ++r) {
    const std::string line = out.read(fmt::format("rank{}", r));
    INFO("rank ", r, ": ", line);
    CHECK(line.starts_with("ConfigError"));
    CHECK(contains(line, "rank 1 says WORLD_SIZE=3, rank 0 says WORLD_SIZE=2"));
    CHECK(seconds_of(line) < 2.0);  // not at the 3 s timeout
  }
}

TEST_CASE("rendezvous: two processes with RANK=0 are told so, at once") {
  Folder out;
  loom::spawn(2,
              [&](const loom::Environment& env0) {
                loom::Environment env = env0;
                env.rank = 0;  // spawn's rank 1 claims rank 0 too
                write_file(out.path / fmt::format("process{}", env0.rank),
                           outcome([&] { (void)loom::rendezvous(env, {.timeout = std::chrono::seconds(3)}); }));
              },
              {.timeout = std::chrono::seconds(30)});
  for (int p = 0; p < 2; ++p) {
    const std::string line = out.read(fmt::format("process{}", p));
    INFO("process ", p, ": ", line);
    CHECK(line.starts_with("ConfigError"));
    CHECK(contains(line, "two processes claim RANK=0"));
    CHECK(seconds_of(line) < 2.0);
  }
}

TEST_CASE("rendezvous: two processes with RANK=1 are told so, at once") {
  Folder out;
  loom::spawn(3,
              [&](const loom::Environment& env0) {
                loom::Environment env = env0;
                env.world_size = 2;
                if (env.rank == 2) env.rank = 1;
                c10::intrusive_ptr<c10d::Store> store;
                write_file(out.path / fmt::format("process{}", env0.rank),
                           outcome([&] { store = loom::rendezvous(env, {.timeout = std::chrono::seconds(3)}); }));
                // Rank 0 keeps its store until every process is done with it.
                const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
                while (std::chrono::steady_clock::now() < deadline &&
                       !(fs::exists(out.path / "process0") && fs::exists(out.path / "process1") &&
                         fs::exists(out.path / "process2")))
                  std::this_thread::sleep_for(std::chrono::milliseconds(5));
              },
              {.timeout = std::chrono::seconds(30)});
  // Rank 0 and the first RANK=1 to arrive may meet before the second one does: at least the
  // second claimant is told, and nobody waits for the timeout.
  int told = 0;
  for (int p = 0; p < 3; ++p) {
    const std::string line = out.read(fmt::format("process{}", p));
    INFO("process ", p, ": ", line);
    CHECK(line != "");
    if (line == "returned") continue;
    CHECK(line.starts_with("ConfigError"));
    CHECK(contains(line, "two processes claim RANK=1"));
    CHECK(seconds_of(line) < 2.0);
    ++told;
  }
  CHECK(told >= 1);
}

TEST_CASE("rendezvous: a second job on a running job's MASTER_PORT names the other job's store, within its timeout") {
  Folder out;
  auto [fd, port] = loom::detail::reserve_port();
  ::close(fd);  // job 1 hosts its store on it
  const fs::path up = out.path / "up", done = out.path / "done";
  // Two jobs side by side, each a loom::spawn of its own (own secret), started from two processes.
  loom::spawn(2,
              [&, port = port](int outer) {
                const auto wait_for = [](const fs::path& p) {
                  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
                  while (!fs::exists(p) && std::chrono::steady_clock::now() < deadline)
                    std::this_thread::sleep_for(std::chrono::milliseconds(10));
                };
                if (outer == 0) {  // job 1: two ranks that join and stay until job 2 is done
                  loom::spawn(2,
                              [&](const loom::Environment& env) {
                                loom::GlooCommunicator comm(env, {.timeout = std::chrono::seconds(20)});
                                if (env.rank == 0) write_file(up, "1");
                                wait_for(done);
                                comm.barrier();
                              },
                              {.timeout = std::chrono::seconds(40), .master_port = port});
                  return;
                }
                wait_for(up);
                try {
                  loom::spawn(2,
                              [&](const loom::Environment& env) {
                                write_file(out.path / fmt::format("job2rank{}", env.rank), outcome([&] {
                                             loom::GlooCommunicator comm(env, {.timeout = std::chrono::seconds(2)});
                                           }));
                              },
                              {.timeout = std::chrono::seconds(30), .master_port = port});
                } catch (...) {
                }
                write_file(done, "1");
              },
              {.timeout = std::chrono::seconds(60)});
  for (int r = 0; r < 2; ++r) {
    const std::string line = out.read(fmt::format("job2rank{}", r));
    INFO("job 2's rank ", r, ": ", line);
    CHECK(line.starts_with("CommError"));
    CHECK(contains(line, fmt::format("127.0.0.1:{} is held by another job's store", port)));
    CHECK(seconds_of(line) < 2.5);
  }
}

TEST_CASE("spawn: a rank's LibTorch error is reported without its backtrace, each failed rank on a line of its own") {
  try {
    loom::spawn(2,
                [](int rank) {
                  if (rank == 1) TORCH_CHECK(false, "the batch has 3 columns, the model wants 4");
                  std::this_thread::sleep_for(std::chrono::seconds(60));  // terminated by spawn
                },
                {.timeout = std::chrono::seconds(50), .grace = std::chrono::milliseconds(200)});
    FAIL("spawn did not throw");
  } catch (const loom::SpawnError& e) {
    const std::string what = e.what();
    INFO(what);
    REQUIRE(e.failures().size() == 2);
    CHECK(e.failures()[0].message == "c10::Error: the batch has 3 columns, the model wants 4");
    CHECK(what ==
          "loom: spawn: rank 1 threw c10::Error: the batch has 3 columns, the model wants 4 (of 2 ranks)\n"
          "  then rank 0 was terminated by spawn");
  }
}

TEST_CASE("without_backtrace: LibTorch's backtrace lines go, the message's own lines stay") {
  const std::string text =
      "all_reduce failed: Connection reset by peer\nException raised from recvBytes at Utils.hpp:787 (most recent "
      "call first):\nframe #0: c10::Error::Error(...) + 0x9d (0x7f in libc10.so)\nframe #1: <unknown function> + "
      "0x67 (0x7f in libtorch_cpu.so)\nhint: check the network\n";
  CHECK(loom::detail::without_backtrace(text) ==
        "all_reduce failed: Connection reset by peer\nhint: check the network");
  CHECK(loom::detail::without_backtrace("one line") == "one line");
}

}  // namespace test_launch_causes
