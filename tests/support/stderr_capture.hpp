// tests/support/stderr_capture.hpp — captures what the process writes to stderr (file descriptor 2)
// between construction and finish(), for tests of loom's warnings.
//
// Example:
//   loom::test::StderrCapture capture;
//   run_something_that_warns();
//   CHECK(capture.finish().find("loom: warning: ...") != std::string::npos);
#pragma once

#include <cstdio>
#include <stdexcept>
#include <string>
#include <unistd.h>

namespace loom::test {

/// Redirects fd 2 to a temporary file until finish() (or destruction), which restores it and
/// returns what was written.
class StderrCapture {
 public:
  StderrCapture() {
    std::fflush(stderr);
    char name[] = "/tmp/loom-stderr-XXXXXX";
    const int fd = ::mkstemp(name);
    if (fd < 0) throw std::runtime_error("StderrCapture: mkstemp failed");
    path_ = name;
    saved_ = ::dup(2);
    ::dup2(fd, 2);
    ::close(fd);
  }
  StderrCapture(const StderrCapture&) = delete;
  StderrCapture& operator=(const StderrCapture&) = delete;
  ~StderrCapture() { (void)finish(); }

  /// Restores stderr (once) and returns everything written to it while captured.
  std::string finish() {
    if (saved_ < 0) return text_;
    std::fflush(stderr);
    ::dup2(saved_, 2);
    ::close(saved_);
    saved_ = -1;
    if (std::FILE* f = std::fopen(path_.c_str(), "r")) {
      char buf[4096];
      std::size_t n;
      while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) text_.append(buf, n);
      std::fclose(f);
    }
    std::remove(path_.c_str());
    return text_;
  }

 private:
  std::string path_, text_;
  int saved_ = -1;
};

}  // namespace loom::test
