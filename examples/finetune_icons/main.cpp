// examples/finetune_icons — fine-tune a small CNN to tell an icon's context (actions, devices,
// status, ...) from its pixels, every icon at its own size, on 2 ranks by default.
//
// Data: Debian's adwaita-icon-theme, /usr/share/icons/Adwaita/<N>x<N>/<context>/*.png, read with
// examples::data::IconFolder (libpng); train/validation split by icon name (the sizes of one icon
// never straddle the split). The task (data, model, evaluation): examples/common/icons_task.hpp.
// Loop, on loom's short path:
//   loom::run (--nproc ranks on this machine, or one rank of a torchrun / mpirun / srun job)
//   -> loom::ProcessGroup (NCCL on a GPU, Gloo on the CPU; --backend, --device)
//   -> loom::BatchLoader: exact-shape buckets (16x16 icons with 16x16 icons) under a pixel
//      budget, --batches-per-step batches per optimizer step for the whole job, dealt to the ranks
//      by cost (the same steps on any number of ranks)
//   -> model -> loss (the batch mean) -> loom::Trainer (sample weighting, bucketed all-reduce
//      overlapped with backward, the optimizer step at each step's end)
//   -> loom::Logger (rank 0), loom::Progress and checkpoints through Trainer::on_step,
//      loom::Metrics (training loss over every rank's samples), loom::evaluate (validation
//      accuracy and loss, every validation sample once).
// Phases: pre-train briefly on the small sizes only (or --init a model / TorchScript file), save
// it, fine-tune from it on every size. A checkpoint (loom::save_checkpoint: model, optimizer, the
// world-size-free cursor, the step count) is written at every epoch end and every
// --checkpoint-every optimizer steps; --resume
// continues at the next optimizer step on any number of ranks, every sample used exactly once;
// under torchrun's elastic restarts (TORCHELASTIC_RESTART_COUNT > 0) it resumes from
// <out>/checkpoint.pt on its own.
//
// Run:   scripts/run_example.sh            (setup, build, run with the defaults)
//        build/examples/finetune_icons --nproc 2 --epochs 4
//        torchrun --nproc-per-node 2 build/examples/finetune_icons     (torchrun's variables)
//        mpirun -np 2 -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT=29500 build/examples/finetune_icons
// Elastic: --elastic MIN goes on while at least MIN ranks are alive; each recovery prints
//        recovered: rank R died at step S, W ranks left, T s
//        (try: --nproc 3 --elastic 2 --deterministic --kill-rank 1 --kill-at-step 5; the weights_fnv1a
//        equals the run nobody killed). docs/elastic.md.
// Output (rank 0): one line per epoch, then
//        result: val_accuracy=A val_loss=L train_loss=T majority_baseline=B epochs=E steps=S seconds=X
//                weights_fnv1a=H (a 64-bit hash of the final weights' bytes; with --deterministic the same
//                on any --nproc) optimizer_state_bytes=N (rank 0's AdamW state)
// ZeRO: --zero 1 keeps each rank's shard of AdamW's state only (optimizer_state_bytes about 1/nproc
//        of --zero 0's; with --deterministic the same weights_fnv1a). docs/zero.md.
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <numbers>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/script.h>
#include <torch/torch.h>

#include <loom/detail/hash.hpp>
#include <loom/dist/run.hpp>
#include <loom/log/all.hpp>
#include <loom/sample/global_batch.hpp>
#include <loom/train/checkpoint.hpp>
#include <loom/train/loader.hpp>
#include <loom/train/trainer.hpp>

#include "../common/icons_task.hpp"
#include "../common/placement.hpp"

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using examples::IconNet;

