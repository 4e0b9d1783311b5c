// Tests of loom/collate: bucket assignments by hand, padded masks, budgets (cases from the field),
// projections, buffer pool, allocator hook, view adaptors on a single-pass archetype, bad input.
#include <atomic>
#include <cassert>
#include <map>
#include <random>
#include <set>

#include <doctest/doctest.h>
#include <range/v3/range/conversion.hpp>
#include <range/v3/view/iota.hpp>
#include <range/v3/view/transform.hpp>
#include <torch/torch.h>

#include <loom/collate/all.hpp>
#include <loom/collate/pool.hpp>

#include "reference/collate_reference.hpp"

namespace test_collate {

namespace {

using Sample = std::pair<torch::Tensor, int64_t>;

// A sample filled with value (index * 1000 + position) so every element is traceable.
torch::Tensor traced(int64_t index, std::vector<int64_t> shape, torch::ScalarType dtype = torch::kFloat) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return (torch::arange(n, torch::kDouble) + static_cast<double>(index) * 1000).reshape(shape).to(dtype);
}

std::vector<std::vector<int64_t>> indices_of(const std::vector<loom::Batch>& batches) {
  std::vector<std::vector<int64_t>> v;
  for (const auto& b : batches) v.push_back(b.indices);
  return v;
}

template <class Options>
std::vector<loom::Batch> run_collator(const std::vector<Sample>& samples, const Options& o,
                                      loom::CollateStats* stats = nullptr) {
  loom::BucketCollator<> c(o);
  std::vector<loom::Batch> out;
  for (const auto& s : samples) {
    c.push(s);
    while (auto b = c.try_pop()) out.push_back(std::move(*b));
  }
  c.flush();
  while (auto b = c.try_pop()) out.push_back(std::move(*b));
  if (stats != nullptr) *stats = c.stats();
  return out;
}

std::vector<Sample> sequences(const std::vector<int64_t>& lengths) {
  std::vector<Sample> s;
  for (std::size_t i = 0; i < lengths.size(); ++i)
    s.emplace_back(traced(static_cast<int64_t>(i), {lengths[i]}), static_cast<int64_t>(i) * 10);
  return s;
}

// ---- archetype: a single-pass input range that builds samples on demand and asserts when
//      begun twice or when an element is read twice (like range-v3's test/debug_view.hpp) ----
class SinglePassSamples : public ranges::view_base {
 public:
  struct Shared {
    std::vector<std::vector<int64_t>> shapes;
    int begins = 0;
    int64_t reads = 0;
  };
  class iterator {
   public:
    using value_type = Sample;
    using difference_type = std::ptrdiff_t;
    using iterator_concept = std::input_iterator_tag;
    iterator() = default;
    iterator(Shared* s, std::size_t i) : s_(s), i_(i) {}
    Sample operator*() const {                         // a prvalue: the view must not keep references into the input
      REQUIRE(static_cast<int64_t>(i_) == s_->reads);  // each element read once, in order
      ++s_->reads;
      return {traced(static_cast<int64_t>(i_), s_->shapes[i_]), static_cast<int64_t>(i_)};
    }
    iterator& operator++() {
      ++i_;
      return *this;
    }
    void operator++(int) { ++i_; }
    friend bool operator==(const iterator& a, ranges::default_sentinel_t) { return a.i_ >= a.s_->shapes.size(); }

   private:
    Shared* s_ = nullptr;
    std::size_t i_ = 0;
  };
  SinglePassSamples() = default;
  explicit SinglePassSamples(std::shared_ptr<Shared> s) : s_(std::move(s)) {}
  iterator begin() const {
    REQUIRE(++s_->begins == 1);  // single pass
    return {s_.get(), 0};
  }
  ranges::default_sentinel_t end() const { return {}; }

 private:
  std::shared_ptr<Shared> s_;
};
static_assert(ranges::input_range<SinglePassSamples> && !ranges::forward_range<SinglePassSamples>);
static_assert(!std::is_copy_constructible_v<loom::BucketCollator<>> &&
              std::is_move_constructible_v<loom::BucketCollator<>>);

}  // namespace

// =============================================================================================
TEST_CASE("exact-shape buckets: hand-computed assignment, data, targets, deterministic order") {
  // shapes: A=(2,3) B=(3,3) C=(1,1); max 3 per batch.
  const std::vector<std::vector<int64_t>> shapes{{2, 3}, {3, 3}, {2, 3}, {2, 3}, {3, 3}, {1, 1}, {2, 3}};
  std::vector<Sample> samples;
  for (std::size_t i = 0; i < shapes.size(); ++i)
    samples.emplace_back(traced(static_cast<int64_t>(i), shapes[i]), 100 + static_cast<int64_t>(i));
  loom::CollateStats st;
  auto batches = run_collator(samples, loom::ShapeBucketOptions{.max_samples = 3}, &st);
  // A fills at sample 3 -> {0,2,3}; then flush in bucket creation order: A {6}, B {1,4}, C {5}.
  const std::vector<std::vector<int64_t>> expected{{0, 2, 3}, {6}, {1, 4}, {5}};
  CHECK(indices_of(batches) == expected);
  for (const auto& b : batches) {
    CHECK(b.num_samples == static_cast<int64_t>(b.indices.size()));
    CHECK(b.weight == 1.0);
    CHECK_FALSE(b.mask.defined());
    REQUIRE(b.data.size(0) == b.num_samples);
    for (int64_t r = 0; r < b.num_samples; ++r) {
      const int64_t i = b.indices[static_cast<std::size_t>(r)];
      CHECK(torch::equal(b.data[r], samples[static_cast<std::size_t>(i)].first));
      CHECK(b.targets[r].item<int64_t>() == 100 + i);
    }
  }
  CHECK(batches[1].data.sizes() == torch::IntArrayRef({1, 2, 3}));
  CHECK(batches[3].data.sizes() == torch::IntArrayRef({1, 1, 1}));
  CHECK((batches[0].targets.scalar_type() == torch::kLong));
  CHECK(st.samples_in == 7);
  CHECK(st.samples_out == 7);
  CHECK(st.batches_out == 4);
  CHECK(st.padding_fraction() == 0.0);
}

