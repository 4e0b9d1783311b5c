// loom/launch/environment.hpp — who am I in the job: rank, world size, local rank, node, master address,
// read from the variables a launcher sets (torchrun, Open MPI's mpirun, Slurm's srun).
//
// One sentence: `loom::Environment::from_env()` turns the launcher's environment variables into one
// validated struct, or throws loom::ConfigError naming the variable and its bad value.
//
// Example:
//   auto env = loom::Environment::from_env();   // under `torchrun --nproc-per-node 2 ./train`
//   // env.rank == 1, env.world_size == 2, env.local_rank == 1, env.master_addr == "127.0.0.1"
//   auto test = loom::Environment::from_map({{"RANK", "1"}, {"WORLD_SIZE", "2"},
//                                            {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "29500"}});
//
// Which launcher wins (the first whose rank variable is set):
//   1. torchrun / torch.distributed.run / loom::spawn: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
//      GROUP_RANK (node rank, optional), MASTER_ADDR, MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE,
//      TORCHELASTIC_RESTART_COUNT. loom::spawn (and loom::run, which spawns) also sets
//      LOOM_LAUNCHER=spawn:<MASTER_PORT>, so its ranks read Launcher::spawn rather than
//      Launcher::torchrun (a mark naming another port, inherited from an outer job, is ignored).
//   2. Open MPI (mpirun): OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK,
//      OMPI_COMM_WORLD_LOCAL_SIZE. MASTER_ADDR / MASTER_PORT must be passed with `mpirun -x`.
//   3. Slurm (srun): SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NTASKS_PER_NODE or
//      SLURM_TASKS_PER_NODE (local size), SLURM_NODEID, SLURM_NNODES. MASTER_ADDR / MASTER_PORT
//      must be exported by the batch script.
//   4. None of them: a single process (rank 0 of 1, master 127.0.0.1:29500).
// Whatever the launcher: LOOM_RENDEZVOUS_SECRET, the job's secret for the rendezvous store (see
// loom/launch/rendezvous.hpp; loom::spawn sets a fresh one for its ranks).
// Under loom::spawn only (LOOM_LAUNCHER names this MASTER_PORT): LOOM_STORE_HOST=spawn, set by an
// elastic spawn (SpawnOptions::elastic), says spawn's store process hosts the store
// (Environment::external_store); elsewhere it is ignored, like a mark inherited from an outer job.
//
// Throws: loom::ConfigError for a non-integer or negative number, RANK >= WORLD_SIZE, WORLD_SIZE < 1,
//         LOCAL_RANK >= LOCAL_WORLD_SIZE, a port outside [1, 65535], MASTER_ADDR missing or empty
//         when WORLD_SIZE > 1, a rank variable without its size variable, a LOOM_LAUNCHER beside
//         RANK that is neither empty nor "spawn:<port>", a LOOM_STORE_HOST beside RANK that is neither
//         empty nor "spawn", LOOM_STORE_HOST=spawn beside TORCHELASTIC_USE_AGENT_STORE=True. The
//         message names the variable and the value, e.g. "loom: RANK='abc' is not an integer".
//
// Source: variable names and meanings as documented for torchrun (torch.distributed.run), Open MPI
// (mpirun(1), "OMPI_COMM_WORLD_*") and Slurm (srun(1), "OUTPUT ENVIRONMENT VARIABLES").
#pragma once

#include <algorithm>
#include <charconv>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>

#include <fmt/format.h>

#include <loom/error.hpp>

namespace loom {

/// Which launcher's variables an Environment was read from.
/// spawn: ranks forked by loom::spawn or loom::run on this machine (torchrun's variables plus
/// LOOM_LAUNCHER=spawn:<MASTER_PORT>); none: no launcher variables, a single process.
enum class Launcher { none, torchrun, mpirun, slurm, spawn };

/// Name of a Launcher ("none", "torchrun", "mpirun", "slurm", "spawn"), for messages.
constexpr std::string_view to_string(Launcher l) noexcept {
  switch (l) {
    case Launcher::none: return "none";
    case Launcher::torchrun: return "torchrun";
    case Launcher::mpirun: return "mpirun";
    case Launcher::slurm: return "slurm";
    case Launcher::spawn: return "spawn";
  }
  return "?";
}

/// The place of this process in a job, read from launcher variables.
///
/// Example:
///   auto env = loom::Environment::from_env();
///   if (env.local_rank == 0) prepare_cache();
///
/// Units: ranks are 0-based process indices; `master_port` is a TCP port.
/// Invariants after from_env()/from_map(): 0 <= rank < world_size, 0 <= local_rank < local_world_size,
/// 0 <= node_rank < num_nodes.
/// Source: torchrun's RANK / LOCAL_RANK / GROUP_RANK ("group" = node) vocabulary.
struct Environment {
  /// Default rendezvous port when MASTER_PORT is not set (the same as torchrun and c10d's TCPStore).
  static constexpr std::uint16_t kDefaultPort = 29500;

