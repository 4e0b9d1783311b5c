// loom/trace/record_file.hpp — a flight record as a text file, and back: what every rank writes
// when a loom collective fails, and what `loom-trace` and loom::trace::read_folder read.
//
// File: `<folder>/loom-trace-rank<r>.txt`, one per rank (a later failure of the same rank replaces
// it). Text, one item per line, so that `less` shows it too:
//   loom-trace 1
//   job 18c2f0a94e1d7b35
//   rank 2 world_size 4 step 41 micro_batch 0 taken_s 12.500000 wall_start_ms 1796000000000 issued_total 813
//   host node3:4711
//   reason all_reduce timed out on rank 2 after 30.001 s: ...
//   entry <seq> <op> <dtype> <numel> <context> <index> <step> <step_checked> <micro_batch> <state> <issued_s> <ended_s>
//   ...
// Tokens: op as to_string(Op), context as to_string(Context) with '_' for ' ', dtype as
// c10::toString ("Float", "Long", "Undefined" for a barrier), state as to_string(State); times in
// seconds on the rank's recorder clock (ended_s -1 while issued); step_checked 1 or 0. The job line
// (Record::job, shared by every rank of one job) is absent when the job was not known; a file
// without it reads as job "".
// A folder may hold the records of several jobs (a rank's file is replaced only by the same rank's
// next failure): select_job keeps one job's, the newest or one named.
// Errors: parse_record throws loom::DataError naming the line number and text of a malformed line;
// write_record / read_folder throw loom::Error naming the path that cannot be written or read.
#pragma once

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include <c10/core/ScalarType.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <loom/error.hpp>
#include <loom/trace/record.hpp>

