// examples/common/data/corrupt.hpp — what a dataset reader does with a file it cannot decode.
//
// One sentence: a reader either throws loom::DataError naming the first bad file (the default),
// or, when the user chose `OnCorrupt::skip`, leaves the file out, reports one warning line per
// file through a callback and counts it, so nothing is dropped silently.
//
// Example:
//   examples::data::IconFolderOptions opts{.root = "/usr/share/icons/Adwaita",
//                                      .on_corrupt = examples::data::OnCorrupt::skip,
//                                      .warn = [](std::string_view m) { std::cerr << m << '\n'; }};
//   examples::data::IconFolder icons(opts);
//   fmt::print("skipped {} files\n", icons.skipped().size());
//
// Source: the throw-or-skip choice follows torchvision's ImageFolder `is_valid_file` hook and
// tf.data's `ignore_errors()`, but these readers always report what they skipped.
#pragma once

#include <cstdio>
#include <filesystem>
#include <functional>
#include <string>
#include <string_view>

namespace examples::data {

/// What a reader does with a file that exists but cannot be decoded (corrupt or truncated).
/// A *missing* folder or file is always an error: there is nothing to skip.
enum class OnCorrupt {
  throw_error,  ///< throw loom::DataError naming the file (default)
  skip,         ///< leave the file out, call `warn` with one line naming it, count it in `skipped()`
};

/// Receives one human-readable warning line per skipped file (no trailing newline, no "warning: "
/// prefix: the sink adds its own, e.g. loom::Logger::warning).
using WarningSink = std::function<void(std::string_view)>;

/// The default WarningSink: writes "warning: <line>" to stderr.
inline void warn_to_stderr(std::string_view line) {
  std::fprintf(stderr, "warning: %.*s\n", static_cast<int>(line.size()), line.data());
}

/// A file a reader left out under OnCorrupt::skip, and why.
struct SkippedFile {
  std::filesystem::path path;  ///< the file that could not be decoded
  std::string reason;          ///< the decoder's message
};

}  // namespace examples::data