  int rank = 0;              ///< global rank, in [0, world_size)
  int world_size = 1;        ///< number of processes in the job
  int local_rank = 0;        ///< rank among the processes of this node
  int local_world_size = 1;  ///< processes on this node
  int node_rank = 0;         ///< index of this node (torchrun's GROUP_RANK); rank / local_world_size when not given
  int num_nodes = 1;         ///< number of nodes; world_size / local_world_size when not given
  std::string master_addr = "127.0.0.1";     ///< host of the rendezvous store (rank 0's or torchrun's)
  std::uint16_t master_port = kDefaultPort;  ///< port of the rendezvous store
  Launcher launcher = Launcher::none;        ///< where the values came from
  bool use_agent_store =
      false;              ///< TORCHELASTIC_USE_AGENT_STORE=True: torchrun hosts the store, every rank is a client
  int restart_count = 0;  ///< TORCHELASTIC_RESTART_COUNT (prefix /worker/attempt_<n> of torchrun's keys)
  std::string
      rendezvous_secret{};  ///< LOOM_RENDEZVOUS_SECRET: loom's store keys live under it; empty = none (a warning)
  /// LOOM_STORE_HOST=spawn (an elastic loom::spawn, SpawnOptions::elastic): spawn's store process hosts
  /// the store, so every rank, rank 0 included, is a client of it (loom/launch/rendezvous.hpp).
  bool external_store = false;

  /// True when more than one process takes part.
  [[nodiscard]] bool is_distributed() const noexcept { return world_size > 1; }

  /// True for local rank 0 (the process that does per-node work, e.g. printing or caching).
  [[nodiscard]] bool is_local_main() const noexcept { return local_rank == 0; }

  /// Reads the current process's environment (see the header comment for precedence).
  /// Throws: loom::ConfigError naming the variable and its value.
  static Environment from_env() {
    return from_lookup([](std::string_view name) -> std::optional<std::string> {
      const char* v = std::getenv(std::string(name).c_str());
      if (v == nullptr) return std::nullopt;
      return std::string(v);
    });
  }

  /// Same as from_env(), from an explicit name -> value map (tests, configuration files).
  /// Example: Environment::from_map({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "1"}}).
  static Environment from_map(const std::map<std::string, std::string, std::less<>>& vars) {
    return from_lookup([&vars](std::string_view name) -> std::optional<std::string> {
      auto it = vars.find(name);
      if (it == vars.end()) return std::nullopt;
      return it->second;
    });
  }