namespace loom::trace {

namespace detail {

inline std::string token(Context c) {
  std::string s(to_string(c));
  std::replace(s.begin(), s.end(), ' ', '_');
  return s;
}

template <class E>
std::optional<E> from_token(std::string_view text) {
  for (int i = 0; i < static_cast<int>(E::kCount); ++i) {
    const E e = static_cast<E>(i);
    std::string name(to_string(e));
    std::replace(name.begin(), name.end(), ' ', '_');
    if (name == text) return e;
  }
  return std::nullopt;
}

inline std::optional<c10::ScalarType> dtype_from_token(std::string_view text) {
  if (text == c10::toString(c10::ScalarType::Undefined)) return c10::ScalarType::Undefined;
  for (int i = 0; i < static_cast<int>(c10::ScalarType::NumOptions); ++i) {
    const auto t = static_cast<c10::ScalarType>(i);
    if (text == c10::toString(t)) return t;
  }
  return std::nullopt;
}

}  // namespace detail

/// The file name of rank `rank`'s record: "loom-trace-rank<rank>.txt".
inline std::string record_file_name(int rank) {
  return fmt::format("loom-trace-rank{}.txt", rank);
}

/// The record as the text of its file (see the header comment).
inline std::string to_text(const Record& r) {
  std::string out = "loom-trace 1\n";
  if (!r.job.empty()) out += fmt::format("job {}\n", r.job);
  out += fmt::format("rank {} world_size {} step {} micro_batch {} taken_s {:.6f} wall_start_ms {} issued_total {}\n",
                     r.rank, r.world_size, r.step, r.micro_batch, r.taken_s, r.wall_start_ms, r.issued_total);
  std::string reason = r.reason;
  std::replace(reason.begin(), reason.end(), '\n', ' ');
  out += fmt::format("host {}\nreason {}\n", r.host, reason);
  for (const Entry& e : r.entries)
    out += fmt::format("entry {} {} {} {} {} {} {} {} {} {} {:.6f} {:.6f}\n", e.seq, to_string(e.op),
                       c10::toString(e.dtype), e.numel, detail::token(e.context), e.index, e.step,
                       e.step_checked ? 1 : 0, e.micro_batch, to_string(e.state), e.issued_s, e.ended_s);
  return out;
}

/// Parses a record file's text. `source` names it in errors.
/// Throws: loom::DataError naming the source, the line number and the line when a line is malformed.
inline Record parse_record(const std::string& text, const std::string& source = "record") {
  Record r;
  std::istringstream in(text);
  std::string line;
  int number = 0;
  bool header = false, ranks = false;
  auto bad = [&](std::string_view why) {
    return DataError(fmt::format("{}: line {} ({}): \"{}\"", source, number, why, line));
  };
  while (std::getline(in, line)) {
    ++number;
    if (line.empty()) continue;
    std::istringstream words(line);
    std::string kind;
    words >> kind;
    if (!header) {
      int version = 0;
      if (kind != "loom-trace" || !(words >> version) || version != 1) throw bad("not a loom-trace 1 record");
      header = true;
    } else if (kind == "rank") {
      std::string k[6];
      if (!(words >> r.rank >> k[0] >> r.world_size >> k[1] >> r.step >> k[2] >> r.micro_batch >> k[3] >> r.taken_s >>
            k[4] >> r.wall_start_ms >> k[5] >> r.issued_total))
        throw bad("expected rank R world_size W step S micro_batch M taken_s T wall_start_ms W issued_total N");
      ranks = true;
    } else if (kind == "job") {
      if (!(words >> r.job)) throw bad("expected job <id>");
    } else if (kind == "host") {
      r.host = line.size() > 5 ? line.substr(5) : std::string{};
    } else if (kind == "reason") {
      r.reason = line.size() > 7 ? line.substr(7) : std::string{};
    } else if (kind == "entry") {
      Entry e;
      std::string op, dtype, context, state;
      int checked = 0;
      if (!(words >> e.seq >> op >> dtype >> e.numel >> context >> e.index >> e.step >> checked >> e.micro_batch >>
            state >> e.issued_s >> e.ended_s))
        throw bad("expected 12 fields after \"entry\"");
      e.step_checked = checked != 0;
      const auto o = detail::from_token<Op>(op);
      const auto c = detail::from_token<Context>(context);
      const auto s = detail::from_token<State>(state);
      const auto d = detail::dtype_from_token(dtype);
      if (!o || !c || !s || !d) throw bad("unknown operation, context, state or dtype");
      e.op = *o;
      e.context = *c;
      e.state = *s;
      e.dtype = *d;
      r.entries.push_back(e);
    } else {
      throw bad("unknown line kind");
    }
  }
  if (!header || !ranks) throw DataError(fmt::format("{}: not a complete loom-trace record (no header line)", source));
  return r;
}

/// Writes `r` to `<folder>/loom-trace-rank<r.rank>.txt` (creating the folder) through a temporary
/// file renamed into place; returns the path. Throws loom::Error naming the path it cannot write.
inline std::filesystem::path write_record(const std::filesystem::path& folder, const Record& r) {
  std::error_code ec;
  std::filesystem::create_directories(folder, ec);
  const auto path = folder / record_file_name(r.rank);
  const auto tmp = folder / (record_file_name(r.rank) + ".tmp");
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << to_text(r);
    out.close();
    if (!out) throw Error(fmt::format("flight recorder: cannot write {}", tmp.string()));
  }
  std::filesystem::rename(tmp, path, ec);
  if (ec)
    throw Error(fmt::format("flight recorder: cannot rename {} to {}: {}", tmp.string(), path.string(), ec.message()));
  return path;
}

