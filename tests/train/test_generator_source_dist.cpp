// loom::GeneratorSource + loom::Trainer on 2 real ranks (Gloo on loopback): ranks whose streams
// end at different steps (drain: a rank that ran dry joins the remaining steps) train the float64
// reference's weight, and the replicas hold the same bits.
#include <chrono>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include <doctest/doctest.h>
#include <fmt/format.h>
#include <torch/torch.h>

#include <loom/dist/run.hpp>

#include "generator_source_fixture.hpp"

namespace test_generator_source_dist {

namespace {

void expect(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error("check failed: " + what);
}

}  // namespace

TEST_SUITE("dist") {
  TEST_CASE("GeneratorSource + Trainer on 2 ranks: a rank that ran dry joins the steps; the float64 reference") {
    // Rank 0 runs generators 0 and 1 (lengths 3, 5), rank 1 generators 2 and 3 (lengths 2, 7):
    // rank 0 runs dry after step 4 and joins steps 5 and 6.
    const std::vector<std::int64_t> lengths{3, 5, 2, 7};
    // A failed expectation on a rank throws there; loom::run then throws here.
    CHECK_NOTHROW(loom::run(
        [&](loom::ProcessGroup& pg) {
          const auto [w, batches] = loom::test::train_generators(pg, lengths, 2, loom::EndPolicy::drain);
          const double ref = loom::test::reference_weight(lengths, 2, /*drain=*/true);
          expect(std::abs(w - ref) <= 1e-12 * std::abs(ref),
                 fmt::format("rank {}: w {} against {}", pg.rank(), w, ref));
          expect(batches == (pg.rank() == 0 ? 10 : 14), fmt::format("rank {}: {} batches", pg.rank(), batches));
          auto all = pg.all_gather(at::full({1}, w, at::kDouble));
          expect(torch::equal(all[0], all[1]), "replicas differ");
        },
        {.nproc = 2, .group = {.timeout = std::chrono::seconds(30)}, .spawn = {.timeout = std::chrono::seconds(120)}}));
  }
}

}  // namespace test_generator_source_dist
