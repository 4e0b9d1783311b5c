// A tiny program built against an *installed* loom (tests/packaging/check_install.py): it uses
// LocalCommunicator, the Logger and a weighted metric, and prints one line the test compares.
#include <ATen/ops/full.h>

#if !__has_include(<loom/build_config.hpp>)
#error "the installed tree lacks loom/build_config.hpp (LOOM_HAS_* of the build)"
#endif

#include <loom/comm/local.hpp>
#include <loom/config.hpp>
#include <loom/log/logger.hpp>
#include <loom/log/metrics.hpp>

int main() {
  loom::LocalCommunicator comm;
  at::Tensor t = at::full({3}, 2.5, at::kFloat);
  comm.all_reduce(t, loom::ReduceOp::sum);  // world size 1: unchanged
  loom::WeightedMean loss;
  loss.add(0.5, 2);
  loss.add(1.0, 2);
  loom::Logger log{loom::StreamSink{stdout}, loom::RankInfo{}};
  log.info("loom {} consumer: sum {} mean {} world {}", LOOM_VERSION_STRING, t.sum().item<float>(),
           loom::global_mean(comm, loss), comm.world_size());
  return 0;
}
