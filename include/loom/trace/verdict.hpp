// loom/trace/verdict.hpp — the first divergence the ranks' flight records prove: which rank went
// its own way, in which collective, at which step, against what the others were doing.
//
// Example:
//   auto records = loom::trace::read_folder("runs/7/trace");
//   loom::trace::Verdict v = loom::trace::first_divergence(records, /*world_size=*/4);
//   // v.text: "rank 2 issued all_reduce #812 (reducer bucket 3, step 41, micro-batch 0, Float x 1024)
//   //          while ranks 0, 1, 3 issued all_reduce #812 (reducer bucket 0, step 42, Float x 4096)"
//
// Rule: the records are aligned by sequence number (each communicator numbers its collectives 0, 1,
// 2, ... in issue order, so the same number must be the same call on every rank). The first number,
// within what every record still holds, at which the ranks' calls differ (operation, dtype, element
// count, context, context index, step: Entry::same_call) is the divergence; a rank that has not
// issued that number at all is "not in a collective" when its last collective ended (with the time
// from that end to its record), or "still waiting in" its last one. When one group of ranks is larger
// than every other, the ranks outside it are the ones named as having gone their own way; with no
// such majority (two ranks, or a tie) every group is listed and none is blamed. Ranks with no record
// are named as such ("exited, crashed or could not reach the store").
// Units: seconds on each rank's own recorder clock (only differences within one record are printed).
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <loom/trace/record.hpp>

