// Tests of the examples' data readers (examples/common/data/): PNG decoding, the icon folder dataset
// and its split, IDX files, CSV files.
// Expected values are written by the test itself (pixels, IDX bytes, CSV cells) or are published
// facts about Debian's data (Fashion-MNIST has 6,000 training images per class).
#include <cstdio>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <doctest/doctest.h>
#include <fmt/format.h>
#include <png.h>
#include <zlib.h>

#include "../../examples/common/data/csv.hpp"
#include "../../examples/common/data/icons.hpp"
#include "../../examples/common/data/idx.hpp"
#include "../../examples/common/data/png.hpp"
#include "support/temp_dir.hpp"

namespace test_data {

namespace fs = std::filesystem;
namespace data = examples::data;

namespace {

using loom::test::TempDir;

/// Writes an 8-bit RGBA PNG of w x h pixels with libpng; pixel (x, y) = fn(x, y) -> {r, g, b, a}.
template <class Fn>
void write_png(const fs::path& file, int w, int h, Fn fn) {
  fs::create_directories(file.parent_path());
  std::vector<unsigned char> rgba(static_cast<std::size_t>(4 * w * h));
  for (int y = 0; y < h; ++y)
    for (int x = 0; x < w; ++x) {
      auto px = fn(x, y);
      for (int c = 0; c < 4; ++c) rgba[static_cast<std::size_t>(4 * (y * w + x) + c)] = px[c];
    }
  png_image img{};
  img.version = PNG_IMAGE_VERSION;
  img.width = static_cast<png_uint_32>(w);
  img.height = static_cast<png_uint_32>(h);
  img.format = PNG_FORMAT_RGBA;
  REQUIRE(png_image_write_to_file(&img, file.c_str(), 0, rgba.data(), 0, nullptr) != 0);
}

void write_bytes(const fs::path& file, const std::string& bytes) {
  fs::create_directories(file.parent_path());
  std::ofstream(file, std::ios::binary) << bytes;
}

std::string read_bytes(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_gz(const fs::path& file, const std::vector<unsigned char>& bytes) {
  gzFile f = gzopen(file.c_str(), "wb");
  REQUIRE(f != nullptr);
  REQUIRE(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())) == static_cast<int>(bytes.size()));
  gzclose(f);
}

std::array<unsigned char, 4> px(int r, int g, int b, int a) {
  return {static_cast<unsigned char>(r), static_cast<unsigned char>(g), static_cast<unsigned char>(b),
          static_cast<unsigned char>(a)};
}

}  // namespace