TEST_CASE("exact-shape buckets equal the naive map-and-stack collate on random shapes") {
  // 16 shapes (the planner's index of buckets grows once), and 144 (it grows five times).
  for (const auto& range : {std::pair<int64_t, int64_t>{2, 5}, std::pair<int64_t, int64_t>{1, 12}}) {
    const int64_t lo = range.first, hi = range.second;
    CAPTURE(hi);
    std::mt19937 rng(5);
    std::uniform_int_distribution<int64_t> hw(lo, hi);
    std::vector<Sample> samples;
    for (int64_t i = 0; i < 600; ++i) samples.emplace_back(traced(i, {3, hw(rng), hw(rng)}), i % 7);
    for (int64_t bs : {1, 5, 8}) {
      auto mine = run_collator(samples, loom::ShapeBucketOptions{.max_samples = bs});
      auto ref = loom_ref::map_and_stack(samples, bs);
      // The reference emits full groups as they fill and leftovers in first-seen order, like loom.
      REQUIRE(mine.size() == ref.size());
      for (std::size_t k = 0; k < ref.size(); ++k) {
        CHECK(mine[k].indices == ref[k].indices);
        CHECK(torch::equal(mine[k].data, ref[k].data));
        CHECK(torch::equal(mine[k].targets, ref[k].targets));
      }
    }
  }
}

TEST_CASE("field case: leftovers are flushed per bucket; drop_incomplete drops and reports them") {
  std::vector<Sample> samples;
  for (int64_t i = 0; i < 13; ++i) samples.emplace_back(traced(i, {2, 2}), 0);   // bucket A: 0-12
  for (int64_t i = 13; i < 16; ++i) samples.emplace_back(traced(i, {3, 3}), 1);  // bucket B: 13-15
  loom::CollateStats st;
  auto keep = run_collator(samples, loom::ShapeBucketOptions{.max_samples = 4}, &st);
  std::vector<int64_t> sizes;
  for (const auto& b : keep) sizes.push_back(b.num_samples);
  CHECK(sizes == std::vector<int64_t>{4, 4, 4, 1, 3});  // A: 4, 4, 4, 1 and B: 3
  CHECK(keep.size() == 5);                              // per bucket, not 16 / 4 = 4
  std::multiset<int64_t> seen;
  for (const auto& b : keep) seen.insert(b.indices.begin(), b.indices.end());
  CHECK(seen.size() == 16);
  CHECK(std::set<int64_t>(seen.begin(), seen.end()).size() == 16);  // every sample once
  CHECK(st.dropped_incomplete == 0);

  auto drop = run_collator(samples, loom::ShapeBucketOptions{.max_samples = 4, .drop_incomplete = true}, &st);
  CHECK(drop.size() == 3);
  CHECK(st.dropped_incomplete == 4);  // 1 from A, 3 from B
  CHECK(st.samples_out == 12);
}

TEST_CASE("field case: a token budget counts padding") {
  const std::vector<int64_t> lengths{100, 10, 10, 10, 100};
  loom::CollateStats st;
  auto batches =
      run_collator(sequences(lengths), loom::PaddedBucketOptions{.pad = {{.dim = 0}}, .max_elements = 150}, &st);
  CHECK(indices_of(batches) == std::vector<std::vector<int64_t>>{{0}, {1, 2, 3}, {4}});
  REQUIRE(batches.size() == 3);
  CHECK(batches[0].data.numel() == 100);  // padded costs 100, 30, 100
  CHECK(batches[1].data.numel() == 30);
  CHECK(batches[2].data.numel() == 100);
  CHECK(st.padded_elements == 230);
  CHECK(st.real_elements == 230);
  // Summing raw lengths would have packed 0-3 together (130 <= 150), padded to 4 x 100 = 400.
  const auto raw = loom_ref::greedy_raw_budget(lengths, 150);
  CHECK(raw.front() == std::vector<int64_t>{0, 1, 2, 3});
  CHECK(loom_ref::greedy_padded_budget(lengths, 150) == indices_of(batches));

  // Ten samples of length 10, budget 95: [[0..8], [9]]; with a multiple of 8: [[0..7], [8, 9]].
  const std::vector<int64_t> ten(10, 10);
  const std::vector<std::vector<int64_t>> nine_one{{0, 1, 2, 3, 4, 5, 6, 7, 8}, {9}};
  const std::vector<std::vector<int64_t>> eight_two{{0, 1, 2, 3, 4, 5, 6, 7}, {8, 9}};
  CHECK(indices_of(run_collator(sequences(ten), loom::PaddedBucketOptions{.pad = {{.dim = 0}}, .max_elements = 95})) ==
        nine_one);
  CHECK(indices_of(run_collator(
            sequences(ten), loom::PaddedBucketOptions{.pad = {{.dim = 0}}, .max_elements = 95, .multiple_of = 8})) ==
        eight_two);
  // The same with exact-shape buckets (all samples share the shape [10]).
  CHECK(indices_of(run_collator(sequences(ten), loom::ShapeBucketOptions{.max_elements = 95})) == nine_one);
  CHECK(indices_of(run_collator(sequences(ten), loom::ShapeBucketOptions{.max_elements = 95, .multiple_of = 8})) ==
        eight_two);
}

TEST_CASE("field case: an oversize sample raises, or is skipped and counted; never truncated") {
  const std::vector<int64_t> lengths{10, 200, 10};
  CHECK_THROWS_WITH_AS(
      run_collator(sequences(lengths), loom::PaddedBucketOptions{.pad = {{.dim = 0}}, .max_elements = 150}),
      doctest::Contains("sample 1 with shape [200] needs 200 (padded) elements, more than max_elements = 150"),
      loom::InvalidArgument);
  loom::CollateStats st;
  auto b = run_collator(
      sequences(lengths),
      loom::PaddedBucketOptions{.pad = {{.dim = 0}}, .max_elements = 150, .on_oversize = loom::OversizePolicy::skip},
      &st);
  CHECK(indices_of(b) == std::vector<std::vector<int64_t>>{{0, 2}});
  CHECK(st.skipped_oversize == 1);
  CHECK(b[0].data.sizes() == torch::IntArrayRef({2, 10}));
  // Exact buckets: a 3x10x10 sample is 300 elements.
  std::vector<Sample> big{{traced(0, {3, 10, 10}), 0}};
  CHECK_THROWS_WITH_AS(run_collator(big, loom::ShapeBucketOptions{.max_elements = 299}),
                       doctest::Contains("sample 0 with shape [3, 10, 10]"), loom::InvalidArgument);
}