/// Reads every `loom-trace-rank*.txt` of `folder`, sorted by rank.
/// Throws: loom::Error when the folder cannot be read; loom::DataError for a malformed file (named).
inline std::vector<Record> read_folder(const std::filesystem::path& folder) {
  std::error_code ec;
  std::vector<Record> out;
  std::filesystem::directory_iterator it(folder, ec);
  if (ec) throw Error(fmt::format("loom-trace: cannot read the folder {}: {}", folder.string(), ec.message()));
  for (const auto& file : it) {
    const std::string name = file.path().filename().string();
    if (name.rfind("loom-trace-rank", 0) != 0 || file.path().extension() != ".txt") continue;
    std::ifstream in(file.path(), std::ios::binary);
    std::stringstream text;
    text << in.rdbuf();
    if (!in && !in.eof()) throw Error(fmt::format("loom-trace: cannot read {}", file.path().string()));
    out.push_back(parse_record(text.str(), file.path().string()));
  }
  std::sort(out.begin(), out.end(), [](const Record& a, const Record& b) { return a.rank < b.rank; });
  return out;
}

/// One job's records out of a folder's, and what was left out.
struct JobSelection {
  std::string job;              ///< the job kept ("" : records that name no job)
  std::vector<Record> records;  ///< its records, sorted by rank
  std::vector<Record> skipped;  ///< the other jobs' records, sorted by job then rank
  std::string skipped_text;     ///< e.g. "skipped 2 records of 1 other job: job 5e1f (ranks 2, 3)"; "" when none
};

/// When a record was taken, in ms since the Unix epoch (its recorder's start plus taken_s).
inline double record_time_ms(const Record& r) {
  return static_cast<double>(r.wall_start_ms) + r.taken_s * 1000.0;
}

/// Keeps the records of one job: `job` when not empty, else the job whose newest record was taken
/// last. A record without a job id ("") counts as a job of its own.
/// Throws: loom::InvalidArgument when `job` is named and no record belongs to it (the message lists
///         the jobs the records do belong to).
inline JobSelection select_job(std::vector<Record> records, const std::string& job = {}) {
  std::map<std::string, double> newest;  // job -> its newest record's time
  for (const Record& r : records) {
    auto [it, fresh] = newest.emplace(r.job, record_time_ms(r));
    if (!fresh) it->second = std::max(it->second, record_time_ms(r));
  }
  auto job_name = [](const std::string& j) { return j.empty() ? std::string("(no job id)") : "job " + j; };
  JobSelection out;
  if (!job.empty()) {
    if (!newest.count(job)) {
      std::vector<std::string> known;
      for (const auto& [j, t] : newest) known.push_back(job_name(j));
      throw InvalidArgument(fmt::format("no record of job {} (the records are of: {})", job, fmt::join(known, ", ")));
    }
    out.job = job;
  } else if (!newest.empty()) {
    out.job = std::max_element(newest.begin(), newest.end(), [](const auto& a, const auto& b) {
                return a.second < b.second;
              })->first;
  }
  for (Record& r : records) (r.job == out.job ? out.records : out.skipped).push_back(std::move(r));
  std::sort(out.records.begin(), out.records.end(), [](const Record& a, const Record& b) { return a.rank < b.rank; });
  std::sort(out.skipped.begin(), out.skipped.end(),
            [](const Record& a, const Record& b) { return std::tie(a.job, a.rank) < std::tie(b.job, b.rank); });
  if (!out.skipped.empty()) {
    std::vector<std::string> parts;
    std::size_t jobs = 0;
    for (std::size_t i = 0; i < out.skipped.size();) {
      std::vector<int> ranks;
      std::size_t k = i;
      for (; k < out.skipped.size() && out.skipped[k].job == out.skipped[i].job; ++k)
        ranks.push_back(out.skipped[k].rank);
      parts.push_back(fmt::format("{} ({} {})", job_name(out.skipped[i].job), ranks.size() == 1 ? "rank" : "ranks",
                                  fmt::join(ranks, ", ")));
      ++jobs;
      i = k;
    }
    out.skipped_text = fmt::format("skipped {} {} of {} other {}: {}", out.skipped.size(),
                                   out.skipped.size() == 1 ? "record" : "records", jobs, jobs == 1 ? "job" : "jobs",
                                   fmt::join(parts, "; "));
  }
  return out;
}

}  // namespace loom::trace
