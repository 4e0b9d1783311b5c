// The state lines a user hands back from a checkpoint (global cursor, sampler state, loss scaler
// state): every form that is read is the form to_string writes, and everything else is a loom
// error quoting the text. The cases marked "fuzz" were found by scripts/fuzz.sh
// (tests/fuzz/fuzz_state_text.cpp); the others are the sscanf-isms the fuzz contract names.
#include <cmath>
#include <string>
#include <string_view>

#include <doctest/doctest.h>

#include <loom/accumulate/loss_scaler.hpp>
#include <loom/error.hpp>
#include <loom/sample/concepts.hpp>
#include <loom/sample/global_batch.hpp>

namespace test_state_text {

namespace {

using namespace std::string_literals;

const std::string kCursor = "loom-global-cursor v1 seed=7 epoch=2 step=13 fingerprint=123456789";
const std::string kSampler =
    "loom-sampler v1 seed=0 epoch=3 position=17 dataset_size=10 num_replicas=3 rank=1 fingerprint=42";
const std::string kScaler = "loom-loss-scaler v1 scale=0x1p+9 good_steps=37";

}  // namespace

TEST_CASE("state text: what to_string writes is read back, with a trailing newline or spaces") {
  const loom::GlobalCursor c = loom::parse_global_cursor(kCursor + "\n");
  CHECK(c == loom::GlobalCursor{.seed = 7, .epoch = 2, .step = 13, .fingerprint = 123456789});
  CHECK(loom::to_string(c) == kCursor);
  CHECK(loom::parse_global_cursor(loom::to_string(loom::GlobalCursor{.seed = ~0ull, .fingerprint = ~0ull})).seed ==
        ~0ull);
  const loom::SamplerState s = loom::parse_sampler_state(kSampler + "  \n");
  CHECK(s.rank == 1);
  CHECK(s.num_replicas == 3);
  CHECK(loom::to_string(s) == kSampler);
  const loom::LossScalerState l = loom::parse_loss_scaler_state(kScaler + "\n");
  CHECK(l.scale == 512.0);
  CHECK(l.good_steps == 37);
  CHECK(loom::to_string(l) == kScaler);
  // Exact: a scale that is not a short decimal comes back bit for bit.
  const loom::LossScalerState odd{.scale = std::nextafter(1000.0, 2000.0), .good_steps = 0};
  CHECK(loom::parse_loss_scaler_state(loom::to_string(odd)) == odd);
}

TEST_CASE("state text: text after a NUL byte is not ignored (fuzz)") {
  // fuzz: build-fuzz/findings/crash-bb4205f1..., and the same for the scaler.
  CHECK_THROWS_WITH_AS(loom::parse_global_cursor(kCursor + "\0\x01"s + "23\n"),
                       doctest::Contains("unexpected text at the end"), loom::InvalidArgument);
  CHECK_THROWS_WITH_AS(loom::parse_loss_scaler_state(kScaler + "\n\0\0"s), doctest::Contains("\\x00"),
                       loom::InvalidArgument);
  CHECK_THROWS_AS(loom::parse_sampler_state(kSampler + "\0 7"s), loom::InvalidArgument);
}

TEST_CASE("state text: a scale without its binary exponent is not {:a}'s form (fuzz)") {
  // fuzz: build-fuzz/findings/crash-84388c58... ("scale=0x1 good_steps=371", read as 1).
  CHECK_THROWS_WITH_AS(loom::parse_loss_scaler_state("loom-loss-scaler v1 scale=0x1 good_steps=371"),
                       doctest::Contains("field 'scale' is not a hexadecimal float"), loom::InvalidArgument);
  CHECK(loom::parse_loss_scaler_state("loom-loss-scaler v1 scale=0x1p+0 good_steps=371").scale == 1.0);
  // fuzz: build-fuzz/findings/crash-4665f9de... (libstdc++'s from_chars reads "1p+-9" as 2^-9).
  for (const char* scale : {"0x1p+-9", "0x1.p+0", "0x1p", "0x1p+", "0x.8p+0", "0x1p+9x"})
    CHECK_THROWS_WITH_AS(loom::parse_loss_scaler_state("loom-loss-scaler v1 scale="s + scale + " good_steps=371"),
                         doctest::Contains("field 'scale' is not a hexadecimal float"), loom::InvalidArgument);
  CHECK(loom::parse_loss_scaler_state("loom-loss-scaler v1 scale=0x1.8p-3 good_steps=371").scale == 0.1875);
}

TEST_CASE("state text: a sign on an unsigned field, a space after '=', or fields run together are errors") {
  // sscanf's %llu read "-1" as 2^64 - 1; its %lld skips spaces; a space in its format matches none.
  CHECK_THROWS_WITH_AS(loom::parse_global_cursor("loom-global-cursor v1 seed=-1 epoch=2 step=13 fingerprint=1"),
                       doctest::Contains("field 'seed' is not a number (digits only, no sign)"), loom::InvalidArgument);
  CHECK_THROWS_WITH_AS(loom::parse_global_cursor("loom-global-cursor v1 seed=+1 epoch=2 step=13 fingerprint=1"),
                       doctest::Contains("field 'seed'"), loom::InvalidArgument);
  CHECK_THROWS_WITH_AS(loom::parse_global_cursor("loom-global-cursor v1 seed=1 epoch= 2 step=13 fingerprint=1"),
                       doctest::Contains("field 'epoch' is not a number"), loom::InvalidArgument);
  CHECK_THROWS_WITH_AS(loom::parse_global_cursor("loom-global-cursor v1 seed=1epoch=2 step=13 fingerprint=1"),
                       doctest::Contains("expected ' epoch='"), loom::InvalidArgument);
  CHECK_THROWS_WITH_AS(loom::parse_loss_scaler_state("loom-loss-scaler v1 scale=0x1p+9 good_steps= 3"),
                       doctest::Contains("field 'good_steps' is not a number"), loom::InvalidArgument);
  CHECK_THROWS_WITH_AS(loom::parse_global_cursor("loom-global-cursor v1 seed=1 epoch=99999999999999999999 step=1 "
                                                 "fingerprint=1"),
                       doctest::Contains("field 'epoch' is out of range"), loom::InvalidArgument);
}

TEST_CASE("state text: values no run can have are errors naming them") {
  CHECK_THROWS_WITH_AS(loom::parse_global_cursor("loom-global-cursor v1 seed=1 epoch=-2 step=0 fingerprint=1"),
                       doctest::Contains("epoch -2 and step 0 must be >= 0"), loom::InvalidArgument);
  for (const char* scale : {"nan", "inf", "0x0p+0", "-0x1p+9", "0xinf", "0x-1p+0", "512"})
    CHECK_THROWS_WITH_AS(loom::parse_loss_scaler_state("loom-loss-scaler v1 scale="s + scale + " good_steps=3"),
                         doctest::Contains("loss scaler state 'loom-loss-scaler v1 scale="), loom::InvalidArgument);
  CHECK_THROWS_WITH_AS(loom::parse_loss_scaler_state("loom-loss-scaler v1 scale=0x1p+9 good_steps=-3"),
                       doctest::Contains("good_steps -3 must be >= 0"), loom::InvalidArgument);
  CHECK_THROWS_WITH_AS(
      loom::parse_sampler_state(
          "loom-sampler v1 seed=0 epoch=3 position=17 dataset_size=10 num_replicas=3 rank=3 fingerprint=42"),
      doctest::Contains("rank 3 of num_replicas 3"), loom::InvalidArgument);
  CHECK_THROWS_WITH_AS(
      loom::parse_sampler_state(
          "loom-sampler v1 seed=0 epoch=3 position=17 dataset_size=10 num_replicas=0 rank=0 fingerprint=42"),
      doctest::Contains("rank 0 of num_replicas 0"), loom::InvalidArgument);
  CHECK_THROWS_WITH_AS(
      loom::parse_sampler_state(
          "loom-sampler v1 seed=0 epoch=3 position=-1 dataset_size=10 num_replicas=3 rank=0 fingerprint=42"),
      doctest::Contains("position -1"), loom::InvalidArgument);
}

TEST_CASE("state text: a long or binary text is quoted shortened, bytes escaped") {
  const std::string junk = std::string(5000, 'x') + "\x01";
  try {
    (void)loom::parse_global_cursor(junk);
    FAIL("no error");
  } catch (const loom::InvalidArgument& e) {
    const std::string what = e.what();
    CHECK(what.find("(5001 bytes)") != std::string::npos);
    CHECK(what.size() < 400);
  }
  CHECK_THROWS_WITH_AS(loom::parse_global_cursor("\x7f\x80"), doctest::Contains("'\\x7f\\x80' is malformed"),
                       loom::InvalidArgument);
}

}  // namespace test_state_text
