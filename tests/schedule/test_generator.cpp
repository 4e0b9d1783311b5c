// Concepts of loom/schedule (which types model them and which do not), the assignment
// policies, and the default collate step.
#include <functional>
#include <istream>
#include <list>
#include <sstream>
#include <tuple>

#include <doctest/doctest.h>
#include <torch/torch.h>

#include <loom/collate/transfer.hpp>
#include <loom/schedule/assign.hpp>
#include <loom/schedule/collate_fn.hpp>
#include <loom/schedule/detail/cursor.hpp>
#include <loom/schedule/detail/own_sample.hpp>
#include <loom/schedule/generator.hpp>

#include "helpers.hpp"

namespace test_generator {

namespace {

// ---- archetypes --------------------------------------------------------------------------------

// A single-pass input range that throws at a given element and fails the test if walked twice
// (begin() called a second time).
class SinglePassThrowing {
 public:
  SinglePassThrowing(int n, int throw_at) : n_(n), throw_at_(throw_at) {}
  struct iterator {
    using value_type = at::Tensor;
    using difference_type = std::ptrdiff_t;
    SinglePassThrowing* owner = nullptr;
    at::Tensor operator*() const {
      if (owner->pos_ == owner->throw_at_) throw std::runtime_error("single-pass archetype throws");
      return torch::full({2}, owner->pos_, torch::kLong);
    }
    iterator& operator++() {
      ++owner->pos_;
      return *this;
    }
    void operator++(int) { ++*this; }
    bool done() const { return owner->pos_ >= owner->n_; }
    friend bool operator==(const iterator& it, std::default_sentinel_t) { return it.done(); }
  };
  iterator begin() {
    REQUIRE_MESSAGE(!begun_, "single-pass range walked twice");
    begun_ = true;
    return iterator{this};
  }
  std::default_sentinel_t end() const { return {}; }