// ------------------------------------------------------------------------------------------------
// Options
// ------------------------------------------------------------------------------------------------
struct Options {
  int nproc = 2;
  std::string device = "auto";   // auto | cpu | cuda
  std::string backend = "auto";  // auto | gloo | nccl
  double timeout = 0;            // seconds: rendezvous and every collective (0: LOOM_TIMEOUT or 300)
  examples::IconTaskOptions task{};
  int pretrain_epochs = 1;
  int epochs = 8;
  double pretrain_lr = 3e-3;
  double lr = 1.5e-3;
  double weight_decay = 1e-4;
  int width = 32;
  int64_t batch_pixels = 32 * 32 * 32;  // pixels (H x W) per batch, all channels
  int64_t max_batch = 64;               // samples per batch
  int64_t batches_per_step = 4;         // batches per optimizer step, for the whole job
  int workers = 0;                      // BatchLoader worker threads (0: collate on the training thread)
  fs::path out = "finetune_icons_out";
  std::string init;              // model or TorchScript file to start from (skips pre-training)
  std::string resume;            // checkpoint to resume fine-tuning from
  int64_t checkpoint_every = 0;  // optimizer steps between mid-epoch checkpoints (0: epoch ends only)
  int64_t stop_after_steps = 0;  // stop fine-tuning after this many optimizer steps (simulates a crash; tests)
  int threads = 1;               // intra-op threads per rank
  bool deterministic = false;    // bit-identical weights on any number of ranks (ReducerOptions::deterministic)
  int zero = 0;              // 1: ZeRO stage 1, each rank keeps its shard of AdamW's state (TrainerOptions::zero_stage)
  int elastic = 0;           // go on while at least this many ranks are alive (0: a death ends the job)
  int kill_rank = -1;        // demonstrates --elastic: this launch rank kills itself (SIGKILL) ...
  int64_t kill_at_step = 0;  // ... when fine-tuning reaches this optimizer step
};

// ------------------------------------------------------------------------------------------------
// Files: the pre-trained model is a model archive (model->save, readable by init_from and by
// torch::jit::load); fine-tuning checkpoints are loom's (loom::save_checkpoint: model, optimizer,
// the world-size-free cursor, the Trainer's step counts, and the run's wall time as a user value).
// ------------------------------------------------------------------------------------------------
void save_model(const fs::path& file, IconNet& model) {
  torch::serialize::OutputArchive archive;
  model->save(archive);
  const fs::path tmp = file.string() + ".tmp";
  archive.save_to(tmp.string());
  fs::rename(tmp, file);  // a crash mid-write never leaves a torn file
}

/// Copies every parameter of `model` from a file that holds tensors of the same names and shapes:
/// the pre-trained model of this program, a torch::save(model) file, or a TorchScript module whose
/// parameters are named like IconNet's ("features.0.weight", ..., "head.bias").
/// Returns the number of tensors copied; throws loom::DataError naming the file when none match.
int64_t init_from(const fs::path& file, IconNet& model) {
  if (!fs::is_regular_file(file)) throw loom::DataError(fmt::format("{}: no such model file", file.string()));
  torch::jit::Module m = torch::jit::load(file.string());
  std::map<std::string, torch::Tensor> found;
  for (const auto& p : m.named_parameters(/*recurse=*/true)) found[p.name] = p.value;
  for (const auto& b : m.named_buffers(/*recurse=*/true)) found[b.name] = b.value;
  int64_t copied = 0;
  torch::NoGradGuard no_grad;
  for (auto& p : model->named_parameters(/*recurse=*/true)) {
    for (const std::string& key : {p.key(), "model." + p.key()}) {
      auto it = found.find(key);
      if (it != found.end() && it->second.sizes() == p.value().sizes()) {
        p.value().copy_(it->second);
        ++copied;
        break;
      }
    }
  }
  if (copied == 0)
    throw loom::DataError(
        fmt::format("{}: none of its tensors matches IconNet's parameters by name and shape", file.string()));
  return copied;
}

