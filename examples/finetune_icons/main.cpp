// examples/finetune_icons — fine-tune a small CNN to tell an icon's context (actions, devices,
// status, ...) from its pixels, every icon at its own size, on 2 ranks by default.
//
// Data: Debian's adwaita-icon-theme, /usr/share/icons/Adwaita/<N>x<N>/<context>/*.png, read with
// loom::data::IconFolder (libpng); train/validation split by icon name (the sizes of one icon
// never straddle the split).
// Loop, assembled from loom's public parts:
//   loom::spawn (--nproc ranks on this machine) or a launcher's variables (torchrun, mpirun, srun)
//   -> loom::GlooCommunicator (CPU tensors, or CUDA tensors with --device cuda)
//   -> loom::DistributedBucketBatchSampler: exact-shape buckets (16x16 icons with 16x16 icons)
//      under a pixel budget, whole batches sharded so every rank runs the same number of steps
//   -> loom::collate_sampled -> model -> loss summed over the batch's samples
//   -> loom::Accumulator (--accumulate micro-batches per optimizer step, exact sample weighting)
//      in front of loom::Reducer (bucketed all-reduce overlapped with backward)
//   -> loom::Logger (rank 0), loom::Progress (samples summed over ranks), loom::global_means
//      (validation accuracy and loss over ranks).
// Phases: pre-train briefly on the small sizes only (or --init a checkpoint / TorchScript file),
// save it, fine-tune from it on every size; a checkpoint is written at every epoch end (and every
// --checkpoint-every optimizer steps); --resume continues a run mid-epoch, exactly.
//
// Run:   scripts/run_example.sh            (setup, build, run with the defaults)
//        build/examples/finetune_icons --nproc 2 --epochs 4
//        torchrun --nproc-per-node 2 build/examples/finetune_icons     (torchrun's variables)
//        mpirun -np 2 -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT=29500 build/examples/finetune_icons
// Output (rank 0): one line per epoch, then
//        result: val_accuracy=A majority_baseline=B epochs=E seconds=S
#include <algorithm>
#include <chrono>
#include <cmath>
#include <numbers>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/script.h>
#include <torch/torch.h>

#include <loom/accumulate/accumulator.hpp>
#include <loom/comm/gloo.hpp>
#include <loom/comm/local.hpp>
#include <loom/config.hpp>
#include <loom/data/icons.hpp>
#include <loom/dist/environment.hpp>
#include <loom/dist/spawn.hpp>
#include <loom/log/all.hpp>
#include <loom/reduce/module.hpp>
#include <loom/reduce/reducer.hpp>
#include <loom/sample/sample.hpp>

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

// ------------------------------------------------------------------------------------------------
// Options
// ------------------------------------------------------------------------------------------------
struct Options {
  int nproc = 2;
  std::string device = "auto";  // auto | cpu | cuda
  fs::path data = "/usr/share/icons/Adwaita";
  std::vector<int> sizes = {16, 24, 32, 48};
  std::vector<int> pretrain_sizes = {16, 24};
  int channels = 4;
  double val_fraction = 0.25;
  uint64_t seed = 1;
  int64_t subset = 0;            // keep every k-th icon name only when > 0 (short test runs): names with hash % subset == 0
  int pretrain_epochs = 1;
  int epochs = 8;
  double pretrain_lr = 3e-3;
  double lr = 1.5e-3;
  double weight_decay = 1e-4;
  int width = 32;
  int64_t batch_pixels = 32 * 32 * 32;  // pixels (H x W) per micro-batch, all channels
  int64_t max_batch = 64;               // samples per micro-batch
  int64_t accumulate = 2;               // micro-batches per optimizer step
  fs::path out = "finetune_icons_out";
  std::string init;              // checkpoint or TorchScript file to start from (skips pre-training)
  std::string resume;            // checkpoint to resume fine-tuning from
  int64_t checkpoint_every = 0;  // optimizer steps between mid-epoch checkpoints (0: epoch ends only)
  int64_t stop_after_steps = 0;  // stop fine-tuning after this many optimizer steps (simulates a crash; tests)
  bool skip_corrupt = false;
  int threads = 1;               // intra-op threads per rank
  double timeout = std::chrono::duration<double>(loom::kDefaultTimeout).count();  // seconds (--timeout)
};