TEST_SUITE("data") {
  TEST_CASE("read_png: pixels, channel modes, and errors naming the file") {
    TempDir tmp;
    const fs::path file = tmp.path / "img.png";
    // pixel (x, y): r = 10x, g = 20y, b = 200, a = 255 at x = 0, else 51 (0.2).
    write_png(file, 3, 2, [](int x, int y) { return px(10 * x, 20 * y, 200, x == 0 ? 255 : 51); });

    auto rgba = data::read_png(file, 4);
    REQUIRE((rgba.sizes() == at::IntArrayRef({4, 2, 3})));
    CHECK((rgba.scalar_type() == at::kByte));
    CHECK(rgba[0][1][2].item<int>() == 20);
    CHECK(rgba[1][1][2].item<int>() == 20);
    CHECK(rgba[2][0][0].item<int>() == 200);
    CHECK(rgba[3][0][0].item<int>() == 255);
    CHECK(rgba[3][0][1].item<int>() == 51);

    auto rgb = data::read_png(file, 3);
    REQUIRE((rgb.sizes() == at::IntArrayRef({3, 2, 3})));
    CHECK(rgb[2][0][0].item<int>() == 200);  // alpha 255: unchanged
    CHECK(rgb[2][0][1].item<int>() == 40);   // 200 * 51 / 255 = 40
    CHECK(rgb[0][1][2].item<int>() == 4);    // 20 * 51 / 255 = 4
    auto alpha = data::read_png(file, 1);
    CHECK((alpha.sizes() == at::IntArrayRef({1, 2, 3})));
    CHECK(alpha[0][1][1].item<int>() == 51);

    CHECK_THROWS_AS(data::read_png(file, 2), loom::InvalidArgument);
    CHECK_THROWS_WITH_AS(data::read_png(tmp.path / "missing.png"), doctest::Contains("missing.png: no such PNG file"),
                         loom::DataError);
    write_bytes(tmp.path / "text.png", "this is not a png file at all");
    CHECK_THROWS_WITH_AS(data::read_png(tmp.path / "text.png"), doctest::Contains("text.png: cannot read PNG"),
                         loom::DataError);
    // A real PNG cut in half: the header reads, the pixel data does not.
    const std::string whole = read_bytes(file);
    write_bytes(tmp.path / "cut.png", whole.substr(0, whole.size() / 2));
    CHECK_THROWS_WITH_AS(data::read_png(tmp.path / "cut.png"), doctest::Contains("cut.png"), loom::DataError);
    // A 57-byte PNG whose header claims 1000000 x 1000000 pixels (libpng's own limit): decoding it
    // would allocate 4e12 bytes before finding the data missing. The claim is checked against what
    // the file can hold.
    auto chunk = [](const std::string& type, const std::string& body) {
      std::string out;
      for (int k = 3; k >= 0; --k) out += static_cast<char>((body.size() >> (8 * k)) & 0xff);
      const std::string typed = type + body;
      const auto crc = crc32(0, reinterpret_cast<const Bytef*>(typed.data()), static_cast<uInt>(typed.size()));
      out += typed;
      for (int k = 3; k >= 0; --k) out += static_cast<char>((crc >> (8 * k)) & 0xff);
      return out;
    };
    const std::string million("\x00\x0f\x42\x40", 4);  // 1000000, big-endian
    write_bytes(tmp.path / "claims.png", std::string("\x89PNG\r\n\x1a\n", 8) +
                                             chunk("IHDR", million + million + std::string("\x08\x06\x00\x00\x00", 5)) +
                                             chunk("IDAT", std::string("\x78\x9c\x03\x00\x00\x00\x00\x01", 8)) +
                                             chunk("IEND", ""));
    CHECK_THROWS_WITH_AS(data::read_png(tmp.path / "claims.png"),
                         doctest::Contains("claims.png: the PNG header claims 1000000 x 1000000 pixels"),
                         loom::DataError);
  }

  TEST_CASE("IconFolder: labels by context, own sizes, corrupt files throw or are skipped and counted") {
    TempDir tmp;
    const fs::path root = tmp.path / "theme";
    write_png(root / "16x16" / "status" / "b-symbolic.symbolic.png", 16, 16, [](int, int) { return px(0, 0, 0, 255); });
    write_png(root / "16x16" / "actions" / "a.png", 16, 16, [](int, int) { return px(255, 0, 0, 255); });
    write_png(root / "32x32" / "actions" / "a.png", 32, 32, [](int, int) { return px(0, 255, 0, 128); });
    write_bytes(root / "scalable" / "actions" / "ignored.png", "not read: not an NxN folder");
    write_bytes(root / "16x16" / "actions" / "notes.txt", "not a png: ignored");

    data::IconFolder icons({.root = root, .channels = 3});
    REQUIRE(icons.size() == 3);
    CHECK(icons.classes() == std::vector<std::string>{"actions", "status"});
    // Order: (size, context, file): 16/actions/a, 16/status/b, 32/actions/a.
    auto s0 = icons.get(0);
    CHECK(s0.name == "a");
    CHECK(s0.label == 0);
    CHECK((s0.image.sizes() == at::IntArrayRef({3, 16, 16})));
    CHECK((s0.image.scalar_type() == at::kFloat));
    CHECK(s0.image[0][5][5].item<float>() == doctest::Approx(1.0));
    CHECK(icons.get(1).name == "b-symbolic");
    CHECK(icons.get(1).label == 1);
    auto s2 = icons.get(2);
    CHECK((s2.image.sizes() == at::IntArrayRef({3, 32, 32})));
    CHECK(s2.image[1][0][0].item<float>() == doctest::Approx(128.0 / 255.0));  // 255 * 128 / 255
    CHECK_THROWS_AS((void)icons.get(3), loom::InvalidArgument);

    data::IconFolder only16({.root = root, .sizes = {16}, .contexts = {"status", "actions"}});
    CHECK(only16.size() == 2);
    CHECK(only16.classes() == std::vector<std::string>{"status", "actions"});
    CHECK(only16.label(0) == 1);  // 16/actions/a.png: "actions" is label 1 in the given order

    // A corrupt file: the default throws and names it; skip warns once, counts it, and keeps the rest.
    write_bytes(root / "16x16" / "status" / "broken.png", "\x89PNG\r\n\x1a\n but then garbage");
    CHECK_THROWS_WITH_AS(data::IconFolder({.root = root}), doctest::Contains("broken.png"), loom::DataError);
    std::vector<std::string> warnings;
    data::IconFolder skipping({.root = root, .on_corrupt = data::OnCorrupt::skip, .warn = [&](std::string_view m) {
                                 warnings.emplace_back(m);
                               }});
    CHECK(skipping.size() == 3);
    REQUIRE(skipping.skipped().size() == 1);
    CHECK((skipping.skipped()[0].path.filename() == "broken.png"));
    REQUIRE(warnings.size() == 1);
    CHECK(warnings[0].find("broken.png") != std::string::npos);

    CHECK_THROWS_WITH_AS(data::IconFolder({.root = tmp.path / "no-such-theme"}),
                         doctest::Contains("no-such-theme: icon folder does not exist"), loom::DataError);
    CHECK_THROWS_WITH_AS(data::IconFolder({.root = root, .sizes = {64}}), doctest::Contains("no PNG icons"),
                         loom::DataError);
  }

  TEST_CASE("split_by_name: the sizes of one icon never straddle; deterministic; fraction respected") {
    TempDir tmp;
    const fs::path root = tmp.path / "theme";
    for (int i = 0; i < 200; ++i)
      for (int s : {8, 16})
        write_png(root / fmt::format("{}x{}", s, s) / (i % 2 ? "actions" : "status") / fmt::format("icon{}.png", i), s,
                  s, [](int, int) { return px(1, 2, 3, 4); });
    data::IconFolder icons({.root = root, .channels = 1});
    REQUIRE(icons.size() == 400);
    auto split = data::split_by_name(icons, 0.25, 7);
    CHECK(split.train.size() + split.val.size() == 400);
    std::set<std::string> train_names, val_names;
    for (auto i : split.train) train_names.insert(icons.name(static_cast<std::size_t>(i)));
    for (auto i : split.val) val_names.insert(icons.name(static_cast<std::size_t>(i)));
    for (const auto& n : val_names) CHECK(train_names.count(n) == 0);
    CHECK(val_names.size() + train_names.size() == 200);
    CHECK(split.val.size() == 2 * val_names.size());  // both sizes of every validation name
    // 200 names, p = 0.25: mean 50, standard deviation ~6.1; [25, 75] is beyond 4 sigma.
    CHECK(val_names.size() >= 25);
    CHECK(val_names.size() <= 75);
    auto again = data::split_by_name(icons, 0.25, 7);
    CHECK((again.val == split.val));
    auto other_seed = data::split_by_name(icons, 0.25, 8);
    CHECK((other_seed.val != split.val));
    CHECK(data::split_by_name(icons, 0.0, 7).val.empty());
    CHECK(data::split_by_name(icons, 1.0, 7).train.empty());
    CHECK_THROWS_AS(data::split_by_name(icons, 1.5, 7), loom::InvalidArgument);
  }

  TEST_CASE("IconFolder on Debian's Adwaita theme, when installed") {
    const fs::path root = "/usr/share/icons/Adwaita";
    if (!fs::is_directory(root / "16x16")) {
      MESSAGE("adwaita-icon-theme not installed: skipped");
      return;
    }
    data::IconFolder icons({.root = root, .sizes = {16, 32}});
    CHECK(icons.size() > 1000);
    CHECK(icons.skipped().empty());
    for (std::size_t i = 0; i < icons.size(); i += 97) {
      const auto& p = icons.pixels(i);
      CHECK(p.size(0) == 4);
      CHECK((p.size(1) == 16 || p.size(1) == 32));
    }
    auto split = data::split_by_name(icons, 0.2, 1);
    std::set<std::string> train_names;
    for (auto i : split.train) train_names.insert(icons.name(static_cast<std::size_t>(i)));
    for (auto i : split.val) CHECK(train_names.count(icons.name(static_cast<std::size_t>(i))) == 0);
  }

  TEST_CASE("read_idx: gzipped and plain IDX files; errors name the file") {
    TempDir tmp;
    // 2 x 3 images (dims 2, 1, 3): bytes 0..5.
    std::vector<unsigned char> idx = {0, 0, 0x08, 3, 0, 0, 0, 2, 0, 0, 0, 1, 0, 0, 0, 3, 0, 1, 2, 3, 4, 5};
    write_gz(tmp.path / "a.idx.gz", idx);
    auto t = data::read_idx(tmp.path / "a.idx.gz");
    REQUIRE((t.sizes() == at::IntArrayRef({2, 1, 3})));
    CHECK(t[1][0][2].item<int>() == 5);
    write_bytes(tmp.path / "a.idx", std::string(idx.begin(), idx.end()));
    CHECK(at::equal(data::read_idx(tmp.path / "a.idx"), t));

    std::vector<unsigned char> cut(idx.begin(), idx.end() - 2);
    write_gz(tmp.path / "cut.idx.gz", cut);
    CHECK_THROWS_WITH_AS(data::read_idx(tmp.path / "cut.idx.gz"),
                         doctest::Contains("cut.idx.gz: truncated: the data needs 6 bytes"), loom::DataError);
    std::vector<unsigned char> floats = idx;
    floats[2] = 0x0D;
    write_gz(tmp.path / "float.idx.gz", floats);
    CHECK_THROWS_WITH_AS(data::read_idx(tmp.path / "float.idx.gz"),
                         doctest::Contains("float.idx.gz: IDX data type 0x0d"), loom::DataError);
    CHECK_THROWS_WITH_AS(data::read_idx(tmp.path / "none.gz"), doctest::Contains("none.gz: no such file"),
                         loom::DataError);
    CHECK_THROWS_WITH_AS(data::read_fashion_mnist(tmp.path / "nowhere", data::MnistSplit::test),
                         doctest::Contains("nowhere: Fashion-MNIST folder does not exist"), loom::DataError);
    // fuzz (build-fuzz/findings/fuzz_data_files-crash-fbee82b3...): a 19-byte file whose header claims
    // 140566624 x 33554432 bytes made the reader allocate 4.7e15 bytes (a c10::Error, not a
    // DataError). The data is read as it comes, so the file's end is what stops it.
    const std::string claims("\x00\x00\x08\x02\x08\x60\xe0\x60\x02\x00\x00\x00\x00\x00\x00", 15);
    write_bytes(tmp.path / "claims.idx", claims);
    CHECK_THROWS_WITH_AS(data::read_idx(tmp.path / "claims.idx"),
                         doctest::Contains("claims.idx: truncated: the data needs 4716633226477568 bytes, the file "
                                           "ends after 3"),
                         loom::DataError);
    // Four dimensions of 2^32 - 1: a size no int64 holds.
    write_bytes(tmp.path / "huge.idx", std::string("\x00\x00\x08\x04", 4) + std::string(16, '\xff'));
    CHECK_THROWS_WITH_AS(data::read_idx(tmp.path / "huge.idx"),
                         doctest::Contains("huge.idx: IDX dimensions 4294967295 x 4294967295 x 4294967295 x "
                                           "4294967295 exceed 2^63 bytes"),
                         loom::DataError);
    // A folder with images but no labels names the labels file.
    write_gz(tmp.path / "t10k-images-idx3-ubyte.gz", idx);
    CHECK_THROWS_WITH_AS(data::read_fashion_mnist(tmp.path, data::MnistSplit::test),
                         doctest::Contains("t10k-labels-idx1-ubyte.gz: no such file"), loom::DataError);
  }

  TEST_CASE("read_fashion_mnist on Debian's dataset-fashion-mnist, when installed") {
    if (!fs::is_directory(data::kDebianFashionMnistDir)) {
      MESSAGE("dataset-fashion-mnist not installed: skipped");
      return;
    }
    auto train = data::read_fashion_mnist(data::kDebianFashionMnistDir, data::MnistSplit::train);
    CHECK((train.images.sizes() == at::IntArrayRef({60000, 28, 28})));
    CHECK((train.labels.scalar_type() == at::kLong));
    // Published fact: the training set is balanced, 6,000 images per class.
    auto counts = at::bincount(train.labels);
    REQUIRE(counts.numel() == 10);
    for (int c = 0; c < 10; ++c) CHECK(counts[c].item<int64_t>() == 6000);
    auto test = data::read_fashion_mnist(data::kDebianFashionMnistDir, data::MnistSplit::test);
    CHECK(test.images.size(0) == 10000);
  }

  TEST_CASE("read_csv: quoting, numbers, grouping; empty column and bad cells name the file") {
    TempDir tmp;
    const fs::path file = tmp.path / "series.csv";
    write_bytes(file,
                "name,value,note,blank\r\n"
                "a,1.5,\"x, with comma\",\n"
                "\n"
                "b,-2,\"say \"\"hi\"\"\",\n"
                "a,+3e2,,\n");
    auto t = data::read_csv(file);
    CHECK(t.rows() == 3);
    CHECK(t.column_names() == std::vector<std::string>{"name", "value", "note", "blank"});
    CHECK(t.column("note")[0] == "x, with comma");
    CHECK(t.column("note")[1] == "say \"hi\"");
    CHECK(t.numeric_column("value") == std::vector<double>{1.5, -2.0, 300.0});
    auto by = t.numeric_columns_by("name", "value");
    CHECK(by.at("a") == std::vector<double>{1.5, 300.0});
    CHECK(by.at("b") == std::vector<double>{-2.0});

    CHECK_THROWS_WITH_AS((void)t.numeric_column("blank"), doctest::Contains("series.csv: column 'blank' is empty"),
                         loom::DataError);
    CHECK_THROWS_WITH_AS((void)t.numeric_column("name"),
                         doctest::Contains("series.csv:2: column 'name' holds 'a', which is not a number"),
                         loom::DataError);
    CHECK_THROWS_WITH_AS((void)t.numeric_column("note"), doctest::Contains("series.csv:2: column 'note'"),
                         loom::DataError);
    CHECK_THROWS_WITH_AS((void)t.column("nope"), doctest::Contains("series.csv: no column 'nope'"), loom::DataError);

    write_bytes(tmp.path / "header-only.csv", "date,temp\n");
    auto h = data::read_csv(tmp.path / "header-only.csv");
    CHECK(h.rows() == 0);
    CHECK_THROWS_WITH_AS((void)h.numeric_column("temp"), doctest::Contains("header-only.csv: column 'temp' is empty"),
                         loom::DataError);
    write_bytes(tmp.path / "gap.csv", "temp\n1\n \n3\n");
    CHECK_THROWS_WITH_AS((void)data::read_csv(tmp.path / "gap.csv").numeric_column("temp"),
                         doctest::Contains("gap.csv:3: column 'temp' has a blank cell"), loom::DataError);
    write_bytes(tmp.path / "ragged.csv", "a,b\n1,2\n3\n");
    CHECK_THROWS_WITH_AS(data::read_csv(tmp.path / "ragged.csv"),
                         doctest::Contains("ragged.csv:3: 1 fields, but the header has 2 columns"), loom::DataError);
    write_bytes(tmp.path / "empty.csv", "");
    CHECK_THROWS_WITH_AS(data::read_csv(tmp.path / "empty.csv"), doctest::Contains("empty.csv: empty CSV file"),
                         loom::DataError);
    CHECK_THROWS_WITH_AS(data::read_csv(tmp.path / "absent.csv"), doctest::Contains("absent.csv: no such CSV file"),
                         loom::DataError);
  }

  TEST_CASE("vega-datasets CSV files, when present") {
    fs::path dir;
    try {
      dir = data::find_vega_datasets({LOOM_SOURCE_ROOT});
    } catch (const loom::DataError& e) {
      MESSAGE("vega-datasets not found: skipped (" << e.what() << ")");
      return;
    }
    auto employment = data::read_csv(dir / "us-employment.csv");
    CHECK(employment.rows() == 120);
    CHECK(employment.column_names().size() == 24);
    CHECK(employment.numeric_column("nonfarm")[0] == 135450.0);  // first row of the file: 2006-01-01
    auto stocks = data::read_csv(dir / "stocks.csv").numeric_columns_by("symbol", "price");
    CHECK(stocks.size() == 5);
    CHECK(stocks.at("MSFT")[0] == doctest::Approx(39.81));
    CHECK(data::read_csv(dir / "seattle-temps.csv").numeric_column("temp").size() == 8759);
  }

}  // TEST_SUITE("data")

}  // namespace test_data
