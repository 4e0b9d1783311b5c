// GlooCommunicator's construction: which network device it uses (GlooOptions::interface,
// GLOO_SOCKET_IFNAME, loopback masters) and what the other ranks see when one rank fails to join
// (they stop waiting at once and name it). The rule's multi-host branch (the local address that
// routes to MASTER_ADDR) needs a second host: tests/dist/test_two_hosts.cpp.
#include <cstdlib>

#include <loom/comm/gloo.hpp>
#include <loom/launch/spawn.hpp>

namespace test_gloo_join {

namespace {

using Kind = loom::detail::GlooDeviceChoice::Kind;

/// Throws (so that spawn reports it) when `ok` is false.
void expect(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error("check failed: " + what);
}

/// Runs `nprocs` ranks; rank `failing` constructs with a network interface this host does not have.
/// Returns spawn's failures (every rank fails: the bad one with its ConfigError, the others with
/// what they saw).
std::vector<loom::RankFailure> one_rank_fails_to_join(int nprocs, int failing) {
  try {
    loom::spawn(nprocs,
                [failing](const loom::Environment& env) {
                  // The others would wait 60 s for the missing rank if nobody told them.
                  loom::GlooOptions options{.timeout = std::chrono::seconds(60)};
                  if (env.rank == failing) options.interface = "loomnoif0";
                  loom::GlooCommunicator comm(env, options);
                  comm.barrier();
                },
                {.timeout = std::chrono::seconds(50), .grace = std::chrono::seconds(30)});
  } catch (const loom::SpawnError& e) {
    MESSAGE(std::string(e.what()));
    return e.failures();
  }
  FAIL("spawn did not throw");
  return {};
}

}  // namespace

TEST_CASE("Gloo device rule: option, GLOO_SOCKET_IFNAME, loopback master, host name resolving to loopback") {
  using loom::detail::gloo_device_rule;
  // gloo_device_rule(option_set, env_set, master_is_loopback, host_name_is_loopback)
  CHECK(gloo_device_rule(true, false, false, false) == Kind::interfaces);
  CHECK(gloo_device_rule(false, true, true, true) == Kind::interfaces);
  CHECK(gloo_device_rule(false, false, true, true) == Kind::loopback);
  CHECK(gloo_device_rule(false, false, false, true) == Kind::route_to_master);
  CHECK(gloo_device_rule(false, false, false, false) == Kind::host_name);

  using loom::detail::split_interface_list;
  CHECK(split_interface_list("eth0") == std::vector<std::string>{"eth0"});
  CHECK(split_interface_list(" eth0 , ib0,,") == std::vector<std::string>{"eth0", "ib0"});
  CHECK(split_interface_list(" , ").empty());
}

TEST_CASE("Gloo device choice on this host: loopback masters keep loopback; named interfaces are checked") {
  using loom::detail::choose_gloo_device;
  for (const char* master : {"127.0.0.1", "localhost", "127.0.1.1"}) {
    CAPTURE(master);
    const auto c = choose_gloo_device("", nullptr, master);
    CHECK(c.kind == Kind::loopback);
    CHECK(c.address == "127.0.0.1");
  }
  // GlooOptions::interface wins over GLOO_SOCKET_IFNAME, which wins over the master address.
  auto c = choose_gloo_device("lo", "loomnoif0", "127.0.0.1");
  CHECK(c.kind == Kind::interfaces);
  CHECK(c.source == "GlooOptions::interface");
  CHECK(c.interfaces == std::vector<std::string>{"lo"});
  c = choose_gloo_device("", "lo,lo", "127.0.0.1");
  CHECK(c.kind == Kind::interfaces);
  CHECK(c.source == "GLOO_SOCKET_IFNAME");
  CHECK(c.interfaces == std::vector<std::string>{"lo", "lo"});
  CHECK(c.describe().find("GLOO_SOCKET_IFNAME='lo,lo'") != std::string::npos);
  CHECK(choose_gloo_device("", "", "127.0.0.1").kind == Kind::loopback);  // empty variable: unset
  // A missing interface is a ConfigError naming it, its source and the interfaces there are.
  CHECK_THROWS_WITH_AS(choose_gloo_device("", "lo,loomnoif0", "127.0.0.1"),
                       doctest::Contains("GLOO_SOCKET_IFNAME='lo,loomnoif0': host"), loom::ConfigError);
  CHECK_THROWS_WITH_AS(choose_gloo_device("loomnoif0", nullptr, "127.0.0.1"),
                       doctest::Contains("has no network interface 'loomnoif0' with an address (its interfaces: "),
                       loom::ConfigError);
}

TEST_CASE("GlooCommunicator honours GLOO_SOCKET_IFNAME, a comma-separated list included") {
  for (const char* ifname : {"lo", "lo,lo"}) {
    CAPTURE(ifname);
    loom::spawn(
        2,
        [ifname](const loom::Environment& env) {
          loom::GlooCommunicator comm(env, {.timeout = std::chrono::seconds(20)});
          expect(comm.device_description().find(fmt::format("GLOO_SOCKET_IFNAME='{}'", ifname)) != std::string::npos,
                 "device from GLOO_SOCKET_IFNAME: " + comm.device_description());
          // Several all-reduces, so that with two devices both of Gloo's contexts carry one.
          for (int k = 0; k < 4; ++k) {
            auto t = torch::full({64}, static_cast<double>(env.rank + 1 + k), torch::kDouble);
            comm.all_reduce(t, loom::ReduceOp::sum);
            expect(torch::equal(t, torch::full({64}, 3.0 + 2 * k, torch::kDouble)), fmt::format("all_reduce {}", k));
          }
        },
        {.timeout = std::chrono::seconds(60), .env = {{"GLOO_SOCKET_IFNAME", ifname}}});
  }
  // Without it, a loopback master keeps loopback.
  loom::spawn(1,
              [](const loom::Environment& env0) {
                loom::Environment env = env0;
                env.world_size = 1;
                loom::GlooCommunicator comm(env, {.timeout = std::chrono::seconds(20)});
                expect(
                    comm.device_description().rfind("127.0.0.1 (MASTER_ADDR '127.0.0.1' is a loopback address", 0) == 0,
                    comm.device_description());
              },
              {.env = {{"GLOO_SOCKET_IFNAME", ""}}});
}

TEST_CASE("GlooCommunicator: when one rank fails to join, the others stop waiting at once and name it") {
  // Event-based: "stopped waiting ... because rank r failed to join" is only said when the failure
  // report arrived; a rank that waited for its 60 s timeout would throw a TimeoutError("connect").
  for (auto [nprocs, failing] : {std::pair{2, 1}, std::pair{2, 0}, std::pair{3, 2}}) {
    CAPTURE(nprocs);
    CAPTURE(failing);
    auto f = one_rank_fails_to_join(nprocs, failing);
    REQUIRE(f.size() == static_cast<std::size_t>(nprocs));
    for (const auto& r : f) {
      INFO(r.describe());
      REQUIRE(r.kind == loom::RankFailure::Kind::exception);
      if (r.rank == failing) {
        CHECK(r.message.find("loom::ConfigError: loom: GlooOptions::interface='loomnoif0'") == 0);
      } else {
        CHECK(r.message.find(fmt::format("loom::CommError: loom: GlooCommunicator: rank {}/{} stopped waiting for its "
                                         "peers after",
                                         r.rank, nprocs)) == 0);
        CHECK(r.message.find(fmt::format("because rank {} (", failing)) != std::string::npos);
        CHECK(r.message.find("failed to join: loom: GlooOptions::interface='loomnoif0'") != std::string::npos);
      }
    }
  }
}

}  // namespace test_gloo_join
