// loom/log/sink.hpp — where log lines and progress output go: the LogSink concept ladder (LogSink,
// then TerminalSink) and three models (a C stream such as stdout, a file of its own, an in-memory
// buffer for tests).
//
// Example:
//   loom::MemorySink mem;                        // copies share one buffer
//   loom::Logger log{mem, loom::RankInfo{}};     // rank 0 of 1
//   log.info("epoch {} done", 3);
//   // mem.text() == "epoch 3 done\n"
//
// A sink receives whole lines in one `write` call, so a line from one process is never split by
// another's on the same terminal or pipe. Guide: docs/log.md#sinks-logsink-terminalsink.
// Source: the split of formatting from output follows spdlog's sinks (a sink only writes bytes);
// terminal detection is isatty(3) as in tqdm and Python's sys.stdout.isatty().
#pragma once

#include <atomic>
#include <cerrno>
#include <concepts>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <unistd.h>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include <loom/error.hpp>

namespace loom {

/// Something that takes finished log text.
///
/// Requirements:
///  1. `s.write(text)` with a std::string_view: appends `text` as is (it already ends with '\n',
///     or is a progress-bar redraw starting with '\r'). Reason: formatting happens once, in the
///     logger; a sink only moves bytes, so any destination (socket, ring buffer) is a few lines.
///  2. `s.flush()`: pushes buffered text to its destination. Reason: a crash right after a log
///     line must not lose it; the logger flushes after warnings and errors.
/// Not required: thread safety (a Logger is used from one thread), copyability (FileSink owns
/// its file and is move-only), a virtual base (sinks are template parameters).
template <class S>
concept LogSink = requires(S& s, std::string_view text) {
  s.write(text);
  s.flush();
};

/// A LogSink that can say whether it writes to an interactive terminal.
///
/// Requirements (in addition to LogSink):
///  1. `s.is_terminal()` -> bool, without side effects. Reason: Progress draws a live bar with
///     '\r' only on a terminal; in a file or CI log it writes one plain line every N seconds.
/// A LogSink without is_terminal() is treated as "not a terminal".
template <class S>
concept TerminalSink = LogSink<S> && requires(const S& s) {
  { s.is_terminal() } -> std::convertible_to<bool>;
};

/// Writes to a C stream it does not own (stdout by default) and flushes after every write.
///
/// Example:
///   loom::StreamSink err{stderr};
///   err.write("hello\n");
///
/// Each write is one fwrite followed by fflush, so whole lines reach the pipe in one piece.
/// Throws: loom::InvalidArgument when constructed with a null stream.
class StreamSink {
 public:
  explicit StreamSink(std::FILE* stream = stdout) : stream_(stream) {
    if (stream_ == nullptr) throw InvalidArgument("StreamSink: the stream is null");
  }

  void write(std::string_view text) {
    std::fwrite(text.data(), 1, text.size(), stream_);
    std::fflush(stream_);
  }
  void flush() { std::fflush(stream_); }

  /// True when the stream is an interactive terminal (isatty on its file descriptor).
  [[nodiscard]] bool is_terminal() const noexcept {
    const int fd = ::fileno(stream_);
    return fd >= 0 && ::isatty(fd) == 1;
  }

 private:
  std::FILE* stream_;
};

/// Owns a file and appends log text to it; move-only.
///
/// Example:
///   auto sink = loom::FileSink::per_rank("logs/train.{rank}.log", ranks.rank);  // one file per rank
///   loom::Logger log{std::move(sink), loom::AllRanks{.with_prefix = false}, ranks};
///
/// Every write is flushed (a log must survive a crash of the training process).
/// Throws: loom::InvalidArgument naming the path and the system's reason when the file cannot be
///         opened; naming the pattern when per_rank's pattern has no {rank} or does not format.
class FileSink {
 public:
  enum class Mode { truncate, append };

  explicit FileSink(const std::string& path, Mode mode = Mode::truncate)
      : file_(std::fopen(path.c_str(), mode == Mode::append ? "a" : "w")), path_(path) {
    if (file_ == nullptr)
      throw InvalidArgument(fmt::format("FileSink: cannot open log file '{}': {}", path, std::strerror(errno)));
  }

