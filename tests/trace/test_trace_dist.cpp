// The flight recorder on real ranks (3 processes, Gloo on loopback): one fault injected per case
// into rank 2 of a reducer loop; each must end the job within one step (well before the timeout,
// except the stall, which only a timeout can reveal), with an error on the other ranks that names
// rank 2 and the step, and a record file from every rank that loom::trace::read_folder reads.
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include <doctest/doctest.h>
#include <fmt/format.h>
#include <torch/torch.h>

#include <loom/accumulate/accumulator.hpp>
#include <loom/comm/gloo.hpp>
#include <loom/compat.hpp>
#include <loom/launch/spawn.hpp>
#include <loom/reduce/module.hpp>
#include <loom/reduce/reducer.hpp>
#include <loom/trace/all.hpp>

#include "support/models.hpp"
#include "support/temp_dir.hpp"

namespace test_trace_dist {

namespace fs = std::filesystem;
using loom::trace::Context;

namespace {

/// A GlooCommunicator that leaves out the async all-reduces `skip` picks (a rank that skips a
/// bucket); everything else goes through, recorded by the inner communicator's flight recorder.
struct SkippingComm {
  loom::GlooCommunicator* inner = nullptr;
  std::function<bool()> skip;

  [[nodiscard]] int rank() const { return inner->rank(); }
  [[nodiscard]] int world_size() const { return inner->world_size(); }
  [[nodiscard]] std::chrono::milliseconds timeout() const { return inner->timeout(); }
  [[nodiscard]] c10::Device device() const { return inner->device(); }
  void all_reduce(at::Tensor& t, loom::ReduceOp op) { inner->all_reduce(t, op); }
  loom::GlooWork all_reduce_async(at::Tensor& t, loom::ReduceOp op) {
    if (skip && skip()) return {};
    return inner->all_reduce_async(t, op);
  }
  void broadcast(at::Tensor& t, int root) { inner->broadcast(t, root); }
  [[nodiscard]] std::vector<at::Tensor> all_gather(const at::Tensor& t) { return inner->all_gather(t); }
  void barrier() { inner->barrier(); }
  [[nodiscard]] loom::trace::FlightRecorder* flight_recorder() const { return inner->flight_recorder(); }
};
static_assert(loom::AsyncCommunicator<SkippingComm>);

constexpr int kWorld = 3;
constexpr int kFaultStep = 3;

/// What one rank saw: its error (empty: none) and the seconds from the start of the fault step to it.
struct Seen {
  std::string error;
  double seconds = -1;
};

/// Runs 6 steps of a 3-layer model under a reducer with 3 buckets on 3 ranks; `fault(comm, step)`
/// runs on every rank before each step's backward (and may sleep, issue collectives or set
/// comm.skip). Returns what each rank saw; the records go to `folder`. `rank2_may_die`: rank 2 may
/// end by a signal (Gloo aborts a process whose collective receives a message larger than its
/// buffer); the others must still fail with the verdict within the grace.
std::vector<Seen> run_job(const fs::path& folder, std::chrono::milliseconds timeout,
                          const std::function<void(SkippingComm&, int)>& fault, bool rank2_may_die = false) {
  auto rank_fn = [&](const loom::Environment& env) {
    loom::GlooCommunicator gloo(env, {.timeout = timeout, .trace_folder = folder.string()});
    SkippingComm comm{&gloo, {}};
    torch::manual_seed(3);
    auto net = torch::nn::Sequential(torch::nn::Linear(3, 64), torch::nn::ReLU(), torch::nn::Linear(64, 64),
                                     torch::nn::ReLU(), torch::nn::Linear(64, 1));
    loom::Reducer reducer(comm, loom::parameters_of(*net), {.bucket_cap_bytes = 8192, .first_bucket_cap_bytes = 1024});
    loom::Accumulator acc(reducer, {.micro_batches_per_step = 1});
    torch::optim::SGD sgd(net->parameters(), 0.01);
    Seen seen;
    auto fault_start = std::chrono::steady_clock::now();
    try {
      for (int step = 0; step < 6; ++step) {
        if (step == kFaultStep) fault_start = std::chrono::steady_clock::now();
        loom::trace::set_position(comm, step, 0, /*check_step=*/true);
        fault(comm, step);
        auto x = loom::test::batch_x(4 * step + 16 * comm.rank(), 4).to(torch::kFloat);
        auto r = acc.run(4, [&] { net->forward(x).sum().backward(); });
        if (r.apply) sgd.step();
        loom::zero_grad(sgd, loom::GradReset::zero);
      }
    } catch (const loom::CommError& e) {
      seen.error = e.what();
      seen.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - fault_start).count();
    }
    loom::test::write_file(folder / fmt::format("seen-{}.txt", comm.rank()),
                           fmt::format("{}\n{}", seen.seconds, seen.error));
  };
  try {
    loom::spawn(kWorld, rank_fn, {.timeout = std::chrono::seconds(180), .grace = std::chrono::seconds(20)});
  } catch (const loom::SpawnError& e) {
    if (!rank2_may_die) throw;
    INFO(e.what());
    CHECK(std::string(e.what()).find("rank 2 was killed by signal SIGABRT") != std::string::npos);
  }
  std::vector<Seen> out;
  for (int r = 0; r < kWorld; ++r) {
    const auto file = folder / fmt::format("seen-{}.txt", r);
    if (!fs::exists(file)) {
      out.push_back({});
      continue;
    }
    const std::string text = loom::test::read_file(file);
    const auto nl = text.find('\n');
    out.push_back({text.substr(nl + 1), std::stod(text.substr(0, nl))});
  }
  return out;
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

/// The checks every fault shares: ranks 0 and 1 failed within `within` seconds of the fault step's
/// start with an error naming rank 2 and containing `names`; every rank wrote its record, and the
/// verdict from the files blames rank 2 alone.
void check_job(const fs::path& folder, const std::vector<Seen>& seen, double within,
               const std::vector<std::string>& names) {
  for (int r = 0; r < 2; ++r) {
    INFO("rank ", r, ": ", seen[static_cast<std::size_t>(r)].error);
    REQUIRE_FALSE(seen[static_cast<std::size_t>(r)].error.empty());
    CHECK(seen[static_cast<std::size_t>(r)].seconds >= 0);
    CHECK(seen[static_cast<std::size_t>(r)].seconds < within);
    for (const auto& n : names) CHECK(contains(seen[static_cast<std::size_t>(r)].error, n));
    CHECK(contains(seen[static_cast<std::size_t>(r)].error, "read them with: loom-trace"));
  }
  const auto records = loom::trace::read_folder(folder);
  REQUIRE(records.size() == kWorld);
  for (int r = 0; r < kWorld; ++r) {
    CHECK(records[static_cast<std::size_t>(r)].rank == r);
    CHECK_FALSE(records[static_cast<std::size_t>(r)].entries.empty());
  }
  const auto v = loom::trace::first_divergence(records, kWorld);
  INFO(v.text);
  CHECK(v.diverged);
  CHECK(v.ranks == std::vector<int>{2});
}

}  // namespace

TEST_SUITE("dist") {
  TEST_CASE("flight recorder: rank 2 skips bucket 0's all-reduce at step 3") {
    loom::test::TempDir dir;
    const auto seen = run_job(
        dir.path, std::chrono::seconds(60),
        [](SkippingComm& comm, int step) {
          if (comm.rank() != 2 || step != kFaultStep) return;
          comm.skip = [&comm] {
            const auto [context, index] = comm.flight_recorder()->context();
            return context == Context::reducer_bucket && index == 0 && comm.flight_recorder()->step() == kFaultStep;
          };
        },
        /*rank2_may_die=*/true);
    check_job(dir.path, seen, 20.0,
              {"rank 2 issued all_reduce", "(reducer bucket 1, step 3", "ranks 0, 1 issued all_reduce",
               "(reducer bucket 0, step 3"});
    // Gloo ends rank 2 (the all-reduce it issued instead received a larger message); its record
    // comes from loom's terminate handler.
    const auto records = loom::trace::read_folder(dir.path);
    REQUIRE(records.size() == kWorld);
    CHECK(contains(records[2].reason, "std::terminate"));
  }

  TEST_CASE("flight recorder: rank 2 issues one collective more at step 3") {
    loom::test::TempDir dir;
    const auto seen = run_job(
        dir.path, std::chrono::seconds(60),
        [](SkippingComm& comm, int step) {
          if (comm.rank() != 2 || step != kFaultStep) return;
          auto t = torch::ones({4});
          comm.all_reduce(t, loom::ReduceOp::sum);
        },
        /*rank2_may_die=*/true);
    // Its all-reduce of 4 elements meets the others' first bucket (which carries the window meta).
    check_job(dir.path, seen, 20.0,
              {"rank 2 issued all_reduce", "(user, step 3", "Float x 4)", "ranks 0, 1 issued all_reduce",
               "(reducer bucket 0, step 3"});
  }

  TEST_CASE("flight recorder: the ranks' tensors differ in shape (user code, step 3)") {
    loom::test::TempDir dir;
    const auto seen = run_job(dir.path, std::chrono::seconds(60), [](SkippingComm& comm, int step) {
      if (step != kFaultStep) return;
      auto t = torch::ones({comm.rank() == 2 ? 5 : 4});
      comm.all_reduce(t, loom::ReduceOp::sum);
    });
    check_job(dir.path, seen, 20.0,
              {"rank 2 issued all_reduce", "Float x 5", "ranks 0, 1 issued all_reduce", "Float x 4", "step 3"});
  }

  TEST_CASE("flight recorder: rank 2 takes another branch of user code (a broadcast, not an all-reduce)") {
    loom::test::TempDir dir;
    const auto seen = run_job(dir.path, std::chrono::seconds(60), [](SkippingComm& comm, int step) {
      if (step != kFaultStep) return;
      auto t = torch::ones({4});
      if (comm.rank() == 2)
        comm.broadcast(t, 0);
      else
        comm.all_reduce(t, loom::ReduceOp::sum);
    });
    check_job(dir.path, seen, 20.0, {"rank 2 issued broadcast", "ranks 0, 1 issued all_reduce", "step 3"});
  }

  TEST_CASE("flight recorder: rank 2 counts its steps one ahead (found by the fingerprint in the next window)") {
    loom::test::TempDir dir;
    const auto seen = run_job(dir.path, std::chrono::seconds(60), [](SkippingComm& comm, int step) {
      if (comm.rank() == 2 && step >= kFaultStep) loom::trace::set_position(comm, step + 1, 0, /*check_step=*/true);
    });
    check_job(dir.path, seen, 20.0,
              {"fingerprints differ", "rank 2 issued all_reduce", "(reducer bucket 0, step 4",
               "ranks 0, 1 issued all_reduce", "(reducer bucket 0, step 3"});
    // Every rank found it in the same window.
    CHECK(contains(seen[2].error, "fingerprints differ"));
  }

  TEST_CASE("flight recorder: rank 2 stalls outside any collective (a stuck fetch): named at the timeout") {
    loom::test::TempDir dir;
    // An 8 s timeout: the others collect records for an eighth of it (1 s), ample for rank 2's
    // watcher thread to answer while its main thread sleeps.
    const auto seen = run_job(dir.path, std::chrono::seconds(8), [](SkippingComm& comm, int step) {
      if (comm.rank() == 2 && step == kFaultStep) std::this_thread::sleep_for(std::chrono::seconds(12));
    });
    check_job(dir.path, seen, 14.0,
              {"timed out", "rank 2 did not issue", "it was not in a collective", "at step 2",
               "ranks 0, 1 issued all_reduce", "(reducer bucket 0, step 3"});
  }
}

}  // namespace test_trace_dist