/// FNV-1a (64-bit) of the bytes of every parameter, in the model's order, as 16 hex digits: equal
/// exactly when the weights are bit for bit equal (up to a collision). Not cryptographic.
std::string weights_hash(IconNet& model) {
  loom::detail::Fnv1a h;
  for (const auto& p : model->parameters()) {
    const auto c = p.detach().to(torch::kCPU).contiguous();
    const auto* bytes = static_cast<const unsigned char*>(c.data_ptr());
    for (int64_t k = 0; k < c.numel() * static_cast<int64_t>(c.element_size()); ++k) h.add_byte(bytes[k]);
  }
  return fmt::format("{:016x}", h.value());
}

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

/// Cosine decay from lr to lr / 10 over the epochs: a function of the epoch alone, so a resumed run
/// uses the same rates.
double learning_rate(const Options& o, int64_t epoch) {
  return o.lr *
         (0.1 +
          0.9 * 0.5 * (1.0 + std::cos(std::numbers::pi * static_cast<double>(epoch) / static_cast<double>(o.epochs))));
}

// ------------------------------------------------------------------------------------------------
// One rank's work.
// ------------------------------------------------------------------------------------------------
void run_rank(loom::ProcessGroup& pg, const Options& o, Clock::time_point start) {
  at::set_num_threads(o.threads);
  const torch::Device device = examples::model_device(pg, o.device);
  const auto& env = pg.environment();
  loom::Logger log(loom::StreamSink{stdout}, pg);
  log.info("finetune_icons: {} rank(s) ({} launcher), backend {}, device {}", pg.world_size(),
           loom::to_string(env.launcher), loom::to_string(pg.backend()), device.str());
  const examples::IconTask task(o.task, [&](std::string_view m) { log.warning("{}", m); });
  if (task.skipped() > 0) log.warning("{} corrupt PNG files skipped", task.skipped());
  log.info("icons: {} train ({} at sizes {} for pre-training), {} validation, {} classes, sizes {}",
           task.train().size(), task.train_small().size(), fmt::join(o.task.pretrain_sizes, ","), task.val().size(),
           task.classes(), fmt::join(o.task.sizes, ","));
  log.info("majority baseline: always '{}' = {:.4f} of validation", task.majority_class(), task.majority_baseline());

  torch::manual_seed(o.task.seed);  // same initial weights on every rank (the trainer also broadcasts rank 0's)
  IconNet model(o.task.channels, o.width, task.classes());
  model->to(device);
  fs::create_directories(o.out);
  const fs::path pretrained = o.out / "pretrained.pt";
  const fs::path checkpoint = o.out / "checkpoint.pt";
  const int64_t max_elements = o.batch_pixels * o.task.channels;
  const loom::GlobalBatchOptions plan{.seed = o.task.seed,
                                      .max_samples = o.max_batch,
                                      .max_elements = max_elements,
                                      .batches_per_step = o.batches_per_step};
  auto evaluate = [&] { return task.evaluate(pg, model, device, o.max_batch, max_elements); };

  // Resume: --resume FILE, or a torchrun elastic restart with a checkpoint from the last attempt.
  std::string resume = o.resume;
  if (resume.empty() && env.restart_count > 0 && fs::is_regular_file(checkpoint)) {
    resume = checkpoint.string();
    log.info("torchrun restart {} (world size {}): resuming from {}", env.restart_count, pg.world_size(), resume);
  }

  if (!resume.empty()) {
    log.info("resuming from {}", resume);
  } else if (!o.init.empty()) {
    log.info("initialised {} parameter tensors from {}", init_from(o.init, model), o.init);
  } else if (o.pretrain_epochs > 0) {
    // Pre-training: the small sizes only, a higher learning rate, then save.
    torch::optim::AdamW opt(model->parameters(),
                            torch::optim::AdamWOptions(o.pretrain_lr).weight_decay(o.weight_decay));
    loom::Trainer trainer(pg, *model, opt, {.reducer = {.deterministic = o.deterministic}, .zero_stage = o.zero});
    loom::BatchLoader loader(pg, task.shapes_of(task.train_small()),
                             [&](int64_t j) { return task.sample(task.train_small(), j); }, plan, {.device = device});
    for (int64_t e = 0; e < o.pretrain_epochs; ++e) {
      const auto t0 = Clock::now();
      loom::Metrics metrics(pg);
      for (loom::Batch& b : trainer.epoch(loader, 1000 + e)) {
        const auto loss = torch::nn::functional::cross_entropy(model->forward(b.data), b.targets);
        trainer.backward(loss, b);
        metrics.add("loss", loss, b);
      }
      const double train_loss = metrics.mean("loss");
      const examples::EvalResult ev = evaluate();
      log.info(
          "pretrain epoch {}/{}: train_loss={:.4f} val_loss={:.4f} val_accuracy={:.4f} majority_baseline={:.4f} "
          "seconds={:.1f}",
          e + 1, o.pretrain_epochs, train_loss, ev.loss, ev.accuracy, task.majority_baseline(), seconds_since(t0));
    }
    if (pg.rank() == 0) save_model(pretrained, model);
    pg.barrier();
    log.info("saved the pre-trained model to {}", pretrained.string());
  }
  if (resume.empty() && (!o.init.empty() || o.pretrain_epochs > 0)) {
    // Fine-tune *from the saved file*, as a separate job would.
    init_from(o.init.empty() ? pretrained : fs::path(o.init), model);
  }

  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(o.lr).weight_decay(o.weight_decay));
  loom::BatchLoader loader(pg, task.shapes_of(task.train()), [&](int64_t j) { return task.sample(task.train(), j); },
                           plan, {.device = device, .num_workers = o.workers});
  loom::Trainer trainer(pg, *model, opt,  // rank 0's weights everywhere
                        {.reducer = {.deterministic = o.deterministic}, .zero_stage = o.zero});
  // After a rank died (--elastic) the survivors are renumbered: the new rank 0 logs.
  trainer.on_recovery([&](const loom::Recovery& r) {
    log.set_rank(loom::rank_info(pg));
    log.info("recovered: rank {} died at step {}, {} ranks left, {:.2f} s", fmt::join(r.lost, ","), r.step,
             r.members.size(), r.seconds);
  });
  double seconds_before = 0;
  int64_t first_epoch = 0;
  if (!resume.empty()) {
    // Every rank loads (rank 0 reads the file); throws naming each batching option that changed, or the data.
    const loom::CheckpointInfo info = loom::load_checkpoint(resume, trainer, loader);
    if (auto it = info.user.find("run_seconds"); it != info.user.end()) seconds_before = std::stod(it->second);
    first_epoch = info.cursor.epoch;
    log.info(
        "resumed at fine-tune epoch {}, global step {} of {} (optimizer step {}), on {} rank(s): global_step={} "
        "ranks={}",
        info.cursor.epoch + 1, info.cursor.step, loader.sampler().num_steps(), trainer.steps(), pg.world_size(),
        info.cursor.step, pg.world_size());
  }
  auto save = [&] {
    loom::save_checkpoint(checkpoint, trainer, loader,
                          {{"run_seconds", fmt::format("{}", seconds_before + seconds_since(start))}});
  };
  log.info("fine-tune plan: batches_per_epoch={} optimizer_steps_per_epoch={} batches_per_step={} ranks={}",
           loader.sampler().plan().batches.size(), loader.sampler().num_steps(), o.batches_per_step, pg.world_size());
  const examples::EvalResult before = evaluate();
  log.info("fine-tune start: val_loss={:.4f} val_accuracy={:.4f} majority_baseline={:.4f}", before.loss,
           before.accuracy, task.majority_baseline());

  examples::EvalResult last = before;
  double train_loss = 0;
  int64_t epochs_done = first_epoch;
  bool stopped = false;
  for (int64_t e = first_epoch; e < o.epochs && !stopped; ++e) {
    const auto t0 = Clock::now();
    for (auto& group : opt.param_groups())
      static_cast<torch::optim::AdamWOptions&>(group.options()).lr(learning_rate(o, e));
    loom::Progress progress{
        loom::StreamSink{stdout},
        loom::rank_info(pg),
        {.total = static_cast<int64_t>(task.train().size()), .label = fmt::format("epoch {}", e + 1)}};
    // Every rank runs on_step at every step (its share of the batches may be empty), so the
    // checkpoint and the stop decision are taken at the same step everywhere.
    trainer.on_step([&](const loom::SyncResult& r) {
      progress.add_global(r.global_samples);
      const int64_t steps = trainer.steps();
      const bool stop = o.stop_after_steps > 0 && steps >= o.stop_after_steps;
      if (stop || (o.checkpoint_every > 0 && steps % o.checkpoint_every == 0)) save();
      if (stop) trainer.stop();
    });
    loom::Metrics metrics(pg);
    for (loom::Batch& b : trainer.epoch(loader, e)) {
      if (pg.launch_rank() == o.kill_rank && trainer.steps() >= o.kill_at_step) std::raise(SIGKILL);
      const auto loss = torch::nn::functional::cross_entropy(model->forward(b.data), b.targets);
      trainer.backward(loss, b);
      metrics.add("loss", loss, b);
    }
    if (trainer.stopped()) {
      stopped = true;
      log.info("stopped after {} optimizer steps as asked (--stop-after-steps); checkpoint {}", trainer.steps(),
               checkpoint.string());
      break;
    }
    progress.finish(pg);
    train_loss = metrics.mean("loss");
    last = evaluate();
    epochs_done = e + 1;
    save();  // after epoch e's last step: resumes at epoch e + 1, step 0
    log.info(
        "epoch {}/{}: train_loss={:.4f} val_loss={:.4f} val_accuracy={:.4f} majority_baseline={:.4f} seconds={:.1f}",
        e + 1, o.epochs, train_loss, last.loss, last.accuracy, task.majority_baseline(), seconds_since(t0));
  }
  pg.barrier();
  if (stopped) return;
  log.info(
      "result: val_accuracy={:.4f} val_loss={:.6f} train_loss={:.6f} majority_baseline={:.4f} epochs={} steps={} "
      "seconds={:.1f} weights_fnv1a={} optimizer_state_bytes={}",
      last.accuracy, last.loss, train_loss, task.majority_baseline(), epochs_done, trainer.steps(),
      seconds_before + seconds_since(start), weights_hash(model),
      trainer.sharded_optimizer() ? trainer.sharded_optimizer()->state_bytes() : loom::optimizer_state_bytes(opt));
}