// ------------------------------------------------------------------------------------------------
// Model: three conv blocks, adaptive pooling (any input size >= 8 px gives the same feature size).
// Shape: in N x C x H x W float32 (H, W >= 8, one size per batch); out N x classes logits.
// GroupNorm, not BatchNorm: it keeps no running statistics, so replicas never drift apart and
// batches of one sample (a lone 48 px icon) are fine.
// ------------------------------------------------------------------------------------------------
struct IconNetImpl : torch::nn::Module {
  IconNetImpl(int channels, int width, int classes)
      : features(register_module(
            "features",
            torch::nn::Sequential(
                torch::nn::Conv2d(torch::nn::Conv2dOptions(channels, width, 3).padding(1)), torch::nn::GroupNorm(8, width),
                torch::nn::ReLU(), torch::nn::MaxPool2d(2),
                torch::nn::Conv2d(torch::nn::Conv2dOptions(width, 2 * width, 3).padding(1)),
                torch::nn::GroupNorm(8, 2 * width), torch::nn::ReLU(), torch::nn::MaxPool2d(2),
                torch::nn::Conv2d(torch::nn::Conv2dOptions(2 * width, 4 * width, 3).padding(1)),
                torch::nn::GroupNorm(8, 4 * width), torch::nn::ReLU(),
                torch::nn::AdaptiveAvgPool2d(torch::nn::AdaptiveAvgPool2dOptions({2, 2})), torch::nn::Flatten()))),
        head(register_module("head", torch::nn::Linear(16 * width, classes))) {}

  torch::Tensor forward(const torch::Tensor& x) { return head->forward(features->forward(x)); }

  torch::nn::Sequential features;
  torch::nn::Linear head;
};
TORCH_MODULE(IconNet);

// ------------------------------------------------------------------------------------------------
// Checkpoints: model, optimizer, and where the run stands (phase, epoch, sampler position, step).
// ------------------------------------------------------------------------------------------------
struct RunState {
  int64_t epoch = 0;     // fine-tune epoch to run (or running)
  int64_t position = 0;  // sampler steps (micro-batches) of that epoch already done
  int64_t step = 0;      // optimizer steps done in fine-tuning
  double seconds = 0;    // wall time spent before this process
};

void save_checkpoint(const fs::path& file, IconNet& model, torch::optim::Optimizer* opt, const RunState& st) {
  torch::serialize::OutputArchive archive;
  torch::serialize::OutputArchive model_archive;
  model->save(model_archive);
  archive.write("model", model_archive);
  if (opt != nullptr) {
    torch::serialize::OutputArchive opt_archive;
    opt->save(opt_archive);
    archive.write("optimizer", opt_archive);
  }
  archive.write("run_state", torch::tensor({st.epoch, st.position, st.step}, torch::kLong));
  archive.write("run_seconds", torch::tensor({st.seconds}, torch::kDouble));
  const fs::path tmp = file.string() + ".tmp";
  archive.save_to(tmp.string());
  fs::rename(tmp, file);  // atomic: a crash mid-write never leaves a torn checkpoint
}

RunState load_checkpoint(const fs::path& file, IconNet& model, torch::optim::Optimizer& opt) {
  if (!fs::is_regular_file(file)) throw loom::DataError(fmt::format("{}: no such checkpoint", file.string()));
  torch::serialize::InputArchive archive;
  archive.load_from(file.string());
  torch::serialize::InputArchive model_archive, opt_archive;
  archive.read("model", model_archive);
  model->load(model_archive);
  if (!archive.try_read("optimizer", opt_archive))
    throw loom::DataError(fmt::format("{}: has no optimizer state (a pre-trained model: pass it with --init)", file.string()));
  opt.load(opt_archive);
  torch::Tensor s, secs;
  archive.read("run_state", s);
  archive.read("run_seconds", secs);
  return {s[0].item<int64_t>(), s[1].item<int64_t>(), s[2].item<int64_t>(), secs[0].item<double>()};
}