  /// A FileSink at `pattern` with "{rank}" replaced by `rank` (e.g. "train.{rank}.log" -> "train.1.log").
  [[nodiscard]] static FileSink per_rank(std::string_view pattern, int rank, Mode mode = Mode::truncate) {
    if (pattern.find("{rank}") == std::string_view::npos)
      throw InvalidArgument(fmt::format(
          "FileSink::per_rank: the pattern '{}' has no {{rank}}, so every rank would write the same file", pattern));
    std::string path;
    try {
      path = fmt::format(fmt::runtime(pattern), fmt::arg("rank", rank));
    } catch (const fmt::format_error& e) {
      throw InvalidArgument(fmt::format("FileSink::per_rank: the pattern '{}' does not format: {}", pattern, e.what()));
    }
    return FileSink(path, mode);
  }

  FileSink(FileSink&& other) noexcept : file_(std::exchange(other.file_, nullptr)), path_(std::move(other.path_)) {}
  FileSink& operator=(FileSink&& other) noexcept {
    if (this != &other) {
      close();
      file_ = std::exchange(other.file_, nullptr);
      path_ = std::move(other.path_);
    }
    return *this;
  }
  FileSink(const FileSink&) = delete;
  FileSink& operator=(const FileSink&) = delete;
  ~FileSink() { close(); }

  void write(std::string_view text) {
    LOOM_ASSERT(file_ != nullptr, "write to a moved-from FileSink");
    std::fwrite(text.data(), 1, text.size(), file_);
    std::fflush(file_);
  }
  void flush() {
    if (file_ != nullptr) std::fflush(file_);
  }
  [[nodiscard]] bool is_terminal() const noexcept { return false; }

  /// The path the file was opened at.
  [[nodiscard]] const std::string& path() const noexcept { return path_; }

 private:
  void close() noexcept {
    if (file_ != nullptr) std::fclose(std::exchange(file_, nullptr));
  }

  std::FILE* file_;
  std::string path_;
};

/// Keeps everything written in memory; copies share one buffer (keep a copy, hand one to a Logger).
///
/// Example:
///   loom::MemorySink mem;
///   mem.write("a\nb\n");
///   // mem.lines() == {"a", "b"}
///
/// `MemorySink{true}` claims to be a terminal, to test the live progress bar.
class MemorySink {
 public:
  explicit MemorySink(bool terminal = false) : state_(std::make_shared<State>()), terminal_(terminal) {}

  void write(std::string_view text) {
    state_->text.append(text);
    ++state_->writes;
  }
  void flush() noexcept {}
  [[nodiscard]] bool is_terminal() const noexcept { return terminal_; }

  /// Everything written so far, verbatim.
  [[nodiscard]] const std::string& text() const noexcept { return state_->text; }
  /// The text split at '\n' (a last line without '\n' is included; the empty tail is not).
  [[nodiscard]] std::vector<std::string> lines() const {
    std::vector<std::string> out;
    std::string_view rest = state_->text;
    while (!rest.empty()) {
      const auto nl = rest.find('\n');
      out.emplace_back(rest.substr(0, nl));
      if (nl == std::string_view::npos) break;
      rest.remove_prefix(nl + 1);
    }
    return out;
  }
  /// Number of write calls made so far (through any copy).
  [[nodiscard]] int writes() const noexcept { return state_->writes; }
  void clear() {
    state_->text.clear();
    state_->writes = 0;
  }

 private:
  struct State {
    std::string text;
    int writes = 0;
  };
  std::shared_ptr<State> state_;
  bool terminal_;
};

static_assert(TerminalSink<StreamSink>, "StreamSink must model TerminalSink");
static_assert(TerminalSink<FileSink>, "FileSink must model TerminalSink");
static_assert(TerminalSink<MemorySink>, "MemorySink must model TerminalSink");

namespace detail {

/// Whether a Progress bar was drawn on a terminal and its line not ended ('\r' redraws leave the
/// cursor on the bar's line): a Logger line written to a terminal now starts with
/// kReplaceBarLine, so it replaces the bar instead of continuing its line (the bar is drawn again,
/// on the next line, at its next redraw), as tqdm.write does. Set and cleared by Progress.
inline std::atomic<bool>& bar_line_open() noexcept {
  static std::atomic<bool> open{false};
  return open;
}

/// Carriage return and "erase to the end of the line": what replaces an open bar's line.
inline constexpr std::string_view kReplaceBarLine = "\r\x1b[K";

}  // namespace detail

}  // namespace loom
