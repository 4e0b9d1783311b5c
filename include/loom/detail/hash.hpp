// loom/detail/hash.hpp — the one 64-bit hash loom uses to fingerprint configurations and names
// (FNV-1a), so that every component hashes the same way.
//
// Example:
//   loom::detail::Fnv1a f;
//   f.add(std::uint64_t{42});                  // an integer, as its 8 little-endian bytes
//   f.add(std::string_view("fc.weight"));      // text, byte by byte
//   std::uint64_t h = f.value();
//
// Not cryptographic: it tells configurations apart (sampler fingerprints, parameter descriptions
// compared across ranks, metric names), it does not resist an adversary.
// Source: Fowler–Noll–Vo FNV-1a, 64-bit (offset basis 14695981039346656037, prime 1099511628211).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

namespace loom::detail {

inline constexpr std::uint64_t kFnvOffset = 0xcbf29ce484222325ULL;
inline constexpr std::uint64_t kFnvPrime = 0x100000001b3ULL;

/// A running FNV-1a hash.
struct Fnv1a {
  std::uint64_t h = kFnvOffset;

  /// Folds in one byte.
  constexpr void add_byte(unsigned char b) noexcept {
    h ^= b;
    h *= kFnvPrime;
  }
  /// Folds in a 64-bit integer as its 8 little-endian bytes.
  constexpr void add(std::uint64_t v) noexcept {
    for (int i = 0; i < 8; ++i) add_byte(static_cast<unsigned char>((v >> (8 * i)) & 0xff));
  }
  /// Folds in the bytes of `text`.
  constexpr void add(std::string_view text) noexcept {
    for (char c : text) add_byte(static_cast<unsigned char>(c));
  }
  /// Folds in `n` bytes of bulk data (tensor contents) 8 at a time: FNV-1a over 64-bit words (the
  /// last n % 8 bytes one by one), about 8x faster than byte by byte; the same on every machine of
  /// one byte order, which is what replicas compare.
  void add_words(const void* data, std::size_t n) noexcept {
    const auto* p = static_cast<const unsigned char*>(data);
    std::size_t i = 0;
    for (; i + 8 <= n; i += 8) {
      std::uint64_t w;
      std::memcpy(&w, p + i, 8);
      h ^= w;
      h *= kFnvPrime;
    }
    for (; i < n; ++i) add_byte(p[i]);
  }
  [[nodiscard]] constexpr std::uint64_t value() const noexcept { return h; }
};

/// FNV-1a of `text`.
constexpr std::uint64_t fnv1a(std::string_view text) noexcept {
  Fnv1a f;
  f.add(text);
  return f.value();
}

}  // namespace loom::detail
