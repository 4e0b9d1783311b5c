// examples/readme_loop.cpp — the loop shown in README.md, as a program the build compiles and the
// tests run: 96 sequences of three lengths (they cannot be stacked into one tensor) on 2 ranks
// (spawned here; or under torchrun / mpirun / srun, one rank per process), shape-bucketed batches
// planned identically on every rank, 2 batches per optimizer step dealt to the ranks, gradients
// reduced across ranks weighted by samples, and rank 0 logging the loss averaged over all ranks and
// the accuracy on 48 validation sequences (each evaluated once, on whichever rank). After every
// epoch rank 0 saves a checkpoint (model, optimizer, the loader's position, step counts).
//
// Run: build/examples/readme_loop [--nproc N] [--epochs E] [--checkpoint FILE] [--resume]
//   --epochs: epochs in all (default 4); --checkpoint: where it saves (default readme_loop.ckpt in
//   the current directory); --resume: continue from that file (without it, the run starts afresh
//   and overwrites the file). Output (rank 0): "epoch E loss L val_accuracy A" lines, then
//   "result: first_loss=F last_loss=L val_accuracy=A ranks=N" (the training set's mean loss before
//   and after training, the last validation accuracy).
// The lines between the two "----" markers are the README's loop: tests/examples/check_readme_loop.py
// fails when they and the README's block differ.
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <loom/loom.hpp>

namespace F = torch::nn::functional;

int main(int argc, char** argv) try {
  int nproc = 2;
  int64_t epochs = 4;
  std::string file = "readme_loop.ckpt";
  bool resume = false;
  for (int k = 1; k < argc; ++k) {
    const std::string a = argv[k];
    if (a == "--resume") {
      resume = true;
    } else if (k + 1 < argc && (a == "--nproc" || a == "--epochs" || a == "--checkpoint")) {
      const std::string v = argv[++k];
      if (a == "--nproc") nproc = std::stoi(v);
      if (a == "--epochs") epochs = std::stoll(v);
      if (a == "--checkpoint") file = v;
    } else {
      throw std::invalid_argument(fmt::format(
          "unknown argument '{}' (usage: readme_loop [--nproc N] [--epochs E] [--checkpoint FILE] [--resume])", a));
    }
  }
  loom::run(
      [&](loom::ProcessGroup& pg) {
        torch::manual_seed(0);  // the same data on every rank; the loaders share it out
        // Sample: 1 x L float32 (L = 8, 16 or 24), class 0 or 1; 96 for training, 48 for validation.
        std::vector<std::pair<torch::Tensor, int64_t>> data, val_data;
        std::vector<std::vector<int64_t>> shapes, val_shapes;
        for (int64_t i = 0; i < 96 + 48; ++i) {
          const int64_t label = i % 2, length = 8 * (1 + i % 3);
          (i < 96 ? data : val_data).emplace_back(torch::randn({1, length}) + (label == 1 ? 0.5 : -0.5), label);
          (i < 96 ? shapes : val_shapes).push_back({1, length});
        }
        torch::nn::Linear model(1, 2);
        torch::optim::SGD opt(model->parameters(), /*lr=*/0.5);
        // The mean loss over the training set (the same on every rank: same seed, same data, and the
        // Trainer keeps the replicas equal), before and after training.
        auto dataset_loss = [&] {
          torch::NoGradGuard no_grad;
          double sum = 0;
          for (const auto& [x, label] : data)
            sum += F::cross_entropy(model->forward(x.unsqueeze(0).mean(-1)), torch::tensor({label})).item<double>();
          return sum / static_cast<double>(data.size());
        };
        // The validation accuracy, sample by sample on this rank (what evaluate gathers over the ranks).
        auto val_accuracy = [&] {
          torch::NoGradGuard no_grad;
          double correct = 0;
          for (const auto& [x, label] : val_data)
            correct += model->forward(x.unsqueeze(0).mean(-1)).argmax(1).item<int64_t>() == label ? 1 : 0;
          return correct / static_cast<double>(val_data.size());
        };
        const double first = dataset_loss();
        // ---- the loop (README) ----
        loom::BatchLoader loader(pg, shapes, [&](int64_t i) { return data[i]; },
                                 {.max_samples = 8, .batches_per_step = 2});
        loom::BatchLoader val_loader(pg, val_shapes, [&](int64_t i) { return val_data[i]; }, {.max_samples = 16});
        loom::Trainer trainer(pg, *model, opt);          // rank 0's weights everywhere; reduces during backward
        loom::Logger log(loom::StreamSink{stdout}, pg);  // rank 0 prints
        int64_t first_epoch = resume ? loom::load_checkpoint(file, trainer, loader).cursor.epoch : 0;
        for (int64_t epoch = first_epoch; epoch < epochs; ++epoch) {
          loom::Metrics metrics(pg);
          for (loom::Batch& b : trainer.epoch(loader, epoch)) {  // this rank's share of every step
            auto loss = F::cross_entropy(model->forward(b.data.mean(-1)), b.targets);  // mean over the batch
            trainer.backward(loss, b);  // weighted by samples; opt.step() + zero_grad() at step ends
            metrics.add("loss", loss, b);
          }
          auto val = loom::evaluate(pg, val_loader, [&](loom::Batch& b) {  // rows of every rank, each sample once
            return model->forward(b.data.mean(-1)).argmax(1).eq(b.targets).to(torch::kFloat);
          });
          const double accuracy = val.values.mean().item<double>();  // over the 48 samples
          log.info("epoch {} loss {:.4f} val_accuracy {:.4f}", epoch, metrics.mean("loss"), accuracy);
          loom::save_checkpoint(file, trainer, loader);  // rank 0 writes; --resume continues from it
        }
        // ---- end of the loop ----
        const double last = dataset_loss();
        log.info("result: first_loss={:.4f} last_loss={:.4f} val_accuracy={:.4f} ranks={}", first, last, val_accuracy(),
                 pg.world_size());
        if (!(last < first)) throw loom::Error(fmt::format("the loss did not fall: {} -> {}", first, last));
      },
      {.nproc = nproc});
  return 0;
} catch (const std::exception& e) {
  fmt::print(stderr, "readme_loop: {}\n", e.what());
  return 1;
}