TEST_CASE("field case: pixel budget for padded image buckets counts count x max H x max W") {
  std::vector<Sample> images{{traced(0, {32, 48}), 0}, {traced(1, {64, 16}), 1}, {traced(2, {16, 16}), 2}};
  auto batches = run_collator(
      images, loom::PaddedBucketOptions{.pad = {{.dim = 0}, {.dim = 1}}, .pad_value = -1, .max_elements = 5000});
  CHECK(indices_of(batches) == std::vector<std::vector<int64_t>>{{0}, {1, 2}});
  REQUIRE(batches.size() == 2);
  CHECK(batches[1].data.sizes() == torch::IntArrayRef({2, 64, 16}));  // 2 x 64 x 16 = 2048 <= 5000
  // Sample 2 (16 x 16) sits in the top 16 rows; the rest is pad = -1 and mask = false.
  auto ref = loom_ref::pad_with_torch({images[0].first, images[1].first, images[2].first}, {1, 2}, {64, 16}, -1);
  CHECK(torch::equal(batches[1].data, ref.data));
  CHECK(torch::equal(batches[1].mask, ref.mask));
  CHECK(batches[1].mask[1].sum().item<int64_t>() == 256);
  CHECK(batches[1].data[1][20][3].item<float>() == -1.0f);
}

TEST_CASE("padded buckets: boundaries give hand-computed data and masks") {
  // lengths 3, 5, 2 with boundaries {4, 8}: 3 -> 4, 5 -> 8, 2 -> 4; two per batch.
  std::vector<Sample> s{{torch::tensor({1.f, 2.f, 3.f}), 0},
                        {torch::tensor({4.f, 5.f, 6.f, 7.f, 8.f}), 1},
                        {torch::tensor({9.f, 10.f}), 2}};
  auto batches = run_collator(
      s, loom::PaddedBucketOptions{.pad = {{.dim = 0, .boundaries = {4, 8}}}, .pad_value = -1, .max_samples = 2});
  REQUIRE(batches.size() == 2);
  CHECK(batches[0].indices == std::vector<int64_t>{0, 2});
  CHECK(torch::equal(batches[0].data, torch::tensor({{1.f, 2.f, 3.f, -1.f}, {9.f, 10.f, -1.f, -1.f}})));
  CHECK(torch::equal(batches[0].mask, torch::tensor({{true, true, true, false}, {true, true, false, false}})));
  CHECK(batches[1].indices == std::vector<int64_t>{1});
  CHECK(torch::equal(batches[1].data, torch::tensor({{4.f, 5.f, 6.f, 7.f, 8.f, -1.f, -1.f, -1.f}})));
  CHECK(torch::equal(batches[1].mask, torch::tensor({{true, true, true, true, true, false, false, false}})));
  // Above the last boundary: an error naming the sample, the size and the boundary.
  std::vector<Sample> too_long{{torch::zeros({9}), 0}};
  CHECK_THROWS_WITH_AS(
      run_collator(too_long, loom::PaddedBucketOptions{.pad = {{.dim = 0, .boundaries = {4, 8}}}, .max_samples = 2}),
      doctest::Contains("sample 0 with shape [9]: size 9 on dimension 0 is above the last boundary 8"),
      loom::InvalidArgument);
}

TEST_CASE("padded buckets equal torch-op padding on random 3-D shapes, dtypes and pad rules") {
  std::mt19937 rng(11);
  std::uniform_int_distribution<int64_t> dim(1, 9);
  for (auto dtype : {torch::kFloat, torch::kDouble, torch::kInt, torch::kHalf, torch::kUInt8}) {
    std::vector<Sample> samples;
    std::vector<torch::Tensor> data;
    for (int64_t i = 0; i < 60; ++i) {
      auto t = traced(i, {2, dim(rng), dim(rng)}, dtype);
      if (i % 5 == 0) t = t.transpose(1, 2);  // non-contiguous input
      samples.emplace_back(t, i);
      data.push_back(t);
    }
    const std::vector<loom::PaddedBucketOptions> configs{
        {.pad = {{.dim = 1, .multiple = 4}, {.dim = 2, .multiple = 4}}, .pad_value = 7, .max_samples = 4},
        {.pad = {{.dim = -2, .boundaries = {3, 6, 9}}, {.dim = -1}}, .pad_value = 3, .max_elements = 300},
        {.pad = {{.dim = 1}, {.dim = 2}}, .pad_value = 0, .max_samples = 8, .max_elements = 500, .multiple_of = 2},
    };
    for (const auto& o : configs) {
      loom::CollateStats st;
      auto batches = run_collator(samples, o, &st);
      std::multiset<int64_t> seen;
      int64_t padded = 0;
      for (const auto& b : batches) {
        std::vector<int64_t> pshape(b.data.sizes().begin() + 1, b.data.sizes().end());
        auto ref = loom_ref::pad_with_torch(data, b.indices, pshape, o.pad_value);
        CHECK(torch::equal(b.data, ref.data));
        CHECK(torch::equal(b.mask, ref.mask));
        if (o.max_elements) CHECK(b.data.numel() <= *o.max_elements);
        if (o.max_samples) CHECK(b.num_samples <= *o.max_samples);
        for (std::size_t r = 0; r < b.indices.size(); ++r)
          CHECK(b.targets[static_cast<int64_t>(r)].item<int64_t>() == b.indices[r]);
        seen.insert(b.indices.begin(), b.indices.end());
        padded += b.data.numel();
      }
      CHECK(seen.size() == 60);
      CHECK(std::set<int64_t>(seen.begin(), seen.end()).size() == 60);
      CHECK(st.padded_elements == padded);
    }
  }
}

TEST_CASE("budget packing equals the naive greedy packer on random lengths (with multiples)") {
  std::mt19937 rng(3);
  std::uniform_int_distribution<int64_t> len(1, 60);
  std::vector<int64_t> lengths;
  for (int i = 0; i < 400; ++i) lengths.push_back(len(rng));
  for (int64_t budget : {60, 100, 257, 1000}) {
    for (int64_t mult : {1, 3, 8}) {
      auto got =
          run_collator(sequences(lengths),
                       loom::PaddedBucketOptions{.pad = {{.dim = 0}}, .max_elements = budget, .multiple_of = mult});
      CHECK(indices_of(got) == loom_ref::greedy_padded_budget(lengths, budget, mult));
    }
  }
}

