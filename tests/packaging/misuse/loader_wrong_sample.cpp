// Compile-fail case (check_misuse.py): a fetch returning (tensor, double) is not a sample: the one
// error is BatchLoader's static_assert saying what a sample must be.
#include <cstdint>
#include <utility>
#include <vector>

#include <loom/comm/local.hpp>
#include <loom/train/loader.hpp>

void misuse() {
  loom::LocalCommunicator comm;
  std::vector<std::pair<at::Tensor, double>> data;
  std::vector<std::vector<int64_t>> shapes;
  loom::BatchLoader loader(comm, shapes, [&](int64_t i) { return data[static_cast<std::size_t>(i)]; });
  (void)loader.next();
}
