// tests/support/temp_dir.hpp — a fresh temporary folder for one test, removed at scope exit, and
// whole-file reads and writes for what ranks leave in it.
//
// Example:
//   loom::test::TempDir dir("loom-sample");      // /tmp/loom-sample-XXXXXX, created now
//   std::ofstream(dir.path / "rank0") << "ok";   // ranks forked after this line see it too
//   CHECK(dir.read("rank0") == "ok");
//
// The folder is made with mkdtemp (a new name every time, so parallel test runs never share one)
// and removed with everything in it by the destructor of the object that created it; a forked
// rank that returns from its function without running destructors leaves it to the parent.
#pragma once

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>
#include <system_error>

#include <doctest/doctest.h>

namespace loom::test {

/// The whole content of a file ("" when it does not exist).
inline std::string read_file(const std::filesystem::path& file) {
  std::ifstream in(file);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

/// Writes `text` as the whole content of `file` (created or truncated).
inline void write_file(const std::filesystem::path& file, const std::string& text) {
  std::ofstream out(file);
  out << text;
}

/// A folder under the system's temporary directory, created by the constructor (REQUIRE fails the
/// test case when mkdtemp cannot make it) and removed with its content by the destructor.
struct TempDir {
  std::filesystem::path path;  ///< the folder, e.g. /tmp/loom-test-a1B2c3

  explicit TempDir(std::string_view prefix = "loom-test") {
    std::string templ = (std::filesystem::temp_directory_path() / (std::string(prefix) + "-XXXXXX")).string();
    REQUIRE(::mkdtemp(templ.data()) != nullptr);
    path = templ;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  /// The content of the file `name` in this folder ("" when it does not exist).
  [[nodiscard]] std::string read(const std::string& name) const { return read_file(path / name); }
};

}  // namespace loom::test
