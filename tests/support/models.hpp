// tests/support/models.hpp — small deterministic models and data for reducer, accumulator and
// trainer tests.
// Data are closed-form functions of the sample index (no RNG state), so every process of a
// multi-rank test and the single-process reference see the same samples.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <loom/reduce/parameters.hpp>

namespace loom::test {

inline constexpr std::int64_t kIn = 3, kHidden = 5, kOut = 2;

/// Features of sample i: kIn values in [-1, 1].
inline at::Tensor sample_x(std::int64_t i, at::ScalarType dtype = at::kDouble) {
  std::vector<double> v;
  for (std::int64_t j = 0; j < kIn; ++j)
    v.push_back(std::sin(0.37 * static_cast<double>(i) + 1.3 * static_cast<double>(j) + 0.1));
  return torch::tensor(v, torch::dtype(torch::kDouble)).to(dtype);
}
/// Target of sample i: kOut values.
inline at::Tensor sample_y(std::int64_t i, at::ScalarType dtype = at::kDouble) {
  std::vector<double> v;
  for (std::int64_t j = 0; j < kOut; ++j)
    v.push_back(std::cos(0.71 * static_cast<double>(i) - 0.9 * static_cast<double>(j)));
  return torch::tensor(v, torch::dtype(torch::kDouble)).to(dtype);
}
/// Rows for sample indices [first, first + n).
inline at::Tensor batch_x(std::int64_t first, std::int64_t n, at::ScalarType dtype = at::kDouble) {
  std::vector<at::Tensor> rows;
  for (std::int64_t i = first; i < first + n; ++i) rows.push_back(sample_x(i, dtype));
  return n == 0 ? torch::zeros({0, kIn}, torch::dtype(dtype)) : torch::stack(rows);
}
inline at::Tensor batch_y(std::int64_t first, std::int64_t n, at::ScalarType dtype = at::kDouble) {
  std::vector<at::Tensor> rows;
  for (std::int64_t i = first; i < first + n; ++i) rows.push_back(sample_y(i, dtype));
  return n == 0 ? torch::zeros({0, kOut}, torch::dtype(dtype)) : torch::stack(rows);
}

/// Length of sequence sample i: 2, 3 or 5 by i mod 3 (the varied shapes of the world-size tests).
inline std::int64_t sequence_length(std::int64_t i) {
  return i % 3 == 0 ? 2 : i % 3 == 1 ? 3 : 5;
}
/// Sequence sample i: (sequence_length(i) x kIn: sample_x(i) plus 0.1 per position, kOut targets), in `dtype`.
inline std::pair<at::Tensor, at::Tensor> sequence_sample(std::int64_t i, at::ScalarType dtype = at::kDouble) {
  auto steps = torch::arange(sequence_length(i), torch::kDouble).mul(0.1).unsqueeze(1);
  return {(sample_x(i).unsqueeze(0) + steps).to(dtype), sample_y(i, dtype)};
}
/// The shapes of sequence samples 0..n-1.
inline std::vector<std::vector<std::int64_t>> sequence_shapes(std::int64_t n) {
  std::vector<std::vector<std::int64_t>> s;
  for (std::int64_t i = 0; i < n; ++i) s.push_back({sequence_length(i), kIn});
  return s;
}

/// A 2-layer MLP as plain tensors: w1 [kHidden, kIn], b1 [kHidden], w2 [kOut, kHidden], b2 [kOut],
/// initialised from a closed form (seed shifts it, so ranks can start different before the broadcast).
struct Mlp {
  std::vector<at::Tensor> params;

  explicit Mlp(at::ScalarType dtype = at::kDouble, double seed = 0.0) {
    auto init = [&](std::vector<std::int64_t> shape, double phase) {
      auto n = 1;
      for (auto s : shape) n *= static_cast<int>(s);
      auto t = torch::arange(n, torch::dtype(torch::kDouble)).mul(0.53).add(phase + seed).sin().mul(0.6).reshape(shape);
      return t.to(dtype).set_requires_grad(true);
    };
    params = {init({kHidden, kIn}, 0.2), init({kHidden}, 1.1), init({kOut, kHidden}, 2.3), init({kOut}, 0.7)};
  }
  [[nodiscard]] at::Tensor forward(const at::Tensor& x) const { return forward_with(params, x); }
  static at::Tensor forward_with(const std::vector<at::Tensor>& p, const at::Tensor& x) {
    return torch::nn::functional::linear(torch::tanh(torch::nn::functional::linear(x, p[0], p[1])), p[2], p[3]);
  }
  /// Loss SUMMED over the rows of x (squared error).
  [[nodiscard]] at::Tensor loss_sum(const at::Tensor& x, const at::Tensor& y) const {
    return (forward(x) - y).pow(2).sum();
  }
  [[nodiscard]] ParameterList list() const {
    return {.names = {"w1", "b1", "w2", "b2"}, .params = params, .buffers = {}};
  }
  [[nodiscard]] std::vector<at::Tensor> grads() const {
    std::vector<at::Tensor> g;
    for (const auto& p : params) g.push_back(p.grad().defined() ? p.grad().detach().clone() : at::Tensor());
    return g;
  }
  /// Float64 detached copies requiring grad (for the reference loop).
  [[nodiscard]] std::vector<at::Tensor> clone64() const {
    std::vector<at::Tensor> out;
    for (const auto& p : params) out.push_back(p.detach().to(at::kDouble).clone().set_requires_grad(true));
    return out;
  }
};

/// Loss of one sample for the reference (float64 params).
inline at::Tensor sample_loss(const std::vector<at::Tensor>& p64, std::int64_t i) {
  return (Mlp::forward_with(p64, sample_x(i).unsqueeze(0)) - sample_y(i).unsqueeze(0)).pow(2).sum();
}

}  // namespace loom::test
