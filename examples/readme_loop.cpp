// examples/readme_loop.cpp — the loop shown in README.md, as a program the build compiles and the
// tests run: 96 sequences of three lengths (they cannot be stacked into one tensor) on 2 ranks over
// Gloo, shape buckets sharded whole across ranks, 2 micro-batches per optimizer step, gradients
// reduced across ranks weighted by samples, and rank 0 logging the loss averaged over all ranks.
//
// Run: build/examples/readme_loop        Output (rank 0): "epoch E loss L" lines, then "result: ..."
#include <cstdint>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <loom/loom.hpp>

namespace F = torch::nn::functional;

int main() try {
  loom::spawn(2, [](const loom::Environment& env) {
    loom::GlooCommunicator comm(env);
    loom::Logger log{loom::StreamSink{stdout}, loom::rank_info(env)};
    torch::manual_seed(0);  // same data on every rank; the sampler shards it
    std::vector<std::pair<torch::Tensor, int64_t>> data;  // sample: 1 x L float32, class 0 or 1
    std::vector<std::vector<int64_t>> shapes;
    for (int64_t i = 0; i < 96; ++i) {
      const int64_t label = i % 2, length = 8 * (1 + i % 3);
      data.emplace_back(torch::randn({1, length}) + (label == 1 ? 0.5 : -0.5), label);
      shapes.push_back({1, length});
    }
    torch::nn::Linear model(1, 2);
    torch::optim::SGD opt(model->parameters(), /*lr=*/0.5);
    // ---- the loop (README) ----
    loom::DistributedBucketBatchSampler sampler(shapes, {.num_replicas = comm.world_size(),
                                                         .rank = comm.rank(), .max_samples = 8});
    loom::Reducer reducer(comm, loom::parameters_of(*model));  // rank 0's weights everywhere
    loom::Accumulator acc(reducer, {.micro_batches_per_step = 2});
    double first = 0, last = 0;
    for (int64_t epoch = 0; epoch < 4; ++epoch) {
      sampler.set_epoch(epoch);
      loom::WeightedMean epoch_loss;
      while (auto planned = sampler.next()) {
        loom::Batch b = loom::collate_sampled(*planned, [&](int64_t i) { return data[i]; });
        auto mb = acc.micro_batch(b);  // counts b.num_samples (0 for a repeated batch)
        auto loss = F::cross_entropy(model->forward(b.data.mean(-1)), b.targets,
                                     F::CrossEntropyFuncOptions().reduction(torch::kSum)) * b.weight;
        mb.scale(loss).backward();       // buckets are all-reduced while backward runs
        if (b.weight > 0) epoch_loss.add(loss.item<double>() / b.num_samples, b.num_samples);
        if (auto step = mb.finish(); step.boundary) { if (step) opt.step(); opt.zero_grad(); }
      }
      while (auto step = acc.end_epoch()) { if (*step) opt.step(); opt.zero_grad(); }  // remainder
      last = loom::global_mean(comm, epoch_loss);  // every rank calls it; rank 0 logs
      if (epoch == 0) first = last;
      log.info("epoch {} loss {:.4f}", epoch, last);
    }
    // ---- end of the loop ----
    log.info("result: first_loss={:.4f} last_loss={:.4f}", first, last);
    if (!(last < first)) throw loom::Error(fmt::format("the loss did not fall: {} -> {}", first, last));
  });
  return 0;
} catch (const loom::Error& e) {
  fmt::print(stderr, "readme_loop: {}\n", e.what());
  return 1;
}