/// Copies every parameter of `model` from a file that holds tensors of the same names and shapes:
/// a checkpoint of this program, a torch::save(model) file, or a TorchScript module whose
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
    throw loom::DataError(fmt::format("{}: none of its tensors matches IconNet's parameters by name and shape", file.string()));
  return copied;
}

// ------------------------------------------------------------------------------------------------
// One rank's work.
// ------------------------------------------------------------------------------------------------
struct EvalResult {
  double accuracy = 0;
  double loss = 0;
};

template <class Comm, class Log>
class Trainer {
 public:
  Trainer(Comm& comm, const loom::RankInfo& me, const Options& o, Log& log, torch::Device device)
      : comm_(comm), me_(me), o_(o), log_(log), device_(device),
        icons_({.root = o.data,
                .sizes = all_sizes(o),
                .channels = o.channels,
                .on_corrupt = o.skip_corrupt ? loom::data::OnCorrupt::skip : loom::data::OnCorrupt::throw_error,
                .warn = [this](std::string_view m) { log_.warning("{}", m); }}) {
    if (!icons_.skipped().empty()) log_.warning("{} corrupt PNG files skipped", icons_.skipped().size());
    auto split = loom::data::split_by_name(icons_, o.val_fraction, o.seed);
    auto keep = [&](int64_t i) {
      if (o.subset <= 1) return true;
      return loom::data::detail::mix64(loom::data::detail::fnv1a(icons_.name(static_cast<std::size_t>(i)))) %
                 static_cast<uint64_t>(o.subset) == 0;
    };
    for (int64_t i : split.train) {
      if (!keep(i)) continue;
      train_all_.push_back(i);
      const int64_t side = icons_.pixels(static_cast<std::size_t>(i)).size(1);
      if (std::find(o.pretrain_sizes.begin(), o.pretrain_sizes.end(), side) != o.pretrain_sizes.end())
        train_small_.push_back(i);
    }
    for (int64_t i : split.val)
      if (keep(i)) val_.push_back(i);
    if (train_all_.empty() || val_.empty())
      throw loom::InvalidArgument(fmt::format("no training ({}) or validation ({}) icons left: lower --subset or --val-fraction",
                                              train_all_.size(), val_.size()));

    // Majority baseline: the best constant prediction on the validation split (the most frequent class there).
    std::vector<int64_t> counts(icons_.classes().size(), 0);
    for (int64_t i : val_) ++counts[static_cast<std::size_t>(icons_.label(static_cast<std::size_t>(i)))];
    const auto top = std::max_element(counts.begin(), counts.end());
    majority_class_ = icons_.classes()[static_cast<std::size_t>(top - counts.begin())];
    majority_baseline_ = static_cast<double>(*top) / static_cast<double>(val_.size());

    log_.info("icons: {} train ({} at sizes {} for pre-training), {} validation, {} classes [{}], sizes {}", train_all_.size(),
              train_small_.size(), fmt::join(o.pretrain_sizes, ","), val_.size(), icons_.classes().size(),
              fmt::join(icons_.classes(), ", "), fmt::join(o.sizes, ","));
    log_.info("majority baseline: always '{}' = {:.4f} of validation", majority_class_, majority_baseline_);
  }