int main(int argc, char** argv) {
  const auto start = Clock::now();
  Options o;
  CLI::App app{"Fine-tune a small CNN on Adwaita's icons (each at its own size) over several ranks."};
  app.add_option("--nproc", o.nproc, "ranks to spawn on this machine (ignored under torchrun/mpirun/srun)")
      ->check(CLI::Range(1, 64));
  app.add_option("--device", o.device,
                 "auto | cpu | cuda (the model's device; a GPU is LOCAL_RANK among CUDA_VISIBLE_DEVICES)")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  app.add_option("--backend", o.backend, "auto | gloo | nccl (auto: NCCL for a GPU model, Gloo for a CPU one)")
      ->check(CLI::IsMember({"auto", "gloo", "nccl"}));
  app.add_option("--timeout", o.timeout,
                 "seconds a rank waits at rendezvous and in any collective (default: LOOM_TIMEOUT, else 300)")
      ->check(CLI::PositiveNumber);
  app.add_option("--data", o.task.data, "icon theme root (<N>x<N>/<context>/*.png)");
  app.add_option("--sizes", o.task.sizes, "icon sizes to fine-tune on, px")->delimiter(',');
  app.add_option("--pretrain-sizes", o.task.pretrain_sizes, "icon sizes to pre-train on, px")->delimiter(',');
  app.add_option("--channels", o.task.channels, "4 = RGBA, 3 = RGB over black, 1 = alpha")
      ->check(CLI::IsMember({1, 3, 4}));
  app.add_option("--val-fraction", o.task.val_fraction, "fraction of icon names held out")
      ->check(CLI::Range(0.01, 0.9));
  app.add_option("--seed", o.task.seed, "seed of the split, the initial weights and the shuffles");
  app.add_option("--subset", o.task.subset, "keep about 1/k of the icon names (short runs; 0 = all)");
  app.add_option("--pretrain-epochs", o.pretrain_epochs, "pre-training epochs (0: none)");
  app.add_option("--epochs", o.epochs, "fine-tuning epochs");
  app.add_option("--pretrain-lr", o.pretrain_lr, "AdamW learning rate for pre-training");
  app.add_option("--lr", o.lr, "AdamW learning rate at the start of fine-tuning (cosine decay to a tenth)");
  app.add_option("--width", o.width, "channels of the first conv layer (x2, x4 after); a multiple of 8");
  app.add_option("--batch-pixels", o.batch_pixels, "pixels (H x W) per batch");
  app.add_option("--max-batch", o.max_batch, "samples per batch");
  app.add_option(
         "--batches-per-step", o.batches_per_step,
         "batches per optimizer step, for the whole job (dealt to the ranks: the same steps on any number of ranks)")
      ->check(CLI::PositiveNumber);
  app.add_option("--workers", o.workers,
                 "threads that collate the next batches while the current one trains (LoaderOptions::num_workers)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--out", o.out, "folder for pretrained.pt and checkpoint.pt");
  app.add_option("--init", o.init,
                 "start from this model file (the pre-trained model of a run, a torch::save(model) file, or "
                 "TorchScript) instead of pre-training");
  app.add_option("--resume", o.resume, "resume fine-tuning from this checkpoint (any number of ranks)");
  app.add_option("--checkpoint-every", o.checkpoint_every,
                 "optimizer steps between mid-epoch checkpoints (0: epoch ends)");
  app.add_option("--stop-after-steps", o.stop_after_steps,
                 "stop after this many fine-tuning optimizer steps (tests resume)");
  app.add_flag("--skip-corrupt", o.task.skip_corrupt, "skip undecodable PNG files with a warning instead of failing");
  app.add_option("--threads", o.threads, "intra-op threads per rank")->check(CLI::PositiveNumber);
  app.add_option("--elastic", o.elastic,
                 "go on while at least this many ranks are alive when ranks die (0: off; docs/elastic.md)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--kill-rank", o.kill_rank, "demonstrates --elastic: this rank kills itself (SIGKILL) ...");
  app.add_option("--kill-at-step", o.kill_at_step, "... when fine-tuning reaches this optimizer step");
  app.add_option("--zero", o.zero,
                 "ZeRO stage: 1 shards AdamW's state across the ranks (each keeps about 1/nproc; docs/zero.md), 0 "
                 "keeps it whole on every rank")
      ->check(CLI::Range(0, 1));
  app.add_flag("--deterministic", o.deterministic,
               "bit-identical weights on any number of ranks (integer gradient sums; docs/elastic.md); compare the "
               "result line's weights_fnv1a across runs");
  CLI11_PARSE(app, argc, argv);
  if (o.width % 8 != 0) {
    fmt::print(stderr, "--width {} must be a multiple of 8 (GroupNorm groups)\n", o.width);
    return 2;
  }
  try {
    loom::run([&](loom::ProcessGroup& pg) { run_rank(pg, o, start); },
              {.nproc = o.nproc,
               .group = {.backend = examples::group_backend(o.backend, o.device),
                         .timeout = examples::group_timeout(o.timeout),
                         .elastic = o.elastic > 0 ? std::optional(loom::ElasticOptions{.min_ranks = o.elastic})
                                                  : std::nullopt},
               .spawn = {.threads_per_rank = o.threads}});
  } catch (const loom::Error& e) {
    fmt::print(stderr, "finetune_icons: {}\n", e.what());
    return 1;
  }
  return 0;
}
