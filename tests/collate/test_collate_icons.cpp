// Real data: the sizes of Debian's adwaita-icon-theme PNGs (read from their IHDR headers), bucketed
// exactly, padded to multiples of 32, and padded to automatic boundaries; every count and padding
// fraction is checked against an independent naive computation.
#include <cmath>
#include <map>
#include <set>

#include <doctest/doctest.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>

#include <loom/collate/all.hpp>

#include "reference/collate_reference.hpp"

namespace test_collate_icons {

namespace {
const char* const kIcons = "/usr/share/icons/Adwaita";

int64_t round_up(int64_t v, int64_t m) {
  return (v + m - 1) / m * m;
}
}  // namespace

TEST_CASE("real data: Adwaita icon sizes — buckets and padding fraction") {
  REQUIRE_MESSAGE(std::filesystem::is_directory(kIcons),
                  "adwaita-icon-theme is not installed (apt-get install adwaita-icon-theme)");
  const auto sizes = loom_ref::png_sizes(kIcons);  // (H, W) per icon, sorted by path
  REQUIRE(sizes.size() > 1000);
  const auto n = static_cast<int64_t>(sizes.size());

  // ---- naive: distinct shapes and batch counts from a map ----
  std::map<std::pair<int64_t, int64_t>, int64_t> count;
  for (const auto& s : sizes) ++count[s];
  int64_t naive_batches = 0;
  for (const auto& [shape, c] : count) naive_batches += (c + 63) / 64;
  CHECK(count.size() == 10);  // 8, 16, 22, 24, 32, 48, 64, 96, 256, 512 (all square)

  // ---- exact-shape buckets ----
  loom::BucketPlanner exact(loom::ShapeBucketOptions{.max_samples = 64});
  std::vector<loom::PlannedBatch> out;
  for (int64_t i = 0; i < n; ++i)
    exact.add(i, {sizes[static_cast<std::size_t>(i)].first, sizes[static_cast<std::size_t>(i)].second}, out);
  exact.flush(out);
  CHECK(exact.buckets().size() == count.size());
  CHECK(static_cast<int64_t>(out.size()) == naive_batches);
  CHECK(exact.stats().padding_fraction() == 0.0);
  CHECK(exact.stats().samples_out == n);

  // ---- round up to a multiple of 32 on H and W ----
  loom::BucketPlanner r32(
      loom::PaddedBucketOptions{.pad = {{.dim = 0, .multiple = 32}, {.dim = 1, .multiple = 32}}, .max_samples = 64});
  std::vector<loom::PlannedBatch> out32;
  double real = 0, padded = 0;
  std::set<std::pair<int64_t, int64_t>> rounded;
  for (int64_t i = 0; i < n; ++i) {
    const auto [h, w] = sizes[static_cast<std::size_t>(i)];
    r32.add(i, {h, w}, out32);
    real += static_cast<double>(h * w);
    padded += static_cast<double>(round_up(h, 32) * round_up(w, 32));
    rounded.insert({round_up(h, 32), round_up(w, 32)});
  }
  r32.flush(out32);
  const double naive_fraction32 = 1.0 - real / padded;
  CHECK(r32.buckets().size() == rounded.size());
  CHECK(r32.stats().padding_fraction() == doctest::Approx(naive_fraction32).epsilon(1e-12));

  // ---- automatic boundaries, as many buckets as round-up-32 made (H and W padded to the same
  //      edge: exponent 2) ----
  std::map<int64_t, int64_t> hist;
  for (const auto& [h, w] : sizes) ++hist[std::max(h, w)];
  const auto k = static_cast<int64_t>(rounded.size());
  const loom::BoundaryPlan plan = loom::auto_boundaries(hist, k, 2);
  CHECK(plan.padded_elements == loom_ref::brute_force_min_padded(hist, static_cast<int>(k), 2));
  loom::BucketPlanner autob(loom::PaddedBucketOptions{
      .pad = {{.dim = 0, .boundaries = plan.boundaries}, {.dim = 1, .boundaries = plan.boundaries}},
      .max_samples = 64});
  std::vector<loom::PlannedBatch> outa;
  double padded_auto = 0;
  for (int64_t i = 0; i < n; ++i) {
    const auto [h, w] = sizes[static_cast<std::size_t>(i)];
    autob.add(i, {h, w}, outa);
    const int64_t bh = *std::lower_bound(plan.boundaries.begin(), plan.boundaries.end(), h);
    const int64_t bw = *std::lower_bound(plan.boundaries.begin(), plan.boundaries.end(), w);
    padded_auto += static_cast<double>(bh * bw);
  }
  autob.flush(outa);
  const double naive_fraction_auto = 1.0 - real / padded_auto;
  CHECK(autob.buckets().size() == plan.boundaries.size());
  CHECK(autob.stats().padding_fraction() == doctest::Approx(naive_fraction_auto).epsilon(1e-12));
  CHECK(plan.padding_fraction() == doctest::Approx(naive_fraction_auto).epsilon(1e-12));  // all icons are square
  // With as many buckets as sizes there is nothing to pad; with as many buckets as round-up-32
  // uses, the chosen edges pad less (the DP is optimal over every choice of k edges).
  CHECK(loom::auto_boundaries(hist, 10, 2).padding_fraction() == 0.0);
  CHECK(plan.padding_fraction() < naive_fraction32);
  MESSAGE(
      fmt::format("icons: {} files, {} exact buckets, {} batches of <= 64; round-up-32: {} buckets, padding {:.4f}; "
                  "auto ({} edges [{}]): padding {:.4f}",
                  n, count.size(), out.size(), rounded.size(), naive_fraction32, k, fmt::join(plan.boundaries, ", "),
                  naive_fraction_auto));

  // ---- the collator itself, on 1 x H x W uint8 tensors of these sizes ----
  loom::BucketCollator<> c(loom::PaddedBucketOptions{.pad = {{.dim = 1, .multiple = 32}, {.dim = 2, .multiple = 32}},
                                                     .max_samples = 64,
                                                     .pool = std::make_shared<loom::BufferPool>()});
  int64_t batches = 0, rows = 0, mask_true = 0;
  for (int64_t i = 0; i < n; ++i) {
    const auto [h, w] = sizes[static_cast<std::size_t>(i)];
    c.push(i, torch::full({1, h, w}, 1, torch::kUInt8));
    while (auto b = c.try_pop()) {
      ++batches;
      rows += b->num_samples;
      mask_true += b->mask.sum().item<int64_t>();
      CHECK(b->data.sum().item<int64_t>() == b->mask.sum().item<int64_t>());  // pad value 0, real value 1
    }
  }
  c.flush();
  while (auto b = c.try_pop()) {
    ++batches;
    rows += b->num_samples;
    mask_true += b->mask.sum().item<int64_t>();
  }
  CHECK(batches == static_cast<int64_t>(out32.size()));
  CHECK(rows == n);
  CHECK(static_cast<double>(mask_true) == real);
  CHECK(c.stats().padding_fraction() == doctest::Approx(naive_fraction32).epsilon(1e-12));
}

}  // namespace test_collate_icons
