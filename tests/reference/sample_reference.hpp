// tests/reference/sample_reference.hpp — naive references for loom/sample tests.
//
// py_distributed_sampler follows, line by line, the documented behaviour of Python's
// torch.utils.data.DistributedSampler.__iter__ (float ceil for the counts, list slicing and list
// repetition for padding), so the test compares loom against the convention rather than against
// loom's own arithmetic.
#pragma once

#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

namespace loom_ref {

/// Python: num_samples = ceil((N - R) / R) if drop_last and N % R else ceil(N / R);
/// indices = perm or list(range(N)); pad with indices[:pad] or (indices * ceil(pad / len))[:pad];
/// or truncate to total; return indices[rank:total:R].
inline std::vector<int64_t> py_distributed_sampler(int64_t n, int64_t r, int64_t rank, bool drop_last,
                                                   std::vector<int64_t> indices = {}) {
  int64_t num_samples = 0;
  if (drop_last && n % r != 0)
    num_samples = static_cast<int64_t>(std::ceil(static_cast<double>(n - r) / static_cast<double>(r)));
  else
    num_samples = static_cast<int64_t>(std::ceil(static_cast<double>(n) / static_cast<double>(r)));
  const int64_t total = num_samples * r;
  if (indices.empty()) {
    indices.resize(static_cast<std::size_t>(n));
    std::iota(indices.begin(), indices.end(), int64_t{0});
  }
  if (!drop_last) {
    const int64_t padding = total - static_cast<int64_t>(indices.size());
    if (padding <= static_cast<int64_t>(indices.size())) {
      std::vector<int64_t> head(indices.begin(), indices.begin() + padding);
      indices.insert(indices.end(), head.begin(), head.end());
    } else {
      const auto times =
          static_cast<int64_t>(std::ceil(static_cast<double>(padding) / static_cast<double>(indices.size())));
      std::vector<int64_t> repeated;
      for (int64_t t = 0; t < times; ++t) repeated.insert(repeated.end(), indices.begin(), indices.end());
      indices.insert(indices.end(), repeated.begin(), repeated.begin() + padding);
    }
  } else {
    indices.resize(static_cast<std::size_t>(total));
  }
  std::vector<int64_t> mine;
  for (int64_t i = rank; i < total; i += r) mine.push_back(indices[static_cast<std::size_t>(i)]);
  return mine;
}

}  // namespace loom_ref