TEST_CASE("BucketPlanner is the collators' plan, from shapes alone") {
  loom::BucketPlanner planner(loom::PaddedBucketOptions{.pad = {{.dim = 0}}, .max_elements = 150});
  std::vector<loom::PlannedBatch> out;
  const std::vector<int64_t> len{100, 10, 10, 10, 100};
  for (int64_t i = 0; i < 5; ++i) planner.add(i, {len[static_cast<std::size_t>(i)]}, out);
  planner.flush(out);
  REQUIRE(out.size() == 3);
  CHECK(out[1] ==
        loom::PlannedBatch{.indices = {1, 2, 3}, .padded_shape = {10}, .real_elements = 30, .padded_elements = 30});
  CHECK(out[0].padded_shape == std::vector<int64_t>{100});
  CHECK(planner.pending() == 0);
}

TEST_CASE("auto_boundaries: exact DP equals brute force; round-up and evaluation by hand") {
  const std::map<int64_t, int64_t> lengths{{10, 50}, {12, 30}, {40, 5}, {100, 2}};
  auto plan = loom::auto_boundaries(lengths, 2);
  CHECK(plan.boundaries == std::vector<int64_t>{12, 100});
  CHECK(plan.padded_elements == 80 * 12 + 7 * 100);
  CHECK(plan.real_elements == 500 + 360 + 200 + 200);
  CHECK(plan.padding_fraction() == doctest::Approx(1.0 - 1260.0 / 1660.0));
  CHECK(loom::auto_boundaries(lengths, 4).padded_elements == plan.real_elements);  // one bucket per size: no padding
  CHECK(loom::round_up_boundaries({{8, 1}, {24, 1}, {48, 1}}, 32) == std::vector<int64_t>{32, 64});
  CHECK(loom::evaluate_boundaries({{10, 3}, {20, 1}}, {32}).padded_elements == 128);

  const std::map<int64_t, int64_t> small{{1, 5}, {2, 1}, {3, 7}, {5, 2}, {8, 3}, {9, 1}, {13, 4}};
  for (int exponent : {1, 2}) {
    for (int k = 1; k <= 8; ++k) {
      const auto p = loom::auto_boundaries(small, k, exponent);
      CHECK(p.padded_elements == loom_ref::brute_force_min_padded(small, k, exponent));
      CHECK(static_cast<int>(p.boundaries.size()) <= k);
      CHECK(p.boundaries.back() == 13);
    }
  }
  std::mt19937 rng(17);
  for (int trial = 0; trial < 30; ++trial) {
    std::map<int64_t, int64_t> h;
    const int m = 1 + static_cast<int>(rng() % 11);
    while (static_cast<int>(h.size()) < m)
      h[1 + static_cast<int64_t>(rng() % 200)] = 1 + static_cast<int64_t>(rng() % 50);
    const int k = 1 + static_cast<int>(rng() % 5);
    CHECK(loom::auto_boundaries(h, k).padded_elements == loom_ref::brute_force_min_padded(h, k, 1));
  }
  CHECK_THROWS_WITH_AS(loom::auto_boundaries({}, 3), doctest::Contains("histogram is empty"), loom::InvalidArgument);
  CHECK_THROWS_WITH_AS(loom::auto_boundaries(small, 0), doctest::Contains("num_buckets = 0"), loom::InvalidArgument);
  CHECK_THROWS_WITH_AS(loom::auto_boundaries({{0, 3}}, 1), doctest::Contains("size 0"), loom::InvalidArgument);
}

// ---- projections ----------------------------------------------------------------------------
namespace {
struct Record {
  torch::Tensor data;
  torch::Tensor target;  // tensor target
  int64_t index;
};
struct Unlabelled {
  torch::Tensor data;
};
struct Utterance {
  torch::Tensor features;
  int64_t speaker;
  int64_t id;
};
struct UtteranceProjection {
  const at::Tensor& data(const Utterance& u) const { return u.features; }
  int64_t target(const Utterance& u) const { return u.speaker; }
  int64_t index(const Utterance& u) const { return u.id; }
};
}  // namespace

static_assert(loom::SampleProjection<loom::DefaultProjection, std::pair<at::Tensor, int64_t>>);
static_assert(loom::SampleProjection<loom::DefaultProjection, std::pair<at::Tensor, at::Tensor>>);
static_assert(loom::SampleProjectionWithIndex<loom::DefaultProjection, Record>);
static_assert(loom::SampleProjection<loom::DefaultProjection, Unlabelled>);
static_assert(loom::SampleProjection<loom::DefaultProjection, at::Tensor>);
static_assert(!loom::SampleProjectionWithIndex<loom::DefaultProjection, at::Tensor>);
static_assert(loom::SampleProjectionWithIndex<UtteranceProjection, Utterance>);
static_assert(!loom::SampleProjection<loom::DefaultProjection, Utterance>);  // no .data member
static_assert(!loom::SampleProjection<loom::DefaultProjection, std::pair<int, int>>);
static_assert(!loom::SampleProjection<loom::DefaultProjection, std::string>);
static_assert(!loom::SampleProjection<UtteranceProjection, Record>);

TEST_CASE("projections: structs with .data/.target/.index, tensor targets, no targets, custom projection") {
  std::vector<Record> recs;
  for (int64_t i = 0; i < 5; ++i)
    recs.push_back({traced(i, {2}), torch::full({3}, static_cast<double>(i), torch::kDouble), 50 + i});
  loom::BucketCollator<> c(loom::ShapeBucketOptions{.max_samples = 2});
  for (const auto& r : recs) c.push(r);
  c.flush();
  std::vector<loom::Batch> bs;
  while (auto b = c.try_pop()) bs.push_back(std::move(*b));
  REQUIRE(bs.size() == 3);
  CHECK(bs[0].indices == std::vector<int64_t>{50, 51});  // from .index
  CHECK(bs[0].targets.sizes() == torch::IntArrayRef({2, 3}));
  CHECK((bs[0].targets.scalar_type() == torch::kDouble));
  CHECK(torch::equal(bs[2].targets, torch::full({1, 3}, 4.0, torch::kDouble)));

  loom::BucketCollator<> u(loom::ShapeBucketOptions{.max_samples = 8});
  u.push(Unlabelled{torch::ones({4})});
  u.push(torch::zeros({4}));  // a bare tensor
  u.flush();
  auto ub = u.pop();
  CHECK_FALSE(ub.targets.defined());
  CHECK(ub.indices == std::vector<int64_t>{0, 1});  // positions

  loom::BucketCollator<UtteranceProjection> s(loom::PaddedBucketOptions{.pad = {{.dim = 0}}, .max_samples = 2});
  s.push(Utterance{torch::ones({3, 2}), 7, 900});
  s.push(Utterance{torch::ones({5, 2}), 8, 901});
  auto sb = s.pop();
  CHECK(sb.indices == std::vector<int64_t>{900, 901});
  CHECK(torch::equal(sb.targets, torch::tensor({7, 8}, torch::kLong)));
  CHECK(sb.data.sizes() == torch::IntArrayRef({2, 5, 2}));
  CHECK(sb.mask.sum().item<int64_t>() == 16);
}

