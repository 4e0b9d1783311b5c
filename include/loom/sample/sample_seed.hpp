// loom/sample/sample_seed.hpp — a random seed per (seed, epoch, sample): augmentation that does not
// depend on which rank, worker or world size processes the sample.
//
// One sentence: `loom::sample_seed(seed, epoch, index)` mixes the three integers into one 64-bit
// seed, so a random crop or flip of sample `index` in `epoch` is the same on 1 or 8 ranks and after
// a resume — the key world-size-invariant training needs (GlobalBatchSampler fixes which samples
// form a step; this fixes what they look like).
//
// Example:
//   auto gen = loom::sample_generator(opts.seed, epoch, index);            // an at::Generator (CPU),
//                                                                           // seeded with all 64 bits
//   auto flip = at::rand({1}, gen).item<double>() < 0.5;
//
// Units: seeds are 64-bit integers; epoch and index are the sampler's.
// Source: the SplitMix64 finaliser (Steele, Lea, Flood: "Fast splittable pseudorandom number
//         generators", 2014) as a mixing function, applied to each input in turn.
#pragma once

#include <cstdint>

#include <ATen/CPUGeneratorImpl.h>

namespace loom {

namespace detail {
/// SplitMix64's finaliser: a bijection of 64-bit integers that spreads every input bit.
constexpr uint64_t mix64(uint64_t z) noexcept {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}
}  // namespace detail

/// The seed of sample `index` in `epoch` of a run seeded `seed`. Pure: the same on every rank.
///
/// Example: `loom::sample_seed(7, 0, 42) != loom::sample_seed(7, 1, 42)` (a new draw each epoch).
constexpr uint64_t sample_seed(uint64_t seed, int64_t epoch, int64_t index) noexcept {
  uint64_t h = detail::mix64(seed + 0x9e3779b97f4a7c15ULL);
  h = detail::mix64(h ^ static_cast<uint64_t>(epoch));
  return detail::mix64(h ^ static_cast<uint64_t>(index));
}

/// A CPU generator whose state depends on all 64 bits of `seed`. ATen's own seeding (mt19937's
/// init_with_uint32, as in torch.manual_seed) keeps only the low 32 bits, so seeds that differ in
/// the high half would draw the same numbers; here the 624 state words come from a SplitMix64
/// stream started at `seed`. current_seed() reports `seed`.
///
/// Example: `loom::generator64(7)` and `loom::generator64(7 + (1ULL << 32))` draw different numbers.
/// Source: SplitMix64 (see the file comment) as the seeding sequence, in the manner of std::seed_seq.
inline at::Generator generator64(uint64_t seed) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  at::mt19937 engine(seed);
  at::mt19937_data_pod data = engine.data();
  uint64_t z = seed;
  for (auto& word : data.state_) {
    z += 0x9e3779b97f4a7c15ULL;
    word = static_cast<uint32_t>(detail::mix64(z) >> 32);
  }
  data.seed_ = seed;
  data.seeded_ = true;
  data.left_ = 1;  // the first draw regenerates the state from these words (as after init)
  data.next_ = 0;
  engine.set_data(data);
  gen.get<at::CPUGeneratorImpl>()->set_engine(engine);
  return gen;
}

/// A CPU generator seeded with all 64 bits of sample_seed(seed, epoch, index) (see generator64).
inline at::Generator sample_generator(uint64_t seed, int64_t epoch, int64_t index) {
  return generator64(sample_seed(seed, epoch, index));
}

}  // namespace loom
