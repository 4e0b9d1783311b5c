// ODR check, first translation unit: includes every loom header (all_headers.hpp) and uses a few
// inline entities; odr_b.cpp does the same, and both are linked into one program. A header that
// defines a non-inline function or variable fails to link here ("multiple definition").
#include <string>

#include "all_headers.hpp"

std::string odr_b();

std::string odr_a() {
  loom::MemorySink mem;
  loom::Logger log{mem, loom::AllRanks{}, loom::RankInfo{.rank = 1, .world_size = 2}};
  log.info("{} {}", loom::to_string(loom::ReduceOp::avg), loom::detail::format_hms(61));
  return mem.text();
}

int main() {
  const std::string a = odr_a(), b = odr_b();
  const std::string expected = "[rank 1/2] avg 0:01:01\n";
  if (a != expected || b != expected) {
    fmt::print(stderr, "ODR check: the two translation units disagree: '{}' vs '{}'\n", a, b);
    return 1;
  }
  fmt::print("ODR check: two translation units with every loom header link and agree: {}", a);
  return 0;
}