// ---- storage: pool and allocator hook --------------------------------------------------------
TEST_CASE("detail::carve: the tensor narrow + view + view give, without dispatching them") {
  const at::Tensor block = at::empty({1024}, at::kByte);
  for (const auto dtype : {at::kFloat, at::kDouble, at::kHalf, at::kLong, at::kByte}) {
    CAPTURE(c10::toString(dtype));
    const int64_t offset = 128;
    const std::vector<int64_t> sizes{3, 2, 5};
    const at::Tensor got = loom::detail::carve(block, offset, dtype, sizes);
    const int64_t bytes = 30 * static_cast<int64_t>(c10::elementSize(dtype));
    const at::Tensor want = block.narrow(0, offset, bytes).view(dtype).view(sizes);
    CHECK(got.sizes() == want.sizes());
    CHECK(got.strides() == want.strides());
    CHECK((got.scalar_type() == dtype));
    CHECK((got.device() == block.device()));
    CHECK(got.data_ptr() == want.data_ptr());
    CHECK(got.is_contiguous());
    CHECK_FALSE(got.requires_grad());
    CHECK(got.storage().is_alias_of(block.storage()));  // keeps the buffer busy, as a view does
    CHECK((got.key_set() == want.key_set()));
    got.fill_(1);
    CHECK(at::equal(got, want));
    block.zero_();
    CHECK(got.count_nonzero().item<int64_t>() == 0);
  }
  const at::Tensor normal = loom::detail::carve(block, 64, at::kFloat, {4});
  {
    // Under InferenceMode a view of a normal tensor is a normal tensor; so is a carved one.
    const c10::InferenceMode inference;
    const at::Tensor got = loom::detail::carve(block, 64, at::kFloat, {4});
    CHECK_FALSE(got.is_inference());
    CHECK((got.key_set() == normal.key_set()));
  }
  // A start not aligned to the element size (an allocator's block at an odd storage offset), or
  // bytes past the block: a loom error, as view(dtype) refused before.
  const at::Tensor odd = block.narrow(0, 1, 512);
  CHECK_THROWS_WITH_AS(loom::detail::carve(odd, 0, at::kFloat, {4}), doctest::Contains("storage offset 1"),
                       loom::Error);
  CHECK_THROWS_WITH_AS(loom::detail::carve(block, 1000, at::kFloat, {8}),
                       doctest::Contains("32 bytes of Float at byte 1000 of a 1024-byte buffer"), loom::Error);
  CHECK_NOTHROW(loom::detail::carve(block, 992, at::kFloat, {8}));
}

TEST_CASE("BufferPool: a dropped batch's buffer is reused; a held one is not") {
  auto pool = std::make_shared<loom::BufferPool>();
  loom::BucketCollator<> c(loom::ShapeBucketOptions{.max_samples = 2, .pool = pool});
  auto push2 = [&](int64_t base) {
    c.push(base, Sample{traced(base, {3, 4}), 0});
    c.push(base + 1, Sample{traced(base + 1, {3, 4}), 0});
    return c.pop();
  };
  const void* first_ptr = nullptr;
  {
    auto b = push2(0);
    first_ptr = b.data.data_ptr();
    CHECK(torch::equal(b.data[1], traced(1, {3, 4})));
  }
  // b is gone: the next batch reuses its data buffer.
  auto b2 = push2(2);
  CHECK(b2.data.data_ptr() == first_ptr);
  CHECK(torch::equal(b2.data[0], traced(2, {3, 4})));
  // b2 is held: the next batch gets another buffer, and b2's contents stay intact.
  auto b3 = push2(4);
  CHECK(b3.data.data_ptr() != b2.data.data_ptr());
  CHECK(torch::equal(b2.data[1], traced(3, {3, 4})));
  CHECK(pool->reuses() == 1);    // b2 (data and targets share one buffer)
  auto view_of_b3 = b3.data[0];  // a view keeps the buffer busy
  b3 = loom::Batch{};
  auto b4 = push2(6);
  CHECK(b4.data.data_ptr() != view_of_b3.data_ptr());
  CHECK(torch::equal(view_of_b3, traced(4, {3, 4})));
}

TEST_CASE("BufferPool::acquire_block: the buffer is busy while the block or a tensor carved from it lives") {
  loom::BufferPool pool;
  const void* first = nullptr;
  {
    loom::detail::ByteBlock block = pool.acquire_block(100);
    CHECK(block.bytes == 100);
    CHECK(block.offset == 0);
    CHECK(block.storage.nbytes() == 128);  // rounded up to 64 bytes
    first = block.storage.data_ptr().get();
    // Held: a second request gets a new buffer.
    const loom::detail::ByteBlock second = pool.acquire_block(100);
    CHECK(second.storage.data_ptr().get() != first);
    CHECK(pool.allocations() == 2);
    // A tensor carved from the block keeps the buffer busy after the block is gone.
    at::Tensor t = loom::detail::carve(block, 64, at::kFloat, {2, 4});
    t.copy_(torch::arange(8, torch::kFloat).view({2, 4}));
    CHECK(static_cast<const char*>(t.data_ptr()) == static_cast<const char*>(first) + 64);
    block = loom::detail::ByteBlock{};
    const loom::detail::ByteBlock third = pool.acquire_block(100);
    CHECK(third.storage.data_ptr().get() != first);
    CHECK(pool.allocations() == 3);
    CHECK(torch::equal(t, torch::arange(8, torch::kFloat).view({2, 4})));
    // The block's bytes bound what can be carved from it.
    CHECK_THROWS_WITH_AS(loom::detail::carve(third, 64, at::kFloat, {10}),
                         doctest::Contains("40 bytes of Float at byte 64 of a 100-byte buffer"), loom::Error);
    CHECK_THROWS_WITH_AS(loom::detail::carve(loom::detail::ByteBlock{}, 0, at::kFloat, {0}),
                         doctest::Contains("empty ByteBlock"), loom::Error);
  }
  // Everything dropped: the smallest free buffer that fits is reused.
  const loom::detail::ByteBlock again = pool.acquire_block(100);
  CHECK(pool.reuses() == 1);
  CHECK(pool.allocations() == 3);
  CHECK(again.storage.use_count() == 2);  // the pool's and this block's
}

