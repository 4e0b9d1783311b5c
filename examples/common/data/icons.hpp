// examples/common/data/icons.hpp — a folder of PNG icons as a classification dataset, each at its own size.
//
// One sentence: `IconFolder` reads an icon theme laid out as <root>/<W>x<H>/<context>/<name>.png
// (the freedesktop layout Debian's adwaita-icon-theme uses), labels each icon with its context
// folder, keeps each image at its own size, and `split_by_name` splits train/validation by icon
// name so the sizes of one icon never straddle the split.
//
// Example:
//   examples::data::IconFolder icons({.root = "/usr/share/icons/Adwaita", .sizes = {16, 24, 32}});
//   auto split = examples::data::split_by_name(icons, 0.25, /*seed=*/1);
//   examples::data::IconSample s = icons.get(split.train[0]);
//   // s.image: 4 x 16 x 16 float32 in [0, 1]; s.label: index into icons.classes() ("actions", ...)
//
// Decoding: every file is decoded once, at construction (so a corrupt file is found before
// training starts), and kept as uint8; get() converts one image to float32.
// Memory: about channels x H x W bytes per icon (all of Adwaita at 16..96 px: ~20 MB).
//
// Source: the folder-per-class convention of torchvision.datasets.ImageFolder; the
// <size>/<context> layout of the freedesktop Icon Theme Specification.
#pragma once

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <loom/error.hpp>

#include "corrupt.hpp"
#include "png.hpp"

