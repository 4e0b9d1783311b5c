// The Open MPI launcher path, with Debian's real mpirun (openmpi-bin): this program starts
//   mpirun --allow-run-as-root --oversubscribe -np 2 -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT=<free> <itself>
// and each MPI rank reads OMPI_COMM_WORLD_* through loom::Environment::from_env(), builds a
// GlooCommunicator and checks an all-reduce and an all-gather against closed forms.
// Exit codes: 0 pass, 1 fail, 77 skipped (mpirun not installed), as Meson expects.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <signal.h>
#include <string>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <loom/comm/gloo.hpp>
#include <loom/launch/spawn.hpp>

namespace {

int worker() {
  try {
    const auto env = loom::Environment::from_env();
    if (env.launcher != loom::Launcher::mpirun || env.world_size != 2 || env.local_world_size != 2)
      throw std::runtime_error(fmt::format("expected 2 Open MPI ranks, got launcher {} world {} local world {}",
                                           to_string(env.launcher), env.world_size, env.local_world_size));
    loom::GlooCommunicator comm(env, {.timeout = std::chrono::seconds(30)});
    auto t = at::full({4}, static_cast<double>(env.rank + 1), at::kDouble);
    comm.all_reduce(t, loom::ReduceOp::sum);
    if (!at::equal(t, at::full({4}, 3.0, at::kDouble))) throw std::runtime_error("all_reduce: expected 3 everywhere");
    auto all = comm.all_gather(at::full({2}, static_cast<std::int64_t>(10 * env.rank), at::kLong));
    for (int r = 0; r < 2; ++r)
      if (!at::equal(all[r], at::full({2}, static_cast<std::int64_t>(10 * r), at::kLong)))
        throw std::runtime_error(fmt::format("all_gather: entry {} wrong", r));
    comm.barrier();
    fmt::print("mpirun rank {}/{} (local {}/{}): all_reduce and all_gather ok\n", env.rank, env.world_size,
               env.local_rank, env.local_world_size);
    return 0;
  } catch (const std::exception& e) {
    fmt::print(stderr, "mpirun rank failed: {}\n", e.what());
    return 1;
  }
}

std::string find_in_path(const std::string& name) {
  const char* path = std::getenv("PATH");
  std::string p = path ? path : "/usr/bin:/bin";
  std::size_t start = 0;
  while (start <= p.size()) {
    auto end = p.find(':', start);
    if (end == std::string::npos) end = p.size();
    auto candidate = std::filesystem::path(p.substr(start, end - start)) / name;
    if (::access(candidate.c_str(), X_OK) == 0) return candidate.string();
    start = end + 1;
  }
  return {};
}

int driver() {
  const std::string mpirun = find_in_path("mpirun");
  if (mpirun.empty()) {
    fmt::print("SKIP: mpirun not found on PATH (apt-get install openmpi-bin); the Open MPI path is untested\n");
    return 77;
  }
  auto [fd, port] = loom::detail::reserve_port();  // held until rank 0's store listens
  std::vector<std::string> args = {mpirun,
                                   "--allow-run-as-root",
                                   "--oversubscribe",
                                   "-np",
                                   "2",
                                   "-x",
                                   "MASTER_ADDR=127.0.0.1",
                                   "-x",
                                   fmt::format("MASTER_PORT={}", port),
                                   std::filesystem::canonical("/proc/self/exe").string()};
  fmt::print("running: {}\n", fmt::join(args, " "));
  std::fflush(stdout);
  pid_t pid = ::fork();
  if (pid < 0) return 1;
  if (pid == 0) {
    ::setpgid(0, 0);
    ::close(fd);
    // The ranks must see Open MPI's variables only, not a torchrun job this test might run under.
    for (const char* v : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "SLURM_PROCID"})
      ::unsetenv(v);
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execv(argv[0], argv.data());
    std::perror("exec mpirun");
    ::_exit(127);
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(150);
  int status = 0;
  for (;;) {
    pid_t w = ::waitpid(pid, &status, WNOHANG);
    if (w == pid) break;
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(-pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      ::close(fd);
      fmt::print(stderr, "FAIL: mpirun did not finish within 150 s\n");
      return 1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ::close(fd);
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) {
    fmt::print("PASS: 2 ranks under mpirun all-reduced over Gloo\n");
    return 0;
  }
  fmt::print(stderr, "FAIL: mpirun exited with status {}\n",
             WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status));
  return 1;
}

}  // namespace

int main() {
  if (std::getenv("OMPI_COMM_WORLD_RANK") != nullptr) return worker();
  return driver();
}