  /// Runs pre-training (unless --init or --resume), then fine-tuning; returns the final validation result.
  void run(Clock::time_point start) {
    torch::manual_seed(static_cast<uint64_t>(o_.seed));  // same initial weights on every rank (the reducer also broadcasts rank 0's)
    IconNet model(o_.channels, o_.width, static_cast<int>(icons_.classes().size()));
    model->to(device_);
    fs::create_directories(o_.out);
    const fs::path pretrained = o_.out / "pretrained.pt";
    const fs::path checkpoint = o_.out / "checkpoint.pt";

    RunState st;
    double seconds_before = 0;
    if (!o_.resume.empty()) {
      log_.info("resuming from {}", o_.resume);
    } else if (!o_.init.empty()) {
      const int64_t n = init_from(o_.init, model);
      log_.info("initialised {} parameter tensors from {}", n, o_.init);
    } else if (o_.pretrain_epochs > 0) {
      // Pre-training: the small sizes only, a higher learning rate, then save.
      torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(o_.pretrain_lr).weight_decay(o_.weight_decay));
      for (int64_t e = 0; e < o_.pretrain_epochs; ++e) {
        const auto t0 = Clock::now();
        const double loss = train_epoch(model, opt, train_small_, /*epoch=*/1000 + e, 0, nullptr, fmt::format("pretrain {}", e + 1));
        const EvalResult ev = evaluate(model);
        log_.info("pretrain epoch {}/{}: train_loss={:.4f} val_loss={:.4f} val_accuracy={:.4f} majority_baseline={:.4f} seconds={:.1f}",
                  e + 1, o_.pretrain_epochs, loss, ev.loss, ev.accuracy, majority_baseline_, secs(t0));
      }
      if (me_.rank == 0) save_checkpoint(pretrained, model, nullptr, {});
      comm_.barrier();
      log_.info("saved the pre-trained model to {}", pretrained.string());
    }
    if (o_.resume.empty() && (!o_.init.empty() || o_.pretrain_epochs > 0)) {
      // Fine-tune *from the saved file*, as a separate job would.
      const fs::path from = o_.init.empty() ? pretrained : fs::path(o_.init);
      init_from(from, model);
    }

    torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(o_.lr).weight_decay(o_.weight_decay));
    if (!o_.resume.empty()) {
      st = load_checkpoint(o_.resume, model, opt);
      seconds_before = st.seconds;
      log_.info("resumed at fine-tune epoch {} step {} (optimizer step {})", st.epoch + 1, st.position, st.step);
    }

    {
      const loom::DistributedBucketBatchSampler plan(shapes_of(train_all_), sampler_options(/*shuffle=*/true));
      log_.info("fine-tune plan: sampler_steps_per_epoch={} optimizer_steps_per_epoch={} accumulate={}", plan.size(),
                (plan.size() + o_.accumulate - 1) / o_.accumulate, o_.accumulate);
    }
    const EvalResult before = evaluate(model);
    log_.info("fine-tune start: val_loss={:.4f} val_accuracy={:.4f} majority_baseline={:.4f}", before.loss, before.accuracy,
              majority_baseline_);

    EvalResult last = before;
    int64_t epochs_done = st.epoch;
    for (int64_t e = st.epoch; e < o_.epochs; ++e) {
      const auto t0 = Clock::now();
      // Cosine decay from --lr to --lr / 10 over the fine-tuning epochs (a function of the epoch
      // alone, so a resumed run uses the same rates).
      const double lr = o_.lr * (0.1 + 0.9 * 0.5 * (1.0 + std::cos(std::numbers::pi * static_cast<double>(e) / static_cast<double>(o_.epochs))));
      for (auto& group : opt.param_groups()) static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);
      CheckpointHook hook{this, &model, &opt, checkpoint, e, &st, start, seconds_before};
      const double loss = train_epoch(model, opt, train_all_, e, e == st.epoch ? st.position : 0, &hook, fmt::format("epoch {}", e + 1));
      if (hook.stopped) {
        log_.info("stopped after {} optimizer steps as asked (--stop-after-steps); checkpoint {}", st.step, checkpoint.string());
        return;
      }
      last = evaluate(model);
      epochs_done = e + 1;
      st.epoch = e + 1;
      st.position = 0;
      st.seconds = seconds_before + secs(start);
      if (me_.rank == 0) save_checkpoint(checkpoint, model, &opt, st);
      log_.info("epoch {}/{}: train_loss={:.4f} val_loss={:.4f} val_accuracy={:.4f} majority_baseline={:.4f} seconds={:.1f}", e + 1,
                o_.epochs, loss, last.loss, last.accuracy, majority_baseline_, secs(t0));
    }
    comm_.barrier();
    log_.info("result: val_accuracy={:.4f} majority_baseline={:.4f} epochs={} seconds={:.1f}", last.accuracy, majority_baseline_,
              epochs_done, seconds_before + secs(start));
  }

 private:
  /// Called at every optimizer step of fine-tuning: counts, checkpoints, and stops when asked.
  struct CheckpointHook {
    Trainer* self;
    IconNet* model;
    torch::optim::Optimizer* opt;
    fs::path file;
    int64_t epoch;
    RunState* st;
    Clock::time_point start;
    double seconds_before;
    bool stopped = false;

    /// `position`: sampler steps done in this epoch. Returns true to stop the epoch now.
    bool after_step(int64_t position) {
      ++st->step;
      const bool stop = self->o_.stop_after_steps > 0 && st->step >= self->o_.stop_after_steps;
      if (stop || (self->o_.checkpoint_every > 0 && st->step % self->o_.checkpoint_every == 0)) {
        st->epoch = epoch;
        st->position = position;
        st->seconds = seconds_before + secs(start);
        if (self->me_.rank == 0) save_checkpoint(file, *model, opt, *st);
        self->comm_.barrier();
      }
      stopped = stop;
      return stop;
    }
  };

  static std::vector<int> all_sizes(const Options& o) {
    std::vector<int> s = o.sizes;
    for (int p : o.pretrain_sizes)
      if (std::find(s.begin(), s.end(), p) == s.end()) s.push_back(p);
    return s;
  }
  static double secs(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

  std::vector<std::vector<int64_t>> shapes_of(const std::vector<int64_t>& idx) const {
    std::vector<std::vector<int64_t>> shapes;
    shapes.reserve(idx.size());
    for (int64_t i : idx) {
      const auto s = icons_.pixels(static_cast<std::size_t>(i)).sizes();
      shapes.emplace_back(s.begin(), s.end());
    }
    return shapes;
  }

  /// A sample for the collator: C x H x W float32 in [0, 1] and its class.
  std::pair<torch::Tensor, int64_t> fetch(const std::vector<int64_t>& subset, int64_t j) const {
    const auto i = static_cast<std::size_t>(subset[static_cast<std::size_t>(j)]);
    return {icons_.pixels(i).to(torch::kFloat).div_(255.0), icons_.label(i)};
  }

  loom::BucketBatchSamplerOptions sampler_options(bool shuffle) const {
    return {.num_replicas = me_.world_size,
            .rank = me_.rank,
            .shuffle = shuffle,
            .seed = o_.seed,
            .max_samples = o_.max_batch,
            .max_elements = o_.batch_pixels * o_.channels,
            .surplus = loom::SurplusPolicy::repeat};
  }

  /// One epoch over `subset` (dataset indices) starting at sampler step `position`; returns the
  /// mean training loss over all ranks' samples of the epoch part it ran.
  double train_epoch(IconNet& model, torch::optim::Optimizer& opt, const std::vector<int64_t>& subset, int64_t epoch,
                     int64_t position, CheckpointHook* hook, const std::string& label) {
    model->train();
    loom::DistributedBucketBatchSampler sampler(shapes_of(subset), sampler_options(/*shuffle=*/true));
    sampler.set_epoch(epoch);
    if (position > 0) {
      loom::SamplerState s = sampler.state();
      s.position = position;
      sampler.load_state(s);
    }
    loom::Reducer reducer(comm_, loom::parameters_of(*model));
    loom::Accumulator acc(reducer, {.micro_batches_per_step = o_.accumulate});
    loom::Progress progress{loom::StreamSink{stdout}, me_,
                            {.total = static_cast<int64_t>(subset.size()), .label = label, .sync_every = 8}};
    loom::WeightedMean loss_mean;
    opt.zero_grad();
    int64_t done = position;
    auto apply = [&](const loom::SyncResult& step) {
      if (step) opt.step();
      opt.zero_grad();
    };
    bool stop = false;
    while (auto planned = sampler.next()) {
      loom::Batch b = loom::collate_sampled(*planned, [&](int64_t j) { return fetch(subset, j); });
      auto mb = acc.micro_batch(b);  // counts 0 samples for a weight-0 (repeated) batch
      const torch::Tensor logits = model->forward(b.data.to(device_));
      const torch::Tensor loss =
          torch::nn::functional::cross_entropy(logits, b.targets.to(device_),
                                               torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum)) *
          b.weight;
      mb.scale(loss).backward();
      const loom::SyncResult step = mb.finish();
      ++done;
      if (b.weight > 0) loss_mean.add(loss.item<double>() / static_cast<double>(b.num_samples), static_cast<double>(b.num_samples));
      progress.step(comm_, b.weight > 0 ? b.num_samples : 0);
      if (step.boundary) {
        apply(step);
        if (hook != nullptr && hook->after_step(done)) {
          stop = true;
          break;
        }
      }
    }
    if (!stop) {
      while (auto step = acc.end_epoch()) {  // the remainder (fewer than --accumulate micro-batches)
        apply(*step);
        if (step->boundary && hook != nullptr) {
          // a step at the epoch's end is not a resumable mid-epoch position; count it only
          ++hook->st->step;
        }
      }
    }
    progress.finish(comm_);
    if (stop) return 0.0;
    return loom::global_mean(comm_, loss_mean);
  }

  /// Accuracy and mean loss over the validation split, every sample counted once over all ranks.
  EvalResult evaluate(IconNet& model) {
    model->eval();
    torch::NoGradGuard no_grad;
    loom::DistributedBucketBatchSampler sampler(shapes_of(val_), sampler_options(/*shuffle=*/false));
    sampler.set_epoch(0);
    loom::WeightedMean accuracy, loss;
    while (auto planned = sampler.next()) {
      loom::Batch b = loom::collate_sampled(*planned, [&](int64_t j) { return fetch(val_, j); });
      if (b.weight == 0) continue;  // another rank evaluates these samples
      const torch::Tensor logits = model->forward(b.data.to(device_));
      const torch::Tensor y = b.targets.to(device_);
      const auto n = static_cast<double>(b.num_samples);
      accuracy.add(logits.argmax(1).eq(y).sum().item<double>() / n, n);
      loss.add(torch::nn::functional::cross_entropy(logits, y).item<double>(), n);
    }
    std::array<loom::WeightedMean, 2> metrics{accuracy, loss};
    const auto means = loom::global_means(comm_, std::span<const loom::WeightedMean>(metrics));
    return {means[0], means[1]};
  }

  Comm& comm_;
  loom::RankInfo me_;
  const Options& o_;
  Log& log_;
  torch::Device device_;
  loom::data::IconFolder icons_;
  std::vector<int64_t> train_all_, train_small_, val_;
  std::string majority_class_;
  double majority_baseline_ = 0;
};

