// loom::evaluate in one process: rows in dataset order equal to a per-sample float64 reference,
// nothing recorded for autograd, idle ranks, bad fn results, plans that leave samples out, and an
// error on one thread rank failing every rank (no rank left in the gather).
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include <doctest/doctest.h>
#include <torch/torch.h>

#include <loom/comm/local.hpp>
#include <loom/train/evaluate.hpp>
#include <loom/train/trainer.hpp>

#include "support/thread_communicator.hpp"
#include "trainer_fixture.hpp"

namespace test_evaluate {

namespace {

using loom::test::kTrainerSamples;

// The model's output for sample i alone (its sequence's mean, a batch of one).
at::Tensor reference_row(const loom::test::Mlp& model, int64_t i) {
  torch::NoGradGuard no_grad;
  return model.forward(loom::test::trainer_sample(i).first.mean(0).unsqueeze(0)).squeeze(0);
}

const loom::GlobalBatchOptions kEvalPlan{.shuffle = false, .max_samples = 4, .batches_per_step = 2};

}  // namespace

TEST_CASE("evaluate: every sample once, in dataset order, equal to the model run on each sample alone") {
  loom::LocalCommunicator comm;
  loom::test::Mlp model(at::kDouble);
  loom::BatchLoader val(comm, loom::test::trainer_shapes(), loom::test::trainer_fetch(), kEvalPlan);
  int64_t calls = 0, rows_seen = 0;
  const loom::GatheredResults r = loom::evaluate(comm, val, [&](loom::Batch& b) {
    ++calls;
    rows_seen += b.num_samples;
    CHECK_FALSE(at::GradMode::is_enabled());
    return model.forward(b.data.mean(1));
  });
  CHECK(rows_seen == kTrainerSamples);
  CHECK(calls == static_cast<int64_t>(val.sampler().plan().batches.size()));
  REQUIRE(r.indices.size() == static_cast<std::size_t>(kTrainerSamples));
  REQUIRE(r.values.sizes() == c10::IntArrayRef({kTrainerSamples, loom::test::kOut}));
  CHECK_FALSE(r.values.requires_grad());
  CHECK(r.duplicates_dropped == 0);
  for (int64_t i = 0; i < kTrainerSamples; ++i) {
    CHECK(r.indices[static_cast<std::size_t>(i)] == i);
    const at::Tensor want = reference_row(model, i);
    CHECK(r.values[i].sub(want).abs().max().item<double>() <= 1e-12);
  }
  // A second call reads the set again and gives the same rows.
  const loom::GatheredResults again =
      loom::evaluate(comm, val, [&](loom::Batch& b) { return model.forward(b.data.mean(1)); });
  CHECK(torch::equal(again.values, r.values));
}

TEST_CASE("evaluate: between Trainer epochs, no gradient is touched and training goes on as without it") {
  loom::LocalCommunicator comm;
  auto run = [&](bool with_eval) {
    loom::test::Mlp model(at::kDouble);
    torch::optim::SGD sgd(model.params, 0.05);
    loom::BatchLoader train(comm, loom::test::trainer_shapes(), loom::test::trainer_fetch(), loom::test::kTrainerPlan);
    loom::BatchLoader val(comm, loom::test::trainer_shapes(), loom::test::trainer_fetch(), kEvalPlan);
    loom::Trainer trainer(comm, model.list(), sgd);
    std::vector<double> losses;
    for (int64_t epoch = 0; epoch < 2; ++epoch) {
      for (loom::Batch& b : trainer.epoch(train, epoch)) trainer.backward(loom::test::mean_loss(model, b), b);
      if (with_eval) {
        auto r = loom::evaluate(
            comm, val, [&](loom::Batch& b) { return (model.forward(b.data.mean(1)) - b.targets).pow(2).sum(1); });
        losses.push_back(r.values.mean().item<double>());
        for (const auto& p : model.params) CHECK((!p.grad().defined() || p.grad().abs().sum().item<double>() == 0));
      }
    }
    return std::make_pair(loom::test::flat_values(model.params), losses);
  };
  const auto [plain, none] = run(false);
  const auto [evaluated, losses] = run(true);
  CHECK(plain == evaluated);  // bit for bit: evaluate neither steps nor leaves gradients behind
  REQUIRE(losses.size() == 2);
  CHECK(losses[1] < losses[0]);
}

TEST_CASE("evaluate on the training loader: put back between epochs, refused inside one, a pending resume kept") {
  loom::LocalCommunicator comm;
  loom::test::Mlp model(at::kDouble);
  torch::optim::SGD sgd(model.params, torch::optim::SGDOptions(0.05));
  loom::BatchLoader loader(comm, loom::test::trainer_shapes(), loom::test::trainer_fetch(), loom::test::kTrainerPlan);
  loom::Trainer trainer(comm, model.list(), sgd);
  auto fn = [&](loom::Batch& b) { return model.forward(b.data.mean(1)); };
  for (loom::Batch& b : trainer.epoch(loader, 0)) trainer.backward(loom::test::mean_loss(model, b), b);
  // Between epochs: the cursor names epoch 1's first step before and after evaluate (rewound into
  // epoch 0, a checkpoint written next would resume one epoch early).
  CHECK(loader.sampler().cursor().epoch == 1);
  CHECK(loom::evaluate(comm, loader, fn).indices.size() == static_cast<std::size_t>(kTrainerSamples));
  CHECK(loader.sampler().cursor().epoch == 1);
  CHECK(loader.sampler().cursor().step == 0);
  // Inside an epoch (from on_step): refused, naming the epoch; the training loop is not cut short
  // silently (the error ends it).
  int64_t steps_seen = 0;
  trainer.on_step([&](const loom::SyncResult&) {
    if (++steps_seen == 2) (void)loom::evaluate(comm, loader, fn);
  });
  CHECK_THROWS_WITH_AS(
      [&] {
        for (loom::Batch& b : trainer.epoch(loader, 1)) trainer.backward(loom::test::mean_loss(model, b), b);
      }(),
      doctest::Contains("evaluate: the loader is inside epoch 1 (at step 2 of"), loom::InvalidArgument);
  // A loader resumed at step 2 of epoch 0 and evaluated before its loop still starts there.
  loom::test::Mlp fresh(at::kDouble);
  torch::optim::SGD sgd2(fresh.params, torch::optim::SGDOptions(0.05));
  loom::BatchLoader resumed(comm, loom::test::trainer_shapes(), loom::test::trainer_fetch(), loom::test::kTrainerPlan);
  loom::Trainer trainer2(comm, fresh.list(), sgd2);
  resumed.resume(loom::GlobalCursor{.seed = loom::test::kTrainerPlan.seed,
                                    .epoch = 0,
                                    .step = 2,
                                    .fingerprint = resumed.sampler().cursor().fingerprint});
  (void)loom::evaluate(comm, resumed, [&](loom::Batch& b) { return fresh.forward(b.data.mean(1)); });
  for (loom::Batch& b : trainer2.epoch(resumed, 0)) trainer2.backward(loom::test::mean_loss(fresh, b), b);
  CHECK(trainer2.steps() == resumed.sampler().num_steps() - 2);
}

TEST_CASE("evaluate: a rank with no batch at all still gets every row (4 thread ranks, 3 batches)") {
  std::vector<std::vector<int64_t>> shapes = loom::test::trainer_shapes();
  shapes.resize(4);  // lengths 2, 3, 5, 2: three exact-shape batches of at most 2 samples
  loom::test::ThreadGroup group(4);
  std::vector<loom::GatheredResults> results(4);
  std::vector<int64_t> batches(4, 0);
  group.run([&](int rank) {
    loom::test::ThreadCommunicator comm(group, rank);
    loom::BatchLoader val(comm, shapes, loom::test::trainer_fetch(),
                          {.shuffle = false, .max_samples = 2, .batches_per_step = 4});
    results[static_cast<std::size_t>(rank)] = loom::evaluate(comm, val, [&](loom::Batch& b) {
      ++batches[static_cast<std::size_t>(rank)];
      return b.data.sum({1, 2}).unsqueeze(1);  // N x 1: the sum of each sample
    });
  });
  CHECK(batches[0] + batches[1] + batches[2] + batches[3] == 3);
  CHECK(std::count(batches.begin(), batches.end(), 0) == 1);
  for (const auto& r : results) {
    REQUIRE(r.values.size(0) == 4);
    for (int64_t i = 0; i < 4; ++i)
      CHECK(r.values[i][0].item<double>() ==
            doctest::Approx(loom::test::trainer_sample(i).first.sum().item<double>()).epsilon(1e-12));
  }
}

TEST_CASE("evaluate: fn's wrong row count, a plan that drops samples, and one rank's exception are loom errors") {
  loom::LocalCommunicator comm;
  loom::BatchLoader val(comm, loom::test::trainer_shapes(), loom::test::trainer_fetch(), kEvalPlan);
  CHECK_THROWS_WITH_AS((void)loom::evaluate(comm, val, [](loom::Batch& b) { return b.data.sum(); }),
                       doctest::Contains("evaluate: fn returned a tensor of shape [] for the batch of step 0"),
                       loom::InvalidArgument);
  CHECK_THROWS_WITH_AS((void)loom::evaluate(comm, val, [](loom::Batch& b) { return b.data.mean(1).narrow(0, 0, 1); }),
                       doctest::Contains("one row per sample"), loom::InvalidArgument);
  CHECK_THROWS_WITH_AS(
      (void)loom::evaluate(comm, val,
                           [](loom::Batch& b) { return b.step == 0 ? b.data.mean(1) : b.data.mean(1).to(at::kFloat); }),
      doctest::Contains("fn returned rows of dtype Float and trailing shape [3]"), loom::InvalidArgument);

  loom::BatchLoader dropping(comm, loom::test::trainer_shapes(), loom::test::trainer_fetch(),
                             {.shuffle = false, .max_samples = 4, .drop_incomplete = true, .batches_per_step = 2});
  CHECK_THROWS_WITH_AS((void)loom::evaluate(comm, dropping, [](loom::Batch& b) { return b.data.mean(1); }),
                       doctest::Contains("evaluate: the loader's plan leaves out"), loom::InvalidArgument);

  loom::test::ThreadGroup group(3);
  std::vector<std::string> errors(3);
  group.run([&](int rank) {
    loom::test::ThreadCommunicator comm(group, rank);
    loom::BatchLoader v(comm, loom::test::trainer_shapes(), loom::test::trainer_fetch(), kEvalPlan);
    try {
      (void)loom::evaluate(comm, v, [&](loom::Batch& b) {
        if (rank == 1) throw std::runtime_error("decoder failed on sample " + std::to_string(b.indices.front()));
        return b.data.mean(1);
      });
    } catch (const std::exception& e) {
      errors[static_cast<std::size_t>(rank)] = e.what();
    }
  });
  CHECK(errors[1].starts_with("decoder failed on sample "));
  CHECK(errors[0] == "loom: evaluate: rank 1 failed: " + errors[1]);
  CHECK(errors[2] == errors[0]);
}

}  // namespace test_evaluate