 private:
  int n_;
  int throw_at_;
  int pos_ = 0;
  bool begun_ = false;
};

struct NotOptional {  // returns a sample, but no way to say "ended"
  at::Tensor operator()() { return {}; }
};
struct NeedsArgument {
  std::optional<at::Tensor> operator()(int) { return {}; }
};
struct Immovable {
  Immovable() = default;
  Immovable(Immovable&&) = delete;
  std::optional<at::Tensor> operator()() { return {}; }
};
struct WithSkip {
  std::optional<int> operator()() { return 1; }
  void skip(int64_t) {}
};
struct RangeWithSkip : std::vector<int> {
  void skip(int64_t) {}
};
struct NoTicket {
  void start(loom::Batch&, int) {}
  void finish(loom::Batch&, int) {}
};

}  // namespace

// ---- SampleGenerator ---------------------------------------------------------------------------

TEST_CASE("SampleGenerator: callables returning optional and input ranges model it; others do not") {
  auto lambda = [k = 0]() mutable -> std::optional<at::Tensor> {
    return k++ < 3 ? std::optional(at::Tensor()) : std::nullopt;
  };
  static_assert(loom::CallableSampleGenerator<decltype(lambda)>);
  static_assert(loom::SampleGenerator<decltype(lambda)>);
  static_assert(loom::SampleGenerator<loom::test::Stream>);
  static_assert(loom::SampleGenerator<std::function<std::optional<at::Tensor>()>>);
  static_assert(loom::SampleGenerator<std::function<std::optional<std::pair<at::Tensor, int64_t>>()>>);
  static_assert(std::same_as<loom::generator_sample_t<decltype(lambda)>, at::Tensor>);

  static_assert(loom::RangeSampleGenerator<std::vector<at::Tensor>>);
  static_assert(loom::RangeSampleGenerator<std::list<int>>);
  static_assert(loom::RangeSampleGenerator<SinglePassThrowing>);
  static_assert(!std::ranges::forward_range<SinglePassThrowing>, "the archetype is single-pass only");
  static_assert(loom::SampleGenerator<SinglePassThrowing>);
  static_assert(std::same_as<loom::generator_sample_t<std::vector<int>>, int>);

  static_assert(!loom::SampleGenerator<int>);
  static_assert(!loom::SampleGenerator<NotOptional>, "no std::optional: no way to signal the end");
  static_assert(!loom::SampleGenerator<NeedsArgument>, "must be callable with no arguments");
  static_assert(!loom::SampleGenerator<Immovable>, "the loader takes ownership by move");
  static_assert(!loom::SampleGenerator<std::optional<at::Tensor>>, "an optional is a value, not a stream");

  static_assert(loom::SkippableSampleGenerator<WithSkip>);
  static_assert(loom::SkippableSampleGenerator<loom::test::SkippableStream>);
  static_assert(!loom::SkippableSampleGenerator<loom::test::Stream>);
  static_assert(!loom::SkippableSampleGenerator<RangeWithSkip>, "a range's position lives in its iterator");
}

TEST_CASE("GeneratorCursor: one interface for both kinds; never asks again after the end") {
  loom::detail::GeneratorCursor<std::vector<int>> c(std::vector<int>{4, 5, 6});
  CHECK(c.next() == std::optional<int>(4));
  CHECK(c.skip(1) == 1);
  CHECK(c.next() == std::optional<int>(6));
  CHECK_FALSE(c.next().has_value());
  CHECK(c.ended());
  CHECK_FALSE(c.next().has_value());

  int calls = 0;
  auto gen = [&calls]() -> std::optional<int> {
    ++calls;
    if (calls > 2) return std::nullopt;
    return calls * 10;
  };
  loom::detail::GeneratorCursor<decltype(gen)> c2(gen);
  CHECK(c2.skip(5) == 2);  // the stream had only 2 samples
  CHECK(c2.ended());
  CHECK_FALSE(c2.next().has_value());
  CHECK(calls == 3);  // two samples and the one end; not called after the end

  loom::detail::GeneratorCursor<SinglePassThrowing> c3(SinglePassThrowing(5, 2));
  CHECK(c3.next()->equal(torch::full({2}, 0, torch::kLong)));
  CHECK(c3.next()->equal(torch::full({2}, 1, torch::kLong)));
  CHECK_THROWS_WITH(c3.next(), "single-pass archetype throws");

  loom::detail::GeneratorCursor<loom::test::SkippableStream> c4(loom::test::SkippableStream{});
  CHECK(c4.skip(7) == 7);
  CHECK(c4.next()->equal(torch::tensor({int64_t{0}, int64_t{7}})));
}

// ---- assignment --------------------------------------------------------------------------------

TEST_CASE("assign: contiguous blocks, round-robin and explicit maps, uneven counts spread evenly") {
  using V = std::vector<std::vector<int>>;
  // 16 onto 8: generators 2i and 2i+1 on device i (contiguous); i and i+8 (round-robin).
  const V contiguous16 = loom::assign(loom::Assignment::contiguous(), 16, 8);
  const V robin16 = loom::assign(loom::Assignment::round_robin(), 16, 8);
  for (int d = 0; d < 8; ++d) {
    CHECK(contiguous16[static_cast<size_t>(d)] == std::vector<int>{2 * d, 2 * d + 1});
    CHECK(robin16[static_cast<size_t>(d)] == std::vector<int>{d, d + 8});
  }
  // 10 onto 4: the first 10 % 4 = 2 devices get 3 generators, the others 2.
  CHECK(loom::assign(loom::Assignment::contiguous(), 10, 4) == V{{0, 1, 2}, {3, 4, 5}, {6, 7}, {8, 9}});
  CHECK(loom::assign(loom::Assignment::round_robin(), 10, 4) == V{{0, 4, 8}, {1, 5, 9}, {2, 6}, {3, 7}});
  CHECK(loom::assign(loom::Assignment::contiguous(), 3, 1) == V{{0, 1, 2}});
  CHECK(loom::assign(loom::Assignment::round_robin(), 3, 1) == V{{0, 1, 2}});
  CHECK(loom::assign(loom::Assignment::explicit_map({1, 0, 1, 2}), 4, 3) == V{{1}, {0, 2}, {3}});
  CHECK(loom::generators_of(loom::Assignment::contiguous(), 16, 8, 3) == std::vector<int>{6, 7});

  // every generator exactly once, loads differ by at most one, for many (N, M)
  for (int m = 1; m <= 9; ++m)
    for (int n = m; n <= 40; ++n)
      for (auto policy : {loom::Assignment::contiguous(), loom::Assignment::round_robin()}) {
        const V a = loom::assign(policy, n, m);
        std::vector<int> seen(static_cast<size_t>(n), 0);
        size_t lo = SIZE_MAX, hi = 0;
        for (const auto& gens : a) {
          lo = std::min(lo, gens.size());
          hi = std::max(hi, gens.size());
          CHECK(std::is_sorted(gens.begin(), gens.end()));
          for (int g : gens) ++seen[static_cast<size_t>(g)];
        }
        CHECK(hi - lo <= 1);
        CHECK(hi == static_cast<size_t>((n + m - 1) / m));
        CHECK(std::all_of(seen.begin(), seen.end(), [](int c) { return c == 1; }));
      }
}

TEST_CASE("assign: bad input names the value") {
  CHECK_THROWS_WITH_AS(loom::assign(loom::Assignment::contiguous(), 3, 4),
                       doctest::Contains("3 generators onto 4 devices"), loom::InvalidArgument);
  CHECK_THROWS_AS(loom::assign(loom::Assignment::contiguous(), 0, 1), loom::InvalidArgument);
  CHECK_THROWS_AS(loom::assign(loom::Assignment::round_robin(), 4, 0), loom::InvalidArgument);
  CHECK_THROWS_WITH_AS(loom::assign(loom::Assignment::explicit_map({0, 5}), 2, 2),
                       doctest::Contains("generator 1 to device 5"), loom::InvalidArgument);
  CHECK_THROWS_WITH_AS(loom::assign(loom::Assignment::explicit_map({0, 0}), 2, 2),
                       doctest::Contains("device 1 no generator"), loom::InvalidArgument);
  CHECK_THROWS_WITH_AS(loom::assign(loom::Assignment::explicit_map({0}), 2, 1),
                       doctest::Contains("1 entries but there are 2 generators"), loom::InvalidArgument);
  CHECK_THROWS_AS(loom::generators_of(loom::Assignment::contiguous(), 4, 2, 2), loom::InvalidArgument);
}

// ---- collate and transfer ------------------------------------------------------------------------

TEST_CASE("DefaultCollate stacks: rows in sample order, targets, generator ids; shape mismatch names the generator") {
  static_assert(loom::CollateFunction<loom::DefaultCollate<>, at::Tensor>);
  static_assert(loom::CollateFunction<loom::DefaultCollate<>, std::pair<at::Tensor, int64_t>>);
  static_assert(loom::CollateFunction<loom::DefaultCollate<>, std::tuple<at::Tensor, int64_t>>);
  static_assert(!loom::CollateFunction<loom::DefaultCollate<>, int>, "DefaultCollate needs a tensor in the sample");
  static_assert(loom::BatchTransfer<loom::HostTransfer, loom::Batch>);
  static_assert(!loom::BatchTransfer<NoTicket, loom::Batch>, "a transfer names its Ticket type");

  loom::DefaultCollate<> collate_fn;
  std::vector<std::pair<at::Tensor, int64_t>> samples = {{torch::tensor({1.0f, 2.0f}), 7},
                                                         {torch::tensor({3.0f, 4.0f}), 9}};
  std::vector<int> ids = {4, 6};
  loom::Batch b = collate_fn(std::span(samples), loom::CollateContext{.device = 2, .step = 5, .generators = ids});
  CHECK(b.data.equal(torch::tensor({{1.0f, 2.0f}, {3.0f, 4.0f}})));
  CHECK(b.targets.equal(torch::tensor({int64_t{7}, int64_t{9}})));
  CHECK(b.indices == std::vector<int64_t>{4, 6});
  CHECK(b.num_samples == 2);
  CHECK(b.weight == 1.0);

  // non-contiguous sample: copied through the strided path
  std::vector<at::Tensor> nc = {torch::arange(6).reshape({2, 3}).t(), torch::arange(6, 12).reshape({2, 3}).t()};
  std::vector<int> ids2 = {0, 1};
  loom::Batch b2 = collate_fn(std::span(nc), loom::CollateContext{.generators = ids2});
  CHECK(b2.data.equal(torch::stack({nc[0], nc[1]})));

  // 2-tuples are read like pairs (loom::DefaultProjection, the one reading of a sample)
  std::vector<std::tuple<at::Tensor, int64_t>> tup = {{torch::tensor({5.0f}), 1}, {torch::tensor({6.0f}), 2}};
  loom::Batch b3 = collate_fn(std::span(tup), loom::CollateContext{.generators = ids2});
  CHECK(b3.data.equal(torch::tensor({{5.0f}, {6.0f}})));
  CHECK(b3.targets.equal(torch::tensor({int64_t{1}, int64_t{2}})));

  std::vector<at::Tensor> bad = {torch::zeros({2, 3}), torch::zeros({3, 2})};
  std::vector<int> ids3 = {10, 11};
  CHECK_THROWS_WITH_AS(
      collate_fn(std::span(bad), loom::CollateContext{.device = 1, .step = 3, .generators = ids3}),
      doctest::Contains(
          "device 1, step 3: generator 10 gave a data tensor of shape [2, 3] Float, generator 11 gave [3, 2] Float"),
      loom::InvalidArgument);
  std::vector<at::Tensor> mixed = {torch::zeros({2}), torch::zeros({2}, torch::kLong)};
  CHECK_THROWS_WITH_AS(collate_fn(std::span(mixed), loom::CollateContext{.generators = ids3}),
                       doctest::Contains("generator 11"), loom::InvalidArgument);
  CHECK(collate_fn.empty({}).weight == 0.0);
}

namespace {
struct Tagged {  // a sample that carries its own dataset index
  at::Tensor data;
  int64_t target = 0;
  int64_t index = 0;
};
}  // namespace

TEST_CASE("DefaultCollate: loom's collator — exact by default, padding with a mask when asked, projection index") {
  static_assert(loom::CollateFunction<loom::DefaultCollate<>, at::Tensor>);
  static_assert(loom::CollateFunction<loom::DefaultCollate<>, std::pair<at::Tensor, int64_t>>);
  static_assert(loom::CollateFunction<loom::DefaultCollate<>, Tagged>);
  static_assert(!loom::CollateFunction<loom::DefaultCollate<>, int>, "the projection cannot read an int");
  static_assert(std::same_as<loom::collate_result_t<loom::DefaultCollate<>, at::Tensor>, loom::Batch>);

  std::vector<int> ids = {3, 5};
  SUBCASE("same shapes: stacked, generator ids as indices, integer targets") {
    std::vector<std::pair<at::Tensor, int64_t>> s = {{torch::tensor({1.0f, 2.0f}), 7},
                                                     {torch::tensor({3.0f, 4.0f}), 9}};
    loom::Batch b = loom::DefaultCollate<>{}(std::span(s), {.device = 1, .step = 2, .generators = ids});
    CHECK(b.data.equal(torch::tensor({{1.0f, 2.0f}, {3.0f, 4.0f}})));
    CHECK(b.targets.equal(torch::tensor({int64_t{7}, int64_t{9}})));
    CHECK(b.indices == std::vector<int64_t>{3, 5});
    CHECK_FALSE(b.mask.defined());
  }
  SUBCASE("different shapes without pad: the error names device, step and both generators") {
    std::vector<at::Tensor> s = {torch::zeros({2}), torch::zeros({3})};
    CHECK_THROWS_WITH_AS(
        loom::DefaultCollate<>{}(std::span(s), {.device = 1, .step = 2, .generators = ids}),
        doctest::Contains(
            "device 1, step 2: generator 3 gave a data tensor of shape [2] Float, generator 5 gave [3] Float"),
        loom::InvalidArgument);
  }
  SUBCASE("different shapes with pad: padded to the step's largest, mask marks real elements") {
    std::vector<at::Tensor> s = {torch::tensor({1.0f, 2.0f}), torch::tensor({3.0f, 4.0f, 5.0f})};
    loom::DefaultCollate<> collate_fn{.pad = true, .options = {.pad_value = -1.0, .mask = true}};
    loom::Batch b = collate_fn(std::span(s), {.generators = ids});
    CHECK(b.data.equal(torch::tensor({{1.0f, 2.0f, -1.0f}, {3.0f, 4.0f, 5.0f}})));
    CHECK(b.mask.equal(torch::tensor({{true, true, false}, {true, true, true}})));
  }
  SUBCASE("a projection with index(): the sample's own index, not the generator id") {
    std::vector<Tagged> s = {{torch::ones({2}), 1, 100}, {torch::zeros({2}), 0, 200}};
    loom::Batch b = loom::DefaultCollate<>{}(std::span(s), {.generators = ids});
    CHECK(b.indices == std::vector<int64_t>{100, 200});
    CHECK(b.targets.equal(torch::tensor({int64_t{1}, int64_t{0}})));
  }
  SUBCASE("collate's own errors carry the device and step") {
    std::vector<at::Tensor> s = {torch::zeros({0}), torch::zeros({0})};
    CHECK_THROWS_WITH_AS(loom::DefaultCollate<>{}(std::span(s), {.device = 4, .step = 6, .generators = ids}),
                         doctest::Contains("DefaultCollate: device 4, step 6 (sample index = generator id)"),
                         loom::InvalidArgument);
  }
}

// ---- samples made their own on arrival -----------------------------------------------------------

namespace {
struct TensorTarget {  // a struct sample with a tensor target
  at::Tensor data;
  at::Tensor target;
};
struct Opaque {  // a sample DefaultProjection does not read
  at::Tensor image;
};
}  // namespace

TEST_CASE("own_sample: tensors that share their memory are copied, tensors that own it are kept") {
  SUBCASE("a fresh tensor is kept as it is (no copy)") {
    at::Tensor fresh = torch::arange(4);
    const void* p = fresh.data_ptr();
    CHECK(loom::detail::owns_its_memory(fresh));
    loom::detail::own_sample(fresh);
    CHECK(fresh.data_ptr() == p);
  }
  SUBCASE("a generator's buffer, a view of it, memory wrapped with from_blob: copied, values equal") {
    at::Tensor buffer = torch::arange(6, torch::kFloat);
    at::Tensor same = buffer;
    at::Tensor view = buffer.narrow(0, 2, 3);
    std::vector<float> mem{1.f, 2.f, 3.f};
    at::Tensor blob = torch::from_blob(mem.data(), {3});
    CHECK_FALSE(loom::detail::owns_its_memory(same));
    CHECK_FALSE(loom::detail::owns_its_memory(view));
    CHECK_FALSE(loom::detail::owns_its_memory(blob));
    loom::detail::own_sample(same);
    loom::detail::own_sample(view);
    loom::detail::own_sample(blob);
    CHECK(same.data_ptr() != buffer.data_ptr());
    CHECK(view.data_ptr() != static_cast<float*>(buffer.data_ptr()) + 2);
    CHECK(blob.data_ptr() != static_cast<void*>(mem.data()));
    buffer.fill_(-1.f);
    mem[0] = -1.f;
    CHECK(same.equal(torch::arange(6, torch::kFloat)));
    CHECK(view.equal(torch::tensor({2.f, 3.f, 4.f})));
    CHECK(blob.equal(torch::tensor({1.f, 2.f, 3.f})));
  }
  SUBCASE("pairs, tuples and .data/.target structs: every tensor loom reads") {
    at::Tensor buffer = torch::ones({2});
    std::pair<at::Tensor, at::Tensor> pair{buffer, buffer};
    std::tuple<at::Tensor, int64_t> tuple{buffer, 3};
    TensorTarget st{buffer, buffer};
    loom::detail::own_sample(pair);
    loom::detail::own_sample(tuple);
    loom::detail::own_sample(st);
    for (const at::Tensor* t : {&pair.first, &pair.second, &std::get<0>(tuple), &st.data, &st.target})
      CHECK(t->data_ptr() != buffer.data_ptr());
  }
  SUBCASE("a sample type loom does not read is left alone") {
    at::Tensor buffer = torch::ones({2});
    Opaque o{buffer};
    loom::detail::own_sample(o);
    CHECK(o.image.data_ptr() == buffer.data_ptr());
  }
}

}  // namespace test_generator
