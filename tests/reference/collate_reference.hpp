// tests/reference/collate_reference.hpp — naive reference implementations for loom/collate tests.
//
// Written for clarity, not speed, and independent of loom's code paths: the map-and-stack collate
// people write by hand, padding with torch ops (full + slice assignment), brute-force boundary
// search, and a plain greedy budget packer. Tests compare loom's results against these.
#pragma once

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

namespace loom_ref {

/// One batch as the naive collate builds it.
struct RefBatch {
  torch::Tensor data;
  torch::Tensor targets;
  torch::Tensor mask;
  std::vector<int64_t> indices;
};

/// The usual hand-written exact-shape collate: a map keyed by shape (buckets in first-seen order)
/// of vectors of tensors, torch::stack when a group reaches max_samples, leftovers at the end.
inline std::vector<RefBatch> map_and_stack(const std::vector<std::pair<torch::Tensor, int64_t>>& samples,
                                           int64_t max_samples) {
  std::vector<std::vector<int64_t>> order;  // keys in first-seen order
  std::map<std::vector<int64_t>, std::vector<int64_t>> groups;
  std::vector<RefBatch> out;
  auto emit = [&](std::vector<int64_t>& members) {
    std::vector<torch::Tensor> ts;
    std::vector<int64_t> ys;
    for (int64_t i : members) {
      ts.push_back(samples[static_cast<std::size_t>(i)].first);
      ys.push_back(samples[static_cast<std::size_t>(i)].second);
    }
    out.push_back({torch::stack(ts), torch::tensor(ys, torch::kLong), {}, members});
    members.clear();
  };
  for (int64_t i = 0; i < static_cast<int64_t>(samples.size()); ++i) {
    auto key = samples[static_cast<std::size_t>(i)].first.sizes().vec();
    if (!groups.count(key)) order.push_back(key);
    auto& g = groups[key];
    g.push_back(i);
    if (static_cast<int64_t>(g.size()) == max_samples) emit(g);
  }
  for (const auto& key : order)
    if (!groups[key].empty()) emit(groups[key]);
  return out;
}

/// Pads `samples` (given indices) to `padded` with torch ops: full(pad), then copy into narrowed views; mask likewise.
inline RefBatch pad_with_torch(const std::vector<torch::Tensor>& samples, const std::vector<int64_t>& indices,
                               const std::vector<int64_t>& padded, double pad_value) {
  std::vector<int64_t> sizes{static_cast<int64_t>(indices.size())};
  sizes.insert(sizes.end(), padded.begin(), padded.end());
  const auto dtype = samples[static_cast<std::size_t>(indices[0])].scalar_type();
  RefBatch b;
  b.data = torch::full(sizes, pad_value, torch::TensorOptions(dtype));
  b.mask = torch::zeros(sizes, torch::kBool);
  for (std::size_t r = 0; r < indices.size(); ++r) {
    const torch::Tensor& s = samples[static_cast<std::size_t>(indices[r])];
    torch::Tensor data_row = b.data[static_cast<int64_t>(r)];
    torch::Tensor mask_row = b.mask[static_cast<int64_t>(r)];
    for (int64_t d = 0; d < s.dim(); ++d) {
      data_row = data_row.narrow(d, 0, s.size(d));
      mask_row = mask_row.narrow(d, 0, s.size(d));
    }
    data_row.copy_(s);
    mask_row.fill_(true);
  }
  b.indices = indices;
  return b;
}

/// Minimum padded cost over every choice of at most k boundaries (subsets of the distinct sizes
/// that include the largest), by enumeration: sum over samples of (smallest boundary >= size)^exponent.
inline int64_t brute_force_min_padded(const std::map<int64_t, int64_t>& hist, int k, int exponent) {
  std::vector<int64_t> sizes;
  for (const auto& [s, c] : hist) sizes.push_back(s);
  const int m = static_cast<int>(sizes.size());
  int64_t best = -1;
  for (uint32_t mask = 0; mask < (1u << m); ++mask) {
    if (!(mask & (1u << (m - 1)))) continue;  // the largest size must be a boundary
    if (__builtin_popcount(mask) > k) continue;
    int64_t cost = 0;
    for (const auto& [s, c] : hist) {
      int64_t b = 0;
      for (int j = 0; j < m; ++j)
        if ((mask & (1u << j)) && sizes[static_cast<std::size_t>(j)] >= s) {
          b = sizes[static_cast<std::size_t>(j)];
          break;
        }
      int64_t p = 1;
      for (int e = 0; e < exponent; ++e) p *= b;
      cost += c * p;
    }
    if (best < 0 || cost < best) best = cost;
  }
  return best;
}

/// Greedy in-order packing of 1-D lengths under a padded-token budget (count x max length),
/// with fairseq's multiple-of rule; a plain loop over a list of lists.
inline std::vector<std::vector<int64_t>> greedy_padded_budget(const std::vector<int64_t>& lengths, int64_t budget,
                                                              int64_t multiple = 1) {
  std::vector<std::vector<int64_t>> out;
  std::vector<int64_t> cur;
  auto cost = [&](const std::vector<int64_t>& members, int64_t extra) {
    int64_t mx = extra;
    for (int64_t i : members) mx = std::max(mx, lengths[static_cast<std::size_t>(i)]);
    return mx * static_cast<int64_t>(members.size() + 1);
  };
  for (int64_t i = 0; i < static_cast<int64_t>(lengths.size()); ++i) {
    while (!cur.empty() && cost(cur, lengths[static_cast<std::size_t>(i)]) > budget) {
      const auto n = static_cast<int64_t>(cur.size());
      const int64_t take = n >= multiple ? n / multiple * multiple : n;
      out.emplace_back(cur.begin(), cur.begin() + take);
      cur.erase(cur.begin(), cur.begin() + take);
    }
    cur.push_back(i);
  }
  if (!cur.empty()) out.push_back(cur);
  return out;
}

/// Packing by *raw* token sums (what the padding-blind budget would do), for contrast.
inline std::vector<std::vector<int64_t>> greedy_raw_budget(const std::vector<int64_t>& lengths, int64_t budget) {
  std::vector<std::vector<int64_t>> out;
  std::vector<int64_t> cur;
  int64_t sum = 0;
  for (int64_t i = 0; i < static_cast<int64_t>(lengths.size()); ++i) {
    const int64_t l = lengths[static_cast<std::size_t>(i)];
    if (!cur.empty() && sum + l > budget) {
      out.push_back(cur);
      cur.clear();
      sum = 0;
    }
    cur.push_back(i);
    sum += l;
  }
  if (!cur.empty()) out.push_back(cur);
  return out;
}

/// (height, width) of every PNG under `root`, read from the IHDR chunk (big-endian width at bytes
/// 16..19, height at 20..23), in sorted path order. Files that are not PNGs are skipped.
inline std::vector<std::pair<int64_t, int64_t>> png_sizes(const std::filesystem::path& root) {
  std::vector<std::filesystem::path> paths;
  for (const auto& e : std::filesystem::recursive_directory_iterator(root))
    if (e.is_regular_file() && e.path().extension() == ".png") paths.push_back(e.path());
  std::sort(paths.begin(), paths.end());
  std::vector<std::pair<int64_t, int64_t>> out;
  for (const auto& p : paths) {
    std::ifstream f(p, std::ios::binary);
    unsigned char h[24];
    if (!f.read(reinterpret_cast<char*>(h), 24)) continue;
    if (h[0] != 0x89 || h[1] != 'P' || h[2] != 'N' || h[3] != 'G') continue;
    auto be32 = [&](int o) {
      return (int64_t{h[o]} << 24) | (int64_t{h[o + 1]} << 16) | (int64_t{h[o + 2]} << 8) | int64_t{h[o + 3]};
    };
    out.emplace_back(be32(20), be32(16));
  }
  return out;
}

}  // namespace loom_ref