template <class Comm>
void train_with(Comm& comm, const loom::Environment& env, const Options& o, torch::Device device, Clock::time_point start) {
  const loom::RankInfo me = loom::rank_info(env);
  loom::Logger log{loom::StreamSink{stdout}, me};
  log.info("finetune_icons: {} rank(s) ({} launcher), communicator {}, device {}", env.world_size,
           loom::to_string(env.launcher), env.world_size > 1 ? "gloo" : "local", device.str());
  Trainer<Comm, decltype(log)> trainer(comm, me, o, log, device);
  trainer.run(start);
}

/// One rank: picks the device and the communicator, then trains.
/// Devices: `--device cuda` (or `auto` when CUDA is there) puts the model and the batches on GPU
/// `local_rank`; the ranks still talk through Gloo, which moves CUDA tensors through host memory.
/// (loom::NcclCommunicator takes device tensors only, while the reducer's sample counts and the
/// metrics are small host tensors; see docs/examples.md.)
void run_rank(const loom::Environment& env, Options o, Clock::time_point start) {
  at::set_num_threads(o.threads);
  const bool cuda = torch::cuda::is_available();
  if (o.device == "auto") o.device = cuda ? "cuda" : "cpu";
  if (o.device == "cuda" && !cuda)
    throw loom::ConfigError("--device cuda: this LibTorch or machine has no CUDA device; use --device cpu");
  const torch::Device device = o.device == "cuda" ? torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(env.local_rank))
                                                  : torch::Device(torch::kCPU);
  if (env.world_size == 1) {
    loom::LocalCommunicator comm;
    train_with(comm, env, o, device, start);
  } else {
    loom::GlooCommunicator comm(env, {.timeout = std::chrono::milliseconds(static_cast<int64_t>(o.timeout * 1000))});
    train_with(comm, env, o, device, start);
  }
}

