// Two hosts on one machine: two network namespaces joined by a veth pair (198.18.0.1 and 198.18.0.2,
// the range reserved for benchmarking), one rank per host, each host with its own hostname that
// resolves to loopback (a private UTS and mount namespace whose /etc/hosts says "127.0.1.1 <name>",
// Debian's default). The ranks get torchrun's variables with MASTER_ADDR = host A's address, as a user
// running one rank per machine would.
//
// Cases:
//   1. training across the hosts (examples/readme_loop) ends with the same loss as the same program
//      spawned as 2 ranks on one host;
//   2. the same with GLOO_SOCKET_IFNAME set to each host's interface;
//   3. the link goes down mid-training: each rank throws loom::TimeoutError naming the collective,
//      its rank and its peer, within the timeout + 1 s;
//   4. the peer is killed with SIGKILL: the survivor throws within 4 s, naming the peer (its Gloo
//      timeout is 20 s);
//   4b. the same, three times, while the peer sends over a link limited to 20 Mbit/s (tc), so the
//      survivor is in the middle of reading a message when the connection ends;
//   5. MASTER_ADDR is unreachable: a loom error naming MASTER_ADDR:MASTER_PORT within the rendezvous
//      timeout + 1 s;
//   6. one rank fails to connect (its peer advertises an address it cannot reach): the other throws at
//      once, naming it;
//   7. one host cut off, the other goes on alone: both ranks train with an elastic ProcessGroup (Gloo,
//      min_ranks 1, 5 s timeout) and a deterministic loom::Trainer (tests/train/trainer_fixture.hpp's
//      float64 MLP, 6 epochs of 5 steps, each batch 25 ms longer); after rank 0's third step the link
//      goes down (as in case 3). Rank 0 (host A, which hosts the store) recovers once (lost: rank 1),
//      finishes, and its final parameters are bit-identical (17 digits) to the same run as one
//      uninterrupted rank on this host; every sample is trained once per epoch (the ranks' batch logs);
//      rank 1 (cut off from the store) throws loom::CommError or TimeoutError within 3 x the timeout
//      + 3 s, and its process ends.
//
// Usage: test_two_hosts [--only CASE] [READMELOOP]   (READMELOOP: path of build/examples/readme_loop, for
//        case 1/2; CASE: one case's number, e.g. 4b or 7)
// Exit codes: 0 pass, 1 fail, 77 skipped (not root, no `ip` / `unshare`, or namespaces cannot be made).
// Cleanup: the namespaces (and with them the veth pair) and the temporary folder are removed when the
// test ends, also when a check fails or throws; a helper process removes them if this process is
// killed. Rank processes die with this process (PR_SET_PDEATHSIG survives the exec chain
// ip netns exec -> unshare -> sh -> program, which never forks).
// Worker mode (the ranks of cases 3-6 and 4b; case 7's ranks and its reference): test_two_hosts --worker
// join|loop|elastic OUTFILE.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fcntl.h>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <random>
#include <signal.h>
#include <sstream>
#include <string>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <thread>
#include <typeinfo>
#include <unistd.h>
#include <vector>

#include <fmt/ranges.h>
#include <netdb.h>

#include <loom/comm/gloo.hpp>
#include <loom/detail/exception_text.hpp>
#include <loom/dist/process_group.hpp>
#include <loom/launch/environment.hpp>

#include "train/trainer_fixture.hpp"

namespace fs = std::filesystem;

namespace {

using Clock = std::chrono::steady_clock;  // CLOCK_MONOTONIC: one clock for every process of the machine

std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

// ------------------------------------------------------------------------------------------------
// Worker mode: one rank of cases 3-6. Writes "key value" lines to OUTFILE.
// ------------------------------------------------------------------------------------------------

class Report {
 public:
  explicit Report(std::string path) : path_(std::move(path)) {}
  void put(const std::string& key, const std::string& value) {
    std::ofstream out(path_, std::ios::app);
    std::string v = value;
    for (char& c : v)
      if (c == '\n') c = ' ';
    out << key << ' ' << v << '\n';
  }

