// loom/log/logger.hpp — a rank-aware logger: levels, {fmt} formatting, a RankPolicy that decides
// which ranks write and with which prefix, and a LogSink that receives whole lines.
//
// Example:
//   auto me = loom::rank_info(loom::Environment::from_env());
//   loom::Logger log{loom::StreamSink{stdout}, me};                  // rank 0 only (the default)
//   log.info("epoch {} loss {:.4f}", epoch, loss);                   // "epoch 3 loss 0.7529"
//   loom::Logger dbg{loom::StreamSink{stderr}, loom::AllRanks{}, me};
//   dbg.warning("{} samples skipped", n);                            // "[rank 1/4] warning: 2 samples skipped"
//   loom::Logger ord{loom::StreamSink{}, loom::RankOrdered{}, me};
//   ord.info("shard {}", shard);  ord.sync(comm);                     // rank 0 prints ranks 0,1,2,... in turn
//
// Cost: on a rank whose policy does not emit, or below the level, a call is one comparison.
// Throws: format strings are checked at compile time (fmt::format_string); at run time only what
//         the sink throws, and loom::InvalidArgument for an out-of-range RankInfo.
// Guide: docs/log.md#rank-policies-rankpolicy.
// Source: levels and `{}` formatting as in spdlog / Python logging; rank filtering as in
//         Accelerate's `get_logger(..., main_process_only=True)`.
#pragma once

#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include <loom/comm/communicator.hpp>
#include <loom/comm/host_values.hpp>
#include <loom/log/rank.hpp>
#include <loom/log/sink.hpp>
#include <loom/trace/recorder.hpp>

namespace loom {

/// Severity of a log line; a Logger drops lines below its level. `off` silences everything.
enum class LogLevel { debug, info, warning, error, off };

/// Name of a LogLevel ("debug", "info", "warning", "error", "off").
constexpr std::string_view to_string(LogLevel level) noexcept {
  switch (level) {
    case LogLevel::debug: return "debug";
    case LogLevel::info: return "info";
    case LogLevel::warning: return "warning";
    case LogLevel::error: return "error";
    case LogLevel::off: return "off";
  }
  return "?";
}

/// Options of a Logger (an aggregate: `loom::LogOptions{.level = loom::LogLevel::debug}`).
struct LogOptions {
  LogLevel level = LogLevel::info;  ///< lines below this level are dropped
};

/// Writes formatted lines to `Sink` on the ranks `Policy` selects.
///
/// Example:
///   loom::MemorySink mem;
///   loom::Logger log{mem, loom::AllRanks{}, loom::RankInfo{.rank = 1, .world_size = 2}};
///   log.info("loss {:.2f}", 0.5);   // mem.text() == "[rank 1/2] loss 0.50\n"
///
/// Not thread-safe: log from one thread, or give each thread its own Logger.
/// Throws: loom::InvalidArgument from the constructor when `me` is out of range (RankInfo::validate).
template <LogSink Sink = StreamSink, RankPolicy Policy = RankZero>
class Logger {
 public:
  /// A logger with the given policy.
  Logger(Sink sink, Policy policy, RankInfo me, LogOptions options = {})
      : sink_(std::move(sink)), policy_(std::move(policy)), me_(me), level_(options.level) {
    me_.validate();
    emits_ = static_cast<bool>(policy_.emits(me_));
    prefix_ = policy_.prefix(me_);
  }
  /// A logger with the default policy (Policy{}, i.e. RankZero unless named).
  Logger(Sink sink, RankInfo me, LogOptions options = {}) : Logger(std::move(sink), Policy{}, me, options) {}
  /// A logger for the rank an Environment or a ProcessGroup describes (see rank_info).
  /// Example: `loom::Logger log(loom::StreamSink{stdout}, pg);`
  /// (Unconstrained so that class template argument deduction works with GCC 12; a `who` that
  /// loom::rank_info cannot read fails in the initializer below.)
  template <class Who>
  Logger(Sink sink, const Who& who, LogOptions options = {})
      : Logger(std::move(sink), Policy{}, ::loom::rank_info(who), options) {}

  Logger(Logger&& other) noexcept(
      std::is_nothrow_move_constructible_v<Sink>&& std::is_nothrow_move_constructible_v<Policy>)
      : sink_(std::move(other.sink_)),
        policy_(std::move(other.policy_)),
        me_(other.me_),
        level_(other.level_),
        emits_(other.emits_),
        prefix_(std::move(other.prefix_)),
        pending_(std::exchange(other.pending_, {})) {}
  Logger& operator=(Logger&&) = delete;
  Logger(const Logger&) = delete;
  Logger& operator=(const Logger&) = delete;

  /// RankOrdered: lines never synced are written to this rank's own sink, so none is lost.
  ~Logger() {
    if (!pending_.empty()) {
      try {
        sink_.write(pending_);
        sink_.flush();
      } catch (...) {  // a destructor must not throw; the lines are lost only if the sink fails
      }
    }
  }

  /// This process's rank changed (an elastic job's ranks are renumbered after a rank died,
  /// docs/elastic.md): the policy decides again who writes, with the new prefix.
  /// Example: `trainer.on_recovery([&](const loom::Recovery&) { log.set_rank(loom::rank_info(pg)); });`
  /// Throws: loom::InvalidArgument when `me` is out of range (RankInfo::validate).
  void set_rank(RankInfo me) {
    me.validate();
    me_ = me;
    emits_ = static_cast<bool>(policy_.emits(me_));
    prefix_ = policy_.prefix(me_);
  }

