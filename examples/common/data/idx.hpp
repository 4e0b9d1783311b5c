// examples/common/data/idx.hpp — IDX files (the MNIST / Fashion-MNIST format), gzipped or not, via zlib.
//
// One sentence: `read_idx(path)` returns the array stored in an IDX file as a uint8 tensor with
// the file's dimensions, and `read_fashion_mnist(dir, split)` returns Fashion-MNIST's images and
// labels from Debian's dataset-fashion-mnist folder, without unpacking anything to disk.
//
// Example:
//   auto train = examples::data::read_fashion_mnist("/usr/share/datasets/fashion-mnist",
//                                               examples::data::MnistSplit::train);
//   // train.images: 60000 x 28 x 28 uint8; train.labels: 60000 int64 in [0, 10)
//   fmt::print("{}\n", examples::data::kFashionMnistClasses[train.labels[0].item<int64_t>()]);
//
// Link: this header calls zlib (Meson: dependency('zlib'); pkg-config: zlib).
//
// Source: the IDX layout of Y. LeCun's MNIST page (big-endian magic 0x0000 <type> <ndim>, then
// ndim big-endian uint32 sizes, then the data in row-major order); gzread reads gzipped and plain
// files alike.
#pragma once

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <zlib.h>

#include <loom/error.hpp>

namespace examples::data {

namespace detail {
/// An open gzFile that closes itself; reads exactly n bytes or throws DataError naming the file.
class GzReader {
 public:
  explicit GzReader(const std::filesystem::path& path) : path_(path) {
    std::error_code ec;
    if (!std::filesystem::is_regular_file(path, ec))
      throw loom::DataError(fmt::format("{}: no such file", path.string()));
    file_ = gzopen(path.c_str(), "rb");
    if (file_ == nullptr)
      throw loom::DataError(fmt::format("{}: cannot open: {}", path.string(), std::strerror(errno)));
  }
  GzReader(const GzReader&) = delete;
  GzReader& operator=(const GzReader&) = delete;
  ~GzReader() {
    if (file_ != nullptr) gzclose(file_);
  }

  /// Reads up to `n` bytes into `dst`, fewer only where the file ends; returns how many.
  /// `what` names the part being read, for the message when the data is corrupt.
  std::size_t read_some(void* dst, std::size_t n, std::string_view what) {
    auto* p = static_cast<unsigned char*>(dst);
    std::size_t done = 0;
    while (done < n) {
      const auto chunk = static_cast<unsigned>(std::min<std::size_t>(n - done, 1u << 30));
      const int got = gzread(file_, p + done, chunk);
      if (got < 0) {
        int errnum = 0;
        const char* msg = gzerror(file_, &errnum);
        throw loom::DataError(fmt::format("{}: corrupt while reading {}: {}", path_.string(), what, msg ? msg : "?"));
      }
      if (got == 0) break;
      done += static_cast<std::size_t>(got);
    }
    return done;
  }

  /// Reads exactly `n` bytes into `dst`; `what` names the part being read, for the message.
  void read_exact(void* dst, std::size_t n, std::string_view what) {
    if (const std::size_t done = read_some(dst, n, what); done < n) truncated(what, n, done);
  }

  /// Throws the DataError of a file that ends after `done` of the `n` bytes `what` needs.
  [[noreturn]] void truncated(std::string_view what, std::size_t n, std::size_t done) const {
    throw loom::DataError(
        fmt::format("{}: truncated: {} needs {} bytes, the file ends after {}", path_.string(), what, n, done));
  }