 private:
  std::string path_;
};

/// True when this host's name resolves (only) to loopback addresses.
bool hostname_is_loopback(std::string& name) {
  char buf[256] = {};
  ::gethostname(buf, sizeof(buf) - 1);
  name = buf;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  addrinfo* res = nullptr;
  if (::getaddrinfo(buf, nullptr, &hints, &res) != 0 || res == nullptr) return false;
  bool all = true;
  for (auto* p = res; p != nullptr; p = p->ai_next) {
    if (p->ai_family == AF_INET)
      all = all && (ntohl(reinterpret_cast<sockaddr_in*>(p->ai_addr)->sin_addr.s_addr) >> 24) == 127;
    else if (p->ai_family == AF_INET6)
      all = all && IN6_IS_ADDR_LOOPBACK(&reinterpret_cast<sockaddr_in6*>(p->ai_addr)->sin6_addr);
  }
  ::freeaddrinfo(res);
  return all;
}

int worker(const std::string& mode, const std::string& out_path) {
  Report report(out_path);
  std::string host;
  report.put("hostname_loopback", hostname_is_loopback(host) ? "1" : "0");
  report.put("hostname", host);
  const auto timeout = std::chrono::milliseconds(std::atoll(std::getenv("LOOM_TEST_TIMEOUT_MS")));
  report.put("t_start", std::to_string(now_ns()));
  try {
    const auto env = loom::Environment::from_env();
    loom::GlooCommunicator comm(env, {.timeout = timeout});
    report.put("t_joined", std::to_string(now_ns()));
    if (mode == "join") {
      comm.barrier();
      report.put("ok", "1");
      return 0;
    }
    // loop: all-reduce 4 MiB tensors (several writes per send, so a dead peer's socket meets a second
    // write: SIGPIPE territory in exec'd ranks) until something fails; "ready" once one succeeded.
    const std::int64_t n = std::int64_t{1} << 19;
    for (long i = 0;; ++i) {
      auto t = at::full({n}, static_cast<double>(env.rank + 1), at::kDouble);
      comm.all_reduce(t, loom::ReduceOp::sum);
      if (!at::equal(t, at::full({n}, 3.0, at::kDouble))) throw std::runtime_error("all_reduce: wrong sum");
      if (i == 0) std::ofstream(out_path + ".ready") << "1\n";
    }
  } catch (const loom::TimeoutError& e) {
    report.put("t_error", std::to_string(now_ns()));
    report.put("type", "TimeoutError");
    report.put("collective", e.collective());
    report.put("what", e.what());
  } catch (const loom::CommError& e) {
    report.put("t_error", std::to_string(now_ns()));
    report.put("type", "CommError");
    report.put("what", e.what());
  } catch (const std::exception& e) {
    report.put("t_error", std::to_string(now_ns()));
    report.put("type", "other");
    report.put("what", e.what());
  }
  return 3;
}

// Worker mode "elastic" (case 7): a deterministic loom::Trainer on an elastic ProcessGroup (Gloo,
// min_ranks 1, timeout LOOM_TEST_TIMEOUT_MS) over the trainer tests' data and float64 MLP
// (tests/train/trainer_fixture.hpp), kElasticEpochs epochs, each batch LOOM_TEST_SLEEP_MS longer.
// With WORLD_SIZE=1 the same run on loom's one-process communicator: the reference. Writes
// "steps N" to OUTFILE after every optimizer step; OUTFILE.batches gets "epoch step generation
// index..." per batch passed to backward, OUTFILE.params the final parameters (17 digits).

// 3 batches of at most 2 samples per step: 5 steps an epoch over the 29 samples.
const loom::GlobalBatchOptions kElasticPlan{.seed = 3, .max_samples = 2, .batches_per_step = 3};
constexpr int kElasticEpochs = 6;

int elastic_worker(const std::string& out_path) {
  Report report(out_path);
  at::set_num_threads(1);  // the same kernels' results in every run: deterministic mode needs it
  std::string host;
  report.put("hostname_loopback", hostname_is_loopback(host) ? "1" : "0");
  report.put("hostname", host);
  const auto timeout = std::chrono::milliseconds(std::atoll(std::getenv("LOOM_TEST_TIMEOUT_MS")));
  const auto pause = std::chrono::milliseconds(std::atoll(std::getenv("LOOM_TEST_SLEEP_MS")));
  report.put("t_start", std::to_string(now_ns()));
  std::FILE* batches = std::fopen((out_path + ".batches").c_str(), "w");
  try {
    const auto env = loom::Environment::from_env();
    loom::ProcessGroupOptions options{.backend = env.world_size == 1 ? loom::Backend::local : loom::Backend::gloo,
                                      .timeout = timeout};
    if (env.world_size > 1) options.elastic = loom::ElasticOptions{.min_ranks = 1};
    loom::ProcessGroup pg(env, options);
    report.put("t_joined", std::to_string(now_ns()));
    loom::test::Mlp model(at::kDouble);
    torch::optim::SGD sgd(model.params, torch::optim::SGDOptions(0.05).momentum(0.9));
    loom::BatchLoader loader(pg, loom::test::trainer_shapes(), loom::test::trainer_fetch(), kElasticPlan);
    loom::Trainer trainer(pg, model.list(), sgd, {.reducer = {.deterministic = true}});
    trainer.on_step([&](const loom::SyncResult&) { report.put("steps", std::to_string(trainer.steps())); });
    trainer.on_recovery([&](const loom::Recovery& r) {
      report.put("t_recovered", std::to_string(now_ns()));
      report.put("recovered_at_steps", std::to_string(trainer.steps()));
      report.put("recovery",
                 fmt::format("lost [{}] members [{}] epoch {} step {} {:.3f} s; cause: {}", fmt::join(r.lost, ","),
                             fmt::join(r.members, ","), r.epoch, r.step, r.seconds, r.cause));
    });
    for (int64_t epoch = 0; epoch < kElasticEpochs; ++epoch) {
      for (loom::Batch& b : trainer.epoch(loader, epoch)) {
        std::fprintf(batches, "%lld %lld %d", static_cast<long long>(epoch), static_cast<long long>(b.step),
                     pg.generation());
        for (int64_t i : b.indices) std::fprintf(batches, " %lld", static_cast<long long>(i));
        std::fprintf(batches, "\n");
        std::fflush(batches);
        std::this_thread::sleep_for(pause);
        trainer.backward(loom::test::mean_loss(model, b), b);
      }
    }
    loom::test::write_values(out_path + ".params", model.params);
    report.put("t_end", std::to_string(now_ns()));
    report.put("steps", std::to_string(trainer.steps()));
    report.put("recoveries", std::to_string(trainer.recoveries().size()));
    for (const loom::Recovery& r : trainer.recoveries()) {
      report.put("lost", fmt::format("{}", fmt::join(r.lost, ",")));
      report.put("members", fmt::format("{}", fmt::join(r.members, ",")));
    }
    report.put("ok", "1");
    std::fclose(batches);
    return 0;
  } catch (const loom::TimeoutError& e) {
    report.put("t_error", std::to_string(now_ns()));
    report.put("type", "TimeoutError");
    report.put("what", e.what());
  } catch (const loom::CommError& e) {
    report.put("t_error", std::to_string(now_ns()));
    report.put("type", "CommError");
    report.put("what", e.what());
  } catch (const std::exception& e) {
    report.put("t_error", std::to_string(now_ns()));
    report.put("type", "other");
    report.put("what", fmt::format("{} ({})", loom::detail::exception_text(e), typeid(e).name()));
  }
  std::fclose(batches);
  return 3;
}

std::map<std::string, std::string> read_report(const std::string& path) {
  std::map<std::string, std::string> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    auto sp = line.find(' ');
    if (sp == std::string::npos) continue;
    out[line.substr(0, sp)] = line.substr(sp + 1);
  }
  return out;
}

// ------------------------------------------------------------------------------------------------
// Controller: hosts, ranks, checks.
// ------------------------------------------------------------------------------------------------

std::string find_in_path(const std::string& name) {
  const char* path = std::getenv("PATH");
  std::string p = path ? path : "/usr/sbin:/usr/bin:/sbin:/bin";
  p += ":/usr/sbin:/sbin";
  std::size_t start = 0;
  while (start <= p.size()) {
    auto end = p.find(':', start);
    if (end == std::string::npos) end = p.size();
    auto candidate = fs::path(p.substr(start, end - start)) / name;
    if (!p.substr(start, end - start).empty() && ::access(candidate.c_str(), X_OK) == 0) return candidate.string();
    start = end + 1;
  }
  return {};
}

