// Environment parsing: every launcher, the derived fields, and every bad value named in its error.
#include <sys/wait.h>
#include <unistd.h>

#include <loom/launch/environment.hpp>

namespace test_environment {

using loom::Environment;
using Vars = std::map<std::string, std::string, std::less<>>;

namespace {
Vars torchrun(std::string rank, std::string world) {
  return {{"RANK", std::move(rank)},
          {"WORLD_SIZE", std::move(world)},
          {"MASTER_ADDR", "10.0.0.1"},
          {"MASTER_PORT", "29400"}};
}
Vars with(Vars v, const std::string& k, const std::string& value) {
  v[k] = value;
  return v;
}
Vars without(Vars v, const std::string& k) {
  v.erase(k);
  return v;
}
}  // namespace

TEST_CASE("Environment: no launcher variables is one process") {
  auto env = Environment::from_map({});
  CHECK(env.launcher == loom::Launcher::none);
  CHECK(env.rank == 0);
  CHECK(env.world_size == 1);
  CHECK(env.local_rank == 0);
  CHECK(env.local_world_size == 1);
  CHECK(env.node_rank == 0);
  CHECK(env.num_nodes == 1);
  CHECK(env.master_addr == "127.0.0.1");
  CHECK(env.master_port == 29500);
  CHECK_FALSE(env.is_distributed());
  CHECK_FALSE(env.use_agent_store);
}

TEST_CASE("Environment: torchrun variables") {
  auto vars = torchrun("3", "4");
  vars["LOCAL_RANK"] = "1";
  vars["LOCAL_WORLD_SIZE"] = "2";
  auto env = Environment::from_map(vars);
  CHECK(env.launcher == loom::Launcher::torchrun);
  CHECK(env.rank == 3);
  CHECK(env.world_size == 4);
  CHECK(env.local_rank == 1);
  CHECK(env.local_world_size == 2);
  CHECK(env.node_rank == 1);  // derived: 3 / 2
  CHECK(env.num_nodes == 2);  // derived: 4 / 2
  CHECK(env.master_addr == "10.0.0.1");
  CHECK(env.master_port == 29400);
  CHECK(env.is_distributed());
  CHECK_FALSE(env.is_local_main());

  SUBCASE("GROUP_RANK / GROUP_WORLD_SIZE override the derivation") {
    auto e = Environment::from_map(with(with(vars, "GROUP_RANK", "0"), "GROUP_WORLD_SIZE", "1"));
    CHECK(e.node_rank == 0);
    CHECK(e.num_nodes == 1);
  }
  SUBCASE("without LOCAL_* a single node is assumed") {
    auto e = Environment::from_map(torchrun("2", "3"));
    CHECK(e.local_rank == 2);
    CHECK(e.local_world_size == 3);
    CHECK(e.node_rank == 0);
    CHECK(e.num_nodes == 1);
  }
  SUBCASE("LOOM_LAUNCHER=spawn:<MASTER_PORT> (what loom::spawn sets) reads as Launcher::spawn, the same values") {
    auto e = Environment::from_map(with(vars, "LOOM_LAUNCHER", "spawn:29400"));
    CHECK(e.launcher == loom::Launcher::spawn);
    CHECK(loom::to_string(e.launcher) == "spawn");
    CHECK(e.rank == 3);
    CHECK(e.world_size == 4);
    CHECK(e.local_rank == 1);
    CHECK(e.local_world_size == 2);
    CHECK(e.master_port == 29400);
  }
  SUBCASE("a mark naming another port (inherited from an outer spawned job) or an empty one is torchrun's") {
    CHECK(Environment::from_map(with(vars, "LOOM_LAUNCHER", "spawn:29401")).launcher == loom::Launcher::torchrun);
    CHECK(Environment::from_map(with(vars, "LOOM_LAUNCHER", "")).launcher == loom::Launcher::torchrun);
  }
  SUBCASE("LOOM_LAUNCHER alone, or beside Open MPI's variables, is not read") {
    CHECK(Environment::from_map({{"LOOM_LAUNCHER", "spawn:29500"}}).launcher == loom::Launcher::none);
    CHECK(Environment::from_map({{"LOOM_LAUNCHER", "x"}, {"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "1"}})
              .launcher == loom::Launcher::mpirun);
  }
  SUBCASE("torchrun wins over Open MPI and Slurm variables") {
    auto e = Environment::from_map(with(with(vars, "OMPI_COMM_WORLD_RANK", "0"), "SLURM_PROCID", "0"));
    CHECK(e.launcher == loom::Launcher::torchrun);
    CHECK(e.rank == 3);
  }
  SUBCASE("2 nodes x 2 ranks: local rank 0 of each node is global rank 0 and 2") {
    std::vector<int> local_mains;
    for (int r = 0; r < 4; ++r) {
      auto e = Environment::from_map(with(
          with(with(torchrun(std::to_string(r), "4"), "LOCAL_RANK", std::to_string(r % 2)), "LOCAL_WORLD_SIZE", "2"),
          "GROUP_RANK", std::to_string(r / 2)));
      if (e.is_local_main()) local_mains.push_back(r);
      CHECK(e.node_rank == r / 2);
    }
    CHECK(local_mains == std::vector<int>{0, 2});
  }
  SUBCASE("surrounding blanks are accepted") {
    CHECK(Environment::from_map(torchrun(" 1\n", "2")).rank == 1);
  }
}

TEST_CASE("Environment: torchrun agent store variables") {
  auto env = Environment::from_map(
      with(with(torchrun("0", "2"), "TORCHELASTIC_USE_AGENT_STORE", "True"), "TORCHELASTIC_RESTART_COUNT", "3"));
  CHECK(env.use_agent_store);
  CHECK(env.restart_count == 3);
  CHECK_FALSE(Environment::from_map(with(torchrun("0", "2"), "TORCHELASTIC_USE_AGENT_STORE", "False")).use_agent_store);
}

TEST_CASE("Environment: LOOM_STORE_HOST=spawn (an elastic spawn) is read under loom::spawn only") {
  const Vars spawned = with(torchrun("0", "2"), "LOOM_LAUNCHER", "spawn:29400");
  CHECK_FALSE(Environment::from_map(spawned).external_store);
  CHECK(Environment::from_map(with(spawned, "LOOM_STORE_HOST", "spawn")).external_store);
  CHECK_FALSE(Environment::from_map(with(spawned, "LOOM_STORE_HOST", "")).external_store);
  // Inherited from an outer spawned job (the mark names another port, or there is none): ignored.
  CHECK_FALSE(
      Environment::from_map(with(with(torchrun("0", "2"), "LOOM_LAUNCHER", "spawn:29401"), "LOOM_STORE_HOST", "spawn"))
          .external_store);
  CHECK_FALSE(Environment::from_map(with(torchrun("0", "2"), "LOOM_STORE_HOST", "spawn")).external_store);
  CHECK_FALSE(Environment::from_map({{"LOOM_STORE_HOST", "spawn"}}).external_store);
}

TEST_CASE("Environment: the job's rendezvous secret, whatever the launcher") {
  CHECK(Environment::from_map(torchrun("0", "2")).rendezvous_secret.empty());
  CHECK(Environment::from_map(with(torchrun("0", "2"), "LOOM_RENDEZVOUS_SECRET", "9f3a")).rendezvous_secret == "9f3a");
  Vars mpi{{"OMPI_COMM_WORLD_RANK", "0"},
           {"OMPI_COMM_WORLD_SIZE", "2"},
           {"MASTER_ADDR", "node0"},
           {"LOOM_RENDEZVOUS_SECRET", "c0ffee"}};
  CHECK(Environment::from_map(mpi).rendezvous_secret == "c0ffee");
  CHECK(Environment::from_map({{"LOOM_RENDEZVOUS_SECRET", "ab"}}).rendezvous_secret == "ab");
}

TEST_CASE("Environment: Open MPI variables") {
  Vars vars{{"OMPI_COMM_WORLD_RANK", "3"},
            {"OMPI_COMM_WORLD_SIZE", "4"},
            {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
            {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
            {"MASTER_ADDR", "node0"}};
  auto env = Environment::from_map(vars);
  CHECK(env.launcher == loom::Launcher::mpirun);
  CHECK(env.rank == 3);
  CHECK(env.world_size == 4);
  CHECK(env.local_rank == 1);
  CHECK(env.local_world_size == 2);
  CHECK(env.node_rank == 1);
  CHECK(env.num_nodes == 2);
  CHECK(env.master_addr == "node0");
  CHECK(env.master_port == 29500);  // MASTER_PORT not passed: the default
  SUBCASE("without the local size, the local rank still comes from OMPI_COMM_WORLD_LOCAL_RANK") {
    auto e = Environment::from_map(without(vars, "OMPI_COMM_WORLD_LOCAL_SIZE"));
    CHECK(e.local_rank == 1);
    CHECK(e.local_world_size == 4);
  }
}

TEST_CASE("Environment: Slurm variables") {
  Vars vars{{"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "1"},    {"SLURM_TASKS_PER_NODE", "4(x2)"},
            {"SLURM_NODEID", "1"}, {"SLURM_NNODES", "2"}, {"MASTER_ADDR", "gpu-01"}, {"MASTER_PORT", "12345"}};
  auto env = Environment::from_map(vars);
  CHECK(env.launcher == loom::Launcher::slurm);
  CHECK(env.rank == 5);
  CHECK(env.world_size == 8);
  CHECK(env.local_rank == 1);
  CHECK(env.local_world_size == 4);
  CHECK(env.node_rank == 1);
  CHECK(env.num_nodes == 2);
  CHECK(env.master_port == 12345);
  SUBCASE("SLURM_NTASKS_PER_NODE is preferred") {
    CHECK(Environment::from_map(with(vars, "SLURM_NTASKS_PER_NODE", "4")).local_world_size == 4);
  }
  SUBCASE("an uneven SLURM_TASKS_PER_NODE leaves the local size at the conservative bound") {
    auto e = Environment::from_map(with(vars, "SLURM_TASKS_PER_NODE", "5,3"));
    CHECK(e.local_world_size == 8);
    CHECK(e.node_rank == 1);  // SLURM_NODEID still tells the node
  }
}

TEST_CASE("Environment: every bad value is a ConfigError naming the variable and the value") {
  auto bad = [](const Vars& vars, const std::string& expected) {
    INFO("expected message: " << expected);
    CHECK_THROWS_WITH_AS(Environment::from_map(vars), doctest::Contains(expected.c_str()), loom::ConfigError);
  };
  bad(torchrun("abc", "2"), "RANK='abc' is not an integer");
  bad(torchrun("1.5", "2"), "RANK='1.5' is not an integer");
  bad(torchrun("", "2"), "RANK='' is not an integer");
  bad(torchrun("-1", "2"), "RANK=-1 is negative");
  bad(torchrun("2", "2"), "RANK=2 is not below WORLD_SIZE=2");
  bad(torchrun("0", "0"), "WORLD_SIZE=0 must be at least 1");
  bad(torchrun("0", "two"), "WORLD_SIZE='two' is not an integer");
  bad(torchrun("0", "99999999999999999999"), "WORLD_SIZE='99999999999999999999' is out of range");
  bad(without(torchrun("0", "2"), "WORLD_SIZE"), "RANK is set but WORLD_SIZE is not");
  bad(with(torchrun("0", "2"), "LOCAL_RANK", "x"), "LOCAL_RANK='x' is not an integer");
  bad(with(torchrun("0", "2"), "LOCAL_RANK", "-3"), "LOCAL_RANK=-3 is negative");
  bad(with(with(torchrun("0", "4"), "LOCAL_RANK", "2"), "LOCAL_WORLD_SIZE", "2"),
      "LOCAL_RANK=2 is not below LOCAL_WORLD_SIZE=2");
  bad(with(torchrun("0", "2"), "LOCAL_WORLD_SIZE", "3"), "LOCAL_WORLD_SIZE=3 is larger than WORLD_SIZE=2");
  bad(with(torchrun("0", "2"), "LOCAL_WORLD_SIZE", "0"), "LOCAL_WORLD_SIZE=0 must be at least 1");
  bad(with(torchrun("0", "2"), "MASTER_PORT", "70000"), "MASTER_PORT=70000 is outside [1, 65535]");
  bad(with(torchrun("0", "2"), "MASTER_PORT", "0"), "MASTER_PORT=0 is outside [1, 65535]");
  bad(with(torchrun("0", "2"), "MASTER_PORT", "-5"), "MASTER_PORT=-5 is outside [1, 65535]");
  bad(with(torchrun("0", "2"), "MASTER_PORT", "http"), "MASTER_PORT='http' is not an integer");
  bad(without(torchrun("0", "2"), "MASTER_ADDR"), "MASTER_ADDR is not set but WORLD_SIZE=2 (> 1)");
  bad(with(torchrun("0", "2"), "MASTER_ADDR", ""), "MASTER_ADDR is empty but WORLD_SIZE=2 (> 1)");
  bad(with(with(torchrun("1", "4"), "GROUP_RANK", "2"), "GROUP_WORLD_SIZE", "2"), "node rank 2");
  bad(with(torchrun("0", "2"), "TORCHELASTIC_USE_AGENT_STORE", "maybe"),
      "TORCHELASTIC_USE_AGENT_STORE='maybe' is not True or False");
  bad(with(torchrun("0", "2"), "TORCHELASTIC_RESTART_COUNT", "-1"), "TORCHELASTIC_RESTART_COUNT=-1 is negative");
  bad(with(torchrun("0", "2"), "LOOM_RENDEZVOUS_SECRET", "ab cd\n"), "LOOM_RENDEZVOUS_SECRET contains whitespace");
  bad(with(torchrun("0", "2"), "LOOM_LAUNCHER", "torchrun"),
      "LOOM_LAUNCHER='torchrun' is not what loom::spawn sets ('spawn:<MASTER_PORT>')");
  bad(with(torchrun("0", "2"), "LOOM_LAUNCHER", "spawn"), "LOOM_LAUNCHER='spawn' is not what loom::spawn sets");
  bad(with(torchrun("0", "2"), "LOOM_LAUNCHER", "spawn:29x"), "LOOM_LAUNCHER='spawn:29x' is not what loom::spawn sets");
  bad(with(torchrun("0", "2"), "LOOM_LAUNCHER", "spawn:1234567"),
      "LOOM_LAUNCHER='spawn:1234567' is not what loom::spawn sets");
  bad(with(torchrun("0", "2"), "LOOM_STORE_HOST", "rank0"),
      "LOOM_STORE_HOST='rank0' is not what loom::spawn sets ('spawn')");
  bad(with(with(with(torchrun("0", "2"), "LOOM_LAUNCHER", "spawn:29400"), "LOOM_STORE_HOST", "spawn"),
           "TORCHELASTIC_USE_AGENT_STORE", "True"),
      "LOOM_STORE_HOST=spawn and TORCHELASTIC_USE_AGENT_STORE=True both name the store's host");
  bad({{"OMPI_COMM_WORLD_RANK", "x"}, {"OMPI_COMM_WORLD_SIZE", "2"}}, "OMPI_COMM_WORLD_RANK='x' is not an integer");
  bad({{"OMPI_COMM_WORLD_RANK", "2"}, {"OMPI_COMM_WORLD_SIZE", "2"}},
      "OMPI_COMM_WORLD_RANK=2 is not below OMPI_COMM_WORLD_SIZE=2");
  bad({{"OMPI_COMM_WORLD_RANK", "0"}}, "OMPI_COMM_WORLD_RANK is set but OMPI_COMM_WORLD_SIZE is not");
  bad({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"}},
      "MASTER_ADDR is not set but OMPI_COMM_WORLD_SIZE=2 (> 1); export MASTER_ADDR=<host of rank 0> and pass it with "
      "mpirun -x MASTER_ADDR");
  bad({{"OMPI_COMM_WORLD_RANK", "1"},
       {"OMPI_COMM_WORLD_SIZE", "2"},
       {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
       {"OMPI_COMM_WORLD_LOCAL_SIZE", "1"},
       {"MASTER_ADDR", "h"}},
      "OMPI_COMM_WORLD_LOCAL_RANK=1 is not below OMPI_COMM_WORLD_LOCAL_SIZE=1");
  bad({{"SLURM_PROCID", "3"}, {"SLURM_NTASKS", "2"}}, "SLURM_PROCID=3 is not below SLURM_NTASKS=2");
  bad({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "-1"}, {"MASTER_ADDR", "h"}},
      "SLURM_LOCALID=-1 is negative");
  bad({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "x2"}}, "SLURM_NTASKS='x2' is not an integer");
  // And the same values are fine when they are in range (the checks are not over-eager).
  CHECK_NOTHROW(Environment::from_map(with(torchrun("1", "2"), "MASTER_PORT", "65535")));
  CHECK_NOTHROW(Environment::from_map(with(torchrun("0", "1"), "MASTER_ADDR", "")));
}

TEST_CASE("Environment::from_env reads the process environment") {
  // Runs in a child so the test process's own environment is untouched.
  pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    setenv("RANK", "1", 1);
    setenv("WORLD_SIZE", "3", 1);
    setenv("MASTER_ADDR", "127.0.0.1", 1);
    setenv("MASTER_PORT", "4242", 1);
    int code = 10;
    try {
      auto env = Environment::from_env();
      code = (env.rank == 1 && env.world_size == 3 && env.master_port == 4242) ? 0 : 11;
      setenv("RANK", "oops", 1);
      try {
        (void)Environment::from_env();
        code = 12;
      } catch (const loom::ConfigError& e) {
        if (std::string(e.what()).find("RANK='oops'") == std::string::npos) code = 13;
      }
    } catch (...) {
      code = 14;
    }
    _exit(code);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
}

}  // namespace test_environment
