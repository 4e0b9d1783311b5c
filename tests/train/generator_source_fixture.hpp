// tests/train/generator_source_fixture.hpp — generators with closed-form samples, a one-weight
// model trained through loom::GeneratorSource + loom::Trainer, and its float64 reference by hand.
//
// Generator g of length L(g) yields sample k = (x, y), x = 0.1 (g + 1) + 0.01 k + 0.001 e (epoch
// e), y = 0.3 x + 0.05 g, each a float64 tensor of shape [1]. Model: y ≈ w x, w one float64
// weight from 0.5; loss: the batch mean of (w x - y)^2; SGD with learning rate 0.1. The step's
// gradient is the mean over every row of the step on every rank.
#pragma once

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <loom/comm/communicator.hpp>
#include <loom/train/generator_source.hpp>
#include <loom/train/trainer.hpp>

namespace loom::test {

inline double source_x(int g, std::int64_t k, std::int64_t epoch) {
  return 0.1 * (g + 1) + 0.01 * static_cast<double>(k) + 0.001 * static_cast<double>(epoch);
}
inline double source_y(int g, double x) {
  return 0.3 * x + 0.05 * g;
}

/// Generator g of one epoch: `length` samples (x, y).
struct ClosedFormGenerator {
  int g = 0;
  std::int64_t length = 0;
  std::int64_t epoch = 0;
  std::int64_t k = 0;
  std::optional<std::pair<at::Tensor, at::Tensor>> operator()() {
    if (k >= length) return std::nullopt;
    const double x = source_x(g, k++, epoch);
    return std::make_pair(at::full({1}, x, at::kDouble), at::full({1}, source_y(g, x), at::kDouble));
  }
};

/// w after `epochs` epochs by hand in float64: per step, w -= 0.1 x mean over the step's rows of
/// 2 (w x - y) x, the rows being sample k of every generator longer than k (drain), or of every
/// generator while all are (stop_at_shortest).
inline double reference_weight(const std::vector<std::int64_t>& lengths, int epochs, bool drain) {
  double w = 0.5;
  std::int64_t shortest = lengths.front(), longest = lengths.front();
  for (auto l : lengths) {
    shortest = std::min(shortest, l);
    longest = std::max(longest, l);
  }
  for (int e = 0; e < epochs; ++e)
    for (std::int64_t k = 0; k < (drain ? longest : shortest); ++k) {
      double sum = 0;
      int rows = 0;
      for (int g = 0; g < static_cast<int>(lengths.size()); ++g) {
        if (k >= lengths[static_cast<std::size_t>(g)]) continue;
        const double x = source_x(g, k, e), y = source_y(g, x);
        sum += 2 * (w * x - y) * x;
        ++rows;
      }
      w -= 0.1 * sum / rows;
    }
  return w;
}

/// Trains w through GeneratorSource + Trainer on `comm` (every rank calls it); returns w and the
/// number of batches this rank passed to backward (idle steps are joined, not yielded).
template <Communicator C>
std::pair<double, std::int64_t> train_generators(C& comm, const std::vector<std::int64_t>& lengths, int epochs,
                                                 EndPolicy end) {
  at::Tensor w = at::full({1}, 0.5, at::kDouble).requires_grad_();
  torch::optim::SGD sgd({w}, torch::optim::SGDOptions(0.1));
  GeneratorSource source(comm, static_cast<int>(lengths.size()),
                         [&](int g, std::int64_t epoch) {
                           return ClosedFormGenerator{
                               .g = g, .length = lengths[static_cast<std::size_t>(g)], .epoch = epoch};
                         },
                         {.end = end});
  Trainer trainer(comm, ParameterList{.names = {"w"}, .params = {w}, .buffers = {}}, sgd);
  std::int64_t batches = 0;
  for (int e = 0; e < epochs; ++e)
    for (Batch& b : trainer.epoch(source, e)) {
      trainer.backward((w * b.data - b.targets).pow(2).mean(), b);
      ++batches;
    }
  return {w.item<double>(), batches};
}

}  // namespace loom::test
