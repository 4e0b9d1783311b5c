// libFuzzer target for the dataset readers the examples use and users copy (examples/common/data/):
// read_idx (IDX, plain or gzip), read_png (libpng's simplified API) and read_csv (RFC 4180).
//
// Input: byte 0 picks the reader (mod 3) and, for read_png, the channels (1, 3 or 4); the rest is
// the file's content, written to a file of this process (these readers take paths).
// Contract checked (a violation traps, which libFuzzer reports as a crash):
//   - a reader returns or throws loom::DataError; any other exception (std::bad_alloc from a size a
//     header claims, c10::Error) escapes and is reported as a crash, as are ASan / UBSan findings;
//   - a file's claims do not outgrow it: libFuzzer's -rss_limit_mb (scripts/fuzz.sh) reports a
//     reader that allocates what a short file's header claims;
//   - a tensor read has the shape and dtype the reader documents; a CSV table's columns all have
//     one entry per row.
// Build and run: scripts/fuzz.sh. Findings become cases of tests/examples/test_data.cpp.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>
#include <unistd.h>

#include "common/data/csv.hpp"
#include "common/data/idx.hpp"
#include "common/data/png.hpp"

namespace {

void require(bool ok) {
  if (!ok) __builtin_trap();
}

const std::filesystem::path& scratch() {
  static const std::filesystem::path p =
      std::filesystem::temp_directory_path() / ("loom-fuzz-data-" + std::to_string(::getpid()));
  return p;
}

void write(const std::uint8_t* data, std::size_t size) {
  std::FILE* f = std::fopen(scratch().c_str(), "wb");
  require(f != nullptr);
  if (size > 0) require(std::fwrite(data, 1, size, f) == size);
  std::fclose(f);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  write(data + 1, size - 1);
  try {
    switch (data[0] % 3) {
      case 0: {
        const at::Tensor t = examples::data::read_idx(scratch());
        require(t.scalar_type() == at::kByte && t.dim() >= 1 && t.dim() <= 4);
        break;
      }
      case 1: {
        const int channels = (data[0] / 3) % 3 == 0 ? 1 : (data[0] / 3) % 3 == 1 ? 3 : 4;
        const at::Tensor t = examples::data::read_png(scratch(), channels);
        require(t.scalar_type() == at::kByte && t.dim() == 3 && t.size(0) == channels);
        break;
      }
      default: {
        const examples::data::CsvTable table = examples::data::read_csv(scratch());
        for (const auto& name : table.column_names()) {
          require(table.column(name).size() == table.rows());
          try {
            (void)table.numeric_column(name);
          } catch (const loom::DataError&) {
          }
        }
        break;
      }
    }
  } catch (const loom::DataError&) {
  }
  return 0;
}
