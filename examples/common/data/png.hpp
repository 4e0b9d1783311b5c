// examples/common/data/png.hpp — decode one PNG file into a uint8 tensor with libpng.
//
// One sentence: `read_png(path, channels)` returns the image at its own size as a
// channels x height x width uint8 tensor, or throws loom::DataError naming the file.
//
// Example:
//   at::Tensor img = examples::data::read_png("/usr/share/icons/Adwaita/16x16/actions/edit-copy-symbolic.symbolic.png");
//   // img.sizes() == {4, 16, 16}, dtype uint8 (R, G, B, A; straight, not premultiplied alpha)
//   at::Tensor x = img.to(at::kFloat).div_(255);   // what IconFolder::get does
//
// Link: this header calls libpng (Meson: dependency('libpng'); pkg-config: libpng); loom's own
// headers do not need it.
//
// Source: libpng's "simplified API" (png_image_*, libpng >= 1.6), which converts every PNG colour
// type and bit depth to 8-bit RGBA; channels=3 composites over black (premultiplies by alpha),
// as PIL's `Image.convert("RGB")` does for an RGBA image on a black background.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <fmt/format.h>
#include <png.h>

#include <loom/error.hpp>

namespace examples::data {

/// Decodes the PNG file at `path` into a `channels` x H x W uint8 tensor.
///
/// Example: `read_png(p, 3)` on a 48x48 RGBA icon gives a 3x48x48 tensor whose pixels are
///          R*A/255, G*A/255, B*A/255 (rounded), i.e. the icon composited over black.
/// Shape: channels x H x W, dtype uint8, contiguous, values 0..255. channels = 4: R, G, B, A
///        (straight alpha, as stored); 3: RGB premultiplied by alpha; 1: alpha only (the
///        silhouette, which is all a symbolic icon carries).
/// Throws: loom::InvalidArgument if channels is not 1, 3 or 4; loom::DataError naming the file
///         if it is missing, not a PNG, truncated or corrupt (the message carries libpng's reason).
/// Source: libpng simplified API (png_image_begin_read_from_file / png_image_finish_read).
inline at::Tensor read_png(const std::filesystem::path& path, int channels = 4) {
  if (channels != 1 && channels != 3 && channels != 4)
    throw loom::InvalidArgument(fmt::format("read_png: channels={} (expected 1, 3 or 4)", channels));
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec))
    throw loom::DataError(fmt::format("{}: no such PNG file", path.string()));

  png_image image{};
  image.version = PNG_IMAGE_VERSION;
  struct Guard {  // png_image_free on every path, including the throwing ones
    png_image* img;
    ~Guard() { png_image_free(img); }
  } guard{&image};

  if (png_image_begin_read_from_file(&image, path.c_str()) == 0)
    throw loom::DataError(fmt::format("{}: cannot read PNG: {}", path.string(), image.message));
  image.format = PNG_FORMAT_RGBA;
  const auto height = static_cast<int64_t>(image.height);
  const auto width = static_cast<int64_t>(image.width);
  if (height <= 0 || width <= 0)
    throw loom::DataError(fmt::format("{}: PNG has an empty size {}x{}", path.string(), width, height));
  // The header's size is a claim: decoding allocates it before finding the pixel data missing. A
  // PNG's zlib stream expands at most 1032-fold and a pixel takes at least 1/8 byte in the file
  // (1-bit), 4 bytes here, so a file cannot hold more than 4 * 8 * 1032 output bytes per byte.
  const auto file_bytes = static_cast<int64_t>(std::filesystem::file_size(path, ec));
  if (!ec && 4 * width * height > int64_t{4 * 8 * 1032} * file_bytes + (int64_t{1} << 20))
    throw loom::DataError(fmt::format("{}: the PNG header claims {} x {} pixels, more than its {} bytes can hold",
                                      path.string(), width, height, file_bytes));
  std::vector<std::uint8_t> rgba(PNG_IMAGE_SIZE(image));
  if (png_image_finish_read(&image, nullptr, rgba.data(), 0, nullptr) == 0)
    throw loom::DataError(fmt::format("{}: corrupt PNG: {}", path.string(), image.message));
  // libpng reports recoverable problems (e.g. a bad CRC in an ancillary chunk) as warnings with
  // PNG_IMAGE_WARNING set; the pixels are still valid, so they are accepted.

  at::Tensor out = at::empty({channels, height, width}, at::TensorOptions().dtype(at::kByte));
  auto* dst = out.data_ptr<std::uint8_t>();
  const int64_t plane = height * width;
  for (int64_t i = 0; i < plane; ++i) {
    const std::uint8_t* px = rgba.data() + 4 * i;
    if (channels == 4) {
      for (int c = 0; c < 4; ++c) dst[c * plane + i] = px[c];
    } else if (channels == 3) {
      const unsigned a = px[3];
      for (int c = 0; c < 3; ++c) dst[c * plane + i] = static_cast<std::uint8_t>((px[c] * a + 127u) / 255u);
    } else {
      dst[i] = px[3];
    }
  }
  return out;
}

}  // namespace examples::data