namespace examples::data {

/// What IconFolder reads. An aggregate: use designated initializers.
///
/// Example: `IconFolderOptions{.root = "/usr/share/icons/Adwaita", .sizes = {16, 32}, .channels = 1}`
struct IconFolderOptions {
  /// Theme root holding <W>x<H>/<context>/ folders; folders not named <W>x<H> (scalable,
  /// cursors) are ignored.
  std::filesystem::path root = "/usr/share/icons/Adwaita";
  /// Square sizes to read, in pixels (the N of an "NxN" folder); empty: every size found.
  std::vector<int> sizes = {};
  /// Contexts (class folders) to read, in label order; empty: every context found, sorted by name.
  std::vector<std::string> contexts = {};
  /// Channels per image: 4 = RGBA, 3 = RGB composited over black, 1 = alpha (see read_png).
  int channels = 4;
  /// Throw on the first undecodable file (default) or skip it with a warning and count it.
  OnCorrupt on_corrupt = OnCorrupt::throw_error;
  /// Receives one line per skipped file when on_corrupt == skip.
  WarningSink warn = warn_to_stderr;
};

/// One icon: its pixels at their own size and its class.
///
/// Shape: `image` is channels x H x W float32 in [0, 1] (H, W: the icon's own size in pixels).
struct IconSample {
  at::Tensor image;            ///< channels x H x W, float32, [0, 1]
  int64_t label = 0;           ///< index into IconFolder::classes()
  std::string name;            ///< icon name: file name without ".png" and ".symbolic"
  std::filesystem::path path;  ///< the file it was decoded from
};

/// Icon name of a file: the file name without its ".png" extension and a trailing ".symbolic"
/// ("edit-copy-symbolic.symbolic.png" -> "edit-copy-symbolic").
inline std::string icon_name(const std::filesystem::path& file) {
  std::string n = file.filename().string();
  for (std::string_view suffix : {std::string_view(".png"), std::string_view(".symbolic")}) {
    if (n.size() > suffix.size() && n.compare(n.size() - suffix.size(), suffix.size(), suffix) == 0)
      n.resize(n.size() - suffix.size());
  }
  return n;
}

namespace detail {
/// Parses "NxN" into N; nullopt for anything else ("scalable", "8x16", "cursors").
inline std::optional<int> parse_square_size(const std::string& dir) {
  const auto x = dir.find('x');
  if (x == std::string::npos || x == 0 || dir.find_first_not_of("0123456789x") != std::string::npos)
    return std::nullopt;
  const std::string w = dir.substr(0, x), h = dir.substr(x + 1);
  if (w.empty() || w != h || w.size() > 5) return std::nullopt;
  return std::stoi(w);
}

/// FNV-1a over the bytes of `s`, continued from `h` (a portable, seedable string hash).
inline std::uint64_t fnv1a(std::string_view s, std::uint64_t h = 14695981039346656037ull) {
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

/// splitmix64's finalizer: spreads every input bit over every output bit (FNV-1a alone leaves
/// the high bits of similar strings such as "icon1", "icon2" correlated).
inline std::uint64_t mix64(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
}  // namespace detail

/// The icons of a theme folder, decoded, labelled by context. See the file comment.
///
/// Example: `IconFolder icons({.sizes = {16}}); icons.size()` is about 700 for Adwaita.
/// Order: by (size, context, file name), the same on every rank and every run.
/// Throws: loom::DataError naming the folder if `root` does not exist or holds no matching PNG,
///         naming the file if a PNG cannot be decoded (unless on_corrupt == skip);
///         loom::InvalidArgument for channels not in {1, 3, 4}.
class IconFolder {
 public:
  explicit IconFolder(IconFolderOptions options) : options_(std::move(options)) {
    namespace fs = std::filesystem;
    const fs::path& root = options_.root;
    std::error_code ec;
    if (!fs::is_directory(root, ec))
      throw loom::DataError(fmt::format(
          "{}: icon folder does not exist (install adwaita-icon-theme, or pass the theme root)", root.string()));
    if (options_.channels != 1 && options_.channels != 3 && options_.channels != 4)
      throw loom::InvalidArgument(
          fmt::format("IconFolderOptions::channels={} (expected 1, 3 or 4)", options_.channels));

    // Collect (size, context, file) in a deterministic order.
    struct Entry {
      int size;
      std::string context;
      fs::path file;
    };
    std::vector<Entry> entries;
    std::set<std::string> found_contexts;
    for (const auto& size_dir : fs::directory_iterator(root)) {
      if (!size_dir.is_directory()) continue;
      const auto px = detail::parse_square_size(size_dir.path().filename().string());
      if (!px) continue;
      if (!options_.sizes.empty() &&
          std::find(options_.sizes.begin(), options_.sizes.end(), *px) == options_.sizes.end())
        continue;
      for (const auto& ctx_dir : fs::directory_iterator(size_dir.path())) {
        if (!ctx_dir.is_directory()) continue;
        const std::string ctx = ctx_dir.path().filename().string();
        if (!options_.contexts.empty() &&
            std::find(options_.contexts.begin(), options_.contexts.end(), ctx) == options_.contexts.end())
          continue;
        for (const auto& f : fs::directory_iterator(ctx_dir.path())) {
          if (f.path().extension() != ".png") continue;
          entries.push_back({*px, ctx, f.path()});
          found_contexts.insert(ctx);
        }
      }
    }
    if (entries.empty())
      throw loom::DataError(fmt::format("{}: no PNG icons under <size>/<context>/ (sizes [{}], contexts [{}])",
                                        root.string(), fmt::join(options_.sizes, ", "),
                                        fmt::join(options_.contexts, ", ")));
    std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
      return std::tie(a.size, a.context, a.file) < std::tie(b.size, b.context, b.file);
    });

    classes_ = options_.contexts.empty() ? std::vector<std::string>(found_contexts.begin(), found_contexts.end())
                                         : options_.contexts;
    std::map<std::string, int64_t> label_of;
    for (std::size_t i = 0; i < classes_.size(); ++i) label_of[classes_[i]] = static_cast<int64_t>(i);

    for (const Entry& e : entries) {
      at::Tensor px;
      try {
        px = read_png(e.file, options_.channels);
      } catch (const loom::DataError& err) {
        if (options_.on_corrupt == OnCorrupt::throw_error) throw;
        skipped_.push_back({e.file, err.what()});
        options_.warn(fmt::format("skipping {} ({})", e.file.string(), err.what()));
        continue;
      }
      pixels_.push_back(std::move(px));
      labels_.push_back(label_of.at(e.context));
      names_.push_back(icon_name(e.file));
      paths_.push_back(e.file);
    }
    if (pixels_.empty())
      throw loom::DataError(
          fmt::format("{}: every one of the {} PNG files was corrupt", root.string(), skipped_.size()));
  }