  /// True when a line at `level` would be written (or buffered) on this rank.
  /// Use it to skip computing expensive arguments: `if (log.enabled(loom::LogLevel::debug)) ...`.
  [[nodiscard]] bool enabled(LogLevel level) const noexcept {
    return emits_ && level != LogLevel::off && level >= level_;
  }

  /// Formats and writes one message at `level` (one line per '\n'-separated part).
  template <class... Args>
  void log(LogLevel level, fmt::format_string<Args...> format, Args&&... args) {
    if (!enabled(level)) return;
    write_message(level, fmt::format(format, std::forward<Args>(args)...));
  }

  template <class... Args>
  void debug(fmt::format_string<Args...> format, Args&&... args) {
    log(LogLevel::debug, format, std::forward<Args>(args)...);
  }
  template <class... Args>
  void info(fmt::format_string<Args...> format, Args&&... args) {
    log(LogLevel::info, format, std::forward<Args>(args)...);
  }
  template <class... Args>
  void warning(fmt::format_string<Args...> format, Args&&... args) {
    log(LogLevel::warning, format, std::forward<Args>(args)...);
  }
  template <class... Args>
  void error(fmt::format_string<Args...> format, Args&&... args) {
    log(LogLevel::error, format, std::forward<Args>(args)...);
  }

  /// Writes an already formatted message at `level` (no {fmt} processing of `message`).
  void write_message(LogLevel level, std::string_view message) {
    if (!enabled(level)) return;
    std::string text;
    text.reserve(message.size() + prefix_.size() + 16);
    const std::string_view tag = level_tag(level);
    for (;;) {
      const auto nl = message.find('\n');
      text.append(prefix_).append(tag).append(message.substr(0, nl)).push_back('\n');
      if (nl == std::string_view::npos || nl + 1 == message.size()) break;
      message.remove_prefix(nl + 1);
    }
    if constexpr (OrderedRankPolicy<Policy>) {
      pending_.append(text);
    } else {
      write_line(std::move(text));
      if (level >= LogLevel::warning) sink_.flush();
    }
  }

  /// A collective under RankOrdered: every rank calls it at the same point; rank 0 then writes
  /// every rank's lines since the last sync, rank 0's first, then rank 1's, ... (two all_gathers).
  /// Under other policies it only flushes the sink and communicates nothing.
  ///
  /// Throws: what the communicator throws (loom::TimeoutError when a rank never calls sync);
  ///         loom::InvalidArgument when comm's rank / world size differ from this logger's RankInfo.
  template <Communicator C>
  void sync(C& comm) {
    if constexpr (OrderedRankPolicy<Policy>) {
      if (comm.rank() != me_.rank || comm.world_size() != me_.world_size)
        throw InvalidArgument(fmt::format("Logger::sync: the communicator is rank {} of {}, the logger rank {} of {}",
                                          comm.rank(), comm.world_size(), me_.rank, me_.world_size));
      trace::Scope scope(comm, trace::Context::logger);
      std::vector<std::string> all = detail::all_gather_strings(comm, pending_);
      pending_.clear();
      if (me_.rank == 0) {
        std::string text;
        for (const auto& part : all) text.append(part);
        if (!text.empty()) write_line(text);
      }
    }
    sink_.flush();
  }

  [[nodiscard]] LogLevel level() const noexcept { return level_; }
  void set_level(LogLevel level) noexcept { level_ = level; }
  /// Whether this rank writes at all under the policy.
  [[nodiscard]] bool emits() const noexcept { return emits_; }
  [[nodiscard]] const RankInfo& rank_info() const noexcept { return me_; }
  [[nodiscard]] const Policy& policy() const noexcept { return policy_; }
  [[nodiscard]] Sink& sink() noexcept { return sink_; }
  [[nodiscard]] const Sink& sink() const noexcept { return sink_; }

 private:
  /// Writes whole lines; on a terminal where a Progress bar's line is open, replaces that line first.
  void write_line(std::string text) {
    if constexpr (TerminalSink<Sink>) {
      if (sink_.is_terminal() && detail::bar_line_open().exchange(false)) text.insert(0, detail::kReplaceBarLine);
    }
    sink_.write(text);
  }

  static constexpr std::string_view level_tag(LogLevel level) noexcept {
    switch (level) {
      case LogLevel::debug: return "debug: ";
      case LogLevel::warning: return "warning: ";
      case LogLevel::error: return "error: ";
      default: return "";
    }
  }

  Sink sink_;
  Policy policy_;
  RankInfo me_;
  LogLevel level_;
  bool emits_ = false;
  std::string prefix_;
  std::string pending_;  // RankOrdered: lines since the last sync
};

template <class Sink>
Logger(Sink, RankInfo) -> Logger<Sink, RankZero>;
template <class Sink>
Logger(Sink, RankInfo, LogOptions) -> Logger<Sink, RankZero>;
template <class Sink, class Policy>
Logger(Sink, Policy, RankInfo) -> Logger<Sink, Policy>;
template <class Sink, class Policy>
Logger(Sink, Policy, RankInfo, LogOptions) -> Logger<Sink, Policy>;

}  // namespace loom