namespace loom::trace {

/// What first_divergence found.
struct Verdict {
  bool diverged = false;     ///< the records prove that ranks issued different collectives
  std::vector<int> ranks;    ///< the ranks that went their own way (empty when no majority or none)
  std::vector<int> missing;  ///< ranks with no record
  std::int64_t seq = -1;     ///< the sequence number of the first divergence (-1: none)
  std::int64_t step = -1;    ///< the step the first named rank was in there (-1: unknown)
  std::string text;          ///< one paragraph for an error message or a terminal
};

namespace detail {

inline std::string rank_list(const std::vector<int>& ranks) {
  return fmt::format("{} {}", ranks.size() == 1 ? "rank" : "ranks", fmt::join(ranks, ", "));
}

/// The entry of `r` with sequence number `seq`, or nullptr when the ring no longer holds it or the
/// rank never issued it.
inline const Entry* entry_at(const Record& r, std::int64_t seq) {
  if (r.entries.empty()) return nullptr;
  const std::int64_t first = r.entries.front().seq;
  if (seq < first || seq - first >= static_cast<std::int64_t>(r.entries.size())) return nullptr;
  return &r.entries[static_cast<std::size_t>(seq - first)];
}

/// What a rank that did not issue `seq` was doing when its record was taken.
inline std::string idle_text(const Record& r, std::int64_t seq) {
  if (r.entries.empty())
    return fmt::format("rank {} did not issue #{}: it had issued no collective yet (step {})", r.rank, seq, r.step);
  const Entry& last = r.entries.back();
  switch (last.state) {
    case State::issued:
      return fmt::format("rank {} did not issue #{}: it was still waiting in {} ({:.3f} s after issuing it)", r.rank,
                         seq, describe(last), r.taken_s - last.issued_s);
    case State::failed:
      return fmt::format("rank {} did not issue #{}: its last collective, {}, failed", r.rank, seq, describe(last));
    default:
      return fmt::format(
          "rank {} did not issue #{}: it was not in a collective (last collective {} at step {}, ended {:.3f} s before "
          "its record was taken; now at step {})",
          r.rank, seq, describe(last), last.step, r.taken_s - last.ended_s, r.step);
  }
}

/// The same Entry without the micro-batch, for a group's shared description.
inline Entry without_micro_batch(Entry e) {
  e.micro_batch = -1;
  return e;
}

}  // namespace detail

/// The first sequence number at which two of `records` hold entries of different calls, or -1. Unlike
/// first_divergence it ignores ranks that have not issued a number yet, so records taken at
/// different times (a rank's older record) never make a false conflict: a number's call never changes.
inline std::int64_t first_conflict(const std::vector<Record>& records) {
  std::int64_t lo = 0, hi = -1;
  for (const Record& r : records) {
    if (r.entries.empty()) continue;
    lo = std::max(lo, r.entries.front().seq);
    hi = std::max(hi, r.entries.back().seq);
  }
  for (std::int64_t s = lo; s <= hi; ++s) {
    const Entry* first = nullptr;
    for (const Record& r : records) {
      const Entry* e = detail::entry_at(r, s);
      if (e == nullptr) continue;
      if (first == nullptr)
        first = e;
      else if (!first->same_call(*e))
        return s;
    }
  }
  return -1;
}

/// The first divergence of `records` (one per rank that wrote one; any order) in a job of
/// `world_size` ranks. See the header comment for the rule.
inline Verdict first_divergence(std::vector<Record> records, int world_size) {
  Verdict v;
  std::sort(records.begin(), records.end(), [](const Record& a, const Record& b) { return a.rank < b.rank; });
  std::vector<bool> present(static_cast<std::size_t>(std::max(world_size, 0)), false);
  for (const Record& r : records)
    if (r.rank >= 0 && r.rank < world_size) present[static_cast<std::size_t>(r.rank)] = true;
  for (int q = 0; q < world_size; ++q)
    if (!present[static_cast<std::size_t>(q)]) v.missing.push_back(q);
  const std::string missing_text =
      v.missing.empty() ? std::string{}
                        : fmt::format("{} wrote no record (exited, crashed or could not reach the store)",
                                      detail::rank_list(v.missing));
  if (records.empty()) {
    v.text = "no rank wrote a flight record";
    return v;
  }

  std::int64_t lo = 0, hi = -1;
  for (const Record& r : records) {
    lo = std::max(lo, r.entries.empty() ? r.issued_total : r.entries.front().seq);
    hi = std::max(hi, r.issued_total - 1);
  }
  for (std::int64_t s = lo; s <= hi; ++s) {
    // Group the ranks by what they issued at s (nullptr: nothing).
    std::vector<std::pair<const Entry*, std::vector<int>>> groups;
    std::map<int, const Record*> by_rank;
    for (const Record& r : records) {
      by_rank[r.rank] = &r;
      const Entry* e = detail::entry_at(r, s);
      auto g = std::find_if(groups.begin(), groups.end(), [&](const auto& grp) {
        return (grp.first == nullptr && e == nullptr) || (grp.first && e && grp.first->same_call(*e));
      });
      if (g == groups.end())
        groups.push_back({e, {r.rank}});
      else
        g->second.push_back(r.rank);
    }
    if (groups.size() < 2) continue;
    std::stable_sort(groups.begin(), groups.end(),
                     [](const auto& a, const auto& b) { return a.second.size() > b.second.size(); });
    v.diverged = true;
    v.seq = s;
    auto what = [&](const auto& grp, bool blamed) {
      if (grp.first == nullptr) {
        std::vector<std::string> parts;
        for (int q : grp.second) parts.push_back(detail::idle_text(*by_rank[q], s));
        return fmt::format("{}", fmt::join(parts, "; "));
      }
      const Entry shown = blamed && grp.second.size() == 1 ? *detail::entry_at(*by_rank[grp.second[0]], s)
                                                           : detail::without_micro_batch(*grp.first);
      return fmt::format("{} issued {}", detail::rank_list(grp.second), describe(shown));
    };
    const bool majority = groups[0].second.size() > groups[1].second.size();
    std::vector<std::string> parts;
    for (std::size_t g = majority ? 1 : 0; g < groups.size(); ++g) parts.push_back(what(groups[g], majority));
    if (majority) {
      for (std::size_t g = 1; g < groups.size(); ++g)
        v.ranks.insert(v.ranks.end(), groups[g].second.begin(), groups[g].second.end());
      std::sort(v.ranks.begin(), v.ranks.end());
      const int first = groups[1].second.front();
      const Entry* e = detail::entry_at(*by_rank[first], s);
      v.step =
          e ? e->step : (by_rank[first]->entries.empty() ? by_rank[first]->step : by_rank[first]->entries.back().step);
      v.text = fmt::format("first divergence at collective #{}: {} while {}", s, fmt::join(parts, "; "),
                           what(groups[0], false));
    } else {
      v.text = fmt::format("first divergence at collective #{}, with no majority: {}", s, fmt::join(parts, "; "));
    }
    if (!missing_text.empty()) v.text += "; " + missing_text;
    return v;
  }

  // The same calls everywhere: say who waits where.
  std::vector<std::string> waits;
  for (const Record& r : records)
    if (!r.entries.empty() && r.entries.back().state != State::completed)
      waits.push_back(
          fmt::format("rank {}: {} {}", r.rank, describe(r.entries.back()), to_string(r.entries.back().state)));
  v.ranks = v.missing;
  v.text =
      fmt::format("no divergence in the records: every rank that wrote one issued the same collectives, up to #{}", hi);
  if (!waits.empty()) v.text += fmt::format(" ({})", fmt::join(waits, "; "));
  if (!missing_text.empty()) v.text += "; " + missing_text;
  return v;
}

}  // namespace loom::trace