TEST_CASE("BatchAllocator hook: called per batch buffer; a broken allocator is reported") {
  std::atomic<int> calls{0};
  loom::BatchAllocator counting = [&](c10::IntArrayRef sizes, c10::ScalarType dtype) {
    ++calls;
    return torch::empty(sizes, torch::TensorOptions(dtype));
  };
  auto b = run_collator(sequences({4, 4, 4}), loom::ShapeBucketOptions{.max_samples = 3, .allocate = counting});
  CHECK(calls == 1);  // one buffer per batch holds data and targets
  CHECK(torch::equal(b[0].data[2], traced(2, {4})));
  CHECK(torch::equal(b[0].targets, torch::tensor({0, 10, 20}, torch::kLong)));
  CHECK(b[0].targets.storage().is_alias_of(b[0].data.storage()));
  auto pool = std::make_shared<loom::BufferPool>(loom::BufferPoolOptions{.allocate = counting});
  calls = 0;
  run_collator(sequences({4, 4, 4}), loom::ShapeBucketOptions{.max_samples = 3, .pool = pool});
  CHECK(calls == 1);
  loom::BatchAllocator broken = [](c10::IntArrayRef, c10::ScalarType) { return torch::empty({1}); };
  CHECK_THROWS_WITH_AS(run_collator(sequences({4}), loom::ShapeBucketOptions{.max_samples = 3, .allocate = broken}),
                       doctest::Contains("BatchAllocator returned a tensor of sizes [1]"), loom::InvalidArgument);
}

// ---- views ----------------------------------------------------------------------------------
TEST_CASE("views::bucket_by_shape / bucket_padded: lazy, single-pass, same batches as the collator") {
  const std::vector<std::vector<int64_t>> shapes{{2, 3}, {3, 3}, {2, 3}, {2, 3}, {3, 3}, {1, 1}, {2, 3}};
  auto shared = std::make_shared<SinglePassSamples::Shared>();
  shared->shapes = shapes;
  auto view = SinglePassSamples(shared) | loom::views::bucket_by_shape({.max_samples = 3});
  static_assert(ranges::input_range<decltype(view)>);
  static_assert(!ranges::forward_range<decltype(view)>);
  static_assert(std::same_as<ranges::range_value_t<decltype(view)>, loom::Batch>);
  CHECK(shared->reads == 0);  // nothing happens before begin()
  auto it = ranges::begin(view);
  CHECK(shared->reads == 4);  // lazily: the first batch closes at sample 3
  CHECK((*it).indices == std::vector<int64_t>{0, 2, 3});
  std::vector<std::vector<int64_t>> got{(*it).indices};
  for (++it; it != ranges::end(view); ++it) got.push_back((*it).indices);
  CHECK(got == std::vector<std::vector<int64_t>>{{0, 2, 3}, {6}, {1, 4}, {5}});
  CHECK(shared->reads == 7);
  CHECK(view.stats().batches_out == 4);

  // Composes with range-v3 views, and the padded adaptor takes a projection.
  const std::vector<int64_t> lengths{100, 10, 10, 10, 100};
  auto padded = ranges::views::iota(0, 5) | ranges::views::transform([&](int i) {
                  return Utterance{torch::ones({lengths[static_cast<std::size_t>(i)]}), i, 10 + i};
                }) |
                loom::views::bucket_padded({.pad = {{.dim = 0}}, .max_elements = 150}, UtteranceProjection{});
  std::vector<std::vector<int64_t>> idx;
  for (loom::Batch& b : padded) idx.push_back(b.indices);
  CHECK(idx == std::vector<std::vector<int64_t>>{{10}, {11, 12, 13}, {14}});

  // A pipeable closure built once, applied to a vector.
  auto closure = loom::views::bucket_by_shape({.max_samples = 2});
  auto samples = sequences({3, 3, 3});
  std::vector<int64_t> sizes;
  for (auto& b : samples | closure) sizes.push_back(b.num_samples);
  CHECK(sizes == std::vector<int64_t>{2, 1});
}

