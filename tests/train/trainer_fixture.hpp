// tests/train/trainer_fixture.hpp — data, model and the two loops (loom::Trainer, and the same
// protocol written by hand over Reducer + Accumulator) that the trainer tests compare.
//
// Data: 29 sequences of lengths 2, 3 or 5 with 3 features and 2 float64 targets, closed forms of
// the index (tests/support/models.hpp). Model: the 2-layer float64 MLP of models.hpp applied to each
// sequence's mean. Loss: the batch mean of the per-sample squared error (PyTorch's default
// reduction), so the trainer multiplies it by the batch's samples.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <torch/torch.h>

#include <loom/accumulate/accumulator.hpp>
#include <loom/compat.hpp>
#include <loom/reduce/reducer.hpp>
#include <loom/sample/global_batch.hpp>
#include <loom/train/loader.hpp>
#include <loom/train/trainer.hpp>

#include "support/models.hpp"

namespace loom::test {

inline constexpr int64_t kTrainerSamples = 29;

inline int64_t trainer_length(int64_t i) {
  return i % 3 == 0 ? 2 : i % 3 == 1 ? 3 : 5;
}

/// Sample i: (L x 3 sequence, 2 targets), float64.
inline std::pair<at::Tensor, at::Tensor> trainer_sample(int64_t i) {
  auto steps = torch::arange(trainer_length(i), torch::kDouble).mul(0.1).unsqueeze(1);
  return {sample_x(i).unsqueeze(0) + steps, sample_y(i)};
}

inline std::vector<std::vector<int64_t>> trainer_shapes() {
  std::vector<std::vector<int64_t>> s;
  for (int64_t i = 0; i < kTrainerSamples; ++i) s.push_back({trainer_length(i), kIn});
  return s;
}

inline const GlobalBatchOptions kTrainerPlan{.seed = 3, .max_samples = 3, .batches_per_step = 2};

/// The batch mean of the per-sample squared error.
inline at::Tensor mean_loss(const Mlp& model, const Batch& b) {
  return (model.forward(b.data.mean(1)) - b.targets).pow(2).sum(1).mean();
}

inline auto trainer_fetch() {
  return [](int64_t i) { return trainer_sample(i); };
}

/// `epochs` epochs with loom::Trainer (a loader with `loading`'s workers); returns the final parameters.
template <class Comm>
std::vector<at::Tensor> train_short(Comm& comm, int epochs, LoaderOptions loading = {}) {
  Mlp model(at::kDouble);
  torch::optim::SGD sgd(model.params, torch::optim::SGDOptions(0.05).momentum(0.9));
  BatchLoader loader(comm, trainer_shapes(), trainer_fetch(), kTrainerPlan, std::move(loading));
  Trainer trainer(comm, model.list(), sgd);
  for (int64_t epoch = 0; epoch < epochs; ++epoch)
    for (Batch& b : trainer.epoch(loader, epoch)) trainer.backward(mean_loss(model, b), b);
  return model.params;
}

/// The fixture's model, SGD (lr 0.05), a loader over the fixture's data (kTrainerPlan) and a Trainer
/// on `comm`: what most single-scenario tests start from.
template <class Comm>
struct TrainerSetup {
  Mlp model{at::kDouble};
  torch::optim::SGD sgd{model.params, torch::optim::SGDOptions(0.05)};
  BatchLoader<decltype(trainer_fetch())> loader;
  Trainer<Comm, torch::optim::SGD> trainer;
  explicit TrainerSetup(Comm& comm, TrainerOptions options = {})
      : loader(comm, trainer_shapes(), trainer_fetch(), kTrainerPlan),
        trainer(comm, model.list(), sgd, std::move(options)) {}
  /// One epoch of the fixture's loss.
  void train_epoch(int64_t epoch) {
    for (Batch& b : trainer.epoch(loader, epoch)) trainer.backward(mean_loss(model, b), b);
  }
};

/// A float16 run whose step gradients are legal but whose summed losses are not: one parameter w
/// (float16, 0), 64 samples x_i = 2048, loss (w * x).mean(), so every batch's mean gradient is 2048;
/// batches of 16, 3 per step (steps of 48 and 16 samples: 48 * 2048 overflows float16). One epoch of
/// SGD with lr 2^-12 moves w by -0.5 per step, exactly. Returns w and the Trainer's skipped steps.
template <class Comm>
std::pair<double, int64_t> train_float16(Comm& comm) {
  auto w = torch::zeros({1}, torch::kHalf).requires_grad_();
  torch::optim::SGD sgd(std::vector<at::Tensor>{w}, torch::optim::SGDOptions(std::ldexp(1.0, -12)));
  const std::vector<std::vector<int64_t>> shapes(64, std::vector<int64_t>{1});
  auto fetch = [](int64_t) {
    return std::make_pair(torch::full({1}, 2048.0, torch::kHalf), torch::zeros({1}, torch::kHalf));
  };
  BatchLoader loader(comm, shapes, fetch, GlobalBatchOptions{.seed = 1, .max_samples = 16, .batches_per_step = 3});
  Trainer trainer(comm, ParameterList{.names = {"w"}, .params = {w}}, sgd);
  for (Batch& b : trainer.epoch(loader, 0)) trainer.backward((w * b.data).mean(), b);
  return {w.item<double>(), trainer.skipped_steps()};
}

/// The same protocol by hand, over the low-level layer; returns the final parameters.
template <class Comm>
std::vector<at::Tensor> train_by_hand(Comm& comm, int epochs) {
  Mlp model(at::kDouble);
  torch::optim::SGD sgd(model.params, torch::optim::SGDOptions(0.05).momentum(0.9));
  GlobalBatchSampler sampler(comm, trainer_shapes(), kTrainerPlan);
  Reducer reducer(comm, model.list());
  Accumulator acc(reducer, {.micro_batches_per_step = 0});
  auto fetch = trainer_fetch();
  for (int64_t epoch = 0; epoch < epochs; ++epoch) {
    sampler.set_epoch(epoch);
    while (auto item = sampler.next()) {
      SyncResult step;
      if (item->idle) {
        step = acc.join_step();
      } else {
        Batch b = collate_sampled(*item, fetch);
        auto mb = acc.micro_batch(b);
        mb.scale(mean_loss(model, b).reshape({}) * static_cast<double>(b.num_samples)).backward();
        step = mb.finish();
      }
      if (step.apply) sgd.step();
      if (step.boundary) loom::zero_grad(sgd, loom::GradReset::zero);
    }
    while (auto s = acc.end_epoch()) {
      if (*s) sgd.step();
      loom::zero_grad(sgd, loom::GradReset::zero);
    }
  }
  return model.params;
}

/// float64 parameters as one list of values, in order.
inline std::vector<double> flat_values(const std::vector<at::Tensor>& params) {
  std::vector<double> out;
  for (const auto& p : params) {
    const at::Tensor c = p.detach().to(at::kDouble).contiguous();
    out.insert(out.end(), c.data_ptr<double>(), c.data_ptr<double>() + c.numel());
  }
  return out;
}

/// Writes the parameters' values to `path`, one per line, exactly (17 digits): how a spawned
/// rank hands its result to the test's process.
inline void write_values(const std::string& path, const std::vector<at::Tensor>& params) {
  std::string text;
  for (double v : flat_values(params)) text += fmt::format("{:.17g}\n", v);
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) throw std::runtime_error("cannot write " + path);
  std::fputs(text.c_str(), f);
  std::fclose(f);
}

/// The values write_values wrote (empty when the file is missing).
inline std::vector<double> read_values(const std::string& path) {
  std::vector<double> out;
  std::FILE* f = std::fopen(path.c_str(), "r");
  if (f == nullptr) return out;
  double x;
  while (std::fscanf(f, "%lf", &x) == 1) out.push_back(x);
  std::fclose(f);
  return out;
}

/// max |a - b| / max |a| over equally long lists (infinity when the lengths differ).
inline double max_relative_difference(const std::vector<double>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) return std::numeric_limits<double>::infinity();
  double worst = 0, scale = 0;
  for (std::size_t k = 0; k < a.size(); ++k) {
    worst = std::max(worst, std::abs(a[k] - b[k]));
    scale = std::max(scale, std::abs(a[k]));
  }
  return worst / scale;
}

}  // namespace loom::test