  /// Same as from_env(), with any lookup function `name -> optional<value>`.
  static Environment from_lookup(const std::function<std::optional<std::string>(std::string_view)>& get);
};

namespace detail {

/// Parses a decimal integer environment value; throws ConfigError naming the variable.
inline long long parse_env_int(std::string_view name, const std::string& value) {
  std::string_view s = value;
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\n')) s.remove_suffix(1);
  long long out = 0;
  const char* first = s.data();
  const char* last = s.data() + s.size();
  if (!s.empty() && s.front() == '+') ++first;
  auto [ptr, ec] = std::from_chars(first, last, out);
  if (s.empty() || ec == std::errc::invalid_argument || ptr != last)
    throw ConfigError(fmt::format("{}='{}' is not an integer", name, value));
  if (ec == std::errc::result_out_of_range) throw ConfigError(fmt::format("{}='{}' is out of range", name, value));
  return out;
}

/// Parses a non-negative int (a rank or a count); throws ConfigError naming the variable.
inline int parse_env_count(std::string_view name, const std::string& value, long long min_value) {
  long long v = parse_env_int(name, value);
  if (v < 0) throw ConfigError(fmt::format("{}={} is negative", name, value));
  if (v < min_value) throw ConfigError(fmt::format("{}={} must be at least {}", name, value, min_value));
  if (v > 1'000'000'000) throw ConfigError(fmt::format("{}={} is implausibly large", name, value));
  return static_cast<int>(v);
}

/// Slurm's SLURM_TASKS_PER_NODE is e.g. "4", "4(x2)" or "4(x2),3": the first count is this layout's
/// local size only when the value is uniform; returns nullopt otherwise.
inline std::optional<int> slurm_uniform_tasks_per_node(const std::string& v) {
  auto paren = v.find('(');
  auto comma = v.find(',');
  if (comma != std::string::npos) return std::nullopt;
  std::string head = v.substr(0, paren);
  long long n = 0;
  auto [ptr, ec] = std::from_chars(head.data(), head.data() + head.size(), n);
  if (ec != std::errc{} || ptr != head.data() + head.size() || n < 1) return std::nullopt;
  return static_cast<int>(n);
}

}  // namespace detail

inline Environment Environment::from_lookup(const std::function<std::optional<std::string>(std::string_view)>& get) {
  Environment env;
  auto need = [&](std::string_view name, std::string_view because) -> std::string {
    auto v = get(name);
    if (!v) throw ConfigError(fmt::format("{} is set but {} is not", because, name));
    return *v;
  };
  auto count = [&](std::string_view name, long long min_value) -> std::optional<int> {
    auto v = get(name);
    if (!v) return std::nullopt;
    return detail::parse_env_count(name, *v, min_value);
  };

  // Names of the variables the values came from, so range errors name them.
  std::string_view rank_var = "RANK", size_var = "WORLD_SIZE", lrank_var = "LOCAL_RANK", lsize_var = "LOCAL_WORLD_SIZE";
  std::optional<int> local_rank, local_size, node_rank, num_nodes;

  if (get("RANK")) {
    env.launcher = Launcher::torchrun;
    env.rank = detail::parse_env_count("RANK", *get("RANK"), 0);
    env.world_size = detail::parse_env_count("WORLD_SIZE", need("WORLD_SIZE", "RANK"), 1);
    local_rank = count("LOCAL_RANK", 0);
    local_size = count("LOCAL_WORLD_SIZE", 1);
    node_rank = count("GROUP_RANK", 0);
    num_nodes = count("GROUP_WORLD_SIZE", 1);
  } else if (get("OMPI_COMM_WORLD_RANK")) {
    env.launcher = Launcher::mpirun;
    rank_var = "OMPI_COMM_WORLD_RANK";
    size_var = "OMPI_COMM_WORLD_SIZE";
    lrank_var = "OMPI_COMM_WORLD_LOCAL_RANK";
    lsize_var = "OMPI_COMM_WORLD_LOCAL_SIZE";
    env.rank = detail::parse_env_count(rank_var, *get(rank_var), 0);
    env.world_size = detail::parse_env_count(size_var, need(size_var, rank_var), 1);
    local_rank = count(lrank_var, 0);
    local_size = count(lsize_var, 1);
  } else if (get("SLURM_PROCID")) {
    env.launcher = Launcher::slurm;
    rank_var = "SLURM_PROCID";
    size_var = "SLURM_NTASKS";
    lrank_var = "SLURM_LOCALID";
    lsize_var = "SLURM_NTASKS_PER_NODE";
    env.rank = detail::parse_env_count(rank_var, *get(rank_var), 0);
    env.world_size = detail::parse_env_count(size_var, need(size_var, rank_var), 1);
    local_rank = count(lrank_var, 0);
    local_size = count("SLURM_NTASKS_PER_NODE", 1);
    if (!local_size) {
      if (auto tpn = get("SLURM_TASKS_PER_NODE")) {
        local_size = detail::slurm_uniform_tasks_per_node(*tpn);
        if (local_size) lsize_var = "SLURM_TASKS_PER_NODE";
      }
    }
    node_rank = count("SLURM_NODEID", 0);
    num_nodes = count("SLURM_NNODES", 1);
  }

  if (env.rank >= env.world_size)
    throw ConfigError(fmt::format("{}={} is not below {}={}", rank_var, env.rank, size_var, env.world_size));

  // Local layout: a missing local size means "all ranks on this node" when there is no local rank
  // either (one node), else it cannot be known and stays 0-free by using the local rank + 1 bound.
  if (!local_rank && !local_size) {
    local_rank = env.launcher == Launcher::none ? 0 : env.rank;
    local_size = env.world_size;
  } else if (!local_size) {
    local_size = env.world_size;  // unknown: the conservative bound (single node assumed)
  } else if (!local_rank) {
    local_rank = env.rank % *local_size;
  }
  env.local_rank = *local_rank;
  env.local_world_size = *local_size;
  if (env.local_world_size > env.world_size)
    throw ConfigError(
        fmt::format("{}={} is larger than {}={}", lsize_var, env.local_world_size, size_var, env.world_size));
  if (env.local_rank >= env.local_world_size)
    throw ConfigError(
        fmt::format("{}={} is not below {}={}", lrank_var, env.local_rank, lsize_var, env.local_world_size));

  env.node_rank = node_rank ? *node_rank : env.rank / env.local_world_size;
  env.num_nodes = num_nodes ? *num_nodes : (env.world_size + env.local_world_size - 1) / env.local_world_size;
  if (env.node_rank >= env.num_nodes)
    throw ConfigError(fmt::format("node rank {} (GROUP_RANK / SLURM_NODEID) is not below the number of nodes {}",
                                  env.node_rank, env.num_nodes));

  if (auto addr = get("MASTER_ADDR")) {
    if (addr->empty() && env.world_size > 1)
      throw ConfigError(fmt::format("MASTER_ADDR is empty but {}={} (> 1)", size_var, env.world_size));
    if (!addr->empty()) env.master_addr = *addr;
  } else if (env.world_size > 1) {
    throw ConfigError(fmt::format("MASTER_ADDR is not set but {}={} (> 1); export MASTER_ADDR=<host of rank 0>{}",
                                  size_var, env.world_size,
                                  env.launcher == Launcher::mpirun ? " and pass it with mpirun -x MASTER_ADDR" : ""));
  }
  if (auto port = get("MASTER_PORT")) {
    long long p = detail::parse_env_int("MASTER_PORT", *port);
    if (p < 1 || p > 65535) throw ConfigError(fmt::format("MASTER_PORT={} is outside [1, 65535]", *port));
    env.master_port = static_cast<std::uint16_t>(p);
  }

  // loom::spawn's mark, "spawn:<the MASTER_PORT spawn picked>". A mark naming another port was
  // inherited from an outer spawned job by a process of another job (e.g. a torchrun started inside a
  // spawned rank) and is ignored; an empty one counts as unset.
  if (auto mark = get("LOOM_LAUNCHER"); mark && !mark->empty() && env.launcher == Launcher::torchrun) {
    constexpr std::string_view prefix = "spawn:";
    const std::string_view digits = std::string_view(*mark).substr(std::min(mark->size(), prefix.size()));
    if (!mark->starts_with(prefix) || digits.empty() || digits.size() > 5 ||
        digits.find_first_not_of("0123456789") != std::string_view::npos)
      throw ConfigError(fmt::format("LOOM_LAUNCHER='{}' is not what loom::spawn sets ('spawn:<MASTER_PORT>')", *mark));
    if (std::stoi(std::string(digits)) == env.master_port) env.launcher = Launcher::spawn;
  }

  if (auto agent = get("TORCHELASTIC_USE_AGENT_STORE")) {
    if (*agent == "True" || *agent == "true" || *agent == "1") {
      env.use_agent_store = true;
    } else if (*agent == "False" || *agent == "false" || *agent == "0" || agent->empty()) {
      env.use_agent_store = false;
    } else {
      throw ConfigError(fmt::format("TORCHELASTIC_USE_AGENT_STORE='{}' is not True or False", *agent));
    }
  }
  // An elastic spawn's "LOOM_STORE_HOST=spawn": read only where the LOOM_LAUNCHER mark names this
  // job's MASTER_PORT (so a variable inherited from an outer spawned job is ignored), checked beside RANK.
  if (auto host = get("LOOM_STORE_HOST");
      host && !host->empty() && (env.launcher == Launcher::torchrun || env.launcher == Launcher::spawn)) {
    if (*host != "spawn")
      throw ConfigError(fmt::format("LOOM_STORE_HOST='{}' is not what loom::spawn sets ('spawn')", *host));
    env.external_store = env.launcher == Launcher::spawn;
    if (env.external_store && env.use_agent_store)
      throw ConfigError(
          "LOOM_STORE_HOST=spawn and TORCHELASTIC_USE_AGENT_STORE=True both name the store's host (spawn's store "
          "process, torchrun's agent); set one");
  }
  if (auto rc = get("TORCHELASTIC_RESTART_COUNT"))
    env.restart_count = detail::parse_env_count("TORCHELASTIC_RESTART_COUNT", *rc, 0);
  if (auto secret = get("LOOM_RENDEZVOUS_SECRET")) {
    if (secret->find_first_of(" \t\n") != std::string::npos)
      throw ConfigError(
          "LOOM_RENDEZVOUS_SECRET contains whitespace (a copy-paste slip?); use e.g. the output of "
          "`openssl rand -hex 16`");
    env.rendezvous_secret = *secret;
  }
  return env;
}

}  // namespace loom