// ---- bad input ------------------------------------------------------------------------------
TEST_CASE("bad input throws loom::InvalidArgument naming the sample index and the shape or value") {
  using loom::InvalidArgument;
  std::vector<Sample> none;
  auto none_view = none | loom::views::bucket_by_shape({.max_samples = 2});
  CHECK_THROWS_WITH_AS(ranges::begin(none_view), doctest::Contains("dataset is empty"), InvalidArgument);
  loom::BucketCollator<> empty(loom::ShapeBucketOptions{.max_samples = 2});
  CHECK_THROWS_WITH_AS(empty.flush(), doctest::Contains("dataset is empty"), InvalidArgument);
  CHECK_THROWS_WITH_AS(empty.pop(), doctest::Contains("no batch ready"), InvalidArgument);

  std::vector<Sample> zero{{torch::zeros({3}), 0}, {torch::zeros({3, 0}), 0}};
  CHECK_THROWS_WITH_AS(run_collator({{torch::zeros({3, 0}), 0}}, loom::ShapeBucketOptions{.max_samples = 2}),
                       doctest::Contains("sample 0 has shape [3, 0]: a zero-size dimension"), InvalidArgument);
  std::vector<Sample> ranks{{torch::zeros({3, 4}), 0}, {torch::zeros({3, 4}), 0}, {torch::zeros({12}), 0}};
  CHECK_THROWS_WITH_AS(
      run_collator(ranks, loom::ShapeBucketOptions{.max_samples = 8}),
      doctest::Contains("sample 2 has shape [12] (1 dimensions) but sample 0 had [3, 4] (2 dimensions)"),
      InvalidArgument);
  std::vector<Sample> dtypes{{torch::zeros({3, 4}), 0}, {torch::zeros({3, 4}, torch::kDouble), 0}};
  CHECK_THROWS_WITH_AS(
      run_collator(dtypes, loom::ShapeBucketOptions{.max_samples = 8}),
      doctest::Contains(
          "sample 1 with shape [3, 4] has dtype Double, but its bucket [3, 4] holds dtype Float (from sample 0)"),
      InvalidArgument);
  // Different dtypes in *different* buckets are fine.
  std::vector<Sample> two{{torch::zeros({3, 4}), 0}, {torch::zeros({5}, torch::kDouble), 0}};
  CHECK_THROWS_AS(run_collator(two, loom::ShapeBucketOptions{.max_samples = 8}), InvalidArgument);  // ranks differ
  std::vector<Sample> ok{{torch::zeros({3, 4}), 0}, {torch::zeros({5, 4}, torch::kDouble), 0}};
  CHECK(run_collator(ok, loom::ShapeBucketOptions{.max_samples = 8}).size() == 2);

  CHECK_THROWS_WITH_AS(loom::BucketCollator<>(loom::ShapeBucketOptions{.max_samples = 0}),
                       doctest::Contains("max_samples = 0"), InvalidArgument);
  CHECK_THROWS_WITH_AS(loom::BucketCollator<>(loom::ShapeBucketOptions{}),
                       doctest::Contains("neither max_samples nor max_elements"), InvalidArgument);
  CHECK_THROWS_WITH_AS(loom::BucketCollator<>(loom::ShapeBucketOptions{.max_elements = -5}),
                       doctest::Contains("max_elements = -5"), InvalidArgument);
  CHECK_THROWS_WITH_AS(loom::BucketCollator<>(loom::ShapeBucketOptions{.max_samples = 10, .multiple_of = 4}),
                       doctest::Contains("max_samples = 10 is not a multiple of multiple_of = 4"), InvalidArgument);
  CHECK_THROWS_WITH_AS(loom::BucketCollator<>(loom::PaddedBucketOptions{.max_samples = 2}),
                       doctest::Contains("pad is empty"), InvalidArgument);
  CHECK_THROWS_WITH_AS(
      loom::BucketCollator<>(loom::PaddedBucketOptions{.pad = {{.dim = 0, .boundaries = {8, 4}}}, .max_samples = 2}),
      doctest::Contains("boundaries [8, 4] must be positive and strictly increasing"), InvalidArgument);
  CHECK_THROWS_WITH_AS(run_collator(sequences({3}), loom::PaddedBucketOptions{.pad = {{.dim = 2}}, .max_samples = 2}),
                       doctest::Contains("padded dimension 2 is out of range for sample 0 with shape [3]"),
                       InvalidArgument);
  // An element budget smaller than one sample.
  CHECK_THROWS_WITH_AS(
      run_collator(sequences({30}), loom::ShapeBucketOptions{.max_elements = 29}),
      doctest::Contains("sample 0 with shape [30] needs 30 (padded) elements, more than max_elements = 29"),
      InvalidArgument);
  // Targets of different shapes in one bucket.
  loom::BucketCollator<> tc(loom::ShapeBucketOptions{.max_samples = 4});
  tc.push(std::pair{torch::zeros({2}), torch::zeros({3})});
  CHECK_THROWS_WITH_AS(tc.push(std::pair{torch::zeros({2}), torch::zeros({4})}),
                       doctest::Contains("sample 1: target of shape [4]"), InvalidArgument);
}

TEST_CASE("collate(): one batch from a given list, padded to the max or to a given shape") {
  std::vector<Sample> s{{torch::tensor({1.f, 2.f}), 3}, {torch::tensor({5.f, 6.f, 7.f}), 4}};
  const std::vector<int64_t> idx{10, 11};
  auto b = loom::collate(s, idx, {.pad_value = 0, .mask = true});
  CHECK(torch::equal(b.data, torch::tensor({{1.f, 2.f, 0.f}, {5.f, 6.f, 7.f}})));
  CHECK(torch::equal(b.mask, torch::tensor({{true, true, false}, {true, true, true}})));
  CHECK(torch::equal(b.targets, torch::tensor({3, 4}, torch::kLong)));
  CHECK(b.indices == idx);
  auto c = loom::collate(s, idx, {.padded_shape = {4}, .pad_value = 9});
  CHECK(torch::equal(c.data, torch::tensor({{1.f, 2.f, 9.f, 9.f}, {5.f, 6.f, 7.f, 9.f}})));
  CHECK_THROWS_WITH_AS(loom::collate(s, idx, {.padded_shape = {2}}),
                       doctest::Contains("sample 11 with shape [3] does not fit padded_shape [2]"),
                       loom::InvalidArgument);
}

// ---- samples that share one output buffer ---------------------------------------------------
namespace {

// A decoder that writes every sample into the same preallocated buffers and returns views of
// them (as image decoders and tokenizers with an output buffer do): sample i is a 1-D float
// tensor of lengths[i] elements, all equal to i + 1, and a 2-element float target {i, -i}. Each
// call overwrites the previous sample's bytes.
struct ReusingDecoder {
  std::vector<int64_t> lengths;
  at::Tensor data = torch::empty({64}, torch::kFloat);
  at::Tensor target = torch::empty({2}, torch::kFloat);

  std::pair<at::Tensor, at::Tensor> operator()(int64_t i) const {
    at::Tensor d = data.narrow(0, 0, lengths[static_cast<std::size_t>(i)]);
    d.fill_(static_cast<float>(i + 1));
    target[0] = static_cast<float>(i);
    target[1] = static_cast<float>(-i);
    return {d, target};
  }
};

// What the batch holding samples `ids` (in row order) must contain, built without the collator:
// data rows i + 1 then pad_value up to the longest, mask, targets {i, -i}.
void check_decoded_batch(const loom::Batch& b, const std::vector<int64_t>& ids, const std::vector<int64_t>& lengths,
                         float pad, int64_t padded_len) {
  const auto n = static_cast<int64_t>(ids.size());
  at::Tensor data = torch::full({n, padded_len}, pad, torch::kFloat);
  at::Tensor mask = torch::zeros({n, padded_len}, torch::kBool);
  at::Tensor targets = torch::empty({n, 2}, torch::kFloat);
  for (int64_t r = 0; r < n; ++r) {
    const int64_t i = ids[static_cast<std::size_t>(r)];
    const int64_t len = lengths[static_cast<std::size_t>(i)];
    data[r].narrow(0, 0, len).fill_(static_cast<float>(i + 1));
    mask[r].narrow(0, 0, len).fill_(true);
    targets[r][0] = static_cast<float>(i);
    targets[r][1] = static_cast<float>(-i);
  }
  CHECK(b.indices == ids);
  CHECK(torch::equal(b.data, data));
  CHECK(torch::equal(b.mask, mask));
  CHECK(torch::equal(b.targets, targets));
}

}  // namespace