int main(int argc, char** argv) {
  const auto start = Clock::now();
  Options o;
  CLI::App app{"Fine-tune a small CNN on Adwaita's icons (each at its own size) over several ranks."};
  app.add_option("--nproc", o.nproc, "ranks to spawn on this machine (ignored under torchrun/mpirun/srun)")->check(CLI::Range(1, 64));
  app.add_option("--device", o.device, "auto | cpu | cuda (GPU local_rank; ranks talk through Gloo)")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  app.add_option("--data", o.data, "icon theme root (<N>x<N>/<context>/*.png)");
  app.add_option("--sizes", o.sizes, "icon sizes to fine-tune on, px")->delimiter(',');
  app.add_option("--pretrain-sizes", o.pretrain_sizes, "icon sizes to pre-train on, px")->delimiter(',');
  app.add_option("--channels", o.channels, "4 = RGBA, 3 = RGB over black, 1 = alpha")->check(CLI::IsMember({1, 3, 4}));
  app.add_option("--val-fraction", o.val_fraction, "fraction of icon names held out")->check(CLI::Range(0.01, 0.9));
  app.add_option("--seed", o.seed, "seed of the split, the initial weights and the shuffles");
  app.add_option("--subset", o.subset, "keep about 1/k of the icon names (short runs; 0 = all)");
  app.add_option("--pretrain-epochs", o.pretrain_epochs, "pre-training epochs (0: none)");
  app.add_option("--epochs", o.epochs, "fine-tuning epochs");
  app.add_option("--pretrain-lr", o.pretrain_lr, "AdamW learning rate for pre-training");
  app.add_option("--lr", o.lr, "AdamW learning rate at the start of fine-tuning (cosine decay to a tenth)");
  app.add_option("--width", o.width, "channels of the first conv layer (x2, x4 after); a multiple of 8");
  app.add_option("--batch-pixels", o.batch_pixels, "pixels (H x W) per micro-batch");
  app.add_option("--max-batch", o.max_batch, "samples per micro-batch");
  app.add_option("--accumulate", o.accumulate, "micro-batches per optimizer step")->check(CLI::PositiveNumber);
  app.add_option("--out", o.out, "folder for pretrained.pt and checkpoint.pt");
  app.add_option("--init", o.init, "start from this model file (a checkpoint or TorchScript) instead of pre-training");
  app.add_option("--resume", o.resume, "resume fine-tuning from this checkpoint");
  app.add_option("--checkpoint-every", o.checkpoint_every, "optimizer steps between mid-epoch checkpoints (0: epoch ends)");
  app.add_option("--stop-after-steps", o.stop_after_steps, "stop after this many fine-tuning optimizer steps (tests resume)");
  app.add_flag("--skip-corrupt", o.skip_corrupt, "skip undecodable PNG files with a warning instead of failing");
  app.add_option("--threads", o.threads, "intra-op threads per rank")->check(CLI::PositiveNumber);
  app.add_option("--timeout", o.timeout, "seconds a rank waits at rendezvous, connect and in any collective")
      ->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  if (o.width % 8 != 0) {
    fmt::print(stderr, "--width {} must be a multiple of 8 (GroupNorm groups)\n", o.width);
    return 2;
  }

  try {
    const loom::Environment env = loom::Environment::from_env();
    if (env.launcher == loom::Launcher::none && o.nproc > 1) {
      // No launcher: become the launcher. spawn forks before any tensor work (its fork rule).
      loom::spawn(o.nproc, [&](const loom::Environment& child) { run_rank(child, o, start); },
                  {.threads_per_rank = o.threads});
    } else {
      run_rank(env, o, start);
    }
  } catch (const loom::Error& e) {
    fmt::print(stderr, "finetune_icons: {}\n", e.what());
    return 1;
  }
  return 0;
}
