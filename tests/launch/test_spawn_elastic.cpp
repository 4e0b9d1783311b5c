// loom::spawn with SpawnOptions::elastic: the store lives in spawn's store process (it outlives
// rank 0), a rank's death ends nothing, what spawn reports at the end, and that no store process is
// left after spawn returns or throws. Real processes on loopback.
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fcntl.h>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>
#include <vector>

#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <loom/launch/detail/store_identity.hpp>
#include <loom/launch/rendezvous.hpp>
#include <loom/launch/spawn.hpp>

#include "support/temp_dir.hpp"

namespace test_spawn_elastic {

namespace fs = std::filesystem;
using namespace std::chrono_literals;

namespace {

using Folder = loom::test::TempDir;

/// Writes `text` to `p` through a rename, so a rank polling for `p` never sees it half written.
void publish(const fs::path& p, const std::string& text) {
  {
    std::ofstream out(p.string() + ".tmp");
    out << text;
  }
  fs::rename(p.string() + ".tmp", p);
}

/// The content of `p` once it exists (polled); throws after `timeout` (inside a rank: a SpawnError).
std::string await_file(const fs::path& p, std::chrono::milliseconds timeout = 30s) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!fs::exists(p)) {
    if (std::chrono::steady_clock::now() > deadline) throw std::runtime_error("no file " + p.string());
    std::this_thread::sleep_for(2ms);
  }
  return loom::test::read_file(p);
}

/// Whether process `pid` has ended: gone, or a zombie its parent has not reaped yet.
bool dead(pid_t pid) {
  std::ifstream stat(fmt::format("/proc/{}/stat", pid));
  if (!stat) return true;
  std::string line;
  std::getline(stat, line);
  const auto paren = line.rfind(')');  // "pid (comm) S ...": the state follows the command's name
  return paren == std::string::npos || line.size() < paren + 3 || line[paren + 2] == 'Z' || line[paren + 2] == 'X';
}

/// Waits until process `pid` has ended; throws after `timeout`.
void await_death(pid_t pid, std::chrono::milliseconds timeout = 30s) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!dead(pid)) {
    if (std::chrono::steady_clock::now() > deadline) throw std::runtime_error(fmt::format("pid {} still runs", pid));
    std::this_thread::sleep_for(2ms);
  }
}

/// True when this process has no child at all (running, or ended and not reaped): spawn left nothing.
bool no_children_left() {
  return ::waitpid(-1, nullptr, WNOHANG) == -1 && errno == ECHILD;
}

/// Sends this process's standard error (fd 2, inherited by the processes spawn forks) to a file for
/// its lifetime.
struct StderrToFile {
  int saved = -1;
  explicit StderrToFile(const fs::path& p) {
    std::fflush(stderr);
    saved = ::dup(2);
    const int fd = ::open(p.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    REQUIRE(fd >= 0);
    ::dup2(fd, 2);
    ::close(fd);
  }
  ~StderrToFile() {
    std::fflush(stderr);
    ::dup2(saved, 2);
    ::close(saved);
  }
};

/// The lines of `text` that start with `prefix`.
std::vector<std::string> lines_starting(const std::string& text, const std::string& prefix) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);)
    if (line.starts_with(prefix)) out.push_back(line);
  return out;
}

std::vector<std::uint8_t> bytes(const std::string& s) {
  return {s.begin(), s.end()};
}
std::string text(const std::vector<std::uint8_t>& v) {
  return {v.begin(), v.end()};
}

/// The identity line of the store at MASTER_PORT ("job <tag> world_size <n> host <host:pid>"), read
/// by a plain client (the key is outside the job's prefix).
std::string store_identity_line(const loom::Environment& env) {
  c10d::TCPStoreOptions opts;
  opts.port = env.master_port;
  opts.isServer = false;
  opts.waitWorkers = false;
  opts.timeout = std::chrono::seconds(10);
  c10d::TCPStore store(env.master_addr, opts);
  return text(store.get(loom::detail::kStoreIdentityKey));
}

/// The pid at the end of a "host:pid".
pid_t pid_of(const std::string& host_and_pid) {
  return static_cast<pid_t>(std::stol(host_and_pid.substr(host_and_pid.rfind(':') + 1)));
}

}  // namespace

