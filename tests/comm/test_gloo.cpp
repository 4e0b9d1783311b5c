// GlooCommunicator over real processes on loopback (ranks started by loom::spawn).
// Inside a spawned rank, failures must throw (REQUIRE or loom errors): a CHECK failure in a child is
// printed but cannot fail the parent's test; spawn turns a child's exception into a SpawnError.
#include <loom/comm/gloo.hpp>
#include <loom/dist/spawn.hpp>

namespace {
constexpr auto kTestTimeout = std::chrono::seconds(20);
loom::SpawnOptions spawn_opts() { return {.timeout = std::chrono::seconds(120)}; }
}  // namespace

TEST_CASE("GlooCommunicator: 2-rank all_reduce sum of float32 equals the closed form") {
  loom::spawn(2, [](const loom::Environment& env) {
    loom::GlooCommunicator comm(env, {.timeout = kTestTimeout});
    REQUIRE(comm.rank() == env.rank);
    REQUIRE(comm.world_size() == 2);
    auto t = torch::full({5}, static_cast<float>(env.rank + 1));
    comm.all_reduce(t, loom::ReduceOp::sum);
    REQUIRE(torch::equal(t, torch::full({5}, 3.0f)));
  }, spawn_opts());
}
