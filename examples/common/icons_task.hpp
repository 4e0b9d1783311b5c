// examples/common/icons_task.hpp — the icon-context task shared by examples/finetune_icons and
// bench/bench_finetune: Debian's Adwaita icons at their own sizes, a train/validation split by
// icon name, the model (IconNet), and evaluation over every rank.
//
// Data: /usr/share/icons/Adwaita/<N>x<N>/<context>/*.png (adwaita-icon-theme), read once with
// examples::data::IconFolder (libpng); the label is the context folder (actions, devices, status, ...).
// The split puts every size of one icon on the same side (examples::data::split_by_name).
// Model: three conv blocks with GroupNorm (no running statistics: replicas never drift and a
// batch of one 48 px icon is fine), adaptive pooling to 2 x 2, a linear head.
// Shape: a sample is C x H x W float32 in [0, 1] (its own H = W), its label an int64 class id;
//        IconNet maps N x C x H x W (H, W >= 8, one size per batch) to N x classes logits.
#pragma once

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>

#include <loom/error.hpp>
#include <loom/sample/global_batch.hpp>
#include <loom/train/evaluate.hpp>
#include <loom/train/loader.hpp>

#include "data/icons.hpp"

namespace examples {

/// What the icon task reads and how it splits it.
struct IconTaskOptions {
  std::filesystem::path data = "/usr/share/icons/Adwaita";
  std::vector<int> sizes = {16, 24, 32, 48};   ///< sizes to train on, px
  std::vector<int> pretrain_sizes = {16, 24};  ///< sizes of the pre-training subset, px
  int channels = 4;                            ///< 4 = RGBA, 3 = RGB over black, 1 = alpha
  double val_fraction = 0.25;                  ///< fraction of icon names held out
  uint64_t seed = 1;                           ///< seed of the split
  int64_t subset = 0;                          ///< keep about 1/k of the icon names (0 = all)
  bool skip_corrupt = false;                   ///< skip undecodable PNG files with a warning
};

struct IconNetImpl : torch::nn::Module {
  IconNetImpl(int channels, int width, int classes)
      : features(register_module(
            "features",
            torch::nn::Sequential(torch::nn::Conv2d(torch::nn::Conv2dOptions(channels, width, 3).padding(1)),
                                  torch::nn::GroupNorm(8, width), torch::nn::ReLU(), torch::nn::MaxPool2d(2),
                                  torch::nn::Conv2d(torch::nn::Conv2dOptions(width, 2 * width, 3).padding(1)),
                                  torch::nn::GroupNorm(8, 2 * width), torch::nn::ReLU(), torch::nn::MaxPool2d(2),
                                  torch::nn::Conv2d(torch::nn::Conv2dOptions(2 * width, 4 * width, 3).padding(1)),
                                  torch::nn::GroupNorm(8, 4 * width), torch::nn::ReLU(),
                                  torch::nn::AdaptiveAvgPool2d(torch::nn::AdaptiveAvgPool2dOptions({2, 2})),
                                  torch::nn::Flatten()))),
        head(register_module("head", torch::nn::Linear(16 * width, classes))) {}

  torch::Tensor forward(const torch::Tensor& x) { return head->forward(features->forward(x)); }

  torch::nn::Sequential features;
  torch::nn::Linear head;
};
TORCH_MODULE(IconNet);

/// Validation accuracy and mean loss over every sample, every rank.
struct EvalResult {
  double accuracy = 0;
  double loss = 0;
};

/// The icons, their split, and the majority baseline.
class IconTask {
 public:
  /// Throws: loom::DataError (missing folder, corrupt PNG unless skip_corrupt), loom::InvalidArgument
  /// (nothing left to train or validate on).
  template <class Warn>
  IconTask(const IconTaskOptions& o, Warn&& warn)
      : o_(o),
        icons_({.root = o.data,
                .sizes = all_sizes(o),
                .channels = o.channels,
                .on_corrupt = o.skip_corrupt ? examples::data::OnCorrupt::skip : examples::data::OnCorrupt::throw_error,
                .warn = std::forward<Warn>(warn)}) {
    auto split = examples::data::split_by_name(icons_, o.val_fraction, o.seed);
    // --subset k keeps about 1/k of the icon names (all sizes of each), chosen by another name split.
    std::vector<char> kept(icons_.size(), 1);
    if (o.subset > 1) {
      std::fill(kept.begin(), kept.end(), 0);
      for (int64_t i : examples::data::split_by_name(icons_, 1.0 / static_cast<double>(o.subset), o.seed + 1).val)
        kept[static_cast<std::size_t>(i)] = 1;
    }
    auto keep = [&](int64_t i) { return kept[static_cast<std::size_t>(i)] != 0; };
    for (int64_t i : split.train) {
      if (!keep(i)) continue;
      const int side = static_cast<int>(icons_.pixels(static_cast<std::size_t>(i)).size(1));
      if (std::find(o.sizes.begin(), o.sizes.end(), side) != o.sizes.end()) train_.push_back(i);
      if (std::find(o.pretrain_sizes.begin(), o.pretrain_sizes.end(), side) != o.pretrain_sizes.end())
        train_small_.push_back(i);
    }
    for (int64_t i : split.val)
      if (keep(i)) val_.push_back(i);
    if (train_.empty() || val_.empty())
      throw loom::InvalidArgument(
          fmt::format("no training ({}) or validation ({}) icons left: lower --subset or --val-fraction", train_.size(),
                      val_.size()));
    std::vector<int64_t> counts(icons_.classes().size(), 0);
    for (int64_t i : val_) ++counts[static_cast<std::size_t>(icons_.label(static_cast<std::size_t>(i)))];
    const auto top = std::max_element(counts.begin(), counts.end());
    majority_class_ = icons_.classes()[static_cast<std::size_t>(top - counts.begin())];
    majority_baseline_ = static_cast<double>(*top) / static_cast<double>(val_.size());
  }