TEST_CASE("spawn, elastic: the store outlives rank 0; the others use it after rank 0 was killed, and spawn returns") {
  Folder dir("loom-elastic");
  const fs::path d = dir.path;
  {
    StderrToFile capture(d / "stderr");
    loom::spawn(3,
                [d](const loom::Environment& env) {
                  if (!env.external_store)
                    throw std::runtime_error("the rank does not know spawn's store process hosts the store");
                  publish(d / fmt::format("pid{}", env.rank), std::to_string(::getpid()));
                  auto store = loom::rendezvous(env, {.timeout = 30s});  // all three arrived
                  if (env.rank == 0) {
                    store->set("rank0_pid", bytes(std::to_string(::getpid())));
                    (void)store->get("rank0_pid");  // answered: the store has the key before rank 0 dies
                    std::raise(SIGKILL);
                  }
                  await_death(static_cast<pid_t>(std::stol(text(store->get("rank0_pid")))));
                  // Rank 0 is dead: the store still serves, since its host was never rank 0.
                  if (env.rank == 1) {
                    store->set("after", bytes("set by rank 1 after rank 0 died"));
                    publish(d / "identity", store_identity_line(env));
                    publish(d / "secret", env.rendezvous_secret);
                  } else {
                    store->wait({"after"});
                    publish(d / "rank2", text(store->get("after")));
                  }
                },
                {.timeout = 60s, .elastic = true});
  }
  CHECK(dir.read("rank2") == "set by rank 1 after rank 0 died");
  const std::string err = dir.read("stderr");
  INFO("stderr of the job: ", err);
  CHECK(lines_starting(err, "loom: spawn:") ==
        std::vector<std::string>{
            "loom: spawn: rank 0 was killed by signal SIGKILL (9); the other ranks went on (elastic)"});
  // The store's identity names the store process (none of the ranks, not this process), this job's
  // secret and world size; that process is gone now, and so is every child of this process.
  const auto id = loom::detail::parse_store_identity(dir.read("identity"));
  REQUIRE(id.has_value());
  CHECK(id->world_size == 3);
  CHECK(id->tag == loom::detail::job_tag(dir.read("secret")));
  const pid_t store_pid = pid_of(id->host);
  CHECK(store_pid > 0);
  CHECK(store_pid != ::getpid());
  for (int r = 0; r < 3; ++r) CHECK(store_pid != std::stol(dir.read(fmt::format("pid{}", r))));
  CHECK(::kill(store_pid, 0) == -1);
  CHECK(errno == ESRCH);
  CHECK(no_children_left());
}

namespace {

/// Rank 1 throws; ranks 0 and 2 wait until it has died, then work well past `grace` and leave a
/// "done" file. Returns the SpawnError spawn threw.
loom::SpawnError throw_in_rank_1(const fs::path& d, bool elastic) {
  try {
    loom::spawn(3,
                [d](int rank) {
                  publish(d / fmt::format("pid{}", rank), std::to_string(::getpid()));
                  if (rank == 1) throw std::out_of_range("boom from rank 1");
                  await_death(static_cast<pid_t>(std::stol(await_file(d / "pid1"))));
                  std::this_thread::sleep_for(1s);  // 10 x grace: without elastic, spawn's SIGTERM comes first
                  publish(d / fmt::format("done{}", rank), "done");
                },
                {.timeout = 60s, .grace = 100ms, .elastic = elastic});
  } catch (const loom::SpawnError& e) {
    return e;
  }
  FAIL("spawn did not throw");
  return loom::SpawnError(3, {});
}

}  // namespace

TEST_CASE("spawn, elastic: a rank that throws is a SpawnError naming it, and the others were not terminated") {
  Folder dir("loom-elastic");
  const loom::SpawnError e = throw_in_rank_1(dir.path, true);
  INFO(e.what());
  CHECK(e.failed_rank() == 1);
  REQUIRE(e.failures().size() == 1);  // ranks 0 and 2 succeeded
  CHECK(e.failures()[0].kind == loom::RankFailure::Kind::exception);
  CHECK(e.failures()[0].message == "std::out_of_range: boom from rank 1");
  CHECK(std::string(e.what()) == "loom: spawn: rank 1 threw std::out_of_range: boom from rank 1 (of 3 ranks)");
  CHECK(dir.read("done0") == "done");
  CHECK(dir.read("done2") == "done");
  CHECK(no_children_left());

  // The same job without elastic: the grace period ends ranks 0 and 2 before they are done.
  Folder plain("loom-elastic");
  const loom::SpawnError p = throw_in_rank_1(plain.path, false);
  INFO(p.what());
  REQUIRE(p.failures().size() == 3);
  CHECK(p.failures()[1].kind == loom::RankFailure::Kind::terminated);
  CHECK(p.failures()[2].kind == loom::RankFailure::Kind::terminated);
  CHECK_FALSE(fs::exists(plain.path / "done0"));
  CHECK_FALSE(fs::exists(plain.path / "done2"));
}

TEST_CASE("spawn, elastic: a non-zero exit, or no rank that succeeded, is a SpawnError") {
  try {
    loom::spawn(2,
                [](int rank) {
                  if (rank == 0) std::exit(3);
                },
                {.timeout = 60s, .elastic = true});
    FAIL("spawn did not throw");
  } catch (const loom::SpawnError& e) {
    INFO(e.what());
    REQUIRE(e.failures().size() == 1);
    CHECK(e.failures()[0].rank == 0);
    CHECK(e.failures()[0].kind == loom::RankFailure::Kind::exit_code);
    CHECK(e.failures()[0].code == 3);
  }
  try {
    loom::spawn(2, [](int) { std::raise(SIGKILL); }, {.timeout = 60s, .elastic = true});
    FAIL("spawn did not throw");
  } catch (const loom::SpawnError& e) {
    INFO(e.what());
    REQUIRE(e.failures().size() == 2);
    for (const auto& f : e.failures()) {
      CHECK(f.kind == loom::RankFailure::Kind::signal);
      CHECK(f.code == SIGKILL);
    }
  }
  CHECK(no_children_left());
}

