// GlooCommunicator over real processes on loopback (ranks started by loom::spawn).
//
// Inside a spawned rank, a failed check must throw (REQUIRE, or the `expect` helper below): a CHECK
// failure in a child is printed but cannot fail the parent's test; spawn turns a child's exception
// into a SpawnError, which fails the test case in the parent.
//
// Inputs are small integers, exactly representable in every dtype, so results are compared with
// tolerance 0 against closed forms computed here in float64 (nccl-tests' "verifiable" idea).
#include <cmath>
#include <cstdint>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <loom/comm/gloo.hpp>
#include <loom/launch/rendezvous.hpp>
#include <loom/launch/spawn.hpp>

namespace test_gloo {

namespace {

constexpr auto kTestTimeout = std::chrono::seconds(20);

loom::SpawnOptions spawn_opts() {
  return {.timeout = std::chrono::seconds(120)};
}

/// Throws (so that spawn reports it) when `ok` is false.
void expect(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error("check failed: " + what);
}

const std::vector<at::ScalarType> kDtypes = {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf, at::kInt, at::kLong};

/// Rank r's input element i: (r + 1) * (i + 1), negated for odd i.
double input_value(int rank, int i) {
  return (rank + 1) * (i + 1) * (i % 2 == 1 ? -1.0 : 1.0);
}

at::Tensor input_tensor(int rank, at::ScalarType dtype) {
  std::vector<double> v;
  for (int i = 0; i < 6; ++i) v.push_back(input_value(rank, i));
  return torch::tensor(v, torch::kDouble).reshape({2, 3}).to(dtype);
}

/// Closed-form reduction over ranks 0..n-1 of input_value, in float64; avg on integers truncates.
at::Tensor expected_reduction(int n, loom::ReduceOp op, at::ScalarType dtype) {
  std::vector<double> out;
  for (int i = 0; i < 6; ++i) {
    double sum = 0, lo = 1e300, hi = -1e300;
    for (int r = 0; r < n; ++r) {
      double x = input_value(r, i);
      sum += x;
      lo = std::min(lo, x);
      hi = std::max(hi, x);
    }
    double v = 0;
    switch (op) {
      case loom::ReduceOp::sum: v = sum; break;
      case loom::ReduceOp::avg: v = at::isIntegralType(dtype, false) ? std::trunc(sum / n) : sum / n; break;
      case loom::ReduceOp::min: v = lo; break;
      case loom::ReduceOp::max: v = hi; break;
    }
    out.push_back(v);
  }
  return torch::tensor(out, torch::kDouble).reshape({2, 3}).to(dtype);
}

std::string show(const at::Tensor& t) {
  auto d = t.to(torch::kDouble).flatten();
  std::vector<double> v(d.data_ptr<double>(), d.data_ptr<double>() + d.numel());
  return fmt::format("{} [{}]", c10::toString(t.scalar_type()), fmt::join(v, ", "));
}

void check_all_collectives(const loom::Environment& env) {
  loom::GlooCommunicator comm(env, {.timeout = kTestTimeout});
  const int n = comm.world_size();
  expect(n == env.world_size && comm.rank() == env.rank, "rank / world size");
  for (auto dtype : kDtypes) {
    for (auto op : {loom::ReduceOp::sum, loom::ReduceOp::avg, loom::ReduceOp::min, loom::ReduceOp::max}) {
      auto t = input_tensor(comm.rank(), dtype);
      comm.all_reduce(t, op);
      auto want = expected_reduction(n, op, dtype);
      expect(t.scalar_type() == dtype && torch::equal(t, want),
             fmt::format("all_reduce {} {} on rank {}: got {}, want {}", to_string(op), c10::toString(dtype),
                         comm.rank(), show(t), show(want)));
    }
    for (int root = 0; root < n; ++root) {
      auto t = input_tensor(comm.rank(), dtype);
      comm.broadcast(t, root);
      expect(torch::equal(t, input_tensor(root, dtype)),
             fmt::format("broadcast root {} {} on rank {}: got {}", root, c10::toString(dtype), comm.rank(), show(t)));
    }
    auto gathered = comm.all_gather(input_tensor(comm.rank(), dtype));
    expect(static_cast<int>(gathered.size()) == n, "all_gather size");
    for (int r = 0; r < n; ++r)
      expect(gathered[r].scalar_type() == dtype && torch::equal(gathered[r], input_tensor(r, dtype)),
             fmt::format("all_gather {} entry {} on rank {}: got {}", c10::toString(dtype), r, comm.rank(),
                         show(gathered[r])));
  }
  comm.barrier();
}

}  // namespace

TEST_CASE("GlooCommunicator models AsyncCommunicator; its work handle models WorkHandle") {
  static_assert(loom::AsyncCommunicator<loom::GlooCommunicator>);
  static_assert(loom::WorkHandle<loom::GlooWork>);
  static_assert(!(loom::WorkHandle<int>));
  static_assert(!(std::is_copy_constructible_v<loom::GlooCommunicator>));
}

TEST_CASE("GlooCommunicator: 2-rank all_reduce sum of float32 equals the closed form") {
  loom::spawn(
      2,
      [](const loom::Environment& env) {
        loom::GlooCommunicator comm(env, {.timeout = kTestTimeout});
        REQUIRE(comm.rank() == env.rank);
        REQUIRE(comm.world_size() == 2);
        auto t = torch::full({5}, static_cast<float>(env.rank + 1));
        comm.all_reduce(t, loom::ReduceOp::sum);
        REQUIRE(torch::equal(t, torch::full({5}, 3.0f)));
      },
      spawn_opts());
}

TEST_CASE("GlooCommunicator: all_reduce sum/avg/min/max, broadcast from every root, all_gather, every dtype") {
  SUBCASE("2 ranks") {
    loom::spawn(2, check_all_collectives, spawn_opts());
  }
  SUBCASE("3 ranks") {
    loom::spawn(3, check_all_collectives, spawn_opts());
  }
}

TEST_CASE("GlooCommunicator: the expected values are not the identity (the test can fail)") {
  // A 1-rank reduction equals the input; with 2 ranks it must differ, or the test above proves nothing.
  CHECK_FALSE(torch::equal(expected_reduction(2, loom::ReduceOp::sum, at::kFloat), input_tensor(0, at::kFloat)));
  CHECK(torch::equal(expected_reduction(1, loom::ReduceOp::avg, at::kLong), input_tensor(0, at::kLong)));
  // avg of int64 over 2 ranks truncates toward zero: element 1 is (-2 + -4) / 2 = -3, element 0 (1 + 2) / 2 = 1.
  auto avg = expected_reduction(2, loom::ReduceOp::avg, at::kLong).flatten();
  CHECK(avg[0].item<std::int64_t>() == 1);
  CHECK(avg[1].item<std::int64_t>() == -3);
}

TEST_CASE("GlooCommunicator: async all-reduces complete in order and wait() is idempotent") {
  loom::spawn(
      2,
      [](const loom::Environment& env) {
        loom::GlooCommunicator comm(env, {.timeout = kTestTimeout});
        std::vector<at::Tensor> ts;
        std::vector<loom::GlooWork> works;
        for (int k = 0; k < 4; ++k) ts.push_back(torch::full({1000}, static_cast<double>((env.rank + 1) * (k + 1))));
        for (int k = 0; k < 4; ++k)
          works.push_back(comm.all_reduce_async(ts[k], k % 2 == 0 ? loom::ReduceOp::sum : loom::ReduceOp::avg));
        for (int k = 3; k >= 0; --k) works[k].wait();  // any wait order
        for (int k = 0; k < 4; ++k) {
          expect(works[k].is_completed(), "is_completed after wait");
          works[k].wait();
          const double want = k % 2 == 0 ? 3.0 * (k + 1) : 1.5 * (k + 1);
          expect(torch::equal(ts[k], torch::full({1000}, want, torch::kDouble)),
                 fmt::format("async k={} got {}", k, ts[k][0].item<double>()));
        }
        // bfloat16 async: staged through float32, copied back by wait().
        auto b = torch::full({8}, env.rank + 1.0, torch::kBFloat16);
        auto w = comm.all_reduce_async(b, loom::ReduceOp::max);
        w.wait();
        expect(torch::equal(b, torch::full({8}, 2.0, torch::kBFloat16)), "bf16 async max");
        // Copies share one pending state: avg divides once however many copies wait.
        auto a = torch::full({4}, 2.0 * (env.rank + 1));
        auto w1 = comm.all_reduce_async(a, loom::ReduceOp::avg);
        auto w2 = w1;
        w1.wait();
        w2.wait();
        expect(w2.is_completed() && torch::equal(a, torch::full({4}, 3.0)), "avg through two copies of a handle");
        loom::GlooWork empty;
        expect(empty.is_completed(), "an empty handle is complete");
        empty.wait();
      },
      spawn_opts());
}

TEST_CASE("GlooCommunicator: bad tensors and mismatches across ranks are loom errors, not garbage") {
  loom::spawn(
      2,
      [](const loom::Environment& env) {
        loom::GlooCommunicator comm(env, {.timeout = kTestTimeout});
        // Local checks (no collective is started, so the ranks stay in step).
        auto nc = torch::zeros({3, 4}).t();
        REQUIRE_THROWS_WITH_AS(comm.all_reduce(nc, loom::ReduceOp::sum), doctest::Contains("not contiguous"),
                               loom::InvalidArgument);
        auto b = torch::zeros({2}, torch::kBool);
        REQUIRE_THROWS_WITH_AS(comm.broadcast(b, 0), doctest::Contains("unsupported dtype Bool"),
                               loom::InvalidArgument);
        auto ok = torch::zeros({2});
        REQUIRE_THROWS_WITH_AS(comm.broadcast(ok, 2), doctest::Contains("root 2 is outside [0, 2)"),
                               loom::InvalidArgument);

        // dtype mismatch: rank 0 float32, rank 1 float64.
        auto t = env.rank == 0 ? torch::ones({4}, torch::kFloat) : torch::ones({4}, torch::kDouble);
        REQUIRE_THROWS_WITH_AS(
            comm.all_reduce(t, loom::ReduceOp::sum),
            doctest::Contains("rank 0: all_reduce op=sum Float [4]; rank 1: all_reduce op=sum Double [4]"),
            loom::CommError);
        // shape mismatch in all_gather.
        auto s = env.rank == 0 ? torch::ones({2, 3}) : torch::ones({3, 2});
        REQUIRE_THROWS_WITH_AS(comm.all_gather(s),
                               doctest::Contains("rank 0: all_gather Float [2x3]; rank 1: all_gather Float [3x2]"),
                               loom::CommError);
        // different roots, different ops.
        auto r = torch::ones({2});
        REQUIRE_THROWS_WITH_AS(comm.broadcast(r, env.rank),
                               doctest::Contains("root=0 Float [2]; rank 1: broadcast root=1"), loom::CommError);
        REQUIRE_THROWS_WITH_AS(comm.all_reduce(r, env.rank == 0 ? loom::ReduceOp::min : loom::ReduceOp::max),
                               doctest::Contains("op=min"), loom::CommError);
        // different collectives.
        if (env.rank == 0) {
          REQUIRE_THROWS_WITH_AS(comm.all_reduce(r, loom::ReduceOp::sum), doctest::Contains("rank 1: broadcast root=0"),
                                 loom::CommError);
        } else {
          REQUIRE_THROWS_AS(comm.broadcast(r, 0), loom::CommError);
        }
        // The check is itself a clean collective: the communicator still works afterwards.
        auto u = torch::full({3}, env.rank + 1.0);
        comm.all_reduce(u, loom::ReduceOp::sum);
        expect(torch::equal(u, torch::full({3}, 3.0)), "all_reduce after mismatch errors");
      },
      spawn_opts());
}

TEST_CASE(
    "GlooCommunicator: a rank that exits before a collective gives the others a CommError (not a timeout) naming it, "
    "and spawn names it") {
  const auto timeout = std::chrono::seconds(3);
  bool threw = false;
  try {
    loom::spawn(3,
                [timeout](const loom::Environment& env) {
                  loom::GlooCommunicator comm(env, {.timeout = timeout});
                  if (env.rank == 1) std::_Exit(3);  // dies before the collective
                  auto t = torch::ones({1024});
                  const auto start = std::chrono::steady_clock::now();
                  try {
                    comm.all_reduce(t, loom::ReduceOp::sum);
                  } catch (const loom::CommError& e) {
                    const double waited =
                        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
                    const std::string what = e.what();
                    expect(dynamic_cast<const loom::TimeoutError*>(&e) == nullptr,
                           "a closed peer is a CommError, not a TimeoutError: " + what);
                    expect(what.starts_with(fmt::format("loom: all_reduce failed on rank {}: peer rank ", env.rank)) &&
                               what.find("closed its connection") != std::string::npos,
                           "the CommError names collective, rank and the peer that closed its connection: " + what);
                    expect(waited <= 3.0 + 2.0, fmt::format("CommError within the timeout (waited {:.3f} s)", waited));
                    throw;  // reported by spawn
                  }
                  throw std::runtime_error("all_reduce returned although rank 1 is dead");
                },
                {.timeout = std::chrono::seconds(60), .grace = std::chrono::seconds(10)});
  } catch (const loom::SpawnError& e) {
    threw = true;
    MESSAGE(std::string(e.what()));
    REQUIRE(e.failed_rank() == 1);
    CHECK(e.failures().front().kind == loom::RankFailure::Kind::exit_code);
    CHECK(e.failures().front().code == 3);
    CHECK(std::string(e.what()).find("rank 1 exited with code 3") != std::string::npos);
    REQUIRE(e.failures().size() == 3);
    for (std::size_t i = 1; i < 3; ++i) {
      CHECK(e.failures()[i].kind == loom::RankFailure::Kind::exception);
      CHECK(e.failures()[i].message.find("loom::CommError: loom: all_reduce failed on rank") != std::string::npos);
    }
  }
  CHECK(threw);
}

TEST_CASE("GlooCommunicator: a peer that never calls the collective: TimeoutError from wait() after the timeout") {
  bool threw = false;
  try {
    loom::spawn(2,
                [](const loom::Environment& env) {
                  loom::GlooCommunicator comm(env, {.timeout = std::chrono::seconds(2)});
                  if (env.rank == 1) {
                    std::this_thread::sleep_for(std::chrono::seconds(6));  // alive, but never joins
                    return;
                  }
                  auto t = torch::ones({16});
                  auto w = comm.all_reduce_async(t, loom::ReduceOp::sum);  // async: the timeout surfaces in wait()
                  try {
                    w.wait();
                  } catch (const loom::TimeoutError&) {
                    w.wait();  // a failed handle rethrows the same TimeoutError on every wait
                    throw std::runtime_error("the second wait() returned normally");
                  }
                },
                {.timeout = std::chrono::seconds(60), .grace = std::chrono::seconds(10)});
  } catch (const loom::SpawnError& e) {
    threw = true;
    MESSAGE(std::string(e.what()));
    REQUIRE(e.failed_rank() == 0);
    CHECK(e.failures().size() == 1);
    CHECK(e.failures().front().message.find("all_reduce timed out on rank 0 after 2.") != std::string::npos);
  }
  CHECK(threw);
}

TEST_CASE("GlooCommunicator: metadata check off (hot path) still reduces correctly") {
  loom::spawn(
      2,
      [](const loom::Environment& env) {
        loom::GlooCommunicator comm(env, {.timeout = kTestTimeout, .check_metadata = false});
        for (auto dtype : kDtypes) {
          auto t = input_tensor(env.rank, dtype);
          comm.all_reduce(t, loom::ReduceOp::sum);
          expect(torch::equal(t, expected_reduction(2, loom::ReduceOp::sum, dtype)), c10::toString(dtype));
        }
      },
      spawn_opts());
}

TEST_CASE("GlooCommunicator: two communicators on one store, constructed from a store") {
  loom::spawn(
      2,
      [](const loom::Environment& env) {
        auto store = loom::rendezvous(env, {.timeout = kTestTimeout});
        loom::GlooCommunicator a(store, env.rank, env.world_size, {.timeout = kTestTimeout});
        loom::GlooCommunicator b(store, env.rank, env.world_size, {.timeout = kTestTimeout});
        auto x = torch::full({2}, env.rank + 1.0);
        auto y = torch::full({2}, 10.0 * (env.rank + 1));
        b.all_reduce(y, loom::ReduceOp::sum);
        a.all_reduce(x, loom::ReduceOp::max);
        expect(torch::equal(x, torch::full({2}, 2.0)) && torch::equal(y, torch::full({2}, 30.0)), "two communicators");
      },
      spawn_opts());
  CHECK_THROWS_AS(loom::GlooCommunicator(c10::intrusive_ptr<c10d::Store>(), 0, 1), loom::InvalidArgument);
}

TEST_CASE("GlooCommunicator under torchrun's agent store: every rank is a client under /worker/attempt_<n>") {
  // torchrun's agent is a process of its own that hosts the TCPStore; the ranks must not try to
  // host it. Here a forked child plays it: a store served by a thread of this test process would be
  // copied into every rank loom::spawn forks, in whatever state that thread was (under
  // AddressSanitizer the ranks then hung at the rendezvous about 1 run in 5).
  int port_pipe[2], stop_pipe[2];
  REQUIRE(::pipe(port_pipe) == 0);
  REQUIRE(::pipe(stop_pipe) == 0);
  const pid_t agent_pid = ::fork();
  REQUIRE(agent_pid >= 0);
  if (agent_pid == 0) {
    ::close(port_pipe[0]);
    ::close(stop_pipe[1]);  // else the read below never sees the end of file
    int code = 0;
    try {
      c10d::TCPStoreOptions opts;
      opts.port = 0;  // any free port
      opts.isServer = true;
      opts.waitWorkers = false;
      opts.timeout = std::chrono::seconds(60);
      auto store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", opts);
      const std::uint16_t port = store->getPort();
      code = ::write(port_pipe[1], &port, sizeof port) == sizeof port ? 0 : 3;
      char c = 0;
      (void)::read(stop_pipe[0], &c, 1);  // serve until the test is done (or gone: end of file)
    } catch (...) {
      code = 2;
    }
    ::_exit(code);
  }
  ::close(port_pipe[1]);
  ::close(stop_pipe[0]);
  std::uint16_t port = 0;
  const bool got_port = ::read(port_pipe[0], &port, sizeof port) == sizeof port;
  ::close(port_pipe[0]);
  auto stop_agent = [&] {
    ::close(stop_pipe[1]);
    int status = 0;
    ::waitpid(agent_pid, &status, 0);
    return status;
  };
  if (!got_port || port == 0) {
    stop_agent();
    FAIL("the agent process could not host a store");
  }
  try {
    loom::spawn(2,
                [](const loom::Environment& env) {
                  expect(env.use_agent_store && env.restart_count == 2, "agent store variables read");
                  loom::GlooCommunicator comm(env, {.timeout = kTestTimeout});
                  auto t = torch::full({3}, env.rank + 1.0);
                  comm.all_reduce(t, loom::ReduceOp::sum);
                  expect(torch::equal(t, torch::full({3}, 3.0)), "all_reduce through the agent store");
                },
                {.timeout = std::chrono::seconds(60),
                 .env = {{"TORCHELASTIC_USE_AGENT_STORE", "True"},
                         {"TORCHELASTIC_RESTART_COUNT", "2"},
                         {"MASTER_PORT", std::to_string(port)},
                         {"LOOM_RENDEZVOUS_SECRET", "0123abcd"}}});
    // Both ranks checked in under torchrun's prefix and the job's secret (generation 0: the first
    // rendezvous of each child), and nowhere else. Read through a client, as a rank would.
    c10d::TCPStoreOptions opts;
    opts.port = port;
    opts.isServer = false;
    opts.timeout = std::chrono::seconds(30);
    auto agent = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", opts);
    CHECK(agent->add("/worker/attempt_2/loom/job/0123abcd/loom/rdzv/0/arrived", 0) == 2);
    CHECK(agent->add("/worker/attempt_2/loom/rdzv/0/arrived", 0) == 0);
    CHECK(agent->add("loom/rdzv/0/arrived", 0) == 0);
  } catch (...) {
    stop_agent();
    throw;
  }
  const int status = stop_agent();
  CHECK((WIFEXITED(status) && WEXITSTATUS(status) == 0));
}

TEST_CASE("GlooCommunicator for one process: no port is opened, collectives are the identity") {
  loom::spawn(
      1,
      [](int) {
        loom::GlooCommunicator comm(loom::Environment{}, {.timeout = kTestTimeout});  // rank 0 of 1, HashStore
        auto t = torch::tensor({1.5, -2.0});
        comm.all_reduce(t, loom::ReduceOp::avg);
        expect(torch::equal(t, torch::tensor({1.5, -2.0})), "identity all_reduce");
        auto g = comm.all_gather(t);
        expect(g.size() == 1 && torch::equal(g[0], t), "identity all_gather");
        comm.barrier();
      },
      spawn_opts());
}

}  // namespace test_gloo
