// Compile-fail case (check_misuse.py): ranging over a BatchLoader instead of trainer.epoch(loader, e):
// the one error is BatchLoader::begin's static_assert.
#include <cstdint>
#include <utility>
#include <vector>

#include <loom/comm/local.hpp>
#include <loom/train/loader.hpp>

void misuse() {
  loom::LocalCommunicator comm;
  std::vector<std::pair<at::Tensor, int64_t>> data;
  std::vector<std::vector<int64_t>> shapes;
  loom::BatchLoader loader(comm, shapes, [&](int64_t i) { return data[static_cast<std::size_t>(i)]; });
  for (loom::Batch& b : loader) (void)b;
}
