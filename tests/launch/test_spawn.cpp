// loom::spawn and spawn_command: variables seen by the ranks, every way a rank can fail, the overall
// timeout, the fork rule (intra-op threads), and rendezvous timeouts.
#include <algorithm>
#include <csignal>
#include <fcntl.h>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <thread>
#include <unistd.h>

#include <loom/launch/rendezvous.hpp>
#include <loom/launch/spawn.hpp>

namespace test_spawn {

namespace fs = std::filesystem;

namespace {

/// A fresh temporary folder, removed at scope exit: the ranks write files, the parent reads them.
struct TempDir {
  fs::path path;
  TempDir() {
    std::string templ = (fs::temp_directory_path() / "loom-spawn-XXXXXX").string();
    REQUIRE(mkdtemp(templ.data()) != nullptr);
    path = templ;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  [[nodiscard]] std::string read(const std::string& name) const {
    std::ifstream in(path / name);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }
};

void write_file(const fs::path& p, const std::string& text) {
  std::ofstream out(p);
  out << text;
}

}  // namespace

TEST_CASE("RankFunction: what spawn accepts") {
  auto by_rank = [](int) {};
  auto by_env = [](const loom::Environment&) {};
  auto neither = [](const std::string&) {};
  static_assert(loom::RankFunction<decltype(by_rank)>);
  static_assert(loom::RankFunction<decltype(by_env)>);
  static_assert(!(loom::RankFunction<decltype(neither)>));
  static_assert(!(loom::RankFunction<int>));
}

TEST_CASE("spawn: every rank runs once with torchrun's variables") {
  TempDir dir;
  const fs::path d = dir.path;
  loom::spawn(3, [d](const loom::Environment& env) {
    write_file(d / fmt::format("rank{}", env.rank),
               fmt::format("{} {} {} {} {} {} {} {} {} {}", env.rank, env.world_size, env.local_rank,
                           env.local_world_size, env.master_addr, env.master_port, to_string(env.launcher),
                           std::getenv("OMP_NUM_THREADS"), at::get_num_threads(), env.rendezvous_secret));
  });
  std::string port, secret;
  for (int r = 0; r < 3; ++r) {
    std::istringstream in(dir.read(fmt::format("rank{}", r)));
    int rank = -1, world = -1, lrank = -1, lworld = -1, threads = -1;
    std::string addr, p, launcher, omp, s;
    in >> rank >> world >> lrank >> lworld >> addr >> p >> launcher >> omp >> threads >> s;
    // One job secret for all ranks: 32 hexadecimal digits.
    CHECK(s.size() == 32);
    CHECK(s.find_first_not_of("0123456789abcdef") == std::string::npos);
    if (r == 0) secret = s;
    CHECK(s == secret);
    CHECK(rank == r);
    CHECK(world == 3);
    CHECK(lrank == r);
    CHECK(lworld == 3);
    CHECK(addr == "127.0.0.1");
    CHECK(launcher == "spawn");
    CHECK(omp == "1");
    CHECK(threads == 1);
    CHECK(std::stoi(p) > 0);
    if (r == 0) port = p;
    CHECK(p == port);  // one MASTER_PORT for the whole job
  }
}

TEST_CASE("spawn: children start with default signal handling, not the parent's handlers") {
  // doctest installs crash handlers (SIGSEGV, SIGTERM, ...) in this process; a rank must not inherit them.
  struct sigaction parent_action {};
  sigaction(SIGTERM, nullptr, &parent_action);
  const bool parent_has_handler = parent_action.sa_handler != SIG_DFL;
  CHECK(parent_has_handler);  // otherwise this test proves nothing
  // A signal the parent ignores stays ignored in the ranks, as across execve(2).
  struct sigaction ignore {
  }, saved{};
  ignore.sa_handler = SIG_IGN;
  REQUIRE(sigaction(SIGUSR2, &ignore, &saved) == 0);
  loom::spawn(1, [](int) {
    struct sigaction a {};
    sigaction(SIGTERM, nullptr, &a);
    if (a.sa_handler != SIG_DFL) throw std::runtime_error("SIGTERM handler inherited from the parent");
    sigaction(SIGSEGV, nullptr, &a);
    if (a.sa_handler != SIG_DFL) throw std::runtime_error("SIGSEGV handler inherited from the parent");
    sigaction(SIGUSR2, nullptr, &a);
    if (a.sa_handler != SIG_IGN) throw std::runtime_error("SIGUSR2 is ignored in the parent but not in the rank");
  });
  sigaction(SIGUSR2, &saved, nullptr);
}

TEST_CASE("spawn: every spawn call gives its ranks a new secret") {
  TempDir dir;
  const fs::path d = dir.path;
  for (int call = 0; call < 2; ++call)
    loom::spawn(1, [d, call](int) { write_file(d / fmt::format("s{}", call), std::getenv("LOOM_RENDEZVOUS_SECRET")); });
  CHECK(dir.read("s0").size() == 32);
  CHECK(dir.read("s0") != dir.read("s1"));
}

TEST_CASE("spawn: fn(int) form, one rank, and SpawnOptions::env") {
  TempDir dir;
  const fs::path d = dir.path;
  loom::spawn(1, [d](int rank) { write_file(d / "one", fmt::format("{} {}", rank, std::getenv("LOOM_TEST_VALUE"))); },
              {.env = {{"LOOM_TEST_VALUE", "forty-two"}}});
  CHECK(dir.read("one") == "0 forty-two");
  CHECK_THROWS_WITH_AS(loom::spawn(0, [](int) {}), "loom: spawn: nprocs = 0 (need >= 1)", loom::InvalidArgument);
}

TEST_CASE("spawn: an exception in one rank is reported with its type and text; the others are terminated") {
  try {
    loom::spawn(3,
                [](int rank) {
                  if (rank == 1) throw std::out_of_range("boom from rank 1");
                  std::this_thread::sleep_for(std::chrono::seconds(60));  // must be terminated, not waited for
                },
                {.timeout = std::chrono::seconds(50), .grace = std::chrono::milliseconds(200)});
    FAIL("spawn did not throw");
  } catch (const loom::SpawnError& e) {
    INFO(e.what());
    CHECK(e.failed_rank() == 1);
    REQUIRE(e.failures().size() == 3);
    CHECK(e.failures()[0].kind == loom::RankFailure::Kind::exception);
    CHECK(e.failures()[0].message == "std::out_of_range: boom from rank 1");
    CHECK(e.failures()[1].kind == loom::RankFailure::Kind::terminated);
    CHECK(e.failures()[2].kind == loom::RankFailure::Kind::terminated);
    CHECK(std::string(e.what()).rfind("loom: spawn: rank 1 threw std::out_of_range: boom from rank 1 (of 3 ranks)",
                                      0) == 0);
  }
}

TEST_CASE("spawn: a non-zero exit code and a signal are named") {
  try {
    loom::spawn(2,
                [](int rank) {
                  if (rank == 1) std::exit(7);
                  std::this_thread::sleep_for(std::chrono::seconds(60));
                },
                {.grace = std::chrono::milliseconds(100)});
    FAIL("spawn did not throw");
  } catch (const loom::SpawnError& e) {
    CHECK(e.failed_rank() == 1);
    CHECK(e.failures()[0].kind == loom::RankFailure::Kind::exit_code);
    CHECK(e.failures()[0].code == 7);
    CHECK(std::string(e.what()).find("rank 1 exited with code 7") != std::string::npos);
  }
  try {
    loom::spawn(2, [](int rank) {
      if (rank == 0) std::raise(SIGSEGV);
    });
    FAIL("spawn did not throw");
  } catch (const loom::SpawnError& e) {
    CHECK(e.failed_rank() == 0);
    CHECK(e.failures().size() == 1);  // rank 1 finished normally
    CHECK(e.failures()[0].kind == loom::RankFailure::Kind::signal);
    CHECK(e.failures()[0].code == SIGSEGV);
    CHECK(std::string(e.what()).find("rank 0 was killed by signal SIGSEGV (11)") != std::string::npos);
  }
}

TEST_CASE("spawn: the overall timeout terminates every rank and names the ones still running") {
  // Checked by events, not by the clock: each rank leaves a marker when it started; rank 1 catches
  // SIGTERM (leaving a marker) and keeps running, so only spawn's SIGKILL can end it; neither rank
  // may reach its "finished" marker. 2 s is far longer than a rank needs to start.
  TempDir dir;
  static std::string term_marker;  // used by the signal handler (async-signal-safe open/close)
  term_marker = (dir.path / "term1").string();
  const fs::path d = dir.path;
  try {
    loom::spawn(2,
                [d](int rank) {
                  if (rank == 1) {
                    struct sigaction on_term {};
                    on_term.sa_handler = [](int) { ::close(::open(term_marker.c_str(), O_CREAT | O_WRONLY, 0600)); };
                    sigaction(SIGTERM, &on_term, nullptr);
                  }
                  write_file(d / fmt::format("started{}", rank), "");
                  for (int i = 0; i < 600; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
                  write_file(d / fmt::format("finished{}", rank), "");
                },
                {.timeout = std::chrono::seconds(2), .kill_after = std::chrono::milliseconds(300)});
    FAIL("spawn did not throw");
  } catch (const loom::TimeoutError& e) {
    INFO(e.what());
    CHECK(e.collective() == "spawn");
    CHECK(std::string(e.what()).find("ranks [0, 1] of 2 were still running after the 2.000 s limit") !=
          std::string::npos);
  }
  CHECK(fs::exists(dir.path / "started0"));
  CHECK(fs::exists(dir.path / "started1"));
  CHECK(fs::exists(dir.path / "term1"));  // SIGTERM came first; rank 1 survived it, so SIGKILL ended it
  CHECK_FALSE(fs::exists(dir.path / "finished0"));
  CHECK_FALSE(fs::exists(dir.path / "finished1"));
}

TEST_CASE("spawn: the fork rule: a parent that used the OpenMP pool, children with one thread each") {
  // The parent runs a parallel ATen op on 2 threads first; children forked afterwards with more than
  // one thread could hang in libgomp. With the default threads_per_rank = 1 they must finish.
  const int before = at::get_num_threads();
  at::set_num_threads(2);
  auto x = torch::rand({512, 1024});
  CHECK((x * 2 + 1).exp().sum().item<double>() > 0);
  at::set_num_threads(before);
  loom::spawn(2,
              [](int) {
                if (at::get_num_threads() != 1) throw std::runtime_error("child has more than one intra-op thread");
                auto y = torch::rand({512, 1024});
                if (!((y * 2 + 1).exp().sum().item<double>() > 0)) throw std::runtime_error("bad sum");
              },
              {.timeout = std::chrono::seconds(60)});
}

TEST_CASE("spawn_command: the exec-based mode runs a program per rank") {
  TempDir dir;
  loom::spawn_command(
      2, {"/bin/sh", "-c", fmt::format("echo \"$RANK $WORLD_SIZE $MASTER_ADDR\" > {}/r$RANK", dir.path.string())});
  CHECK(dir.read("r0") == "0 2 127.0.0.1\n");
  CHECK(dir.read("r1") == "1 2 127.0.0.1\n");
  try {
    // exec: rank 0's shell becomes the sleep, which spawn's SIGTERM then ends. A shell's child outlives
    // its terminated shell (spawn signals each rank's process, not what it started) and would hold the
    // test's standard output open for the whole minute.
    loom::spawn_command(2, {"/bin/sh", "-c", "if [ \"$RANK\" = 1 ]; then exit 3; fi; exec sleep 60"},
                        {.grace = std::chrono::milliseconds(100)});
    FAIL("spawn_command did not throw");
  } catch (const loom::SpawnError& e) {
    CHECK(e.failed_rank() == 1);
    CHECK(e.failures()[0].code == 3);
    CHECK(e.failures()[1].kind == loom::RankFailure::Kind::terminated);
  }
  try {
    loom::spawn_command(1, {"/nonexistent/loom-program"});
    FAIL("spawn_command did not throw");
  } catch (const loom::SpawnError& e) {
    CHECK(e.failures()[0].message.find("exec of '/nonexistent/loom-program' failed") != std::string::npos);
  }
  CHECK_THROWS_AS(loom::spawn_command(1, {}), loom::InvalidArgument);
}

TEST_CASE("rendezvous: unreachable store and missing ranks are TimeoutErrors naming the rendezvous") {
  // A port that is bound but not listening: nobody answers there.
  auto [fd, port] = loom::detail::reserve_port();
  // In a rank of its own, so that a rendezvous that ignored its timeout ends as spawn's TimeoutError
  // instead of hanging the suite; the test checks what happened, not how long it took.
  loom::spawn(1,
              [port = port](int) {
                loom::Environment client;
                client.rank = 1;
                client.world_size = 2;
                client.master_port = port;
                try {
                  (void)loom::rendezvous(client, {.timeout = std::chrono::seconds(1)});
                } catch (const loom::TimeoutError& e) {
                  const std::string what = e.what();
                  if (e.collective() != "rendezvous" || e.rank() != 1 ||
                      what.find(fmt::format("could not reach the store at 127.0.0.1:{} hosted by rank 0", port)) ==
                          std::string::npos)
                    throw;
                  // It kept trying for the whole timeout (c10d alone gives up early), so a rank 0 that starts late
                  // is still found.
                  if (e.seconds_waited() < 1.0)
                    throw std::runtime_error(fmt::format("gave up after {:.3f} s", e.seconds_waited()));
                  return;
                }
                throw std::runtime_error("rendezvous did not throw");
              },
              {.timeout = std::chrono::seconds(60)});
  close(fd);

  // Rank 0 alone in a world of 2: hosts the store, then waits for rank 1 in vain.
  loom::spawn(
      1,
      [](const loom::Environment& env0) {
        loom::Environment env = env0;
        env.world_size = 2;
        try {
          (void)loom::rendezvous(env, {.timeout = std::chrono::seconds(1)});
        } catch (const loom::TimeoutError& e) {
          if (e.collective() != "rendezvous" || std::string(e.what()).find("1 of 2 ranks arrived") == std::string::npos)
            throw;
          return;
        }
        throw std::runtime_error("rendezvous returned without rank 1");
      },
      {.timeout = std::chrono::seconds(60)});
  CHECK_THROWS_AS(loom::rendezvous(loom::Environment{.rank = 2, .world_size = 2}), loom::InvalidArgument);
}

namespace {

/// What rank 0 (world of 2, rendezvous timeout 3 s) did while rank 1, a stranger who can reach its
/// store but does not know the job's secret, wrote the keys that say "every rank arrived": "accepted"
/// (rendezvous returned without rank 1 checking in) or "rejected" (it timed out waiting for rank 1).
/// `stderr_path` gets rank 0's standard error. The stranger is a process of its own (spawn's rank 1),
/// not a thread of the test: a thread inside c10d while spawn forks could hold a lock rank 0 needs
/// (spawn.hpp's fork rule), and rank 0 would hang instead of answering.
std::string rendezvous_with_stranger(const std::map<std::string, std::string>& env, const fs::path& stderr_path) {
  TempDir out;
  const fs::path result = out.path / "result";
  const fs::path forged = out.path / "forged";
  const fs::path stranger_error = out.path / "stranger_error";
  const std::string err = stderr_path.string();
  const auto started = std::chrono::steady_clock::now();
  loom::SpawnOptions options{.timeout = std::chrono::seconds(60), .env = {}};
  for (const auto& [k, v] : env) options.env[k] = v;
  loom::spawn(
      2,
      [=](const loom::Environment& env) {
        if (env.rank == 1) {
          // The stranger: connects as a plain store client (no secret, no check-in) and forges the
          // check-in keys of the first ten rendezvous generations (what an outsider would try).
          const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
          while (std::chrono::steady_clock::now() < deadline) {
            bool wrote = false;
            try {
              c10d::TCPStoreOptions opts;
              opts.port = env.master_port;
              opts.isServer = false;
              opts.waitWorkers = false;
              opts.timeout = std::chrono::seconds(5);  // c10d retries refused connects until then
              c10d::TCPStore store(env.master_addr, opts);
              for (int gen = 0; gen < 10; ++gen) {
                store.add(fmt::format("loom/rdzv/{}/arrived", gen), 1);
                store.set(fmt::format("loom/rdzv/{}/all", gen), std::vector<std::uint8_t>{1});
                if (!wrote) write_file(forged, "1");
                wrote = true;  // (a rank 0 that accepts may exit and close the store before the later ones)
              }
              return;
            } catch (const std::exception& e) {
              if (wrote) return;
              write_file(stranger_error, fmt::format("{:.3f} s: {}", loom::detail::seconds_since(started), e.what()));
              std::this_thread::sleep_for(std::chrono::milliseconds(20));
            }
          }
          return;
        }
        const int fd = ::open(err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
        ::dup2(fd, 2);
        try {
          (void)loom::rendezvous(env, {.timeout = std::chrono::seconds(3)});
          write_file(result, "accepted");
        } catch (const loom::TimeoutError& e) {
          write_file(result,
                     std::string(e.what()).find("1 of 2 ranks arrived") != std::string::npos ? "rejected" : e.what());
        }
      },
      options);
  INFO("the stranger's last error: ", out.read("stranger_error"), "; spawn returned after ",
       loom::detail::seconds_since(started), " s");
  CHECK(out.read("forged") == "1");  // the stranger did reach the store and write its keys
  return out.read("result");
}

}  // namespace

TEST_CASE("rendezvous: a client without the job's secret cannot make rank 0 accept its keys") {
  TempDir dir;
  // spawn gives its ranks a secret: the forged check-in is never read; rank 0 keeps waiting for rank 1.
  CHECK(rendezvous_with_stranger({}, dir.path / "with.err") == "rejected");
  CHECK(dir.read("with.err").find("LOOM_RENDEZVOUS_SECRET") == std::string::npos);
  // Without a secret (a launcher that sets none): the same stranger's keys are taken for rank 1's, which
  // is what the secret prevents; rank 0 says so in one warning line.
  CHECK(rendezvous_with_stranger({{"LOOM_RENDEZVOUS_SECRET", ""}}, dir.path / "without.err") == "accepted");
  const std::string warning = dir.read("without.err");
  CHECK(warning.find("loom: warning: LOOM_RENDEZVOUS_SECRET is not set") == 0);
  CHECK(std::count(warning.begin(), warning.end(), '\n') == 1);
}

}  // namespace test_spawn