  /// Dataset indices of the training icons (all sizes), the pre-training subset, and validation.
  [[nodiscard]] const std::vector<int64_t>& train() const noexcept { return train_; }
  [[nodiscard]] const std::vector<int64_t>& train_small() const noexcept { return train_small_; }
  [[nodiscard]] const std::vector<int64_t>& val() const noexcept { return val_; }
  [[nodiscard]] const examples::data::IconFolder& icons() const noexcept { return icons_; }
  [[nodiscard]] int classes() const noexcept { return static_cast<int>(icons_.classes().size()); }
  [[nodiscard]] const std::string& majority_class() const noexcept { return majority_class_; }
  [[nodiscard]] double majority_baseline() const noexcept { return majority_baseline_; }
  [[nodiscard]] int64_t skipped() const noexcept { return static_cast<int64_t>(icons_.skipped().size()); }

  /// Shapes (C x H x W) of `subset`'s icons, in subset order.
  [[nodiscard]] std::vector<std::vector<int64_t>> shapes_of(const std::vector<int64_t>& subset) const {
    std::vector<std::vector<int64_t>> shapes;
    shapes.reserve(subset.size());
    for (int64_t i : subset) {
      const auto s = icons_.pixels(static_cast<std::size_t>(i)).sizes();
      shapes.emplace_back(s.begin(), s.end());
    }
    return shapes;
  }

  /// Sample j of `subset`: C x H x W float32 in [0, 1] and its class.
  [[nodiscard]] std::pair<torch::Tensor, int64_t> sample(const std::vector<int64_t>& subset, int64_t j) const {
    const auto i = static_cast<std::size_t>(subset[static_cast<std::size_t>(j)]);
    return {icons_.pixels(i).to(torch::kFloat).div_(255.0), icons_.label(i)};
  }

  /// Accuracy and mean loss over the validation split, each sample once over all ranks: a
  /// BatchLoader over the split in order, loom::evaluate gathering each sample's (correct, loss).
  template <class Comm>
  EvalResult evaluate(Comm& comm, IconNet& model, torch::Device device, int64_t max_samples,
                      int64_t max_elements) const {
    loom::BatchLoader val(comm, shapes_of(val_), [this](int64_t j) { return sample(val_, j); },
                          {.shuffle = false,
                           .max_samples = max_samples,
                           .max_elements = max_elements,
                           .batches_per_step = comm.world_size()},
                          {.device = device});
    model->eval();
    const loom::GatheredResults r = loom::evaluate(comm, val, [&](loom::Batch& b) {
      const torch::Tensor logits = model->forward(b.data);
      const torch::Tensor correct = logits.argmax(1).eq(b.targets).to(torch::kDouble);
      const torch::Tensor loss = torch::nn::functional::cross_entropy(
          logits, b.targets, torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone));
      return torch::stack({correct, loss.to(torch::kDouble)}, 1);  // N x 2
    });
    model->train();
    const torch::Tensor mean = r.values.mean(0);  // over every validation sample, once each
    return {mean[0].item<double>(), mean[1].item<double>()};
  }

 private:
  static std::vector<int> all_sizes(const IconTaskOptions& o) {
    std::vector<int> s = o.sizes;
    for (int p : o.pretrain_sizes)
      if (std::find(s.begin(), s.end(), p) == s.end()) s.push_back(p);
    return s;
  }

  IconTaskOptions o_;
  examples::data::IconFolder icons_;
  std::vector<int64_t> train_, train_small_, val_;
  std::string majority_class_;
  double majority_baseline_ = 0;
};

}  // namespace examples
