// The deterministic reducer (ReducerOptions::deterministic) in one process: the grid arithmetic
// against hand-computed integers, the CPU loops against the ATen ops, the reduced gradient's
// independence of micro-batch order, its error against a float64 reference across magnitudes,
// the exponent rule, overflow and inf/NaN. Real ranks (identical bytes on 1-4 ranks, resume on
// another world size): tests/train/test_exact_dist.cpp.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <optional>
#include <vector>

#include <doctest/doctest.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>

#include <loom/accumulate/accumulator.hpp>
#include <loom/comm/local.hpp>
#include <loom/reduce/detail/exact.hpp>
#include <loom/reduce/detail/grid_aten.hpp>
#include <loom/reduce/detail/host_path.hpp>
#include <loom/reduce/reducer.hpp>

#include "support/models.hpp"

namespace test_grid {

namespace {

namespace d = loom::detail;

/// The bytes of every tensor, concatenated (bit-identity checks).
std::vector<unsigned char> bytes_of(const std::vector<at::Tensor>& ts) {
  std::vector<unsigned char> out;
  for (const auto& t : ts) {
    auto c = t.detach().contiguous();
    const auto* p = static_cast<const unsigned char*>(c.data_ptr());
    out.insert(out.end(), p, p + c.numel() * static_cast<std::int64_t>(c.element_size()));
  }
  return out;
}

at::Tensor param(std::vector<float> v) {
  return torch::tensor(v, torch::kFloat).requires_grad_();
}

/// One contribution written by hand: the parameter's gradient is `g`, then marked ready.
template <class R>
void contribute(R& reducer, std::size_t index, const at::Tensor& p, const at::Tensor& g) {
  p.mutable_grad() = g.clone();
  reducer.mark_ready(index);
}

}  // namespace

TEST_CASE("grid: contributions are rounded to the nearest grid point, half to even") {
  // exponent 3: grid step 1/8. 0.0625 = 0.5 steps -> 0; 0.1875 = 1.5 -> 2; 0.3125 = 2.5 -> 2;
  // -0.3125 -> -2; 0.15 = 1.2 -> 1; 100 -> 800.
  std::vector<float> g{0.0625f, 0.1875f, 0.3125f, -0.3125f, 0.15f, 100.0f};
  std::vector<std::int64_t> q(g.size(), 5);  // adds to what is there
  const auto f = d::quantize_add_cpu(g.data(), q.data(), static_cast<std::int64_t>(g.size()), 3);
  CHECK(q == std::vector<std::int64_t>{5, 7, 7, 3, 6, 805});
  CHECK(std::all_of(g.begin(), g.end(), [](float v) { return v == 0.0f; }));
  CHECK_FALSE(f.non_finite);
  CHECK_FALSE(f.overflow);
  CHECK_FALSE(f.near);

  // The limit is 2^42 grid units, "near" from 2^40: at exponent 0, 2^41 is near, 2^42 overflows;
  // an inf is not finite; neither is added.
  std::vector<double> big{std::ldexp(1.0, 41), std::ldexp(1.0, 42), std::numeric_limits<double>::infinity(), 1.0};
  std::vector<std::int64_t> qb(big.size(), 0);
  const auto fb = d::quantize_add_cpu(big.data(), qb.data(), 4, 0);
  CHECK(qb == std::vector<std::int64_t>{std::int64_t{1} << 41, 0, 0, 1});
  CHECK(fb.near);
  CHECK(fb.overflow);
  CHECK(fb.non_finite);
}

TEST_CASE(
    "grid: on the CPU, the fused loops and the ATen ops (the path of GPU buckets) give the same integers and bits") {
  at::manual_seed(7);
  // Magnitudes from 1e-12 to 1e3 with both signs, float32.
  auto mag = torch::pow(10.0, torch::rand({4096}, torch::kDouble) * 15 - 12);
  auto sign = torch::randint(0, 2, {4096}, torch::kDouble) * 2 - 1;
  const at::Tensor g = (mag * sign).to(torch::kFloat);
  for (int exponent : {0, 20, 30}) {
    at::Tensor g1 = g.clone(), g2 = g.clone();
    at::Tensor q1 = torch::zeros({4096}, torch::kLong), q2 = torch::zeros({4096}, torch::kLong);
    const auto f = d::quantize_add_cpu(g1.data_ptr<float>(), q1.data_ptr<std::int64_t>(), 4096, exponent);
    auto flags = torch::zeros({3}, torch::kLong);
    d::quantize_add_aten(g2, q2, exponent, flags.narrow(0, 0, 1), flags.narrow(0, 1, 1), flags.narrow(0, 2, 1));
    CHECK(torch::equal(q1, q2));
    CHECK(torch::equal(g1, g2));  // both zeroed
    CHECK(flags[0].item<std::int64_t>() == (f.non_finite ? 1 : 0));
    CHECK(flags[1].item<std::int64_t>() == (f.overflow ? 1 : 0));
    CHECK(flags[2].item<std::int64_t>() == (f.near ? 1 : 0));
    // An independent rounding: float64 nearest-even of g x 2^e for the elements below the limit.
    auto x = g.to(torch::kDouble) * std::ldexp(1.0, exponent);
    auto expected = torch::where(x.abs() < d::kGridLimit, x.round(), torch::zeros_like(x)).to(torch::kLong);
    CHECK(torch::equal(q1, expected));

    at::Tensor out1 = torch::empty({4096}, torch::kFloat), out2 = torch::empty({4096}, torch::kFloat);
    bool bad = false;
    const auto largest =
        d::dequantize_cpu(q1.data_ptr<std::int64_t>(), out1.data_ptr<float>(), 4096, exponent, 3.0, 7.0, bad);
    auto [largest2, bad2] = d::dequantize_aten(q2, out2, exponent, 3.0, 7.0);
    CHECK(bytes_of({out1}) == bytes_of({out2}));
    CHECK(largest == largest2.item<std::int64_t>());
    CHECK(largest == q1.abs().max().item<std::int64_t>());
    CHECK_FALSE(bad);
    CHECK(bad2.item<std::int64_t>() == 0);
  }
}

TEST_CASE("grid: the int32 wire takes values up to (2^31 - 1) / world size, and turns back to the same bits") {
  CHECK(d::wire_limit(1) == 2147483647);
  CHECK(d::wire_limit(2) == 1073741823);
  CHECK(d::wire_limit(3) == 715827882);  // 3 x 715827882 = 2147483646 <= 2^31 - 1
  CHECK(d::wire_limit(8) == 268435455);
  const std::int64_t limit = d::wire_limit(3);
  std::vector<std::int64_t> q{0, 1, -1, limit, -limit, 123456789, -987654};
  std::vector<std::int32_t> w(q.size(), 77);
  CHECK(d::narrow_to_wire_cpu(q.data(), w.data(), static_cast<std::int64_t>(q.size()), limit));
  CHECK(std::equal(q.begin(), q.end(), w.begin()));
  for (std::int64_t over : {limit + 1, -limit - 1, std::int64_t{1} << 40}) {
    std::vector<std::int64_t> q2 = q;
    q2[3] = over;
    CAPTURE(over);
    CHECK_FALSE(d::narrow_to_wire_cpu(q2.data(), w.data(), static_cast<std::int64_t>(q2.size()), limit));
  }
  // More elements than one parallel chunk (2^16), the value out of range in the last one.
  std::vector<std::int64_t> many(200000, -5);
  std::vector<std::int32_t> wm(many.size());
  CHECK(d::narrow_to_wire_cpu(many.data(), wm.data(), 200000, limit));
  CHECK(std::all_of(wm.begin(), wm.end(), [](std::int32_t v) { return v == -5; }));
  many[199999] = limit + 1;
  CHECK_FALSE(d::narrow_to_wire_cpu(many.data(), wm.data(), 200000, limit));

  // Quantizing straight onto the wire: without sums the wire gets the rounded gradient, with sums
  // their total; neither the gradient nor the sums change, and `wide` says when one is above the
  // limit (here 10 at exponent 0: limit 10 fits, 11 does not).
  std::vector<float> g1{3.0f, -10.0f, 0.5f, 2.5f};
  std::vector<std::int32_t> w1(4, 77);
  auto f1 = d::quantize_to_wire_cpu(g1.data(), nullptr, w1.data(), 4, 0, 10);
  CHECK(w1 == std::vector<std::int32_t>{3, -10, 0, 2});  // half to even: 0.5 -> 0, 2.5 -> 2
  CHECK_FALSE(f1.wide);
  CHECK(g1 == std::vector<float>{3.0f, -10.0f, 0.5f, 2.5f});
  std::vector<float> g2{8.0f, 0.0f, 1.5f, 0.0f};
  const std::vector<std::int64_t> sums{3, -10, 0, 2};
  std::vector<std::int64_t> q1 = sums;
  auto f2 = d::quantize_to_wire_cpu(g2.data(), q1.data(), w1.data(), 4, 0, 10);
  CHECK(w1[0] == 11);
  CHECK(w1[1] == -10);
  CHECK(w1[2] == 2);  // 1.5 -> 2
  CHECK(f2.wide);
  CHECK(q1 == sums);
  CHECK(g2[0] == 8.0f);
  // The int64 resend from the same gradient and sums: the wire's integers without the int32 limit,
  // the gradient kept; without keep_gradient it is zeroed.
  auto f3 = d::quantize_add_cpu(g2.data(), q1.data(), 4, 0, /*first=*/false, /*keep_gradient=*/true);
  CHECK(q1 == std::vector<std::int64_t>{11, -10, 2, 2});
  CHECK_FALSE(f3.wide);
  CHECK(g2 == std::vector<float>{8.0f, 0.0f, 1.5f, 0.0f});
  std::vector<std::int64_t> q2(4, 1000);
  d::quantize_add_cpu(g2.data(), q2.data(), 4, 0, /*first=*/true);
  CHECK(q2 == std::vector<std::int64_t>{8, 0, 2, 0});
  CHECK(std::all_of(g2.begin(), g2.end(), [](float v) { return v == 0.0f; }));

  // Straight onto the wire from float32 without sums (4 at a time on x86-64, pieces with a value
  // outside the limit redone one by one) against a naive reference: std::nearbyint per element,
  // flags by definition. 20011 elements (not a multiple of 4, several pieces), magnitudes from
  // 1e-9 to 3e3 grid units; then a NaN, an inf, a near-limit and an overflowing value.
  {
    const std::int64_t count = 20011, wlimit = d::wire_limit(2);
    const int e = 20;
    at::manual_seed(5);
    auto base = (at::rand({count}, at::kDouble) * 2 - 1) * at::pow(10.0, at::rand({count}, at::kDouble) * 12 - 9);
    std::vector<float> gv(static_cast<std::size_t>(count));
    for (std::int64_t i = 0; i < count; ++i)
      gv[static_cast<std::size_t>(i)] = static_cast<float>(base[i].item<double>() * std::ldexp(1.0, -e));
    gv[7] = 0.5f * static_cast<float>(std::ldexp(1.0, -e));  // a tie: rounds to 0 (even)
    gv[8] = 1.5f * static_cast<float>(std::ldexp(1.0, -e));  // rounds to 2
    auto check_against_naive = [&](const std::vector<float>& gin, std::int64_t lim) {
      std::vector<std::int32_t> wv(gin.size(), 7);
      const auto f =
          d::quantize_to_wire_cpu(gin.data(), nullptr, wv.data(), static_cast<std::int64_t>(gin.size()), e, lim);
      bool bad = false, over = false, close = false, wide = false;
      for (std::size_t i = 0; i < gin.size(); ++i) {
        if (!std::isfinite(gin[i])) {
          bad = true;
          continue;
        }
        const double x = std::ldexp(static_cast<double>(gin[i]), e);
        if (std::abs(x) >= std::ldexp(1.0, 42)) {
          over = true;
          continue;
        }
        if (std::abs(x) >= std::ldexp(1.0, 40)) close = true;
        const double r = std::nearbyint(x);
        if (std::abs(r) > static_cast<double>(lim)) {
          wide = true;
          continue;
        }
        if (wv[i] != static_cast<std::int32_t>(r)) {
          FAIL_CHECK(fmt::format("element {}: wire {} against {}", i, wv[i], r));
          break;
        }
      }
      CHECK(f.non_finite == bad);
      CHECK(f.overflow == over);
      CHECK(f.near == close);
      CHECK(f.wide == wide);
      return wide;
    };
    CHECK_FALSE(check_against_naive(gv, wlimit));
    std::vector<float> odd = gv;
    odd[5000] = std::numeric_limits<float>::quiet_NaN();
    odd[9001] = std::numeric_limits<float>::infinity();
    odd[12000] = static_cast<float>(std::ldexp(1.0, 41 - e));   // near the limit
    odd[15003] = static_cast<float>(-std::ldexp(1.0, 43 - e));  // above it
    odd[20010] = static_cast<float>(std::ldexp(3.0, 30 - e));   // above the wire's limit, last element
    CHECK(check_against_naive(odd, wlimit));
    // Only one value above the wire's limit (2^30 > 2^30 - 1 grid units), inside a 4-lane group.
    std::vector<float> one_wide = gv;
    one_wide[101] = static_cast<float>(std::ldexp(1.0, 30 - e));
    CHECK(check_against_naive(one_wide, wlimit));
    // At the limit exactly (1000 here): 1000, -1000 and the tie 1000.5 (to 1000) fit, in lanes of
    // groups the vector loop keeps; 1001 does not.
    std::vector<float> at_limit(8195, static_cast<float>(std::ldexp(0.25, -e)));
    at_limit[40] = static_cast<float>(std::ldexp(1000.0, -e));
    at_limit[41] = static_cast<float>(std::ldexp(-1000.0, -e));
    at_limit[42] = static_cast<float>(std::ldexp(1000.5, -e));
    at_limit[5003] = static_cast<float>(std::ldexp(-999.5, -e));  // a tie to -1000
    CHECK_FALSE(check_against_naive(at_limit, 1000));
    at_limit[43] = static_cast<float>(std::ldexp(1001.0, -e));
    CHECK(check_against_naive(at_limit, 1000));
  }

  // The same integers as int32 or int64 turn back to the same bits and the same largest magnitude.
  std::vector<float> out64(q.size()), out32(q.size());
  bool bad64 = false, bad32 = false;
  std::vector<std::int32_t> w2(q.size());
  REQUIRE(d::narrow_to_wire_cpu(q.data(), w2.data(), static_cast<std::int64_t>(q.size()), limit));
  const auto n = static_cast<std::int64_t>(q.size());
  CHECK(d::dequantize_cpu(q.data(), out64.data(), n, 20, 3.0, 7.0, bad64) == limit);
  CHECK(d::dequantize_cpu(w2.data(), out32.data(), n, 20, 3.0, 7.0, bad32) == limit);
  CHECK(std::memcmp(out64.data(), out32.data(), out64.size() * sizeof(float)) == 0);
  CHECK(out64[5] == static_cast<float>(123456789.0 * (std::ldexp(1.0, -20) * 3.0 / 7.0)));

  // Longer than the int32 loop's blocks of 8 (1003 = 125 blocks and 3 left), both signs, the
  // largest magnitude in a block's lane and then in the rest; and results that overflow float32.
  at::manual_seed(11);
  at::Tensor big = torch::randint(-(std::int64_t{1} << 30), std::int64_t{1} << 30, {1003}, torch::kLong);
  for (std::int64_t where : {std::int64_t{517}, std::int64_t{1001}}) {
    at::Tensor qq = big.clone();
    qq[where] = -(std::int64_t{1} << 31) + 1;
    at::Tensor ww = qq.to(torch::kInt);
    for (int e : {20, -120}) {  // -120: 2^120 x 2^30 overflows float32
      at::Tensor o64 = torch::empty({1003}, torch::kFloat), o32 = torch::empty({1003}, torch::kFloat);
      bool b64 = false, b32 = false;
      const auto l64 = d::dequantize_cpu(qq.data_ptr<std::int64_t>(), o64.data_ptr<float>(), 1003, e, 1.0, 3.0, b64);
      const auto l32 = d::dequantize_cpu(ww.data_ptr<std::int32_t>(), o32.data_ptr<float>(), 1003, e, 1.0, 3.0, b32);
      CAPTURE(where);
      CAPTURE(e);
      CHECK(l64 == (std::int64_t{1} << 31) - 1);
      CHECK(l32 == l64);
      CHECK(b64 == (e < 0));
      CHECK(b32 == b64);
      CHECK(bytes_of({o64}) == bytes_of({o32}));
      CHECK(o32[where].item<float>() ==
            static_cast<float>(static_cast<double>(-(std::int64_t{1} << 31) + 1) * (std::ldexp(1.0, -e) * 1.0 / 3.0)));
    }
  }
}

TEST_CASE("grid: the exponent rule, by hand") {
  CHECK(d::next_grid_exponent(32, std::int64_t{600} << 32, false, true) == 16);  // 42 bits -> aimed at 26
  CHECK(d::next_grid_exponent(32, std::int64_t{1} << 25, false, true) == 32);    // 26 bits: unchanged
  CHECK(d::next_grid_exponent(32, 1, false, true) == 40);                        // rises by at most 8
  CHECK(d::next_grid_exponent(32, 0, false, false) == 32);                       // no gradient: nothing to go by
  CHECK(d::next_grid_exponent(32, 0, false, true) == 40);  // gradients that rounded to 0: a finer grid
  CHECK(d::next_grid_exponent(92, 0, false, true) == 96);  // up to the ceiling
  CHECK(d::next_grid_exponent(96, 0, false, true) == 96);  // and no further
  CHECK(d::next_grid_exponent(32, std::int64_t{1} << 25, true, true) == 30);  // near the limit: 2 lower
  CHECK(d::backed_off_grid_exponent(32) == 16);
  CHECK(d::next_grid_exponent(d::kGridMaxExponent, 1, false, true) == d::kGridMaxExponent);
}

TEST_CASE(
    "deterministic reducer: a gradient below the first grid's half step (2^-40) is trained from its second window") {
  // The first grid's step is 2^-32: 2^-40 rounds to 0. The parameter was used, so the next grid is
  // 2^8 finer, where 2^-40 is one step: the second window's gradient is 2^-40 exactly. A parameter
  // that gets no gradient keeps its grid; one whose gradient is exactly 0 rises to the ceiling only.
  loom::LocalCommunicator comm;
  auto w = torch::zeros({2}, torch::kDouble).requires_grad_();
  auto unused = torch::zeros({1}, torch::kDouble).requires_grad_();
  loom::Reducer reducer(comm, {.names = {"w", "unused"}, .params = {w, unused}}, {.deterministic = true});
  const double tiny = std::ldexp(1.0, -40);
  std::vector<double> seen;
  for (int window = 0; window < 3; ++window) {
    if (w.grad().defined()) w.mutable_grad().zero_();  // the optimizer's zero_grad between steps
    reducer.prepare_backward({.sync = true, .window_samples = 1});
    (w * torch::tensor({tiny, 0.0}, torch::kDouble)).sum().backward();
    REQUIRE_FALSE(reducer.finish_window().grid_overflow);
    seen.push_back(w.grad()[0].item<double>());
    CHECK(w.grad()[1].item<double>() == 0.0);
  }
  CHECK(seen == std::vector<double>{0.0, tiny, tiny});
  const auto exponents = reducer.grid_exponents();
  REQUIRE(exponents.size() == 2);
  CHECK(exponents[1] == 32);  // never used: the first grid
}

TEST_CASE("deterministic reducer: the gradient's bytes do not depend on the order or grouping of micro-batches") {
  // 6 micro-batches of 1..6 samples; float mode sums them in float32 in the order given, the
  // deterministic mode as integers. Orders: as listed, reversed, interleaved.
  const std::vector<std::vector<int>> orders{{0, 1, 2, 3, 4, 5}, {5, 4, 3, 2, 1, 0}, {3, 0, 5, 1, 4, 2}};
  std::vector<std::vector<unsigned char>> seen;
  std::vector<at::Tensor> reference;
  for (const auto& order : orders) {
    loom::test::Mlp model(at::kFloat);
    loom::LocalCommunicator comm;
    loom::Reducer reducer(comm, model.list(), {.deterministic = true});
    loom::Accumulator acc(reducer, {.micro_batches_per_step = 6});
    loom::SyncResult s;
    for (int m : order) {
      const std::int64_t first = m * (m + 1) / 2, n = m + 1;
      auto mb = acc.micro_batch(n);
      model.loss_sum(loom::test::batch_x(first, n, at::kFloat), loom::test::batch_y(first, n, at::kFloat)).backward();
      s = mb.finish();
    }
    REQUIRE(s.apply);
    CHECK(s.global_samples == 21);
    seen.push_back(bytes_of(model.grads()));
    if (reference.empty()) {
      // float64 reference: the mean gradient over the 21 samples.
      auto p64 = model.clone64();
      for (auto& p : p64) p.mutable_grad() = at::Tensor();
      ((loom::test::Mlp::forward_with(p64, loom::test::batch_x(0, 21)) - loom::test::batch_y(0, 21)).pow(2).sum() / 21)
          .backward();
      for (auto& p : p64) reference.push_back(p.grad());
      const auto g = model.grads();
      for (std::size_t k = 0; k < g.size(); ++k) {
        const double err = (g[k].to(at::kDouble) - reference[k]).abs().max().item<double>();
        const double scale = reference[k].abs().max().item<double>();
        CHECK_MESSAGE(err <= 1e-6 * scale, fmt::format("parameter {}: {} against {}", k, err, scale));
      }
    }
  }
  CHECK(seen[1] == seen[0]);
  CHECK(seen[2] == seen[0]);
  // The floating reducer on the same orders: float32 sums in another order round differently, so
  // the comparison above can fail.
  std::vector<std::vector<unsigned char>> floating;
  for (const auto& order : orders) {
    loom::test::Mlp model(at::kFloat);
    loom::LocalCommunicator comm;
    loom::Reducer reducer(comm, model.list());
    loom::Accumulator acc(reducer, {.micro_batches_per_step = 6});
    for (int m : order) {
      const std::int64_t first = m * (m + 1) / 2, n = m + 1;
      auto mb = acc.micro_batch(n);
      model.loss_sum(loom::test::batch_x(first, n, at::kFloat), loom::test::batch_y(first, n, at::kFloat)).backward();
      (void)mb.finish();
    }
    floating.push_back(bytes_of(model.grads()));
  }
  CHECK((floating[1] != floating[0] || floating[2] != floating[0]));
}

TEST_CASE("the device path's inf/NaN verdict (one infinity-norm reduction) against isfinite on every element") {
  // reference: any element not finite after the cast to the range dtype.
  auto reference = [](const at::Tensor& t, c10::ScalarType range) {
    return at::logical_not(at::isfinite(t.to(range))).any().item<bool>() ? 1.0 : 0.0;
  };
  const double inf = std::numeric_limits<double>::infinity(), nan = std::nan("");
  struct Case {
    std::vector<double> values;
    c10::ScalarType dtype, range;
  };
  const std::vector<Case> cases{
      {{1.0, -2.0, 3.5}, at::kFloat, at::kFloat},   {{1.0, inf, 3.5}, at::kFloat, at::kFloat},
      {{1.0, -inf, 3.5}, at::kFloat, at::kFloat},   {{nan, 1.0, 3.5}, at::kFloat, at::kFloat},
      {{1.0, 2.0, nan}, at::kDouble, at::kDouble},  {{1e300, -1e300}, at::kDouble, at::kDouble},
      {{1e300, -1e300}, at::kDouble, at::kFloat},  // finite in float64, inf in float32
      {{65519.0, -1.0}, at::kFloat, at::kHalf},    // rounds to 65504 in float16: finite
      {{-65520.0, 1.0}, at::kFloat, at::kHalf},    // rounds to inf in float16
      {{3e38, 1.0}, at::kFloat, at::kBFloat16},    // bfloat16's range is float32's: finite
      {{1.0, nan}, at::kHalf, at::kHalf},           {{1.0, inf}, at::kBFloat16, at::kBFloat16},
      {{0.5, -0.25}, at::kBFloat16, at::kBFloat16},
  };
  for (const auto& c : cases) {
    const at::Tensor t = at::tensor(c.values, at::kDouble).to(c.dtype);
    const at::Tensor flag = loom::detail::non_finite_flag(t, at::kFloat, c.range);
    CHECK(flag.sizes() == c10::IntArrayRef{1});
    CHECK_MESSAGE(
        flag.item<double>() == reference(t, c.range),
        fmt::format("{} {} in {}", fmt::join(c.values, ", "), c10::toString(c.dtype), c10::toString(c.range)));
  }
  CHECK(loom::detail::non_finite_flag(at::empty({0}), at::kLong).item<std::int64_t>() == 0);
}

TEST_CASE("floating reducer: the device path (ATen) gives the CPU path's gradients and verdicts") {
  // Windows of 2 micro-batches through several buckets, float32 parameters and a float16 one in a
  // float32 slot; window 1 has an inf in a float32 gradient, window 2 a float16 gradient of 140000
  // (inf in float16 before it reaches its slot).
  auto run = [](bool device_path) {
    std::optional<loom::detail::DevicePathOnCpu> forced;
    if (device_path) forced.emplace();
    loom::test::Mlp model(at::kFloat);
    at::Tensor h = at::full({3}, 0.5, at::kHalf).requires_grad_();
    auto list = model.list();
    list.names.push_back("h");
    list.params.push_back(h);
    loom::LocalCommunicator comm;
    loom::Reducer reducer(comm, list, {.bucket_cap_bytes = 256, .first_bucket_cap_bytes = 64});
    loom::Accumulator acc(reducer, {.micro_batches_per_step = 2});
    std::vector<std::vector<unsigned char>> grads;
    std::vector<bool> non_finite;
    for (int m = 0; m < 6; ++m) {
      const std::int64_t first = m * (m + 1) / 2, n = m + 1;
      auto mb = acc.micro_batch(n);
      const double hx = m == 3 ? std::numeric_limits<double>::infinity() : m == 5 ? 140000.0 : 0.25 * m;
      (model.loss_sum(loom::test::batch_x(first, n, at::kFloat), loom::test::batch_y(first, n, at::kFloat)) +
       (h.to(at::kFloat) * hx).sum())
          .backward();
      const loom::SyncResult r = mb.finish();
      if (!r.boundary) continue;
      non_finite.push_back(!r.apply);
      auto g = model.grads();
      g.push_back(h.grad().defined() ? h.grad().clone() : at::Tensor());
      grads.push_back(bytes_of(g));
      for (auto& p : list.params) p.mutable_grad() = at::Tensor();
    }
    // Host reads (docs/gpu.md): one summary per window on either path, none inside a hook.
    CHECK(reducer.host_reads().in_hooks == 0);
    CHECK(reducer.host_reads().total == 3);
    return std::make_pair(grads, non_finite);
  };
  const auto cpu = run(false);
  const auto device = run(true);
  REQUIRE(cpu.second.size() == 3);
  CHECK(cpu.second == std::vector<bool>{false, true, true});
  CHECK(device.second == cpu.second);
  CHECK(device.first[0] == cpu.first[0]);
}

TEST_CASE("deterministic reducer: the device path (ATen, whole buckets) gives the CPU path's bytes and exponents") {
  // Three windows of 3 micro-batches (1..9 samples) through buckets of several slots; the CPU path
  // (host loops, slot by slot) against the path a GPU takes, forced onto CPU tensors
  // (quantize_add_bucket_aten / dequantize_bucket_aten over each bucket's segments).
  auto run = [](bool device_path) {
    std::optional<loom::detail::DevicePathOnCpu> forced;
    if (device_path) forced.emplace();
    loom::test::Mlp model(at::kFloat);
    loom::LocalCommunicator comm;
    loom::Reducer reducer(comm, model.list(),
                          {.bucket_cap_bytes = 256, .first_bucket_cap_bytes = 64, .deterministic = true});
    loom::Accumulator acc(reducer, {.micro_batches_per_step = 3});
    std::vector<std::vector<unsigned char>> grads;
    std::vector<std::vector<int>> exponents;
    for (int m = 0; m < 9; ++m) {
      const std::int64_t first = m * (m + 1) / 2, n = m + 1;
      auto mb = acc.micro_batch(n);
      model.loss_sum(loom::test::batch_x(first, n, at::kFloat), loom::test::batch_y(first, n, at::kFloat))
          .mul(m % 2 == 0 ? 1.0 : 1e-3)
          .backward();
      const loom::SyncResult r = mb.finish();
      if (!r.boundary) continue;
      REQUIRE(r.apply);
      grads.push_back(bytes_of(model.grads()));
      exponents.push_back(reducer.grid_exponents());
      for (auto& p : model.params) p.mutable_grad() = at::Tensor();
    }
    REQUIRE(reducer.bucket_params().size() >= 2);
    // Host reads (docs/gpu.md): two per window on the device path (the window meta, then the
    // tails and maxima), none inside a hook; none on the CPU path (host memory).
    CHECK(reducer.host_reads().in_hooks == 0);
    CHECK(reducer.host_reads().total == (device_path ? 6 : 0));
    return std::make_pair(grads, exponents);
  };
  const auto cpu = run(false);
  const auto device = run(true);
  REQUIRE(cpu.first.size() == 3);
  for (std::size_t w = 0; w < 3; ++w) {
    CHECK_MESSAGE(device.first[w] == cpu.first[w], fmt::format("window {}: gradient bytes differ", w));
    CHECK(device.second[w] == cpu.second[w]);
  }
  CHECK(cpu.first[1] != cpu.first[0]);  // the windows' gradients differ (the comparison is not of zeros)
}

TEST_CASE("deterministic reducer: a micro-batch is one contribution, whichever micro-batch ends the window") {
  // Micro-batch A runs two backward passes of 0.4 each (autograd adds them: 0.8), B one of 2. On
  // the grid 2^0 a micro-batch's gradient is rounded once: A gives round(0.8) = 1, B 2, so the
  // window's sum is 3 in either order (rounding each 0.4 alone would give 0 + 0 + 2). The last
  // micro-batch of a window goes onto the int32 wire straight from its floating gradient, the
  // earlier ones onto the int64 sums: both round the same sum. overlap = false: with one slot per
  // bucket, A's second backward would otherwise arrive after its bucket left.
  for (bool a_last : {false, true}) {
    CAPTURE(a_last);
    auto a = param({0.0f});
    loom::LocalCommunicator comm;
    loom::Reducer reducer(comm, {.names = {"a"}, .params = {a}}, {.overlap = false, .deterministic = true});
    reducer.load_grid_exponents({0});
    auto run_a = [&](bool sync) {
      reducer.prepare_backward({.sync = sync, .window_samples = 1});
      (a * 0.4f).sum().backward();
      (a * 0.4f).sum().backward();
    };
    auto run_b = [&](bool sync) {
      reducer.prepare_backward({.sync = sync, .window_samples = 1});
      (a * 2.0f).sum().backward();
    };
    if (a_last) {
      run_b(false);
      run_a(true);
    } else {
      run_a(false);
      run_b(true);
    }
    const auto r = reducer.finish_window();
    REQUIRE(r.reduced);
    CHECK(r.grid_wide_buckets == 0);
    CHECK(a.grad().item<float>() == 3.0f);
  }
}

TEST_CASE("deterministic reducer: error against float64 within C x 2^-(e+1) / N, magnitudes 1e-12..600 in one bucket") {
  auto a = param({0, 0, 0, 0}), b = param({0, 0, 0});
  loom::LocalCommunicator comm;
  loom::Reducer reducer(comm, {.names = {"a", "b"}, .params = {a, b}}, {.deterministic = true});
  REQUIRE(reducer.bucket_params().size() == 1);
  REQUIRE(reducer.grid_exponents() == std::vector<int>{32, 32});
  // 5 contributions (micro-batches) of each, window of N = 3 samples.
  const int contributions = 5;
  const double n = 3;
  std::vector<double> ref_a(4, 0.0), ref_b(3, 0.0);
  for (int c = 0; c < contributions; ++c) {
    const float k = 1.0f + 0.1f * static_cast<float>(c);
    std::vector<float> ga{1e-8f * k, 3e-3f * k, -7.5f * k, 120.0f}, gb{1e-12f * k, 5e-6f * k, 0.25f};
    for (std::size_t i = 0; i < ga.size(); ++i) ref_a[i] += static_cast<double>(ga[i]);
    for (std::size_t i = 0; i < gb.size(); ++i) ref_b[i] += static_cast<double>(gb[i]);
    reducer.prepare_backward({.sync = c == contributions - 1, .window_samples = static_cast<std::int64_t>(n)});
    contribute(reducer, 0, a, torch::tensor(ga));
    contribute(reducer, 1, b, torch::tensor(gb));
  }
  const auto r = reducer.finish_window();
  REQUIRE(r.reduced);
  REQUIRE_FALSE(r.non_finite);
  REQUIRE_FALSE(r.grid_overflow);
  const double bound_grid = contributions * std::ldexp(1.0, -(32 + 1)) / n;
  auto check = [&](const at::Tensor& got, const std::vector<double>& ref, const char* name) {
    for (std::size_t i = 0; i < ref.size(); ++i) {
      const double want = ref[i] / n;
      const double bound = bound_grid + std::abs(want) * std::ldexp(1.0, -24);  // + the float32 cast
      const double err = std::abs(got[static_cast<std::int64_t>(i)].item<double>() - want);
      CHECK_MESSAGE(err <= bound, fmt::format("{}[{}]: {} against {} (error {:.3g}, bound {:.3g})", name, i,
                                              got[static_cast<std::int64_t>(i)].item<double>(), want, err, bound));
    }
  };
  check(a.grad(), ref_a, "a");
  check(b.grad(), ref_b, "b");
  // b[0] (5e-12 in sum) is below half a grid step per contribution: each rounded to 0.
  CHECK(b.grad()[0].item<float>() == 0.0f);
  // a's sum 600 x 2^32 is far above the int32 wire (W = 1: 2^31 - 1): the bucket went again as int64.
  CHECK(r.grid_wide_buckets == 1);
  // The next exponents, by hand: a's largest sum is 600 = 10 bits -> 600 x 2^32 has 42 bits, aimed
  // at 26: e = 16. b's largest is 1.25 x 2^32 (33 bits): e = 25.
  REQUIRE(reducer.grid_exponents() == std::vector<int>{16, 25});

  // The same window again on those grids: every sum fits the int32 wire (600 x 2^16 < 2^31), and
  // the error bound is each parameter's own: C x 2^-(e+1) / N.
  a.mutable_grad().zero_();
  b.mutable_grad().zero_();
  for (int c = 0; c < contributions; ++c) {
    const float k = 1.0f + 0.1f * static_cast<float>(c);
    reducer.prepare_backward({.sync = c == contributions - 1, .window_samples = static_cast<std::int64_t>(n)});
    contribute(reducer, 0, a, torch::tensor({1e-8f * k, 3e-3f * k, -7.5f * k, 120.0f}));
    contribute(reducer, 1, b, torch::tensor({1e-12f * k, 5e-6f * k, 0.25f}));
  }
  const auto r2 = reducer.finish_window();
  REQUIRE(r2.reduced);
  CHECK(r2.grid_wide_buckets == 0);
  auto check_on = [&](const at::Tensor& got, const std::vector<double>& ref, int e, const char* name) {
    for (std::size_t i = 0; i < ref.size(); ++i) {
      const double want = ref[i] / n;
      const double bound = contributions * std::ldexp(1.0, -(e + 1)) / n + std::abs(want) * std::ldexp(1.0, -24);
      const double err = std::abs(got[static_cast<std::int64_t>(i)].item<double>() - want);
      CHECK_MESSAGE(err <= bound, fmt::format("{}[{}]: {} against {} (error {:.3g}, bound {:.3g})", name, i,
                                              got[static_cast<std::int64_t>(i)].item<double>(), want, err, bound));
    }
  };
  check_on(a.grad(), ref_a, 16, "a");
  check_on(b.grad(), ref_b, 25, "b");
  // a[0] (5e-8 in sum) is below half a grid step of 2^-16 per contribution: each rounded to 0.
  CHECK(a.grad()[0].item<float>() == 0.0f);
  CHECK(reducer.grid_exponents() == std::vector<int>{16, 25});  // the sums landed at 26 bits
}

TEST_CASE("deterministic reducer: a contribution too large for its grid skips the step on the grid's next exponent") {
  auto c = param({5000.0f}), e = param({1.0f});
  loom::LocalCommunicator comm;
  loom::Reducer reducer(comm, {.names = {"c", "e"}, .params = {c, e}}, {.deterministic = true});
  loom::Accumulator acc(reducer, {.micro_batches_per_step = 1});
  auto step = [&] {
    auto mb = acc.micro_batch(1);
    (c * c / 2 + e).sum().backward();  // gradients 5000 and 1
    return mb.finish();
  };
  // 5000 > 2^10 = 1024 grid units... at e = 32: 5000 x 2^32 >= 2^42.
  const loom::SyncResult s1 = step();
  CHECK(s1.boundary);
  CHECK(s1.grid_overflow);
  CHECK_FALSE(s1.apply);
  CHECK_FALSE(s1.non_finite);
  CHECK(c.grad().item<float>() == 0.0f);
  CHECK(e.grad().item<float>() == 0.0f);
  CHECK(reducer.grid_exponents() == std::vector<int>{16, 32});  // only c's grid is coarser
  c.mutable_grad().zero_();
  e.mutable_grad().zero_();
  const loom::SyncResult s2 = step();
  CHECK(s2.apply);
  CHECK_FALSE(s2.grid_overflow);
  CHECK(c.grad().item<float>() == 5000.0f);
  CHECK(e.grad().item<float>() == 1.0f);
}

TEST_CASE("deterministic reducer: inf/NaN on a micro-batch skips the step, exponents kept") {
  auto a = param({1.0f, 2.0f});
  loom::LocalCommunicator comm;
  loom::Reducer reducer(comm, {.names = {"a"}, .params = {a}}, {.deterministic = true});
  reducer.prepare_backward({.sync = false});
  contribute(reducer, 0, a, torch::tensor({1.0f, 1.0f}));
  reducer.prepare_backward({.sync = true, .window_samples = 2});
  contribute(reducer, 0, a, torch::tensor({std::numeric_limits<float>::quiet_NaN(), 1.0f}));
  const auto r = reducer.finish_window();
  CHECK(r.non_finite);
  CHECK_FALSE(r.grid_overflow);
  CHECK(torch::equal(a.grad(), torch::zeros({2})));
  CHECK(reducer.grid_exponents() == std::vector<int>{32});
}

TEST_CASE("deterministic reducer: options it cannot honour are refused by name") {
  auto a = param({1.0f});
  loom::LocalCommunicator comm;
  auto message = [&](loom::ReducerOptions o) {
    try {
      loom::Reducer reducer(comm, {.names = {"a"}, .params = {a}}, o);
    } catch (const loom::InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  CHECK(message({.average = loom::Average::world_size, .deterministic = true}).find("average = world_size") !=
        std::string::npos);
  CHECK(message({.wire_dtype = at::kHalf, .deterministic = true}).find("wire_dtype = Half") != std::string::npos);
  CHECK(message({.average = loom::Average::none, .deterministic = true}).empty());
}

TEST_CASE("deterministic reducer: bfloat16 buckets (the ATen path) and float16 in float32 slots, by hand") {
  // bfloat16 without float32 accumulation: the bucket is bfloat16, so quantizing, turning back and
  // the verdicts run as ATen ops (the path of buckets on a GPU). Values exact in bfloat16.
  auto bf = [](std::vector<float> v) { return torch::tensor(v).to(torch::kBFloat16).requires_grad_(); };
  auto a = bf({0.5f, 1.25f, -3.0f}), b = bf({0.375f, 2.0f}), c = bf({1.0f});
  loom::LocalCommunicator comm;
  loom::Reducer reducer(comm, {.names = {"a", "b", "c"}, .params = {a, b, c}},
                        {.float32_accumulation = false, .deterministic = true});
  reducer.prepare_backward({.sync = false});
  contribute(reducer, 0, a, torch::tensor({0.5f, 1.25f, -3.0f}).to(torch::kBFloat16));
  contribute(reducer, 1, b, torch::tensor({0.375f, 2.0f}).to(torch::kBFloat16));
  reducer.prepare_backward({.sync = true, .window_samples = 4});
  contribute(reducer, 0, a, torch::tensor({0.25f, 0.75f, 1.0f}).to(torch::kBFloat16));
  const auto r = reducer.finish_window();
  REQUIRE(r.reduced);
  CHECK_FALSE(r.non_finite);
  CHECK_FALSE(r.grid_overflow);
  CHECK(torch::equal(a.grad().to(torch::kFloat), torch::tensor({0.1875f, 0.5f, -0.5f})));  // (x + y) / 4
  CHECK(torch::equal(b.grad().to(torch::kFloat), torch::tensor({0.09375f, 0.5f})));
  CHECK_FALSE(c.grad().defined());  // unused everywhere, undefined before: stays undefined
  // Largest sums 2 (a: 2 x 2^32 has 34 bits, aimed at 26) and 2 (b): e = 24; c had nothing: 32.
  CHECK(reducer.grid_exponents() == std::vector<int>{24, 24, 32});
  CHECK(r.grid_wide_buckets == 0);  // a bfloat16 bucket's integers travel as int64

  // A contribution over the limit on the ATen path: 2048 >= 2^10 at e = 32.
  auto big = bf({2048.0f});
  loom::Reducer big_reducer(comm, {.names = {"big"}, .params = {big}},
                            {.float32_accumulation = false, .deterministic = true});
  big_reducer.prepare_backward({.sync = true, .window_samples = 1});
  contribute(big_reducer, 0, big, torch::tensor({2048.0f}).to(torch::kBFloat16));
  CHECK(big_reducer.finish_window().grid_overflow);
  CHECK(big_reducer.grid_exponents() == std::vector<int>{16});

  // float16 summed in a float32 slot: 1.5 + 0.5 over 2 samples = 1, handed back as float16.
  auto h = torch::tensor({1.0f}).to(torch::kHalf).requires_grad_();
  loom::Reducer half_reducer(comm, {.names = {"h"}, .params = {h}}, {.deterministic = true});
  half_reducer.prepare_backward({.sync = false});
  contribute(half_reducer, 0, h, torch::tensor({1.5f}).to(torch::kHalf));
  half_reducer.prepare_backward({.sync = true, .window_samples = 2});
  contribute(half_reducer, 0, h, torch::tensor({0.5f}).to(torch::kHalf));
  const auto rh = half_reducer.finish_window();
  REQUIRE(rh.reduced);
  CHECK(rh.grid_wide_buckets == 1);  // 2 x 2^32 on the first grid: above the int32 wire's 2^31 - 1
  CHECK((h.grad().scalar_type() == torch::kHalf));
  CHECK(h.grad().item<float>() == 1.0f);
}

TEST_CASE("deterministic reducer: the rules of the floating mode hold (stale gradients, unused, late, closed window)") {
  loom::LocalCommunicator comm;
  SUBCASE("a parameter unused everywhere keeps the gradient it held; a used one adds it to the sum") {
    auto a = param({1.0f}), d = param({1.0f});
    loom::Reducer reducer(comm, {.names = {"a", "d"}, .params = {a, d}}, {.deterministic = true});
    a.mutable_grad() = torch::tensor({2.0f});
    d.mutable_grad() = torch::tensor({7.0f});
    reducer.prepare_backward({.sync = true, .window_samples = 1});
    (a * 3).sum().backward();
    REQUIRE(reducer.finish_window().reduced);
    CHECK(a.grad().item<float>() == 5.0f);  // 2 held + 3 from the backward, 1 sample
    CHECK(d.grad().item<float>() == 7.0f);
  }
  SUBCASE("a backward before any window keeps its gradient, and the next window adds it (as floating mode)") {
    auto a = param({1.0f});
    loom::Reducer reducer(comm, {.names = {"a"}, .params = {a}}, {.deterministic = true});
    (a * 2).sum().backward();
    CHECK(a.grad().item<float>() == 2.0f);
    reducer.prepare_backward({.sync = true, .window_samples = 1});
    (a * 3).sum().backward();
    REQUIRE(reducer.finish_window().reduced);
    CHECK(a.grad().item<float>() == 5.0f);
  }
  SUBCASE("a gradient replaced by hand between micro-batches counts as replaced (as floating mode)") {
    auto a = param({1.0f});
    loom::Reducer reducer(comm, {.names = {"a"}, .params = {a}}, {.deterministic = true});
    reducer.prepare_backward({.sync = false, .window_samples = 1});
    (a * 2).sum().backward();
    a.mutable_grad() = a.grad() * 0.5;  // 1, a new tensor
    reducer.prepare_backward({.sync = true, .window_samples = 1});
    (a * 3).sum().backward();
    REQUIRE(reducer.finish_window().reduced);
    CHECK(a.grad().item<float>() == 4.0f);  // 1 + 3, as floating mode: not 2 + 1 + 3
  }
  SUBCASE("a second gradient after the bucket left is refused by name, before the integers in flight change") {
    auto a = param({1.0f});
    loom::Reducer reducer(comm, {.names = {"a"}, .params = {a}}, {.deterministic = true});
    reducer.prepare_backward({.sync = true, .window_samples = 1});
    (a * 3).sum().backward();  // the bucket leaves
    CHECK_THROWS_WITH_AS((a * 4).sum().backward(), doctest::Contains("'a') received a second gradient"),
                         loom::InvalidArgument);
    CHECK(reducer.finish_window().reduced);
    CHECK(a.grad().item<float>() == 3.0f);
  }
  SUBCASE("load_grid_exponents refuses what does not fit") {
    auto a = param({1.0f}), b = param({1.0f});
    loom::Reducer reducer(comm, {.names = {"a", "b"}, .params = {a, b}}, {.deterministic = true});
    CHECK_THROWS_WITH_AS(reducer.load_grid_exponents({30}), doctest::Contains("1 exponents for 2 trainable"),
                         loom::InvalidArgument);
    CHECK_THROWS_WITH_AS(reducer.load_grid_exponents({30, 901}), doctest::Contains("exponent 901 of parameter 1"),
                         loom::InvalidArgument);
    reducer.load_grid_exponents({30, -5});
    CHECK(reducer.grid_exponents() == std::vector<int>{30, -5});
    loom::Reducer floating(comm, {.names = {"c"}, .params = {param({1.0f})}});
    CHECK_THROWS_WITH_AS(floating.load_grid_exponents({30}), doctest::Contains("not deterministic"),
                         loom::InvalidArgument);
  }
}

}  // namespace test_grid