TEST_CASE("spawn, elastic: the timeout still terminates every rank, and the store process goes too") {
  Folder dir("loom-elastic");
  const fs::path d = dir.path;
  try {
    loom::spawn(2,
                [d](int rank) {
                  publish(d / fmt::format("started{}", rank), "");
                  for (int i = 0; i < 600; ++i) std::this_thread::sleep_for(100ms);
                  publish(d / fmt::format("finished{}", rank), "");
                },
                {.timeout = 2s, .kill_after = 300ms, .elastic = true});
    FAIL("spawn did not throw");
  } catch (const loom::TimeoutError& e) {
    INFO(e.what());
    CHECK(e.collective() == "spawn");
    CHECK(std::string(e.what()).find("ranks [0, 1] of 2 were still running after the 2.000 s limit") !=
          std::string::npos);
  }
  CHECK(fs::exists(d / "started0"));
  CHECK(fs::exists(d / "started1"));
  CHECK_FALSE(fs::exists(d / "finished0"));
  CHECK(no_children_left());
}

TEST_CASE("spawn, elastic: a store process that cannot host the store is a CommError naming MASTER_PORT") {
  // A port some other program listens on: the store process cannot bind it; no rank is started.
  auto [fd, port] = loom::detail::reserve_port();
  REQUIRE(::listen(fd, 16) == 0);
  Folder dir("loom-elastic");
  const fs::path d = dir.path;
  try {
    loom::spawn(2, [d](int rank) { publish(d / fmt::format("ran{}", rank), ""); },
                {.timeout = 60s, .master_port = port, .elastic = true});
    FAIL("spawn did not throw");
  } catch (const loom::CommError& e) {
    INFO(e.what());
    CHECK(std::string(e.what()).find(fmt::format("could not host the store on 127.0.0.1:{} (MASTER_PORT)", port)) !=
          std::string::npos);
  }
  ::close(fd);
  CHECK_FALSE(fs::exists(d / "ran0"));
  CHECK_FALSE(fs::exists(d / "ran1"));
  CHECK(no_children_left());
}

TEST_CASE("spawn_command, elastic: the exec'd ranks are told the store's host; a killed rank ends nothing") {
  Folder dir("loom-elastic");
  {
    StderrToFile capture(dir.path / "stderr");
    loom::spawn_command(2,
                        {"/bin/sh", "-c",
                         fmt::format("echo \"$LOOM_STORE_HOST\" > {}/h$RANK; if [ \"$RANK\" = 1 ]; then kill -9 $$; fi",
                                     dir.path.string())},
                        {.timeout = 60s, .elastic = true});
  }
  CHECK(dir.read("h0") == "spawn\n");
  CHECK(dir.read("h1") == "spawn\n");
  CHECK(lines_starting(dir.read("stderr"), "loom: spawn:") ==
        std::vector<std::string>{
            "loom: spawn: rank 1 was killed by signal SIGKILL (9); the other ranks went on (elastic)"});
  CHECK(no_children_left());
}

TEST_CASE("spawn without elastic: rank 0 hosts the store, LOOM_STORE_HOST is not passed on") {
  // An outer elastic job's variable in this process is removed from the ranks of a plain spawn.
  ::setenv("LOOM_STORE_HOST", "spawn", 1);
  Folder dir("loom-elastic");
  const fs::path d = dir.path;
  loom::spawn(2,
              [d](const loom::Environment& env) {
                auto store = loom::rendezvous(env, {.timeout = 30s});
                publish(
                    d / fmt::format("rank{}", env.rank),
                    fmt::format("{} {} {}", env.external_store, std::getenv("LOOM_STORE_HOST") == nullptr, ::getpid()));
                if (env.rank == 1) {
                  publish(d / "identity", store_identity_line(env));
                  store->set("done1", bytes("1"));
                } else {
                  store->wait({"done1"});  // the store's host stays until rank 1 read the identity
                }
              },
              {.timeout = 60s});
  ::unsetenv("LOOM_STORE_HOST");
  std::istringstream rank0(dir.read("rank0")), rank1(dir.read("rank1"));
  std::string external0, unset0, external1, unset1;
  long pid0 = 0, pid1 = 0;
  rank0 >> external0 >> unset0 >> pid0;
  rank1 >> external1 >> unset1 >> pid1;
  CHECK(external0 == "false");
  CHECK(unset0 == "true");
  CHECK(external1 == "false");
  CHECK(unset1 == "true");
  // Rank 0 hosted it: the identity names rank 0's pid.
  const auto id = loom::detail::parse_store_identity(dir.read("identity"));
  REQUIRE(id.has_value());
  CHECK(id->world_size == 2);
  CHECK(pid_of(id->host) == pid0);
  CHECK(pid0 != pid1);
  CHECK(no_children_left());
}

}  // namespace test_spawn_elastic
