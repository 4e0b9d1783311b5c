// examples/readme_loop.cpp — the loop shown in README.md, as a program the build compiles and the
// tests run: 96 sequences of three lengths (they cannot be stacked into one tensor) on 2 ranks
// (spawned here; or under torchrun / mpirun / srun, one rank per process), shape-bucketed batches
// planned identically on every rank, 2 batches per optimizer step dealt to the ranks, gradients
// reduced across ranks weighted by samples, and rank 0 logging the loss averaged over all ranks.
//
// Run: build/examples/readme_loop [--nproc N]   Output (rank 0): "epoch E loss L" lines, then
// "result: first_loss=F last_loss=L ranks=N" (the dataset's mean loss before and after training).
// The lines between the two "----" markers are the README's loop: tests/examples/check_readme_loop.py
// fails when they and the README's block differ.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <loom/loom.hpp>

namespace F = torch::nn::functional;

int main(int argc, char** argv) try {
  const int nproc = argc == 3 && std::string(argv[1]) == "--nproc" ? std::stoi(argv[2]) : 2;
  loom::run(
      [](loom::ProcessGroup& pg) {
        torch::manual_seed(0);                                // the same data on every rank; the loader shares it out
        std::vector<std::pair<torch::Tensor, int64_t>> data;  // sample: 1 x L float32, class 0 or 1
        std::vector<std::vector<int64_t>> shapes;
        for (int64_t i = 0; i < 96; ++i) {
          const int64_t label = i % 2, length = 8 * (1 + i % 3);
          data.emplace_back(torch::randn({1, length}) + (label == 1 ? 0.5 : -0.5), label);
          shapes.push_back({1, length});
        }
        torch::nn::Linear model(1, 2);
        torch::optim::SGD opt(model->parameters(), /*lr=*/0.5);
        // The mean loss over the whole dataset (the same on every rank: same seed, same data, and the
        // Trainer keeps the replicas equal), before and after training.
        auto dataset_loss = [&] {
          torch::NoGradGuard no_grad;
          double sum = 0;
          for (const auto& [x, label] : data)
            sum += F::cross_entropy(model->forward(x.unsqueeze(0).mean(-1)), torch::tensor({label})).item<double>();
          return sum / static_cast<double>(data.size());
        };
        const double first = dataset_loss();
        // ---- the loop (README) ----
        loom::BatchLoader loader(pg, shapes, [&](int64_t i) { return data[i]; },
                                 {.max_samples = 8, .batches_per_step = 2});
        loom::Trainer trainer(pg, *model, opt);          // rank 0's weights everywhere; reduces during backward
        loom::Logger log(loom::StreamSink{stdout}, pg);  // rank 0 prints
        for (int64_t epoch = 0; epoch < 4; ++epoch) {
          loom::Metrics metrics(pg);
          for (loom::Batch& b : trainer.epoch(loader, epoch)) {  // this rank's share of every step
            auto loss = F::cross_entropy(model->forward(b.data.mean(-1)), b.targets);  // mean over the batch
            trainer.backward(loss, b);  // weighted by samples; opt.step() + zero_grad() at step ends
            metrics.add("loss", loss, b);
          }
          log.info("epoch {} loss {:.4f}", epoch, metrics.mean("loss"));  // over every rank's samples
        }
        // ---- end of the loop ----
        const double last = dataset_loss();
        log.info("result: first_loss={:.4f} last_loss={:.4f} ranks={}", first, last, pg.world_size());
        if (!(last < first)) throw loom::Error(fmt::format("the loss did not fall: {} -> {}", first, last));
      },
      {.nproc = nproc});
  return 0;
} catch (const std::exception& e) {
  fmt::print(stderr, "readme_loop: {}\n", e.what());
  return 1;
}
