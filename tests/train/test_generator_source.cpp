// loom::GeneratorSource on one process: generator streams trained by loom::Trainer against the
// float64 reference by hand (exact weighting of steps with fewer rows, drain and
// stop_at_shortest, epochs of re-made streams), its batches, resume, and misuse.
#include <cmath>
#include <cstdint>
#include <vector>

#include <doctest/doctest.h>
#include <fmt/format.h>
#include <torch/torch.h>

#include <loom/comm/local.hpp>
#include <loom/train/generator_source.hpp>

#include "generator_source_fixture.hpp"

namespace test_generator_source {

TEST_CASE("GeneratorSource + Trainer: steps of fewer rows weighted by their rows (drain), against float64 by hand") {
  const std::vector<std::int64_t> lengths{4, 6, 5};
  loom::LocalCommunicator comm;
  const auto [w, batches] = loom::test::train_generators(comm, lengths, 2, loom::EndPolicy::drain);
  const double ref = loom::test::reference_weight(lengths, 2, /*drain=*/true);
  CHECK(batches == 12);  // 6 steps (the longest stream) per epoch, one batch each
  CHECK_MESSAGE(std::abs(w - ref) <= 1e-12 * std::abs(ref), fmt::format("w {} against {}", w, ref));
  // The steps with 2 and 1 rows count by their rows: weighting every step's rows as 3 would differ.
  CHECK(std::abs(ref - loom::test::reference_weight({4, 4, 4}, 2, true)) > 1e-6);
}

TEST_CASE("GeneratorSource + Trainer: stop_at_shortest ends the epoch where the first stream ended") {
  const std::vector<std::int64_t> lengths{4, 6, 5};
  loom::LocalCommunicator comm;
  const auto [w, batches] = loom::test::train_generators(comm, lengths, 3, loom::EndPolicy::stop_at_shortest);
  const double ref = loom::test::reference_weight(lengths, 3, /*drain=*/false);
  CHECK(batches == 12);  // 4 steps per epoch
  CHECK_MESSAGE(std::abs(w - ref) <= 1e-12 * std::abs(ref), fmt::format("w {} against {}", w, ref));
}

TEST_CASE("GeneratorSource: batches carry their step, rows and generator ids; epochs re-make the streams") {
  loom::LocalCommunicator comm;
  loom::GeneratorSource source(comm, 2,
                               [](int g, std::int64_t epoch) {
                                 return loom::test::ClosedFormGenerator{.g = g, .length = 2 + g, .epoch = epoch};
                               },
                               {.end = loom::EndPolicy::drain});
  for (std::int64_t e = 0; e < 2; ++e) {
    source.begin_epoch(e);
    for (std::int64_t k = 0; k < 3; ++k) {
      auto b = source.next();
      REQUIRE(b.has_value());
      CHECK(b->step == k);
      CHECK(b->step_end);
      CHECK_FALSE(b->idle);
      const std::int64_t rows = k < 2 ? 2 : 1;
      CHECK(b->num_samples == rows);
      CHECK(b->data.sizes() == c10::IntArrayRef{rows, 1});
      CHECK(b->indices == (rows == 2 ? std::vector<std::int64_t>{0, 1} : std::vector<std::int64_t>{1}));
      CHECK(b->data[rows - 1].item<double>() == loom::test::source_x(1, k, e));
    }
    CHECK_FALSE(source.next().has_value());
  }
}

TEST_CASE("GeneratorSource: resume_epoch continues an epoch after the samples already delivered") {
  loom::LocalCommunicator comm;
  auto make = [](int g, std::int64_t epoch) {
    return loom::test::ClosedFormGenerator{.g = g, .length = 5, .epoch = epoch};
  };
  loom::GeneratorSource first(comm, 2, make);
  first.begin_epoch(3);
  REQUIRE(first.next().has_value());
  REQUIRE(first.next().has_value());
  const loom::GeneratorLoaderState state = first.state();
  CHECK(state.steps == 2);
  loom::GeneratorSource second(comm, 2, make);
  second.resume_epoch(3, state);
  second.begin_epoch(3);
  auto b = second.next();
  REQUIRE(b.has_value());
  CHECK(b->step == 2);
  CHECK(b->data[0].item<double>() == loom::test::source_x(0, 2, 3));
  second.begin_epoch(4);  // a resume state applies to its epoch only
  b = second.next();
  REQUIRE(b.has_value());
  CHECK(b->step == 0);
}

TEST_CASE("GeneratorSource: next() before begin_epoch and a bad generator count are loom errors") {
  loom::LocalCommunicator comm;
  auto make = [](int g, std::int64_t epoch) {
    return loom::test::ClosedFormGenerator{.g = g, .length = 1, .epoch = epoch};
  };
  loom::GeneratorSource source(comm, 1, make);
  CHECK_THROWS_WITH_AS(source.next(), doctest::Contains("no epoch has begun"), loom::Error);
  CHECK_THROWS_WITH_AS(loom::GeneratorSource(comm, 0, make), doctest::Contains("num_generators is 0"),
                       loom::InvalidArgument);
}

}  // namespace test_generator_source
