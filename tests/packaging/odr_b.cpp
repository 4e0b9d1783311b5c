// ODR check, second translation unit (see odr_a.cpp).
#include <string>

#include "all_headers.hpp"

std::string odr_b() {
  loom::MemorySink mem;
  loom::Logger log{mem, loom::AllRanks{}, loom::RankInfo{.rank = 1, .world_size = 2}};
  log.info("{} {}", loom::to_string(loom::ReduceOp::avg), loom::detail::format_hms(61));
  return mem.text();
}