TEST_CASE("pad-to-max buckets read each sample when it arrives: a decoder that reuses one output buffer") {
  const std::vector<int64_t> lengths{3, 7, 2, 5, 4, 6, 1, 7, 3};
  ReusingDecoder decode{lengths};
  SUBCASE("BucketCollator, padded to the batch's longest") {
    loom::BucketCollator<> c(loom::PaddedBucketOptions{.pad = {{.dim = 0}}, .pad_value = -1, .max_samples = 4});
    std::vector<loom::Batch> out;
    for (int64_t i = 0; i < static_cast<int64_t>(lengths.size()); ++i) {
      c.push(i, decode(i));
      while (auto b = c.try_pop()) out.push_back(std::move(*b));
    }
    c.flush();
    while (auto b = c.try_pop()) out.push_back(std::move(*b));
    REQUIRE(out.size() == 3);
    check_decoded_batch(out[0], {0, 1, 2, 3}, lengths, -1.f, 7);
    check_decoded_batch(out[1], {4, 5, 6, 7}, lengths, -1.f, 7);
    check_decoded_batch(out[2], {8}, lengths, -1.f, 3);
  }
  SUBCASE("a budget-closed batch keeps its remainder pending across the emit") {
    // max_elements 20 padded elements: a batch closes when the next sample would push
    // count x longest over 20, and the rest of the input goes on into the same bucket.
    loom::BucketCollator<> c(loom::PaddedBucketOptions{.pad = {{.dim = 0}}, .pad_value = 0, .max_elements = 20});
    std::vector<loom::Batch> out;
    for (int64_t i = 0; i < static_cast<int64_t>(lengths.size()); ++i) {
      c.push(i, decode(i));
      while (auto b = c.try_pop()) out.push_back(std::move(*b));
    }
    c.flush();
    while (auto b = c.try_pop()) out.push_back(std::move(*b));
    // Greedy by hand: {0,1} (2x7=14; +2 -> 3x7=21), {2,3,4} (3x5=15; +5 -> 4x6=24), {5,6} (2x6=12;
    // +7 -> 3x7=21), {7} (1x7; +8 -> 2x7=14 fits), so {7, 8}.
    REQUIRE(out.size() == 4);
    check_decoded_batch(out[0], {0, 1}, lengths, 0.f, 7);
    check_decoded_batch(out[1], {2, 3, 4}, lengths, 0.f, 5);
    check_decoded_batch(out[2], {5, 6}, lengths, 0.f, 6);
    check_decoded_batch(out[3], {7, 8}, lengths, 0.f, 7);
  }
  SUBCASE("views::bucket_padded over a range that decodes on demand") {
    auto view = ranges::views::iota(int64_t{0}, static_cast<int64_t>(lengths.size())) |
                ranges::views::transform(decode) |
                loom::views::bucket_padded({.pad = {{.dim = 0}}, .pad_value = -1, .max_samples = 4});
    std::vector<loom::Batch> out;
    for (loom::Batch& b : view) out.push_back(std::move(b));
    REQUIRE(out.size() == 3);
    check_decoded_batch(out[0], {0, 1, 2, 3}, lengths, -1.f, 7);
    check_decoded_batch(out[1], {4, 5, 6, 7}, lengths, -1.f, 7);
    check_decoded_batch(out[2], {8}, lengths, -1.f, 3);
  }
  SUBCASE("collate() over a range that decodes on demand") {
    std::vector<int64_t> ids{0, 1, 2, 3, 4};
    auto decoded = ranges::views::iota(int64_t{0}, int64_t{5}) | ranges::views::transform(decode);
    const loom::Batch b = loom::collate(decoded, ids, {.pad_value = -1, .mask = true});
    check_decoded_batch(b, ids, lengths, -1.f, 7);
  }
}

TEST_CASE("DeviceTransfer: labels map to devices; a batch moves with Tensor::to; bad labels are named") {
  static_assert(loom::BatchTransfer<loom::DeviceTransfer, loom::Batch>);

  // Labels: index d of the type, or devices[d]; the CPU has one device whatever the label.
  const loom::DeviceTransfer cpu;
  CHECK(cpu.device(0) == c10::Device(c10::kCPU));
  CHECK(cpu.device(5) == c10::Device(c10::kCPU));
  const loom::DeviceTransfer by_index({.type = c10::kCUDA});
  CHECK(by_index.device(3) == c10::Device(c10::kCUDA, 3));
  CHECK_THROWS_WITH_AS((void)by_index.device(-1), doctest::Contains("device label -1 is negative"),
                       loom::InvalidArgument);
  const loom::DeviceTransfer mapped({.type = c10::kCUDA, .devices = {3, 1}});
  CHECK(mapped.device(0) == c10::Device(c10::kCUDA, 3));
  CHECK(mapped.device(1) == c10::Device(c10::kCUDA, 1));
  CHECK_THROWS_WITH_AS((void)mapped.device(2), doctest::Contains("device label 2 has no entry in devices [3, 1]"),
                       loom::InvalidArgument);

  auto host_batch = [] {
    loom::Batch b;
    b.data = torch::arange(6, torch::kFloat).reshape({2, 3});
    b.targets = torch::tensor({int64_t{4}, int64_t{9}});
    b.indices = {4, 9};
    b.num_samples = 2;
    b.weight = 0.5;
    b.step = 7;
    b.step_end = true;
    return b;
  };

  // To the CPU: the same tensors (no copy), no event.
  loom::Batch b = host_batch();
  const void* before = b.data.data_ptr();
  loom::DeviceTransfer to_cpu;
  auto ticket = to_cpu.start(b, 0);
  to_cpu.finish(b, 0, ticket);
  CHECK(b.data.data_ptr() == before);
  CHECK_FALSE(ticket.done.has_value());
  CHECK_FALSE(b.mask.defined());

  // To another device (meta: shapes and dtypes without storage, on any build): every defined
  // tensor moves; the bookkeeping fields stay.
  loom::Batch m = host_batch();
  m.mask = torch::ones({2, 3}, torch::kBool);
  loom::DeviceTransfer to_meta({.type = c10::kMeta});
  auto t2 = to_meta.start(m, 0);
  to_meta.finish(m, 0, t2);
  CHECK(m.data.is_meta());
  CHECK(m.targets.is_meta());
  CHECK(m.mask.is_meta());
  CHECK(m.data.sizes() == c10::IntArrayRef({2, 3}));
  CHECK((m.data.scalar_type() == at::kFloat));
  CHECK((m.targets.scalar_type() == at::kLong));
  CHECK(m.indices == std::vector<int64_t>{4, 9});
  CHECK(m.num_samples == 2);
  CHECK(m.weight == 0.5);
  CHECK(m.step == 7);
  CHECK(m.step_end);
  CHECK_FALSE(t2.done.has_value());  // meta has no streams: nothing to wait for
}

}  // namespace test_collate