/// Runs a command, waits for it; returns its exit code (-1 when it could not run). Output to `log`.
int run_command(const std::vector<std::string>& args, const std::string& log = "/dev/null") {
  pid_t pid = ::fork();
  if (pid < 0) return -1;
  if (pid == 0) {
    int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0600);
    if (fd >= 0) {
      ::dup2(fd, 1);
      ::dup2(fd, 2);
    }
    std::vector<char*> argv;
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    ::execvp(argv[0], argv.data());
    ::_exit(127);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string tail(const std::string& text, std::size_t n = 3000) {
  return text.size() <= n ? text : "..." + text.substr(text.size() - n);
}

/// Starts `args` with `env` added (the launchers' variables of this process removed); stdout and
/// stderr to `log`. The process dies with this one (PR_SET_PDEATHSIG). Returns its pid.
pid_t start_process(const std::vector<std::string>& args, const std::map<std::string, std::string>& env,
                    const std::string& log) {
  const pid_t parent = ::getpid();
  pid_t pid = ::fork();
  if (pid != 0) return pid;
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != parent) ::_exit(111);
  int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  if (fd >= 0) {
    ::dup2(fd, 1);
    ::dup2(fd, 2);
  }
  for (const char* v :
       {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "MASTER_ADDR",
        "MASTER_PORT", "GLOO_SOCKET_IFNAME", "LOOM_RENDEZVOUS_SECRET", "TORCHELASTIC_USE_AGENT_STORE",
        "TORCHELASTIC_RESTART_COUNT", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID", "LOOM_LAUNCHER"})
    ::unsetenv(v);
  for (const auto& [k, v] : env) ::setenv(k.c_str(), v.c_str(), 1);
  std::vector<char*> cargv;
  for (const auto& a : args) cargv.push_back(const_cast<char*>(a.c_str()));
  cargv.push_back(nullptr);
  ::execvp(cargv[0], cargv.data());
  ::_exit(127);
}

/// The two hosts. Constructor builds them; destructor (and the reaper, if this process dies) removes them.
class Hosts {
 public:
  static constexpr const char* kAddrA = "198.18.0.1";
  static constexpr const char* kAddrB = "198.18.0.2";
  static constexpr const char* kUnreachable = "198.18.0.3";  // in the subnet, assigned to nobody

  explicit Hosts(const fs::path& dir) : dir_(dir) {
    const std::string id = std::to_string(::getpid() % 1000000);
    ns_[0] = "loomA" + id;
    ns_[1] = "loomB" + id;
    veth_[0] = "lvA" + id;
    veth_[1] = "lvB" + id;
    start_reaper();
    created_ = run_command({"ip", "netns", "add", ns_[0]}) == 0;
    if (!created_) return;
    ok_ = run_command({"ip", "netns", "add", ns_[1]}) == 0 &&
          run_command({"ip", "link", "add", veth_[0], "netns", ns_[0], "type", "veth", "peer", "name", veth_[1],
                       "netns", ns_[1]}) == 0;
    const char* addr[2] = {kAddrA, kAddrB};
    for (int h = 0; h < 2 && ok_; ++h) {
      ok_ = run_command({"ip", "-n", ns_[h], "link", "set", "lo", "up"}) == 0 &&
            run_command({"ip", "-n", ns_[h], "addr", "add", std::string(addr[h]) + "/24", "dev", veth_[h]}) == 0 &&
            run_command({"ip", "-n", ns_[h], "link", "set", veth_[h], "up"}) == 0;
      name_[h] = h == 0 ? "loom-host-a" : "loom-host-b";
      hosts_file_[h] = (dir_ / fmt::format("hosts.{}", h)).string();
      std::ofstream(hosts_file_[h]) << "127.0.0.1 localhost\n127.0.1.1 " << name_[h] << "\n::1 localhost\n";
    }
  }
  ~Hosts() { remove(); }
  Hosts(const Hosts&) = delete;
  Hosts& operator=(const Hosts&) = delete;

  [[nodiscard]] bool created() const { return created_; }
  [[nodiscard]] bool ok() const { return ok_; }
  [[nodiscard]] const std::string& ns(int h) const { return ns_[h]; }
  [[nodiscard]] const std::string& veth(int h) const { return veth_[h]; }

  void link(bool up) { run_command({"ip", "-n", ns_[1], "link", "set", veth_[1], up ? "up" : "down"}); }

  /// Limits both ends of the link to `rate` (tc's token bucket filter, e.g. "20mbit"); empty: removes
  /// the limit. Returns false when tc is missing or the kernel has no tbf queueing discipline.
  bool rate(const std::string& rate) {
    bool ok = true;
    for (int h = 0; h < 2; ++h) {
      if (rate.empty()) {
        run_command({"ip", "netns", "exec", ns_[h], "tc", "qdisc", "del", "dev", veth_[h], "root"});
        continue;
      }
      ok = ok && run_command({"ip", "netns", "exec", ns_[h], "tc", "qdisc", "add", "dev", veth_[h], "root", "tbf",
                              "rate", rate, "burst", "32kbit", "latency", "400ms"}) == 0;
    }
    return ok;
  }

  /// Starts `argv` on host h (0 = A, 1 = B) with `env` added; stdout and stderr to `log`. Returns the pid
  /// (the same process all the way down the exec chain).
  pid_t start(int h, const std::vector<std::string>& argv, const std::map<std::string, std::string>& env,
              const std::string& log) {
    std::vector<std::string> args = {
        "ip",
        "netns",
        "exec",
        ns_[h],
        "unshare",
        "--uts",
        "--mount",
        "sh",
        "-c",
        fmt::format("hostname {} && mount --bind {} /etc/hosts && exec \"$0\" \"$@\"", name_[h], hosts_file_[h])};
    args.insert(args.end(), argv.begin(), argv.end());
    return start_process(args, env, log);
  }

  void remove() {
    if (removed_) return;
    removed_ = true;
    if (created_) {
      run_command({"ip", "netns", "del", ns_[0]});
      run_command({"ip", "netns", "del", ns_[1]});
    }
    if (reaper_pipe_ >= 0) ::close(reaper_pipe_);  // the reaper finds nothing left to remove
    if (reaper_ > 0) ::waitpid(reaper_, nullptr, 0);
  }

 private:
  /// A child that waits for this process to end (its pipe closes) and then removes the namespaces, so
  /// they go away even when this process is killed.
  void start_reaper() {
    int fds[2];
    if (::pipe(fds) != 0) return;
    reaper_ = ::fork();
    if (reaper_ == 0) {
      ::close(fds[1]);
      for (int fd = 3; fd < 1024; ++fd)
        if (fd != fds[0]) ::close(fd);
      char c;
      while (::read(fds[0], &c, 1) > 0) {
      }
      const std::string cmd = fmt::format("ip netns del {0} 2>/dev/null; ip netns del {1} 2>/dev/null; rm -rf {2}",
                                          ns_[0], ns_[1], dir_.string());
      ::execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
      ::_exit(0);
    }
    ::close(fds[0]);
    ::fcntl(fds[1], F_SETFD, FD_CLOEXEC);
    reaper_pipe_ = fds[1];
  }

  fs::path dir_;
  std::string ns_[2], veth_[2], name_[2], hosts_file_[2];
  bool created_ = false, ok_ = false, removed_ = false;
  pid_t reaper_ = -1;
  int reaper_pipe_ = -1;
};

/// Waits for `pids` until `deadline`; kills what is left. Returns the exit codes (-SIG for a signal,
/// -1000 when killed at the deadline); `ended`, when given, gets when each one ended (now_ns()).
std::vector<int> wait_all(const std::vector<pid_t>& pids, Clock::time_point deadline,
                          std::vector<std::int64_t>* ended = nullptr) {
  if (ended != nullptr) ended->assign(pids.size(), 0);
  std::vector<int> codes(pids.size(), 0);
  std::vector<bool> done(pids.size(), false);
  std::size_t left = pids.size();
  while (left > 0) {
    for (std::size_t i = 0; i < pids.size(); ++i) {
      if (done[i]) continue;
      int status = 0;
      if (::waitpid(pids[i], &status, WNOHANG) == pids[i]) {
        done[i] = true;
        --left;
        codes[i] = WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
        if (ended != nullptr) (*ended)[i] = now_ns();
      }
    }
    if (left == 0) break;
    if (Clock::now() > deadline) {
      for (std::size_t i = 0; i < pids.size(); ++i)
        if (!done[i]) {
          ::kill(pids[i], SIGKILL);
          ::waitpid(pids[i], nullptr, 0);
          codes[i] = -1000;
          if (ended != nullptr) (*ended)[i] = now_ns();
        }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return codes;
}

/// Waits until `path` exists or the deadline passes.
bool wait_for_file(const std::string& path, Clock::time_point deadline) {
  while (Clock::now() < deadline) {
    if (fs::exists(path)) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return fs::exists(path);
}

std::string random_hex(int bytes) {
  std::random_device rd;
  std::string out;
  for (int i = 0; i < bytes; ++i) out += fmt::format("{:02x}", rd() & 0xff);
  return out;
}

/// Every epoch's samples counted from the workers' batch logs ("epoch step generation index..."
/// lines, elastic_worker): for each step, the batches of the last generation that ran it (an
/// attempt a cut interrupted is replaced by the survivors' re-run). counts[epoch][sample index].
std::map<std::int64_t, std::map<std::int64_t, int>> trained_counts(const std::vector<std::string>& logs) {
  struct Line {
    int generation = 0;
    std::vector<std::int64_t> indices;
  };
  std::map<std::pair<std::int64_t, std::int64_t>, std::vector<Line>> by_step;
  for (const auto& path : logs) {
    std::ifstream in(path);
    std::string text;
    while (std::getline(in, text)) {
      std::istringstream fields(text);
      std::int64_t epoch = 0, step = 0;
      Line line;
      if (!(fields >> epoch >> step >> line.generation)) continue;
      for (std::int64_t i = 0; fields >> i;) line.indices.push_back(i);
      by_step[{epoch, step}].push_back(std::move(line));
    }
  }
  std::map<std::int64_t, std::map<std::int64_t, int>> counts;
  for (const auto& [key, lines] : by_step) {
    int last = 0;
    for (const Line& l : lines) last = std::max(last, l.generation);
    for (const Line& l : lines)
      if (l.generation == last)
        for (std::int64_t i : l.indices) ++counts[key.first][i];
  }
  return counts;
}

struct Suite {
  fs::path dir;
  Hosts& hosts;
  std::string self;
  std::string readme_loop;
  int failed = 0;
  int port = 29400;

  bool check(bool ok, const std::string& what) {
    if (!ok) {
      fmt::print("    check failed: {}\n", what);
      ++failed_checks;
    }
    return ok;
  }
  int failed_checks = 0;

  std::map<std::string, std::string> rank_env(int rank, const std::string& master, int timeout_ms) {
    return {{"RANK", std::to_string(rank)},
            {"WORLD_SIZE", "2"},
            {"LOCAL_RANK", "0"},
            {"LOCAL_WORLD_SIZE", "1"},
            {"GROUP_RANK", std::to_string(rank)},
            {"GROUP_WORLD_SIZE", "2"},
            {"MASTER_ADDR", master},
            {"MASTER_PORT", std::to_string(port)},
            {"OMP_NUM_THREADS", "1"},
            {"LOOM_TEST_TIMEOUT_MS", std::to_string(timeout_ms)},
            {"LOOM_RENDEZVOUS_SECRET", secret}};
  }
  std::string secret = random_hex(16);

  void begin(const std::string& name) {
    ++port;
    failed_checks = 0;
    fmt::print("case {}\n", name);
    std::fflush(stdout);
  }
  void end(const std::string& name, const std::vector<std::string>& logs) {
    if (failed_checks == 0) {
      fmt::print("  PASS: {}\n", name);
    } else {
      ++failed;
      fmt::print("  FAIL: {}\n", name);
      for (const auto& l : logs) fmt::print("  --- {} ---\n{}\n", l, tail(read_text(l)));
    }
    std::fflush(stdout);
  }

  /// Cases 1 and 2: readme_loop across the hosts equals readme_loop spawned on one host.
  void training(const std::string& name, bool ifname) {
    begin(name);
    const std::string base_log = (dir / "baseline.log").string();
    std::vector<std::string> logs;
    if (!check(!readme_loop.empty() && fs::exists(readme_loop), "the readme_loop program exists: " + readme_loop)) {
      end(name, logs);
      return;
    }
    if (!fs::exists(base_log)) {
      // The same program as 2 ranks spawned on one host (loopback).
      std::vector<std::string> args = {readme_loop, "--nproc", "2"};
      pid_t pid = ::fork();
      if (pid == 0) {
        int fd = ::open(base_log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
        ::dup2(fd, 1);
        ::dup2(fd, 2);
        for (const char* v : {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMPI_COMM_WORLD_RANK",
                              "SLURM_PROCID", "LOOM_LAUNCHER"})
          ::unsetenv(v);
        ::execl(readme_loop.c_str(), readme_loop.c_str(), "--nproc", "2", static_cast<char*>(nullptr));
        ::_exit(127);
      }
      auto codes = wait_all({pid}, Clock::now() + std::chrono::seconds(120));
      check(codes[0] == 0, fmt::format("the spawned baseline run exited with {}", codes[0]));
    }
    logs.push_back(base_log);
    std::vector<pid_t> pids;
    for (int r = 0; r < 2; ++r) {
      auto env = rank_env(r, Hosts::kAddrA, 60000);
      if (ifname) env["GLOO_SOCKET_IFNAME"] = hosts.veth(r);
      const std::string log = (dir / fmt::format("{}.rank{}.log", name, r)).string();
      logs.push_back(log);
      pids.push_back(hosts.start(r, {readme_loop}, env, log));
    }
    auto codes = wait_all(pids, Clock::now() + std::chrono::seconds(90));
    for (int r = 0; r < 2; ++r) check(codes[r] == 0, fmt::format("rank {} exited with {}", r, codes[r]));
    auto result_line = [](const std::string& text) {
      auto at = text.rfind("result: ");
      return at == std::string::npos ? std::string() : text.substr(at, text.find('\n', at) - at);
    };
    const std::string want = result_line(read_text(base_log));
    const std::string got = result_line(read_text(logs[1]));
    check(!want.empty(), "the baseline printed a result line");
    check(got == want, fmt::format("two hosts: '{}', one host: '{}'", got, want));
    end(name, logs);
  }

  /// Starts the "loop" worker on both hosts, waits until both all-reduced once, then runs `fault`
  /// and returns the reports; `t_fault` is when the fault happened.
  std::vector<std::map<std::string, std::string>> loop_with_fault(const std::string& name, int timeout_ms,
                                                                  const std::function<void(std::vector<pid_t>&)>& fault,
                                                                  std::int64_t& t_fault, std::vector<std::string>& logs,
                                                                  std::vector<int>& codes) {
    std::vector<pid_t> pids;
    std::vector<std::string> outs;
    for (int r = 0; r < 2; ++r) {
      const std::string out = (dir / fmt::format("{}.rank{}.out", name, r)).string();
      const std::string log = (dir / fmt::format("{}.rank{}.log", name, r)).string();
      outs.push_back(out);
      logs.push_back(log);
      logs.push_back(out);
      pids.push_back(hosts.start(r, {self, "--worker", "loop", out}, rank_env(r, Hosts::kAddrA, timeout_ms), log));
    }
    const auto ready_deadline = Clock::now() + std::chrono::seconds(60);
    bool ready = wait_for_file(outs[0] + ".ready", ready_deadline) && wait_for_file(outs[1] + ".ready", ready_deadline);
    check(ready, "both ranks all-reduced across the hosts before the fault");
    t_fault = now_ns();
    if (ready) fault(pids);
    codes = wait_all(pids, Clock::now() + std::chrono::milliseconds(timeout_ms) + std::chrono::seconds(30));
    return {read_report(outs[0]), read_report(outs[1])};
  }

  /// Case 3: the link goes down.
  void link_down() {
    const std::string name = "3-link-down";
    begin(name);
    constexpr int kTimeoutMs = 3000;
    std::int64_t t_down = 0;
    std::vector<std::string> logs;
    std::vector<int> codes;
    auto reports = loop_with_fault(
        name, kTimeoutMs, [&](std::vector<pid_t>&) { hosts.link(false); }, t_down, logs, codes);
    for (int r = 0; r < 2; ++r) {
      auto& rep = reports[r];
      check(rep["hostname_loopback"] == "1",
            fmt::format("rank {}'s hostname {} resolves to loopback", r, rep["hostname"]));
      check(rep["type"] == "TimeoutError",
            fmt::format("rank {} threw loom::TimeoutError (got {}: {})", r, rep["type"], rep["what"]));
      check(rep["collective"] == "all_reduce", fmt::format("rank {}'s error names all_reduce: {}", r, rep["what"]));
      check(rep["what"].find(fmt::format("on rank {}", r)) != std::string::npos,
            fmt::format("rank {}'s error names its rank", r));
      check(rep["what"].find(fmt::format("peer rank {}", 1 - r)) != std::string::npos,
            fmt::format("rank {}'s error names peer rank {}: {}", r, 1 - r, rep["what"]));
      const double after = rep.count("t_error") ? (std::stoll(rep["t_error"]) - t_down) / 1e9 : 1e9;
      // + 0.75 s: the flight recorder's exchange of records (2 x an eighth of the timeout, at most;
      // loom/comm/detail/trace_exchange.hpp).
      check(after <= kTimeoutMs / 1000.0 + 1.75,
            fmt::format("rank {} threw {:.3f} s after the link went down (bound: timeout {} s + 1 s + 0.75 s)", r,
                        after, kTimeoutMs / 1000.0));
      fmt::print("    rank {}: {:.3f} s after the link went down: {}\n", r, after, rep["what"].substr(0, 300));
    }
    hosts.link(true);
    end(name, logs);
  }

  /// Case 7: the link goes down mid-training under an elastic group and a deterministic Trainer:
  /// host A (rank 0, which hosts the store) goes on alone and ends with the uninterrupted run's
  /// weights; host B (rank 1, cut off from the store) ends with a loom error, in bounded time.
  void cut_off_elastic() {
    const std::string name = "7-cut-off-elastic";
    begin(name);
    constexpr int kTimeoutMs = 5000;  // the ranks' Gloo and store timeout: the cut is seen through it
    constexpr int kSleepMs = 25;      // per batch: 30 steps of 1-2 batches per rank, about 1.5 s in all
    constexpr std::int64_t kCutAfterSteps = 3;
    std::vector<std::string> logs;

    // The reference: the same program as one rank on this host (loom's one-process communicator),
    // uninterrupted. Deterministic mode gives the same bits on any world size.
    const std::string ref_out = (dir / (name + ".reference.out")).string();
    const std::string ref_log = (dir / (name + ".reference.log")).string();
    logs.push_back(ref_log);
    logs.push_back(ref_out);
    auto ref_env = rank_env(0, "127.0.0.1", kTimeoutMs);
    ref_env["WORLD_SIZE"] = ref_env["GROUP_WORLD_SIZE"] = "1";
    ref_env["LOOM_TEST_SLEEP_MS"] = "0";
    ref_env["LOOM_TRACE_DIR"] = (dir / "trace").string();  // the flight recorder's records, if any
    const pid_t ref_pid = start_process({self, "--worker", "elastic", ref_out}, ref_env, ref_log);
    const int ref_code = wait_all({ref_pid}, Clock::now() + std::chrono::seconds(120))[0];
    auto ref = read_report(ref_out);
    const std::vector<double> reference = loom::test::read_values(ref_out + ".params");
    check(ref_code == 0 && ref["ok"] == "1",
          fmt::format("the reference run (1 rank) ended well (exit {}; {}: {})", ref_code, ref["type"], ref["what"]));
    // 32 values: the MLP's 3x5 + 5 + 5x2 + 2 parameters.
    check(reference.size() == 32, fmt::format("the reference wrote 32 parameter values, not {}", reference.size()));
    check(ref["recoveries"] == "0", "the reference had no recovery: " + ref["recoveries"]);
    const auto ref_counts = trained_counts({ref_out + ".batches"});
    check(static_cast<int>(ref_counts.size()) == kElasticEpochs,
          fmt::format("the reference ran {} epochs, not {}", ref_counts.size(), kElasticEpochs));

    // The two ranks; the link goes down once rank 0 reports kCutAfterSteps optimizer steps.
    std::vector<pid_t> pids;
    std::vector<std::string> outs;
    for (int r = 0; r < 2; ++r) {
      outs.push_back((dir / fmt::format("{}.rank{}.out", name, r)).string());
      const std::string log = (dir / fmt::format("{}.rank{}.log", name, r)).string();
      logs.push_back(log);
      logs.push_back(outs[r]);
      auto env = rank_env(r, Hosts::kAddrA, kTimeoutMs);
      env["LOOM_TEST_SLEEP_MS"] = std::to_string(kSleepMs);
      env["LOOM_TRACE_DIR"] = (dir / "trace").string();
      pids.push_back(hosts.start(r, {self, "--worker", "elastic", outs[r]}, env, log));
    }
    std::int64_t steps_at_cut = -1;
    const auto ready_deadline = Clock::now() + std::chrono::seconds(60);
    while (Clock::now() < ready_deadline) {
      auto rep = read_report(outs[0]);
      if (rep.count("steps") && std::atoll(rep["steps"].c_str()) >= kCutAfterSteps) {
        steps_at_cut = std::atoll(rep["steps"].c_str());
        break;
      }
      if (rep.count("t_error") || ::waitpid(pids[0], nullptr, WNOHANG) != 0) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    const std::int64_t t_cut = now_ns();
    const bool cut = check(steps_at_cut >= kCutAfterSteps,
                           fmt::format("rank 0 reported {} optimizer steps before the cut", kCutAfterSteps));
    if (cut) hosts.link(false);
    std::vector<std::int64_t> ended;
    // Both end well within this (rank 0 about timeout + 2 s after the cut; rank 1's bound below).
    const auto codes = wait_all(pids, Clock::now() + std::chrono::seconds(40), &ended);
    hosts.link(true);
    auto r0 = read_report(outs[0]);
    auto r1 = read_report(outs[1]);
    if (!cut) {
      end(name, logs);
      return;
    }

    // Host A goes on alone: one recovery that lost rank 1, the run completed, the reference's weights.
    check(codes[0] == 0 && r0["ok"] == "1",
          fmt::format("rank 0 completed the run (exit {}; {}: {})", codes[0], r0["type"], r0["what"]));
    check(r0["recoveries"] == "1", fmt::format("rank 0 reports 1 recovery, not '{}'", r0["recoveries"]));
    check(r0["lost"] == "1" && r0["members"] == "0",
          fmt::format("rank 0's recovery lost rank 1 and kept rank 0 (lost [{}], members [{}])", r0["lost"],
                      r0["members"]));
    const std::int64_t recovered_at =
        r0.count("recovered_at_steps") ? std::atoll(r0["recovered_at_steps"].c_str()) : -1;
    check(
        recovered_at >= steps_at_cut && r0["steps"] == ref["steps"] && recovered_at < std::atoll(ref["steps"].c_str()),
        fmt::format("the cut came mid-run: recovered after {} of {} steps (cut after {}); rank 0 ended with {}",
                    recovered_at, ref["steps"], steps_at_cut, r0["steps"]));
    const double recovered_after =
        r0.count("t_recovered") ? (std::atoll(r0["t_recovered"].c_str()) - t_cut) / 1e9 : 1e9;
    // The all-reduce's timeout, the flight recorder's exchange (at most 2 x timeout / 8), the agreement
    // (rank 1's heartbeat stopped at the cut: dead at once) and a step's worth of slack.
    check(recovered_after <= kTimeoutMs / 1000.0 + 3.0,
          fmt::format("rank 0 recovered {:.3f} s after the cut (bound: timeout {} s + 3 s)", recovered_after,
                      kTimeoutMs / 1000.0));
    const std::vector<double> params = loom::test::read_values(outs[0] + ".params");
    std::size_t differ = 0;
    for (std::size_t k = 0; k < std::min(params.size(), reference.size()); ++k) differ += params[k] != reference[k];
    check(params.size() == reference.size() && differ == 0 && !reference.empty(),
          fmt::format("rank 0's final parameters are bit-identical to the uninterrupted 1-rank run's ({} values, "
                      "reference {}, {} differ)",
                      params.size(), reference.size(), differ));
    // Every sample trained once per epoch: rank 1's batches until the cut, rank 0's throughout (the
    // step the cut interrupted counted from its re-run by rank 0 alone, generation 1).
    const auto counts = trained_counts({outs[0] + ".batches", outs[1] + ".batches"});
    check(static_cast<int>(counts.size()) == kElasticEpochs,
          fmt::format("the batch logs cover {} epochs, not {}", counts.size(), kElasticEpochs));
    for (const auto& [epoch, per_sample] : counts) {
      int once = 0;
      for (const auto& [index, n] : per_sample) once += n == 1 && index >= 0 && index < loom::test::kTrainerSamples;
      check(once == loom::test::kTrainerSamples && per_sample.size() == std::size_t{loom::test::kTrainerSamples},
            fmt::format("epoch {}: {} of {} samples trained exactly once ({} distinct)", epoch, once,
                        loom::test::kTrainerSamples, per_sample.size()));
    }

    // Host B, cut off from the store: a loom error, in bounded time, and the process ends.
    check(r1["type"] == "TimeoutError" || r1["type"] == "CommError",
          fmt::format("rank 1 threw a loom error (got '{}': {})", r1["type"], r1["what"]));
    const double error_after = r1.count("t_error") ? (std::atoll(r1["t_error"].c_str()) - t_cut) / 1e9 : 1e9;
    const double ended_after = (ended[1] - t_cut) / 1e9;
    check(codes[1] == 3, fmt::format("rank 1 ended by itself through its error path (exit {})", codes[1]));
    // Its all-reduce's timeout, the flight recorder's exchange (at most 2 x timeout / 8), the
    // agreement's store requests bounded by the timeout (the store is out of reach), and slack.
    check(error_after <= 3 * kTimeoutMs / 1000.0 + 3.0,
          fmt::format("rank 1 threw {:.3f} s after the cut (bound: 3 x timeout + 3 s)", error_after));
    check(ended_after <= 3 * kTimeoutMs / 1000.0 + 5.0,
          fmt::format("rank 1's process ended {:.3f} s after the cut (bound: 3 x timeout + 5 s)", ended_after));
    fmt::print("    cut after {} steps; rank 0: {} ({:.3f} s after the cut), {} steps\n", steps_at_cut,
               r0["recovery"].substr(0, 300), recovered_after, r0["steps"]);
    fmt::print("    rank 1: {}: {:.3f} s after the cut, exited {:.3f} s after: {}\n", r1["type"], error_after,
               ended_after, r1["what"].substr(0, 400));
    end(name, logs);
  }

  /// Case 4: rank 1 is killed with SIGKILL.
  void killed_peer() {
    const std::string name = "4-peer-killed";
    begin(name);
    std::int64_t t_kill = 0;
    std::vector<std::string> logs;
    std::vector<int> codes;
    auto reports = loop_with_fault(
        name, 20000, [&](std::vector<pid_t>& pids) { ::kill(pids[1], SIGKILL); }, t_kill, logs, codes);
    auto& rep = reports[0];
    check(codes[1] == -SIGKILL, fmt::format("rank 1 was killed (exit {})", codes[1]));
    check(rep["type"] == "TimeoutError" || rep["type"] == "CommError",
          fmt::format("rank 0 threw a loom error (got {}: {})", rep["type"], rep["what"]));
    check(rep["what"].find("all_reduce") != std::string::npos && rep["what"].find("on rank 0") != std::string::npos,
          "rank 0's error names the collective and its rank: " + rep["what"]);
    check(rep["what"].find("peer rank 1") != std::string::npos, "rank 0's error names peer rank 1: " + rep["what"]);
    const double after = rep.count("t_error") ? (std::stoll(rep["t_error"]) - t_kill) / 1e9 : 1e9;
    // 4 s: loom's watch of the connections (GlooWork::kClosedGrace, 1 s, and a 50 ms tick) when Gloo
    // leaves a receive waiting, plus the flight recorder's exchange (at most 1 s with a peer that posts
    // nothing), plus up to 0.4 s for the link's queue (case 4b), plus 0.2 s in the communicator's
    // destructor (a collective still running in Gloo; include/loom/comm/gloo.hpp), plus a busy machine.
    check(after <= 4.0, fmt::format("rank 0 threw {:.3f} s after the kill (bound 4 s)", after));
    fmt::print("    rank 0: {:.3f} s after the kill: {}\n", after, rep["what"].substr(0, 300));
    end(name, logs);
  }

  /// Case 4b: rank 1 is killed while it sends over a slow link (20 Mbit/s: one 2 MiB message of the
  /// loop's all-reduce takes 0.8 s), so rank 0 is in the middle of reading a message. Gloo fails the
  /// operations it has queued on the closed connection, but not the receive whose message it was
  /// reading (it waits for the timeout; gloo/transport/tcp/pair.cc, signalException); loom's wait
  /// sees the closed connection and ends it. Three kills at different moments: without loom's watch
  /// about half of them wait the whole 20 s.
  void killed_peer_mid_message() {
    const std::string name = "4b-peer-killed-mid-message";
    begin(name);
    if (find_in_path("tc").empty() || !hosts.rate("20mbit")) {
      hosts.rate("");
      fmt::print("  SKIP: {}: tc could not limit the link (apt-get install iproute2; kernel module sch_tbf)\n", name);
      return;
    }
    std::vector<std::string> logs;
    for (int k = 0; k < 3; ++k) {
      ++port;
      std::int64_t t_kill = 0;
      std::vector<int> codes;
      auto reports = loop_with_fault(
          fmt::format("{}.{}", name, k), 20000,
          [&](std::vector<pid_t>& pids) {
            std::this_thread::sleep_for(std::chrono::milliseconds(150 + 250 * k));
            t_kill = now_ns();
            ::kill(pids[1], SIGKILL);
          },
          t_kill, logs, codes);
      auto& rep = reports[0];
      check(codes[1] == -SIGKILL, fmt::format("kill {}: rank 1 was killed (exit {})", k, codes[1]));
      check(rep["type"] == "CommError",
            fmt::format("kill {}: rank 0 threw loom::CommError (got {}: {})", k, rep["type"], rep["what"]));
      check(rep["what"].find("peer rank 1 closed its connection") != std::string::npos,
            fmt::format("kill {}: rank 0's error says peer rank 1 closed its connection: {}", k, rep["what"]));
      const double after = rep.count("t_error") ? (std::stoll(rep["t_error"]) - t_kill) / 1e9 : 1e9;
      check(after <= 4.0,
            fmt::format("kill {}: rank 0 threw {:.3f} s after the kill (bound 4 s, as case 4)", k, after));
      fmt::print("    kill {}: rank 0 {:.3f} s after the kill: {}\n", k, after, rep["what"].substr(0, 300));
    }
    hosts.rate("");
    end(name, logs);
  }

  /// Case 5: MASTER_ADDR is an address nobody has.
  void unreachable_master() {
    const std::string name = "5-master-unreachable";
    begin(name);
    constexpr int kTimeoutMs = 3000;
    const std::string out = (dir / (name + ".rank1.out")).string();
    const std::string log = (dir / (name + ".rank1.log")).string();
    pid_t pid = hosts.start(1, {self, "--worker", "join", out}, rank_env(1, Hosts::kUnreachable, kTimeoutMs), log);
    auto codes = wait_all({pid}, Clock::now() + std::chrono::seconds(60));
    auto rep = read_report(out);
    check(rep["type"] == "TimeoutError" || rep["type"] == "CommError",
          fmt::format("rank 1 threw a loom error (got {}: {})", rep["type"], rep["what"]));
    const std::string where = fmt::format("{}:{}", Hosts::kUnreachable, port);
    check(rep["what"].find(where) != std::string::npos, fmt::format("the error names {}: {}", where, rep["what"]));
    const double took = rep.count("t_error") ? (std::stoll(rep["t_error"]) - std::stoll(rep["t_start"])) / 1e9 : 1e9;
    check(took <= kTimeoutMs / 1000.0 + 1.0,
          fmt::format("rank 1 gave up after {:.3f} s (bound: timeout 3 s + 1 s)", took));
    fmt::print("    rank 1: {:.3f} s: {}\n", took, rep["what"].substr(0, 300));
    (void)codes;
    end(name, {log, out});
  }

  /// Case 6: rank 0 advertises loopback (GLOO_SOCKET_IFNAME=lo), so rank 1 cannot connect to it.
  void failed_connect() {
    const std::string name = "6-failed-connect";
    begin(name);
    constexpr int kTimeoutMs = 20000;
    std::vector<pid_t> pids;
    std::vector<std::string> outs, logs;
    for (int r = 0; r < 2; ++r) {
      outs.push_back((dir / fmt::format("{}.rank{}.out", name, r)).string());
      logs.push_back((dir / fmt::format("{}.rank{}.log", name, r)).string());
      auto env = rank_env(r, Hosts::kAddrA, kTimeoutMs);
      if (r == 0) env["GLOO_SOCKET_IFNAME"] = "lo";
      pids.push_back(hosts.start(r, {self, "--worker", "join", outs[r]}, env, logs[r]));
    }
    auto codes = wait_all(pids, Clock::now() + std::chrono::seconds(60));
    auto r0 = read_report(outs[0]);
    auto r1 = read_report(outs[1]);
    check(r1.count("type") == 1, "rank 1 failed to connect: " + r1["what"]);
    check(r0["type"] == "CommError" || r0["type"] == "TimeoutError",
          fmt::format("rank 0 threw a loom error (got {}: {})", r0["type"], r0["what"]));
    check(r0["what"].find("rank 1") != std::string::npos, "rank 0's error names rank 1: " + r0["what"]);
    const double gap = r0.count("t_error") && r1.count("t_error")
                           ? (std::stoll(r0["t_error"]) - std::stoll(r1["t_error"])) / 1e9
                           : 1e9;
    check(gap <= 1.0, fmt::format("rank 0 threw {:.3f} s after rank 1 failed (bound 1 s; its timeout is 20 s)", gap));
    fmt::print("    rank 1: {}\n    rank 0 ({:.3f} s later): {}\n", r1["what"].substr(0, 300), gap,
               r0["what"].substr(0, 400));
    (void)codes;
    logs.insert(logs.end(), outs.begin(), outs.end());
    end(name, logs);
  }
};

int controller(int argc, char** argv) {
  std::string only, readme_loop;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--only" && i + 1 < argc)
      only = argv[++i];
    else
      readme_loop = argv[i];
  }
  if (::geteuid() != 0) {
    fmt::print("SKIP: network namespaces need root\n");
    return 77;
  }
  for (const char* tool : {"ip", "unshare", "hostname", "mount"})
    if (find_in_path(tool).empty()) {
      fmt::print("SKIP: '{}' not found (apt-get install iproute2 util-linux hostname)\n", tool);
      return 77;
    }
  std::string templ = (fs::temp_directory_path() / "loom-two-hosts-XXXXXX").string();
  if (::mkdtemp(templ.data()) == nullptr) {
    fmt::print("FAIL: mkdtemp\n");
    return 1;
  }
  const fs::path dir = templ;
  int rc = 0;
  {
    Hosts hosts(dir);
    if (!hosts.created()) {
      fmt::print("SKIP: cannot create a network namespace (ip netns add failed)\n");
      rc = 77;
    } else if (!hosts.ok()) {
      fmt::print("FAIL: the namespaces or the veth pair could not be set up\n");
      rc = 1;
    } else {
      Suite suite{dir, hosts, fs::canonical("/proc/self/exe").string(), readme_loop};
      fmt::print("hosts: {} ({} {}) and {} ({} {}); MASTER_ADDR={}\n", hosts.ns(0), hosts.veth(0), Hosts::kAddrA,
                 hosts.ns(1), hosts.veth(1), Hosts::kAddrB, Hosts::kAddrA);
      const std::vector<std::pair<std::string, std::function<void()>>> cases = {
          {"1", [&] { suite.training("1-training", false); }},
          {"2", [&] { suite.training("2-GLOO_SOCKET_IFNAME", true); }},
          {"3", [&] { suite.link_down(); }},
          {"4", [&] { suite.killed_peer(); }},
          {"4b", [&] { suite.killed_peer_mid_message(); }},
          {"5", [&] { suite.unreachable_master(); }},
          {"6", [&] { suite.failed_connect(); }},
          {"7", [&] { suite.cut_off_elastic(); }}};
      int ran = 0;
      for (const auto& [id, run_case] : cases)
        if (only.empty() || only == id) {
          run_case();
          ++ran;
        }
      fmt::print("{} of {} cases failed\n", suite.failed, ran);
      rc = suite.failed == 0 && ran > 0 ? 0 : 1;
    }
  }
  std::error_code ec;
  fs::remove_all(dir, ec);
  return rc;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 4 && std::string(argv[1]) == "--worker")
    return std::string(argv[2]) == "elastic" ? elastic_worker(argv[3]) : worker(argv[2], argv[3]);
  try {
    return controller(argc, argv);
  } catch (const std::exception& e) {
    fmt::print("FAIL: {}\n", e.what());
    return 1;
  }
}
