// tests/reference/grad_reference.hpp — naive float64 references for gradient accumulation and
// reduction tests: the full-batch gradient of the mean loss, computed one sample at a time.
//
// One sentence: every optimized path in loom/accumulate and loom/reduce (micro-batches, buckets,
// ranks, compression) must reproduce what this obviously-correct loop computes in one process.
//
// Example:
//   auto ref = loom::test::mean_gradient(params64, 22, [&](std::int64_t i) { return loss_of(i); });
//   // ref[k] == (1/22) * sum_i d loss_i / d params64[k]
//
// Shape: `params` are leaf tensors requiring grad (float64 for exactness tests); the result has one
//        float64 tensor per parameter, shaped like it (zeros for a parameter no sample touches).
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include <torch/torch.h>

namespace loom::test {

/// Sum over samples i in [0, n) of d loss_of(i) / d params, one autograd call per sample.
inline std::vector<at::Tensor> summed_gradient(const std::vector<at::Tensor>& params, std::int64_t n,
                                               const std::function<at::Tensor(std::int64_t)>& loss_of) {
  std::vector<at::Tensor> sum;
  for (const auto& p : params)
    sum.push_back(torch::zeros(p.sizes(), p.options().dtype(torch::kDouble).requires_grad(false)));
  for (std::int64_t i = 0; i < n; ++i) {
    auto loss = loss_of(i);
    auto grads = torch::autograd::grad({loss}, params, /*grad_outputs=*/{}, /*retain_graph=*/false,
                                       /*create_graph=*/false, /*allow_unused=*/true);
    for (std::size_t k = 0; k < params.size(); ++k)
      if (grads[k].defined()) sum[k] += grads[k].to(torch::kDouble);
  }
  return sum;
}

/// The gradient of the mean loss over n samples: summed_gradient / n.
inline std::vector<at::Tensor> mean_gradient(const std::vector<at::Tensor>& params, std::int64_t n,
                                             const std::function<at::Tensor(std::int64_t)>& loss_of) {
  auto g = summed_gradient(params, n, loss_of);
  for (auto& t : g) t /= static_cast<double>(n);
  return g;
}

/// Largest relative difference max|a - b| / max|b| over a list of tensors (float64).
inline double max_relative_error(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  double num = 0, den = 0;
  for (std::size_t k = 0; k < a.size(); ++k) {
    auto x = a[k].to(torch::kDouble), y = b[k].to(torch::kDouble);
    num = std::max(num, (x - y).abs().max().item<double>());
    den = std::max(den, y.abs().max().item<double>());
  }
  return den == 0 ? num : num / den;
}

/// The global L2 norm of a list of tensors, in float64.
inline double global_norm(const std::vector<at::Tensor>& ts) {
  double s = 0;
  for (const auto& t : ts) s += t.to(torch::kDouble).pow(2).sum().item<double>();
  return std::sqrt(s);
}

}  // namespace loom::test
