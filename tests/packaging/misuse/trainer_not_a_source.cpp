// Compile-fail case (check_misuse.py): Trainer::epoch over a sampler instead of a BatchLoader: the
// one error is Trainer::epoch's static_assert saying what a loader must be.
#include <cstdint>
#include <vector>

#include <torch/torch.h>

#include <loom/comm/local.hpp>
#include <loom/sample/global_batch.hpp>
#include <loom/train/trainer.hpp>

void misuse() {
  loom::LocalCommunicator comm;
  loom::GlobalBatchSampler sampler(comm, {{1}}, {});
  torch::nn::Linear model(1, 2);
  torch::optim::SGD opt(model->parameters(), 0.5);
  loom::Trainer trainer(comm, *model, opt);
  for (loom::Batch& b : trainer.epoch(sampler, 0)) trainer.backward(model->forward(b.data).sum(), b);
}