 private:
  std::filesystem::path path_;
  gzFile file_ = nullptr;
};
}  // namespace detail

/// Reads an IDX file of unsigned bytes (type 0x08) into a uint8 tensor with the file's dimensions.
///
/// Example: `read_idx(".../t10k-labels-idx1-ubyte.gz").sizes() == {10000}`.
/// Shape: d0 x d1 x ... (the dimensions in the header), dtype uint8.
/// Throws: loom::DataError naming the file if it is missing, has a bad magic number, a data type
///         other than unsigned byte, a zero dimension, dimensions whose product exceeds 2^63, or is
///         truncated or not valid gzip.
/// Memory: the data is read in pieces of at most 64 MiB as the file delivers it (a header may claim
///         more than the file holds: its end stops the read, not an allocation of the claim), then
///         copied once into the tensor; the peak is twice the data.
/// Source: the IDX format of the MNIST database.
inline at::Tensor read_idx(const std::filesystem::path& path) {
  detail::GzReader in(path);
  unsigned char magic[4];
  in.read_exact(magic, 4, "the magic number");
  if (magic[0] != 0 || magic[1] != 0)
    throw loom::DataError(fmt::format("{}: not an IDX file (magic {:02x}{:02x}{:02x}{:02x})", path.string(), magic[0],
                                      magic[1], magic[2], magic[3]));
  if (magic[2] != 0x08)
    throw loom::DataError(
        fmt::format("{}: IDX data type 0x{:02x} is not supported (only 0x08, unsigned byte)", path.string(), magic[2]));
  const int ndim = magic[3];
  if (ndim < 1 || ndim > 4)
    throw loom::DataError(fmt::format("{}: IDX with {} dimensions (expected 1..4)", path.string(), ndim));
  std::vector<int64_t> dims(static_cast<std::size_t>(ndim));
  for (int d = 0; d < ndim; ++d) {
    unsigned char be[4];
    in.read_exact(be, 4, fmt::format("dimension {}", d));
    dims[static_cast<std::size_t>(d)] = (int64_t{be[0]} << 24) | (int64_t{be[1]} << 16) | (int64_t{be[2]} << 8) | be[3];
    if (dims[static_cast<std::size_t>(d)] == 0)
      throw loom::DataError(fmt::format("{}: IDX dimension {} is 0", path.string(), d));
  }
  int64_t total = 1;
  for (const int64_t d : dims)
    if (__builtin_mul_overflow(total, d, &total))
      throw loom::DataError(
          fmt::format("{}: IDX dimensions {} exceed 2^63 bytes", path.string(), fmt::join(dims, " x ")));
  constexpr int64_t kPiece = int64_t{64} << 20;
  std::vector<std::uint8_t> bytes;
  while (static_cast<int64_t>(bytes.size()) < total) {
    const std::size_t before = bytes.size();
    const auto want = static_cast<std::size_t>(std::min(total - static_cast<int64_t>(before), kPiece));
    bytes.resize(before + want);
    const std::size_t got = in.read_some(bytes.data() + before, want, "the data");
    if (got < want) in.truncated("the data", static_cast<std::size_t>(total), before + got);
  }
  at::Tensor out = at::empty(dims, at::TensorOptions().dtype(at::kByte));
  std::memcpy(out.data_ptr<std::uint8_t>(), bytes.data(), bytes.size());
  return out;
}

/// Which half of an MNIST-style dataset to read.
enum class MnistSplit { train, test };

/// Images and their class labels.
///
/// Shape: `images` N x 28 x 28 uint8 (0 = background); `labels` N int64 in [0, 10).
struct LabelledImages {
  at::Tensor images;  ///< N x H x W, uint8
  at::Tensor labels;  ///< N, int64
};

/// Fashion-MNIST's class names, in label order.
inline constexpr std::array<std::string_view, 10> kFashionMnistClasses = {
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"};

/// Debian's folder for Fashion-MNIST (package dataset-fashion-mnist).
inline const std::filesystem::path kDebianFashionMnistDir = "/usr/share/datasets/fashion-mnist";

/// Reads one split of Fashion-MNIST (or MNIST) from `dir`: {train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz].
///
/// Example: `read_fashion_mnist(kDebianFashionMnistDir, MnistSplit::test).images.size(0) == 10000`.
/// Shape: see LabelledImages.
/// Throws: loom::DataError naming the folder if it does not exist, naming the file if one is
///         missing or corrupt, naming both files if their counts differ or a label is >= 10.
/// Source: file names of the MNIST / Fashion-MNIST distributions.
inline LabelledImages read_fashion_mnist(const std::filesystem::path& dir, MnistSplit split) {
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec))
    throw loom::DataError(
        fmt::format("{}: Fashion-MNIST folder does not exist (install dataset-fashion-mnist)", dir.string()));
  const std::string prefix = split == MnistSplit::train ? "train" : "t10k";
  auto pick = [&](const std::string& stem) {
    const auto gz = dir / (stem + ".gz");
    const auto plain = dir / stem;
    return std::filesystem::exists(plain, ec) ? plain : gz;
  };
  const auto image_file = pick(prefix + "-images-idx3-ubyte");
  const auto label_file = pick(prefix + "-labels-idx1-ubyte");
  LabelledImages out{read_idx(image_file), read_idx(label_file)};
  if (out.images.dim() != 3)
    throw loom::DataError(
        fmt::format("{}: expected 3 dimensions (N x H x W), got {}", image_file.string(), out.images.dim()));
  if (out.labels.dim() != 1 || out.labels.size(0) != out.images.size(0))
    throw loom::DataError(fmt::format("{} has {} images but {} has {} labels", image_file.string(), out.images.size(0),
                                      label_file.string(), out.labels.numel()));
  out.labels = out.labels.to(at::kLong);
  const int64_t max_label = out.labels.max().item<int64_t>();
  if (max_label >= static_cast<int64_t>(kFashionMnistClasses.size()))
    throw loom::DataError(fmt::format("{}: label {} is outside [0, 10)", label_file.string(), max_label));
  return out;
}

}  // namespace examples::data
