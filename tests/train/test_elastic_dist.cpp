// World-size invariance on real ranks (Gloo on loopback): the same float64 training trajectory on
// 1, 2 and 3 ranks, and a run checkpointed on W ranks and resumed on W' equal to the uninterrupted
// one, with every sample used exactly once.
//
// The data: 37 sequences of lengths 2, 3 or 5 (3 features each) with 2 targets, closed forms of
// the index (tests/support/models.hpp's sample_x / sample_y, varied along the sequence); the model:
// the 2-layer MLP of tests/support/models.hpp applied to each sequence's mean. Plan: exact-shape
// buckets of at most 3 samples, 2 batches per optimizer step (the epoch's last step is partial),
// SGD with momentum (its state carries across steps, so the order of steps matters).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <doctest/doctest.h>
#include <fmt/format.h>
#include <torch/torch.h>

#include <loom/accumulate/accumulator.hpp>
#include <loom/comm/gloo.hpp>
#include <loom/compat.hpp>
#include <loom/reduce/reducer.hpp>
#include <loom/sample/global_batch.hpp>

#include "support/models.hpp"
#include "support/ranks.hpp"
#include "support/temp_dir.hpp"

namespace test_elastic_dist {

namespace fs = std::filesystem;

namespace {

constexpr int64_t kSamples = 37;

std::pair<at::Tensor, at::Tensor> sample(int64_t i) {
  return loom::test::sequence_sample(i);
}

std::vector<std::vector<int64_t>> shapes() {
  return loom::test::sequence_shapes(kSamples);
}

const loom::GlobalBatchOptions kPlan{.seed = 17, .max_samples = 3, .batches_per_step = 2};

using loom::test::read_file;
using loom::test::TempDir;
using loom::test::write_file;

std::string to_text(const std::vector<at::Tensor>& ts) {
  std::string out;
  for (const auto& t : ts) {
    auto c = t.detach().to(torch::kDouble).contiguous();
    for (int64_t k = 0; k < c.numel(); ++k) out += fmt::format("{:.17g}\n", c.data_ptr<double>()[k]);
  }
  return out;
}

std::vector<double> parse(const std::string& text) {
  std::vector<double> v;
  std::istringstream in(text);
  double x;
  while (in >> x) v.push_back(x);
  return v;
}

double max_relative(const std::vector<double>& a, const std::vector<double>& b) {
  REQUIRE(a.size() == b.size());
  REQUIRE_FALSE(a.empty());
  double num = 0, den = 0;
  for (std::size_t k = 0; k < a.size(); ++k) {
    num = std::max(num, std::abs(a[k] - b[k]));
    den = std::max(den, std::abs(b[k]));
  }
  return num / den;
}

/// What one rank does: trains `steps` optimizer steps from `dir/checkpoint` (or from the initial
/// weights), then rank 0 writes the parameters, the momentum buffers and the cursor. Every rank
/// appends the sample indices it trained on to `dir/uses.<rank>`.
void train(loom::GlooCommunicator& comm, const fs::path& dir, int steps, const std::string& tag,
           const loom::GlobalBatchOptions& plan = kPlan) {
  loom::test::Mlp model(at::kDouble);
  torch::optim::SGD sgd(model.params, torch::optim::SGDOptions(0.05).momentum(0.9));
  loom::GlobalBatchSampler sampler(comm, shapes(), plan);
  if (fs::exists(dir / "checkpoint.cursor")) {
    const auto saved = parse(read_file(dir / "checkpoint.params"));
    std::size_t k = 0;
    torch::NoGradGuard no_grad;
    for (auto& p : model.params)
      for (int64_t j = 0; j < p.numel(); ++j) p.view({-1})[j] = saved.at(k++);
    torch::load(sgd, (dir / "checkpoint.sgd").string());
    sampler.resume(loom::parse_global_cursor(read_file(dir / "checkpoint.cursor")));
  }
  loom::Reducer reducer(comm, model.list());
  loom::Accumulator acc(reducer, {.micro_batches_per_step = 0});  // steps come from the plan
  std::ofstream uses(dir / fmt::format("uses.{}.{}", tag, comm.rank()));
  int done = 0;
  while (done < steps) {
    auto item = sampler.next();
    if (!item) {
      sampler.set_epoch(sampler.epoch() + 1);
      continue;
    }
    loom::SyncResult step;
    if (item->idle) {
      step = acc.join_step();
    } else {
      std::vector<at::Tensor> xs, ys;
      for (int64_t i : item->indices) {
        auto [x, y] = sample(i);
        xs.push_back(x);
        ys.push_back(y);
        uses << i << "\n";
      }
      auto x = torch::stack(xs).mean(1);  // N x kIn
      auto y = torch::stack(ys);
      auto mb = acc.micro_batch(static_cast<int64_t>(xs.size()), item->step_end);
      model.loss_sum(x, y).backward();
      step = mb.finish();
    }
    if (!step.boundary) continue;
    if (!step.apply) throw std::runtime_error("a step was not applied");
    sgd.step();
    loom::zero_grad(sgd, loom::GradReset::zero);
    ++done;
  }
  if (comm.rank() == 0) {
    write_file(dir / fmt::format("params.{}", tag), to_text(model.params));
    write_file(dir / "checkpoint.params", to_text(model.params));
    torch::save(sgd, (dir / "checkpoint.sgd").string());
    write_file(dir / "checkpoint.cursor", loom::to_string(sampler.cursor()));
  }
}

void run(int world, const fs::path& dir, int steps, const std::string& tag,
         const loom::GlobalBatchOptions& plan = kPlan) {
  loom::test::run_ranks(world, [&](loom::GlooCommunicator& comm) { train(comm, dir, steps, tag, plan); },
                        {.comm_timeout = std::chrono::seconds(30), .spawn_timeout = std::chrono::seconds(120)});
}

std::map<int64_t, int> count_uses(const fs::path& dir, const std::string& tag) {
  std::map<int64_t, int> uses;
  for (const auto& e : fs::directory_iterator(dir)) {
    const auto name = e.path().filename().string();
    if (name.rfind("uses." + tag + ".", 0) != 0) continue;
    for (double i : parse(read_file(e.path()))) ++uses[static_cast<int64_t>(i)];
  }
  return uses;
}

}  // namespace

TEST_SUITE("dist") {
  int epoch_steps() {
    return static_cast<int>(loom::plan_epoch(shapes(), kPlan, 0).steps.size());
  }

  TEST_CASE("the plan: more than 6 steps per epoch, a partial last step (the cases below need both)") {
    const auto plan = loom::plan_epoch(shapes(), kPlan, 0);
    REQUIRE(plan.steps.size() > 6);
    CHECK(plan.steps.back().num_batches == 1);
  }

  TEST_CASE(
      "trajectory: an epoch and 2 steps (its partial last step included) on 1, 2 and 3 ranks end equal (float64, "
      "1e-12)") {
    std::map<int, std::vector<double>> params;
    const int steps = epoch_steps() + 2;
    for (int w : {1, 2, 3}) {
      TempDir dir("loom-elastic");
      run(w, dir.path, steps, "run");
      params[w] = parse(read_file(dir.path / "params.run"));
      // Every sample once in epoch 0, a few twice (the 2 steps of epoch 1).
      const auto uses = count_uses(dir.path, "run");
      CHECK(static_cast<int64_t>(uses.size()) == kSamples);
      for (const auto& [i, k] : uses) CHECK((k == 1 || k == 2));
    }
    const double e2 = max_relative(params[2], params[1]), e3 = max_relative(params[3], params[1]);
    MESSAGE(fmt::format("relative difference to W = 1: W = 2 {:.3g}, W = 3 {:.3g}", e2, e3));
    CHECK(e2 < 1e-12);
    CHECK(e3 < 1e-12);
    // The steps moved the parameters (the comparison is not between two initial states).
    TempDir none("loom-elastic");
    run(1, none.path, 1, "one");
    CHECK(max_relative(parse(read_file(none.path / "params.one")), params[1]) > 1e-3);
  }

  TEST_CASE("resume on another world size: 3 steps on W, 3 more on W' equal 6 uninterrupted steps; each sample once") {
    REQUIRE(epoch_steps() > 6);
    TempDir straight("loom-elastic");
    run(2, straight.path, 6, "all");
    const auto reference = parse(read_file(straight.path / "params.all"));
    const auto ref_uses = count_uses(straight.path, "all");
    for (auto [first, second] : {std::pair{2, 3}, std::pair{3, 1}}) {
      TempDir dir("loom-elastic");
      run(first, dir.path, 3, "a");
      run(second, dir.path, 3, "b");
      const double err = max_relative(parse(read_file(dir.path / "params.b")), reference);
      MESSAGE(fmt::format("W = {} then W = {}: relative difference to the uninterrupted W = 2 run {:.3g}", first,
                          second, err));
      CHECK(err < 1e-12);
      auto uses = count_uses(dir.path, "a");
      for (const auto& [i, k] : count_uses(dir.path, "b")) uses[i] += k;
      CHECK(uses == ref_uses);  // the same samples as the uninterrupted run
      CHECK(uses.size() >= 12);
      for (const auto& [i, k] : uses) CHECK(k == 1);  // 6 steps inside epoch 0: each sample once
    }
  }

  TEST_CASE("global_batch_size = 8: an epoch and a step on 1, 2 and 3 ranks end equal (float64, 1e-12)") {
    // 37 samples of 3 shapes: steps of 8 samples (the last 5), each split into up to 3 same-shape
    // micro-batches of at most 3 samples, dealt to the ranks (some idle in a step on 3 ranks).
    const loom::GlobalBatchOptions plan{.seed = 17, .max_samples = 3, .global_batch_size = 8};
    const auto epoch = loom::plan_epoch(shapes(), plan, 0);
    REQUIRE(epoch.steps.size() == 5);
    for (std::size_t k = 0; k < epoch.steps.size(); ++k)
      CHECK(epoch.steps[k].num_samples == (k + 1 < epoch.steps.size() ? 8 : 5));
    std::map<int, std::vector<double>> params;
    for (int w : {1, 2, 3}) {
      TempDir dir("loom-elastic");
      run(w, dir.path, 6, "g", plan);
      params[w] = parse(read_file(dir.path / "params.g"));
      const auto uses = count_uses(dir.path, "g");
      CHECK(static_cast<int64_t>(uses.size()) == kSamples);  // the epoch's every sample, 8 of them twice
      int twice = 0;
      for (const auto& [i, k] : uses) {
        CHECK((k == 1 || k == 2));
        twice += k == 2 ? 1 : 0;
      }
      CHECK(twice == 8);  // the first step of epoch 1
    }
    const double e2 = max_relative(params[2], params[1]), e3 = max_relative(params[3], params[1]);
    MESSAGE(fmt::format("global_batch_size 8, relative difference to W = 1: W = 2 {:.3g}, W = 3 {:.3g}", e2, e3));
    CHECK(e2 < 1e-12);
    CHECK(e3 < 1e-12);
    // Different from the batches_per_step plan's trajectory (the option changed the steps).
    TempDir other("loom-elastic");
    run(1, other.path, 6, "o");
    CHECK(max_relative(parse(read_file(other.path / "params.o")), params[1]) > 1e-6);
  }
}  // TEST_SUITE

}  // namespace test_elastic_dist