  /// Number of icons read (files skipped as corrupt are not counted).
  [[nodiscard]] std::size_t size() const noexcept { return pixels_.size(); }

  /// Icon `i` with float32 pixels in [0, 1]. Shape: channels x H x W.
  /// Throws: loom::InvalidArgument if i >= size().
  [[nodiscard]] IconSample get(std::size_t i) const {
    check_index(i);
    return {pixels_[i].to(at::kFloat).div_(255.0), labels_[i], names_[i], paths_[i]};
  }

  /// Icon `i`'s stored pixels. Shape: channels x H x W, uint8.
  [[nodiscard]] const at::Tensor& pixels(std::size_t i) const {
    check_index(i);
    return pixels_[i];
  }
  /// Class index of icon `i`.
  [[nodiscard]] int64_t label(std::size_t i) const {
    check_index(i);
    return labels_[i];
  }
  /// Icon name of icon `i` (see icon_name).
  [[nodiscard]] const std::string& name(std::size_t i) const {
    check_index(i);
    return names_[i];
  }
  /// Class names, in label order.
  [[nodiscard]] const std::vector<std::string>& classes() const noexcept { return classes_; }
  /// Files left out under OnCorrupt::skip (empty otherwise).
  [[nodiscard]] const std::vector<SkippedFile>& skipped() const noexcept { return skipped_; }
  /// The options this folder was read with.
  [[nodiscard]] const IconFolderOptions& options() const noexcept { return options_; }

 private:
  void check_index(std::size_t i) const {
    if (i >= pixels_.size())
      throw loom::InvalidArgument(fmt::format("IconFolder: index {} is outside [0, {})", i, pixels_.size()));
  }

  IconFolderOptions options_;
  std::vector<std::string> classes_;
  std::vector<at::Tensor> pixels_;
  std::vector<int64_t> labels_;
  std::vector<std::string> names_;
  std::vector<std::filesystem::path> paths_;
  std::vector<SkippedFile> skipped_;
};

/// Indices of a train/validation split.
struct Split {
  std::vector<int64_t> train;  ///< dataset indices, ascending
  std::vector<int64_t> val;    ///< dataset indices, ascending
};

/// Splits icons into train and validation by icon name: all sizes of one name land on the same side.
///
/// Example: `split_by_name(icons, 0.25, 1)` puts about a quarter of the names in `val`.
/// A name goes to validation when hash(seed, name) / 2^64 < val_fraction (FNV-1a, then splitmix64's
/// finalizer), so the split
/// depends only on the names and the seed: every rank, every run and every size subset agree.
/// Throws: loom::InvalidArgument if val_fraction is outside [0, 1].
/// Source: hash-based splitting as in TensorFlow Datasets' "split by key" and Google's
///         "ML test score" advice to split by entity, not by example.
inline Split split_by_name(const IconFolder& icons, double val_fraction, std::uint64_t seed) {
  if (!(val_fraction >= 0.0 && val_fraction <= 1.0))
    throw loom::InvalidArgument(fmt::format("split_by_name: val_fraction={} is outside [0, 1]", val_fraction));
  Split s;
  const std::string seed_text = fmt::format("{}:", seed);
  for (std::size_t i = 0; i < icons.size(); ++i) {
    const std::uint64_t h = detail::mix64(detail::fnv1a(icons.name(i), detail::fnv1a(seed_text)));
    // Top 53 bits as a double in [0, 1).
    const double u = static_cast<double>(h >> 11) * (1.0 / 9007199254740992.0);
    (u < val_fraction ? s.val : s.train).push_back(static_cast<int64_t>(i));
  }
  return s;
}

}  // namespace examples::data
